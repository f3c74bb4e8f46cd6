"""``--method auto``: per round, the drafting source with the best expected tokens per second.

The sources: n-gram drafts from the context (:mod:`.pld`); quantized full-depth chains
(:mod:`.specqd`: the model's own weights as int8 or the GGUF's own blocks); layer-skip
drafts with this model's calibrated Self-SD skip set when one exists (else ASD's
per-prompt set, which needs no artifact), over the same quantized weights; and none (a
plain step). With ``hybrid`` (the default) the quantized and layer-skip chains carry the
n-gram continuation as a second branch of one verified tree. Before each round every source's planner
(:mod:`selfspec_cli.decoding.planning`) gives the best expected gain over plain decoding at
its measured draft cost and acceptance; the round goes to the source with the highest
gain, which then plans its own draft length (and may still decline or probe). Each
source keeps its own acceptance statistics, updated by its own rounds; the n-gram planners
also by the n-gram branch of hybrid rounds (a verified n-gram draft), so that n-gram drafts
stay measured while a quantized chain wins the rounds (a source that never drafts would
keep its prior forever).

Lossless: whichever source drafts, the driver verifies with the exact rules.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..decoding.choose import Choose, Option
from ..decoding.drafts import Chain, Draft, LayerSkipNote, NoDraft, Round, Tree, depth
from ..decoding.state import DecodeState
from ..engine import Engine, ForwardOutput
from ..errors import ArtifactError, FieldError
from . import fr_spec
from .asd import ASD
from .base import (AUTO_PRECISION_HELP, DRAFT_PRECISIONS, LayerSkipMethod, SelfProposing, method_precision, option, require,
                   resolve_precision)
from .pld import PLDConfig, PromptLookup
from .self_sd import SelfSD, SkipSet
from .specqd import SpecQD


@dataclass(frozen=True)
class AutoConfig:
    ngram_only: bool = option(False, "n-gram drafts only, no layer-skip or quantized drafts")
    draft_precision: str = option("auto", f"weights of the quantized and layer-skip drafts: {AUTO_PRECISION_HELP}, "
                                          "int8, int8-g32, gguf, w4a8, or target (no quantized chains)")
    hybrid: bool = option(True, "when layer-skip drafts are chosen, merge the n-gram continuation into the same "
                                "tree (--no-hybrid: one source per round)")

    def __post_init__(self) -> None:
        require(self.draft_precision in DRAFT_PRECISIONS, "draft_precision", f"one of {', '.join(DRAFT_PRECISIONS)}",
                self.draft_precision)
        if self.ngram_only and self.draft_precision != "auto":
            raise FieldError("ngram_only/draft_precision", "conflict: n-gram drafts read no weights, so a draft "
                                                           "precision would be ignored; drop one of them")


class Auto(SelfProposing):
    name = "auto"
    lossless = True
    description = ("auto: per round the best of n-gram drafts, quantized chains, layer-skip drafts and none, by "
                   "expected tokens/s")
    Config = AutoConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None,
                 layer_skip: LayerSkipMethod | None = None, quant: LayerSkipMethod | None = None,
                 pld: PromptLookup | None = None) -> None:
        super().__init__(engine, tokenizer, config)
        self.pld = pld or PromptLookup(engine, tokenizer, PLDConfig())
        self.layer_skip = layer_skip
        self.quant = quant
        options = [Option("ngram", self.pld)]
        options += [Option(name, m.proposer) for name, m in (("layer_skip", layer_skip), ("quant", quant)) if m is not None]
        self.choice = Choose(options)
        self.lookahead = self.choice.lookahead
        self.curve = self.pld.curve  # the driver's round clock reads it when a decode starts
        self.rounds: Counter[str] = Counter()
        self._ngram_n = 0  # the order of this round's n-gram lookup (0: none)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None) -> Auto:
        config = config or AutoConfig()
        pld = PromptLookup(engine, tokenizer, PLDConfig())
        if config.ngram_only:
            return cls(engine, tokenizer, config, pld=pld)
        ngram = pld if config.hybrid else None  # hybrid trees (decoding/hybrid.py)
        layer_skip: LayerSkipMethod | None = None
        quant: LayerSkipMethod | None = None
        precision = resolve_precision(engine, config.draft_precision)
        if precision is not None:
            quant = SpecQD(engine, tokenizer, weights=precision, vocab=fr_spec.draft_vocab(engine, precision), ngram=ngram)
        try:
            skip = SkipSet.load(None, engine.model)
        except ArtifactError:  # no calibrated set for this model: ASD's per-prompt set
            skip = None
        ls_precision = method_precision(engine, config.draft_precision, skip.draft_precision if skip else None)
        # a calibrated empty skip set is the quantized chain itself: one source
        if skip is None or skip.attn or skip.mlp or ls_precision != precision:
            # the quantized full-depth chain is a source of its own here: no full-depth choice inside this one
            parts = {"weights": ls_precision, "ngram": ngram, "weigh_full_depth": False,
                     "vocab": fr_spec.draft_vocab(engine, ls_precision)}  # FR-Spec's draft vocabulary when calibrated
            layer_skip = ASD(engine, tokenizer, **parts) if skip is None else SelfSD(engine, tokenizer, skip=skip, **parts)
        return cls(engine, tokenizer, config, layer_skip, quant, pld)

    def prefill_options(self) -> dict[str, Any]:
        return self.choice.prefill_options()

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.rounds = Counter()
        self.choice.begin(state, prefill)

    def propose(self, state: DecodeState, budget: int) -> Draft:
        self._ngram_n = self.pld.candidate(state, budget)[1]
        source = self.choice.pick(state, budget)
        if source is None:
            self.rounds["none"] += 1
            return NoDraft()
        draft = source.propose(state, budget)
        self.rounds[self.choice.last_name if depth(draft) else "none"] += 1
        self.curve = self.pld.curve
        return draft

    def update(self, state: DecodeState, rnd: Round) -> None:
        self.choice.update(state, rnd)
        note = rnd.draft.note if isinstance(rnd.draft, (Chain, Tree)) else None
        path = note.ngram_path if isinstance(note, LayerSkipNote) else None
        if self.choice.last is not self.pld and path and self._ngram_n:
            # the n-gram branch of a hybrid round is a verified n-gram draft: its planner learns from it too
            self.pld.planner(self._ngram_n).observe(len(path), len(set(path) & set(rnd.verdict.accepted)))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_rounds": dict(self.rounds), "ngram": self.pld.describe()}
        if self.layer_skip is not None:
            out["layer_skip"] = {"method": self.layer_skip.name, **self.layer_skip.describe()}
        if self.quant is not None:
            out["quant"] = self.quant.describe()
        return out
