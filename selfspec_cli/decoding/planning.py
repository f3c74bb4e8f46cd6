"""Planning: how far to draft, from measured costs and measured acceptance, and the one round-cost formula.

A round that drafts a chain of ``k`` tokens and verifies it emits, in expectation,

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j

tokens, where ``a_j`` is the probability that draft depth ``j`` is accepted given that
depth ``j - 1`` was (tracked online per proposer, :class:`Acceptance`; a full-depth quantized
draft starts from its measured agreement, :func:`.measure.draft_agreement`). In units of one
plain decoding step T(1) the round costs ``k c + v(k + 1)``: ``c`` is one draft step
(measured online, from a stored or timed first value: :func:`.cost_store.draft_cost_for`; 0 for n-gram
drafts) and ``v(m)`` one full-depth forward of ``m`` rows (:class:`.measure.VerifyCurve`, one reading
per engine, read from this machine's store of costs: :mod:`.cost_store`). Plain decoding is ``E(0) /
v(1) = 1``. :meth:`Planner.plan` picks the ``k`` that maximizes ``E(k) / (k c + v(k+1))``
(SWIFT's Eq. 6 with a measured v), and ``k = 0``, no draft, whenever no draft pays.

A drafting round also pays for work no forward accounts for: the Python around each
draft step, the lookup, building and checking a tree. And ``v`` is one reading, taken
once per machine and refreshed by every process's rounds (:mod:`.cost_store`), that can be
off by 5-10 % on a busy host. :class:`Overhead` learns
both from the rounds themselves: the driver measures each drafting round in plain
rounds of the same proposer (``Round.steps``, from :class:`RoundClock`: its seconds over the
running average of plain rounds', or over T(1) until a plain round has run), and the
difference from the planned cost is averaged into
``o``, added to every drafting round's cost: ``E(k) / (k c + v(k+1) + o)``. On the code
model (a 2.5 ms step) the learned ``o`` ranged from -0.04 to +0.10 of a step across
methods (docs/design.md, "Decoding"); it also makes the reported prediction the measured
cost of the rounds.

So that an estimate that once turned pessimistic can recover, a planner that chose
not to draft probes with one draft token now and then, within a budget: each round
without a draft earns ``probe_budget`` (1 %) of a plain step, and a probe runs once the
savings cover its expected loss, ``c + v(w + 1) - E(1)`` steps. Probing thus costs at
most about 1 % of the rounds that do not draft: a probe that is nearly free (an n-gram
draft near break-even) runs every few rounds, an expensive one that is seldom accepted
(a layer-skip draft on a model without redundancy) every 60 or so.

The driver adds up each round's expected tokens and cost (a round that does not
draft: 1 and 1) into the run's *predicted gain*, reported beside the *realized gain*
(tokens per plain step's time), so every prediction can be checked.

Invariant: planning changes only how many tokens are drafted, never how they are
verified, so every lossless proposer stays exact.

**The one round-cost formula** (:func:`expected_tokens`, :func:`round_cost`, :func:`round_plan`,
:func:`round_gain`; issue 49): a round that drafts ``k`` tokens, verifies ``nodes`` drafted nodes
(``k`` for a chain, more for a tree or a merged n-gram branch) with the pending token, and
reaches draft depth ``j`` with probability ``reach_j``, yields

    E = 1 + sum_j reach_j  tokens,   costs  k c + v(nodes + 1) + o  plain steps  (o: none when k = 0),

and gains ``E / cost`` over plain decoding. The planners, the hybrid merge, calibration's proxy,
``selfspec profile``'s draft verdict (i.i.d. acceptance: ``reach_j = a^j``) and every predicted
speedup (:func:`predicted_speedup`: the rounds' expected tokens over their cost, summed) use
these functions and no formula of their own. :meth:`Planner.best` sums ``E`` as ``k`` grows
(one pass), the same sum in running order, so that the draft length it picks is the one it
always picked.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from .drafts import Plan
from .measure import VerifyCurve
from .output import DraftReport

PROBE_BUDGET = 0.01  # share of a plain step a source that does not draft saves up per round, to probe

@dataclass(frozen=True, slots=True)
class PlannerReport(DraftReport):
    """A planner's state as the prompt's ``stats`` report it (:meth:`Planner.report`): its prior, the
    acceptance it measured at depths 1..8, its round overhead ``o`` and the verify curve's v(2), v(4), v(8)."""

    prior: float
    acceptance_by_depth: list[float]
    round_overhead: float
    verify_curve: dict[int, float]


