"""``selfspec calibrate``: the offline searches of the methods that have one (Self-SD's skip set
and draft precision, SpecEE's exit statistics, FR-Spec's draft vocabulary), each saved as its
method's artifact. A thin dispatcher: the work is each method package's offline step, and the
options only one step takes are flags made from that step's ``Options`` (:mod:`selfspec_cli.cli.offline`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..methods import OFFLINE
from ..methods.base import DRAFT_PRECISIONS
from . import options as opt
from ..config import check_choice
from .offline import run_step, step_for, with_step_options

CALIBRATE_METHODS = [name for command, name in OFFLINE if command == "calibrate"]


@with_step_options("calibrate")
def calibrate(
    method: Optional[str] = typer.Option(None, "--method", help=f"What to calibrate (required): {', '.join(CALIBRATE_METHODS)}."),
    model: Optional[str] = opt.model(),
    prompt_file: Optional[str] = opt.prompt_file("Calibration prompts (as for generate; first turn of each). One of --prompt-file and --dataset is required."),
    prompt_format: str = opt.prompt_format(),
    dataset: Optional[str] = opt.dataset("Calibration prompts from a local .jsonl/.json/.csv/.parquet file, read with `datasets` (instead of --prompt-file)."),
    dataset_field: str = opt.dataset_field(),
    num_prompts: Optional[int] = opt.num_prompts(None, "Use at most this many prompts (in file order; default 8, fr-spec 64)."),
    max_new_tokens: Optional[int] = opt.max_new_tokens(None, "Tokens generated per prompt in each trial (default 32, fr-spec 128)."),
    output: Optional[Path] = opt.output("Artifact path. Default: <selfspec home>/artifacts/<kind>/<model name>-<fingerprint> plus .json (self-sd), .schedule.json (specee: kind specee) or a directory (fr-spec: kind fr-spec-vocab) (home: $SELFSPEC_HOME, else ~/.local/share/selfspec); never the shipped artifacts."),
    force: bool = opt.force("Replace an existing artifact at the output path."),
    threads: Optional[str] = opt.threads(),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
    **step_options: Any,
) -> None:
    """Self-SD: search skipped sublayers and the draft's precision by Bayesian optimization (of the predicted
    speedup, or of measured throughput with --objective throughput). SpecEE: exit-frequency
    statistics per layer and the predictor subset they select. FR-Spec: the model's own output tokens ranked by
    frequency, and the draft-vocabulary size chosen by measured coverage and head cost. Saves an artifact."""
    step = step_for("calibrate", "--method", method)
    if step_options.get("draft_precision") is not None:
        check_choice(step_options["draft_precision"], DRAFT_PRECISIONS, "--draft-precision")
    run_step(step, step_options, model=model, prompt_file=prompt_file, prompt_format=prompt_format, dataset=dataset,
             dataset_field=dataset_field, num_prompts=num_prompts, max_new_tokens=max_new_tokens, output=output,
             force=force, threads=threads, chat_template=chat_template, dtype=dtype, device=device,
             target_precision=target_precision)
