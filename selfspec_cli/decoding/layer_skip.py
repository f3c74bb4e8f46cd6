"""The layer-skip drafter shared by Self-SD, SWIFT, ASD and SpecQD: one configuration.

A :class:`LayerSkipDrafter` is a skip set (attention and MLP sublayers that add nothing to
the residual stream and write no K/V; chosen by a :class:`SkipSource`: fixed, per prompt or
searched while decoding), the weights its forwards read (None: the target's own; else the
quantized copy of engine/quant.py) and the vocabulary its head scores (FR-Spec; None: all).
SpecQD is the drafter with no skips on quantized weights; nothing about it is a special case.

A round, gpt-fast style: draft with the target itself over its own KV cache with that
configuration, one token at a time from the pending token, until the planned length is
reached or the draft's confidence drops below the threshold (that last token is still
kept). The driver then drops the draft K/V, verifies the pending token plus the drafts at
full depth, as a chain or as SWIFT's candidate tree (top-k siblings per depth, chosen by
confidence), and keeps the accepted K/V.

Each round the drafter first asks its policy (:class:`~.policy.LengthPolicy`, a separate
object) how far to draft: with ``cost_aware`` (the default) how far drafting pays at the
measured draft cost and acceptance, none when it does not pay; the drafter only draws. What a
configuration's draft forward reads is a :class:`DraftModel`, built (quantized copy, subset
head) before the drafter, and each draft runs as one engine :class:`~selfspec_cli.engine.route.Route`
(:meth:`DraftModel.route`; no forward option is passed any other way); nothing here times a forward.
Choosing between configurations (a skip set, or full depth on the same
quantized weights) is :mod:`.choose`'s; merging an n-gram branch is :mod:`.hybrid`'s; a skip
source that adapts sees every round through :class:`Adapting`. Greedy drafts are the draft's
argmax; sampled chain drafts are drawn from the draft's processed distribution and handed to
the driver with their laws, so the driver's speculative-sampling rule is exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..engine import Engine, ForwardOutput, Route
from .choose import BestOf, Choose, Option
from .drafts import Chain, Draft, LayerSkipNote, NoDraft, Plan, Round, Tree, chain_or_tree
from .driver import Delegating, Drafter, Taps
from .output import NO_REPORT, DraftReport, Merged, flat, optional
from .policy import CostModelReport, LengthPolicy
from .sampling import processed_scores, sample_from
from .state import DecodeState

PAPER_TREE_TOPK = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How drafts are made and verified.

    ``max_draft``: at most this many draft tokens per round. ``threshold``: initial
    draft-exit threshold (stop after a token whose draft confidence is below it).
    ``adaptive``: Draft & Verify's adaptive threshold. ``tree``: SWIFT's dynamic
    verification; ``tree_topk`` maps confidence bins (upper bounds) to the number of
    candidates kept at a depth; ``tree_max_nodes`` caps the candidate nodes of one tree
    (None: no cap, the paper's GPU setting). On a CPU every verified row costs a few
    per cent of a step, so a large tree can cost more than it wins.
    """

    max_draft: int = 12
    threshold: float = 0.6
    adaptive: bool = True
    tree: bool = False
    tree_topk: tuple[tuple[float, int], ...] = PAPER_TREE_TOPK
    tree_max_nodes: int | None = None
    cost_aware: bool = True  # plan each round's draft length from measured costs (decoding/planning.py)
    kv_window: tuple[int, int] | None = None  # (sinks, window): drafts attend to those keys only (engine/runner.py)

    @property
    def lookahead(self) -> int:
        """Most cache slots a round of these drafts writes past the pending token."""
        return self.max_draft if not self.tree else (self.tree_max_nodes or 64)

    def topk_for(self, confidence: float) -> int:
        return next((k for upper, k in self.tree_topk if confidence <= upper), self.tree_topk[-1][1])


