"""``selfspec profile``: the engine's costs on this machine against the hardware's limits.

Writes ``profile.json`` (keys documented in docs/engine.md, "`profile.json`"), ``verify_cost.png`` and
``redundancy.png`` into ``--output-dir``; a rich table goes to stderr and one JSON line
with the headline figures to stdout.

The verify curve is this machine's stored one (decoding/cost_store.py) when the store holds a
full reading; otherwise, and always with ``--remeasure``, a full reading is taken and stored
(``--remeasure`` also times the draft costs afresh). ``cost_store`` in profile.json and the
table say where it is kept, under which key, how old it is, its rows, and whether this run
read or measured it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..artifacts import environment_info, model_name, now_iso, save_json_artifact
from ..bench import engine_profile as prof
from ..bench.suite_loader import DEFAULT_SUITE, load_prompts
from ..decoding import cost_store
from ..decoding.cost import CURVE_ROWS, engine_key, measure_fresh
from ..engine import Engine
from ..errors import ArtifactError, ConfigError
from ..engine.target import TARGET_PRECISIONS
from ..loading import load_model, model_fingerprint
from ..prompts import PROMPT_FORMATS
from ..methods import METHODS, fr_spec
from ..methods.self_sd import SkipSet
from ..runtime import encode_turn, eos_token_ids
from .common import MODEL_HELP, TARGET_HELP, THREADS_HELP, print_json, apply_threads, check_choice, err_console, log, progress, table

PROFILE_FILES = ("profile.json", "verify_cost.png", "redundancy.png")


def profile(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    suite: Optional[str] = typer.Option(None, "--suite", help=f"Prompts for the context and the redundancy map (default {DEFAULT_SUITE})."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Prompts from a file instead of a suite (first turn of each)."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="--prompt-file format: auto, text or jsonl."),
    output_dir: Path = typer.Option(Path("profile-out"), "--output-dir", "-o", help="Where profile.json and the plots go."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier profile in --output-dir."),
    rounds: int = typer.Option(7, "--rounds", help="Timing rounds; every figure is the median over rounds."),
    redundancy_prompts: int = typer.Option(3, "--redundancy-prompts", help="Prompts for the redundancy map (0: skip the map)."),
    redundancy_tokens: int = typer.Option(16, "--redundancy-tokens", help="Greedy tokens per prompt for the redundancy map."),
    layers: Optional[Path] = typer.Option(None, "--layers", help="Skip-set artifact for the map's calibrated row (default: this model's calibrated set, if any)."),
    predict: str = typer.Option(",".join(prof.PREDICT_METHODS), "--predict", help="Methods whose speedup to predict from the measured costs and the acceptance they show on the prompts ('' for none)."),
    predict_tokens: int = typer.Option(32, "--predict-tokens", help="Greedy tokens per prompt for the predictions (on --redundancy-prompts prompts, at least 1)."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Take a fresh full reading of the verify curve and the draft costs, and store it, instead of reading what this machine's cost store holds."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the chat template (as generate does)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    target_precision: str = typer.Option("auto", "--target-precision", help=TARGET_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Measure the engine against the machine: memory-bandwidth floor, decode step T(1), verification cost v(k),
    draft cost c(r), the LM head's share, the kernel's logit difference and a layer-redundancy map."""
    for name, val in (("--rounds", rounds), ("--predict-tokens", predict_tokens)):
        if val < 1:
            raise ConfigError(f"{name} must be >= 1, got {val}")
    predict_methods = [m for m in predict.replace(" ", "").split(",") if m]
    if unknown := [m for m in predict_methods if m not in METHODS]:
        raise ConfigError(f"--predict: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if unplanned := [m for m in predict_methods if m not in prof.PREDICT_METHODS]:
        raise ConfigError(f"--predict: {unplanned[0]} does not plan its rounds with the cost model, so there is nothing "
                          f"to predict; choose from {', '.join(prof.PREDICT_METHODS)} (selfspec bench measures it)")
    if redundancy_prompts < 0 or redundancy_tokens < 1:
        raise ConfigError("--redundancy-prompts must be >= 0 and --redundancy-tokens >= 1")
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir '{output_dir}' is a file; pass a directory")
    old = [output_dir / n for n in PROFILE_FILES if (output_dir / n).exists()]
    if old and not force:
        raise ConfigError(f"{output_dir} already holds a profile ({old[0].name}); pass --force to replace it, "
                          "or choose another --output-dir")
    n_threads = apply_threads(threads)
    prompts, _ = load_prompts(prompt_file, suite, prompt_format)  # never empty: both readers refuse that

    mdl, tok = load_model(model, dtype=dtype, device=device)
    engine = Engine(mdl, target_precision=target_precision)
    ids = [encode_turn(tok, [{"role": "user", "content": p.turns[0]}], chat_template) for p in prompts]
    calibrated = None
    try:
        skip = SkipSet.load(layers, mdl)
        calibrated = (skip.attn, skip.mlp)
    except ArtifactError as exc:
        if layers is not None:
            raise
        log(f"[dim]no calibrated skip set for the redundancy map ({str(exc).split(';')[0]})[/dim]")
    log(f"[dim]model {mdl.config.model_type}, {engine.num_layers} layers, {engine.dtype}, {engine.device}, "
        f"{n_threads} thread(s); matrix products: {engine.kernel_info['backend']}"
        f"{' (' + engine.kernel_info['reason'] + ')' if engine.kernel_info.get('reason') else ''}[/dim]")

    t_start = time.perf_counter()
    before = cost_store.describe(engine_key(engine))
    if remeasure:
        measure_fresh(engine)
    # the store's curve is used when it is a full reading (a short one, or none, is measured in full and stored)
    read = not remeasure and before["stored"] and set(CURVE_ROWS) <= set(before["rows"])
    # the context: the median-length prompt of the set (a typical decode position)
    ctx_ids = sorted(ids, key=len)[len(ids) // 2]
    with progress() as bar:
        task = bar.add_task("timing", total=rounds, info="")
        costs = prof.engine_costs(engine, ctx_ids, rounds=rounds, on_round=lambda i, n: bar.update(task, completed=i))
        diff = prof.kernel_logit_diff(engine, ctx_ids)
        # the redundancy map's prompts, evenly spread (at least one, for the predictions)
        n_sample = max(1, redundancy_prompts)
        sample = ids[:: max(1, len(ids) // n_sample)][:n_sample]
        red = None
        if redundancy_prompts > 0:
            rtask = bar.add_task("redundancy map", total=len(sample) * redundancy_tokens, info="")
            red = prof.redundancy_map(engine, sample, redundancy_tokens, calibrated,
                                      on_token=lambda i, n: bar.update(rtask, completed=i))
        qtask = bar.add_task("quantized drafts", total=None, info="")
        vocab = fr_spec.resolve("auto", mdl)
        quantized = prof.quantized_drafts(engine, ctx_ids, sample, redundancy_tokens, rounds=rounds,
                                          draft_vocab=None if vocab is None else vocab.ids)
        bar.update(qtask, total=1, completed=1)
        predicted = None
        if predict_methods:
            ptask = bar.add_task("predicted speedups", total=len(predict_methods), info="")
            predicted = prof.predicted_speedups(
                engine, tok, sample, predict_methods, predict_tokens, eos_token_ids(mdl, tok),
                on_method=lambda i, n: bar.update(ptask, completed=i, info=n))
            bar.update(ptask, completed=len(predict_methods), info="")

    result: dict[str, Any] = {
        "kind": "selfspec-profile", "model": model_name(mdl), "model_fingerprint": model_fingerprint(mdl),
        "num_layers": engine.num_layers, **costs, "ar_tokens_per_s_upper": round(1e3 / costs["step_ms"], 2),
        "target_precision": engine.target_precision, "target_info": engine.target_info,
        "kernel_max_logit_diff": diff, "redundancy": red, "quantized_drafts": quantized,
        "draft_verdict": prof.draft_verdict(quantized, costs["verify_cost"]), "predicted_speedup": predicted,
        "cost_store": {**cost_store.describe(engine_key(engine)), "curve": "read" if read else "measured"},
        "environment": environment_info(engine.device, engine.dtype), "created": now_iso(),
        "profile_s": round(time.perf_counter() - t_start, 1)}
    output_dir.mkdir(parents=True, exist_ok=True)
    save_json_artifact(output_dir / "profile.json", result)
    if plots:
        prof.verify_cost_plot(result, output_dir / "verify_cost.png")
        if red is not None:
            prof.redundancy_plot(red, output_dir / "redundancy.png", title=Path(model_name(mdl)).name)
    err_console.print(_table(result))
    log(f"wrote {output_dir / 'profile.json'}")
    print_json({k: result[k] for k in ("model", "floor_ms", "step_ms", "step_over_floor", "verify_cost", "draft_cost",
                                       "lm_head_share", "kernel_max_logit_diff")})


def _table(r: dict[str, Any]) -> Table:
    t = table(f"profile: {r['model']} (target {r['target_precision']}, {r['environment']['threads']} thread(s), "
              f"kernel {r['kernel']['backend']})", ("figure", "value"), left=("figure",))
    t.add_row("weights read per step", f"{r['weight_bytes'] / 1e6:.0f} MB")
    t.add_row("read bandwidth", f"{r['bandwidth_gbs']:.1f} GB/s")
    t.add_row("floor (bytes / bandwidth)", f"{r['floor_ms']:.1f} ms")
    t.add_row("T(1): one decode step", f"{r['step_ms']:.1f} ms ({r['step_over_floor']:.2f}x floor)")
    t.add_row("v(k) k=2,4,8,16", ", ".join(f"{r['verify_cost'][str(k)]:.2f}" for k in (2, 4, 8, 16) if str(k) in r["verify_cost"]))
    t.add_row("c(r) r=" + ",".join(r["draft_cost"]), ", ".join(f"{v:.2f}" for v in r["draft_cost"].values()))
    t.add_row("LM head share", f"{r['lm_head_share']:.0%}")
    if r.get("kernel_max_logit_diff") is not None:
        t.add_row("kernel max |logit diff|", f"{r['kernel_max_logit_diff']:.1e}")
    if red := r.get("redundancy"):
        a, m = red["attn"], red["mlp"]
        t.add_row("one skipped sublayer: agreement", f"attn {min(a):.2f}-{max(a):.2f}, mlp {min(m):.2f}-{max(m):.2f}")
        if c := red.get("calibrated"):
            t.add_row("calibrated set: agreement",
                      f"{c['agreement']:.2f} ({len(c['skip_attn'])} attn + {len(c['skip_mlp'])} mlp skipped)")
    for name, q in (r.get("quantized_drafts") or {}).items():
        if name == "_":
            continue
        t.add_row(f"draft {name}", q["unavailable"] if "unavailable" in q else
                  f"c {q['c']:.2f} (draft vocabulary {q.get('c_draft_vocab', q['c']):.2f}), agreement "
                  f"{q['agreement']:.3f}, {q['draft_bytes'] / 1e6:.0f} MB, loaded in {q['load_s']:.2f} s ({q['cache']})")
    if v := r.get("draft_verdict"):
        t.add_row("full-depth drafts", v["summary"])
    if s := r.get("cost_store"):
        t.add_row("costs on disk", f"{s['path']}" + (
            f" ({'read' if s['curve'] == 'read' else 'measured now and stored'}; rows {','.join(map(str, s['rows']))}, "
            f"{s['readings']} reading(s), updated {_age(s['age_s'])} ago, created {_age(s['created_age_s'])} ago)"
            if s["stored"] else " (not writable: nothing stored)"))
        t.add_row("costs key", ", ".join(f"{k} {v}" for k, v in s["key"].items()))
    for name, p in (r.get("predicted_speedup") or {}).items():
        t.add_row(f"predicted speedup: {name}", p.get("unavailable", "no plans (not cost-aware)")
                  if p.get("predicted_speedup") is None
                  else f"{p['predicted_speedup']:.2f}x (drafts in {p['draft_round_share']:.0%} of rounds)")
    return t


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
