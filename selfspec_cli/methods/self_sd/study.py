"""An Optuna study that many processes and machines work on together (docs/calibrate.md,
"More than one process").

Optuna already runs one study from many processes through a shared storage; this module
only picks the storage from what the user names and keeps three promises on top of it:

* **no trial lost**: every storage records a heartbeat per running trial (Optuna's own for
  SQL databases; :class:`HeartbeatJournal` adds the same protocol to a journal file). A
  worker that dies mid-trial stops beating; any live worker then fails the stale trial and
  queues a copy with the same parameters (Optuna's ``RetryHeartbeatStaleTrialCallback``), which the
  next free worker runs.
* **exactly N complete trials**: :func:`run_workers_share` starts a trial only while the
  complete and running trials number fewer than N; two workers that start the last free
  trial at the same moment both see each other, and the later-numbered one is pruned
  (``surplus``) before it decodes anything.
* **no parameters reported twice**: a trial whose parameters equal those of a complete or
  earlier running trial is pruned (``duplicate``) before it decodes, and the worker's next
  trial is drawn at random (a model-based sampler that has converged would otherwise keep
  proposing the same point).

Which process writes the result: :func:`finished_last` (the worker whose trial completed
last; a worker that re-opens a study finished before it joined writes too).

It also holds the search itself, apart from what a trial measures: the parameters of a skip set
(:func:`params_for`), the starting points enqueued first (:func:`seed_points`, from the uniform
sets of :func:`uniform_layers`), the sampler, the study's setup check (:func:`open_study`, given
an SQLite path the offline step has already checked for writing), Ctrl-C at safe points
(:class:`DeferredInterrupt`), one worker's loop (:func:`run_search`), and the calibration around
it: the study's setup, the best trial and the confirmation (:func:`calibrate_self_sd`), run with
the helper processes of ``--workers`` (:class:`Workers`) and a progress bar (:class:`TrialBar`)
by :func:`run_calibration` from the :class:`CalibrationPlan` the offline step builds.

The search decodes nothing itself: it is handed a :class:`Scorer` (the offline step passes
:class:`~.measure.Candidates`) that gives the measured inputs every trial is scored with, an
untimed warm-up, the decode of one candidate and the confirmation. So this module imports no
decoder and never calls back into the offline step: a calibration flows down from
:mod:`.calibrate` through :mod:`.measure` (the candidates set up), this module (the whole
search) and back to :mod:`.calibrate` only to write the artifact. No typer or rich here.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...config import GenerationConfig
from ...errors import ConfigError, first_line
from . import DEFAULT_HEARTBEAT_S
from ...jsonio import JsonObject

if TYPE_CHECKING:
    from ...engine import Engine
    from .search import SearchConfig

RDB_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql")
JOURNAL_PREFIX = "journal:"
GRACE_BEATS = 3  # a worker silent for this many DEFAULT_HEARTBEAT_S (or --heartbeat) is declared dead
MAX_RETRY = 3  # a trial whose worker died this many times is not queued again


def worker_id() -> str:
    """This worker's name in the study: host, process and start time (a restarted worker is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{time.time_ns() // 1_000_000}"


def machine_id() -> str:
    """Where a throughput trial was timed: host name and CPU model (timings from two machines do not compare)."""
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    return f"{socket.gethostname()} ({cpu})" if cpu else socket.gethostname()


def describe(spec: str) -> str:
    """The storage as a log line and the artifact show it: a database URL's user and password (the
    part of its authority before the last '@') are not printed; a path holding '@' is kept."""
    scheme, sep, rest = spec.partition("://")
    authority, slash, path = rest.partition("/")
    if sep and "@" in authority:
        return f"{scheme}://***@{authority.rsplit('@', 1)[1]}{slash}{path}"
    return spec


def _journal_path(spec: str) -> Path | None:
    if spec.startswith(JOURNAL_PREFIX):
        return Path(spec[len(JOURNAL_PREFIX):].removeprefix("//"))
    if "://" not in spec and spec.endswith((".journal", ".log")):
        return Path(spec)
    return None


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def check_storage(spec: str) -> tuple[str, str]:
    """``(database URL, scheme)`` of a --storage that is not a journal file; a spec that is neither
    a database URL Optuna knows nor a journal file is refused (checked before any model loads)."""
    url = spec if "://" in spec else sqlite_url(Path(spec))
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if _journal_path(spec) is None and scheme not in RDB_SCHEMES:
        raise ConfigError(f"--storage '{describe(spec)}' is neither a database URL ({', '.join(RDB_SCHEMES)}) nor a "
                          f"journal file ({JOURNAL_PREFIX}PATH or *.journal); pass one of those")
    return url, scheme