@dataclass(slots=True)
class AdaptiveThreshold:
    """Draft & Verify (Zhang et al. 2024) draft-exit threshold, carried across prompts:
    acceptance EMA ``m <- 0.5 m + 0.5 (accepted / drafted)``; candidate
    ``th' = th + 0.01`` if ``m < 0.9`` else ``th - 0.01`` (unchanged when the draft hit
    its length limit, since the threshold did not end it); ``th <- 0.9 th + 0.1 th'``."""

    value: float
    ema: float = 1.0
    target: float = 0.9
    step: float = 0.01

    def update(self, accepted: int, drafted: int, hit_limit: bool) -> None:
        """After a round that drafted ``drafted > 0`` tokens."""
        self.ema = 0.5 * self.ema + 0.5 * (accepted / drafted)
        if hit_limit:
            return
        cand = self.value + self.step if self.ema < self.target else self.value - self.step
        self.value = min(1.0, max(0.0, 0.9 * self.value + 0.1 * cand))


@dataclass(frozen=True, slots=True)
class FullDepthReport(DraftReport):
    """Full depth on a quantized configuration's weights, as weighed against its skip set
    (:class:`SkipOrFullDepth`): the rounds it drafted and its cost model."""

    rounds: int
    cost_model: CostModelReport


@dataclass(frozen=True, slots=True)
class LayerSkipReport(DraftReport):
    """A layer-skip drafter's report (its ``end()``): its skip set, draft weights (``"target"``: the target's
    own), verification, draft-exit threshold, draft vocabulary (``"full"``: all rows), its cost model (absent:
    unplanned), full depth's where a choice weighed it (:class:`SkipOrFullDepth`), and what an adapting skip
    source says of itself (:meth:`SkipSource.describe`, its keys written flat)."""

    skip_attn: list[int]
    skip_mlp: list[int]
    draft_precision: str
    verify: str
    draft_threshold: float
    draft_vocab: int | str
    cost_model: CostModelReport | None = optional()
    full_depth: FullDepthReport | None = optional()
    source: DraftReport | None = flat(omit=True, default=None)


SkipPair = tuple[frozenset[int], frozenset[int]]
NO_SKIPS: SkipPair = (frozenset(), frozenset())


class SkipSource:
    """What chooses a drafter's skip set: fixed (Self-SD, SpecQD's none), per prompt (ASD),
    searched while decoding (SWIFT). A source that ``adapts`` sees every round of the stack
    it drafts in (:class:`Adapting`): ``begin`` after each prefill, ``update`` after each
    round (``own``: the round was drafted with this source's set)."""

    adapts = False
    needs_attn_cosine = False  # the prefill reports per-layer attention cosines (ASD)

    def sets(self) -> SkipPair:
        raise NotImplementedError

    def never_skips(self) -> bool:
        """Whether every layer always runs (the drafter is the full-depth model on its weights)."""
        return False

    def begin(self, state: DecodeState, prefill: Any) -> None:
        pass

    def update(self, state: DecodeState, rnd: Round, own: bool) -> None:
        pass

    def describe(self) -> DraftReport:
        """What the source says of itself in its drafter's report (:class:`LayerSkipReport`'s ``source``)."""
        return NO_REPORT


