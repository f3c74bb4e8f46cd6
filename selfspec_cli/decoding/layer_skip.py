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

With ``cost_aware`` (the default) each round first asks the :class:`~.planning.Planner` how far
drafting pays at the measured draft cost and acceptance, and does not draft at all when it
does not pay. Choosing between configurations (a skip set, or full depth on the same
quantized weights) is :mod:`.choose`'s; merging an n-gram branch is :mod:`.hybrid`'s; a skip
source that adapts sees every round through :class:`Adapting`. Greedy drafts are the draft's
argmax; sampled chain drafts are drawn from the draft's processed distribution and handed to
the driver with their laws, so the driver's speculative-sampling rule is exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import Engine
from ..prompts import encode_turn
from .cost_store import curve_for, draft_cost_for, observe_draft_step
from .measure import draft_agreement, prior_draft_cost
from .planning import Planner, ema
from .choose import Choose, Option
from .drafts import Chain, Draft, LayerSkipNote, NoDraft, Plan, Round, Tree, chain_or_tree
from .driver import Delegating, Proposer
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


# the instruction whose greedy answer a quantized draft's agreement prior is read along (any neutral request)
AGREEMENT_PROMPT = "Write a short paragraph about a topic of your choice."




def agreement_prior(engine: Engine, tokenizer: Any, weights: str) -> float:
    """Depth 1's prior acceptance for a full-depth quantized draft: its top-1 agreement with
    the target along the target's own greedy answer to a neutral instruction
    (:func:`~selfspec_cli.decoding.measure.draft_agreement`, as (hits + 1) / (positions + 2)),
    so that a fresh decode starts from what the copy is known to do rather than from 0.5,
    which prices a draft that costs c per token below plain decoding until a few rounds have
    run (docs/engine.md, "Quantized drafts"). 0.5 without a tokenizer."""
    if tokenizer is None:
        return 0.5
    ids = encode_turn(tokenizer, [{"role": "user", "content": AGREEMENT_PROMPT}], True)
    hits, n = draft_agreement(engine, weights, ids)
    return (hits + 1) / (n + 2)


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

    def describe(self) -> dict[str, Any]:
        return {}


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