def open_storage(spec: str, heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> Any:
    import warnings

    import optuna

    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.9; they are what we need
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _open_storage(spec, heartbeat_s)


def _open_storage(spec: str, heartbeat_s: int) -> Any:
    """An Optuna storage with heartbeats for ``spec``: a database URL (sqlite:///file.db,
    postgresql://..., mysql://...), a journal file (``journal:PATH``, or a path ending in
    .journal or .log: one file on a disk every worker sees), or a plain path (an SQLite file)."""
    import optuna

    try:  # Optuna >= 4.9 renamed the callback and its RDBStorage argument
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
        stale_arg = "heartbeat_stale_trial_callback"
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry
        stale_arg = "failed_trial_callback"
    retry = Retry(max_retry=MAX_RETRY)
    if (jpath := _journal_path(spec)) is not None:
        from optuna.storages.journal import JournalFileBackend

        try:
            jpath.parent.mkdir(parents=True, exist_ok=True)
            return HeartbeatJournal(JournalFileBackend(str(jpath)), heartbeat_s, retry)
        except OSError as exc:
            raise ConfigError(f"cannot open the journal '{jpath}' ({exc.strerror}); pass a writable --storage path") from None
    url, scheme = check_storage(spec)
    # SQLite: several writers wait for the file lock instead of failing at once
    kwargs = {"connect_args": {"timeout": 120}} if scheme == "sqlite" else {}
    try:
        storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_s,
                                             grace_period=GRACE_BEATS * heartbeat_s, **{stale_arg: retry})
    except ImportError as exc:  # a driver (psycopg2, pymysql) that is not installed
        raise ConfigError(f"--storage '{describe(spec)}' needs a database driver that is not installed ({first_line(exc)}); "
                          "pip install it, or use a journal file") from None
    if scheme == "sqlite":
        _immediate_transactions(storage.engine)
    return storage


def _immediate_transactions(engine: Any) -> None:
    """Every SQLite transaction takes the write lock when it begins (``BEGIN IMMEDIATE``). SQLite's
    default deferred transactions let two workers both read a waiting trial as WAITING and both
    start it (seen here: two workers ran one enqueued trial, and the second could not report it);
    a server database locks the row Optuna reads FOR UPDATE, SQLite needs this instead."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_pysqlite_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners (the schema check) are not reused


def HeartbeatJournal(backend: Any, interval: int, callback: Callable[..., None]) -> Any:  # noqa: N802 (a class, built lazily)
    from optuna.storages import BaseStorage, JournalStorage, RDBStorage

    # Optuna 5.0 (as 4.x) has no public hook for a heartbeat on a storage other than RDBStorage:
    # fail_stale_trials checks isinstance(storage, BaseHeartbeat), a class exported by no public
    # module; it is taken as the heartbeat base of RDBStorage, the public class that implements it.
    BaseHeartbeat = next(b for b in RDBStorage.__bases__ if b is not BaseStorage)  # noqa: N806

    class _HeartbeatJournal(JournalStorage, BaseHeartbeat):  # type: ignore[misc]
        """A journal-file storage that keeps Optuna's heartbeat protocol (Optuna implements it
        for SQL databases only): a running trial's heartbeat is a system attribute with the wall
        time, written every ``interval`` seconds by Optuna's heartbeat thread; a running trial
        whose last beat (or start) is older than ``GRACE_BEATS`` intervals is stale. Workers on
        several machines need clocks in step, as with a database."""

        def __init__(self, backend: Any, interval: int, callback: Callable[..., None]) -> None:
            super().__init__(backend)
            self._interval, self._callback = interval, callback

        def record_heartbeat(self, trial_id: int) -> None:
            from optuna.exceptions import UpdateFinishedTrialError

            with contextlib.suppress(UpdateFinishedTrialError):  # failed meanwhile by a worker that thought us dead
                self.set_trial_system_attr(trial_id, "heartbeat", time.time())

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            from optuna.trial import TrialState

            now, grace = time.time(), GRACE_BEATS * self._interval
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                beat = t.system_attrs.get("heartbeat")
                if beat is None and t.datetime_start is not None:
                    beat = t.datetime_start.timestamp()
                if beat is not None and now - beat > grace:
                    stale.append(self.get_trial_id_from_study_id_trial_number(study_id, t.number))
            return stale

        def get_heartbeat_interval(self) -> int:
            return self._interval

        def get_heartbeat_stale_trial_callback(self) -> Callable[..., None]:
            return self._callback

        get_failed_trial_callback = get_heartbeat_stale_trial_callback  # the name before Optuna 4.9

    return _HeartbeatJournal(backend, interval, callback)


def dispose(storage: Any) -> None:
    """Close a database storage's connections (the study stays consistent either way)."""
    with contextlib.suppress(Exception):
        storage.remove_session()
    with contextlib.suppress(Exception):
        storage.engine.dispose()


# ---------------------------------------------------------------- one worker's share


CLAIMED = "claimed"  # user attribute a trial sets once all its parameters are suggested, before check_slot


