"""``selfspec train-heads``: train AdaDecode's intermediate heads (``--kind lm-heads``) or
SpecEE's exit predictors (``--kind exit-mlp``) on the target's own greedy output."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from ..artifacts import check_new_artifact, environment_info, model_name
from ..calibrate.data import load_calibration_prompts, prompts_digest
from ..engine import Engine
from ..errors import ConfigError
from ..methods import head_store as store
from ..heads.data import collect_on_policy
from ..heads.train import DEFAULT_THRESHOLDS, ExitTrainConfig, HeadTrainConfig, train_exit_mlps, train_lm_heads
from ..loading import EXAMPLES_DIR, load_model, model_fingerprint
from ..methods.base import layer_list
from ..runtime import encode_turn, eos_token_ids
from ..prompts import PROMPT_FORMATS
from .common import MODEL_HELP, THREADS_HELP, print_json, apply_threads, check_choice, log, progress

KINDS = ("lm-heads", "exit-mlp")
DEFAULT_PROMPTS = str(EXAMPLES_DIR / "chat-calibration.jsonl")  # shipped with the package


MIN_PROMPTS = 3


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
    rank: int = typer.Option(64, "--rank", help="lm-heads: rank r of each head's correction (identity + B A)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Training epochs (default: 30 for lm-heads, 100 for exit-mlp)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Adam learning rate (default: 5e-3 for lm-heads, 1e-3 for exit-mlp)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Rows per step (default: 128 for lm-heads, 1024 for exit-mlp)."),
    heads_path: Optional[Path] = typer.Option(None, "--heads", help="exit-mlp: the lm-heads artifact whose shallowest head drafts (default: this model's, the one `selfspec train-heads --kind lm-heads` wrote under $SELFSPEC_HOME first, then the shipped one)."),
    seed: int = typer.Option(0, "--seed", help="Seed of initialisation and shuffling."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory. Default: <selfspec home>/artifacts/adadecode/<model>-<fingerprint>/ or .../specee/<model>-<fingerprint>/ (home: $SELFSPEC_HOME, else ~/.local/share/selfspec)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing artifact at the output path."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="On-disk cache of the on-policy data (default <selfspec cache>/onpolicy; cache: $SELFSPEC_CACHE, else $SELFSPEC_HOME/cache, else ~/.cache/selfspec)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N (the data is collected there; training runs on CPU)."),
) -> None:
    """Train early-exit add-ons on the target's own greedy continuations; saves safetensors + manifest."""
    if kind is None:
        raise ConfigError(f"train-heads needs --kind; choose one of: {', '.join(KINDS)}")
    check_choice(kind, KINDS, "--kind")
    for name, val in (("--max-new-tokens", max_new_tokens), ("--rank", rank), ("--epochs", epochs),
                      ("--batch-size", batch_size)):
        if val is not None and val < 1:
            raise ConfigError(f"{name} must be >= 1, got {val}")
    if lr is not None and not lr > 0:
        raise ConfigError(f"--lr must be > 0, got {lr}")
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    if prompt_file is None and dataset is None:
        prompt_file = DEFAULT_PROMPTS
    texts = load_calibration_prompts(prompt_file, dataset, dataset_field, num_prompts, prompt_format)
    if len(texts) < MIN_PROMPTS:  # training, validation and test prompts are disjoint (heads/data.py)
        raise ConfigError(f"train-heads needs at least {MIN_PROMPTS} prompts (disjoint training, validation and test "
                          f"prompts), got {len(texts)}; pass --num-prompts {MIN_PROMPTS} or more, or a longer prompt file")
    apply_threads(threads)
    if output is not None:
        check_new_artifact(output, force)

    t_start = time.perf_counter()
    mdl, tok = load_model(model, dtype="float32" if device in ("auto", "cpu") else "auto", device=device)
    engine = Engine(mdl)
    L = engine.num_layers
    fingerprint = model_fingerprint(mdl)
    head_layers = layer_list(layers, "--layers")  # a FieldError is a ConfigError worded with the flag
    if head_layers is not None and not (head_layers and all(0 <= k < L - 1 for k in head_layers)):
        raise ConfigError(f"--layers {list(head_layers)}: head layers must be in 0..{L - 2} for a {L}-layer model")
    out_path = output or (store.default_heads_path(mdl) if kind == "lm-heads" else store.default_exit_path(mdl))
    check_new_artifact(out_path, force)  # before the slow data collection
    # exit-mlp: the drafter heads, loaded before the slow data collection (so it fails early)
    heads, drafter_manifest = store.load_heads(heads_path, mdl) if kind == "exit-mlp" else (None, None)

    prompt_ids = [encode_turn(tok, [{"role": "user", "content": t}], chat_template) for t in texts]
    log(f"[dim]model {mdl.config.model_type} {L} layers; {len(prompt_ids)} prompts x {max_new_tokens} greedy tokens "
        f"(on-policy data, cached)[/dim]")
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("on-policy data", total=len(prompt_ids), info="")
        data = collect_on_policy(engine, prompt_ids, max_new_tokens, fingerprint, eos_token_ids(mdl, tok), cache_dir,
                                 on_prompt=lambda i, n: bar.update(task, completed=i))
    collect_s = time.perf_counter() - t0
    train_idx, val_idx, hold_idx = data.split3()
    log(f"[dim]{data.num_rows} rows ({len(train_idx)} train, {len(val_idx)} validation, {len(hold_idx)} test) "
        f"in {collect_s:.1f}s[/dim]")

    prompts_info = {"source": prompt_file if prompt_file is not None else dataset, "num_prompts": len(prompt_ids),
                    "sha256": prompts_digest(prompt_ids), "max_new_tokens": max_new_tokens,
                    "rows": data.num_rows, "train_rows": len(train_idx), "validation_rows": len(val_idx),
                    "heldout_rows": len(hold_idx)}
    common = {"model_fingerprint": fingerprint, "model_name_or_path": model_name(mdl), "num_layers": L,
              "data": prompts_info, "environment": environment_info(engine.device, engine.dtype)}

    with progress() as bar:
        tasks: dict[str, int] = {}

        def on_progress(name: str, done: int, total: int, info: str) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total, info="")
            bar.update(tasks[name], completed=done, info=info)

        t0 = time.perf_counter()
        if kind == "lm-heads":
            cfg = HeadTrainConfig(layers=head_layers, rank=rank, epochs=epochs or 30,  # layers None: the default ones
                                  batch_size=batch_size or 128, lr=lr or 5e-3, seed=seed)
            trained, reports = train_lm_heads(engine, data, cfg, on_progress)
            train_s = time.perf_counter() - t0
            manifest = {**common, "rank": rank, "head_layers_note": "0-based id of the layer after which the head reads",
                        "training": {"loss": "forward KL(p_final || p_head)", "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                                     "lr": cfg.lr, "schedule": f"cosine, {cfg.warmup_share:.0%} warmup", "seed": seed,
                                     "early_stopping": "epoch with the lowest validation KL (validation prompts)",
                                     "collect_seconds": collect_s, "train_seconds": train_s},
                        "report": [asdict(r) for r in reports]}
            store.save_heads(out_path, trained, manifest)
            extra = {"rank": rank}
            for r in reports:
                pcs = ", ".join(f"@{th}: prec {v['precision']:.3f} cov {v['coverage']:.3f}"
                                for th, v in r.precision_coverage.items())
                log(f"head after layer {r.layer} (epoch {r.best_epoch} kept): test KL {r.kl_before:.3f} -> {r.kl_after:.3f}, "
                    f"top-1 {r.top1_before:.3f} -> {r.top1_after:.3f}; {pcs}")
        else:
            drafter_layer = min(heads)
            cfg_e = ExitTrainConfig(epochs=epochs or 100, batch_size=batch_size or 1024, lr=lr or 1e-3, seed=seed)
            trained, reports = train_exit_mlps(engine, data, drafter_layer, heads[drafter_layer], cfg_e, on_progress)
            train_s = time.perf_counter() - t0
            manifest = {**common, "drafter": {"kind": "adadecode-head", "layer": drafter_layer,
                                              "heads_artifact_id": drafter_manifest.get("artifact_id"), "top_k": 4},
                        "features": "[s (4 speculative-token logits of final_norm(h_l)), q = softmax(s), q - q_(l-1) (q at the drafter layer)]",
                        "label": "argmax of the full LM head on final_norm(h_l) is a speculative token and equals the full model's token",
                        "training": {"loss": "BCE, positives weighted n_neg/n_pos", "epochs": cfg_e.epochs,
                                     "batch_size": cfg_e.batch_size, "lr": cfg_e.lr, "seed": seed,
                                     "collect_seconds": collect_s, "train_seconds": train_s},
                        "thresholds": {str(r.layer): r.threshold for r in reports},
                        "threshold_rule": (f"lowest threshold >= 0.5 whose exit precision on the validation prompts has one-sided lower "
                                           f"bounds (z {cfg_e.confidence_z}: Wilson over rows and a bootstrap over prompts) "
                                           f">= {cfg_e.target_precision}"),
                        "report": [asdict(r) for r in reports]}
            store.save_exit_mlps(out_path, trained, manifest)
            extra = {"drafter_layer": drafter_layer}
            for r in reports:
                log(f"predictor after layer {r.layer}: positives {r.positive_share:.3f}; test prompts at 0.5: exit precision "
                    f"{r.precision:.3f}, recall {r.recall:.3f}, fires {r.fire_share:.3f}; threshold {r.threshold:.3f}: "
                    f"precision {r.precision_at_threshold:.3f}, recall {r.recall_at_threshold:.3f}, fires {r.fire_share_at_threshold:.3f}")
    total = time.perf_counter() - t_start
    log(f"wrote {out_path} (data {collect_s:.1f}s, training {train_s:.1f}s, total {total:.1f}s)")
    summary = {"kind": kind, "artifact": str(out_path), "layers": sorted(trained), **extra, "report": manifest["report"],
               "rows": data.num_rows, "collect_seconds": collect_s, "train_seconds": train_s, "total_seconds": total,
               "thresholds": list(DEFAULT_THRESHOLDS)}
    print_json(summary)
