"""Choosing a drafting source per round: the best expected gain among sources, taking turns
when none pays.

Each source is a :class:`~.driver.Proposer` that also answers ``expected_gain(state, budget)``:
its planner's best expected tokens per plain step at its measured draft cost and acceptance
(:class:`~.planning.Planner`), or None when it cannot draft this round. The round goes to the
source with the highest gain (ties: the one listed first), which then plans its own draft
length and may still decline or probe. When no source pays (every gain at most 1), the
sources take turns, so that each one's own probes still run and its statistics stay
measured. Used for a layer-skip method's skip set against full depth on the same quantized
weights (:func:`~selfspec_cli.decoding.layer_skip.skip_or_full_depth`) and by ``auto``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .drafts import Draft, NoDraft, Round
from .driver import Proposer
from .state import DecodeState


class Option(NamedTuple):
    """A source to choose from, under ``name``; ``available`` (None: always) says whether it
    may be chosen this round."""

    name: str
    source: Any  # a Proposer with expected_gain(state, budget) -> float | None
    available: Callable[[], bool] | None = None


class Choose(Proposer):
    """Per round, the source of highest expected gain (see the module docstring)."""

    def __init__(self, options: Sequence[Option]) -> None:
        first = options[0].source
        super().__init__(first.engine, first.tokenizer)
        self.options = list(options)
        self.lookahead = max(o.source.lookahead for o in self.options)
        self.last: Any = None  # the source chosen this round (None: none could draft)
        self.last_name: str | None = None
        self._turn = 0

    @property
    def curve(self) -> Any:  # type: ignore[override]
        return next((o.source.curve for o in self.options if o.source.curve is not None), None)

    def prefill_options(self) -> dict[str, Any]:
        """What any source's prefill needs (a layer-skip source's attention cosines)."""
        return {k: v for o in self.options for k, v in o.source.prefill_options().items()}

    def gains(self, state: DecodeState | None, budget: int) -> list[tuple[float, Option]]:
        """The expected gain of every source that can draft this round, in the options' order."""
        out = []
        for option in self.options:
            if option.available is not None and not option.available():
                continue
            g = option.source.expected_gain(state, budget)
            if g is not None:
                out.append((g, option))
        return out

    def expected_gain(self, state: DecodeState | None, budget: int) -> float | None:
        gains = self.gains(state, budget)
        return max(g for g, _ in gains) if gains else None

    def pick(self, state: DecodeState | None, budget: int) -> Any:
        """This round's source (None: none can draft)."""
        gains = self.gains(state, budget)
        if not gains:
            self.last = self.last_name = None
            return None
        if max(g for g, _ in gains) <= 1.0 and len(gains) > 1:  # none pays: turns, so that each still probes
            self._turn = (self._turn + 1) % len(gains)
            option = gains[self._turn][1]
        else:
            option = max(gains, key=lambda go: go[0])[1]
        self.last, self.last_name = option.source, option.name
        return option.source

    def begin(self, state: DecodeState, prefill: Any) -> None:
        for option in self.options:
            option.source.begin(state, prefill)

    def propose(self, state: DecodeState, budget: int) -> Draft:
        source = self.pick(state, budget)
        return NoDraft() if source is None else source.propose(state, budget)

    def update(self, state: DecodeState, rnd: Round) -> None:
        if self.last is not None:
            self.last.update(state, rnd)

    def describe(self) -> dict[str, Any]:
        return {o.name: o.source.describe() for o in self.options}