def check_slot(study: Any, trial: Any, n_trials: int) -> str | None:
    """Why ``trial`` (just started, parameters suggested and ``claimed`` set) must not run: ``surplus``
    when the complete trials and the running ones numbered before it already make ``n_trials``;
    ``duplicate`` when a complete trial, or another running trial that has claimed its parameters,
    has the same ones. Parameters reach the storage one suggestion at a time, so a running trial
    counts as a duplicate only once it has claimed (all its parameters are there), and whichever
    number it has: a trial that checked while the other's parameters were still partial, and runs,
    is seen by the other's later check. Two that claim the same parameters at once may both give
    way (each is drawn again); two never both run. None: run it."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    before = [t for t in trials if t.state == TrialState.COMPLETE or t.number < trial.number]
    if len(before) >= n_trials:
        return "surplus"
    if any(t.params == trial.params for t in trials if t.number != trial.number
           and (t.state == TrialState.COMPLETE or t.user_attrs.get(CLAIMED))):
        return "duplicate"
    return None


def run_workers_share(study: Any, run_one: Callable[[], None], n_trials: int, *, poll_s: float = 1.0,
                      check: Callable[[], None] = lambda: None) -> int:
    """Run trials (``run_one`` runs one: ``study.optimize(..., n_trials=1)``) until the study holds
    ``n_trials`` COMPLETE ones. While the complete and running trials already make ``n_trials``,
    wait (polling every ``poll_s``) for them to end: a running one whose worker died goes stale,
    is failed here and queued again with its parameters. Returns the trials this worker started."""
    import optuna
    from optuna.trial import TrialState

    started = 0
    while True:
        with contextlib.suppress(Exception):  # a busy database: the next round tries again
            optuna.storages.fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
        if sum(t.state == TrialState.COMPLETE for t in trials) >= n_trials:
            return started
        if len(trials) >= n_trials:
            check()
            time.sleep(poll_s)
            continue
        run_one()
        started += 1
        check()


def finished_last(study: Any, me: str, joined: Any) -> bool:
    """Whether this worker (``me``, the ``worker`` user attribute of its trials) ran the trial that
    completed last: that worker writes the result, once. A worker that ran no trial writes only when
    the study was already finished when it joined (``joined``, a naive local datetime as Optuna keeps
    them): it re-opened a finished study."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return False
    last = max(done, key=lambda t: (t.datetime_complete, t.number))
    if last.user_attrs.get("worker") == me:
        return True
    return not any(t.user_attrs.get("worker") == me for t in done) and last.datetime_complete < joined


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Optuna logs every trial at INFO on stderr; the caller owns stderr (real errors still propagate)."""
    import logging
    import warnings

    import optuna

    old = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(old)


# ---------------------------------------------------------------- the search space and the study

STUDY_NAME = "self-sd"


def params_for(num_layers: int, skip_attn: frozenset[int], skip_mlp: frozenset[int],
               precision: str | None = None) -> JsonObject:
    """The parameters attn_0 .. attn_<L-1>, mlp_0 .. mlp_<L-1> (in that order): 1 where skipped;
    then ``precision`` when the search has that dimension (``precision`` not None)."""
    out: JsonObject = {f"{kind}_{l}": int(l in skip) for kind, skip in (("attn", skip_attn), ("mlp", skip_mlp))
                           for l in range(num_layers)}
    if precision is not None:
        out["precision"] = precision
    return out


def skip_sets_from_params(params: JsonObject, num_layers: int) -> tuple[frozenset[int], ...]:
    return tuple(frozenset(l for l in range(num_layers) if int(params[f"{kind}_{l}"])) for kind in ("attn", "mlp"))


@dataclass(frozen=True, slots=True)
class SeedPoint:
    """A starting point of the search, enqueued before the sampler's first trial."""

    name: str
    skip_attn: frozenset[int]
    skip_mlp: frozenset[int]
    precision: str = "target"


SEED_RATIOS = (0.3, 0.45)  # the uniform starting sets skip these shares of the sublayers


def uniform_layers(num_layers: int, ratio: float) -> frozenset[int]:
    """About ``ratio * L`` layers spread evenly over the interior layers ``1..L-2``
    (SWIFT's uniform start: never the first or last layer). Skipping both sublayers
    of those layers skips a ``ratio`` share of the 2L sublayers."""
    interior = list(range(1, num_layers - 1))
    if not interior:
        return frozenset()
    n = min(len(interior), max(1, round(ratio * num_layers)))
    return frozenset(interior[round((i + 0.5) * len(interior) / n - 0.5)] for i in range(n))


def seed_points(num_layers: int, ratios: Sequence[float] = SEED_RATIOS,
                precisions: Sequence[str] = ("target",), cheap_head: Sequence[str] = ()) -> list[SeedPoint]:
    """Distinct uniform starting sets, one per ratio (small models may merge them), at every
    precision; and full depth (no skips) at every quantized precision, and at the target's own
    weights too when it is in ``cheap_head`` (its drafts score a draft vocabulary: the full-depth
    draft is then cheaper than a step)."""
    out: list[SeedPoint] = []
    tag = len(precisions) > 1
    for p in precisions:
        for r in ratios:
            layers = uniform_layers(num_layers, r)
            if layers and all((q.skip_attn, q.precision) != (layers, p) for q in out):
                out.append(SeedPoint(f"uniform-{r:g}" + (f"-{p}" if tag else ""), layers, layers, p))
        if p != "target" or p in cheap_head:
            out.append(SeedPoint(f"full-depth-{p}", frozenset(), frozenset(), p))
    return out


