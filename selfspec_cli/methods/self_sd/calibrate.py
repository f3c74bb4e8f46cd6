"""``selfspec calibrate --method self-sd``: the offline step around Self-SD's skip-set search.

:func:`prepare` checks the step's own options before the model loads (one
:class:`~selfspec_cli.errors.ConfigError` line for a bad one) and :func:`run` does the work on
the loaded model, top to bottom: :func:`plan_calibration` builds the typed plan (where the study
lives, ``--study-path``, by default beside ``--output``, or ``--storage``, and that its file can
be written; the draft weights searched, ``--draft-precision``); :class:`~.measure.Candidates`
fixes how every candidate set is decoded and scored; :func:`~.study.run_calibration` runs the
search over them, its ``--workers`` helpers and its confirmation and returns a typed
:class:`~.study.SelfSDCalibration`; :func:`write_result` writes the artifact
(:func:`build_manifest`, through :data:`~selfspec_cli.methods.self_sd.SKIP_SET` and
:meth:`~selfspec_cli.methods.offline.OfflineJob.publish`) and returns the summary the command prints.

Invariants: only the worker that finished the study last writes the artifact, and a
``--workers`` helper writes nothing and returns None; a set predicted slower than plain
decoding never becomes the model's default (it goes beside it as ``*.below-ar.json``). No
typer or rich here: the step reports through the job's ``log`` and progress bar.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ...artifacts import check_writable, environment_info
from ...config import GenerationConfig
from ...errors import ConfigError, count
from ...loading import model_fingerprint
from ..base import resolve_precision
from ..offline import OfflineJob
from . import DEFAULT_HEARTBEAT_S, SKIP_SET, SkipSet
from .measure import Candidates
from .search import SearchConfig
from .study import STUDY_NAME, CalibrationPlan, SelfSDCalibration, check_storage, run_calibration, worker_id
from ...jsonio import JsonObject


# ---------------------------------------------------------------- the artifact


def build_manifest(result: SelfSDCalibration, *, model: torch.nn.Module, cfg: GenerationConfig,
                   search: SearchConfig, prompts: JsonObject, environment: JsonObject,
                   target_precision: str | None = None) -> JsonObject:
    """The ``self-sd-layers`` manifest (:data:`~selfspec_cli.methods.self_sd.SKIP_SET`)."""
    ar, best_c = result.confirm["ar"]["tokens_per_s"], result.confirm["best"]["tokens_per_s"]
    proxy = search.objective == "proxy"
    objective: JsonObject = {
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
            "seed_points": result.seed_points, "study_path": search.where(), "study_name": STUDY_NAME,
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


def prepare(options: JsonObject) -> Setting:
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


def run(job: OfflineJob) -> JsonObject | None:
    """Search, confirm, write the skip set (a set predicted slower than ``ar`` goes beside the
    default path as ``*.below-ar.json``, never as the model's default). A ``--workers`` helper
    returns None; a worker that did not finish the study last reports ``"writer": false``."""
    plan = plan_calibration(job)
    search, where = plan.search, plan.search.where()
    say = (lambda _m: None) if search.search_only else job.log  # the helpers of --workers report through the first process
    engine = job.engine
    say(f"[dim]model {job.model.config.model_type} {engine.num_layers} layers ({2 * engine.num_layers} sublayers), "
        f"{engine.dtype}, {engine.device}; {count(len(job.prompt_ids), 'prompt')} x {count(job.gen.max_new_tokens, 'token')}"
        f"{f' x {search.repeats} passes' if search.repeats > 1 else ''}; sampler {search.sampler}, seed {search.seed}; "
        f"draft weights {', '.join(search.precisions)}; study {where}{f'; {plan.workers} workers' if plan.workers > 1 else ''}[/dim]")
    candidates = Candidates(engine, job.tokenizer, job.prompt_ids, job.gen, search.precisions, draft=search.draft,
                            repeats=search.repeats, proxy=search.objective == "proxy")
    result = run_calibration(plan, candidates)
    if search.search_only:
        return None
    if not result.writer:
        job.log(f"the study holds its {result.trials} trials ({result.new_trials} from this worker); the worker that "
                "finished the last one writes the artifact")
        return {"method": "self-sd", "artifact": None, "study": where, "trials": result.trials,
                "new_trials": result.new_trials, "best_trial": result.best_trial, "writer": False}
    return write_result(job, result, search, where, plan.unit)


def plan_calibration(job: OfflineJob) -> CalibrationPlan:
    """The calibration ``job`` asks for: the study placed (``--study-path``, by default beside ``--output``, or
    ``--storage``; its file checked for writing before anything is decoded, since the study makes the file when it
    opens) and the draft weights searched (``--draft-precision``: auto searches the target's own and a quantized
    copy where there is one)."""
    s: Setting = job.setting
    search = s.search
    db_path = Path(search.study_path) if search.study_path is not None else job.output.with_name(job.output.stem + ".optuna.db")
    if search.storage is None:
        check_writable(db_path, "--study-path")
    quantized = resolve_precision(job.engine, s.draft_precision)  # None: target, or auto without a quantized copy
    own = ("target",) if s.draft_precision in ("auto", "target") else ()  # auto searches both weights
    search = dataclasses.replace(search, study_path=db_path, precisions=own + ((quantized,) if quantized else ()))
    return CalibrationPlan(
        engine=job.engine, num_prompts=len(job.prompt_ids), gen=job.gen, search=search,
        fingerprint=model_fingerprint(job.model), prompts_sha=job.prompts["sha256"], workers=s.workers, argv=job.argv,
        unit="x ar (predicted)" if search.objective == "proxy" else "tok/s", log=job.log, progress=job.progress,
        exit_note=job.exit_note)


def write_result(job: OfflineJob, result: SelfSDCalibration, search: SearchConfig, where: str, unit: str) -> JsonObject:
    """The skip set written (never as the model's default when it is predicted slower than plain decoding:
    methods/offline.py, the one rule; the same command run again, the study resuming, replaces its own below-ar
    result) and the summary the command prints."""
    engine = job.engine
    environment = environment_info(engine.device, engine.dtype)
    manifest = build_manifest(result, model=job.model, cfg=job.gen, search=search, prompts=job.prompts,
                              environment=environment, target_precision=engine.target_precision)
    obj = manifest["objective"]
    vs_ar = result.best_value if search.objective == "proxy" else obj.get("speedup_vs_ar")
    below_ar = vs_ar is not None and vs_ar < 1.0
    said = ""
    if below_ar:
        measured = obj.get("speedup_vs_ar")
        said = (f"predicted at {vs_ar:.2f}x ar by the search's proxy (the verdict; one short re-measurement read "
                f"{measured:.2f}x)" if search.objective == "proxy" and measured is not None else f"{vs_ar:.2f}x ar")
    base, conf = result.baseline, result.confirm  # baseline None: the model has no uniform starting set
    best = (f"[bold]best (trial {result.best_trial}): {len(result.skip_attn)} attention + {len(result.skip_mlp)} MLP "
            f"of {2 * result.num_layers} sublayers skipped, {result.best_value:.2f} {unit} in the search; re-measured: "
            + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in conf.items()) + " tok/s[/bold]")
    out = job.publish(SKIP_SET, manifest, f"the best set found is {said}, slower than plain decoding" if below_ar else None,
                      "below-ar", lambda out: f"run more --trials (the study resumes), pass --layers {out} to use it",
                      said=[best])
    return {"method": "self-sd", "artifact": str(out), "study": where, "model": manifest["model_name_or_path"],
            "model_fingerprint": manifest["model_fingerprint"], "num_layers": result.num_layers,
            "skip_attn": sorted(result.skip_attn), "skip_mlp": sorted(result.skip_mlp),
            "objective": obj["value"], "unit": obj["unit"], "best_trial": result.best_trial,
            "mean_accepted_length": obj["mean_accepted_length"], "acceptance_rate": obj["acceptance_rate"],
            "baseline": base and {"name": base["name"], "value": base["value"], "confirm": base["confirm"]["tokens_per_s"]},
            "confirm": {k: v["tokens_per_s"] for k, v in conf.items()},
            "speedup_vs_ar": obj.get("speedup_vs_ar"), "speedup_vs_baseline": obj.get("speedup_vs_baseline"),
            "trials": result.trials, "new_trials": result.new_trials, "below_ar": below_ar, "writer": True}
