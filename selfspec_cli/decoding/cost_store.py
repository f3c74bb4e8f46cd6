"""The store of engine costs: each engine's verify curve and draft costs, measured once per machine,
read by every later process, refreshed by its rounds.

What is kept, one JSON file per key in ``costs/`` of selfspec's cache
(``<cache>/costs/<digest>.json``, :func:`selfspec_cli.paths.cache_root`): the verify curve's
forward times (T(1), the m-row forward behind each v(m), T(1)'s growth with the context) and
c, one draft step over a plain step, of each quantized draft variant that was timed. A
quantized draft's agreement with the target is a property of the two sets of weights, not of
the machine: it stays beside the draft copy's own disk cache
(:func:`selfspec_cli.decoding.measure.draft_agreement`).

**Each engine's costs** (the last section): :func:`curve_for`, the engine's one verify curve, and
:func:`draft_cost_for`, a draft variant's c: read from the store, measured (:mod:`.measure`) and
stored only when none is (a short first reading, said on stderr; ``selfspec profile`` takes the full
one). An engine in :func:`measure_fresh` mode (the bench) measures everything itself.

The key (:func:`machine_key`) is everything that sets those costs and does not change while
the machine stays the same: the model's fingerprint, the target's precision (``fp32``,
``bf16``, ``gguf``, ... or its dtype), the thread count (``auto<n>`` under the thread
governor), the kernel build (the compiled kernel's build id, or ``F.linear`` without it),
the device and the CPU model. What changes from minute to minute (other processes' load,
where the weights land in memory; docs/engine.md, "How far the readings repeat") is not in
the key: the online refresh follows it.

**Online refresh** (:class:`Online`). A process that planned with a stored reading times its
own verify forwards (the driver, one ``time.perf_counter`` pair per round; plain rounds are
one-row forwards, T(1)) and its draft steps (the layer-skip proposer), each put at the
curve's context. At its exit (:func:`flush`, also callable directly) the medians of what it
saw, for each row count and draft variant seen at least :data:`ONLINE_MIN` times, are one
more reading. T(1) is the **median** of the last :data:`T1_KEEP` processes' T(1) (``t1_samples``
in the stored curve; the first reading counts as one): one process on a loaded minute moves it
not at all, where a running mean moved it by a tenth of the difference every call (a new user saw
the stored T(1) drift from 16.4 to 26.1 ms over an afternoon, and the same ``generate`` call
report 0.62x to 1.10x ``ar``; issue 50). Each v(m) and c moves towards the process's ratio to its
own T(1) (so that a process on a slower minute does not make every row look dearer) by ``1 /
min(readings + 1, BLEND_CAP)``: the mean of the readings so far, then an exponential average
over about the last ten.

**Refreshed deliberately, not on every call.** A process folds its reading in only while the
stored curve holds fewer than :data:`BLEND_CAP` readings (it is still being established), or when
it was last updated :data:`REFRESH_S` or more ago; otherwise the store is left as it is, so calls
within a few hours read the same figures (and ``generate``'s summary line, which predicts ``ar``
from them, says their age). ``selfspec profile --remeasure`` replaces them on purpose. A row count of the full curve the
stored table lacks (a short first reading) is filled in from the rounds, and T(1)'s growth
with the context from the process's plain steps (a least-squares slope, when they span at
least :data:`SLOPE_SPAN` tokens; a share of T(1), blended the same way). Chains only: a tree's
verify forward (a mask, other rows) is not one the curve times.

Invariants:

* a file is written atomically (:func:`selfspec_cli.paths.atomic_write`); one that cannot be
  read, is of another format or version, or holds another key is ignored (the costs are
  measured again and written over it); a cache that cannot be written only costs the next
  process the measurement: nothing here raises;
* the refresh never changes the costs a running process plans with (its planners learn
  the round overhead ``o`` from their rounds instead, :mod:`.planning`): it changes what
  the next process reads; a running process plans with the reading it started with.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import math
import platform
import statistics
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..engine import Engine, kernels
from ..engine.adapter import model_fingerprint
from ..errors import ArtifactError
from ..jsonio import JsonObject
from ..paths import atomic_write, cache_root
from .measure import CURVE_ROWS, SHORT_ROUNDS, SHORT_ROWS, CurveRecord, VerifyCurve, draft_step_cost

FORMAT = "selfspec-costs"
VERSION = 1
ONLINE_MIN = 3  # observations of a row count or draft variant before a process's reading of it counts
BLEND_CAP = 10  # a stored figure moves 1 / min(readings + 1, BLEND_CAP) of the way to a process's reading
ONLINE_KEEP = 1024  # the newest observations kept per row count and draft variant
SLOPE_SPAN = 64  # context tokens a process's plain steps must span before they give a slope
T1_KEEP = 15  # the processes' T(1) readings whose median is the stored T(1)
REFRESH_S = 6 * 3600  # a settled store (BLEND_CAP readings) takes a process's reading at most this often
DRAFT_KEEP = 64  # draft variants kept per key, the newest (SWIFT's search times one per skip set it tries)

_FINGERPRINTS: "weakref.WeakKeyDictionary[Engine, str]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class DraftCost:
    """A draft variant's c (one draft step over a plain step) as stored, and the readings folded into it."""

    c: float
    readings: int = 1

    def to_json(self) -> JsonObject:
        return {"c": self.c, "readings": self.readings}