LATER_KEYS = frozenset({"target_precision"})  # setup keys older studies do not hold


def make_sampler(name: str, seed: int):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    # "gp" or "random" (SearchConfig checks the name)
    return (optuna.samplers.GPSampler if name == "gp" else optuna.samplers.RandomSampler)(seed=seed)


@dataclass(frozen=True, slots=True)
class TrialReport:
    """What ``on_trial`` gets after each finished trial (and once at the start, ``number`` None)."""

    done: int  # COMPLETE trials in the study
    total: int  # n_trials
    number: int | None
    value: float | None
    best_value: float | None
    best_number: int | None
    mean_accepted_length: float | None = None
    acceptance_rate: float | None = None


class DeferredInterrupt:
    """Ctrl-C only where it is safe: a SIGINT during a decode raises KeyboardInterrupt at
    once (Optuna then records the running trial as FAIL); one that arrives while Optuna
    writes to SQLite is remembered and raised at the next safe point. (A
    KeyboardInterrupt inside an SQLAlchemy commit leaves the session broken and the
    process dies with an unrelated AssertionError.) Installed only in the main thread
    and only over Python's default handler."""

    pending = False  # a SIGINT is waiting for the next safe point
    inside = False  # in a decode: a SIGINT raises at once

    def _handler(self, signum: int, frame: Any) -> None:
        if self.inside:
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self.check()
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield  # somebody else owns SIGINT (or not the main thread): leave it alone
            return
        signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def open_study(search: Any, sampler: Any, setup: JsonObject):
    """Create or join the study in ``search``'s storage; refuse a study made for another model or
    another calibration setup, and a throughput study timed on another machine. An SQLite
    ``search.study_path`` is checked for writing by the caller (the offline step does it before
    anything is decoded); its directory is made here."""
    import optuna

    if search.storage is None:
        try:  # SQLite makes the file, not its directory
            Path(search.study_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the directory of --study-path '{search.study_path}' ({exc.strerror}); "
                              "choose a writable path") from None
        spec, option = sqlite_url(Path(search.study_path)), "--study-path"
    else:
        spec, option = search.storage, "--storage"
    shown = describe(search.storage or str(search.study_path))
    try:
        storage = open_storage(spec, search.heartbeat_s)
        study = optuna.create_study(study_name=STUDY_NAME, storage=storage, sampler=sampler,
                                    direction="maximize", load_if_exists=True)
    except ConfigError:
        raise
    except Exception as exc:  # sqlalchemy/optuna raise many types for a foreign file  # noqa: BLE001
        raise ConfigError(f"cannot open the Optuna study '{shown}' ({first_line(exc)[:200]}); "
                          f"pass another {option} or delete that file") from None
    saved = study.user_attrs.get("setup")
    # keys added to the setup since a study was made: such a study's values were taken without them being
    # recorded, so their absence there matches anything (the study resumes as before)
    diff = [] if saved is None else sorted(
        k for k in set(saved) | set(setup) if saved.get(k) != setup.get(k) and not (k in LATER_KEYS and k not in saved))
    if saved is None:
        study.set_user_attr("setup", setup)
    elif diff:
        implied = {"precisions": ["target"], "draft_vocab": "none"}  # what a setup without the key means
        said = ", ".join(f"{k}: {saved.get(k, implied.get(k))} then, {setup.get(k, implied.get(k))} now"
                         for k in diff if k != "prompts_sha256") or "other prompts"
        hint = (" (an FR-Spec draft vocabulary of this model was made or removed since: move it aside to resume)"
                if "draft_vocab" in diff else "")
        raise ConfigError(f"the study '{shown}' was made with another {', '.join(diff)} ({said}){hint}; "
                          f"pass another {option} (or --output) or delete that file to start over")
    if search.objective == "throughput":  # measured tokens/s from two machines do not compare
        here = machine_id()
        timed_on = study.user_attrs.get("machine")
        if timed_on is None:
            study.set_user_attr("machine", here)
        elif timed_on != here:
            raise ConfigError(f"the throughput study '{shown}' is timed on {timed_on}, not on this machine ({here}); "
                              "run it there, or use --objective proxy (the same on every machine) or another "
                              f"{option}")
    return study, storage


def enqueue_seeds(study: Any, points: Sequence[SeedPoint], num_layers: int, searched: bool) -> None:
    """Enqueue each starting point unless a finished, running or waiting trial already has it (a
    running one whose worker died is queued again by the heartbeat check: :mod:`.study`)."""
    from optuna.trial import TrialState

    have = [t.system_attrs.get("fixed_params", t.params)
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING))]
    for p in points:
        params = params_for(num_layers, p.skip_attn, p.skip_mlp, p.precision if searched else None)
        if params not in have:
            study.enqueue_trial(params, user_attrs={"seed_point": p.name})


