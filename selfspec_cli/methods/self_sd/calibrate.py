"""Offline search of Self-SD's skipped-sublayer set (Draft & Verify, Zhang et al., ACL 2024).

The paper searches, by Bayesian optimization, which of the 2L sublayers (L attention,
L MLP) the draft skips, maximizing measured decoding throughput on a few
calibration prompts. Here:

* search space: one categorical 0/1 parameter per sublayer, ``attn_<l>`` and
  ``mlp_<l>`` (free cardinality, first and last layers included, as in Self-SD), and,
  when more than one draft precision is searched, a categorical ``precision`` (the
  target's own weights, or a quantized copy: engine/quant.py): skip set and precision are
  searched together, the skip set on top of the quantized weights;
* objective (``proxy``, the default): each candidate decodes the prompts for real
  (:class:`selfspec_cli.methods.self_sd.SelfSD`, greedy, ``max_new_tokens`` per prompt),
  and its score is the predicted speedup :func:`~.measure.proxy_speedup`: tokens after the
  prefills over the rounds' cost in plain steps, ``k c + v(k + 1)`` per round, with ``c`` from
  weight bytes and ``v`` from the verify curve kept in the study (:mod:`.measure`); nothing in the score is timed per trial, so machine load cannot reorder
  candidates and trials from different machines compare. ``throughput`` (the paper's):
  tokens / wall seconds of the decode calls. Greedy Self-SD is lossless, so every trial
  produces the same tokens; mean accepted length M and acceptance rate are kept per
  trial (``user_attrs``);
* sampler: Optuna's multivariate TPE by default (``gp`` and ``random`` on request);
  see ``docs/calibrate.md`` for the measurements behind that choice;
* starting points: uniform SWIFT-style sets (interior layers at even spacing, both
  sublayers) at skip ratios 0.3 and 0.45 at every searched precision, and the empty set
  (full depth) at every quantized one (and at the target's own weights when its drafts
  score a draft vocabulary), are enqueued first (:func:`~.study.seed_points`);
* storage: an Optuna study in an SQLite file by default, or any storage Optuna shares
  between processes and machines (a database URL, a journal file: :mod:`.study`),
  worked on by one or many workers at once. Optuna commits each trial when it finishes,
  so a Ctrl-C loses at most the running trial, and a re-run with the same study resumes:
  ``n_trials`` counts COMPLETE trials, only the rest are run; a worker killed mid-trial
  is detected by heartbeat and its trial run again. The proxy's measured inputs (the
  verify curve, a quantized draft's full-depth cost) are measured by the first worker and
  kept in the study, so every worker scores trials with the same numbers;
* confirmation: after the search, the best set, the uniform sets and plain
  autoregressive decoding are measured again back to back, so the reported
  speedups compare numbers taken under the same machine load (the best trial's
  own value is biased upward: it is the maximum of noisy measurements).

No typer or rich here: :func:`run`, the offline step, reports through the job's ``log`` and progress bar.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...artifacts import check_writable
from ...loading import model_fingerprint
from ...config import GenerationConfig
from ...decoding.layer_skip import DraftSettings
from ...engine import Engine
from ...errors import ConfigError
from ..base import resolve_precision
from ..offline import OfflineJob
from . import SKIP_SET, SkipSet
from .measure import DEFAULT_DRAFT, Candidates
# the search space and the Optuna study live in .study; their names stay importable from here
from .study import (DEFAULT_HEARTBEAT_S, STUDY_NAME, SeedPoint, TrialReport, check_storage, describe, make_sampler,  # noqa: F401
                    open_study, params_for, run_search, seed_points, skip_sets_from_params, worker_id)

SAMPLERS = ("tpe", "gp", "random")
OBJECTIVES = ("proxy", "throughput")


# ---------------------------------------------------------------- the study


@dataclass(frozen=True, slots=True)
class SearchConfig:
    study_path: Path | None  # None: not chosen yet (the CLI validates the rest before it loads the model)
    n_trials: int = 100  # COMPLETE trials wanted in the study, resumed ones included
    seed: int = 0
    sampler: str = "tpe"
    repeats: int = 1  # passes per measurement; per prompt the fastest counts
    objective: str = "proxy"  # "proxy" (timing-free, proxy_speedup) or "throughput" (measured tokens/s)
    draft: DraftSettings = DEFAULT_DRAFT
    precisions: tuple[str, ...] = ("target",)  # draft weights searched with the skip set (engine/quant.py)
    storage: str | None = None  # an Optuna storage (.study); None: the SQLite file study_path
    heartbeat_s: int = DEFAULT_HEARTBEAT_S  # seconds between a running trial's heartbeats
    worker_index: int = 0  # this process among the --workers of one command (0: the one that writes)
    search_only: bool = False  # a helper worker: run trials, never the confirmation or the artifact
    worker: str = ""  # this worker's name in the study (the helpers of --workers share their first process's)

    def __post_init__(self) -> None:
        for flag, value in (("trials", self.n_trials), ("repeats", self.repeats), ("heartbeat", self.heartbeat_s)):
            if value < 1:
                raise ConfigError(f"--{flag} must be >= 1, got {value}")
        for flag, value, choices in (("objective", self.objective, OBJECTIVES), ("sampler", self.sampler, SAMPLERS)):
            if value not in choices:
                raise ConfigError(f"unknown --{flag} '{value}'; choose one of: {', '.join(choices)}")


@dataclass(slots=True)
class SelfSDCalibration:
    num_layers: int
    skip_attn: frozenset[int]
    skip_mlp: frozenset[int]
    precision: str
    best_trial: int
    best_value: float  # tokens/s measured in the search
    best_attrs: dict[str, Any]
    trials: int  # COMPLETE trials in the study
    new_trials: int  # trials run by this call
    study_path: Path | str  # the SQLite file, or the --storage as given (the manifest hides its password)
    baseline: dict[str, Any] | None  # the better uniform set
    confirm: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> Measurement.as_dict()
    seed_points: list[dict[str, Any]] = field(default_factory=list)
    search_time_s: float | None = None  # wall time of every complete trial in the study (resumed runs included)
    writer: bool = True  # False: another worker finished the study last and writes the artifact
    draft_vocab: dict[str, int | str] = field(default_factory=dict)  # precision -> tokens its drafts score ("full": all)


def calibrate_self_sd(
    engine: Engine,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    cfg: GenerationConfig,
    search: SearchConfig,
    *,
    fingerprint: str,
    prompts_sha: str,
    on_trial: Callable[[TrialReport], None] = lambda _report: None,
    log: Callable[[str], None] = lambda _msg: None,
    on_ready: Callable[[], None] = lambda: None,
    before_finish: Callable[[], None] = lambda: None,
) -> SelfSDCalibration:
    """Run (or resume, or join) the search until the study holds ``search.n_trials`` COMPLETE
    trials. ``on_ready``: called once the study holds its setup, starting points and measured
    costs (other workers may start then); ``before_finish``: called when the study is complete,
    before this worker decides whether it writes the result (wait for the other local workers)."""
    if not cfg.sampling.greedy:
        raise ConfigError("Self-SD calibration decodes greedily; pass a greedy GenerationConfig")
    L = engine.num_layers
    precisions = search.precisions
    # what must not change between runs that share a study (values would not compare)
    setup = {"kind": "self-sd-layers", "model_fingerprint": fingerprint, "num_layers": L,
             "max_new_tokens": cfg.max_new_tokens, "prompts_sha256": prompts_sha, "num_prompts": len(prompt_ids),
             "repeats": search.repeats, "objective": search.objective,
             "draft": {k: getattr(search.draft, k) for k in ("max_draft", "threshold", "adaptive")}}
    if precisions != ("target",):
        setup["precisions"] = list(precisions)
    candidates = Candidates(engine, tokenizer, prompt_ids, cfg, precisions, draft=search.draft, repeats=search.repeats,
                            proxy=search.objective == "proxy")
    points = seed_points(L, precisions=precisions, cheap_head=candidates.cheap_heads())
    if candidates.cheap_heads():  # drafts over an FR-Spec vocabulary: their sizes
        setup["draft_vocab"] = candidates.vocab_sizes()
    found = run_search(search, setup, points, L, candidates.measure, candidates.inputs, candidates.warm_up,
                       on_trial=on_trial, log=log, on_ready=on_ready, before_finish=before_finish)
    finished, best_t, durations, seeds_in_study, writer, me = (found.finished, found.best, found.durations, found.seeds,
                                                               found.writer, found.worker)

    # the fields of both results: a writer's, and that of a worker that leaves the artifact to another
    common = dict(num_layers=L, draft_vocab=candidates.vocab_sizes(), best_trial=best_t.number,
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
    # the better uniform set, by the back-to-back re-measurement
    uniform = [s for s in seeds_in_study if s["name"].startswith("uniform-")]  # the paper-style baselines
    base = max(uniform, key=lambda s: confirm[s["name"]]["tokens_per_s"], default=None)
    return SelfSDCalibration(skip_attn=attn, skip_mlp=mlp, precision=best_p, seed_points=seeds_in_study,
                             baseline=base and {**base, "confirm": confirm[base["name"]]}, confirm=confirm,
                             search_time_s=round(sum(durations), 3) if durations else None, **common)


# ---------------------------------------------------------------- the artifact


def build_manifest(result: SelfSDCalibration, *, model: torch.nn.Module, cfg: GenerationConfig,
                   search: SearchConfig, prompts: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The ``self-sd-layers`` manifest (:data:`~selfspec_cli.methods.self_sd.SKIP_SET`)."""
    ar, best_c = result.confirm["ar"]["tokens_per_s"], result.confirm["best"]["tokens_per_s"]
    proxy = search.objective == "proxy"
    objective: dict[str, Any] = {
        "name": "self-sd predicted speedup (hardware-aware proxy)" if proxy else "self-sd greedy decoding throughput",
        "value": round(result.best_value, 4 if proxy else 3),
        "unit": "x ar" if proxy else "tokens/s",
        "definition": ("tokens after the prefills / sum over rounds of (k c + v(k+1)) plain steps: c from weight "
                       "bytes, v measured once, the rounds' draft lengths k and acceptance by decoding" if proxy else
                       "tokens produced / wall seconds of the decode calls, over the calibration prompts"),
        "best_trial": result.best_trial, "mean_accepted_length": result.best_attrs.get("mean_accepted_length"),
        "acceptance_rate": result.best_attrs.get("acceptance_rate"), "baseline": result.baseline,
        "confirm": result.confirm,
    }
    if ar:
        objective["speedup_vs_ar"] = round(best_c / ar, 4)
        base_c = (result.baseline or {}).get("confirm")
        if base_c and base_c["tokens_per_s"]:
            objective["speedup_vs_baseline"] = round(best_c / base_c["tokens_per_s"], 4)
    return SkipSet(frozenset(result.skip_attn), frozenset(result.skip_mlp)).to_manifest(
        model, objective=objective, trials=result.trials, search_time_s=result.search_time_s,
        draft_precision=result.precision,
        search={
            "sampler": search.sampler, "sampler_options": {"multivariate": True} if search.sampler == "tpe" else {},
            "seed": search.seed, "repeats": search.repeats,
            "n_trials": search.n_trials, "new_trials": result.new_trials,
            "space": f"{2 * result.num_layers} categorical 0/1 parameters attn_<l>, mlp_<l>"
                     + (f", precision in {list(search.precisions)}" if len(search.precisions) > 1 else ""),
            "precisions": list(search.precisions), "draft_vocab": result.draft_vocab,
            "seed_points": result.seed_points, "study_path": describe(str(result.study_path)), "study_name": STUDY_NAME,
            "max_new_tokens": cfg.max_new_tokens,
            "draft": {k: getattr(search.draft, k) for k in ("max_draft", "threshold", "adaptive", "tree")},
            "prompts": prompts,
        },
        environment=environment)


