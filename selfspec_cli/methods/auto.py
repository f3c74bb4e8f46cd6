"""``--method auto``: per round, the drafting source with the best expected tokens per second.

The sources: n-gram drafts from the context (prompt lookup's, decoding/ngram.py); quantized full-depth chains
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

The method has a drafter (:class:`AutoDrafter`) and a policy (the choice among the sources'
policies, :class:`~selfspec_cli.decoding.choose.BestOf`); each source is a drafter with its own
policy, never a method. Lossless: whichever source drafts, the driver verifies with the exact rules.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..decoding.choose import BestOf, Choose, Option
from ..decoding.drafts import Chain, Draft, LayerSkipNote, NoDraft, Round, Tree, depth
from ..decoding.ngram import NgramDrafter, NgramLookup, NgramPolicy, NgramReport
from ..decoding.output import DraftReport, flat, optional
from ..decoding.state import DecodeState
from ..engine import Engine, ForwardOutput
from ..errors import ArtifactError, FieldError
from . import fr_spec
from .asd import ASD
from .base import (AUTO_PRECISION_HELP, DRAFT_PRECISIONS, DraftInputs, LayerSkipMethod, Method, method_precision, option,
                   require, resolve_precision)
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


@dataclass(frozen=True, slots=True)
class MethodReport(DraftReport):
    """A source method's name and its drafter's report (its keys written after the name)."""

    method: str
    report: DraftReport = flat()


@dataclass(frozen=True, slots=True)
class AutoReport(DraftReport):
    """``auto``'s report: the rounds each source drafted, the n-gram source's report, and the layer-skip
    and quantized sources' (absent where ``auto`` has none)."""

    auto_rounds: dict[str, int]
    ngram: NgramReport
    layer_skip: MethodReport | None = optional()
    quant: DraftReport | None = optional()


class AutoDrafter:
    """``auto``'s drafter: the source its choice (:class:`~selfspec_cli.decoding.choose.BestOf`)
    picks drafts; it counts the rounds each source drafted, and feeds the n-gram branch of a
    hybrid round to the n-gram policy (a verified n-gram draft)."""

    def __init__(self, choice: Choose, ngram: NgramDrafter, layer_skip: Method | None, quant: Method | None) -> None:
        self.choice, self.ngram, self.layer_skip, self.quant = choice, ngram, layer_skip, quant
        self.lookahead, self.taps = choice.lookahead, choice.taps
        self.rounds: Counter[str] = Counter()
        self._ngram_n = 0  # the order of this round's n-gram lookup (0: none)

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.rounds = Counter()
        self.choice.begin(state, prefill)

    def draft(self, state: DecodeState, budget: int) -> Draft:
        self._ngram_n = self.ngram.source.candidate(state, budget)[1]
        option = self.choice.best.pick(state, budget)
        if option is None:
            self.rounds["none"] += 1
            return NoDraft()
        draft = option.drafter.draft(state, budget)
        self.rounds[option.name if depth(draft) else "none"] += 1
        return draft

    def accept(self, state: DecodeState, rnd: Round) -> None:
        self.choice.accept(state, rnd)
        note = rnd.draft.note if isinstance(rnd.draft, (Chain, Tree)) else None
        path = note.ngram_path if isinstance(note, LayerSkipNote) else None
        last = self.choice.best.last
        if (last is None or last.drafter is not self.ngram) and path and self._ngram_n:
            # the n-gram branch of a hybrid round is a verified n-gram draft: its planner learns from it too
            self.ngram.policy.observe(self._ngram_n, len(path), len(set(path) & set(rnd.verdict.accepted)))

    def end(self) -> AutoReport:
        return AutoReport(dict(self.rounds), self.ngram.end(),
                          None if self.layer_skip is None else MethodReport(self.layer_skip.name, self.layer_skip.describe()),
                          None if self.quant is None else self.quant.describe())


class Auto(Method):
    """Has an :class:`AutoDrafter` over its sources (prompt lookup's n-gram drafter, and the
    layer-skip and quantized methods' stacks), and the choice among them as its policy."""

    name = "auto"
    lossless = True
    description = ("auto: per round the best of n-gram drafts, quantized chains, layer-skip drafts and none, by "
                   "expected tokens/s")
    Config = AutoConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None,
                 layer_skip: Method | None = None, quant: Method | None = None,
                 ngram: NgramDrafter | None = None) -> None:
        super().__init__(engine, tokenizer, config)
        self.ngram = ngram or ngram_drafter(engine)
        self.layer_skip = layer_skip
        self.quant = quant
        options = [Option("ngram", self.ngram, self.ngram.policy)]
        options += [Option(name, m.drafter, m.policy) for name, m in (("layer_skip", layer_skip), ("quant", quant))
                    if m is not None]
        self.policy = BestOf(options)
        self.drafter = AutoDrafter(Choose(self.policy), self.ngram, layer_skip, quant)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: AutoConfig | None = None) -> Auto:
        config = config or AutoConfig()
        ngram = ngram_drafter(engine)
        if config.ngram_only:
            return cls(engine, tokenizer, config, ngram=ngram)
        branch = ngram.source if config.hybrid else None  # hybrid trees (decoding/hybrid.py)
        layer_skip: LayerSkipMethod | None = None
        quant: LayerSkipMethod | None = None
        precision = resolve_precision(engine, config.draft_precision)
        if precision is not None:
            quant = SpecQD(engine, tokenizer, inputs=DraftInputs(precision, fr_spec.draft_vocab(engine, precision), branch))
        try:
            skip = SkipSet.load(None, engine.model)
        except ArtifactError:  # no calibrated set for this model: ASD's per-prompt set
            skip = None
        ls_precision = method_precision(engine, config.draft_precision, skip.draft_precision if skip else None)
        # a calibrated empty skip set is the quantized chain itself: one source
        if skip is None or skip.attn or skip.mlp or ls_precision != precision:
            # the quantized full-depth chain is a source of its own here: no full-depth choice inside this one;
            # FR-Spec's draft vocabulary when calibrated
            inputs = DraftInputs(ls_precision, fr_spec.draft_vocab(engine, ls_precision), branch)
            layer_skip = (ASD(engine, tokenizer, inputs=inputs, weigh_full_depth=False) if skip is None
                          else SelfSD(engine, tokenizer, skip=skip, inputs=inputs, weigh_full_depth=False))
        return cls(engine, tokenizer, config, layer_skip, quant, ngram)


def ngram_drafter(engine: Engine) -> NgramDrafter:
    """``auto``'s n-gram source: prompt lookup's lookup with its defaults, planned (decoding/ngram.py)."""
    lookup = NgramLookup()
    return NgramDrafter(lookup, NgramPolicy(engine, lookup, lookup.max_draft))