def seed_values(complete: Sequence[Any], points: Sequence[SeedPoint], num_layers: int,
                 searched: bool = False) -> list[JsonObject]:
    """The study's best value of each starting point (None if it never completed)."""
    out = []
    for p in points:
        params = params_for(num_layers, p.skip_attn, p.skip_mlp, p.precision if searched else None)
        best = max((t.value for t in complete if t.params == params), default=None)
        out.append({"name": p.name, "skip_attn": sorted(p.skip_attn), "skip_mlp": sorted(p.skip_mlp),
                    "precision": p.precision, "value": None if best is None else round(best, 3)})
    return out


# ---------------------------------------------------------------- the search


@dataclass(slots=True)
class SearchOutcome:
    """What a worker's part of the search leaves: the study's complete trials, its best one, every
    complete trial's duration, each starting point's best value, whether this worker writes the
    result, and its name."""

    finished: list[Any]
    best: Any
    durations: list[float]
    seeds: list[JsonObject]
    writer: bool
    worker: str


def _resume(study: Any, search: Any, points: Sequence[SeedPoint], L: int, searched: bool, done: int, remaining: int,
            log: Callable[[str], None]) -> None:
    """The first process's part before its trials: a resumed study said so, and the starting points enqueued."""
    if done:
        log(f"resuming study {describe(search.storage or str(search.study_path))}: {done} trials done, "
            f"{remaining} to run")
    enqueue_seeds(study, points, L, searched)


def _warm_up(points: Sequence[SeedPoint], warm_up: Callable[[frozenset[int], frozenset[int]], None],
             guard: DeferredInterrupt) -> None:
    """The untimed warm-up, with the last starting point (full depth where there is one), Ctrl-C allowed."""
    warm = points[-1] if points else SeedPoint("none", frozenset(), frozenset())
    with guard.interruptible():
        warm_up(warm.skip_attn, warm.skip_mlp)


def run_search(search: Any, setup: JsonObject, points: Sequence[SeedPoint], L: int,
               evaluate: Callable[[frozenset[int], frozenset[int], str], Any], inputs: Callable[[Any], None],
               warm_up: Callable[[frozenset[int], frozenset[int]], None], *, on_trial: Callable[[TrialReport], None], log: Callable[[str], None],
               on_ready: Callable[[], None], before_finish: Callable[[], None]) -> SearchOutcome:
    """Open (or join) the study ``search`` names and run this worker's share of its trials until the study
    holds ``search.n_trials`` COMPLETE ones: ``inputs(study)`` reads or measures the numbers every
    trial is scored with, ``warm_up(attn, mlp)`` runs untimed before the first trial (with the last
    starting point: full depth where there is one), ``evaluate(attn, mlp,
    precision)`` decodes one candidate (its ``proxy`` or ``tokens_per_s`` is the value, ``as_dict()``
    the trial's attributes). A Ctrl-C stops at a safe point (:class:`DeferredInterrupt`)."""
    import optuna
    from datetime import datetime
    from optuna.trial import TrialState

    precisions = search.precisions
    searched = len(precisions) > 1  # precision is a search dimension
    me = search.worker or worker_id()
    joined = datetime.now()
    guard = DeferredInterrupt()
    main_sampler = make_sampler(search.sampler, search.seed + search.worker_index)
    with quiet(), guard.installed():
        study, storage = open_study(search, main_sampler, setup)
        try:
            inputs(study)

            def complete() -> list[Any]:
                return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

            done = len(complete())
            remaining = max(0, search.n_trials - done)
            if not search.search_only:
                _resume(study, search, points, L, searched, done, remaining, log)

            def best() -> tuple[float | None, int | None]:
                b = study.best_trial if complete() else None  # best_trial raises without a complete trial
                return (b.value, b.number) if b else (None, None)

            on_trial(TrialReport(done, search.n_trials, None, None, *best()))

            if remaining:
                _warm_up(points, warm_up, guard)
            random_next = [False]  # after a duplicate, one trial drawn at random
            with guard.interruptible():
                on_ready()

            def objective(trial: Any) -> float:
                names = params_for(L, frozenset(), frozenset())
                params = {name: trial.suggest_categorical(name, (0, 1)) for name in names}
                attn, mlp = skip_sets_from_params(params, L)
                precision = trial.suggest_categorical("precision", precisions) if searched else precisions[0]
                trial.set_user_attr("worker", me)
                trial.set_user_attr("worker_index", search.worker_index)
                trial.set_user_attr("pid", os.getpid())
                if search.objective == "throughput":
                    trial.set_user_attr("machine", machine_id())
                trial.set_user_attr(CLAIMED, True)  # every parameter is in the storage now (study.check_slot)
                if (why := check_slot(study, trial, search.n_trials)) is not None:
                    trial.set_user_attr("pruned", why)
                    random_next[0] = why == "duplicate"
                    raise optuna.TrialPruned(why)
                with guard.interruptible():
                    m = evaluate(attn, mlp, precision)
                for k, v in {**m.as_dict(), "skip_ratio": round((len(attn) + len(mlp)) / (2 * L), 4)}.items():
                    trial.set_user_attr(k, v)
                return m.proxy if search.objective == "proxy" else m.tokens_per_s

            def callback(st: Any, frozen: Any) -> None:
                if frozen.state == TrialState.COMPLETE:
                    on_trial(TrialReport(len(complete()), search.n_trials, frozen.number, frozen.value, *best(),
                                         frozen.user_attrs.get("mean_accepted_length"),
                                         frozen.user_attrs.get("acceptance_rate")))
                guard.check()  # a Ctrl-C during Optuna's bookkeeping stops here, the trial saved

            def run_one() -> None:
                study.sampler = make_sampler("random", search.seed + 7919 * (1 + started[0])) if random_next[0] else main_sampler
                random_next[0] = False
                started[0] += 1
                study.optimize(objective, n_trials=1, callbacks=[callback], gc_after_trial=False)

            started = [0]
            run_workers_share(study, run_one, search.n_trials, poll_s=min(1.0, search.heartbeat_s / 2), check=guard.check)
            guard.check()
            before_finish()
            finished = complete()
            best_t = study.best_trial
            durations = [t.duration.total_seconds() for t in finished if t.duration is not None]
            seeds_in_study = seed_values(finished, points, L, searched)
            writer = not search.search_only and finished_last(study, me, joined)
        finally:
            dispose(storage)
    return SearchOutcome(finished, best_t, durations, seeds_in_study, writer, me)


