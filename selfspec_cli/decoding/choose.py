"""Choosing a drafting source per round: the best expected gain among sources, taking turns
when none pays.

Each source is a :class:`~.driver.Drafter` with its :class:`~.driver.DraftPolicy`, whose
``gain(state, budget)`` is its planner's best expected tokens per plain step at its measured
draft cost and acceptance (:class:`~.planning.Planner`), or None when it cannot draft this round.
The choice is a policy of its own, :class:`BestOf`: the round goes to the source with the
highest gain (ties: the one listed first), which then plans its own draft length and may still
decline or probe. When no source pays (every gain at most 1), the sources take turns, so that
each one's own probes still run and its statistics stay measured. :class:`Choose` is the
drafter that drafts with the chosen source. Used for a layer-skip method's skip set against
full depth on the same quantized weights (:class:`~.layer_skip.SkipOrFullDepth`) and by ``auto``.
Invariant: a source's policy is asked exactly as often, and in the same order, as when each
source answered for itself (its probes count the rounds it is asked).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..engine import ForwardOutput
from .measure import VerifyCurve
from .drafts import Draft, NoDraft, Round
from .driver import Drafter, DraftPolicy, Taps
from .output import ByName
from .state import DecodeState


class Option(NamedTuple):
    """A source to choose from, under ``name``: its drafter and that drafter's policy; ``available``
    (None: always) says whether it may be chosen this round."""

    name: str
    drafter: Drafter
    policy: DraftPolicy
    available: Callable[[], bool] | None = None


class BestOf:
    """The choice's policy: per round, the option of highest expected gain (see the module docstring)."""

    def __init__(self, options: Sequence[Option]) -> None:
        self.options = list(options)
        self.last: Option | None = None  # the option chosen this round (None: none could draft)
        self._turn = 0

    @property
    def curve(self) -> VerifyCurve | None:
        return next((o.policy.curve for o in self.options if o.policy.curve is not None), None)

    def gains(self, state: DecodeState | None, budget: int) -> list[tuple[float, Option]]:
        """The expected gain of every source that can draft this round, in the options' order."""
        out = []
        for option in self.options:
            if option.available is not None and not option.available():
                continue
            g = option.policy.gain(state, budget)
            if g is not None:
                out.append((g, option))
        return out

    def gain(self, state: DecodeState | None, budget: int) -> float | None:
        gains = self.gains(state, budget)
        return max(g for g, _ in gains) if gains else None

    def pick(self, state: DecodeState | None, budget: int) -> Option | None:
        """This round's option (None: none can draft)."""
        gains = self.gains(state, budget)
        if not gains:
            self.last = None
            return None
        if max(g for g, _ in gains) <= 1.0 and len(gains) > 1:  # none pays: turns, so that each still probes
            self._turn = (self._turn + 1) % len(gains)
            option = gains[self._turn][1]
        else:
            option = max(gains, key=lambda go: go[0])[1]
        self.last = option
        return option


class Choose:
    """Drafts with the source its policy (``best``) picks each round; the chosen source's drafter
    learns the round."""

    def __init__(self, best: BestOf) -> None:
        self.best = best
        self.lookahead = max(o.drafter.lookahead for o in best.options)
        taps = Taps()
        for o in best.options:  # what any source's forwards need (a layer-skip source's attention cosines)
            taps = taps | o.drafter.taps
        self.taps = taps

    @property
    def policy(self) -> BestOf:
        return self.best

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        for option in self.best.options:
            option.drafter.begin(state, prefill)

    def draft(self, state: DecodeState, budget: int) -> Draft:
        option = self.best.pick(state, budget)
        return NoDraft() if option is None else option.drafter.draft(state, budget)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        if self.best.last is not None:
            self.best.last.drafter.accept(state, rnd)

    def end(self) -> ByName:
        return ByName({o.name: o.drafter.end() for o in self.best.options})
