"""``selfspec bench``: selfspec's methods and outside peers side by side, one run, one timer.

The command parses its options and prints; the run (resume, torchrun ranks, what an interrupt
keeps, the files written) is :mod:`selfspec_cli.bench.job`. Outputs (``--output-dir``, default
``bench-out/``): ``results.json`` (schema in docs/benchmarks.md), ``records/<method>.jsonl``,
``answers/<method>.jsonl``, PNG plots. A rich table goes to stderr; the last line on stdout is
one JSON document with the headline figures.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..bench import job
from ..bench.job import DEFAULT_METHODS, VARIANTS
from ..bench.peers import PEERS
from ..bench.metrics import Paired
from ..bench.report import Block, MethodSummary, headline
from ..bench.suite_loader import DEFAULT_SUITE
from ..methods import METHODS
from . import options as opt
from .common import FigureTable, err_console, invocation, log, print_json, progress, set_exit_note, write_record


def bench(
    methods: str = typer.Option(DEFAULT_METHODS, "--methods", help=f"Comma-separated contenders, run as listed and no others: selfspec methods ({', '.join(METHODS)}), ar-fp32 (plain decoding of the float32 weights in a process of its own, beside a block or 16-bit target's ar; in the default list), method variants ({', '.join(VARIANTS)}: SpecEE with the paper's empty deeper KV, Self-SD with hybrid drafts or without the draft vocabulary, auto without hybrid trees) and peers ({', '.join(PEERS)})."),
    prompt_file: Optional[str] = opt.prompt_file("Prompts (as for generate) instead of a suite."),
    prompt_format: str = opt.prompt_format(),
    suite: Optional[str] = opt.suite(f"Bundled prompt suite (default {DEFAULT_SUITE}: 2 Spec-Bench questions per group; spec-bench: all 480; pystdlib, pystdlib-mini: for --model pystdlib) or a local JSONL path, loaded with `datasets`."),
    model: Optional[str] = opt.model(),
    max_new_tokens: int = opt.max_new_tokens(64, "New tokens per prompt turn (64 keeps the default suite with every contender under 15 minutes on 2 CPU cores)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs of the first prompt, per contender."),
    repeats: int = typer.Option(1, "--repeats", help="Timed passes over all prompts (interleaved); tokens/s is the median."),
    output_dir: Path = typer.Option(Path("bench-out"), "--output-dir", "-o", help="Where results.json, records, answers and plots go. Refused when it holds an earlier bench run's files, unless --force."),
    force: bool = opt.force("Delete the files an earlier bench run wrote in --output-dir (only those) before running."),
    resume: bool = opt.resume("Finish an interrupted run in --output-dir: the same command plus --resume keeps every finished record and runs only the prompts and passes missing (a method's state that carries across the prompts of a pass, SWIFT's search, restarts where the pass resumes)."),
    plot: bool = opt.plots("Write PNG plots."),
    costs: bool = typer.Option(True, "--costs/--no-costs", help="Measure the engine's costs first (floor, T(1), v(k), c(r), LM head share, as `selfspec profile` does, 7 rounds; about 10 s on the default model) and record them in results.json."),
    early_exit_layer: Optional[int] = typer.Option(None, "--early-exit-layer", help="hf-early-exit: layer the draft exits at (default: half the layers)."),
    assistant_model: Optional[str] = typer.Option(None, "--assistant-model", help="hf-assisted: a second model with the same tokenizer."),
    temperature: float = opt.temperature("0 = greedy (the default); > 0 samples, every pass with the same --seed, so lossless methods keep parity under the default --sampling-rule."),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    sampling_rule: str = opt.sampling_rule(),
    seed: int = opt.seed("Seed of sampling and of methods with random search (swift)."),
    threads: Optional[str] = opt.threads(),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
) -> None:
    """Benchmark methods and peers on the same model and prompts (greedy, or sampled with one seed): speed, speedup, M, alpha, parity."""
    req = job.BenchRequest(
        methods=methods, prompt_file=prompt_file, prompt_format=prompt_format, suite=suite, model=model,
        max_new_tokens=max_new_tokens, warmup=warmup, repeats=repeats, output_dir=output_dir, force=force, resume=resume,
        plot=plot, costs=costs, early_exit_layer=early_exit_layer, assistant_model=assistant_model,
        temperature=temperature, top_p=top_p, top_k=top_k, sampling_rule=sampling_rule, seed=seed, threads=threads,
        chat_template=chat_template, dtype=dtype, target_precision=target_precision, device=device)
    io = job.BenchIO(log=log, progress=progress, write_record=write_record, set_exit_note=set_exit_note,
                     invocation=invocation())
    plan = job.prepare(req, io)
    outcome = job.run(req, plan, io)
    if outcome is not None:  # None: a torchrun rank other than 0, which rank 0 reports for
        _report(outcome, plan, output_dir)


def _report(outcome: job.BenchOutcome, plan: job.BenchPlan, output_dir: Path) -> None:
    """The tables on stderr, the parity warning, and the headline JSON on stdout."""
    summary, has_base = outcome.summary, outcome.baseline is not None
    err_console.print(_table(summary, outcome.title, outcome.reference is not None, has_base))
    for extra in (_category_table(summary, has_base), _cost_table(summary)):
        if extra is not None:
            err_console.print(extra)
    lossless_bad = [n for n, m in summary.items() if m.lossless and m.overall.parity and m.overall.parity.parity < 1]
    if lossless_bad and not plan.sampling.greedy and plan.sampling.rule == "speculative":
        log("parity below 100% is expected under --sampling-rule speculative: the same law, other samples")
    elif lossless_bad:
        log(f"[bold red]parity below 100% for lossless {', '.join(lossless_bad)}: see 'differing' in "
            f"{output_dir}/results.json[/bold red]")
    log(f"wrote {output_dir}/results.json")
    print_json(headline(outcome.doc))


def _f(x: Any, suffix: str = "", fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def _table(summary: dict[str, MethodSummary], title: str, has_ref: bool, has_base: bool) -> FigureTable:
    vs = [k for k, shown in (("ar", has_ref), ("hf", has_base)) if shown]  # the speedup columns
    t = FigureTable(title + ("; vs ar/hf: ratio of mean tok/s, paired: geometric mean of per-prompt ratios" if vs else ""),
                    ["method", "tok/s", "min-max", *(f"vs {k}" for k in vs), "paired vs ar [95 %]", "decode tok/s", "M",
                     "alpha", "parity", "differs (first token)", "optim s", "peak MB"],
                    left=("method", "differs (first token)"), wrap=("differs (first token)",))
    for n, s in summary.items():
        m, par = s.overall, s.overall.parity
        differs = ", ".join(f"{d.id}@{d.first_divergence}" for d in (par.differing if par else [])[:4])
        if par and len(par.differing) > 4:
            differs += f" +{len(par.differing) - 4}"
        speedups = [f"{getattr(m, 'speedup_vs_' + k):.2f}x" for k in vs]
        t.add_row(n + ("" if s.lossless else " (lossy)"), f"{m.tokens_per_s:.1f}",
                  f"{m.tokens_per_s_min:.1f}-{m.tokens_per_s_max:.1f}", *speedups, _paired(m.paired_vs_ar),
                  _f(m.decode_tokens_per_s, fmt=".1f"), _f(m.mean_accepted_length), _f(m.acceptance_rate),
                  f"{par.parity:.0%} ({par.token_parity:.1%} tok)" if par else "-", differs,
                  _f(s.optimization_s, fmt=".1f"), f"{s.peak_cuda_mb or s.peak_rss_mb or 0:.0f}")
    return t


def _paired(p: Paired | None) -> str:
    if not p:
        return "-"
    return f"{p.speedup:.3f}x" + (f" [{p.ci95[0]:.2f}-{p.ci95[1]:.2f}]" if p.ci95 else "")


def _category_table(summary: dict[str, MethodSummary], has_base: bool) -> FigureTable | None:
    cats = sorted({c for m in summary.values() for c in m.categories})
    if not cats:
        return None
    t = FigureTable("speedup by category: vs ar [paired, 95 % interval]" + (" / vs hf" if has_base else "") + "  (M)",
                    ["method", *cats])
    for n, m in summary.items():
        t.add_row(n, *(_category_cell(m.categories.get(c), has_base) for c in cats))
    return t


def _category_cell(b: Block | None, has_base: bool) -> str:
    if not b:
        return "-"
    hf = f" / {b.speedup_vs_hf:.2f}" if has_base and b.speedup_vs_hf is not None else ""
    m = "" if b.mean_accepted_length is None else f" ({b.mean_accepted_length:.2f})"
    ci = b.paired_vs_ar.ci95 if b.paired_vs_ar else None
    return _f(b.speedup_vs_ar) + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "") + hf + m


def _cost_table(summary: dict[str, MethodSummary]) -> FigureTable | None:
    rows = {n: m.cost_model for n, m in summary.items() if m.cost_model}
    if not rows:
        return None
    t = FigureTable("cost-aware drafting: predicted (measured costs and acceptance) vs measured speedup, decode-only",
                    ("method", "rounds drafted", "predicted vs ar", "measured vs ar", "measured / predicted",
                     "end to end vs ar", "skip ratio"))
    for n, cm in rows.items():
        m = summary[n].overall
        t.add_row(n, f"{cm.draft_round_share:.0%}", _f(cm.predicted_speedup, "x"),
                  _f(m.decode_speedup_vs_ar, "x"), _f(cm.measured_over_predicted),
                  _f(m.speedup_vs_ar, "x"), _f(cm.skip_ratio))
    return t
