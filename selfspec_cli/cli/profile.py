"""``selfspec profile``: the engine's costs on this machine against the hardware's limits.

Writes ``profile.json`` (keys documented in docs/engine.md, "`profile.json`"), ``verify_cost.png`` and
``redundancy.png`` into ``--output-dir``; a rich table goes to stderr and one JSON line
with the headline figures to stdout. The command parses and prints; the measurement is
:mod:`selfspec_cli.bench.profile`.

The verify curve is this machine's stored one (decoding/cost_store.py) when the store holds a
full reading; otherwise, and always with ``--remeasure``, a full reading is taken and stored
(``--remeasure`` also times the draft costs afresh). ``cost_store`` in profile.json and the
table say where it is kept, under which key, how old it is, its rows, and whether this run
read or measured it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..bench import profile as run_profile
from ..bench.engine_profile import PREDICT_METHODS
from ..bench.suite_loader import DEFAULT_SUITE
from ..errors import count
from . import options as opt
from .common import err_console, log, print_json, progress, table
from .summary import age_text


def profile(
    model: Optional[str] = opt.model(),
    suite: Optional[str] = opt.suite(f"Prompts for the context and the redundancy map (default {DEFAULT_SUITE})."),
    prompt_file: Optional[str] = opt.prompt_file("Prompts from a file instead of a suite (first turn of each)."),
    prompt_format: str = opt.prompt_format(),
    output_dir: Path = typer.Option(Path("profile-out"), "--output-dir", "-o", help="Where profile.json and the plots go."),
    force: bool = opt.force("Replace an earlier profile in --output-dir."),
    rounds: int = typer.Option(7, "--rounds", help="Timing rounds; every figure is the median over rounds."),
    redundancy_prompts: int = typer.Option(3, "--redundancy-prompts", help="Prompts for the redundancy map (0: skip the map)."),
    redundancy_tokens: int = typer.Option(16, "--redundancy-tokens", help="Greedy tokens per prompt for the redundancy map."),
    layers: Optional[Path] = typer.Option(None, "--layers", help="Skip-set artifact for the map's calibrated row (default: this model's calibrated set, if any)."),
    predict: str = typer.Option(",".join(PREDICT_METHODS), "--predict", help="Methods whose speedup to predict from the measured costs and the acceptance they show on the prompts ('' for none)."),
    predict_tokens: int = typer.Option(32, "--predict-tokens", help="Greedy tokens per prompt for the predictions (on --redundancy-prompts prompts, at least 1)."),
    plots: bool = opt.plots("Write the PNG plots."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Take a fresh full reading of the verify curve and the draft costs, and store it, instead of reading what this machine's cost store holds."),
    threads: Optional[str] = opt.threads(),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
) -> None:
    """Measure the engine against the machine: memory-bandwidth floor, decode step T(1), verification cost v(k),
    draft cost c(r), the LM head's share, the kernel's logit difference and a layer-redundancy map."""
    req = run_profile.ProfileRequest(
        model=model, suite=suite, prompt_file=prompt_file, prompt_format=prompt_format, output_dir=output_dir,
        force=force, rounds=rounds, redundancy_prompts=redundancy_prompts, redundancy_tokens=redundancy_tokens,
        layers=layers, predict=predict, predict_tokens=predict_tokens, plots=plots, remeasure=remeasure,
        threads=threads, chat_template=chat_template, dtype=dtype, target_precision=target_precision, device=device)
    result = run_profile.run(req, run_profile.check(req), log=log, progress=progress)
    err_console.print(_table(result))
    if s := result.get("cost_store"):
        log(f"costs on disk: {s['path']}")
    log(f"wrote {output_dir / 'profile.json'}")
    print_json({k: result[k] for k in ("model", "floor_ms", "step_ms", "step_over_floor", "verify_cost", "draft_cost",
                                       "lm_head_share", "kernel_max_logit_diff")})


def _thread_rows(t: Table, r: dict[str, Any]) -> None:
    """The rows on threads: T(1) and v(k) at one thread beside the default's, and where a step's time goes."""
    if one := r.get("one_thread"):
        t.add_row("at 1 thread: T(1), v(k) k=2,4,8", f"{one['step_ms']:.1f} ms; " + ", ".join(
            f"{one['verify_cost'][str(k)]:.2f}" for k in (2, 4, 8) if str(k) in one["verify_cost"]))
    for row in (r.get("step_parts") or {}).get("rows", []):
        t.add_row(*_step_part_row(row))


def _step_part_row(row: dict[str, Any]) -> tuple[str, str]:
    """One row of profile.json's ``step_parts``: T(1) at a thread count and context, split into the layers'
    products, their attention, their other ops and what runs outside the layers' call."""
    p = row["parts_ms"]
    products = p["qkv"] + p["o"] + p["gate_up"] + p["down"]
    other = sum(p.values()) - products - p["attention"]
    return (f"step at {count(row['threads'], 'thread')}, {row['context_tokens']} tokens",
            f"{row['step_ms']:.2f} ms: products {products:.2f}, attention {p['attention']:.2f}, other ops "
            f"{other:.2f}, outside the layers {row['outside_layers_ms']:.2f}")


def _table(r: dict[str, Any]) -> Table:
    t = table(f"profile: {r['model']} (target {r['target_precision']}, {count(r['environment']['threads'], 'thread')}, "
              f"kernel {r['kernel']['backend']})", ("figure", "value"), left=("figure",))
    t.add_row("weights read per step", f"{r['weight_bytes'] / 1e6:.0f} MB")
    t.add_row("read bandwidth", f"{r['bandwidth_gbs']:.1f} GB/s")
    t.add_row("floor (bytes / bandwidth)", f"{r['floor_ms']:.1f} ms")
    t.add_row("T(1): one decode step", f"{r['step_ms']:.1f} ms ({r['step_over_floor']:.2f}x floor)")
    t.add_row("v(k) k=2,4,8,16 (non-decreasing)", ", ".join(f"{r['verify_cost'][str(k)]:.2f}" for k in (2, 4, 8, 16) if str(k) in r["verify_cost"]))
    _thread_rows(t, r)
    t.add_row("c(r) r=" + ",".join(r["draft_cost"]), ", ".join(f"{v:.2f}" for v in r["draft_cost"].values()))
    t.add_row("LM head share", f"{r['lm_head_share']:.0%}")
    if "non_product_share" in r:
        t.add_row("T(1) besides the products", f"{r['non_product_share']:.0%} (products {r['products_ms']:.1f} ms)")
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
    if ceil := r.get("draft_ceilings"):
        t.add_row("ceiling, every draft accepted", ceil["summary"])
    if s := r.get("cost_store"):
        t.add_row("costs on disk", (  # the file's path is its own line under the table, whole at any width
            f"{'read' if s['curve'] == 'read' else 'measured now and stored'}; rows {','.join(map(str, s['rows']))}, "
            f"{count(s['readings'], 'reading')}, updated {age_text(s['age_s'])} ago, created "
            f"{age_text(s['created_age_s'])} ago" if s["stored"] else "not writable: nothing stored"))
        t.add_row("costs key", ", ".join(f"{k} {v}" for k, v in s["key"].items()))
    for name, p in (r.get("predicted_speedup") or {}).items():
        t.add_row(f"predicted speedup: {name}", p.get("unavailable", "no plans (not cost-aware)")
                  if p.get("predicted_speedup") is None
                  else f"{p['predicted_speedup']:.2f}x (drafts in {p['draft_round_share']:.0%} of rounds)")
    return t