# ---------------------------------------------------------------- the calibration: setup, search, confirmation


@dataclass(slots=True)
class SelfSDCalibration:
    """What :func:`calibrate_self_sd` found: the best set, the study's numbers and the confirmation."""

    num_layers: int
    skip_attn: frozenset[int]
    skip_mlp: frozenset[int]
    precision: str
    best_trial: int
    best_value: float  # tokens/s measured in the search
    best_attrs: JsonObject
    trials: int  # COMPLETE trials in the study
    new_trials: int  # trials run by this call
    study_path: Path | str  # the SQLite file, or the --storage as given (the manifest hides its password)
    baseline: JsonObject | None  # the better uniform set
    confirm: dict[str, JsonObject] = field(default_factory=dict)  # name -> Measurement.as_dict()
    seed_points: list[JsonObject] = field(default_factory=list)
    search_time_s: float | None = None  # wall time of every complete trial in the study (resumed runs included)
    writer: bool = True  # False: another worker finished the study last and writes the artifact
    draft_vocab: dict[str, int | str] = field(default_factory=dict)  # precision -> tokens its drafts score ("full": all)


CONTRADICTED = 1.10  # a starting point re-measured this much faster than the chosen set is worth a line


def faster_starting_point(confirm: dict[str, JsonObject], seeds: Sequence[JsonObject], finished: Sequence[Any],
                          num_layers: int, default_precision: str, margin: float = 1.0) -> tuple[str, Any] | None:
    """The starting point that re-measured fastest, if more than ``margin`` times as fast as the search's best set
    (``confirm["best"]``), with its best complete trial; else None. A starting point no trial completed is left out."""
    best = confirm["best"]["tokens_per_s"] * margin
    for s in sorted(seeds, key=lambda s: -confirm.get(s["name"], {}).get("tokens_per_s", float("-inf"))):
        if confirm.get(s["name"], {}).get("tokens_per_s", float("-inf")) <= best:
            return None
        want = (frozenset(s["skip_attn"]), frozenset(s["skip_mlp"]), s["precision"])
        trials = [t for t in finished if t.value is not None
                  and (*skip_sets_from_params(t.params, num_layers), t.params.get("precision", default_precision)) == want]
        if trials:
            return s["name"], max(trials, key=lambda t: t.value)
    return None


class Scorer(Protocol):
    """What the search decodes and scores its candidates with (:class:`~.measure.Candidates`): the precisions
    whose drafts score a draft vocabulary and each precision's vocabulary size, the study's measured inputs, an
    untimed warm-up, one candidate's measurement and the back-to-back confirmation. The search knows no decoder."""

    cheap_heads: list[str]
    vocab_sizes: dict[str, int | str]

    def inputs(self, study: Any) -> None: ...
    def warm_up(self, skip_attn: frozenset[int], skip_mlp: frozenset[int]) -> None: ...
    def measure(self, skip_attn: frozenset[int], skip_mlp: frozenset[int], precision: str) -> Any: ...
    def confirm(self, best: tuple[frozenset[int], frozenset[int], str],
                points: Sequence[Any]) -> dict[str, JsonObject]: ...


