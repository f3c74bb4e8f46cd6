"""N-gram drafts from the context (prompt lookup, Saxena 2023; methods/pld.py): three parts, composed where used.

* :func:`lookup`, :class:`NgramLookup`: the continuation of the longest earlier match of the
  context's suffix, once per round however many ask; also the n-gram branch of hybrid drafts;
* :class:`NgramPolicy`: how many looked-up tokens to verify (a :class:`~.planning.Planner` per
  n-gram order, one shared round overhead; none when they do not pay; all when unplanned); each order's
  acceptance is the prompt's own, with the earlier prompts' pooled estimate as its prior
  (:class:`~.planning.Acceptance`'s per-prompt level);
* :class:`NgramDrafter`: the drafter of ``--method pld`` and of ``auto``'s n-gram source.

Invariants: the draft is deterministic, so the driver verifies it exactly; the policy measures
the verify curve when it is made (once per engine), never inside a timed decode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine import Engine, ForwardOutput
from .cost_store import curve_for
from .measure import VerifyCurve
from .output import DraftReport, optional
from .planning import Overhead, Planner, PlannerReport
from .drafts import Chain, Draft, NgramNote, NoDraft, Plan, Round
from .driver import Taps
from .state import DecodeState

# prompt lookup's defaults: the longest and shortest suffix n-gram looked up, the most draft tokens per round
MAX_NGRAM, MIN_NGRAM, MAX_DRAFT = 3, 1, 10
# an n-gram order's acceptance per prompt (planning.Acceptance): the pooled estimate of the earlier prompts is a prior
# worth this many rounds of the prompt's own, the weight every other prior of the planners has
PROMPT_WEIGHT = 2.0


def lookup(context: list[int], max_ngram: int, min_ngram: int, max_len: int) -> tuple[list[int], int]:
    """The continuation of the most recent earlier occurrence of the longest matching
    suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens), at most ``max_len``
    tokens, and that n; ``([], 0)`` when nothing matches. The candidates are found with
    one vectorized comparison against the last token (a Python scan of an 800-token
    context costs about a millisecond, several per cent of a step)."""
    n_ctx = len(context)
    if n_ctx < 2 or max_len < 1:
        return [], 0
    arr = np.asarray(context)
    ends = np.flatnonzero(arr[:-1] == arr[-1])[::-1].tolist()  # earlier positions holding the last token, latest first
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = arr[n_ctx - n :]
        for e in ends:
            if e >= n - 1 and np.array_equal(arr[e - n + 1 : e + 1], tail):
                return context[e + 1 : e + 1 + max_len], n
    return [], 0


@dataclass(frozen=True, slots=True)
class NgramReport(DraftReport):
    """An n-gram policy's report: a planner's per n-gram order (absent when it planned nothing)."""

    cost_model: dict[str, PlannerReport] | None = optional()


class NgramLookup:
    """This round's n-gram continuation of the context, computed once per round (``auto`` and a
    hybrid draft ask before the drafter drafts)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, max_draft: int = MAX_DRAFT) -> None:
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft
        self._last: tuple[Any, tuple[list[int], int]] = (None, ([], 0))

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._last = (None, ([], 0))  # a new state may reuse a freed one's id

    def candidate(self, state: DecodeState, budget: int) -> tuple[list[int], int]:
        """The looked-up continuation (at most ``min(max_draft, budget)`` tokens) and its n-gram order (0: none)."""
        key = (id(state), len(state.committed), budget)
        if self._last[0] != key:
            self._last = (key, lookup(state.committed, self.max_ngram, self.min_ngram, min(self.max_draft, budget)))
        return self._last[1]


class NgramPolicy:
    """How many of a lookup's tokens to verify (see the module docstring); ``planned`` False:
    all of them, nothing measured."""

    def __init__(self, engine: Engine, source: NgramLookup, max_draft: int, planned: bool = True) -> None:
        self.engine, self.source, self.max_draft, self.planned = engine, source, max_draft, planned
        self.planners: dict[int, Planner] = {}  # n-gram length -> its planner (longer matches draft better)
        self.overhead = Overhead()  # a lookup round costs the same whatever the n-gram length: one average
        self.curve: VerifyCurve | None = None
        if planned:
            self.curve = curve_for(engine)  # measured now (once per engine), not inside a timed decode

    def planner(self, n: int) -> Planner:
        if n not in self.planners:
            self.curve = curve_for(self.engine)
            self.planners[n] = Planner(self.curve, self.max_draft, overhead=self.overhead, prompt_weight=PROMPT_WEIGHT)
        return self.planners[n]

    def new_prompt(self) -> None:
        """A decode begins: each order's acceptance starts the prompt from what the earlier prompts measured."""
        for p in self.planners.values():
            p.acceptance.new_prompt()

    def gain(self, state: DecodeState, budget: int) -> float | None:
        """The best expected gain of this round's lookup (None: nothing looked up)."""
        cont, n = self.source.candidate(state, budget)
        return self.planner(n).at(state.pos).best(0.0, len(cont))[1] if cont else None

    def length(self, n: int, available: int, context: int) -> tuple[int, Plan]:
        """How many of ``available`` looked-up tokens of order ``n`` to verify after ``context`` tokens, and the plan."""
        planner = self.planner(n).at(context)
        k = planner.plan(0.0, available)
        return k, planner.last

    def observe(self, n: int, drafted: int, accepted: int) -> None:
        """A verified n-gram draft of order ``n`` (also the n-gram branch of a hybrid round, ``auto``)."""
        self.planner(n).observe(drafted, accepted)

    def observe_round(self, rnd: Round, n: int) -> None:
        """After an n-gram round this policy planned (the order ``n`` it was looked up with)."""
        draft = rnd.draft
        if n and n in self.planners:
            self.planners[n].observe(len(draft.tokens), len(rnd.verdict.accepted))
            if draft.tokens:
                self.planners[n].observe_round(rnd.steps, draft.plan)

    def report(self) -> NgramReport:
        return NgramReport({str(n): p.report() for n, p in sorted(self.planners.items())} if self.planners else None)


class NgramDrafter:
    """Drafts a lookup's continuation, as long as its policy says (unplanned: all of it)."""

    taps = Taps()

    def __init__(self, source: NgramLookup, policy: NgramPolicy) -> None:
        self.source, self.policy = source, policy
        self.lookahead = source.max_draft

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.source.begin(state, prefill)
        self.policy.new_prompt()

    def draft(self, state: DecodeState, budget: int) -> Draft:
        cont, n = self.source.candidate(state, budget)
        if not cont:
            return NoDraft()
        if not self.policy.planned:
            return Chain(cont, note=NgramNote(n))
        cont = state.through_stop(cont)
        k, plan = self.policy.length(n, len(cont), state.pos)
        return Chain(cont[:k], note=NgramNote(n), plan=plan) if k else NoDraft(plan=plan)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        # the n-gram order the chain was looked up with
        n = draft.note.n if isinstance(draft, Chain) and isinstance(draft.note, NgramNote) else None
        if n:
            self.policy.observe_round(rnd, n)

    def end(self) -> NgramReport:
        return self.policy.report()
