"""``selfspec generate``: decode every prompt of a file with one method; JSONL out."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import typer

from ..config import GenerationConfig, SamplingConfig
from ..engine import Engine
from ..errors import ConfigError
from ..loading import load_model
from ..methods import METHODS
from ..methods.factory import MethodOptions, build_method, parse_layer_list
from ..prompts import PROMPT_FORMATS, read_prompts
from ..runtime import check_prompt_fits, context_length, eos_token_ids, run_prompt
from .common import MODEL_HELP, THREADS_HELP, apply_threads, check_output, log, output_stream, progress, write_record

# method-specific options: parameter name -> (flag, methods that use it)
_LAYER_SKIPPING = ("self-sd", "asd", "swift")
METHOD_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "layers": ("--layers", ("self-sd",)),
    "skip_attn": ("--skip-attn", ("self-sd",)),
    "skip_mlp": ("--skip-mlp", ("self-sd",)),
    "max_draft": ("--max-draft", _LAYER_SKIPPING),
    "draft_threshold": ("--draft-threshold", _LAYER_SKIPPING),
    "skip_ratio": ("--skip-ratio", ("swift",)),
    "context_window": ("--context-window", ("swift",)),
    "tree_nodes": ("--tree-nodes", ("swift",)),
    "save_layers": ("--save-layers", ("swift",)),
    "asd_alpha": ("--asd-alpha", ("asd",)),
    "asd_m": ("--asd-m", ("asd",)),
    "asd_n": ("--asd-n", ("asd",)),
    "heads": ("--heads", ("adadecode", "specee")),
    "adadecode_threshold": ("--adadecode-threshold", ("adadecode",)),
    "adadecode_layers": ("--adadecode-layers", ("adadecode",)),
    "adadecode_max_pending": ("--adadecode-max-pending", ("adadecode",)),
    "exit_mlps": ("--exit-mlps", ("specee",)),
    "specee_schedule": ("--specee-schedule", ("specee",)),
    "specee_kv_mode": ("--specee-kv-mode", ("specee",)),
    "specee_threshold": ("--specee-threshold", ("specee",)),
    "specee_eval": ("--specee-eval", ("specee",)),
}


def check_method_options(ctx: typer.Context, method: str) -> None:
    """Refuse a method-specific option given on the command line with a method that ignores it."""
    for name, (flag, methods) in METHOD_OPTIONS.items():
        src = ctx.get_parameter_source(name)  # typer may bundle its own click: compare by name
        if src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP") and method not in methods:
            raise ConfigError(f"{flag} is an option of --method {' / '.join(methods)}, not of '{method}'; "
                              f"drop it or choose one of those methods")


def generate(
    ctx: typer.Context,
    prompt_file: str = typer.Option(..., "--prompt-file", "-p", help="Plain text (one prompt per line) or JSONL with 'prompt' or 'turns'; '-' reads stdin."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="auto (JSONL when the name ends in .jsonl/.json or the first line starts with '{'), text (one prompt per line) or jsonl."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    method: str = typer.Option("ar", "--method", help=f"Decoding method: {', '.join(METHODS)}."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Exact upper bound on generated tokens per turn."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling (reproducible)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); the output keeps it."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write JSONL here instead of stdout: streamed into <output>.<random>.partial beside it, which replaces it at the end (kept, and named, if the run stops early). Never the prompt file."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --output (or --save-layers artifact)."),
    append: bool = typer.Option(False, "--append", help="Add the records to the end of an existing --output instead of refusing."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    layers: Optional[Path] = typer.Option(None, "--layers", help="self-sd: skip-set artifact (default: this model's calibrated one, the user's under $SELFSPEC_HOME first, then the shipped one)."),
    skip_attn: Optional[str] = typer.Option(None, "--skip-attn", help="self-sd: inline attention sublayers to skip, e.g. 1,3,5 (0-based)."),
    skip_mlp: Optional[str] = typer.Option(None, "--skip-mlp", help="self-sd: inline MLP sublayers to skip, e.g. 2,4 (0-based)."),
    max_draft: Optional[int] = typer.Option(None, "--max-draft", help="Layer-skipping methods: most draft tokens per round."),
    draft_threshold: Optional[float] = typer.Option(None, "--draft-threshold", help="Layer-skipping methods: draft-exit confidence threshold (initial value when adaptive)."),
    skip_ratio: Optional[float] = typer.Option(None, "--skip-ratio", help="swift: share of sublayers skipped (default 0.45; lowered automatically when acceptance stays low)."),
    context_window: Optional[int] = typer.Option(None, "--context-window", help="swift: generated tokens used to score candidate skip sets (default 32)."),
    tree_nodes: Optional[int] = typer.Option(None, "--tree-nodes", help="swift: most candidate nodes in one verification tree (default: no cap, the paper's GPU setting; on a CPU each verified row costs a few per cent of a step)."),
    save_layers: Optional[Path] = typer.Option(None, "--save-layers", help="swift: write the skip set found as an artifact that --method self-sd --layers can load."),
    asd_alpha: float = typer.Option(0.985, "--asd-alpha", help="asd: cosine-similarity threshold."),
    asd_m: int = typer.Option(3, "--asd-m", help="asd: skip every m-th layer's MLP and attention."),
    asd_n: int = typer.Option(2, "--asd-n", help="asd: never skip the last n layers."),
    heads: Optional[Path] = typer.Option(None, "--heads", help="adadecode, specee: trained heads artifact (default: this model's, made by `selfspec train-heads --kind lm-heads`; the user's first, then the shipped one)."),
    adadecode_threshold: Optional[float] = typer.Option(None, "--adadecode-threshold", help="adadecode: early-prediction confidence gamma (default 0.5; the paper uses 0.75)."),
    adadecode_layers: Optional[str] = typer.Option(None, "--adadecode-layers", help="adadecode: use only these head layers, e.g. 2,5 (default: all trained heads)."),
    adadecode_max_pending: Optional[int] = typer.Option(None, "--adadecode-max-pending", help="adadecode: most unverified early predictions (default 5)."),
    exit_mlps: Optional[Path] = typer.Option(None, "--exit-mlps", help="specee: exit-predictor artifact (default: this model's, made by `selfspec train-heads --kind exit-mlp`)."),
    specee_schedule: Optional[Path] = typer.Option(None, "--specee-schedule", help="specee: offline schedule (default: this model's, made by `selfspec calibrate --method specee`)."),
    specee_kv_mode: Optional[str] = typer.Option(None, "--specee-kv-mode", help="specee (LOSSY): 'deferred' (default; skipped layers filled later, KV preserved) or 'empty' (the paper: deeper KV left empty)."),
    specee_threshold: Optional[float] = typer.Option(None, "--specee-threshold", help="specee: one predictor decision threshold for every layer (default: the per-layer thresholds of the artifact, chosen for 97% held-out exit precision; the paper uses 0.5)."),
    specee_eval: bool = typer.Option(False, "--specee-eval", help="specee: also run the skipped layers (a full-depth shadow) and report early-exit agreement and the share identical to ar."),
) -> None:
    """Generate a continuation for every prompt; one JSON object per prompt, flushed as it finishes.
    Every method is lossless except specee (LOSSY: its records say lossless false)."""
    if method not in METHODS:
        raise ConfigError(f"unknown --method '{method}'; choose one of: {', '.join(METHODS)}")
    check_method_options(ctx, method)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=tuple(stop))  # validates before any loading
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"unknown --prompt-format '{prompt_format}'; choose one of: {', '.join(PROMPT_FORMATS)}")
    n_threads = apply_threads(threads)
    if save_layers is not None:
        from ..artifacts import check_new_artifact

        check_new_artifact(save_layers, force, "--save-layers")
    check_output(output, force=force, append=append, inputs=(prompt_file,))  # before any work
    prompts = read_prompts(prompt_file, prompt_format)

    mdl, tok = load_model(model, dtype=dtype, device=device)
    eos_ids = eos_token_ids(mdl, tok)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=tuple(stop), eos_token_ids=eos_ids)
    ctx = context_length(mdl)
    for p in prompts:
        check_prompt_fits(p, tok, cfg, ctx, chat_template)

    engine = Engine(mdl)
    opts = MethodOptions(
        layers=layers, skip_attn=parse_layer_list(skip_attn, "--skip-attn"), skip_mlp=parse_layer_list(skip_mlp, "--skip-mlp"),
        max_draft=max_draft, draft_threshold=draft_threshold, skip_ratio=skip_ratio, context_window=context_window, tree_nodes=tree_nodes,
        seed=seed, asd_alpha=asd_alpha, asd_m=asd_m, asd_n=asd_n,
        heads=heads, adadecode_threshold=adadecode_threshold,
        adadecode_layers=parse_layer_list(adadecode_layers, "--adadecode-layers"), adadecode_max_pending=adadecode_max_pending,
        exit_mlps=exit_mlps, specee_schedule=specee_schedule, specee_kv_mode=specee_kv_mode,
        specee_threshold=specee_threshold, specee_eval=specee_eval)
    meth = build_method(method, engine, tok, opts)
    dev = torch.device(engine.device)
    log(f"[dim]model {mdl.config.model_type} {mdl.config.num_hidden_layers} layers, {engine.dtype}, {dev}; "
        f"method {method}; {len(prompts)} prompts[/dim]")
    total_tokens, total_time = 0, 0.0
    with output_stream(output, force=force, append=append, inputs=(prompt_file,)) as out, progress() as bar:
        task = bar.add_task("generate", total=len(prompts), info="")
        for p in prompts:
            rec = run_prompt(meth.generate, tok, p, cfg, dev, method, chat_template, meth.lossless)
            rec["threads"] = n_threads
            write_record(out, rec)
            total_tokens += rec["new_tokens"]
            total_time += rec["wall_time_s"]
            bar.update(task, advance=1, info=f"{total_tokens / max(total_time, 1e-9):.1f} tok/s")
    if save_layers is not None:
        path = meth.save_layers(save_layers)
        log(f"wrote skip-set artifact {path}")