@dataclass(frozen=True, slots=True)
class CostRecord:
    """One key's stored costs (``<cache>/costs/<digest>.json``): the key, when it was created and last updated
    (seconds since the epoch), the verify curve (None: none, or one that is not a curve) and each draft
    variant's c. Read and written only through :meth:`from_json` and :meth:`to_json`, whose text is the
    store's format (``selfspec-costs`` version 1, as it always was)."""

    key: dict[str, str]
    created: float
    updated: float
    curve: CurveRecord | None = None
    draft_costs: dict[str, DraftCost] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        return {"format": FORMAT, "version": VERSION, "key": self.key, "created": self.created, "updated": self.updated,
                "curve": None if self.curve is None else self.curve.to_json(),
                "draft_costs": {k: v.to_json() for k, v in self.draft_costs.items()}}

    @classmethod
    def from_json(cls, rec: Any) -> CostRecord | None:
        """The record of a stored file's JSON; None when it is of another format or version, or its times are
        not numbers. A draft cost that is not ``{"c": number, ...}`` is left out (it is timed again)."""
        if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
            return None
        if not all(isinstance(rec.get(t), (int, float)) for t in ("created", "updated")) or not isinstance(rec.get("draft_costs", {}), dict):
            return None
        costs = {k: DraftCost(v["c"], v.get("readings", 1)) for k, v in (rec.get("draft_costs") or {}).items()
                 if isinstance(v, dict) and isinstance(v.get("c"), (int, float))}
        return cls(rec.get("key"), rec["created"], rec["updated"], CurveRecord.from_json(rec.get("curve")), costs)


def costs_dir() -> Path:
    """Where the costs live: ``costs/`` of selfspec's cache (read from the environment at every call)."""
    return cache_root() / "costs"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def target_precision(engine: Engine) -> str:
    """The target's precision (``Engine.target_precision`` where the engine has one), else its dtype."""
    return getattr(engine, "target_precision", None) or str(engine.dtype).removeprefix("torch.")


