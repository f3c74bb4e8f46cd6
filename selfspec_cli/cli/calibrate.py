"""``selfspec calibrate``: offline searches saved as artifacts: Self-SD's skip set and draft
precision, SpecEE's exit statistics, FR-Spec's draft vocabulary. A Self-SD result predicted
slower than plain decoding is written beside the default path (``*.below-ar.json``), never
as the model's default."""
from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ..artifacts import (check_new_artifact, default_skip_artifact_path, environment_info, model_name, now_iso,
                         save_json_artifact, save_tensors_artifact)
from ..calibrate import CALIBRATE_METHODS
from ..calibrate.data import load_calibration_prompts, prompts_digest
from ..calibrate.self_sd import SAMPLERS, SearchConfig, TrialReport, build_manifest, calibrate_self_sd, check_writable
from ..calibrate.study import DEFAULT_HEARTBEAT_S, describe, worker_id
from ..config import GenerationConfig
from ..engine import Engine
from ..errors import ConfigError
from ..loading import load_model, model_fingerprint
from ..methods import fr_spec
from ..methods.base import DRAFT_PRECISIONS, resolve_precision
from ..methods import head_store as store
from ..prompts import PROMPT_FORMATS, Prompt
from ..runtime import check_prompt_fits, context_length, encode_turn, eos_token_ids
from .common import MODEL_HELP, THREADS_HELP, invocation_args, print_json, apply_threads, check_choice, log, progress, set_exit_note


def _check_output(path: Path, force: bool, directory: bool = False) -> Path:
    check_new_artifact(path, force)
    check_writable(path / "manifest.json" if directory else path, "--output")
    return path


