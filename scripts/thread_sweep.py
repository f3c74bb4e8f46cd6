"""`ar` at several thread counts in one process: decode tok/s, prefill tok/s, T(1), v(k), the read bandwidth, and
whether the token ids are the same at every count (docs/benchmarks.md, "Many cores"; issue 48 asks for 1, 2, 4, 8
and 16 threads where a machine has them).

    python scripts/thread_sweep.py MODEL PROMPTS.jsonl [--threads 1,2,4,8,16] [-n 64] [--rounds 5]

One model load; for each thread count in turn (the kernel pool and torch resized by `session.apply_threads`):
  * the read bandwidth (`read_bandwidth_gbs`, the bench's probe) and the floor of the step's weight bytes;
  * T(1) and v(k) for k in 2, 4, 8: k-row forwards with logits at the first prompt's context, medians of
    `--rounds` interleaved rounds after a warm-up (as `selfspec profile` times them, without its cost store);
  * `ar` on every prompt (greedy, `-n` new tokens, EOS ignored): decode tok/s = (tokens - 1) / (verify seconds),
    prefill tok/s, and the token ids.
One JSON line per thread count on stdout; the table and the token check on stderr. Exit status 1 when the token
ids differ between two thread counts (they must not: docs/engine.md, "Threads").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default=None,
                    help="instead of the sweep: T(1) and the pool's loops a step for each thread count x chunks a "
                         "thread in this list (the pool's pool_chunks), 30 steps each")
    a = ap.parse_args()

    from selfspec_cli.cli.entry import set_wait_policy

    set_wait_policy([])  # torch's own threads sleep when idle, as under the `selfspec` command (before torch loads)
    import torch

    from selfspec_cli.bench.engine_profile import _median_times, read_bandwidth_gbs
    from selfspec_cli.config import GenerationConfig
    from selfspec_cli.decoding.measure import weight_bytes
    from selfspec_cli.engine import Engine
    from selfspec_cli.engine.cores import cores
    from selfspec_cli.loading import load_model
    from selfspec_cli.methods import METHODS
    from selfspec_cli.prompts import encode_turn, read_prompts
    from selfspec_cli.session import apply_threads

    counts = [int(t) for t in a.threads.split(",")]
    apply_threads(counts[0])
    t0 = time.perf_counter()
    model, tok = load_model(a.model, device="cpu", lite=True)  # as the CLI opens it: no transformers model, no float copy
    engine = Engine(model, target_precision="auto")  # the GGUF's own blocks, as the CLI runs them
    load_s = time.perf_counter() - t0
    prompts = [encode_turn(tok, [{"role": "user", "content": p.turns[0]}], True) for p in read_prompts(a.prompts)]
    wbytes = weight_bytes(engine)
    print(f"loaded in {load_s:.1f} s; {len(prompts)} prompts of {[len(p) for p in prompts]} tokens; "
          f"weights a step reads {wbytes / 1e6:.0f} MB; cores seen {cores()}", file=sys.stderr, flush=True)
    if a.chunks:
        return step_grid(engine, prompts[0], counts, [int(c) for c in a.chunks.split(",")], apply_threads)
    ar = METHODS["ar"](engine, tok)
    cfg = GenerationConfig(max_new_tokens=a.n, ignore_eos=True)
    ids = prompts[0]
    rows = (1, 2, 4, 8)
    results, tokens_at = [], {}
    for t in counts:
        apply_threads(t)
        bw = read_bandwidth_gbs()
        # T(1), v(k): k-row forwards with logits at the first prompt's context, interleaved rounds (profile's timer)
        cache = engine.new_cache(len(ids) + max(rows) + 1)
        engine.forward(cache, torch.tensor(ids), positions=0)
        toks = torch.tensor((ids * max(rows))[-max(rows):])
        jobs = {k: partial(engine.forward, cache, toks[:k], positions=len(ids), logits_rows=slice(None)) for k in rows}
        times = _median_times(engine, cache, len(ids), jobs, list(rows), a.rounds)
        t1 = times[1]
        ar.generate(prompts[0], GenerationConfig(max_new_tokens=4, ignore_eos=True))  # warm-up
        dec_tok = dec_s = pre_tok = pre_s = 0.0
        got = []
        for p in prompts:
            res = ar.generate(p, cfg)
            got.append(res.token_ids)
            dec_tok += len(res.token_ids) - 1
            dec_s += (res.stats.verify_s or 0.0) + (res.stats.draft_s or 0.0)
            pre_tok += len(p)
            pre_s += res.stats.prefill_s or 0.0
        tokens_at[t] = got
        row = {"threads": t, "bandwidth_gbs": round(bw, 2), "floor_ms": round(wbytes / bw / 1e6, 2),
               "step_ms": round(t1 * 1e3, 2), "step_over_floor": round(t1 * 1e3 / (wbytes / bw / 1e6), 3),
               "verify_cost": {str(k): round(times[k] / t1, 3) for k in rows[1:]},
               "decode_tok_s": round(dec_tok / dec_s, 2), "prefill_tok_s": round(pre_tok / pre_s, 2),
               "same_tokens_as_first": got == tokens_at[counts[0]]}
        results.append(row)
        print(json.dumps(row), flush=True)
        print(f"threads {t:3d}: bandwidth {bw:6.1f} GB/s  T(1) {row['step_ms']:7.2f} ms ({row['step_over_floor']:.2f}x floor)"
              f"  v(2,4,8) {row['verify_cost']}  decode {row['decode_tok_s']:7.2f} tok/s  prefill {row['prefill_tok_s']:7.1f}"
              f"  tokens same as {counts[0]} thread(s): {row['same_tokens_as_first']}", file=sys.stderr, flush=True)
    base = results[0]["decode_tok_s"]
    print("| threads | decode tok/s | x 1st | T(1) ms | T(1)/floor | v(4) | prefill tok/s | GB/s | same ids |",
          file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in results:
        print(f"| {r['threads']} | {r['decode_tok_s']} | {r['decode_tok_s'] / base:.2f} | {r['step_ms']} | "
              f"{r['step_over_floor']} | {r['verify_cost']['4']} | {r['prefill_tok_s']} | {r['bandwidth_gbs']} | "
              f"{r['same_tokens_as_first']} |", file=sys.stderr)
    return 0 if all(r["same_tokens_as_first"] for r in results) else 1


def step_grid(engine, ids, counts, chunks, apply_threads) -> int:
    """T(1) (median of 30 one-row steps at the prompt's context, after one) and parallel loops a step, per thread count
    and chunks a thread: where a many-core step's time goes when it stops scaling."""
    import torch

    from selfspec_cli.engine import kernels

    module = kernels.load_extension()
    from selfspec_cli.bench.engine_profile import _median_times

    cache = engine.new_cache(len(ids) + 2)
    engine.forward(cache, torch.tensor(ids), positions=0)
    step = {"step": partial(engine.forward, cache, torch.tensor(ids[-1:]), positions=len(ids))}
    for t in counts:
        apply_threads(t)
        for c in chunks:
            module.pool_chunks(c)
            loops0 = module.pool_loops()
            ms = _median_times(engine, cache, len(ids), step, ["step"], 30)["step"] * 1e3
            row = {"threads": t, "chunks_per_thread": c, "step_ms": round(ms, 3),
                   "loops_per_step": round((module.pool_loops() - loops0) / 31, 1)}
            print(json.dumps(row), flush=True)
            print(f"threads {t:3d} chunks {c}: T(1) {row['step_ms']:.3f} ms, {row['loops_per_step']} loops a step",
                  file=sys.stderr, flush=True)
    module.pool_chunks(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