def machine_key(engine: Engine) -> dict[str, str]:
    """What the engine's costs depend on, other than the minute (see the module docstring)."""
    if engine not in _FINGERPRINTS:
        _FINGERPRINTS[engine] = model_fingerprint(engine.model)
    governor = getattr(engine, "governor", None)
    device = engine.device.type
    if device == "cuda":
        device = f"cuda {torch.cuda.get_device_name(engine.device)}"
    return {"model": _FINGERPRINTS[engine], "precision": target_precision(engine),
            "threads": f"auto{governor.threads}" if governor is not None else str(torch.get_num_threads()),
            "kernel": kernels.build_id() if engine.kernel_info.get("backend") == "small_gemm" else (
                f"fixed{engine.static.rows}" if getattr(engine, "static", None) is not None else "F.linear"),
            "device": device, "cpu": cpu_model()}


def path_for(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"{digest}.json"


def read(key: dict[str, str], path: Path | None = None) -> CostRecord | None:
    """The stored record for ``key`` (at ``path``, by default :func:`path_for`); None when there is
    none, or it is unreadable or foreign."""
    try:
        rec = CostRecord.from_json(json.loads((path or path_for(key)).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    return rec if rec is not None and rec.key == key else None


def write(key: dict[str, str], rec: CostRecord, path: Path | None = None, *, now: float | None = None) -> Path | None:
    """Store ``rec`` (its ``curve`` and ``draft_costs``, created when it was) for ``key``, updated ``now`` (default:
    the time now), atomically (at ``path``, by default :func:`path_for`); None when the cache cannot be written."""
    doc = replace(rec, key=key, updated=time.time() if now is None else now).to_json()
    path = path or path_for(key)
    try:
        atomic_write(path, lambda f: f.write((json.dumps(doc, indent=1) + "\n").encode()))
    except ArtifactError:
        return None
    return path


def update(key: dict[str, str], *, curve: CurveRecord | None = None,
           draft_costs: dict[str, DraftCost] | None = None) -> Path | None:
    """Replace the stored curve (when given) and add or replace draft costs (the newest
    :data:`DRAFT_KEEP`), keeping the rest."""
    now = time.time()
    rec = read(key) or CostRecord(key, now, now)
    if curve is not None:
        rec = replace(rec, curve=curve)
    old = {k: v for k, v in rec.draft_costs.items() if k not in (draft_costs or {})}
    return write(key, replace(rec, draft_costs=dict(list({**old, **(draft_costs or {})}.items())[-DRAFT_KEEP:])), now=now)


def describe(key: dict[str, str]) -> JsonObject:
    """What is stored for ``key``, as ``selfspec profile`` shows it: path, key, age, rows, readings."""
    path = path_for(key)
    rec = read(key)
    if rec is None:
        return {"path": str(path), "key": key, "stored": False}
    curve = rec.curve
    return {"path": str(path), "key": key, "stored": True, "age_s": round(time.time() - float(rec.updated), 1),
            "created_age_s": round(time.time() - float(rec.created), 1),
            "rows": sorted(int(m) for m in curve.times_s) if curve is not None else [],
            "readings": None if curve is None else curve.readings,
            "t1_samples": len((curve.t1_samples if curve is not None else None) or [1]), "settled": settled(rec),
            "draft_costs": {k: v.c for k, v in rec.draft_costs.items()}}


# ---------------------------------------------------------------- online refresh


def _blend(old: float, new: float, readings: int) -> float:
    return old + (new - old) / min(readings + 1, BLEND_CAP)


def slope_fit(plain: list[tuple[int, float]]) -> float | None:
    """Least-squares seconds per context token of plain steps ``(tokens past the curve's context,
    seconds)``, never negative; None over fewer than ``ONLINE_MIN`` steps or a span under :data:`SLOPE_SPAN`."""
    if len(plain) < ONLINE_MIN or max(x for x, _ in plain) - min(x for x, _ in plain) < SLOPE_SPAN:
        return None
    mx, my = statistics.fmean(x for x, _ in plain), statistics.fmean(y for _, y in plain)
    sxx = sum((x - mx) ** 2 for x, _ in plain)
    return max(0.0, sum((x - mx) * (y - my) for x, y in plain) / sxx)


def blend(rec: CostRecord, rows: dict[int, list[float]], drafts: dict[str, list[float]],
          plain: list[tuple[int, float]] = ()) -> CostRecord | None:
    """``rec`` with one process's observations folded in (the module docstring's rule); None when
    there is nothing to fold (no stored curve, or too few observations of anything). ``rows``: an
    m-row verify forward's seconds at the curve's context; ``drafts``: one draft step's seconds;
    ``plain``: plain steps as taken, for the slope (:func:`slope_fit`)."""
    curve = rec.curve
    if curve is None or not curve.times_s:
        return None
    times = {int(m): float(t) for m, t in curve.times_s.items()}
    med = {m: statistics.median(v) for m, v in rows.items() if len(v) >= ONLINE_MIN}
    dmed = {k: statistics.median(v) for k, v in drafts.items() if len(v) >= ONLINE_MIN and k in rec.draft_costs}
    if not med and not dmed:
        return None
    n, t1 = int(curve.readings), times[1]
    t1_here = med.get(1, t1)  # this process's plain step (the stored one when it ran none)
    samples = [float(x) for x in curve.t1_samples or [t1]]  # a curve stored before the samples: one
    if 1 in med:
        samples = (samples + [t1_here])[-T1_KEEP:]
    t1_new = statistics.median(samples)  # robust: one loaded minute does not move it (module docstring)
    ratios = {m: t / t1 for m, t in times.items()}
    for m, s in med.items():
        ratios[m] = _blend(ratios[m], s / t1_here, n) if m in ratios else s / t1_here
    new_curve = replace(curve, times_s={str(m): ratios[m] * t1_new for m in sorted(ratios)}, readings=n + 1,
                        t1_samples=[round(x, 9) for x in samples])
    if (slope := slope_fit(list(plain))) is not None:  # as a share of T(1), like the rows
        new_curve = replace(new_curve, slope_s=_blend(float(curve.slope_s) / t1, slope / t1_here, n) * t1_new)
    costs = dict(rec.draft_costs)
    for k, s in dmed.items():
        r = int(costs[k].readings)
        costs[k] = DraftCost(round(_blend(float(costs[k].c), s / t1_here, r), 5), r + 1)
    return replace(rec, curve=new_curve, draft_costs=costs)


def settled(rec: CostRecord, now: float | None = None) -> bool:
    """Whether a stored record takes no process's reading now: its curve holds :data:`BLEND_CAP` readings
    and was updated less than :data:`REFRESH_S` ago (the module docstring's deliberate refresh)."""
    readings = 1 if rec.curve is None else rec.curve.readings
    age = (time.time() if now is None else now) - float(rec.updated)
    return int(readings) >= BLEND_CAP and age < REFRESH_S


@dataclass
class Online:
    """One process's observations for one key, kept until :func:`flush` folds them into the store."""

    key: dict[str, str]
    path: Path
    rows: dict[int, deque] = field(default_factory=dict)
    drafts: dict[str, deque] = field(default_factory=dict)
    plain: deque = field(default_factory=lambda: deque(maxlen=ONLINE_KEEP))  # (tokens past the curve's context, s)

    def observe_forward(self, rows: int, seconds: float, past: int = 0, raw_s: float | None = None) -> None:
        """An m-row forward's ``seconds`` put at the curve's context; a plain step's also as taken
        (``raw_s``, ``past`` tokens beyond that context), for the slope."""
        self.rows.setdefault(rows, deque(maxlen=ONLINE_KEEP)).append(seconds)
        if rows == 1 and raw_s is not None:
            self.plain.append((past, raw_s))

    def observe_draft(self, variant: str, seconds: float) -> None:
        self.drafts.setdefault(variant, deque(maxlen=ONLINE_KEEP)).append(seconds)

    def flush(self) -> Path | None:
        """Fold the observations into the stored record and forget them; the path written, or None."""
        rows, drafts, plain = {m: list(v) for m, v in self.rows.items()}, {k: list(v) for k, v in self.drafts.items()}, list(self.plain)
        self.rows, self.drafts, self.plain = {}, {}, deque(maxlen=ONLINE_KEEP)
        rec = read(self.key, self.path)
        if rec is None or settled(rec):
            return None
        new = blend(rec, rows, drafts, plain)
        return write(self.key, new, self.path) if new is not None else None


_ONLINE: dict[str, Online] = {}  # store path -> this process's observations for it


def online(key: dict[str, str]) -> Online:
    """This process's observations for ``key`` (flushed at exit)."""
    path = path_for(key)
    if not _ONLINE:
        atexit.register(flush)
    if str(path) not in _ONLINE:
        _ONLINE[str(path)] = Online(key, path)
    return _ONLINE[str(path)]


def flush() -> list[Path]:
    """Fold every observation this process made into the store (at exit; tests and commands may call it)."""
    written = []
    for o in list(_ONLINE.values()):
        try:
            if (p := o.flush()) is not None:
                written.append(p)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError):
            pass  # a hand-edited store, one changed under us or a half-gone cache directory at exit: the next process measures
    return written


# ---------------------------------------------------------------- each engine's costs


_CURVES: "weakref.WeakKeyDictionary[Engine, VerifyCurve]" = weakref.WeakKeyDictionary()
_READINGS: "weakref.WeakKeyDictionary[Engine, list[VerifyCurve]]" = weakref.WeakKeyDictionary()
_FRESH: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # engines that measure their costs themselves (measure_fresh)
_KEYS: "weakref.WeakKeyDictionary[Engine, dict[str, str]]" = weakref.WeakKeyDictionary()  # machine_key
_ENGINE_ONLINE: "weakref.WeakKeyDictionary[Engine, Online]" = weakref.WeakKeyDictionary()


def curve_for(engine: Engine, full: bool = False) -> VerifyCurve:
    """The engine's verify curve, kept with it: the planners, ``selfspec profile`` and the bench's engine
    costs all read this one reading (or the pool of :func:`refresh_curve`). On first use it is read from
    the store of this machine's costs (no forward is timed); only when none is stored is it measured
    (:meth:`VerifyCurve.measure`), and then stored: a **short** reading (:data:`SHORT_ROWS`, about
    an eighth of the full reading's time, said in one line on stderr) so that a first call on a new
    machine does not stall for the full one, which later processes' rounds refine
    (:func:`flush`); ``full`` (``selfspec profile``) takes the full reading (about 160
    forwards, 5-6 s on the default model) when what is kept or stored lacks some of its rows.
    An engine in :func:`measure_fresh` mode measures the full reading itself, as before there was
    a store, and stores it."""
    if engine in _CURVES and (engine in _FRESH or not full or _CURVES[engine].full):
        return _CURVES[engine]
    key = engine_key(engine)
    if engine not in _FRESH:
        rec = read(key)
        stored = VerifyCurve.from_record(rec.curve if rec is not None else None)
        if stored is not None and (stored.full or not full):
            return _keep_curve(engine, stored)
    if full or engine in _FRESH:
        curve = VerifyCurve.measure(engine)
        update(key, curve=curve.to_record())
        return _keep_curve(engine, curve)
    t0 = time.perf_counter()
    curve = VerifyCurve.measure(engine, rounds=SHORT_ROUNDS, rows=SHORT_ROWS, extra=0)
    where = update(key, curve=curve.to_record())
    print(f"selfspec: no engine costs stored for this machine; measured a short verify curve "
          f"({len(SHORT_ROWS)} row counts x {SHORT_ROUNDS} passes, {time.perf_counter() - t0:.1f} s)"
          f"{f' into {where}' if where else ' (the cache is not writable: not stored)'}; later runs read it "
          "and refine it from their rounds ('selfspec profile' takes a full reading)", file=sys.stderr)
    return _keep_curve(engine, curve)


def _keep_curve(engine: Engine, curve: VerifyCurve) -> VerifyCurve:
    """Make ``curve`` the engine's, its first reading, and let the engine's rounds refine the store."""
    _CURVES[engine] = curve
    _READINGS[engine] = [curve]
    _ENGINE_ONLINE[engine] = online(engine_key(engine))
    return curve


def set_curve(engine: Engine, curve: VerifyCurve) -> None:
    """Make ``curve`` the engine's from now on, without storing it or taking it for this machine's reading
    (a test's curve, or a caller's own): the planners and the driver's unit read it."""
    _CURVES[engine] = curve


def held_curve(engine: Engine) -> VerifyCurve | None:
    """The curve the engine holds now; None when it has none yet (nothing is read or measured)."""
    return _CURVES.get(engine)


def refresh_curve(engine: Engine) -> VerifyCurve | None:
    """Take another reading and pool it with the earlier ones (:meth:`VerifyCurve.pool`); planners made
    from now on read the pool, and the store keeps it. One reading is a few seconds of a shared
    host, whose speed drifts by several per cent from minute to minute (docs/engine.md); a long
    run (the bench, between its passes) pools many. Nothing when this engine has no curve yet."""
    if engine not in _CURVES:
        return None
    readings = _READINGS.setdefault(engine, [])  # a curve set from outside (a test's) is not a reading
    readings.append(VerifyCurve.measure(engine, _CURVES[engine].context))
    _CURVES[engine] = VerifyCurve.pool(readings)
    if engine in _ENGINE_ONLINE:  # a reading of this machine, not a test's curve
        update(engine_key(engine), curve=_CURVES[engine].to_record())
    return _CURVES[engine]


def engine_key(engine: Engine) -> dict[str, str]:
    """The key of the engine's costs in the store (:func:`machine_key`), read once per engine."""
    if engine not in _KEYS:
        _KEYS[engine] = machine_key(engine)
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
    tokens, for the store's online refresh (:class:`Online`), put at the curve's context. Only
    engines whose curve is this machine's reading, on a CPU (no device synchronize is paid here),
    and row counts of :data:`CURVE_ROWS`."""
    obs, curve = _ENGINE_ONLINE.get(engine), _CURVES.get(engine)
    if obs is not None and curve is not None and rows in CURVE_ROWS and engine.device.type == "cpu":
        obs.observe_forward(rows, seconds * curve.t1_s / curve.t1_at(context), context - curve.context, seconds)


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
    obs, curve = _ENGINE_ONLINE.get(engine), _CURVES.get(engine)
    if obs is not None and curve is not None and engine.device.type == "cpu":
        obs.observe_draft(draft_variant(weights, skip_attn, skip_mlp, vocab_rows), seconds * curve.t1_s / curve.t1_at(context))



def draft_cost_for(engine: Engine, weights: str | None, skip_attn: frozenset[int] = frozenset(),
                   skip_mlp: frozenset[int] = frozenset(), vocab: torch.Tensor | None = None, head: Any = None) -> float:
    """c of this draft variant on this machine: the stored one, else timed now
    (:func:`.measure.draft_step_cost`) and stored. An engine in :func:`measure_fresh` mode times it at
    every call, as before there was a store."""
    rows = None if vocab is None else int(vocab.numel())
    variant, key = draft_variant(weights, skip_attn, skip_mlp, rows), engine_key(engine)
    if engine not in _FRESH:
        rec = read(key)
        got = rec.draft_costs.get(variant) if rec is not None else None
        try:
            c = float(got.c)
            if math.isfinite(c) and c > 0:
                return c
        except (AttributeError, TypeError, ValueError):
            pass  # none stored, or unusable: time it
    c = draft_step_cost(engine, weights, skip_attn, skip_mlp, vocab=vocab, head=head)
    update(key, draft_costs={variant: DraftCost(round(c, 5), 1)})
    return c