class LayerSkipDrafter(Proposer):
    """Drafts with one configuration: a skip set (from ``skips``), ``weights`` (None: the
    target's own) and a vocabulary (``vocab`` token ids; None: the whole vocabulary).
    Verification keeps the full head, so greedy output is unchanged by the vocabulary;
    sampled drafts are drawn from the draft law restricted to ``vocab`` and handed over as
    that law (zero elsewhere), which keeps speculative sampling exact (proof:
    methods/fr_spec/). ``prior``: depth 1's prior acceptance (:func:`agreement_prior` for a
    full-depth quantized draft)."""

    def __init__(self, engine: Engine, tokenizer: Any, settings: DraftSettings, skips: SkipSource = FixedSkips(),
                 weights: str | None = None, vocab: torch.Tensor | None = None, prior: float = 0.5) -> None:
        super().__init__(engine, tokenizer)
        self.settings, self.skips, self.weights, self.prior = settings, skips, weights, prior
        self.threshold = AdaptiveThreshold(settings.threshold)
        self.lookahead = settings.lookahead
        self.planner: Planner | None = None
        self.step_c: float | None = None  # EMA of one draft forward over the plain step at its context
        self.c0: float | None = None  # c before any draft (draft_cost_for: stored, or timed)
        self._prior: tuple[SkipPair, float] | None = None  # the target-weight prior for the current skip set
        self.drafting_rounds = 0
        if settings.cost_aware:
            curve_for(engine)  # measured now (once per engine), not inside a timed decode
        if weights is not None:
            engine.quantized(weights)  # the quantized copy is built (or read from its disk cache) now
        self.vocab_ids = self._vocab_index = self._vocab_head = None
        if vocab is not None and int(vocab.numel()) < engine.vocab_size:
            ids = vocab.to(torch.int64)
            self.vocab_ids, self._vocab_index = ids.tolist(), ids.to(engine.device)
            self._vocab_head = engine.subset_head(ids, weights)
        if weights is not None and settings.cost_aware:  # a quantized draft's cost is timed now, not in a decode
            self.c0 = draft_cost_for(engine, weights, *self.skip_sets(), vocab=self._vocab_index, head=self._vocab_head)
        if settings.cost_aware:
            self._planner()

    def skip_sets(self) -> SkipPair:
        return self.skips.sets()

    def draft_cost(self) -> float:
        """c: one draft forward over one plain step, measured (before any draft: the share of the
        weight bytes the skip set reads, :func:`~.measure.prior_draft_cost`, or a quantized draft's
        timed step)."""
        if self.step_c is not None and self.planner is not None:
            return self.step_c
        attn, mlp = self.skip_sets()
        if self.weights is None:  # the one prior for c: the weight bytes the draft step reads (memory-bound)
            if self._prior is None or self._prior[0] != (attn, mlp):
                self._prior = ((attn, mlp), prior_draft_cost(self.engine, attn, mlp, vocab_rows=self.vocab_rows))
            return self._prior[1]
        if self.c0 is None:  # a quantized draft's cost is not its share of sublayers: time one
            self.c0 = draft_cost_for(self.engine, self.weights, attn, mlp, vocab=self._vocab_index, head=self._vocab_head)
        return self.c0

    @property
    def vocab_rows(self) -> int | None:
        """The tokens the draft's head scores (None: the whole vocabulary)."""
        return None if self.vocab_ids is None else len(self.vocab_ids)

    def _planner(self) -> Planner:
        if self.planner is None:
            self.planner = Planner(curve_for(self.engine), self.settings.max_draft,
                                   width=2 if self.settings.tree else 1, prior=self.prior)
            self.curve = self.planner.curve
        return self.planner

    def expected_gain(self, state: DecodeState | None, budget: int) -> float | None:
        """The best expected gain of drafting this round (1.0: drafting does not pay; None: no budget)."""
        if budget <= 0:
            return None
        context = None if state is None else state.pos
        return self._planner().at(context).best(self.draft_cost(), min(self.settings.max_draft, budget))[1]

    def pick(self, state: DecodeState | None, budget: int) -> LayerSkipDrafter:
        """The configuration that drafts this round: this one (a :class:`~.choose.Choose` picks among several)."""
        return self

    def plan_round(self, budget: int, context: int | None) -> tuple[int, Plan | None]:
        """This round's draft length (0: no draft) and its plan (None: unplanned), after ``context`` tokens."""
        budget = min(self.settings.max_draft, budget)
        plan = None
        if budget > 0 and self.settings.cost_aware:
            budget = self._planner().at(context).plan(self.draft_cost(), budget)
            plan = self.planner.last
        self.drafting_rounds += budget > 0
        return budget, plan

    def propose(self, state: DecodeState, budget: int) -> Draft:
        k, plan = self.plan_round(budget, state.pos)
        if k <= 0:
            return NoDraft(plan=plan)
        made = self.draw(state, k)
        return chain_or_tree(made.tokens, made.parents, q=made.q, forwards=made.steps, plan=self.as_drafted(plan, made, k),
                             note=LayerSkipNote(hit_limit=made.hit_limit, chain_nodes=len(made.tokens), by=self))

    def as_drafted(self, plan: Plan | None, made: Drafted, k: int) -> Plan | None:
        """The round's plan as drafted, not as planned (a confidence exit, or a tree's nodes)."""
        if plan is not None and (made.steps < k or made.parents is not None):
            return self.planner.drafted(made.steps, len(made.tokens), self.draft_cost())
        return plan

    # -- one draft -----------------------------------------------------------
    def draw(self, state: DecodeState, k: int, deterministic: bool = False) -> Drafted:
        """Draft up to ``k`` tokens from the pending token (``deterministic``: sampled chains take
        the argmax too, as the nodes of a hybrid tree must be)."""
        s = self.settings
        t0 = time.perf_counter()
        skip_attn, skip_mlp = self.skip_sets()
        tree = _TreeBuilder(s, k) if s.tree else None
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        inp = torch.empty(1, dtype=torch.long, device=self.engine.device)
        d, hit_limit, steps = state.pending, True, 0  # d: the newest token fed, drafted from next
        for steps in range(1, k + 1):
            inp[0] = d
            # logits over the whole vocabulary, or over the draft vocabulary (column i: token vocab[i])
            logits = state.run(inp, skip_attn=skip_attn, skip_mlp=skip_mlp, head=self._vocab_head,
                               weights=self.weights, kv_window=s.kv_window).logits[0]
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
        self._observe_step(state, (time.perf_counter() - t0) / steps, state.pos + steps // 2)
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

    def _observe_step(self, state: DecodeState, step_s: float, at: int) -> None:
        """One draft step over the plain step at this context (VerifyCurve.t1_at)."""
        if self.planner is None:
            return
        self.step_c = ema(self.step_c, step_s / self.planner.curve.t1_at(at))
        if self.weights is not None:  # a timed (quantized) draft's c: the store's online refresh
            observe_draft_step(self.engine, self.weights, *self.skip_sets(), step_s, at, self.vocab_rows)

    def update(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        if not isinstance(draft, (Chain, Tree)) or not isinstance(draft.note, LayerSkipNote):
            return
        note, steps = draft.note, draft.forwards
        # the layer-skip draft's own acceptance: accepted nodes among its chain (or tree) nodes
        own = sum(1 for i in rnd.verdict.accepted if i < note.chain_nodes)
        if self.settings.adaptive and steps:
            self.threshold.update(own, steps, note.hit_limit)
        if self.planner is not None:
            self.planner.observe(steps, own)
            if steps:
                self.planner.observe_round(rnd.steps, draft.plan)

    def cost_model(self) -> dict[str, Any] | None:
        return None if self.planner is None else {"c": round(self.draft_cost(), 4), **self.planner.report()}

    def describe(self) -> dict[str, Any]:
        attn, mlp = self.skip_sets()
        out = {"skip_attn": sorted(attn), "skip_mlp": sorted(mlp), "draft_precision": self.weights or "target",
               "verify": "tree" if self.settings.tree else "chain",
               "draft_threshold": round(self.threshold.value, 4),
               "draft_vocab": self.vocab_rows or "full"}
        if (model := self.cost_model()) is not None:
            out["cost_model"] = model
        return out


class _TreeBuilder:
    """SWIFT's candidate tree, one depth at a time: the top-1 probability picks how many siblings
    to keep (``tree_topk``), within a node cap (with cost-aware drafting a planned depth k
    verifies at most 2k nodes)."""

    def __init__(self, settings: DraftSettings, k: int) -> None:
        self.settings = settings
        self.cap = settings.tree_max_nodes
        if settings.cost_aware:
            self.cap = min(self.cap or 2 * k, 2 * k)
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
    pays. Full depth is a choice only while the skip set skips something."""

    def __init__(self, skip: LayerSkipDrafter, full: LayerSkipDrafter) -> None:
        super().__init__([Option("skip_set", skip), Option("full_depth", full, lambda: any(skip.skip_sets()))])
        self.skip, self.full = skip, full

    def describe(self) -> dict[str, Any]:
        out = self.skip.describe()
        if any(self.skip.skip_sets()) and (model := self.full.cost_model()) is not None:
            out["full_depth"] = {"rounds": self.full.drafting_rounds, "cost_model": model}
        return out


class Adapting(Delegating):
    """A stack whose skip source adapts (ASD's per-prompt set, SWIFT's search): the source sees
    the prefill and every round, whichever configuration drafted it."""

    def __init__(self, inner: Proposer, source: SkipSource, drafter: LayerSkipDrafter) -> None:
        super().__init__(inner)
        self.source, self.drafter = source, drafter

    def prefill_options(self) -> dict[str, Any]:
        """ASD's skip source reads the prefill's per-layer attention cosines."""
        return {**self.inner.prefill_options(), **({"attn_cosine": True} if self.source.needs_attn_cosine else {})}

    def begin(self, state: DecodeState, prefill: Any) -> None:
        self.inner.begin(state, prefill)
        self.source.begin(state, prefill)

    def propose(self, state: DecodeState, budget: int) -> Draft:
        return self.inner.propose(state, budget)

    def update(self, state: DecodeState, rnd: Round) -> None:
        self.inner.update(state, rnd)
        draft = rnd.draft
        own = (isinstance(draft, (Chain, Tree)) and bool(draft.forwards) and isinstance(draft.note, LayerSkipNote)
               and draft.note.by is self.drafter)
        self.source.update(state, rnd, own)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), **self.source.describe()}
