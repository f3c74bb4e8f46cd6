"""Does Self-SD calibration's objective rank skip sets the same way under load as on an idle machine?

Two objectives of ``selfspec calibrate --method self-sd``: measured throughput (each
prompt's fastest of ``--repeats`` passes) and the timing-free proxy (``--objective proxy``,
the default: predicted speedup from the decoded rounds' draft lengths, the draft cost from
weight bytes and the engine's verify curve). This script measures a fixed list of
candidates (plain decoding, uniform sets at several ratios, the shipped calibrated set and
seeded random sets) four ways, interleaved candidate by candidate, and computes the proxy
in every pass:

1. idle, fastest of 3 passes (the reference);
2. with a competing busy process (``python -c "while 1: pass"``), one pass;
3. with the competitor, fastest of 3 passes (what calibrate does);
4. idle again, fastest of 3 passes (how well an idle measurement reproduces its own ranking);

and prints the rank correlation (Spearman, Kendall) of 2, 3 and 4 and of the proxy (idle
and under load) against 1.

    python scripts/objective_ranking.py --model pystdlib --output docs/bench/objective-ranking.json
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from selfspec_cli.artifacts import environment_info, save_json_artifact
from selfspec_cli.methods.self_sd import SkipSet
from selfspec_cli.prompts import load_calibration_prompts
from selfspec_cli.methods.self_sd.measure import measure_ar, measure_self_sd
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.loading import load_model
from selfspec_cli.methods.self_sd.study import uniform_layers
from selfspec_cli.runtime import encode_turn, eos_token_ids


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0.0] * len(values)
    for pos, i in enumerate(order):
        r[i] = float(pos)
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def kendall(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1)
    return s / (n * (n - 1) / 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pystdlib")
    ap.add_argument("--prompts", default="examples/calibration.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32)
    ap.add_argument("--random-sets", type=int, default=3)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model, tok = load_model(args.model)
    engine = Engine(model)
    L = engine.num_layers
    texts = load_calibration_prompts(args.prompts, None, "prompt", args.num_prompts, "auto")
    ids = [encode_turn(tok, [{"role": "user", "content": t}], True) for t in texts]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(model, tok))

    cands: dict[str, tuple[frozenset[int], frozenset[int]] | None] = {"ar": None}
    for r in (0.1, 0.2, 0.3, 0.45, 0.6):
        u = uniform_layers(L, r)
        cands[f"uniform-{r:g}"] = (u, u)
    try:
        skip = SkipSet.load(None, model)
        sa, sm = skip.attn, skip.mlp
        cands["calibrated"] = (sa, sm)
    except Exception as exc:  # noqa: BLE001 - a model without an artifact still gets the others
        print(f"no calibrated set: {exc}", file=sys.stderr)
    rng = random.Random(0)
    for i in range(args.random_sets):
        k = rng.randint(L // 4, L)
        sub = [rng.randrange(2 * L) for _ in range(k)]
        cands[f"random-{i}"] = (frozenset(s for s in sub if s < L), frozenset(s - L for s in sub if s >= L))

    proxies: dict[str, dict[str, float]] = {}

    def run(repeats: int, label: str) -> dict[str, float]:
        out = {}
        for name, sets in cands.items():
            m = measure_ar(engine, tok, ids, cfg, repeats) if sets is None else \
                measure_self_sd(engine, tok, ids, cfg, sets[0], sets[1], repeats=repeats)
            out[name] = m.tokens_per_s
            proxies.setdefault(label, {})[name] = 1.0 if m.proxy is None else m.proxy
            print(f"  {name}: {out[name]:.1f} tok/s, proxy {proxies[label][name]:.3f}", file=sys.stderr, flush=True)
        return out

    print("idle, fastest of 3", file=sys.stderr)
    idle = run(3, "idle")
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        print("busy, 1 pass", file=sys.stderr)
        busy1 = run(1, "busy")
        print("busy, fastest of 3", file=sys.stderr)
        busy3 = run(3, "busy3")
    finally:
        busy.kill()
        busy.wait()
    print("idle again, fastest of 3", file=sys.stderr)
    idle2 = run(3, "idle2")
    names = list(cands)
    ref = [idle[n] for n in names]
    proxy_idle, proxy_busy = proxies["idle"], proxies["busy"]
    result = {
        "model": args.model, "prompts": args.prompts, "num_prompts": len(ids), "max_new_tokens": args.max_new_tokens,
        "candidates": {n: {"idle_min3": idle[n], "busy_1pass": busy1[n], "busy_min3": busy3[n],
                           "idle_again_min3": idle2[n], "proxy_idle": proxy_idle[n], "proxy_busy": proxy_busy[n]}
                       for n in names},
        "spearman": {k: spearman(ref, [v[n] for n in names])
                     for k, v in (("busy_1pass", busy1), ("busy_min3", busy3), ("idle_again_min3", idle2),
                                 ("proxy_idle", proxy_idle), ("proxy_busy", proxy_busy))},
        "kendall": {k: kendall(ref, [v[n] for n in names])
                    for k, v in (("busy_1pass", busy1), ("busy_min3", busy3), ("idle_again_min3", idle2),
                                 ("proxy_idle", proxy_idle), ("proxy_busy", proxy_busy))},
        "ranking": {k: sorted(names, key=lambda n: -v[n])
                    for k, v in (("idle_min3", idle), ("busy_1pass", busy1), ("busy_min3", busy3), ("idle_again_min3", idle2),
                                           ("proxy_idle", proxy_idle), ("proxy_busy", proxy_busy))},
        "environment": environment_info(engine.device, engine.dtype),
    }
    print(json.dumps({k: result[k] for k in ("spearman", "kendall", "ranking")}, indent=1))
    if args.output:
        save_json_artifact(args.output, result)


if __name__ == "__main__":
    main()
