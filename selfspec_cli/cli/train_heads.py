"""``selfspec train-heads``: train AdaDecode's intermediate heads (``--kind lm-heads``) or
SpecEE's exit predictors (``--kind exit-mlp``) on the target's own greedy output. A thin
dispatcher: the work is each method package's training step, and the options only one step
takes are flags made from that step's ``Options`` (:mod:`selfspec_cli.cli.offline`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..loading import EXAMPLES_DIR
from . import options as opt
from .offline import run_step, step_for, with_step_options

DEFAULT_PROMPTS = str(EXAMPLES_DIR / "chat-calibration.jsonl")  # shipped with the package


@with_step_options("train-heads")
def train_heads(
    kind: Optional[str] = typer.Option(None, "--kind", help="lm-heads (AdaDecode) or exit-mlp (SpecEE; needs lm-heads first: its drafter is the shallowest head)."),
    model: Optional[str] = opt.model(),
    prompt_file: Optional[str] = opt.prompt_file("Training prompts (first turn of each). Default: the shipped examples/chat-calibration.jsonl (64 prompts written for this project, none from Spec-Bench)."),
    prompt_format: str = opt.prompt_format(),
    dataset: Optional[str] = opt.dataset("Training prompts from a local .jsonl/.json/.csv/.parquet file, read with `datasets`."),
    dataset_field: str = opt.dataset_field(),
    num_prompts: int = opt.num_prompts(1000, "Use at most this many prompts (in file order)."),
    max_new_tokens: int = opt.max_new_tokens(256, "Greedy tokens generated per prompt for the on-policy data."),
    output: Optional[Path] = opt.output("Artifact directory. Default: <selfspec home>/artifacts/adadecode/<model>-<fingerprint>/ or .../specee/<model>-<fingerprint>/ (home: $SELFSPEC_HOME, else ~/.local/share/selfspec)."),
    force: bool = opt.force("Replace an existing artifact at the output path."),
    chat_template: bool = opt.chat_template(),
    threads: Optional[str] = opt.threads(),
    device: str = opt.device("auto, cpu, cuda, cuda:N (the data is collected there; training runs on CPU)."),
    **step_options: Any,
) -> None:
    """Train early-exit add-ons on the target's own greedy continuations; saves safetensors + manifest."""
    step = step_for("train-heads", "--kind", kind)
    run_step(step, step_options, model=model, prompt_file=DEFAULT_PROMPTS if prompt_file is None and dataset is None else prompt_file,
             prompt_format=prompt_format, dataset=dataset, dataset_field=dataset_field, num_prompts=num_prompts,
             max_new_tokens=max_new_tokens, output=output, force=force, threads=threads, chat_template=chat_template,
             dtype="float32" if device in ("auto", "cpu") else "auto", device=device)
