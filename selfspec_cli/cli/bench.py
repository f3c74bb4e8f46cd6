"""``selfspec bench``: selfspec methods and outside peers side by side (minimal version)."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.table import Table

from ..bench.peers import HFGenerate
from ..bench.runner import Contender, parity, run_bench
from ..config import GenerationConfig, SamplingConfig
from ..engine import Engine
from ..errors import ConfigError
from ..loading import REPO_ROOT, load_model
from ..methods import METHODS
from ..methods.factory import MethodOptions, build_method
from ..prompts import read_prompts
from ..runtime import check_prompt_fits, context_length, eos_token_ids
from .common import err_console, log, progress

PEERS = ("hf",)
DEFAULT_PROMPTS = REPO_ROOT / "examples" / "prompts.jsonl"


def bench(
    methods: str = typer.Option("ar,hf", "--methods", help=f"Comma-separated: selfspec methods ({', '.join(METHODS)}) and peers ({', '.join(PEERS)})."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-p", help="Prompts (as for generate). Default: examples/prompts.jsonl."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Local Hugging Face directory or hub id. Default: the shipped model."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs of the first prompt, per contender."),
    repeats: int = typer.Option(1, "--repeats", help="Timed passes over all prompts; throughput is the median."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template"),
    dtype: str = typer.Option("auto", "--dtype"),
    device: str = typer.Option("auto", "--device"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Also write results.json and per-method answers here."),
) -> None:
    """Time methods and peers on the same prompts; a table on stderr, one JSON line on stdout."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS and m not in PEERS]
    if not names or unknown:
        raise ConfigError(f"unknown --methods {', '.join(unknown) or '(none)'}; choose from: {', '.join([*METHODS, *PEERS])}")
    if warmup < 0 or repeats < 1:
        raise ConfigError("--warmup must be >= 0 and --repeats >= 1")
    cfg0 = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig())
    prompts = read_prompts(prompt_file or str(DEFAULT_PROMPTS))

    mdl, tok = load_model(model, dtype=dtype, device=device)
    eos_ids = eos_token_ids(mdl, tok)
    cfg = GenerationConfig(max_new_tokens=cfg0.max_new_tokens, sampling=cfg0.sampling, eos_token_ids=eos_ids)
    ctx = context_length(mdl)
    for p in prompts:
        check_prompt_fits(p, tok, cfg, ctx, chat_template)
    engine = Engine(mdl)
    dev = torch.device(engine.device)
    contenders = []
    for n in names:
        if n in METHODS:
            m = build_method(n, engine, tok, MethodOptions())
            contenders.append(Contender(n, m.generate, m.lossless))
        elif n == "hf":
            contenders.append(Contender(n, HFGenerate(mdl, tok).generate, True))

    with progress() as bar:
        task = bar.add_task("bench", total=len(prompts) * len(contenders) * repeats, info="")
        results = run_bench(contenders, prompts, tok, cfg, dev, warmup, repeats, chat_template,
                            on_prompt=lambda name: bar.update(task, advance=1, info=name))

    ref_name = "ar" if "ar" in results else names[0]
    base_name = "hf" if "hf" in results else ref_name
    table = Table(title=f"selfspec bench: {len(prompts)} prompts, {max_new_tokens} new tokens, {dev}, {engine.dtype}")
    cols = ["method", "tokens/s (median)", "min-max", f"vs {ref_name}"] + ([f"vs {base_name}"] if base_name != ref_name else [])
    for col in cols + ["parity", "differs"]:
        table.add_column(col)
    summary: dict[str, dict] = {}
    for n, r in results.items():
        par, differ = parity(r.records, results[ref_name].records)
        summary[n] = {
            "tokens_per_s": round(r.median_tps, 3),
            "tokens_per_s_min": round(min(r.throughputs), 3),
            "tokens_per_s_max": round(max(r.throughputs), 3),
            f"speedup_vs_{ref_name}": round(r.mean_tps / results[ref_name].mean_tps, 4),
            f"speedup_vs_{base_name}": round(r.mean_tps / results[base_name].mean_tps, 4),
            "parity": par,
            "differing_prompts": differ,
            "new_tokens": sum(x["new_tokens"] for x in r.records),
        }
        s = summary[n]
        speedups = [f"{s[f'speedup_vs_{ref_name}']:.2f}x"] + ([f"{s[f'speedup_vs_{base_name}']:.2f}x"] if base_name != ref_name else [])
        table.add_row(n, f"{s['tokens_per_s']:.1f}", f"{s['tokens_per_s_min']:.1f}-{s['tokens_per_s_max']:.1f}",
                      *speedups, f"{par:.0%}", ", ".join(map(str, differ[:5])) + (" ..." if len(differ) > 5 else ""))
    err_console.print(table)
    doc = {
        "model": mdl.config.name_or_path, "device": str(dev), "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "warmup": warmup, "repeats": repeats,
        "reference": ref_name, "baseline": base_name, "methods": summary,
    }
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
        for n, r in results.items():
            with (output_dir / f"{n}.jsonl").open("w") as f:
                for rec in r.records:
                    f.write(json.dumps(rec) + "\n")
        log(f"wrote {output_dir}/results.json")
    print(json.dumps(doc), flush=True)
