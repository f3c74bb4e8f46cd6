"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) as a
selfspec proposer: n-gram drafts from the context so far (prompt and output), free to make.

Each round, the longest suffix of the committed tokens of ``pld_max_ngram`` down to
``pld_min_ngram`` tokens that occurred earlier in the context is looked up (the most
recent earlier occurrence wins), and the tokens that followed it are the draft. The
draft is deterministic, so the driver verifies it exactly: greedy by prefix match,
sampling by speculative sampling with a point-mass draft law (accept ``d`` with
probability ``p(d)``, else resample from ``p`` without ``d``), which emits exactly the
target's distribution.

Cost-aware (default): drafting a lookup costs no model forward, but verifying ``k``
drafts costs ``v(k + 1)`` plain steps; a :class:`~selfspec_cli.decoding.planning.Planner`
per n-gram length tracks acceptance by depth and chooses how many of the looked-up
tokens to verify (none when they do not pay).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..decoding.cost_store import curve_for
from ..decoding.planning import Overhead, Planner
from ..decoding.drafts import Chain, Draft, NgramNote, NoDraft, Round
from ..decoding.state import DecodeState
from ..engine import Engine
from ..errors import FieldError
from .base import SelfProposing, option, require


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


@dataclass(frozen=True)
class PLDConfig:
    pld_max_ngram: int = option(3, "longest suffix n-gram looked up in the context")
    pld_min_ngram: int = option(1, "shortest suffix n-gram looked up")
    max_draft: int = option(10, "most draft tokens per round")
    paper_drafting: bool = option(False, "verify every looked-up token, as transformers' prompt lookup does, "
                                         "without planning from measured costs (can be slower than ar)")

    def __post_init__(self) -> None:
        if not 1 <= self.pld_min_ngram <= self.pld_max_ngram:
            raise FieldError("pld_min_ngram/pld_max_ngram", f"need 1 <= min <= max, got {self.pld_min_ngram}, {self.pld_max_ngram}")
        require(self.max_draft >= 1, "max_draft", ">= 1", self.max_draft)


class PromptLookup(SelfProposing):
    name = "pld"
    lossless = True
    description = "prompt lookup: n-gram drafts from the prompt and the output so far, cost-aware"
    Config = PLDConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: PLDConfig | None = None) -> None:
        super().__init__(engine, tokenizer, config)
        self.lookahead = self.config.max_draft
        self.planners: dict[int, Planner] = {}  # n-gram length -> its planner (longer matches draft better)
        self.overhead = Overhead()  # a lookup round costs the same whatever the n-gram length: one average
        self._last_lookup: tuple[Any, tuple[list[int], int]] = (None, ([], 0))
        if not self.config.paper_drafting:
            self.curve = curve_for(engine)  # measured now (once per engine), not inside a timed decode

    def planner(self, n: int) -> Planner:
        if n not in self.planners:
            self.curve = curve_for(self.engine)
            self.planners[n] = Planner(self.curve, self.config.max_draft, overhead=self.overhead)
        return self.planners[n]

    def begin(self, state: DecodeState, prefill: Any) -> None:
        self._last_lookup = (None, ([], 0))  # a new state may reuse a freed one's id

    def candidate(self, state: DecodeState, budget: int) -> tuple[list[int], int]:
        """This round's lookup (computed once per round: ``auto`` asks before proposing)."""
        c = self.config
        key = (id(state), len(state.committed), budget)
        if self._last_lookup[0] != key:
            self._last_lookup = (key, lookup(state.committed, c.pld_max_ngram, c.pld_min_ngram, min(c.max_draft, budget)))
        return self._last_lookup[1]

    def expected_gain(self, state: DecodeState, budget: int) -> float | None:
        """The best expected gain of this round's lookup (None: nothing looked up)."""
        cont, n = self.candidate(state, budget)
        return self.planner(n).at(state.pos).best(0.0, len(cont))[1] if cont else None

    def propose(self, state: DecodeState, budget: int) -> Draft:
        cont, n = self.candidate(state, budget)
        if not cont:
            return NoDraft()
        if self.config.paper_drafting:
            return Chain(cont, note=NgramNote(n))
        cont = state.through_stop(cont)
        planner = self.planner(n).at(state.pos)
        k = planner.plan(0.0, len(cont))
        return Chain(cont[:k], note=NgramNote(n), plan=planner.last) if k else NoDraft(plan=planner.last)

    def update(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        # the n-gram order the chain was looked up with
        n = draft.note.n if isinstance(draft, Chain) and isinstance(draft.note, NgramNote) else None
        if n and n in self.planners:
            self.planners[n].observe(len(draft.tokens), len(rnd.verdict.accepted))
            if draft.tokens:
                self.planners[n].observe_round(rnd.steps, draft.plan)

    def describe(self) -> dict[str, Any]:
        return {"cost_model": {str(n): p.report() for n, p in sorted(self.planners.items())}} if self.planners else {}


def hybrid_branch(engine: Engine, tokenizer: Any) -> PromptLookup:
    """The n-gram branch that a layer-skip method merges into its hybrid drafts: prompt lookup's defaults
    (``LayerSkipMethod.ngram_source``)."""
    return PromptLookup(engine, tokenizer, PLDConfig())