# ---------------------------------------------------------------- the offline step


@dataclass(frozen=True)
class Setting:
    """``selfspec calibrate --method self-sd``'s own options, checked before the model loads."""

    search: SearchConfig
    workers: int
    draft_precision: str

    @property
    def writes(self) -> bool:  # a --workers helper runs trials only
        return not self.search.search_only


def prepare(options: dict[str, Any]) -> Setting:
    o = {"trials": 100, "seed": 0, "sampler": "tpe", "objective": "proxy", "repeats": None, "study_path": None,
         "storage": None, "workers": 1, "heartbeat": DEFAULT_HEARTBEAT_S, "worker_index": 0, "worker_group": None,
         "draft_precision": "auto", **options}
    if o["storage"] is not None and o["study_path"] is not None:
        raise ConfigError("--storage and --study-path both name the study; pass one of them")
    if o["workers"] < 1:
        raise ConfigError(f"--workers must be >= 1, got {o['workers']}")
    if o["storage"] is not None:
        check_storage(o["storage"])  # a bad URL costs no model load
    repeats = o["repeats"] if o["repeats"] is not None else (1 if o["objective"] == "proxy" else 3)
    search = SearchConfig(study_path=o["study_path"], n_trials=o["trials"], seed=o["seed"], sampler=o["sampler"],
                          repeats=repeats, objective=o["objective"], storage=o["storage"], heartbeat_s=o["heartbeat"],
                          worker_index=o["worker_index"], search_only=o["worker_index"] > 0,
                          worker=o["worker_group"] or worker_id())
    if search.study_path is not None:
        check_writable(Path(search.study_path), "--study-path")
    return Setting(search, o["workers"], o["draft_precision"])


