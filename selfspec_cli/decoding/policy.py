"""The draft policy of a layer-skip drafter: how many tokens to draft each round, the tree's node
cap, and whether to draft at all, fed by the cost model.

A :class:`LengthPolicy` is the separate object a :class:`~.layer_skip.LayerSkipDrafter` asks
before each draft (:meth:`LengthPolicy.length`); the drafter only draws the tokens. The policy
holds what is measured about its configuration: the verify curve, the draft cost ``c`` (before
any draft the weight-byte prior, :func:`~.measure.prior_draft_cost`, or a quantized draft's
stored or timed step, :func:`~.cost_store.draft_cost_for`; then the measured steps' average),
depth 1's prior acceptance (:func:`agreement_prior`) and the :class:`~.planning.Planner`. All
measuring happens in :meth:`LengthPolicy.setup`, before a decode, never in a drafter's constructor.

Invariants: the planning arithmetic is decoding/planning.py's, called in the same order as when it
lived in the drafter, so a round's plan is what it was; without ``cost_aware`` nothing is measured
or planned. Its one planning function of its own: :meth:`LengthPolicy.tree_cap`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine import Engine
from ..prompts import encode_turn
from .cost_store import curve_for, draft_cost_for, observe_draft_step
from .measure import VerifyCurve, draft_agreement, prior_draft_cost
from .planning import Planner, PlannerReport, ema
from .drafts import Plan
from .output import DraftReport, flat
from .state import DecodeState

if TYPE_CHECKING:
    from .layer_skip import DraftModel, DraftSettings, SkipPair

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


@dataclass(frozen=True, slots=True)
class CostModelReport(DraftReport):
    """A planned configuration's cost model as the prompt's ``stats`` report it (``cost_model``): its draft
    cost ``c``, then its planner's report (:class:`~.planning.PlannerReport`)."""

    c: float
    planner: PlannerReport = flat()


class LengthPolicy:
    """The draft length of each round of one layer-skip configuration (see the module docstring).
    ``model``: what the configuration's draft forward reads (its skip source, weights and
    vocabulary), which prices its draft step; ``prior``: depth 1's prior acceptance."""

    def __init__(self, engine: Engine, settings: DraftSettings, model: DraftModel, prior: float = 0.5) -> None:
        self.engine, self.settings, self.model, self.prior = engine, settings, model, prior
        self.planner: Planner | None = None
        self.curve: VerifyCurve | None = None
        self.step_c: float | None = None  # EMA of one draft forward over the plain step at its context
        self.c0: float | None = None  # c before any draft (draft_cost_for: stored, or timed)
        self._prior: tuple[SkipPair, float] | None = None  # the target-weight prior for the current skip set
        self.drafting_rounds = 0

    @staticmethod
    def measure_curve(engine: Engine, settings: DraftSettings) -> None:
        """The engine's verify curve, measured now (once per engine) when the policy plans, not inside a timed decode."""
        if settings.cost_aware:
            curve_for(engine)

    def setup(self) -> LengthPolicy:
        """Measure what planning needs before any decode: the verify curve (:meth:`measure_curve`)
        and a quantized draft's cost (stored, else timed now); then the planner."""
        if self.model.weights is not None and self.settings.cost_aware:  # a quantized draft's cost is timed now
            m = self.model
            self.c0 = draft_cost_for(self.engine, m.weights, *m.skip_sets(), vocab=m.vocab_index, head=m.vocab_head)
        if self.settings.cost_aware:
            self._planner()
        return self

    def draft_cost(self) -> float:
        """c: one draft forward over one plain step, measured (before any draft: the share of the
        weight bytes the skip set reads, :func:`~.measure.prior_draft_cost`, or a quantized draft's
        timed step)."""
        if self.step_c is not None and self.planner is not None:
            return self.step_c
        m = self.model
        attn, mlp = m.skip_sets()
        if m.weights is None:  # the one prior for c: the weight bytes the draft step reads (memory-bound)
            if self._prior is None or self._prior[0] != (attn, mlp):
                self._prior = ((attn, mlp), prior_draft_cost(self.engine, attn, mlp, vocab_rows=m.vocab_rows))
            return self._prior[1]
        if self.c0 is None:  # a quantized draft's cost is not its share of sublayers: time one
            self.c0 = draft_cost_for(self.engine, m.weights, attn, mlp, vocab=m.vocab_index, head=m.vocab_head)
        return self.c0

    def _planner(self) -> Planner:
        if self.planner is None:
            self.planner = Planner(curve_for(self.engine), self.settings.max_draft,
                                   width=2 if self.settings.tree else 1, prior=self.prior)
            self.curve = self.planner.curve
        return self.planner

    def gain(self, state: DecodeState | None, budget: int) -> float | None:
        """The best expected gain of drafting this round (1.0: drafting does not pay; None: no budget)."""
        if budget <= 0:
            return None
        context = None if state is None else state.pos
        return self._planner().at(context).best(self.draft_cost(), min(self.settings.max_draft, budget))[1]

    def length(self, budget: int, context: int | None) -> tuple[int, Plan | None]:
        """This round's draft length (0: no draft) and its plan (None: unplanned), after ``context`` tokens."""
        budget = min(self.settings.max_draft, budget)
        plan = None
        if budget > 0 and self.settings.cost_aware:
            budget = self._planner().at(context).plan(self.draft_cost(), budget)
            plan = self.planner.last
        self.drafting_rounds += budget > 0
        return budget, plan

    def tree_cap(self, k: int) -> int | None:
        """The most nodes of a tree drafted ``k`` deep (None: no cap): the configured cap, and with
        cost-aware drafting at most 2k (a planned depth k verifies at most 2k nodes)."""
        cap = self.settings.tree_max_nodes
        if self.settings.cost_aware:
            cap = min(cap or 2 * k, 2 * k)
        return cap

    def drafted(self, plan: Plan | None, steps: int, nodes: int, k: int, tree: bool) -> Plan | None:
        """The round's plan as drafted, not as planned (a confidence exit after ``steps`` of ``k``
        draft steps, or a tree's ``nodes``)."""
        if plan is not None and (steps < k or tree):
            return self.planner.drafted(steps, nodes, self.draft_cost())
        return plan

    def observe_step(self, step_s: float, at: int) -> None:
        """One draft step's seconds over the plain step at this context (VerifyCurve.t1_at)."""
        if self.planner is None:
            return
        self.step_c = ema(self.step_c, step_s / self.planner.curve.t1_at(at))
        m = self.model
        if m.weights is not None:  # a timed (quantized) draft's c: the store's online refresh
            observe_draft_step(self.engine, m.weights, *m.skip_sets(), step_s, at, m.vocab_rows)

    def observe(self, steps: int, own: int, round_steps: float | None, plan: Plan | None) -> None:
        """After a round of this configuration: ``own`` of its ``steps`` draft nodes accepted, the round's
        measured cost in plain steps and its plan."""
        if self.planner is not None:
            self.planner.observe(steps, own)
            if steps:
                self.planner.observe_round(round_steps, plan)

    def report(self) -> CostModelReport | None:
        """The cost model as the prompt's ``stats`` report it (None: unplanned)."""
        return None if self.planner is None else CostModelReport(round(self.draft_cost(), 4), self.planner.report())
