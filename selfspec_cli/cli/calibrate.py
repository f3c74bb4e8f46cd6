"""``selfspec calibrate``: the offline searches of the methods that have one (Self-SD's skip set
and draft precision, SpecEE's exit statistics, FR-Spec's draft vocabulary), each saved as its
method's artifact. A thin dispatcher: the work is each method package's offline step
(:mod:`selfspec_cli.cli.offline`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..methods import OFFLINE
from ..methods.base import DRAFT_PRECISIONS
from ..methods.self_sd.calibrate import SAMPLERS
from ..methods.self_sd.study import DEFAULT_HEARTBEAT_S
from .common import TARGET_HELP, MODEL_HELP, THREADS_HELP, check_choice
from .offline import run_step, step_for

CALIBRATE_METHODS = [name for command, name in OFFLINE if command == "calibrate"]


def calibrate(
    method: Optional[str] = typer.Option(None, "--method", help=f"What to calibrate (required): {', '.join(CALIBRATE_METHODS)}."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Calibration prompts (as for generate; first turn of each). One of --prompt-file and --dataset is required."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="--prompt-file format: auto, text or jsonl (as for generate)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Calibration prompts from a local .jsonl/.json/.csv/.parquet file, read with `datasets` (instead of --prompt-file)."),
    dataset_field: str = typer.Option("prompt", "--dataset-field", help="Column of --dataset holding the prompt text."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use at most this many prompts (in file order; default 8, fr-spec 64)."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Self-SD: complete trials wanted in the study (default 100); a resumed study runs only the rest."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Self-SD: sampler seed (default 0)."),
    sampler: Optional[str] = typer.Option(None, "--sampler", help=f"Self-SD: Optuna sampler (default tpe): {', '.join(SAMPLERS)} (see docs/calibrate.md)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens generated per prompt in each trial (default 32, fr-spec 128)."),
    objective: Optional[str] = typer.Option(None, "--objective", help="Self-SD: proxy (default): the predicted speedup from measured acceptance and draft lengths, draft cost from weight bytes and the engine's measured verify curve; no per-trial timing, so machine load cannot reorder candidates (docs/calibrate.md). throughput: measured tokens/s."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Self-SD: decode the prompts this many times per trial; per prompt the fastest pass counts (default 3 with --objective throughput, 1 with proxy)."),
    study_path: Optional[Path] = typer.Option(None, "--study-path", help="Self-SD: Optuna SQLite study (resumable). Default: <output stem>.optuna.db beside --output."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Self-SD: the study in any storage Optuna shares between processes and machines, instead of --study-path: a database URL (sqlite:///study.db, postgresql://user@host/db, mysql://...) or a journal file on a disk every worker sees (journal:PATH, or a path ending in .journal). Another machine joins by running the same command with the same --storage (docs/calibrate.md)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Self-SD (default 1): processes working on the study at once on this machine (each loads the model; one thread each unless --threads)."),
    heartbeat: Optional[int] = typer.Option(None, "--heartbeat", help=f"Self-SD (default {DEFAULT_HEARTBEAT_S}): seconds between a running trial's heartbeats; a worker silent for 3 of them is taken as dead and its trial is run again."),
    worker_index: Optional[int] = typer.Option(None, "--worker-index", hidden=True, help="Set by --workers for the helper processes it starts."),
    worker_group: Optional[str] = typer.Option(None, "--worker-group", hidden=True, help="Set by --workers: the first process's worker name."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact path. Default: <selfspec home>/artifacts/self-sd/<model name>-<fingerprint>.json (home: $SELFSPEC_HOME, else ~/.local/share/selfspec); never the shipped artifacts."),
    force: bool = typer.Option(False, "--force", help="Replace an existing artifact at the output path."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    draft_precision: Optional[str] = typer.Option(None, "--draft-precision", help="Self-SD: draft weights searched together with the skip set: auto (the target's own and the quantized copy generate would use: the GGUF's own blocks for a GGUF model, else int8), target (the target's only), int8, int8-g32 or gguf (that one only)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one (as generate does)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    target_precision: str = typer.Option("auto", "--target-precision", help=TARGET_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Self-SD: search skipped sublayers and the draft's precision by Bayesian optimization (of the predicted
    speedup, or of measured throughput with --objective throughput). SpecEE: exit-frequency
    statistics per layer and the predictor subset they select. FR-Spec: the model's own output tokens ranked by
    frequency, and the draft-vocabulary size chosen by measured coverage and head cost. Saves an artifact."""
    step = step_for("calibrate", "--method", method)
    if draft_precision is not None:
        check_choice(draft_precision, DRAFT_PRECISIONS, "--draft-precision")
    options = dict(trials=trials, seed=seed, sampler=sampler, objective=objective, repeats=repeats, study_path=study_path,
                   storage=storage, workers=workers, heartbeat=heartbeat, worker_index=worker_index,
                   worker_group=worker_group, draft_precision=draft_precision)
    run_step(step, options, model=model, prompt_file=prompt_file, prompt_format=prompt_format, dataset=dataset,
             dataset_field=dataset_field, num_prompts=num_prompts, max_new_tokens=max_new_tokens, output=output,
             force=force, threads=threads, chat_template=chat_template, dtype=dtype, device=device,
             target_precision=target_precision)