def calibrate(
    method: Optional[str] = typer.Option(None, "--method", help=f"What to calibrate (required): {', '.join(CALIBRATE_METHODS)}."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Calibration prompts (as for generate; first turn of each). One of --prompt-file and --dataset is required."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="--prompt-file format: auto, text or jsonl (as for generate)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Calibration prompts from a local .jsonl/.json/.csv/.parquet file, read with `datasets` (instead of --prompt-file)."),
    dataset_field: str = typer.Option("prompt", "--dataset-field", help="Column of --dataset holding the prompt text."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use at most this many prompts (in file order; default 8, fr-spec 64)."),
    trials: int = typer.Option(100, "--trials", help="Complete trials wanted in the study; a resumed study runs only the rest."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed."),
    sampler: str = typer.Option("tpe", "--sampler", help=f"Optuna sampler: {', '.join(SAMPLERS)} (see docs/calibrate.md)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens generated per prompt in each trial (default 32, fr-spec 128)."),
    objective: str = typer.Option("proxy", "--objective", help="proxy (default): the predicted speedup from measured acceptance and draft lengths, draft cost from weight bytes and the engine's measured verify curve; no per-trial timing, so machine load cannot reorder candidates (docs/calibrate.md). throughput: measured tokens/s."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Decode the prompts this many times per trial; per prompt the fastest pass counts (default 3 with --objective throughput, 1 with proxy)."),
    study_path: Optional[Path] = typer.Option(None, "--study-path", help="Optuna SQLite study (resumable). Default: <output stem>.optuna.db beside --output."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Self-SD: the study in any storage Optuna shares between processes and machines, instead of --study-path: a database URL (sqlite:///study.db, postgresql://user@host/db, mysql://...) or a journal file on a disk every worker sees (journal:PATH, or a path ending in .journal). Another machine joins by running the same command with the same --storage (docs/calibrate.md)."),
    workers: int = typer.Option(1, "--workers", help="Self-SD: processes working on the study at once on this machine (each loads the model; one thread each unless --threads)."),
    heartbeat: int = typer.Option(DEFAULT_HEARTBEAT_S, "--heartbeat", help="Seconds between a running trial's heartbeats; a worker silent for 3 of them is taken as dead and its trial is run again."),
    worker_index: int = typer.Option(0, "--worker-index", hidden=True, help="Set by --workers for the helper processes it starts."),
    worker_group: Optional[str] = typer.Option(None, "--worker-group", hidden=True, help="Set by --workers: the first process's worker name."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact path. Default: <selfspec home>/artifacts/self-sd/<model name>-<fingerprint>.json (home: $SELFSPEC_HOME, else ~/.local/share/selfspec); never the shipped artifacts."),
    force: bool = typer.Option(False, "--force", help="Replace an existing artifact at the output path."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    draft_precision: str = typer.Option("auto", "--draft-precision", help="Self-SD: draft weights searched together with the skip set: auto (the target's own and the quantized copy generate would use: the GGUF's own blocks for a GGUF model, else int8), target (the target's only), int8, int8-g32 or gguf (that one only)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one (as generate does)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Self-SD: search skipped sublayers and the draft's precision by Bayesian optimization (of the predicted
    speedup, or of measured throughput with --objective throughput). SpecEE: exit-frequency
    statistics per layer and the predictor subset they select. FR-Spec: the model's own output tokens ranked by
    frequency, and the draft-vocabulary size chosen by measured coverage and head cost. Saves an artifact."""
    if method is None:  # checked here, not by click: a missing option must also be a one-line error
        raise ConfigError(f"calibrate needs --method; choose one of: {', '.join(CALIBRATE_METHODS)}")
    check_choice(method, CALIBRATE_METHODS, "--method", " for calibrate")
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(draft_precision, DRAFT_PRECISIONS, "--draft-precision")
    apply_threads(threads)
    num_prompts = num_prompts if num_prompts is not None else (64 if method == "fr-spec" else 8)
    max_new_tokens = max_new_tokens if max_new_tokens is not None else (128 if method == "fr-spec" else 32)
    search = None
    if method != "self-sd" and (storage is not None or workers != 1):
        raise ConfigError(f"--storage and --workers are options of the Self-SD search; {method} calibration runs in one process")
    if storage is not None and study_path is not None:
        raise ConfigError("--storage and --study-path both name the study; pass one of them")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    helper = worker_index > 0  # a process started by --workers: searches only
    if method == "self-sd":  # SearchConfig validates the search options before any loading
        repeats = repeats if repeats is not None else (1 if objective == "proxy" else 3)
        search = SearchConfig(study_path=study_path, n_trials=trials, seed=seed, sampler=sampler, repeats=repeats,
                              objective=objective, storage=storage, heartbeat_s=heartbeat, worker_index=worker_index,
                              search_only=helper, worker=worker_group or worker_id())
    GenerationConfig(max_new_tokens=max_new_tokens)  # validates before any loading
    texts = load_calibration_prompts(prompt_file, dataset, dataset_field, num_prompts, prompt_format)
    if output is not None and not helper:
        _check_output(output, force, directory=method == "fr-spec")
    if search is not None and study_path is not None:
        check_writable(study_path, "--study-path")

    mdl, tok = load_model(model, dtype=dtype, device=device)
    default_path = {"self-sd": default_skip_artifact_path, "specee": store.default_schedule_path,
                    "fr-spec": fr_spec.default_path}[method]
    out_path = output or default_path(mdl)
    if not helper:
        _check_output(out_path, force, directory=method == "fr-spec")  # before the search
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids(mdl, tok))
    prompt_ids = [encode_turn(tok, [{"role": "user", "content": t}], chat_template) for t in texts]
    prompts_info = {"source": prompt_file if prompt_file is not None else dataset, "num_prompts": len(prompt_ids),
                    "sha256": prompts_digest(prompt_ids)}
    engine = Engine(mdl)
    if method == "fr-spec":
        prompts_info.update(max_new_tokens=max_new_tokens, chat_template=chat_template)
        return _calibrate_fr_spec(engine, tok, prompt_ids, cfg, out_path, prompts_info)
    if search is None:
        return _calibrate_specee(engine, tok, prompt_ids, cfg, out_path, prompts_info)

    ctx = context_length(mdl)
    for i, t in enumerate(texts):
        check_prompt_fits(Prompt(id=i + 1, turns=(t,)), tok, cfg, ctx, chat_template)
    db_path = study_path if study_path is not None else out_path.with_name(out_path.stem + ".optuna.db")
    if storage is None:
        check_writable(db_path, "--study-path")
    where = describe(storage) if storage is not None else str(db_path)
    if draft_precision in ("auto", "target"):
        quantized = resolve_precision(engine, "auto") if draft_precision == "auto" else None
        precisions = ("target",) if quantized is None else ("target", quantized)
    else:
        precisions = (resolve_precision(engine, draft_precision),)
    search = dataclasses.replace(search, study_path=db_path, precisions=precisions)
    fingerprint = model_fingerprint(mdl)
    unit = "x ar (predicted)" if objective == "proxy" else "tok/s"
    say = (lambda _m: None) if helper else log  # the helpers of --workers report through the first process
    say(f"[dim]model {mdl.config.model_type} {engine.num_layers} layers ({2 * engine.num_layers} sublayers), "
        f"{engine.dtype}, {engine.device}; {len(prompt_ids)} prompts x {max_new_tokens} tokens"
        f"{f' x {repeats} passes' if repeats > 1 else ''}; "
        f"sampler {sampler}, seed {seed}; draft weights {', '.join(precisions)}; study {where}"
        f"{f'; {workers} workers' if workers > 1 else ''}[/dim]")

    state: dict[str, int] = {"done": 0}
    helpers: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        bar_task: list = []  # the bar starts with the first report, once the study has opened

        def start_helpers() -> None:
            """Once the study holds its setup, seeds and measured costs: start the helpers and wait until
            each has loaded the model and warmed up (or died), so that every worker starts trials together."""
            import select

            if helper:  # tell the first process this helper is ready
                print("ready", flush=True)
                return
            argv = _helper_argv(storage, db_path)
            for i in range(1, workers):
                helpers.append(subprocess.Popen([*argv, "--worker-index", str(i), "--worker-group", search.worker],
                                                stdout=subprocess.PIPE, text=True))
            for h in helpers:  # "ready", or "" when the helper ended before it; after 10 minutes, go on without it
                if select.select([h.stdout], [], [], 600)[0]:
                    h.stdout.readline()

        def wait_helpers() -> None:
            for i, h in enumerate(helpers, 1):
                h.stdout.read()
                if (rc := h.wait()) != 0:
                    log(f"[yellow]worker {i} ended with exit status {rc}; its unfinished trial, if any, was run again[/yellow]")

        def on_trial(r: TrialReport) -> None:
            if helper:
                return
            if not bar_task:
                bar = stack.enter_context(progress())
                bar_task.extend([bar, bar.add_task("calibrate self-sd", total=trials, info="")])
            bar, task = bar_task
            state["done"] = r.done
            info = ""
            if r.best_value is not None:
                info = f"best {r.best_value:.2f} {unit} (trial {r.best_number})"
            if r.value is not None:
                info += f"; last {r.value:.2f} {unit}"
                if r.mean_accepted_length is not None:
                    info += f", M {r.mean_accepted_length:.2f}"
            bar.update(task, completed=min(r.done, trials), info=info)

        try:
            result = calibrate_self_sd(engine, tok, prompt_ids, cfg, search, fingerprint=fingerprint,
                                       prompts_sha=prompts_info["sha256"], on_trial=on_trial, log=say,
                                       on_ready=start_helpers, before_finish=wait_helpers)
        except KeyboardInterrupt:
            stack.close()
            for h in helpers:  # they got the terminal's Ctrl-C too; wait for them to save their trials
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(timeout=30)
            set_exit_note(f"{state['done']} finished trials are saved in {where}; run the same command again to resume")
            raise
        finally:
            for h in helpers:
                if h.poll() is None:
                    h.kill()

    if helper:
        return
    if not result.writer:
        log(f"the study holds its {result.trials} trials ({result.new_trials} from this worker); the worker that finished "
            "the last one writes the artifact")
        print_json({"method": method, "artifact": None, "study": where, "trials": result.trials,
                    "new_trials": result.new_trials, "best_trial": result.best_trial, "writer": False})
        return

    prompts_info["chat_template"] = chat_template
    if dataset is not None:
        prompts_info["dataset_field"] = dataset_field
    manifest = build_manifest(result, model=mdl, cfg=cfg, search=search, prompts=prompts_info,
                              environment=environment_info(engine.device, engine.dtype))
    vs_ar = result.best_value if objective == "proxy" else manifest["objective"].get("speedup_vs_ar")
    below_ar = vs_ar is not None and vs_ar < 1.0
    if below_ar and output is None:  # never install, as this model's default, a set slower than plain decoding
        out_path = _check_output(out_path.with_name(out_path.stem + ".below-ar.json"), force)
    save_json_artifact(out_path, manifest)

    obj = manifest["objective"]
    base = result.baseline  # None when the model has no uniform starting set
    conf = result.confirm
    re_measured = ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in conf.items())
    log(f"[bold]best (trial {result.best_trial}): {len(result.skip_attn)} attention + {len(result.skip_mlp)} MLP "
        f"of {2 * result.num_layers} sublayers skipped, {result.best_value:.2f} {unit} in the search; "
        f"re-measured: {re_measured} tok/s[/bold]")
    log(f"wrote {out_path}")
    if below_ar:
        log(f"[bold yellow]the best set found is {vs_ar:.2f}x ar, slower than plain decoding: "
            + ("not made this model's default (generate keeps the previous one); " if output is None else "")
            + f"run more --trials (the study resumes), or pass --layers {out_path} to use it anyway[/bold yellow]")
    summary = {
        "method": method, "artifact": str(out_path), "study": where, "model": model_name(mdl),
        "model_fingerprint": fingerprint, "num_layers": result.num_layers,
        "skip_attn": sorted(result.skip_attn), "skip_mlp": sorted(result.skip_mlp),
        "objective": obj["value"], "unit": obj["unit"], "best_trial": result.best_trial,
        "mean_accepted_length": obj["mean_accepted_length"], "acceptance_rate": obj["acceptance_rate"],
        "baseline": base and {"name": base["name"], "value": base["value"], "confirm": base["confirm"]["tokens_per_s"]},
        "confirm": {k: v["tokens_per_s"] for k, v in conf.items()},
        "speedup_vs_ar": obj.get("speedup_vs_ar"), "speedup_vs_baseline": obj.get("speedup_vs_baseline"),
        "trials": result.trials, "new_trials": result.new_trials, "below_ar": below_ar, "writer": True,
    }
    print_json(summary)


def _calibrate_specee(engine: Engine, tok: Any, prompt_ids: list[list[int]], cfg: GenerationConfig, out_path: Path,
                      prompts_info: dict[str, Any]) -> None:
    """SpecEE's offline schedule: decode with every exit predictor on, count exits per layer, keep the frequent layers."""
    from ..calibrate.specee import exit_statistics
    from ..methods.specee import SpecEE

    mdl = engine.model
    # the schedule artifact itself is what we make: build with a placeholder schedule
    heads, heads_manifest = store.load_heads(None, mdl)
    predictors, pman = store.load_exit_mlps(None, mdl)
    drafter = int(pman.get("drafter", {}).get("layer", min(heads)))
    thresholds = {int(k): float(v) for k, v in (pman.get("thresholds") or {}).items()}
    method = SpecEE(engine, tok, drafter_layer=drafter, drafter=heads[drafter], predictors=predictors, offline_layers=[],
                    thresholds=thresholds)
    log(f"[dim]SpecEE exit statistics: {len(prompt_ids)} prompts x {cfg.max_new_tokens} tokens, every predictor on "
        f"(layers {min(predictors)}..{max(predictors)}), kv mode {method.config.specee_kv_mode}[/dim]")
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("calibrate specee", total=len(prompt_ids), info="")
        st = exit_statistics(method, prompt_ids, cfg, on_prompt=lambda i, n: bar.update(task, completed=i))
    search_s = round(time.perf_counter() - t0, 3)
    manifest = {"kind": store.SCHEDULE_KIND, "format_version": 1, "model_fingerprint": model_fingerprint(mdl),
                "model_name_or_path": model_name(mdl), "num_layers": engine.num_layers, **st.as_dict(),
                "drafter_layer": drafter, "exit_mlps_artifact_id": pman.get("artifact_id"),
                "heads_artifact_id": heads_manifest.get("artifact_id"),
                "prompts": {**prompts_info, "max_new_tokens": cfg.max_new_tokens},
                "environment": environment_info(engine.device, engine.dtype), "created": now_iso(),
                "search_time_s": search_s}
    save_json_artifact(out_path, manifest)
    probs = ", ".join(f"{k}: {v:.2f}" for k, v in st.exit_probability.items())
    log(f"exit probability per layer: {probs}; exit rate {manifest['exit_rate']:.3f}")
    log(f"[bold]selected predictor layers {st.selected_layers} ({manifest['selected_exit_share']:.0%} of exits)[/bold]")
    log(f"wrote {out_path}")
    print_json({"method": "specee", "artifact": str(out_path), **st.as_dict()})


def _calibrate_fr_spec(engine: Engine, tok: Any, prompt_ids: list[list[int]], cfg: GenerationConfig, out_path: Path,
                       prompts_info: dict[str, Any]) -> None:
    """FR-Spec's draft vocabulary: count the model's greedy output tokens, rank, choose the size by measurement."""
    from ..calibrate.fr_spec import calibrate_draft_vocab

    log(f"[dim]FR-Spec draft vocabulary: {len(prompt_ids)} prompts x {cfg.max_new_tokens} tokens, greedy, "
        f"vocabulary {engine.vocab_size}[/dim]")
    with progress() as bar:
        task = bar.add_task("calibrate fr-spec", total=len(prompt_ids), info="")
        res = calibrate_draft_vocab(engine, tok, prompt_ids, cfg, on_prompt=lambda i, n: bar.update(task, completed=i))
    manifest = {"kind": fr_spec.KIND, "model_fingerprint": model_fingerprint(engine.model),
                "model_name_or_path": model_name(engine.model), "vocab_size": engine.vocab_size, **res.summary(),
                "prompts": prompts_info, "environment": environment_info(engine.device, engine.dtype),
                "search_time_s": round(res.decode_s, 1)}
    save_tensors_artifact(out_path, {"ranked_ids": res.ranked_ids, "counts": res.counts, "expected": res.expected},
                          manifest)
    for r in res.candidates:
        log(f"  n {r['n']:>6}: held-out coverage {r['held_out_coverage']:.4f}, head {r['head_ms']:.2f} ms "
            f"({r['head_share_of_step']:.1%} of a step), draft cost at half body {r['draft_cost_half_body']:.3f}")
    log(f"[bold]draft vocabulary: {res.n} of {engine.vocab_size} tokens ({res.tokens} tokens counted, "
        f"{int((res.counts > 0).sum())} distinct)[/bold]")
    log(f"wrote {out_path}")
    print_json({"method": "fr-spec", "artifact": str(out_path), **res.summary()})


def _helper_argv(storage: str | None, db_path: Path) -> list[str]:
    """The command line of a --workers helper: this run's arguments without --workers, --force and
    the study's name, then the study named explicitly (the caller adds --worker-index)."""
    args, out = invocation_args(), [sys.executable, "-m", "selfspec_cli"]
    drop_with_value, drop_flag = ("--workers", "--study-path", "--storage"), ("--force",)
    i = 0
    while i < len(args):
        a = args[i]
        name = a.split("=", 1)[0]
        if name in drop_flag:
            i += 1
        elif name in drop_with_value:
            i += 1 if "=" in a else 2
        else:
            out.append(a)
            i += 1
    return out + (["--storage", storage] if storage is not None else ["--study-path", str(db_path)])
