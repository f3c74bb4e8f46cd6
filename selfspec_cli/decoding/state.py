"""The decode state of one prompt: the KV cache, the committed tokens, the tokens in flight.

Drafters and the driver touch the cache only through this object, so no method
does position or cache-length arithmetic:

* ``committed``: prompt + emitted tokens. The newest one, ``pending``, is not yet in
  the cache; between rounds every other committed token is, at every layer a
  lossless method has run (``pos`` is the pending token's position);
* ``in_flight``: tokens fed to the model but not verified (layer-skip drafts,
  AdaDecode's early predictions);
* :meth:`run` (extend) runs the newest fed rows through a range of layers, at the
  positions those tokens hold, on a drafter's :class:`~selfspec_cli.engine.route.Route` (its skip
  sets, weights copy, KV window, head; the forward's options are typed, never free keywords);
  :meth:`feed` adds a token in flight;
* :meth:`verify_forward` drops whatever drafting wrote past ``pos`` and runs the
  pending token plus a chain or tree of drafts at full depth; :meth:`commit` keeps
  the accepted chain prefix or tree path (accept-path) and drops the rest;
* :meth:`commit_decided` commits tokens a lossy drafter decided without a
  verification forward (SpecEE), whose rows it has already run;
* :meth:`replay` is a teacher-forced forward over committed tokens in scratch
  slots (SWIFT's scoring), restored on exit.

The cache records every slot's position and refuses out-of-order writes (see
:mod:`selfspec_cli.engine.cache`), so a drafter that mixes up rows fails loudly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar

import torch

from ..config import SamplingConfig
from ..engine import NO_TAPS, TARGET, Engine, ForwardOutput, ForwardTaps, Route
from ..engine.runner import ALL_ROWS, LAST_ROW
from ..engine.tree import tree_depths, tree_mask_from_parents, tree_positions
from .sampling import PositionNoise

PREFILL_CHUNK = 256  # prompt rows per prefill forward (DecodeState.prefill)
# Called after each prefill chunk with (prompt rows done, prompt rows): a caller's progress (cli/generate.py sets
# it around a turn); the chunks are the prefill's own, so watching it changes nothing it computes.
PREFILL_PROGRESS: ContextVar[Callable[[int, int], None] | None] = ContextVar("prefill_progress", default=None)


class DecodeState:
    def __init__(self, engine: Engine, prompt_ids: Sequence[int], *, max_new_tokens: int, lookahead: int,
                 sampling: SamplingConfig, generator: torch.Generator | None, eos: frozenset[int] = frozenset(),
                 noise: PositionNoise | None = None) -> None:
        if not prompt_ids:
            raise ValueError("an empty prompt has nothing to condition on")
        self.engine = engine
        self.prompt_len = len(prompt_ids)
        self.committed: list[int] = [int(t) for t in prompt_ids]
        self.in_flight: list[int] = []
        self.sampling = sampling
        self.generator = generator
        self.noise = noise  # sampling rule gumbel: the per-position noise (decoding/sampling.py)
        self.eos = eos
        # the one place capacity is computed: prompt + output + what a round may write beyond it
        self.cache = engine.new_cache(self.prompt_len + max_new_tokens + lookahead + 2)

    # -- views -------------------------------------------------------------
    @property
    def pending(self) -> int:
        return self.committed[-1]

    @property
    def pos(self) -> int:
        """Position of the pending token (== number of committed tokens in the cache)."""
        return len(self.committed) - 1

    @property
    def output(self) -> list[int]:
        return self.committed[self.prompt_len :]

    @property
    def next_position(self) -> int:
        """Position of the token drafted next (after the committed and in-flight tokens)."""
        return len(self.committed) + len(self.in_flight)

    def row_positions(self, n_rows: int, parents: Sequence[int] | None = None) -> list[int]:
        """Positions of the tokens a verification's rows predict: row 0 (the pending token's)
        predicts ``pos + 1``; a chain's row ``i`` ``pos + 1 + i``; a tree node's row, the
        position after its own."""
        if parents is None:
            return [self.pos + 1 + i for i in range(n_rows)]
        return [self.pos + 1] + [self.pos + 2 + d for d in tree_depths(list(parents))]

    def through_stop(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` up to and including the first stop token: nothing after an end of
        sequence can be emitted, so a draft never needs to hold it."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        return list(tokens[:end])

    def ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long, device=self.engine.device)

    # -- extend ------------------------------------------------------------
    def prefill(self, taps: ForwardTaps = NO_TAPS, logits_rows: slice | None = LAST_ROW) -> ForwardOutput:
        """The prompt at full depth; call once, before anything is committed after it.

        A prompt longer than :data:`PREFILL_CHUNK` rows runs in chunks of that many (the last one
        returns the output), so a long prompt's activations stay a bounded transient: 45 MB for a
        1,500-token prompt of the default model in one forward, 17 MB in chunks of 512. The chunks give
        the very bits of one forward (the kernels are batch-invariant and each row attends the same
        keys; tests/test_decoding.py), and :data:`PREFILL_PROGRESS` hears of each. A forward asked for
        per-row extras over the whole prompt (ASD's attention cosines, hidden states) runs in one piece,
        as those cover every row (``taps``, what the drafter's :class:`~.driver.Taps` ask)."""
        ids = self.ids(self.committed)
        n = ids.shape[0]
        progress = PREFILL_PROGRESS.get()
        if n > PREFILL_CHUNK and not taps.per_row:
            last = (n - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # the final chunk's first row: it has 1..CHUNK rows
            for s in range(0, last, PREFILL_CHUNK):  # the same options, no logits
                self.engine.forward(self.cache, ids[s:s + PREFILL_CHUNK], positions=s, taps=taps, logits_rows=None)
                if progress is not None:
                    progress(s + PREFILL_CHUNK, n)
            out = self.engine.forward(self.cache, ids[last:], positions=last, taps=taps, logits_rows=logits_rows)
        else:
            out = self.engine.forward(self.cache, ids, positions=0, taps=taps, logits_rows=logits_rows)
        if progress is not None:
            progress(n, n)
        return out

    def feed(self, token: int) -> None:
        """Put a draft token in flight (it becomes the newest fed token)."""
        self.in_flight.append(int(token))

    def run(self, ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None, *, start: int = 0,
            end: int | None = None, route: Route = TARGET, taps: ForwardTaps = NO_TAPS,
            logits_rows: slice | None = LAST_ROW) -> ForwardOutput:
        """Run the newest ``T`` fed tokens (as ids, or as residual rows from an earlier
        call) through layers ``[start, end)``, at their own positions, on ``route`` (a draft's
        computation; :data:`~selfspec_cli.engine.route.TARGET`, the target's)."""
        t = ids.shape[0] if ids is not None else hidden.shape[0]
        fed = len(self.committed) + len(self.in_flight)
        return self.engine.forward(self.cache, ids, hidden=hidden, positions=fed - t, start=start, end=end, route=route,
                                   taps=taps, logits_rows=logits_rows)

    def verify_forward(self, tokens: Sequence[int], parents: Sequence[int] | None = None,
                       taps: ForwardTaps = NO_TAPS) -> ForwardOutput:
        """Full-depth forward of the pending token and a chain (or tree, ``parents``) of
        draft tokens on the target's route; logits for every row, and what ``taps`` ask.
        Drafting's slots past ``pos`` are dropped first."""
        self.rollback()
        inp = self.ids([self.pending, *tokens])
        if parents is None:
            return self.engine.forward(self.cache, inp, positions=self.pos, logits_rows=ALL_ROWS, taps=taps)
        tree = [-1] + [p + 1 for p in parents]
        dev = self.engine.device
        return self.engine.forward(self.cache, inp, positions=tree_positions(tree, self.pos, dev),
                                   tree_mask=tree_mask_from_parents(tree, dev), logits_rows=ALL_ROWS, taps=taps)

    # -- commit / rollback -------------------------------------------------
    def commit(self, tokens: Sequence[int], accepted: Sequence[int], tree: bool = False) -> None:
        """Keep the pending token plus the accepted drafts (chain prefix, or tree path by
        node index) in the cache, drop every other slot past ``pos``, and commit
        ``tokens`` (the accepted drafts and the target's next token)."""
        first = self.pos + 1
        if tree:
            self.cache.compact([first + i for i in accepted], first)
        else:
            self.cache.crop(first + len(accepted))
        self.commit_decided(tokens)

    def commit_decided(self, tokens: Sequence[int]) -> None:
        """Commit tokens a (lossy) drafter chose itself; the rows it ran stay cached."""
        self.committed.extend(int(t) for t in tokens)
        self.in_flight.clear()
        if self.noise is not None:
            self.noise.forget_before(len(self.committed))

    def rollback(self) -> None:
        """Drop everything past ``pos`` at every layer, and the tokens in flight."""
        self.cache.crop(self.pos)
        self.in_flight.clear()

    # -- scratch -----------------------------------------------------------
    def replay(self, first: int, count: int, *, route: Route = TARGET, logits_rows: slice | None = LAST_ROW
               ) -> ForwardOutput:
        """Teacher-forced forward over ``committed[first : first + count]`` on ``route``, written in
        scratch slots from ``first`` on (the cache must hold positions ``0..first-1``
        densely); everything is restored afterwards."""
        with self.cache.scratch(first, count):
            return self.engine.forward(self.cache, self.ids(self.committed[first : first + count]), positions=first,
                                       route=route, logits_rows=logits_rows)
