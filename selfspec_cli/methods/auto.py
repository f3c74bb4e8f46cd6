"""``--method auto``: per round, the drafting source with the best expected tokens per second.

The sources: n-gram drafts from the context (:mod:`.pld`); quantized full-depth chains
(:mod:`.specqd`: the model's own weights as int8 or the GGUF's own blocks); layer-skip
drafts with this model's calibrated Self-SD skip set when one exists (else ASD's
per-prompt set, which needs no artifact), over the same quantized weights; and none (a
plain step). With ``hybrid`` (the default) the quantized and layer-skip chains carry the
n-gram continuation as a second branch of one verified tree. Before each round every source's planner
(:mod:`selfspec_cli.decoding.cost`) gives the best expected gain over plain decoding at
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

from ..decoding.drafts import Chain, Draft, NoDraft, Round, Tree, depth
from ..decoding.driver import Proposer
from ..decoding.layer_skip import LayerSkipProposer
from ..decoding.state import DecodeState
from ..engine import Engine, ForwardOutput
from ..errors import ArtifactError, FieldError
from . import fr_spec
from .asd import ASD
from .base import DRAFT_PRECISIONS, Method, method_precision, option, require, resolve_precision
from .pld import PLDConfig, PromptLookup
from .self_sd import SelfSD, SkipSet
from .specqd import SpecQD


@dataclass(frozen=True)
class AutoConfig:
    ngram_only: bool = option(False, "n-gram drafts only, no layer-skip or quantized drafts")
    draft_precision: str = option("auto", "weights of the quantized and layer-skip drafts: auto (the GGUF's own "
                                          "blocks when the model came from one, else int8), int8, int8-g32, gguf, or "
                                          "target (no quantized chains)")
    hybrid: bool = option(True, "when layer-skip drafts are chosen, merge the n-gram continuation into the same "
                                "tree (--no-hybrid: one source per round)")

    def __post_init__(self) -> None:
        require(self.draft_precision in DRAFT_PRECISIONS, "draft_precision", f"one of {', '.join(DRAFT_PRECISIONS)}",
                self.draft_precision)
        if self.ngram_only and self.draft_precision != "auto":
            raise FieldError("ngram_only/draft_precision", "conflict: n-gram drafts read no weights, so a draft "
                                                           "precision would be ignored; drop one of them")


class Auto(Method):
    name = "auto"
    lossless = True
    description = ("auto: per round the best of n-gram drafts, quantized chains, layer-skip drafts and none, by "
                   "expected tokens/s")
    Config = AutoConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None,
                 layer_skip: LayerSkipProposer | None = None, quant: LayerSkipProposer | None = None) -> None:
        super().__init__(engine, tokenizer, config)
        self.pld = PromptLookup(engine, tokenizer, PLDConfig())
        self.layer_skip = layer_skip
        self.quant = quant
        for source in (layer_skip, quant):
            if source is not None and self.config.hybrid:
                source.ngram = self.pld.candidate  # hybrid trees (decoding/layer_skip.py)
        self.needs_attn_cosine = bool(layer_skip and layer_skip.needs_attn_cosine)
        self.lookahead = max(source.lookahead for source in (self.pld, layer_skip, quant) if source is not None)
        self.rounds: Counter[str] = Counter()
        self._last: Proposer | None = None
        self._turn = 0
        self._ngram_n = 0  # the order of this round's n-gram lookup (0: none)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None) -> Auto:
        config = config or AutoConfig()
        layer_skip: LayerSkipProposer | None = None
        quant: LayerSkipProposer | None = None
        if not config.ngram_only:
            precision = resolve_precision(engine, config.draft_precision)
            if precision is not None:
                quant = SpecQD(engine, tokenizer)
                quant.use_precision(precision)
                fr_spec.attach(quant, engine.model)
            try:
                layer_skip = SelfSD(engine, tokenizer, skip=SkipSet.load(None, engine.model))
            except ArtifactError:  # no calibrated set for this model: ASD's per-prompt set
                layer_skip = ASD(engine, tokenizer)
            ls_precision = method_precision(engine, config.draft_precision, getattr(layer_skip, "artifact_precision", None))
            if isinstance(layer_skip, SelfSD) and not any(layer_skip.skip_sets()) and ls_precision == precision:
                layer_skip = None  # a calibrated empty skip set is the quantized chain itself: one source
            else:
                layer_skip.full_depth_variant = False  # the quantized full-depth chain is a source of its own here
                layer_skip.use_precision(ls_precision)
                fr_spec.attach(layer_skip, engine.model)  # FR-Spec's draft vocabulary when calibrated
        return cls(engine, tokenizer, config, layer_skip, quant)

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.rounds = Counter()
        for source in (self.pld, self.layer_skip, self.quant):
            if source is not None:
                source.begin(state, prefill)

    def propose(self, state: DecodeState, budget: int) -> Draft:
        options: list[tuple[float, str, Proposer]] = []
        cont, n = self.pld.candidate(state, budget)
        self._ngram_n = n
        if cont:
            options.append((self.pld.planner(n).best(0.0, len(cont))[1], "ngram", self.pld))
        for source, drafts in (("layer_skip", self.layer_skip), ("quant", self.quant)):
            if drafts is not None and budget > 0:
                options.append((drafts.expected_gain(budget), source, drafts))
        if not options:
            self._last = None
            self.rounds["none"] += 1
            return NoDraft()
        if max(g for g, _, _ in options) <= 1.0 and len(options) > 1:
            # no source pays: let them take turns, so that each one's own probes can still run
            self._turn = (self._turn + 1) % len(options)
            _, source, proposer = options[self._turn]
        else:
            _, source, proposer = max(options, key=lambda o: o[0])
        self._last = proposer
        draft = proposer.propose(state, budget)
        self.rounds[source if depth(draft) else "none"] += 1
        self.curve = self.pld.curve or getattr(self.layer_skip, "curve", None) or getattr(self.quant, "curve", None)
        return draft

    def update(self, state: DecodeState, rnd: Round) -> None:
        if self._last is not None:
            self._last.update(state, rnd)
        path = getattr(rnd.draft.note, "ngram_path", None) if isinstance(rnd.draft, (Chain, Tree)) else None
        if self._last is not self.pld and path and self._ngram_n:
            # the n-gram branch of a hybrid round is a verified n-gram draft: its planner learns from it too
            self.pld.planner(self._ngram_n).observe(len(path), len(set(path) & set(rnd.verdict.accepted)))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_rounds": dict(self.rounds), "ngram": self.pld.describe()}
        if self.layer_skip is not None:
            out["layer_skip"] = {"method": self.layer_skip.name, **self.layer_skip.describe()}
        if self.quant is not None:
            out["quant"] = self.quant.describe()
        return out
