"""Greedy ``ar`` decoding throughput vs CPU threads, OpenMP wait policy and a competing busy process.

Reproduces the measurements behind the default of ``--threads`` (docs/engine.md, "Threads"; measured 2026-11-23).
Every configuration runs in a fresh subprocess, because OpenMP reads ``OMP_WAIT_POLICY``
once, when torch's OpenMP runtime (libgomp) is loaded:

* ``policy=default``: OMP_WAIT_POLICY unset and torch imported before selfspec_cli, so
  selfspec's own ``setdefault`` comes too late (what selfspec did before 2026-11-23);
* ``policy=passive``: OMP_WAIT_POLICY=PASSIVE in the environment (what selfspec sets now).

Configurations are interleaved (A B C ... A B C ...) so slow drifts in machine load hit
all of them alike; the table reports the median over repeats, and the worker reports
CPU seconds per wall second of decoding (``cpu/wall``): ~2 with two threads that spin,
nearer 1 when idle workers sleep, and CPU milliseconds per token (spinning shows up as
CPU burned per token: the check that PASSIVE takes effect, robust to other load). The competitor
is ``python -c "while 1: pass"``, started and killed by this script.

    python scripts/thread_bench.py [--model DIR] [-n 32] [--prompts 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [  # (label, threads, policy, interop)
    ("1 thread, default policy", 1, "default", None),
    ("2 threads, default policy", 2, "default", None),
    ("1 thread, PASSIVE", 1, "passive", None),
    ("2 threads, PASSIVE", 2, "passive", None),
    ("2 threads, PASSIVE, interop 1", 2, "passive", 1),
]


def worker(args: argparse.Namespace) -> None:
    import torch  # before selfspec_cli: with policy=default its setdefault of OMP_WAIT_POLICY is too late

    torch.set_num_threads(args.threads)
    if args.interop:
        torch.set_num_interop_threads(args.interop)
    sys.path.insert(0, str(ROOT))
    from selfspec_cli.config import GenerationConfig
    from selfspec_cli.engine import Engine
    from selfspec_cli.loading import load_model
    from selfspec_cli.methods import METHODS
    from selfspec_cli.prompts import read_prompts
    from selfspec_cli.runtime import encode_turn

    model, tok = load_model(args.model, device="cpu")
    prompts = [encode_turn(tok, [{"role": "user", "content": p.turns[0]}], True)
               for p in read_prompts(str(ROOT / "examples" / "prompts.jsonl"))[: args.prompts]]
    cfg = GenerationConfig(max_new_tokens=args.n, ignore_eos=True)
    method = METHODS["ar"](Engine(model), tok)
    method.generate(prompts[0], GenerationConfig(max_new_tokens=4, ignore_eos=True))  # warm-up
    t0, c0 = time.perf_counter(), os.times()
    tokens = sum(len(method.generate(p, cfg).token_ids) for p in prompts)
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps({"tokens_per_s": tokens / wall, "cpu_per_wall": cpu / wall, "cpu_ms_per_token": 1000 * cpu / tokens, "threads": torch.get_num_threads(),
                      "interop": torch.get_num_interop_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


def run_one(args: argparse.Namespace, threads: int, policy: str, interop: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "-n", str(args.n),
           "--prompts", str(args.prompts)] + (["--model", args.model] if args.model else [])
    cmd += ["--interop", str(interop)] if interop else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--interop", type=int, default=None)
    ap.add_argument("-n", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conditions", default="idle,busy", help="idle, busy (one competing busy-loop process), or both")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results: dict[tuple[str, str], list[dict]] = {}
    for cond in args.conditions.split(","):
        competitor = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if cond == "busy" else None
        try:
            for rep in range(args.repeats):
                for label, threads, policy, interop in CONFIGS:
                    r = run_one(args, threads, policy, interop)
                    r["load1"] = os.getloadavg()[0]
                    results.setdefault((cond, label), []).append(r)
                    print(f"{cond:5s} rep {rep} {label:32s} {r['tokens_per_s']:7.1f} tok/s  cpu/wall {r['cpu_per_wall']:.2f}"
                          f"  load {r['load1']:.2f}", file=sys.stderr, flush=True)
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
    print(f"model {args.model or 'shipped'}; {args.prompts} prompts x {args.n} tokens; median of {args.repeats}")
    print("| condition | configuration | tok/s (median) | min-max | CPU ms / token | cpu/wall | load avg |")
    print("|---|---|---|---|---|---|---|")
    for (cond, label), rs in results.items():
        tps = [r["tokens_per_s"] for r in rs]
        print(f"| {cond} | {label} | {statistics.median(tps):.1f} | {min(tps):.1f}-{max(tps):.1f} | "
              f"{statistics.median(r['cpu_ms_per_token'] for r in rs):.1f} | {statistics.median(r['cpu_per_wall'] for r in rs):.2f} | {statistics.median(r['load1'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