def calibrate_self_sd(
    engine: Engine,
    num_prompts: int,
    cfg: GenerationConfig,
    search: SearchConfig,
    candidates: Scorer,
    *,
    fingerprint: str,
    prompts_sha: str,
    on_trial: Callable[[TrialReport], None] = lambda _report: None,
    log: Callable[[str], None] = lambda _msg: None,
    on_ready: Callable[[], None] = lambda: None,
    before_finish: Callable[[], None] = lambda: None,
) -> SelfSDCalibration:
    """Run (or resume, or join) the search until the study holds ``search.n_trials`` COMPLETE
    trials, each candidate decoded and scored by ``candidates`` (over ``num_prompts`` prompts of
    ``cfg.max_new_tokens`` tokens). ``on_ready``: called once the study holds its setup, starting
    points and measured costs (other workers may start then); ``before_finish``: called when the
    study is complete, before this worker decides whether it writes the result (wait for the other
    local workers)."""
    L = engine.num_layers
    precisions = search.precisions
    # what must not change between runs that share a study (values would not compare)
    setup = {"kind": "self-sd-layers", "model_fingerprint": fingerprint, "num_layers": L,
             "max_new_tokens": cfg.max_new_tokens, "prompts_sha256": prompts_sha, "num_prompts": num_prompts,
             "repeats": search.repeats, "objective": search.objective,
             "target_precision": engine.target_precision,  # the verify curve and the drafts' costs are this target's
             "draft": {k: getattr(search.draft, k) for k in ("max_draft", "threshold", "adaptive")}}
    if precisions != ("target",):
        setup["precisions"] = list(precisions)
    points = seed_points(L, precisions=precisions, cheap_head=candidates.cheap_heads)
    if candidates.cheap_heads:  # drafts over an FR-Spec vocabulary: their sizes
        setup["draft_vocab"] = dict(candidates.vocab_sizes)
    found = run_search(search, setup, points, L, candidates.measure, candidates.inputs, candidates.warm_up,
                       on_trial=on_trial, log=log, on_ready=on_ready, before_finish=before_finish)
    finished, best_t, durations, seeds_in_study, writer, me = (found.finished, found.best, found.durations, found.seeds,
                                                               found.writer, found.worker)

    # the fields of both results: a writer's, and that of a worker that leaves the artifact to another
    common = dict(num_layers=L, draft_vocab=dict(candidates.vocab_sizes), best_trial=best_t.number,
                  best_value=float(best_t.value), best_attrs=dict(best_t.user_attrs), trials=len(finished),
                  new_trials=sum(t.user_attrs.get("worker") == me for t in finished),
                  study_path=search.storage if search.storage is not None else search.study_path)
    if not writer:
        return SelfSDCalibration(skip_attn=frozenset(), skip_mlp=frozenset(), precision=precisions[0],
                                 baseline=None, writer=False, **common)
    attn, mlp = skip_sets_from_params(best_t.params, L)
    best_p = best_t.params.get("precision", precisions[0])
    log("re-measuring the best set, the starting points and plain decoding back to back")
    confirm = candidates.confirm((attn, mlp, best_p), points)
    faster = faster_starting_point(confirm, seeds_in_study, finished, L, precisions[0], CONTRADICTED)
    if faster is not None:  # said, not acted on: one short timing must not pick the result (module docstring)
        name, t = faster
        log(f"[yellow]the starting point {name} (trial {t.number}) re-measured at "
            f"{confirm[name]['tokens_per_s']:.1f} tok/s, the chosen set at {confirm['best']['tokens_per_s']:.1f}: "
            f"the search's {'prediction' if search.objective == 'proxy' else 'timing'} and this re-measurement "
            "disagree; more prompts or tokens measure both better[/yellow]")
    # the better uniform set, by the back-to-back re-measurement
    uniform = [s for s in seeds_in_study if s["name"].startswith("uniform-")]  # the paper-style baselines
    base = max(uniform, key=lambda s: confirm[s["name"]]["tokens_per_s"], default=None)
    return SelfSDCalibration(skip_attn=attn, skip_mlp=mlp, precision=best_p, seed_points=seeds_in_study,
                             baseline=base and {**base, "confirm": confirm[base["name"]]}, confirm=confirm,
                             search_time_s=round(sum(durations), 3) if durations else None, **common)


# ---------------------------------------------------------------- one calibration, with its workers and its bar


@dataclass(frozen=True)
class CalibrationPlan:
    """One calibration as the offline step sets it up (:func:`~.calibrate.run` builds it from its job): the model and
    the prompts' count and length (the study's setup records them), the search (its study placed and its precisions
    chosen), the processes that share it and how it reports. :func:`run_calibration` carries it out over the
    offline step's :class:`Scorer`, which decodes."""

    engine: Engine
    num_prompts: int
    gen: GenerationConfig
    search: Any  # a SearchConfig (search.py) with study_path and precisions set
    fingerprint: str  # the model's (the study's setup holds it)
    prompts_sha: str
    workers: int  # --workers: this process and its helpers
    argv: list[str]  # this command line (the helpers run it again)
    unit: str  # the objective's unit, as the progress bar shows it
    log: Callable[[str], None]  # stderr, rich markup allowed
    progress: Callable[[], Any]  # a context manager giving a bar with add_task/update
    exit_note: Callable[[str], None]  # said when the command is interrupted


