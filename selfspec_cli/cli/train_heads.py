"""``selfspec train-heads``: train AdaDecode's intermediate heads (``--kind lm-heads``) or
SpecEE's exit predictors (``--kind exit-mlp``) on the target's own greedy output. A thin
dispatcher: the work is each method package's training step (:mod:`selfspec_cli.cli.offline`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..loading import EXAMPLES_DIR
from .common import MODEL_HELP, THREADS_HELP
from .offline import run_step, step_for

DEFAULT_PROMPTS = str(EXAMPLES_DIR / "chat-calibration.jsonl")  # shipped with the package


def train_heads(
    kind: Optional[str] = typer.Option(None, "--kind", help="lm-heads (AdaDecode) or exit-mlp (SpecEE; needs lm-heads first: its drafter is the shallowest head)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Training prompts (first turn of each). Default: the shipped examples/chat-calibration.jsonl (64 prompts written for this project, none from Spec-Bench)."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="--prompt-file format: auto, text or jsonl (as for generate)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Training prompts from a local .jsonl/.json/.csv/.parquet file, read with `datasets`."),
    dataset_field: str = typer.Option("prompt", "--dataset-field", help="Column of --dataset holding the prompt text."),
    num_prompts: int = typer.Option(1000, "--num-prompts", help="Use at most this many prompts (in file order)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Greedy tokens generated per prompt for the on-policy data."),
    layers: Optional[str] = typer.Option(None, "--layers", help="lm-heads: 0-based layers after which heads sit (default: after L/4, L/2, 3L/4 layers)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="lm-heads: rank r (default 64) of each head's correction (identity + B A)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Training epochs (default: 30 for lm-heads, 100 for exit-mlp)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Adam learning rate (default: 5e-3 for lm-heads, 1e-3 for exit-mlp)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Rows per step (default: 128 for lm-heads, 1024 for exit-mlp)."),
    heads_path: Optional[Path] = typer.Option(None, "--heads", help="exit-mlp: the lm-heads artifact whose shallowest head drafts (default: this model's, the one `selfspec train-heads --kind lm-heads` wrote under $SELFSPEC_HOME first, then the shipped one)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of initialisation and shuffling (default 0)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory. Default: <selfspec home>/artifacts/adadecode/<model>-<fingerprint>/ or .../specee/<model>-<fingerprint>/ (home: $SELFSPEC_HOME, else ~/.local/share/selfspec)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing artifact at the output path."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="On-disk cache of the on-policy data (default <selfspec cache>/onpolicy; cache: $SELFSPEC_CACHE, else $SELFSPEC_HOME/cache, else ~/.cache/selfspec)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N (the data is collected there; training runs on CPU)."),
) -> None:
    """Train early-exit add-ons on the target's own greedy continuations; saves safetensors + manifest."""
    step = step_for("train-heads", "--kind", kind)
    options = dict(layers=layers, rank=rank, epochs=epochs, lr=lr, batch_size=batch_size, heads=heads_path, seed=seed,
                   cache_dir=cache_dir)
    run_step(step, options, model=model, prompt_file=DEFAULT_PROMPTS if prompt_file is None and dataset is None else prompt_file,
             prompt_format=prompt_format, dataset=dataset, dataset_field=dataset_field, num_prompts=num_prompts,
             max_new_tokens=max_new_tokens, output=output, force=force, threads=threads, chat_template=chat_template,
             dtype="float32" if device in ("auto", "cpu") else "auto", device=device)
