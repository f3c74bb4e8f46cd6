"""``selfspec bench``: selfspec's methods and outside peers side by side, one run, one timer.

Outputs (``--output-dir``, default ``bench-out/``): ``results.json`` (schema in
docs/benchmarks.md), ``records/<method>.jsonl`` (every timed pass, flushed prompt by
prompt), ``answers/<method>.jsonl`` (Spec-Bench answer format), PNG plots. A rich table
goes to stderr; the last line on stdout is one JSON document with the headline figures.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import typer

from ..artifacts import environment_info, model_name, recording_loads
from ..bench import engine_profile as prof, plots, ranks as rk
from ..bench.metrics import step_log
from ..bench.peers import PEERS, make_peer
from ..bench.report import document, headline, spec_bench_answers, summarize
from ..bench.runner import Contender, ContenderResult, run_bench
from ..bench.suite_loader import DEFAULT_SUITE, load_prompts
from ..config import GenerationConfig, SamplingConfig, check_seed
from ..decoding.cost import VerifyCurve, measure_fresh
from ..engine import Engine
from ..engine.target import TARGET_PRECISIONS
from ..errors import ConfigError
from ..loading import load_model, model_fingerprint
from ..methods import METHODS, Method, build
from ..paths import atomic_write
from ..prompts import PROMPT_FORMATS, Prompt, uses_chat_template
from ..runtime import check_prompt_fits, context_length, encode_turn, eos_token_ids
from .common import (MODEL_HELP, SAMPLING_RULE_HELP, TARGET_HELP, print_json, THREADS_HELP, cut_to_last_line, apply_threads, check_choice,
                     check_not_input, check_sampling_options, err_console, invocation, set_exit_note,
                     FigureTable, log, progress, write_record)
from .method_options import method_config
from ..jsonio import dumps

# contenders that are a method with non-default options: name -> (method, config fields, description suffix)
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "specee-empty": ("specee", {"specee_kv_mode": "empty"}, " [empty KV: deeper layers never get an exited token's K/V, as in the paper]"),
    "self-sd-hybrid": ("self-sd", {"hybrid": True}, " [hybrid: the n-gram continuation merged into the draft tree]"),
    "self-sd-full-vocab": ("self-sd", {"draft_vocab": "full"}, " [drafts over the full vocabulary, no FR-Spec subset]"),
    "auto-single": ("auto", {"hybrid": False}, " [one drafting source per round, no hybrid trees]"),
    "specqd-int8": ("specqd", {"draft_precision": "int8"}, " [int8 per-channel draft weights]"),
}
# plain decoding on another target than the run's (engine/target.py): the fp32 row beside a block or bf16 target,
# so every run shows what the faster target is worth; added by itself when the run's target is not fp32
TARGET_PEERS: dict[str, str] = {"ar-fp32": "fp32"}
DEFAULT_METHODS = "ar,hf,hf-pld," + ",".join(m for m in METHODS if m != "ar")
REFERENCE, BASELINE = "ar", "hf"


# files bench writes into --output-dir (and only these are ever deleted, with --force)
BENCH_FILES = ("results.json", "run.json", "speedup_by_category.png", "accept_lengths.png", "records/*.jsonl",
               "records/rank*/*.jsonl", "answers/*.jsonl", "*_skip_sets.png")


def bench_files(output_dir: Path) -> list[Path]:
    """Files of an earlier bench run in ``output_dir``: its fixed names, records/*.jsonl (and a
    torchrun run's records/rank<r>/*.jsonl), answers/*.jsonl and *_skip_sets.png. Nothing else
    there is touched."""
    return [p for pattern in BENCH_FILES for p in sorted(output_dir.glob(pattern)) if p.is_file()]


def _earlier_records(output_dir: Path, run_key: dict[str, Any], names: list[str],
                     records_dir: Path) -> dict[str, dict[tuple[int, Any], dict]]:
    """--resume: the finished records of the interrupted run in ``output_dir``, per contender,
    keyed by (pass, prompt id); a torn last line is dropped. Refused when that run was another command."""
    try:
        earlier = json.loads((output_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"--resume: '{output_dir}' holds no interrupted bench run (no readable run.json); "
                          "drop --resume to start one") from None
    diff = [k for k in run_key if earlier.get(k) != run_key[k]]
    if diff:
        raise ConfigError(f"--resume: the run in '{output_dir}' was made with other settings ({', '.join(diff)}); "
                          "resume it with its own command, or choose another --output-dir")
    done: dict[str, dict[tuple[int, Any], dict]] = {}
    for n in names:
        path = records_dir / f"{n}.jsonl"
        if not path.is_file():
            continue
        cut_to_last_line(path)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rec = json.loads(line)
                done.setdefault(n, {})[(rec["repeat"], rec["id"])] = rec
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--resume: line {i} of '{path}' is not a bench record; start the run again "
                                  "with --force") from None
    return done


def _complete_cells(partial: dict[str, ContenderResult], prompts: Sequence[Prompt]) -> dict[str, ContenderResult] | None:
    """The (pass, prompt) cells every contender finished, as results (None when there is none)."""
    if not partial:
        return None
    passes = min(len(r.repeats) for r in partial.values())
    out = {n: ContenderResult(r.name, r.lossless, r.kind, peak_rss_mb=r.peak_rss_mb) for n, r in partial.items()}
    for rep in range(passes):
        ids = set.intersection(*({rec["id"] for rec in r.repeats[rep]} for r in partial.values()))
        if not ids:
            continue
        for n, r in partial.items():
            out[n].repeats.append([rec for rec in r.repeats[rep] if rec["id"] in ids])
    return out if any(r.repeats for r in out.values()) else None


def _f(x: Any, suffix: str = "", fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def _table(summary: dict[str, dict[str, Any]], title: str, has_ref: bool, has_base: bool) -> FigureTable:
    vs = [k for k, shown in (("ar", has_ref), ("hf", has_base)) if shown]  # the speedup columns
    t = FigureTable(title + ("; vs ar/hf: ratio of mean tok/s, paired: geometric mean of per-prompt ratios" if vs else ""),
                    ["method", "tok/s", "min-max", *(f"vs {k}" for k in vs), "paired vs ar [95 %]", "decode tok/s", "M",
                     "alpha", "parity", "differs (first token)", "optim s", "peak MB"],
                    left=("method", "differs (first token)"), wrap=("differs (first token)",))
    for n, m in summary.items():
        par = m.get("parity")
        differs = ", ".join(f"{d['id']}@{d['first_divergence']}" for d in (par or {}).get("differing", [])[:4])
        if par and len(par["differing"]) > 4:
            differs += f" +{len(par['differing']) - 4}"
        speedups = [f"{m['speedup_vs_' + k]:.2f}x" for k in vs]
        t.add_row(n + ("" if m["lossless"] else " (lossy)"), f"{m['tokens_per_s']:.1f}",
                  f"{m['tokens_per_s_min']:.1f}-{m['tokens_per_s_max']:.1f}", *speedups, _paired(m.get("paired_vs_ar")),
                  _f(m.get("decode_tokens_per_s"), fmt=".1f"), _f(m["mean_accepted_length"]), _f(m["acceptance_rate"]),
                  f"{par['parity']:.0%} ({par['token_parity']:.1%} tok)" if par else "-", differs,
                  _f(m["optimization_s"], fmt=".1f"), f"{m['peak_cuda_mb'] or m['peak_rss_mb'] or 0:.0f}")
    return t


def _paired(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return f"{p['speedup']:.3f}x" + (f" [{p['ci95'][0]:.2f}-{p['ci95'][1]:.2f}]" if p["ci95"] else "")


def _category_table(summary: dict[str, dict[str, Any]], has_base: bool) -> FigureTable | None:
    cats = sorted({c for m in summary.values() for c in m.get("categories", {})})
    if not cats:
        return None
    t = FigureTable("speedup by category: vs ar [paired, 95 % interval]" + (" / vs hf" if has_base else "") + "  (M)",
                    ["method", *cats])
    for n, m in summary.items():
        t.add_row(n, *(_category_cell(m["categories"].get(c), has_base) for c in cats))
    return t


def _category_cell(b: dict[str, Any] | None, has_base: bool) -> str:
    if not b:
        return "-"
    hf = f" / {b['speedup_vs_hf']:.2f}" if has_base and b["speedup_vs_hf"] is not None else ""
    m = "" if b["mean_accepted_length"] is None else f" ({b['mean_accepted_length']:.2f})"
    ci = (b.get("paired_vs_ar") or {}).get("ci95")
    return _f(b["speedup_vs_ar"]) + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "") + hf + m


def _cost_table(summary: dict[str, dict[str, Any]]) -> FigureTable | None:
    rows = {n: m["cost_model"] for n, m in summary.items() if m.get("cost_model")}
    if not rows:
        return None
    t = FigureTable("cost-aware drafting: predicted (measured costs and acceptance) vs measured speedup, decode-only",
                    ("method", "rounds drafted", "predicted vs ar", "measured vs ar", "measured / predicted",
                     "end to end vs ar", "skip ratio"))
    for n, cm in rows.items():
        m = summary[n]
        t.add_row(n, f"{cm['draft_round_share']:.0%}", _f(cm.get("predicted_speedup"), "x"),
                  _f(m.get("decode_speedup_vs_ar"), "x"), _f(cm.get("measured_over_predicted")),
                  _f(m.get("speedup_vs_ar"), "x"), _f(cm.get("skip_ratio")))
    return t


def bench(
    methods: str = typer.Option(DEFAULT_METHODS, "--methods", help=f"Comma-separated contenders: selfspec methods ({', '.join(METHODS)}), method variants ({', '.join(VARIANTS)}: SpecEE with the paper's empty deeper KV, Self-SD with hybrid drafts or without the draft vocabulary, auto without hybrid trees) and peers ({', '.join(PEERS)})."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Prompts (as for generate) instead of a suite."),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="--prompt-file format: auto, text or jsonl (as for generate)."),
    suite: Optional[str] = typer.Option(None, "--suite", help=f"Bundled prompt suite (default {DEFAULT_SUITE}: 2 Spec-Bench questions per group; spec-bench: all 480; pystdlib, pystdlib-mini: for --model pystdlib) or a local JSONL path, loaded with `datasets`."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt turn (64 keeps the default suite with every contender under 15 minutes on 2 CPU cores)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs of the first prompt, per contender."),
    repeats: int = typer.Option(1, "--repeats", help="Timed passes over all prompts (interleaved); tokens/s is the median."),
    output_dir: Path = typer.Option(Path("bench-out"), "--output-dir", "-o", help="Where results.json, records, answers and plots go. Refused when it holds an earlier bench run's files, unless --force."),
    force: bool = typer.Option(False, "--force", help="Delete the files an earlier bench run wrote in --output-dir (only those) before running."),
    resume: bool = typer.Option(False, "--resume", help="Finish an interrupted run in --output-dir: the same command plus --resume keeps every finished record and runs only the prompts and passes missing (a method's state that carries across the prompts of a pass, SWIFT's search, restarts where the pass resumes)."),
    plot: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots."),
    costs: bool = typer.Option(True, "--costs/--no-costs", help="Measure the engine's costs first (floor, T(1), v(k), c(r), LM head share, as `selfspec profile` does, 7 rounds; about 10 s on the default model) and record them in results.json."),
    early_exit_layer: Optional[int] = typer.Option(None, "--early-exit-layer", help="hf-early-exit: layer the draft exits at (default: half the layers)."),
    assistant_model: Optional[str] = typer.Option(None, "--assistant-model", help="hf-assisted: a second model with the same tokenizer."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy (the default); > 0 samples, every pass with the same --seed, so lossless methods keep parity under the default --sampling-rule."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    sampling_rule: str = typer.Option("gumbel", "--sampling-rule", help=SAMPLING_RULE_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of sampling and of methods with random search (swift)."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap prompts in the tokenizer's chat template when it has one (as generate does)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16."),
    target_precision: str = typer.Option("auto", "--target-precision", help=TARGET_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Benchmark methods and peers on the same model and prompts (greedy, or sampled with one seed): speed, speedup, M, alpha, parity."""
    names = list(dict.fromkeys(m.strip() for m in methods.split(",") if m.strip()))
    unknown = [m for m in names if m not in METHODS and m not in VARIANTS and m not in PEERS and m not in TARGET_PEERS]
    if not names or unknown:
        raise ConfigError((f"unknown --methods {', '.join(unknown)}" if unknown else "--methods names no contender")
                          + f"; choose from: {', '.join([*METHODS, *VARIANTS, *PEERS, *TARGET_PEERS])}")
    if warmup < 0 or repeats < 1:
        raise ConfigError("--warmup must be >= 0 and --repeats >= 1")
    check_seed(seed)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir '{output_dir}' is a file; pass a directory")
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    for opt, value, peer in (("--early-exit-layer", early_exit_layer, "hf-early-exit"),
                             ("--assistant-model", assistant_model, "hf-assisted")):
        if value is not None and peer not in names:
            raise ConfigError(f"{opt} is an option of the {peer} peer; drop it or add {peer} to --methods")
    if temperature > 0 and (greedy_only := [n for n in names if n in PEERS or (
            (base := VARIANTS.get(n, (n,))[0]) in METHODS and METHODS[base].greedy_only)]):
        raise ConfigError(f"{', '.join(greedy_only)} {'runs' if len(greedy_only) == 1 else 'run'} greedy only; with "
                          "--temperature drop them from --methods (e.g. --methods ar,specqd,self-sd,swift,asd,pld,auto,adadecode)")
    if "hf-assisted" in names and assistant_model is None:
        raise ConfigError("hf-assisted needs a second model with the same tokenizer; pass --assistant-model DIR")
    apply_threads(threads)
    ranks = rk.from_env()  # torchrun's ranks (one when not under torchrun)
    say = log if ranks.lead else (lambda _msg: None)  # the other ranks report through rank 0
    if resume and force:
        raise ConfigError("--resume keeps the earlier run's records and --force deletes them; pass one of them")
    stale = [] if resume else bench_files(output_dir)
    if stale and not force:
        shown = ", ".join(str(p.relative_to(output_dir)) for p in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise ConfigError(f"--output-dir '{output_dir}' holds files of an earlier bench run ({shown}); pass --force to delete "
                          "those files first, or choose another --output-dir")
    for f in stale:  # only with --force
        check_not_input(f, (prompt_file,), "--output-dir")
    rk.init(ranks)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, rule=sampling_rule)
    cfg0 = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling)  # validates first
    check_sampling_options(sampling)
    decoding = "greedy" if sampling.greedy else (f"sampling (temperature {temperature}, top-p {top_p}, top-k {top_k}, "
                                                 f"rule {sampling_rule}, seed {seed})")
    prompts, source = load_prompts(prompt_file, suite, prompt_format)
    if len({p.id for p in prompts}) != len(prompts):
        raise ConfigError("prompt ids repeat; give every prompt a unique 'id' so outputs can be compared")
    if len(prompts) < ranks.world:  # every rank checks the same thing, so all of them stop with this line
        raise ConfigError(f"{len(prompts)} prompts for {ranks.world} torchrun ranks: a rank would have none; "
                          "start fewer ranks (--nproc-per-node) or pass more prompts")

    mdl, tok = load_model(model, dtype=dtype, device=device)
    cfg = dataclasses.replace(cfg0, eos_token_ids=eos_token_ids(mdl, tok))
    for p in prompts:
        check_prompt_fits(p, tok, cfg, context_length(mdl), chat_template)
    suite_prompts, prompts = prompts, ranks.share(prompts)  # this rank's prompts (all of them in one process)
    records_dir = output_dir / "records" / (f"rank{ranks.rank}" if ranks.many else "")
    assistant = None if assistant_model is None else load_model(assistant_model, dtype=dtype, device=device)[0]
    engine = Engine(mdl, target_precision=target_precision)
    measure_fresh(engine)  # every run measures its own costs (and pools a new reading per pass), never the store's
    dev = torch.device(engine.device)
    if REFERENCE in names and engine.target_precision != "fp32" and engine.dtype == torch.float32:
        names = list(dict.fromkeys([*names[:names.index(REFERENCE) + 1], "ar-fp32", *names]))  # beside ar
    other_targets: dict[str, Engine] = {}  # TARGET_PEERS' engines, built once

    # build every contender once up front: a missing artifact fails now, not after an hour
    contenders: list[Contender] = []
    descriptions: dict[str, str] = {}
    offline: dict[str, dict[str, Any] | None] = {}
    artifacts: dict[str, dict[str, str]] = {}
    built: dict[str, list[Method]] = {}  # the method instances of each pass, for their search histories
    for n in names:
        if n in METHODS or n in VARIANTS:
            base, extra, note = VARIANTS.get(n, (n, {}, ""))
            conf = method_config(base, extra, seed=seed)  # the run's seed where the method has one
            with recording_loads() as artifacts[n]:  # the artifact files it reads, recorded in results.json
                first = build(base, engine, tok, conf)
            descriptions[n] = first.description + note
            offline[n] = first.offline_info()  # calibration / training time, from its artifacts
            built[n] = []

            def make(b: str = base, c: Any = conf, n: str = n) -> Any:
                built[n].append(build(b, engine, tok, c))
                return built[n][-1].generate

            contenders.append(Contender(n, make, first.lossless))
        elif n in TARGET_PEERS:
            tp = TARGET_PEERS[n]
            if tp not in other_targets:
                other_targets[tp] = Engine(mdl, target_precision=tp)
            descriptions[n] = (f"plain decoding on the {tp} target (the model's float32 tensors), beside ar on "
                               f"this run's {engine.target_precision} target")

            def make_ar(e: Engine = other_targets[tp]) -> Any:
                return build(REFERENCE, e, tok).generate

            contenders.append(Contender(n, make_ar, True, kind="peer"))
        else:
            peer = make_peer(n, mdl, early_exit_layer=early_exit_layer, assistant=assistant)
            descriptions[n] = PEERS[n]
            contenders.append(Contender(n, (lambda peer=peer: peer.generate), peer.lossless, kind="peer"))

    if not any(n in PEERS or n in TARGET_PEERS for n in names):  # no contender runs the float weights
        engine.release_float_weights()
    run_key = {"methods": names, "prompts": [p.id for p in suite_prompts], "max_new_tokens": max_new_tokens,
               "decoding": decoding, "model_fingerprint": model_fingerprint(mdl), "dtype": str(engine.dtype), "target_precision": engine.target_precision,
               "chat_template": chat_template, "warmup": warmup, "seed": seed, "threads": torch.get_num_threads(),
               "early_exit_layer": early_exit_layer, "assistant_model": assistant_model,
               "prompts_sha256": hashlib.sha256(dumps([list(p.turns) for p in suite_prompts]).encode()).hexdigest(),
               "ranks": ranks.world}
    done = _earlier_records(output_dir, run_key, names, records_dir) if resume else {}
    if ranks.lead:
        for f in stale:
            f.unlink(missing_ok=True)
    rk.barrier(ranks)  # the earlier run's files are gone before any rank makes its own
    try:
        for d in (records_dir, output_dir / "answers"):
            d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --output-dir '{output_dir}' ({exc.strerror}); choose a writable directory") from None
    if ranks.lead:
        atomic_write(output_dir / "run.json", lambda f: f.write((dumps(run_key, indent=2) + "\n").encode()))
    if done:
        say(f"[dim]resuming: {sum(len(v) for v in done.values())} finished records kept[/dim]")
    cats = Counter(p.category or "all" for p in suite_prompts)
    if ranks.many:
        say(f"[dim]torchrun: {ranks.world} ranks, every {ranks.world}th prompt each; records per rank in "
            f"{output_dir}/records/rank<r>/[/dim]")
    say(f"[dim]model {model_name(mdl)} ({mdl.config.model_type}, {engine.num_layers} layers, {engine.dtype}, {dev}, "
        f"{torch.get_num_threads()} threads{' per rank' if ranks.many else ''}); {len(suite_prompts)} prompts ({', '.join(f'{c} {k}' for c, k in cats.items())}) "
        f"x {max_new_tokens} tokens; warm-up {warmup}, repeats {repeats}; contenders {', '.join(names)}[/dim]")
    say(f"[dim]target: {engine.target_precision} ({engine.target_info.get('why') or 'asked'}); every speedup is "
        f"against ar on it[/dim]")

    engine_costs = None
    if costs and ranks.lead:
        ids = sorted((encode_turn(tok, [{"role": "user", "content": p.turns[0]}], chat_template) for p in prompts), key=len)
        engine_costs = prof.engine_costs(engine, ids[len(ids) // 2], rounds=7)  # as selfspec profile
        say(f"[dim]engine costs: floor {engine_costs['floor_ms']:.1f} ms ({engine_costs['bandwidth_gbs']:.1f} GB/s), "
            f"T(1) {engine_costs['step_ms']:.1f} ms ({engine_costs['step_over_floor']:.2f}x floor), "
            f"v(4) {engine_costs['verify_cost']['4']:.2f}, v(8) {engine_costs['verify_cost']['8']:.2f}, "
            f"c(0.5) {engine_costs['draft_cost']['0.5']:.2f}, LM head {engine_costs['lm_head_share']:.0%}; "
            f"matrix products: {engine.kernel_info['backend']}[/dim]")

    rk.barrier(ranks)  # every rank starts timing together, after rank 0's cost measurement
    partial: dict[str, ContenderResult] = {}
    with ExitStack() as stack, progress(disable=not ranks.lead) as bar:
        files = {n: stack.enter_context((records_dir / f"{n}.jsonl").open("a" if resume else "w", encoding="utf-8"))
                 for n in names}
        running = {n: Counter() for n in names}  # new tokens and seconds so far, per contender
        task = bar.add_task("bench", total=len(prompts) * len(contenders) * repeats, info="")
        bar.update(task, advance=sum(len(v) for v in done.values()))

        def on_record(name: str, rep: int, rec: dict[str, Any]) -> None:
            if ranks.many:
                rec["rank"] = ranks.rank
            write_record(files[name], rec)
            r = running[name]
            r.update(tokens=rec["new_tokens"], seconds=rec["wall_time_s"])
            bar.update(task, advance=1, info=f"{name} {r['tokens'] / max(r['seconds'], 1e-9):.1f} tok/s")

        try:
            # one process: pool another verify-curve reading before each pass (decoding/cost.py, VerifyCurve.refresh)
            results = run_bench(contenders, prompts, tok, cfg, dev, warmup, repeats, chat_template, on_record=on_record,
                                done=done, partial=partial,
                                between_passes=None if ranks.many else lambda: VerifyCurve.refresh(engine))
        except KeyboardInterrupt:
            stack.close()
            kept = _complete_cells(partial, prompts)
            note = f"records are in {records_dir}; the same command with --resume finishes the run"
            if ranks.many:  # torchrun stops every rank when one fails; rank 0 alone cannot summarize the run
                set_exit_note(f"{ranks}: {note}")
                raise
            if kept is not None:
                summary = summarize(kept, REFERENCE if REFERENCE in kept else None, BASELINE if BASELINE in kept else None,
                                    descriptions, offline, num_layers=engine.num_layers)
                doc = document(summary, setup={**source, "complete": False, "command": invocation(), "decoding": decoding},
                               environment=environment_info(dev, engine.dtype), model={"name": model_name(mdl)},
                               reference=REFERENCE if REFERENCE in kept else None,
                               baseline=BASELINE if BASELINE in kept else None, files={})
                atomic_write(output_dir / "results.json", lambda f: f.write((dumps(doc, indent=2) + "\n").encode()))
                note = f"results.json holds the prompts every contender finished (marked incomplete); {note}"
            set_exit_note(note)
            raise

    if ranks.many:  # rank 0 gathers every rank's passes and merges them in the suite's order
        parts = rk.gather(ranks, {n: {"repeats": r.repeats, "peak_rss_mb": r.peak_rss_mb, "peak_cuda_mb": r.peak_cuda_mb}
                                  for n, r in results.items()})
        rk.close(ranks)
        if not ranks.lead:
            return
        for n, r in results.items():
            r.repeats = rk.merge_repeats([part[n]["repeats"] for part in parts], [p.id for p in suite_prompts])
            for k in ("peak_rss_mb", "peak_cuda_mb"):
                setattr(r, k, max((v for part in parts if (v := part[n][k]) is not None), default=None))
            _write_jsonl(output_dir / "records" / f"{n}.jsonl", (rec for passed in r.repeats for rec in passed))
        prompts = suite_prompts
    ref = REFERENCE if REFERENCE in results else None
    base = BASELINE if BASELINE in results else None
    summary = summarize(results, ref, base, descriptions, offline, num_layers=engine.num_layers)
    for n, m in summary.items():
        m["artifacts"] = artifacts.get(n, {})
    setup = {**source, "prompts": len(prompts), "categories": dict(cats), "max_new_tokens": max_new_tokens,
             "warmup": warmup, "repeats": repeats, "decoding": decoding, "batch_size": 1,
             # whether the prompts were wrapped in a chat template (asked, and the tokenizer has one)
             "chat_template": uses_chat_template(tok, chat_template), "chat_template_asked": chat_template,
             "seed": seed, "command": invocation(), "complete": True,
             "early_exit_layer": early_exit_layer, "assistant_model": assistant_model, "ranks": ranks.world}
    model_info = {"name": model_name(mdl), "architecture": mdl.config.model_type, "num_layers": engine.num_layers,
                  "fingerprint": model_fingerprint(mdl), "parameters": sum(p.numel() for p in mdl.parameters())}
    file_map: dict[str, Any] = {"results": str(output_dir / "results.json"),
                                "records": {n: str(output_dir / "records" / f"{n}.jsonl") for n in names},
                                "answers": {n: str(output_dir / "answers" / f"{n}.jsonl") for n in results}}
    for n, r in results.items():
        _write_jsonl(file_map["answers"][n], spec_bench_answers(r.records, f"{model_name(mdl)}-{n}"))
    if plot:
        file_map["plots"] = _plots(results, summary, engine.num_layers, output_dir, ref, built)
    doc = document(summary, setup=setup, environment=environment_info(dev, engine.dtype), model=model_info,
                   reference=ref, baseline=base, files=file_map)
    if engine_costs is not None:  # the curve the last pass's planners read (pooled over the passes)
        engine_costs.update(prof.curve_fields(VerifyCurve.for_engine(engine)))
        engine_costs["step_over_floor"] = round(engine_costs["step_ms"] / engine_costs["floor_ms"], 3)
    doc["engine_costs"] = engine_costs
    atomic_write(output_dir / "results.json", lambda f: f.write((dumps(doc, indent=2) + "\n").encode()))

    title = (f"selfspec bench: {source.get('suite') or source.get('prompt_file')}, {len(prompts)} prompts x "
             f"{max_new_tokens} tokens, {dev}, {str(engine.dtype).replace('torch.', '')}, {decoding}, "
             f"median of {repeats} pass{'es' if repeats > 1 else ''}")
    err_console.print(_table(summary, title, ref is not None, base is not None))
    for extra in (_category_table(summary, base is not None), _cost_table(summary)):
        if extra is not None:
            err_console.print(extra)
    lossless_bad = [n for n, m in summary.items() if m["lossless"] and m.get("parity") and m["parity"]["parity"] < 1]
    if lossless_bad and not sampling.greedy and sampling.rule == "speculative":
        log("parity below 100% is expected under --sampling-rule speculative: the same law, other samples")
    elif lossless_bad:
        log(f"[bold red]parity below 100% for lossless {', '.join(lossless_bad)}: see 'differing' in {output_dir}/results.json[/bold red]")
    log(f"wrote {output_dir}/results.json")
    print_json(headline(doc))


def _write_jsonl(path: Path | str, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            write_record(f, row)


def _plots(results: dict[str, ContenderResult], summary: dict[str, dict[str, Any]], num_layers: int,
           out: Path, ref: str | None, built: dict[str, list[Method]]) -> dict[str, str]:
    logs = {n: step_log(r.records)["accept_lengths"] for n, r in results.items() if summary[n]["acceptance_rate"] is not None}
    made = {"speedup_by_category": plots.speedup_by_category(summary, out / "speedup_by_category.png", reference=ref)
            if ref else None,
            "accept_lengths": plots.accept_length_histogram(logs, out / "accept_lengths.png")}
    for n, methods in built.items():
        history = (methods[-1].search_history() if methods else None) or []  # no search: no plot
        title = f"{n}: skipped sublayers over optimization steps (last pass)"
        made[f"{n}_skip_sets"] = plots.swift_heatmap(history, num_layers, out / f"{n}_skip_sets.png", title=title)
    return {name: str(p) for name, p in made.items() if p}  # a plot with nothing to show is not written