class Workers:
    """The helper processes of ``--workers N``: the same command line with a hidden
    ``--worker-index`` each, started once the study holds its setup and measured costs, each
    waited for until it has loaded the model and warmed up (so all start trials together).
    A helper prints ``ready`` and then runs trials only. As a context manager: on Ctrl-C the
    helpers (which got the terminal's Ctrl-C too) get 30 s to save their trials; any left
    running are killed."""

    def __init__(self, argv: list[str], n: int, search: Any, log: Callable[[str], None],
                 exit_note: Callable[[str], None]) -> None:
        self.job_argv, self.n, self.search = argv, n, search  # search.study_path: the SQLite file (without a --storage)
        self.log, self.exit_note = log, exit_note
        self.procs: list[Any] = []
        self.done = 0

    def argv(self) -> list[str]:
        """This run's arguments without --workers, --force and the study's name, then the study named explicitly."""
        import sys

        out, args, named = [sys.executable, "-m", "selfspec_cli"], iter(self.job_argv), ("--workers", "--study-path", "--storage")
        for a in args:
            if a in named:  # its value is the next argument
                next(args, None)
            if a.split("=", 1)[0] not in (*named, "--force"):
                out.append(a)
        storage = self.search.storage
        return out + (["--storage", storage] if storage is not None else ["--study-path", str(self.search.study_path)])

    def start(self) -> None:
        import select
        import subprocess

        if self.search.search_only:  # tell the first process this helper is ready
            print("ready", flush=True)
            return
        argv = self.argv()
        for i in range(1, self.n):
            self.procs.append(subprocess.Popen([*argv, "--worker-index", str(i), "--worker-group", self.search.worker],
                                               stdout=subprocess.PIPE, text=True))
        for h in self.procs:  # "ready", or "" when the helper ended before it; after 10 minutes, go on without it
            if select.select([h.stdout], [], [], 600)[0]:
                h.stdout.readline()

    def wait(self) -> None:
        for i, h in enumerate(self.procs, 1):
            h.stdout.read()
            if (rc := h.wait()) != 0:
                self.log(f"[yellow]worker {i} ended with exit status {rc}; its unfinished trial, if any, was run again[/yellow]")

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        import subprocess

        if exc_type is KeyboardInterrupt:
            for h in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(timeout=30)
            self.exit_note(f"{self.done} finished trials are saved in {self.search.where()}; run the same command again to resume")
        for h in self.procs:
            if h.poll() is None:
                h.kill()


class TrialBar:
    """The calibration's progress bar, started by the first report (once the study is open and its costs
    logged) inside ``stack``; each report also tells ``workers`` how many trials are done (said on Ctrl-C)."""

    def __init__(self, stack: contextlib.ExitStack, progress: Callable[[], Any], total: int, unit: str,
                 workers: Workers) -> None:
        self.stack, self.progress, self.total, self.unit, self.workers = stack, progress, total, unit, workers
        self.bar: Any = None
        self.task: Any = None

    def report(self, r: TrialReport) -> None:
        if self.bar is None:
            self.bar = self.stack.enter_context(self.progress())
            self.task = self.bar.add_task("calibrate self-sd", total=self.total, info="")
        unit = self.unit
        info = f"best {r.best_value:.2f} {unit} (trial {r.best_number})" if r.best_value is not None else ""
        if r.value is not None:
            info += f"; last {r.value:.2f} {unit}" + (f", M {r.mean_accepted_length:.2f}"
                                                      if r.mean_accepted_length is not None else "")
        self.workers.done = r.done
        self.bar.update(self.task, completed=min(r.done, self.total), info=info)


def run_calibration(plan: CalibrationPlan, candidates: Scorer) -> SelfSDCalibration:
    """The search of ``plan`` over ``candidates`` (:func:`calibrate_self_sd`) with its ``--workers`` helpers started
    once the study is set up and waited for before the result, and its progress bar. A helper (``search_only``)
    reports nothing."""
    search, helper = plan.search, plan.search.search_only
    workers = Workers(plan.argv, plan.workers, search, plan.log, plan.exit_note)
    say = (lambda _m: None) if helper else plan.log  # the helpers of --workers report through the first process
    with contextlib.ExitStack() as stack:
        bar = TrialBar(stack, plan.progress, search.n_trials, plan.unit, workers)
        with workers:
            return calibrate_self_sd(plan.engine, plan.num_prompts, plan.gen, search, candidates,
                                     fingerprint=plan.fingerprint, prompts_sha=plan.prompts_sha,
                                     on_trial=(lambda _r: None) if helper else bar.report, log=say,
                                     on_ready=workers.start, before_finish=workers.wait)