def run(job: OfflineJob) -> dict[str, Any] | None:
    """Search, confirm, write the skip set (a set predicted slower than ``ar`` goes beside the
    default path as ``*.below-ar.json``, never as the model's default). A ``--workers`` helper
    returns None; a worker that did not finish the study last reports ``"writer": false``."""
    s: Setting = job.setting
    search, engine, helper = s.search, job.engine, s.search.search_only
    db_path = Path(search.study_path) if search.study_path is not None else job.output.with_name(job.output.stem + ".optuna.db")
    if search.storage is None:  # before anything is decoded (the study makes the file when it opens)
        check_writable(db_path, "--study-path")
    where = describe(search.storage) if search.storage is not None else str(db_path)
    quantized = resolve_precision(engine, s.draft_precision)  # None: target, or auto without a quantized copy
    own = ("target",) if s.draft_precision in ("auto", "target") else ()  # auto searches both weights
    precisions = own + ((quantized,) if quantized else ())
    search = dataclasses.replace(search, study_path=db_path, precisions=precisions)
    unit = "x ar (predicted)" if search.objective == "proxy" else "tok/s"
    say = (lambda _m: None) if helper else job.log  # the helpers of --workers report through the first process
    say(f"[dim]model {job.model.config.model_type} {engine.num_layers} layers ({2 * engine.num_layers} sublayers), "
        f"{engine.dtype}, {engine.device}; {len(job.prompt_ids)} prompts x {job.gen.max_new_tokens} tokens"
        f"{f' x {search.repeats} passes' if search.repeats > 1 else ''}; sampler {search.sampler}, seed {search.seed}; "
        f"draft weights {', '.join(precisions)}; study {where}{f'; {s.workers} workers' if s.workers > 1 else ''}[/dim]")
    workers = Workers(job, s.workers, search, db_path, where)
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []  # (bar, task): started by the first report, once the study is open and its costs logged

        def on_trial(r: TrialReport) -> None:
            if not bar:
                bar.append(stack.enter_context(job.progress()))
                bar.append(bar[0].add_task("calibrate self-sd", total=search.n_trials, info=""))
            info = f"best {r.best_value:.2f} {unit} (trial {r.best_number})" if r.best_value is not None else ""
            if r.value is not None:
                info += f"; last {r.value:.2f} {unit}" + (f", M {r.mean_accepted_length:.2f}"
                                                          if r.mean_accepted_length is not None else "")
            workers.done = r.done
            bar[0].update(bar[1], completed=min(r.done, search.n_trials), info=info)

        with workers:
            result = calibrate_self_sd(engine, job.tokenizer, job.prompt_ids, job.gen, search,
                                       fingerprint=model_fingerprint(job.model),
                                       prompts_sha=job.prompts["sha256"], on_trial=(lambda _r: None) if helper else on_trial,
                                       log=say, on_ready=workers.start, before_finish=workers.wait)
    if helper:
        return None
    if not result.writer:
        job.log(f"the study holds its {result.trials} trials ({result.new_trials} from this worker); the worker that "
                "finished the last one writes the artifact")
        return {"method": "self-sd", "artifact": None, "study": where, "trials": result.trials,
                "new_trials": result.new_trials, "best_trial": result.best_trial, "writer": False}
    manifest = build_manifest(result, model=job.model, cfg=job.gen, search=search, prompts=job.prompts,
                              environment=job.environment())
    obj, out = manifest["objective"], job.output
    vs_ar = result.best_value if search.objective == "proxy" else obj.get("speedup_vs_ar")
    below_ar = vs_ar is not None and vs_ar < 1.0
    if below_ar and not job.explicit_output:  # never install, as this model's default, a set slower than plain decoding
        # the study's own latest result, not a file the user named: the same command run again (the study
        # resumes, as the message below says) replaces it instead of stopping at "already exists"
        out = SKIP_SET.check_output(out.with_name(out.stem + ".below-ar.json"), True)
    SKIP_SET.save(out, job.model, manifest)
    base, conf = result.baseline, result.confirm  # baseline None: the model has no uniform starting set
    job.log(f"[bold]best (trial {result.best_trial}): {len(result.skip_attn)} attention + {len(result.skip_mlp)} MLP "
            f"of {2 * result.num_layers} sublayers skipped, {result.best_value:.2f} {unit} in the search; re-measured: "
            + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in conf.items()) + " tok/s[/bold]")
    job.log(f"wrote {out}")
    if below_ar:
        job.log(f"[bold yellow]the best set found is {vs_ar:.2f}x ar, slower than plain decoding: "
                + ("" if job.explicit_output else "not made this model's default (generate keeps the previous one); ")
                + f"run more --trials (the study resumes), or pass --layers {out} to use it anyway[/bold yellow]")
    return {"method": "self-sd", "artifact": str(out), "study": where, "model": manifest["model_name_or_path"],
            "model_fingerprint": manifest["model_fingerprint"], "num_layers": result.num_layers,
            "skip_attn": sorted(result.skip_attn), "skip_mlp": sorted(result.skip_mlp),
            "objective": obj["value"], "unit": obj["unit"], "best_trial": result.best_trial,
            "mean_accepted_length": obj["mean_accepted_length"], "acceptance_rate": obj["acceptance_rate"],
            "baseline": base and {"name": base["name"], "value": base["value"], "confirm": base["confirm"]["tokens_per_s"]},
            "confirm": {k: v["tokens_per_s"] for k, v in conf.items()},
            "speedup_vs_ar": obj.get("speedup_vs_ar"), "speedup_vs_baseline": obj.get("speedup_vs_baseline"),
            "trials": result.trials, "new_trials": result.new_trials, "below_ar": below_ar, "writer": True}