@dataclass(frozen=True)
class FixedSkips(SkipSource):
    """A skip set fixed for the drafter's life (none: all layers)."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    def sets(self) -> SkipPair:
        return self.attn, self.mlp

    def never_skips(self) -> bool:
        return not (self.attn or self.mlp)


@dataclass(slots=True)
class Drafted:
    """What one layer-skip draft made: its tokens (and parents, for a tree), the laws of sampled
    chain tokens, the draft forwards run and whether it ran to its limit (no confidence exit)."""

    tokens: list[int]
    parents: list[int] | None
    q: torch.Tensor | None
    steps: int
    hit_limit: bool


@dataclass(frozen=True, eq=False)
class DraftModel:
    """What one layer-skip configuration's draft forward reads: the skip sets its source
    chooses, ``weights`` (None: the target's own; else the quantized copy of engine/quant.py) and
    the vocabulary its head scores (``vocab_ids``, their index on the device and the subset head;
    None: the whole vocabulary). Built once by :meth:`build`, which makes the quantized copy and
    the subset head (no forward is timed); read by the drafter and priced by its policy."""

    skips: SkipSource
    weights: str | None = None
    vocab_ids: list[int] | None = None
    vocab_index: torch.Tensor | None = None
    vocab_head: Any = None

    @classmethod
    def build(cls, engine: Engine, skips: SkipSource = FixedSkips(), weights: str | None = None,
              vocab: torch.Tensor | None = None) -> DraftModel:
        if weights is not None:
            engine.quantized(weights)  # the quantized copy is built (or read from its disk cache) now
        if vocab is None or int(vocab.numel()) >= engine.vocab_size:
            return cls(skips, weights)
        ids = vocab.to(torch.int64)
        return cls(skips, weights, ids.tolist(), ids.to(engine.device), engine.subset_head(ids, weights))

    def skip_sets(self) -> SkipPair:
        return self.skips.sets()

    def route(self, kv_window: tuple[int, int] | None = None) -> Route:
        """What a draft forward of this configuration computes (engine/route.py), with the source's current
        skip sets and the draft's view of a long context ``kv_window`` (None: all of it)."""
        attn, mlp = self.skips.sets()
        return Route(attn, mlp, self.weights, kv_window, self.vocab_head)

    @property
    def vocab_rows(self) -> int | None:
        """The tokens the draft's head scores (None: the whole vocabulary)."""
        return None if self.vocab_ids is None else len(self.vocab_ids)


class LayerSkipDrafter:
    """Drafts with one configuration (a :class:`DraftModel`: a skip set, weights and a vocabulary),
    as long as its ``policy`` (:class:`~.policy.LengthPolicy`) plans each round. Verification
    keeps the full head, so greedy output is unchanged by the vocabulary; sampled drafts are
    drawn from the draft law restricted to the vocabulary and handed over as that law (zero
    elsewhere), which keeps speculative sampling exact (proof: methods/fr_spec/). Its constructor
    measures nothing: the policy was set up before."""

    taps = Taps()

    def __init__(self, engine: Engine, settings: DraftSettings, model: DraftModel, policy: LengthPolicy) -> None:
        self.engine, self.settings, self.model, self.policy = engine, settings, model, policy
        self.threshold = AdaptiveThreshold(settings.threshold)
        self.lookahead = settings.lookahead
        self.weights, self.vocab_ids = model.weights, model.vocab_ids
        self._vocab_index, self._vocab_head = model.vocab_index, model.vocab_head

    def skip_sets(self) -> SkipPair:
        return self.model.skip_sets()

    def route(self) -> Route:
        """This round's draft forward as one engine :class:`~selfspec_cli.engine.route.Route`: the source's
        current skip sets, the weights copy, the settings' KV window and the subset head."""
        return self.model.route(self.settings.kv_window)

    @property
    def vocab_rows(self) -> int | None:
        return self.model.vocab_rows

    def configuration(self, state: DecodeState | None, budget: int) -> LayerSkipDrafter:
        """The configuration that drafts this round: this one (:class:`SkipOrFullDepth` picks among two)."""
        return self

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        pass

    def draft(self, state: DecodeState, budget: int) -> Draft:
        k, plan = self.policy.length(budget, state.pos)
        if k <= 0:
            return NoDraft(plan=plan)
        made = self.draw(state, k)
        return chain_or_tree(made.tokens, made.parents, q=made.q, forwards=made.steps, plan=self.as_drafted(plan, made, k),
                             note=LayerSkipNote(hit_limit=made.hit_limit, chain_nodes=len(made.tokens), by=self))

    def as_drafted(self, plan: Plan | None, made: Drafted, k: int) -> Plan | None:
        """The round's plan as drafted, not as planned (a confidence exit, or a tree's nodes)."""
        return self.policy.drafted(plan, made.steps, len(made.tokens), k, made.parents is not None)

    # -- one draft -----------------------------------------------------------
    def draw(self, state: DecodeState, k: int, deterministic: bool = False) -> Drafted:
        """Draft up to ``k`` tokens from the pending token (``deterministic``: sampled chains take
        the argmax too, as the nodes of a hybrid tree must be)."""
        s = self.settings
        t0 = time.perf_counter()
        route = self.route()
        tree = _TreeBuilder(s, self.policy.tree_cap(k)) if s.tree else None
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        inp = torch.empty(1, dtype=torch.long, device=self.engine.device)
        d, hit_limit, steps = state.pending, True, 0  # d: the newest token fed, drafted from next
        for steps in range(1, k + 1):
            inp[0] = d
            # logits over the whole vocabulary, or over the draft vocabulary (column i: token vocab[i])
            logits = state.run(inp, route=route).logits[0]
            probs, key = self._law(state, logits)
            if tree is not None:
                d, conf = tree.add(self._ranked(probs, key))
                if tree.full:
                    break  # node budget spent (counts as the length limit: hit_limit stays True)
            else:
                d, conf = self._pick(state, probs, key, deterministic, q_rows)
                tokens.append(d)
            state.feed(d)
            if conf < self.threshold.value:
                hit_limit = False
                break
            if d in state.eos:  # nothing after an end of sequence can be emitted
                break
        self.policy.observe_step((time.perf_counter() - t0) / steps, state.pos + steps // 2)
        if tree is not None:
            tokens = tree.tokens
        return Drafted(tokens, tree.parents if tree is not None else None,
                       torch.stack(q_rows) if q_rows else None, steps, hit_limit)

    def _law(self, state: DecodeState, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's law at this row, and (rule gumbel) the position's perturbed scores, whose
        argmax the target takes too."""
        if state.sampling.greedy:
            return logits.softmax(-1), None
        scores = processed_scores(logits, state.sampling)
        if state.noise is None:
            return scores.softmax(-1), None
        g = state.noise(state.next_position)
        return scores.softmax(-1), scores + (g if self.vocab_ids is None else g[self._vocab_index])

    def _ranked(self, probs: torch.Tensor, key: torch.Tensor | None) -> tuple[list[float], list[int]]:
        """The tree's candidates at this depth, best first: one top-k and one host sync (rule gumbel:
        in the order the target's perturbed argmax would take them)."""
        max_k = max(k for _, k in self.settings.tree_topk)
        indices = torch.topk(probs if key is None else key, min(max_k, probs.shape[-1])).indices
        values, indices = probs[indices].tolist(), indices.tolist()
        return values, indices if self.vocab_ids is None else [self.vocab_ids[i] for i in indices]

    def _pick(self, state: DecodeState, probs: torch.Tensor, key: torch.Tensor | None, deterministic: bool,
              q_rows: list[torch.Tensor]) -> tuple[int, float]:
        """A chain's next token and its draft confidence."""
        if key is not None:  # the Gumbel pick: deterministic given the noise, coupled with the target's
            d, conf = key.argmax(), probs.max()
        elif state.sampling.greedy or deterministic:  # hybrid trees hold deterministic nodes only
            conf, d = probs.max(-1)
        else:
            d = sample_from(probs, state.generator)
            q_rows.append(self._full_law(probs))  # the law d was drawn from, over the whole vocabulary
            conf = probs.max()
        d = int(d)
        return d if self.vocab_ids is None else self.vocab_ids[d], float(conf)

    def _full_law(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft law over the subset as a law over the whole vocabulary (zero outside)."""
        if self._vocab_index is None:
            return probs
        return probs.new_zeros(self.engine.vocab_size).index_copy_(0, self._vocab_index, probs)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        if not isinstance(draft, (Chain, Tree)) or not isinstance(draft.note, LayerSkipNote):
            return
        note, steps = draft.note, draft.forwards
        # the layer-skip draft's own acceptance: accepted nodes among its chain (or tree) nodes
        own = sum(1 for i in rnd.verdict.accepted if i < note.chain_nodes)
        if self.settings.adaptive and steps:
            self.threshold.update(own, steps, note.hit_limit)
        self.policy.observe(steps, own, rnd.steps, draft.plan)

    def end(self) -> LayerSkipReport:
        attn, mlp = self.skip_sets()
        return LayerSkipReport(sorted(attn), sorted(mlp), self.weights or "target",
                               "tree" if self.settings.tree else "chain", round(self.threshold.value, 4),
                               self.vocab_rows or "full", self.policy.report())


class _TreeBuilder:
    """SWIFT's candidate tree, one depth at a time: the top-1 probability picks how many siblings
    to keep (``tree_topk``), within the node cap the policy sets (:meth:`~.policy.LengthPolicy.tree_cap`)."""

    def __init__(self, settings: DraftSettings, cap: int | None) -> None:
        self.settings = settings
        self.cap = cap
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.chain_parent = -1

    def add(self, ranked: tuple[list[float], list[int]]) -> tuple[int, float]:
        values, indices = ranked
        width = self.settings.topk_for(values[0])
        if self.cap is not None:
            width = max(1, min(width, self.cap - len(self.tokens)))
        self.parents.extend([self.chain_parent] * width)
        self.chain_parent = len(self.tokens)
        self.tokens.extend(indices[:width])
        return indices[0], values[0]

    @property
    def full(self) -> bool:
        return self.cap is not None and len(self.tokens) >= self.cap


class SkipOrFullDepth(Choose):
    """A skip set on quantized weights weighed each round against the same weights at full depth
    (no skips), each with its own measured cost and acceptance: skipping is used only where it
    pays. Full depth is a choice only while the skip set skips something. Its policy is the
    choice's (:class:`~.choose.BestOf` over the two configurations' :class:`~.policy.LengthPolicy`)."""

    def __init__(self, skip: LayerSkipDrafter, full: LayerSkipDrafter) -> None:
        super().__init__(BestOf([Option("skip_set", skip, skip.policy),
                                 Option("full_depth", full, full.policy, lambda: any(skip.skip_sets()))]))
        self.skip, self.full = skip, full

    def configuration(self, state: DecodeState | None, budget: int) -> LayerSkipDrafter:
        """The configuration whose expected gain is the best this round."""
        return self.best.pick(state, budget).drafter

    def end(self) -> LayerSkipReport:
        out = self.skip.end()
        if any(self.skip.skip_sets()) and (model := self.full.policy.report()) is not None:
            out = replace(out, full_depth=FullDepthReport(self.full.policy.drafting_rounds, model))
        return out


class Adapting(Delegating):
    """A stack whose skip source adapts (ASD's per-prompt set, SWIFT's search): the source sees
    the prefill and every round, whichever configuration drafted it (``drafter``: the one of the
    source's own set)."""

    def __init__(self, inner: Drafter, source: SkipSource, drafter: LayerSkipDrafter) -> None:
        super().__init__(inner)
        self.source, self.drafter = source, drafter
        # ASD's skip source reads the prefill's per-layer attention cosines
        self.taps = inner.taps | Taps(attn_cosine=source.needs_attn_cosine)

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.inner.begin(state, prefill)
        self.source.begin(state, prefill)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        self.inner.accept(state, rnd)
        draft = rnd.draft
        own = (isinstance(draft, (Chain, Tree)) and bool(draft.forwards) and isinstance(draft.note, LayerSkipNote)
               and draft.note.by is self.drafter)
        self.source.update(state, rnd, own)

    def end(self) -> DraftReport:
        inner = self.inner.end()
        if isinstance(inner, LayerSkipReport) and inner.source is None:
            return replace(inner, source=self.source.describe())
        return Merged((inner, self.source.describe()))