@dataclass
class Acceptance:
    """Per-depth acceptance ``a_j``, over all rounds so far. Depth 1 has a Beta prior of weight 2
    centred on ``prior`` (0.5, a flat Beta(1, 1), when nothing is known; a quantized draft's
    measured agreement, :func:`draft_agreement`); depth ``j > 1`` a Beta prior of weight 2
    centred on depth ``j - 1``'s estimate, so that a depth never drafted yet is expected to
    behave like the one before it (a flat 0.5 there would keep a planner from ever trying a
    depth beyond those it has seen)."""

    max_depth: int
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    prior_weight: float = 2.0
    prior: float = 0.5
    # per prompt (None: one pool over every round): the rounds of the prompt being decoded are counted apart, and each
    # depth's rate is their Beta posterior of this weight centred on the estimate pooled over the earlier prompts
    # (which :meth:`new_prompt` extends): how well a source drafts depends on the text (n-gram drafts pay on code
    # and summaries, rarely on a translation), so a prompt's own failures count at once, not as one more round of a
    # pool that other prompts filled
    prompt_weight: float | None = None
    prompt_reached: list[float] = field(default_factory=list)
    prompt_accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * (self.max_depth + 1)  # index j: depth j (index 0 unused)
        self.accepted = [0.0] * (self.max_depth + 1)
        self.prompt_reached = [0.0] * (self.max_depth + 1)
        self.prompt_accepted = [0.0] * (self.max_depth + 1)

    def rate(self, depth: int) -> float:
        d = max(1, min(depth, self.max_depth))
        mean = self.prior
        for j in range(1, d + 1):
            mean = (self.accepted[j] + self.prior_weight * mean) / (self.reached[j] + self.prior_weight)
        if self.prompt_weight is None:
            return mean
        w = self.prompt_weight
        return (self.prompt_accepted[d] + w * mean) / (self.prompt_reached[d] + w)

    def observe(self, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` tokens of which the first ``accepted`` were accepted."""
        reached, acc = ((self.reached, self.accepted) if self.prompt_weight is None
                        else (self.prompt_reached, self.prompt_accepted))
        for j in range(1, min(drafted, accepted + 1) + 1):
            d = min(j, self.max_depth)
            reached[d] += 1
            acc[d] += j <= accepted

    def new_prompt(self) -> None:
        """A new prompt's decode begins: the last prompt's rounds join the pool (per-prompt mode only)."""
        for j in range(self.max_depth + 1):
            self.reached[j] += self.prompt_reached[j]
            self.accepted[j] += self.prompt_accepted[j]
            self.prompt_reached[j] = self.prompt_accepted[j] = 0.0


@dataclass
class Overhead:
    """``o``: a drafting round's measured cost beyond its plan, in plain steps. A mean that
    starts from a prior of 0 worth ``prior`` rounds (so one outlying first round, a cold
    cache or a page fault, cannot by itself make a source look unprofitable and stop it
    from ever drafting again), then an exponential average over the last 10; each reading
    clipped to [-0.5, 1]."""

    value: float = 0.0
    rounds: int = 0
    prior: int = 3

    def observe(self, excess: float) -> None:
        self.rounds += 1
        self.value += (min(1.0, max(-0.5, excess)) - self.value) / min(self.rounds + self.prior, 10)


@dataclass
class ProbeBudget:
    """The probes of a source that chose not to draft (see the module docstring): each such round
    earns ``share`` of a plain step; a probe runs once the savings cover its expected loss, and
    is paid from them. A round that pays on its own spends nothing and resets the savings."""

    share: float = PROBE_BUDGET
    savings: float = 0.0  # earned and not yet spent, in plain steps

    def paying(self) -> None:
        self.savings = 0.0

    def probe(self, loss: float) -> bool:
        """After a round that does not pay: whether to probe now, at an expected ``loss`` in plain steps."""
        self.savings += self.share
        if self.savings >= loss:
            self.savings -= loss
            return True
        return False


def expected_tokens(reach: Iterable[float]) -> float:
    """E: a round's expected tokens, ``1 + sum_j reach_j``, the pending token's one and each draft depth
    reached (``reach_j``: the chance that depth ``j`` is accepted, :meth:`Planner.reach`; i.i.d.
    acceptance ``a``: ``a^j``). The one definition (see the module docstring)."""
    return 1.0 + sum(reach)


def round_cost(curve: VerifyCurve, k: int, c: float, nodes: int, overhead: float, context: int | None = None) -> float:
    """A round's expected cost in plain steps, k·c + v(n+1) + o: ``k`` draft forwards of cost ``c``
    each, one verify forward of the pending token and ``nodes`` drafted nodes (v after ``context``
    tokens: :meth:`VerifyCurve.v_at`), and the learned overhead ``o`` of a drafting round (none for a
    plain step, ``k = 0``). The one formula every planner, the hybrid merge and calibration's proxy use."""
    return k * c + curve.v_at(nodes + 1, context) + (overhead if k else 0.0)


def round_plan(curve: VerifyCurve, k: int, reach: Iterable[float], c: float, nodes: int, overhead: float = 0.0,
               context: int | None = None) -> Plan:
    """A round's :class:`Plan`: :func:`expected_tokens` of ``reach`` and :func:`round_cost` of ``k`` draft
    forwards and ``nodes`` verified nodes."""
    return Plan(expected_tokens(reach), round_cost(curve, k, c, nodes, overhead, context))


def round_gain(tokens: float, cost: float) -> float:
    """Expected tokens per plain step's time, relative to plain decoding: ``E / cost``."""
    return tokens / cost


def predicted_speedup(plans: Sequence[tuple[float, float]]) -> float | None:
    """The speedup plans predict over plain decoding: their expected tokens over their cost, each summed
    (``plans``: ``(expected_tokens, cost in plain steps)`` pairs, a round's :class:`Plan` or a decode's
    totals); None when they cost nothing."""
    cost = sum(p[1] for p in plans)
    return round_gain(sum(p[0] for p in plans), cost) if cost else None


def iid_chain_gains(curve: VerifyCurve, a: float, c: float, ks: Iterable[int]) -> dict[int, float]:
    """Per draft length ``k`` in ``ks``, the gain of a chain of ``k`` drafts whose tokens are each
    accepted with probability ``a`` (i.i.d., an optimistic reading: ``reach_j = a^j``), at draft cost
    ``c`` and the curve's v, with no learned overhead: :func:`round_plan` and :func:`round_gain`."""
    out = {}
    for k in ks:
        plan = round_plan(curve, k, accumulate([a] * k, operator.mul), c, k)
        out[k] = round_gain(*plan)
    return out


@dataclass
class Planner:
    """Chooses the draft length of each round (see the module docstring)."""

    curve: VerifyCurve
    max_len: int
    acceptance: Acceptance = None  # type: ignore[assignment]
    probes: ProbeBudget = field(default_factory=ProbeBudget)  # one-token probes when drafting does not pay
    width: int = 1  # verified rows per draft depth (2 for a tree of at most 2k nodes)
    prior: float = 0.5  # depth 1's prior acceptance (Acceptance)
    prompt_weight: float | None = None  # Acceptance's per-prompt level (None: one pool over every round)
    overhead: Overhead = field(default_factory=Overhead)  # shared by planners whose rounds cost alike
    last: Plan = Plan(1.0, 1.0)  # the last plan's expected tokens and cost (in plain steps)
    context: int | None = None  # the round's context: v is read there (VerifyCurve.v_at); None, the curve's own

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.max_len, prior=self.prior, prompt_weight=self.prompt_weight)

    def at(self, context: int | None) -> Planner:
        """This planner, pricing rounds after ``context`` tokens from now on (a proposer sets it each round)."""
        self.context = context
        return self

    def reach(self, k: int) -> list[float]:
        """P(depth j of a k-token draft is accepted), j = 1..k."""
        return list(accumulate((self.acceptance.rate(j) for j in range(1, k + 1)), operator.mul))

    def expected_tokens(self, k: int) -> float:
        """E(k) of a ``k``-token draft (:func:`expected_tokens`)."""
        return expected_tokens(self.reach(k))

    def cost(self, k: int, c: float) -> float:
        """A round with ``k`` drafts, in plain steps (``k = 0``: a plain step)."""
        return round_cost(self.curve, k, c, self.width * k, self.overhead.value, self.context)

    def gain(self, k: int, c: float) -> float:
        """Expected tokens per T(1) of a round with ``k`` drafts, relative to plain decoding."""
        return round_gain(self.expected_tokens(k), self.cost(k, c))

    def best(self, c: float, budget: int) -> tuple[int, float]:
        """The draft length that maximizes the expected gain, and that gain (``(0, 1.0)``
        when no draft pays); no side effects. One pass: E(k) (:func:`expected_tokens`) is built up as k
        grows, the same sum in running order."""
        best_k, best, e = 0, 1.0, 1.0
        for k, reach in enumerate(self.reach(min(self.max_len, budget)), 1):
            e += reach
            g = round_gain(e, self.cost(k, c))
            if g > best:
                best_k, best = k, g
        return best_k, best

    def plan(self, c: float, budget: int) -> int:
        """The draft length for this round (0: do not draft), probing now and then."""
        best_k = self.best(c, budget)[0]
        if best_k == 0 and min(self.max_len, budget) > 0:
            best_k = int(self.probes.probe(self.probe_loss(c)))  # probe: one draft token, paid from the savings
        elif best_k:
            self.probes.paying()
        self.last = Plan(self.expected_tokens(best_k), self.cost(best_k, c))
        return best_k

    def drafted(self, k: int, nodes: int, c: float) -> tuple[float, float]:
        """Expected tokens and cost of the round as drafted: ``k`` draft steps (fewer than
        planned when the draft stopped at a confidence exit or an end of sequence) and
        ``nodes`` verified draft nodes. The prediction and ``o`` then rest on what ran,
        not on what was planned (a round cut short is cheaper than its plan, and would
        otherwise read as a negative overhead)."""
        return round_plan(self.curve, k, self.reach(k), c, nodes, self.overhead.value, self.context)

    def probe_loss(self, c: float) -> float:
        """Expected loss of a one-token probe, in plain steps: its cost less the tokens it yields."""
        return self.cost(1, c) - self.expected_tokens(1)

    def observe(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(drafted, accepted)  # no draft: no depth reached

    def observe_round(self, steps: float | None, plan: Plan | None) -> None:
        """Learn ``o`` from a drafting round this planner planned: ``steps`` is its measured
        cost in plain steps (:class:`RoundClock`); its ``plan``'s cost less ``o`` is what the
        forwards were expected to cost."""
        if steps is None or plan is None:
            return
        self.overhead.observe(steps - (plan.cost - self.overhead.value))

    def report(self) -> PlannerReport:
        return PlannerReport(round(self.prior, 3),
                             [round(self.acceptance.rate(j), 3) for j in range(1, min(self.max_len, 8) + 1)],
                             round(self.overhead.value, 4),
                             {m: round(self.curve.v(m), 3) for m in (2, 4, 8)})  # the reading this planner uses


EMA_OLD = 0.8  # the running averages of measured seconds: this much of the old value, the rest new


def ema(old: float | None, new: float) -> float:
    """A running average of measured seconds (the first reading as it is)."""
    return new if old is None else EMA_OLD * old + (1 - EMA_OLD) * new


class RoundClock:
    """The unit every round is measured in: a plain round's seconds, as a running average
    (:func:`ema`) of the rounds that drafted nothing; until one has run, T(1) at the round's
    context from the verify curve. Kept by the driver for one decode."""

    def __init__(self, curve: VerifyCurve | None) -> None:
        self.curve = curve
        self.plain_s: float | None = None

    def plain_round(self, seconds: float) -> None:
        self.plain_s = ema(self.plain_s, seconds)

    def t1_at(self, context: int) -> float | None:
        """A plain step's seconds after ``context`` tokens (None without a curve: the proposer does not plan)."""
        return self.curve.t1_at(context) if self.curve is not None else None

    def steps(self, seconds: float, context: int) -> float | None:
        """A drafting round's seconds in plain steps."""
        unit = self.plain_s or self.t1_at(context)
        return seconds / unit if unit else None