class Workers:
    """The helper processes of ``--workers N``: the same command line with a hidden
    ``--worker-index`` each, started once the study holds its setup and measured costs, each
    waited for until it has loaded the model and warmed up (so all start trials together).
    A helper prints ``ready`` and then runs trials only. As a context manager: on Ctrl-C the
    helpers (which got the terminal's Ctrl-C too) get 30 s to save their trials; any left
    running are killed."""

    def __init__(self, job: OfflineJob, n: int, search: SearchConfig, db_path: Path, where: str) -> None:
        self.job, self.n, self.search, self.db_path, self.where = job, n, search, db_path, where
        self.procs: list[Any] = []
        self.done = 0

    def argv(self) -> list[str]:
        """This run's arguments without --workers, --force and the study's name, then the study named explicitly."""
        import sys

        out, args, named = [sys.executable, "-m", "selfspec_cli"], iter(self.job.argv), ("--workers", "--study-path", "--storage")
        for a in args:
            if a in named:  # its value is the next argument
                next(args, None)
            if a.split("=", 1)[0] not in (*named, "--force"):
                out.append(a)
        storage = self.search.storage
        return out + (["--storage", storage] if storage is not None else ["--study-path", str(self.db_path)])

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
                self.job.log(f"[yellow]worker {i} ended with exit status {rc}; its unfinished trial, if any, was run again[/yellow]")

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        import subprocess

        if exc_type is KeyboardInterrupt:
            for h in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(timeout=30)
            self.job.exit_note(f"{self.done} finished trials are saved in {self.where}; run the same command again to resume")
        for h in self.procs:
            if h.poll() is None:
                h.kill()
