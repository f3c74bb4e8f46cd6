"""``selfspec calibrate --method self-sd``: the offline step around Self-SD's skip-set search.

:func:`prepare` checks the step's own options before the model loads (one
:class:`~selfspec_cli.errors.ConfigError` line for a bad one) and :func:`run` does the work on
the loaded model, in this order: where the study lives (``--study-path``, by default beside
``--output``, or ``--storage``) and that its file can be written; the helper processes of
``--workers`` (:class:`Workers`); the draft weights searched (``--draft-precision``); the
search and its confirmation (:func:`~.search.calibrate_self_sd`, which knows no job and no
artifact); then the artifact (:func:`build_manifest`, written through
:data:`~selfspec_cli.methods.self_sd.SKIP_SET`) and the summary the command prints.

Invariants: only the worker that finished the study last writes the artifact, and a
``--workers`` helper writes nothing and returns None; a set predicted slower than plain
decoding never becomes the model's default (it goes beside it as ``*.below-ar.json``). No
typer or rich here: the step reports through the job's ``log`` and progress bar.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...artifacts import check_writable
from ...config import GenerationConfig
from ...errors import ConfigError, count
from ...loading import model_fingerprint
from ..base import resolve_precision
from ..offline import OfflineJob
from . import SKIP_SET, SkipSet
from .search import SearchConfig, SelfSDCalibration, calibrate_self_sd
from .study import DEFAULT_HEARTBEAT_S, STUDY_NAME, TrialReport, check_storage, describe, worker_id


# ---------------------------------------------------------------- the artifact


def build_manifest(result: SelfSDCalibration, *, model: torch.nn.Module, cfg: GenerationConfig,
                   search: SearchConfig, prompts: dict[str, Any], environment: dict[str, Any],
                   target_precision: str | None = None) -> dict[str, Any]:
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
            "target_precision": target_precision,
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
    search = dataclasses.replace(search, study_path=db_path)
    workers = Workers(job, s.workers, search)  # the helpers that share the study: started once it is set up (on_ready)
    where = search.where()
    quantized = resolve_precision(engine, s.draft_precision)  # None: target, or auto without a quantized copy
    own = ("target",) if s.draft_precision in ("auto", "target") else ()  # auto searches both weights
    precisions = own + ((quantized,) if quantized else ())
    search = dataclasses.replace(search, precisions=precisions)
    unit = "x ar (predicted)" if search.objective == "proxy" else "tok/s"
    say = (lambda _m: None) if helper else job.log  # the helpers of --workers report through the first process
    say(f"[dim]model {job.model.config.model_type} {engine.num_layers} layers ({2 * engine.num_layers} sublayers), "
        f"{engine.dtype}, {engine.device}; {count(len(job.prompt_ids), 'prompt')} x {count(job.gen.max_new_tokens, 'token')}"
        f"{f' x {search.repeats} passes' if search.repeats > 1 else ''}; sampler {search.sampler}, seed {search.seed}; "
        f"draft weights {', '.join(precisions)}; study {where}{f'; {s.workers} workers' if s.workers > 1 else ''}[/dim]")
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
    environment = job.environment()
    manifest = build_manifest(result, model=job.model, cfg=job.gen, search=search, prompts=job.prompts,
                              environment=environment, target_precision=engine.target_precision)
    obj, out = manifest["objective"], job.output
    vs_ar = result.best_value if search.objective == "proxy" else obj.get("speedup_vs_ar")
    below_ar = vs_ar is not None and vs_ar < 1.0
    said = ""
    if below_ar:
        measured = obj.get("speedup_vs_ar")
        said = (f"predicted at {vs_ar:.2f}x ar by the search's proxy (the verdict; one short re-measurement read "
                f"{measured:.2f}x)" if search.objective == "proxy" and measured is not None else f"{vs_ar:.2f}x ar")
    # never install, as this model's default, a set slower than plain decoding (methods/offline.py: the one rule);
    # the same command run again (the study resumes) replaces its own below-ar result
    out = job.destination(SKIP_SET, f"the best set found is {said}, slower than plain decoding" if below_ar else None,
                          "below-ar")
    SKIP_SET.save(out, job.model, manifest)
    base, conf = result.baseline, result.confirm  # baseline None: the model has no uniform starting set
    job.log(f"[bold]best (trial {result.best_trial}): {len(result.skip_attn)} attention + {len(result.skip_mlp)} MLP "
            f"of {2 * result.num_layers} sublayers skipped, {result.best_value:.2f} {unit} in the search; re-measured: "
            + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in conf.items()) + " tok/s[/bold]")
    job.log(f"wrote {out}")
    if below_ar:
        job.warn_throwaway(out, f"the best set found is {said}, slower than plain decoding",
                           f"run more --trials (the study resumes), pass --layers {out} to use it")
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

    def __init__(self, job: OfflineJob, n: int, search: SearchConfig) -> None:
        self.job, self.n, self.search = job, n, search  # search.study_path: the SQLite file (without a --storage)
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
                self.job.log(f"[yellow]worker {i} ended with exit status {rc}; its unfinished trial, if any, was run again[/yellow]")

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        import subprocess

        if exc_type is KeyboardInterrupt:
            for h in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(timeout=30)
            self.job.exit_note(f"{self.done} finished trials are saved in {self.search.where()}; run the same command again to resume")
        for h in self.procs:
            if h.poll() is None:
                h.kill()
