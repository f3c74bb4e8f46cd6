"""What an engine forward computes, and what it reports beside the logits: two named, typed values.

A drafter's draft forward differs from the target's in *which computation runs* (a :class:`Route`: the
sublayers it skips, the weights copy it reads, its view of a long context, the head that scores it) and a
forward may be asked to *report more* than its logits (:class:`ForwardTaps`: hidden states at some
layers, per-layer attention cosines). :meth:`~.runner.Engine.forward` takes one of each instead of free
keyword arguments, so a new need of a drafter is one new field here, read by the engine's internals, and
not an argument threaded through the engine, its fixed-shape path and every caller (docs/design.md,
"Drafters and policies").

Invariants:

* both are frozen and hashable (a drafter builds its route once per draft, a fixed-shape forward keys its
  captured graphs by the sets); skip sets are normalized to ``frozenset`` and hidden-state layers to a
  tuple without repeats, in the caller's order, so equal needs compare equal;
* a layer index is a non-negative int (refused here); that it names a layer of *this* model is checked by
  the engine (:meth:`Route.deepest`, :meth:`ForwardTaps.deepest`), which refuses the forward with one
  ``ValueError`` instead of silently running every layer;
* the defaults, :data:`TARGET` and :data:`NO_TAPS`, are the target's own full forward reporting logits
  only: a route with every field at its default computes exactly what the target does.

The forward's *range* (``start``/``end``, with ``hidden`` rows as input: AdaDecode's and SpecEE's deferred
layers) stays a plain argument of the forward: it changes from call to call within one round and says
where the rows are, not which computation a drafter runs.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def _layers(name: str, values: Iterable[int]) -> tuple[int, ...]:
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: a layer index is a non-negative int, got {v!r}")
    return out


@dataclass(frozen=True, slots=True)
class Route:
    """Which computation a forward runs (the defaults: the target's own, :data:`TARGET`).

    ``skip_attn`` / ``skip_mlp``: the sublayers that add nothing to the residual stream (a skipped
    attention writes no K/V); ``weights``: the quantized draft copy the matrix products read (a precision
    name, :meth:`~.runner.Engine.quantized`; None: the target's own); ``kv_window`` = (sinks, window): the
    draft's view of a long context (the first ``sinks`` keys and the newest ``window``; None: everything);
    ``head``: the head that scores the last rows (a :meth:`~.runner.Engine.subset_head`; None: the whole
    vocabulary, the ``weights`` copy's head when there is one)."""

    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()
    weights: str | None = None
    kv_window: tuple[int, int] | None = None
    head: Any = None  # compared and hashed by identity (__eq__, __hash__): a head holds tensors

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip_attn", frozenset(_layers("skip_attn", self.skip_attn)))
        object.__setattr__(self, "skip_mlp", frozenset(_layers("skip_mlp", self.skip_mlp)))
        if self.kv_window is not None:
            sinks, window = self.kv_window
            if sinks < 0 or window < 1:
                raise ValueError(f"kv_window: (sinks >= 0, window >= 1), got {self.kv_window!r}")
            object.__setattr__(self, "kv_window", (int(sinks), int(window)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Route):
            return NotImplemented
        return (self.skip_attn == other.skip_attn and self.skip_mlp == other.skip_mlp and self.weights == other.weights
                and self.kv_window == other.kv_window and self.head is other.head)

    def __hash__(self) -> int:
        return hash((self.skip_attn, self.skip_mlp, self.weights, self.kv_window, id(self.head)))

    @property
    def deepest(self) -> int:
        """The highest layer index the route names (-1: none)."""
        return max(max(self.skip_attn, default=-1), max(self.skip_mlp, default=-1))

    @property
    def is_target(self) -> bool:
        """Whether the route reads the target's own weights, head and whole context (skips aside)."""
        return self.weights is None and self.head is None and self.kv_window is None


@dataclass(frozen=True, slots=True)
class ForwardTaps:
    """What a forward reports beside the logits (the defaults: nothing, :data:`NO_TAPS`).

    ``hidden_at``: the layers whose residual stream (after the layer) the forward returns
    (``ForwardOutput.hidden_at``); ``attn_cosine``: the mean cosine between the residual stream before and
    after each attention sublayer run (``ForwardOutput.attn_cosine``; ASD's skip source)."""

    hidden_at: tuple[int, ...] = ()
    attn_cosine: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_at", tuple(dict.fromkeys(_layers("hidden_at", self.hidden_at))))
        object.__setattr__(self, "attn_cosine", bool(self.attn_cosine))

    @property
    def deepest(self) -> int:
        """The highest layer index the taps name (-1: none)."""
        return max(self.hidden_at, default=-1)

    @property
    def per_row(self) -> bool:
        """Whether the taps report something over every row (a prefill then runs in one piece)."""
        return self.attn_cosine or bool(self.hidden_at)


TARGET = Route()
NO_TAPS = ForwardTaps()
