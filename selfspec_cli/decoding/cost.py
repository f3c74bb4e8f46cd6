"""Cost-aware drafting: how far to draft, from measured costs and measured acceptance.

A round that drafts a chain of ``k`` tokens and verifies it emits, in expectation,

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j

tokens, where ``a_j`` is the probability that draft depth ``j`` is accepted given that
depth ``j - 1`` was (tracked online per proposer, :class:`Acceptance`; a full-depth quantized
draft starts from its measured agreement, :func:`draft_agreement`). In units of one
plain decoding step T(1) the round costs ``k c + v(k + 1)``: ``c`` is one draft step
(measured online, from a stored or timed first value: :func:`draft_cost_for`; 0 for n-gram
drafts) and ``v(m)`` one full-depth forward of ``m`` rows (:class:`VerifyCurve`, one reading
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

Every cost is measured with :func:`timed` (wall time, with a device synchronize on each
side on CUDA), which the runtime, calibration and the bench time with too.

**Costs on disk** (:mod:`.cost_store`). The curve and each timed draft's c are kept per
machine (model, precision, threads, kernel build, device, CPU), so that a process reads
them instead of timing about 160 forwards first. A machine with nothing stored takes a
short reading (:data:`SHORT_ROWS`, :data:`SHORT_ROUNDS` passes, no slope: about an eighth
of the full reading's time) and says so in one line on stderr; every process's rounds then refine the
store at its exit, and ``selfspec profile`` takes the full reading (``--remeasure``: a fresh
one). An engine in :func:`measure_fresh` mode (the bench) measures everything itself, as
before the store, and stores what it measured. Invariant: a running process plans with the
reading it started with; the store changes only what the next process reads.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..engine import Engine
from ..engine.kernels import stream_bytes
from ..errors import ArtifactError
from ..paths import atomic_write
from . import cost_store
from .drafts import Plan

T = TypeVar("T")

# up to the longest verify the default planners make (specqd: 25 drafts and the pending token), so that
# v is read between measured rows, not extrapolated (docs/engine.md)
CURVE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PROBE_BUDGET = 0.01  # share of a plain step a source that does not draft saves up per round, to probe
CURVE_ROUNDS = 11  # timed passes per row count (after one warm-up pass); the median is kept (docs/engine.md)
SLOPE_EXTRA = 512  # T(1)'s growth with the context: read after this many more tokens than the curve's context
SLOPE_ROWS = 8  # ... and a verify forward's, from one of this many rows (VerifyCurve.row_slope_s)
# a first reading on a machine with no stored costs (VerifyCurve.for_engine): the powers of two up to 16 rows
# (v beyond 16 rows extrapolated from 8 and 16 until rounds fill the table), 3 passes, and no slope (its
# long prefill would cost as much again; the rounds of later runs fit it): about an eighth of the full
# reading's time, 2.0-2.2 s against about 18 s on a busy 2-core host (docs/engine.md, "Costs on disk")
SHORT_ROWS = (1, 2, 4, 8, 16)
SHORT_ROUNDS = 3
_CURVES: "weakref.WeakKeyDictionary[Engine, VerifyCurve]" = weakref.WeakKeyDictionary()
_READINGS: "weakref.WeakKeyDictionary[Engine, list[VerifyCurve]]" = weakref.WeakKeyDictionary()
_FRESH: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # engines that measure their costs themselves (measure_fresh)
_KEYS: "weakref.WeakKeyDictionary[Engine, dict[str, str]]" = weakref.WeakKeyDictionary()  # cost_store.machine_key
_ONLINE: "weakref.WeakKeyDictionary[Engine, cost_store.Online]" = weakref.WeakKeyDictionary()


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``fn()`` and its wall time, with a device synchronize on each side on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    res = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return res, time.perf_counter() - t0


@dataclass(frozen=True)
class VerifyCurve:
    """``v(m)``: a full-depth forward of ``m`` rows over one of one row, and T(1) in seconds
    after ``context`` tokens. A plain step grows with the context it attends to (on the
    default model at 1 thread, about 20 % from 64 to 800 tokens): ``t1_at(n)`` is T(1)
    after ``n`` tokens, linear in ``n`` with the slope ``slope_s`` measured beside it, so
    that a draft step or a round measured in seconds at a long context is put in units of
    the plain step *there*, which is what plain decoding would spend.

    A forward of ``m`` rows grows faster with the context than one of one row: every row
    attends to every cached key (though the rows after the first find the keys in cache, so
    not ``m`` times as fast: on the default model's block target, 1 thread, T(2), T(5) and
    T(8) grew 1.5, 2.8 and 4.0 times as fast as T(1) from 64 to 800 tokens). ``row_slope_s``
    is the growth each row after the first adds, read beside ``slope_s`` from an 8-row
    forward, and :meth:`v_at` is v at a given context, ``(v(m) T(1) + (slope_s + (m - 1)
    row_slope_s) (n - context)) / t1_at(n)``, which the planners use: taking v as fixed
    under-priced a 5-row verify by 18 % at 800 tokens."""

    t1_s: float
    ratios: dict[int, float]
    context: int = 64
    slope_s: float = 0.0  # seconds per context token of a one-row step
    times_s: dict[int, float] = field(default_factory=dict)  # the medians behind the ratios, seconds
    readings: int = 1  # how many readings it pools (VerifyCurve.refresh)
    row_slope_s: float | None = None  # seconds per context token each row after the first adds (None: not read)

    def t1_at(self, context: int) -> float:
        return self.t1_s + self.slope_s * max(0, context - self.context)

    def v_at(self, m: int, context: int | None) -> float:
        """v(m) after ``context`` tokens (None, or a curve without a row slope: :meth:`v`)."""
        if context is None or self.row_slope_s is None or context <= self.context:
            return self.v(m)
        extra = context - self.context
        return (self.v(m) * self.t1_s + (self.slope_s + (m - 1) * self.row_slope_s) * extra) / self.t1_at(context)

    def v(self, m: int) -> float:
        if m in self.ratios:
            return self.ratios[m]
        rows = sorted(self.ratios)
        # beyond the table: linear in the rows, from the last two points; else between the neighbours
        lo, hi = (rows[-2], rows[-1]) if m > rows[-1] else (max(r for r in rows if r < m), min(r for r in rows if r > m))
        x0 = hi if m > hi else lo  # extrapolate from the last point, interpolate from the lower one
        return self.ratios[x0] + (m - x0) * (self.ratios[hi] - self.ratios[lo]) / (hi - lo)

    @property
    def full(self) -> bool:
        """Whether every row count of the full reading (:data:`CURVE_ROWS`) is in the table."""
        return all(m in self.ratios for m in CURVE_ROWS)

    @classmethod
    def for_engine(cls, engine: Engine, full: bool = False) -> VerifyCurve:
        """The engine's curve, kept with it: the planners, ``selfspec profile`` and the bench's engine
        costs all read this one reading (or the pool of :meth:`refresh`). On first use it is read from
        the store of this machine's costs (decoding/cost_store.py: no forward is timed); only when
        none is stored is it measured, and then stored: a **short** reading (:data:`SHORT_ROWS`, about
        an eighth of the full reading's time, said in one line on stderr) so that a first call on a new
        machine does not stall for the full one, which later processes' rounds refine
        (:func:`cost_store.flush`); ``full`` (``selfspec profile``) takes the full reading (about 160
        forwards, 5-6 s on the default model) when what is kept or stored lacks some of its rows.
        An engine in :func:`measure_fresh` mode measures the full reading itself, as before there was
        a store, and stores it."""
        if engine in _CURVES and (engine in _FRESH or not full or _CURVES[engine].full):
            return _CURVES[engine]
        key = engine_key(engine)
        if engine not in _FRESH:
            stored = cls.from_record(((cost_store.read(key) or {}).get("curve")))
            if stored is not None and (stored.full or not full):
                return cls._keep(engine, stored)
        if full or engine in _FRESH:
            curve = cls.measure(engine)
            cost_store.update(key, curve=curve.to_record())
            return cls._keep(engine, curve)
        t0 = time.perf_counter()
        curve = cls.measure(engine, rounds=SHORT_ROUNDS, rows=SHORT_ROWS, extra=0)
        where = cost_store.update(key, curve=curve.to_record())
        print(f"selfspec: no engine costs stored for this machine; measured a short verify curve "
              f"({len(SHORT_ROWS)} row counts x {SHORT_ROUNDS} passes, {time.perf_counter() - t0:.1f} s)"
              f"{f' into {where}' if where else ' (the cache is not writable: not stored)'}; later runs read it "
              "and refine it from their rounds ('selfspec profile' takes a full reading)", file=sys.stderr)
        return cls._keep(engine, curve)

    @classmethod
    def _keep(cls, engine: Engine, curve: VerifyCurve) -> VerifyCurve:
        """Make ``curve`` the engine's, its first reading, and let the engine's rounds refine the store."""
        _CURVES[engine] = curve
        _READINGS[engine] = [curve]
        _ONLINE[engine] = cost_store.online(engine_key(engine))
        return curve

    @classmethod
    def refresh(cls, engine: Engine) -> VerifyCurve | None:
        """Take another reading and pool it with the earlier ones (:meth:`pool`); planners made
        from now on read the pool, and the store keeps it. One reading is a few seconds of a shared
        host, whose speed drifts by several per cent from minute to minute (docs/engine.md); a long
        run (the bench, between its passes) pools many. Nothing when this engine has no curve yet."""
        if engine not in _CURVES:
            return None
        readings = _READINGS.setdefault(engine, [])  # a curve set from outside (a test's) is not a reading
        readings.append(cls.measure(engine, _CURVES[engine].context))
        _CURVES[engine] = cls.pool(readings)
        if engine in _ONLINE:  # a reading of this machine, not a test's curve
            cost_store.update(engine_key(engine), curve=_CURVES[engine].to_record())
        return _CURVES[engine]

    @classmethod
    def pool(cls, readings: list[VerifyCurve]) -> VerifyCurve:
        """Per row count the median of the readings' times (over the readings that have that row
        count: a short reading pools with full ones), and the median slope; v from those."""
        rows = sorted({m for r in readings for m in r.times_s})
        times = {m: statistics.median(r.times_s[m] for r in readings if m in r.times_s) for m in rows}
        row_slopes = [r.row_slope_s for r in readings if r.row_slope_s is not None]
        pooled = cls._from_times(times, readings[0].context, statistics.median(r.slope_s for r in readings),
                                 row_slope_s=statistics.median(row_slopes) if row_slopes else None)
        return dataclasses.replace(pooled, readings=sum(r.readings for r in readings))

    @classmethod
    def measure(cls, engine: Engine, context: int = 64, rounds: int = CURVE_ROUNDS, rows: tuple[int, ...] = CURVE_ROWS,
                extra: int = SLOPE_EXTRA) -> VerifyCurve:
        """Time forwards of ``rows`` rows (by default ``CURVE_ROWS``) after a ``context``-token prefix,
        ``rounds`` interleaved passes after one warm-up pass; per size the **median** (the fastest pass
        undershoots what plain decoding spends per step on a shared machine, so predictions
        read high, and it moves more from run to run than the median; docs/engine.md); the slopes
        over ``extra`` more tokens (none below 64: 0, and no row slope)."""
        med = _median_forward_s(engine, context, {m: (m, {"logits_rows": slice(None)}) for m in rows}, rounds)
        slope, row_slope = cls._slopes(engine, context, med, rounds, extra)
        return cls._from_times(med, context, slope, row_slope_s=row_slope)

    @classmethod
    def _from_times(cls, times: dict[int, float], context: int, slope_s: float, readings: int = 1,
                    row_slope_s: float | None = None) -> VerifyCurve:
        # v is non-decreasing in the rows (a noisy reading must not make more rows look cheaper): the running
        # maximum of the readings, from v(1) = 1
        rows = sorted(times)
        ratios = {m: round(r, 4) for m, r in zip(rows, accumulate((times[m] / times[1] for m in rows), max))}
        return cls(times[1], ratios, context, slope_s, dict(times), readings, row_slope_s)

    def to_record(self) -> dict[str, Any]:
        """The reading as the store keeps it (decoding/cost_store.py): the forward times, not the ratios."""
        return {"context": self.context, "slope_s": self.slope_s, "times_s": {str(m): t for m, t in sorted(self.times_s.items())},
                "readings": self.readings, **({} if self.row_slope_s is None else {"row_slope_s": self.row_slope_s})}

    @classmethod
    def from_record(cls, rec: Any) -> VerifyCurve | None:
        """The curve of a stored record; None for anything that is not a usable one (missing fields,
        T(1) missing or not positive, fewer than two row counts, a negative slope)."""
        try:
            times = {int(m): float(t) for m, t in rec["times_s"].items()}
            context, slope, readings = int(rec["context"]), float(rec["slope_s"]), int(rec.get("readings", 1))
            row_slope = None if rec.get("row_slope_s") is None else float(rec["row_slope_s"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if (1 not in times or len(times) < 2 or context < 1 or readings < 1 or not math.isfinite(slope) or slope < 0
                or not all(m >= 1 and math.isfinite(t) and t > 0 for m, t in times.items())
                or (row_slope is not None and (not math.isfinite(row_slope) or row_slope < 0))):
            return None
        return cls._from_times(times, context, slope, readings, row_slope)

    @staticmethod
    def _slopes(engine: Engine, context: int, med: dict[int, float], rounds: int,
                extra: int = SLOPE_EXTRA) -> tuple[float, float | None]:
        """Seconds per context token of a one-row step (T(1) after ``context + extra`` tokens, fewer where
        the model's positions end sooner, against T(1) after ``context``), and what each row after the
        first adds to that (the same read for :data:`SLOPE_ROWS` rows, when ``med`` has them); never
        negative. ``(0.0, None)`` below 64 extra tokens."""
        extra = min(extra, engine.adapter.max_positions - context - 2)
        if extra < 64:
            return 0.0, None
        m = SLOPE_ROWS if SLOPE_ROWS in med else None
        runs = {1: (1, {})} | ({m: (m, {"logits_rows": slice(None)})} if m else {})
        far = _median_forward_s(engine, context + extra, runs, rounds)
        slope = max(0.0, (far[1] - med[1]) / extra)
        if m is None:
            return slope, None
        return slope, max(0.0, ((far[m] - med[m]) / extra - slope) / (m - 1))


def engine_key(engine: Engine) -> dict[str, str]:
    """The key of the engine's costs in the store (:func:`cost_store.machine_key`), read once per engine."""
    if engine not in _KEYS:
        _KEYS[engine] = cost_store.machine_key(engine)
    return _KEYS[engine]


def measure_fresh(engine: Engine) -> None:
    """From now on the engine measures its costs itself, as before there was a store: the verify
    curve's full reading on first use, c at every :func:`draft_cost_for` (what the bench does, so
    that every run and every pass rests on its own readings; ``selfspec profile --remeasure``). What
    it measures is still stored. A curve the engine already holds is forgotten."""
    _FRESH.add(engine)
    _CURVES.pop(engine, None)
    _READINGS.pop(engine, None)


def observe_forward(engine: Engine, rows: int, seconds: float, context: int) -> None:
    """A verify forward of ``rows`` rows (a plain step: 1) that took ``seconds`` after ``context``
    tokens, for the store's online refresh (cost_store.Online), put at the curve's context. Only
    engines whose curve is this machine's reading, on a CPU (no device synchronize is paid here),
    and row counts of :data:`CURVE_ROWS`."""
    online, curve = _ONLINE.get(engine), _CURVES.get(engine)
    if online is not None and curve is not None and rows in CURVE_ROWS and engine.device.type == "cpu":
        online.observe_forward(rows, seconds * curve.t1_s / curve.t1_at(context), context - curve.context, seconds)


def draft_variant(weights: str | None, skip_attn: frozenset[int], skip_mlp: frozenset[int],
                  vocab_rows: int | None = None) -> str:
    """A draft variant's name in the store: its weights, skip sets and, for a draft that scores a
    draft vocabulary (FR-Spec), the number of tokens its head scores."""
    name = f"{weights or 'target'}/attn{sorted(skip_attn)}/mlp{sorted(skip_mlp)}".replace(" ", "")
    return name if vocab_rows is None else f"{name}/vocab{vocab_rows}"


def observe_draft_step(engine: Engine, weights: str | None, skip_attn: frozenset[int], skip_mlp: frozenset[int],
                       seconds: float, context: int, vocab_rows: int | None = None) -> None:
    """One draft step of this variant took ``seconds`` after ``context`` tokens (a round's draft time
    over its steps), for the store's online refresh of its c (as :func:`observe_forward`)."""
    online, curve = _ONLINE.get(engine), _CURVES.get(engine)
    if online is not None and curve is not None and engine.device.type == "cpu":
        online.observe_draft(draft_variant(weights, skip_attn, skip_mlp, vocab_rows), seconds * curve.t1_s / curve.t1_at(context))


@torch.inference_mode()
def _median_forward_s(engine: Engine, context: int, runs: dict[T, tuple[int, dict[str, Any]]],
                      rounds: int) -> dict[T, float]:
    """Per key of ``runs``, ``(rows, engine options)``: the median seconds of a forward of that many
    rows with those options after a ``context``-token prefix, over ``rounds`` interleaved passes
    after one warm-up pass (so that every key sees the same drifts of the host). The prefilled prefix
    (up to :data:`HELD_PREFIX` tokens) is kept with the engine for the next reading at that context:
    a first call on a new machine reads the verify curve and a quantized draft's c on one prefill."""
    most = max(m for m, _ in runs.values())
    ids = torch.arange(context + most, device=engine.device) % max(2, engine.vocab_size)
    held = _PREFIX.get(engine)
    if held is not None and held[0] == context and held[1].capacity >= context + most + 1:
        cache = held[1]  # the same prefix, prefilled by an earlier reading (a first call takes two: curve and c)
        cache.crop(context)
    else:
        cache = engine.new_cache(context + most + 1)
        engine.forward(cache, ids[:context], positions=0, logits_rows=None)
        if engine.static is None and context <= HELD_PREFIX:  # (a GPU's pooled KV buffer is not held)
            _PREFIX[engine] = (context, cache)
    samples: dict[T, list[float]] = {key: [] for key in runs}
    for r in range(rounds + 1):  # pass 0 warms up
        for key, (m, kw) in runs.items():
            dt = timed(lambda: engine.forward(cache, ids[context : context + m], positions=context, **kw), engine.device)[1]
            if r:
                samples[key].append(dt)
            cache.crop(context)
    return {key: statistics.median(v) for key, v in samples.items()}


def weight_bytes(engine: Engine, skip_attn: frozenset[int] = frozenset(), skip_mlp: frozenset[int] = frozenset(),
                 vocab_rows: int | None = None) -> int:
    """Bytes of target weights one decode step reads with these sublayers skipped: the kept layers'
    matrices, biases and norms, the final norm and the LM head (one embedding row is negligible;
    ``vocab_rows``: a head that scores only that many tokens, an FR-Spec draft vocabulary).
    Batch-1 decoding is memory-bound (docs/engine.md), so a skip set's draft cost is about its
    share of these bytes."""
    a, lins, mat = engine.adapter, engine._lin, stream_bytes  # the target's matrices as it streams them

    def size(*ts: torch.Tensor | None) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    attn = [size(w.attn_norm, w.b_qkv, w.b_o, w.qk_norm, w.post_attn_norm) + mat(lins[l]["qkv"]) + mat(lins[l]["o"])
            for l, w in enumerate(a.layers) if l not in skip_attn]
    mlp = [size(w.mlp_norm, w.b_gate_up, w.b_down, w.post_mlp_norm) + mat(lins[l]["gate_up"]) + mat(lins[l]["down"])
           for l, w in enumerate(a.layers) if l not in skip_mlp]
    head = mat(engine.lm_head)
    if vocab_rows is not None:
        head = head * min(vocab_rows, engine.vocab_size) // engine.vocab_size
    return head + size(a.final_norm) + sum(attn) + sum(mlp)


def prior_draft_cost(engine: Engine, skip_attn: frozenset[int] = frozenset(), skip_mlp: frozenset[int] = frozenset(),
                     full_depth_c: float | None = None, vocab_rows: int | None = None) -> float:
    """c of a draft step before any is timed: the weight bytes it reads over a full step's
    (:func:`weight_bytes`; batch-1 decoding is memory-bound). ``vocab_rows``: the draft's head
    scores only that many tokens (FR-Spec). ``full_depth_c``: the cost of a full-depth step on the
    draft's weights and vocabulary, measured (a quantized copy); None: its bytes too (the target's
    own weights). The one prior for c: calibration's proxy and the layer-skip drafter's rounds
    before its first timed draft step on the target's weights. Bytes, not the share of sublayers
    skipped (the drafter's prior until issue 36): an MLP sublayer reads about three times an
    attention sublayer's bytes and the LM head, never skipped, a fifth of SmolLM2's (more than half
    of Gemma 3's), so the share prices skipping too cheap; the proxy built on bytes ranks skip sets
    as idle measured throughput does (docs/calibrate.md)."""
    full = weight_bytes(engine, vocab_rows=vocab_rows)
    depth = full / weight_bytes(engine) if full_depth_c is None else full_depth_c
    return depth * weight_bytes(engine, skip_attn, skip_mlp, vocab_rows) / full


def draft_step_cost(engine: Engine, weights: str | None, skip_attn: frozenset[int] = frozenset(),
                    skip_mlp: frozenset[int] = frozenset(), context: int = 64, rounds: int = 5,
                    vocab: torch.Tensor | None = None, head: Any = None) -> float:
    """c before the first drafting round: one one-row draft forward with these weights and skip
    sets (``vocab``: its head scores only these token ids, FR-Spec; ``head``: that subset head when
    the caller holds it already) over one one-row target forward, both after a ``context``-token
    prefix, timed in interleaved passes (the median of ``rounds`` each), so that the ratio does not
    depend on how fast the host was when T(1) was read."""
    if head is None and vocab is not None:
        head = engine.subset_head(vocab, weights)
    med = _median_forward_s(engine, context, {"draft": (1, {"skip_attn": skip_attn, "skip_mlp": skip_mlp, "weights": weights,
                                                            "head": head}),
                                              "target": (1, {})}, rounds)
    return med["draft"] / med["target"]


def draft_cost_for(engine: Engine, weights: str | None, skip_attn: frozenset[int] = frozenset(),
                   skip_mlp: frozenset[int] = frozenset(), vocab: torch.Tensor | None = None, head: Any = None) -> float:
    """c of this draft variant on this machine: the stored one (decoding/cost_store.py), else timed
    now (:func:`draft_step_cost`) and stored. An engine in :func:`measure_fresh` mode times it at
    every call, as before there was a store."""
    rows = None if vocab is None else int(vocab.numel())
    variant, key = draft_variant(weights, skip_attn, skip_mlp, rows), engine_key(engine)
    if engine not in _FRESH:
        got = ((cost_store.read(key) or {}).get("draft_costs") or {}).get(variant)
        try:
            c = float(got["c"])
            if math.isfinite(c) and c > 0:
                return c
        except (KeyError, TypeError, ValueError):
            pass  # none stored, or unusable: time it
    c = draft_step_cost(engine, weights, skip_attn, skip_mlp, vocab=vocab, head=head)
    cost_store.update(key, draft_costs={variant: {"c": round(c, 5), "readings": 1}})
    return c


AGREEMENT_TOKENS = 32  # positions of the target's own greedy text a quantized draft's prior is read over
HELD_PREFIX = 128  # the longest measurement prefix kept for the next reading (the slope's long one is not)
_PREFIX: "weakref.WeakKeyDictionary[Engine, tuple[int, Any]]" = weakref.WeakKeyDictionary()  # context -> its prefilled cache
_AGREEMENT: "weakref.WeakKeyDictionary[Engine, dict[tuple, tuple[int, int]]]" = weakref.WeakKeyDictionary()


@torch.inference_mode()
def draft_agreement(engine: Engine, weights: str, context: list[int], tokens: int = AGREEMENT_TOKENS) -> tuple[int, int]:
    """Top-1 hits of one-token drafts at ``weights`` (full depth, over the target's K/V) along
    the target's greedy continuation of ``context`` (``tokens`` positions; a context of at least
    two tokens), and the positions compared: depth 1's acceptance, as `selfspec profile` reads
    it. Measured once per engine and kept beside the draft copy's disk cache (a JSON file,
    written atomically), so that a later process reads it: it costs about ``tokens`` plain and
    draft steps (about 1 s on the default model; docs/engine.md, "Quantized drafts")."""
    key = (weights, tuple(context), tokens)
    memo = _AGREEMENT.setdefault(engine, {})
    if key in memo:
        return memo[key]
    path = engine.quantized(weights).info.get("path")
    digest = hashlib.sha256(json.dumps([list(context), tokens]).encode()).hexdigest()[:16]
    side = Path(f"{path}.agreement-{digest}.json") if path else None
    if side is not None and side.is_file():
        try:
            got = json.loads(side.read_text())
            memo[key] = (int(got["hits"]), int(got["positions"]))
            return memo[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again and rewrite it
    n, hits = len(context), 0
    cache = engine.new_cache(n + tokens + 1)
    engine.forward(cache, torch.tensor(context[:-1], device=engine.device), positions=0)
    tok = context[-1]
    for pos in range(n - 1, n - 1 + tokens):  # the draft's row is cropped before the target's is computed
        x = torch.tensor([tok], device=engine.device)
        guess = int(engine.forward(cache, x, positions=pos, weights=weights).logits[-1].argmax())
        cache.crop(pos)
        tok = int(engine.forward(cache, x, positions=pos).logits[-1].argmax())
        hits += guess == tok
    memo[key] = (hits, tokens)
    if side is not None:
        try:
            atomic_write(side, lambda f: f.write(json.dumps({"hits": memo[key][0], "positions": tokens,
                                                             "weights": weights}).encode()))
        except ArtifactError:
            pass  # a read-only cache only costs the next process the measurement
    return memo[key]


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

    def __post_init__(self) -> None:
        self.reached = [0.0] * (self.max_depth + 1)  # index j: depth j (index 0 unused)
        self.accepted = [0.0] * (self.max_depth + 1)

    def rate(self, depth: int) -> float:
        d = max(1, min(depth, self.max_depth))
        mean = self.prior
        for j in range(1, d + 1):
            mean = (self.accepted[j] + self.prior_weight * mean) / (self.reached[j] + self.prior_weight)
        return mean

    def observe(self, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` tokens of which the first ``accepted`` were accepted."""
        for j in range(1, min(drafted, accepted + 1) + 1):
            d = min(j, self.max_depth)
            self.reached[d] += 1
            self.accepted[d] += j <= accepted


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


def round_cost(curve: VerifyCurve, k: int, c: float, nodes: int, overhead: float, context: int | None = None) -> float:
    """A round's expected cost in plain steps, k·c + v(n+1) + o: ``k`` draft forwards of cost ``c``
    each, one verify forward of the pending token and ``nodes`` drafted nodes (v after ``context``
    tokens: :meth:`VerifyCurve.v_at`), and the learned overhead ``o`` of a drafting round (none for a
    plain step, ``k = 0``). The one formula every planner, the hybrid merge and calibration's proxy use."""
    return k * c + curve.v_at(nodes + 1, context) + (overhead if k else 0.0)


@dataclass
class Planner:
    """Chooses the draft length of each round (see the module docstring)."""

    curve: VerifyCurve
    max_len: int
    acceptance: Acceptance = None  # type: ignore[assignment]
    probes: ProbeBudget = field(default_factory=ProbeBudget)  # one-token probes when drafting does not pay
    width: int = 1  # verified rows per draft depth (2 for a tree of at most 2k nodes)
    prior: float = 0.5  # depth 1's prior acceptance (Acceptance)
    overhead: Overhead = field(default_factory=Overhead)  # shared by planners whose rounds cost alike
    last: Plan = Plan(1.0, 1.0)  # the last plan's expected tokens and cost (in plain steps)
    context: int | None = None  # the round's context: v is read there (VerifyCurve.v_at); None, the curve's own

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.max_len, prior=self.prior)

    def at(self, context: int | None) -> Planner:
        """This planner, pricing rounds after ``context`` tokens from now on (a proposer sets it each round)."""
        self.context = context
        return self

    def reach(self, k: int) -> list[float]:
        """P(depth j of a k-token draft is accepted), j = 1..k."""
        return list(accumulate((self.acceptance.rate(j) for j in range(1, k + 1)), operator.mul))

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.reach(k))

    def cost(self, k: int, c: float) -> float:
        """A round with ``k`` drafts, in plain steps (``k = 0``: a plain step)."""
        return round_cost(self.curve, k, c, self.width * k, self.overhead.value, self.context)

    def gain(self, k: int, c: float) -> float:
        """Expected tokens per T(1) of a round with ``k`` drafts, relative to plain decoding."""
        return self.expected_tokens(k) / self.cost(k, c)

    def best(self, c: float, budget: int) -> tuple[int, float]:
        """The draft length that maximizes the expected gain, and that gain (``(0, 1.0)``
        when no draft pays); no side effects. One pass: E(k) is built up as k grows."""
        best_k, best, e = 0, 1.0, 1.0
        for k, reach in enumerate(self.reach(min(self.max_len, budget)), 1):
            e += reach
            g = e / self.cost(k, c)
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
        return Plan(self.expected_tokens(k), round_cost(self.curve, k, c, nodes, self.overhead.value, self.context))

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

    def report(self) -> dict[str, Any]:
        return {"prior": round(self.prior, 3), "acceptance_by_depth": [round(self.acceptance.rate(j), 3) for j in range(1, min(self.max_len, 8) + 1)],
                "round_overhead": round(self.overhead.value, 4),
                "verify_curve": {m: round(self.curve.v(m), 3) for m in (2, 4, 8)}}  # the reading this planner uses


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
