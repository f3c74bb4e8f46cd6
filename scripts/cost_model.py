"""Why a layer-skipping draft does or does not pay off on this machine: measured costs.

Measures on one model (default: the shipped one), batch 1, greedy:
  * F: one full decode step (1 row through every layer, LM head included);
  * c(r): a draft step that skips a uniform share r of the sublayers, over F;
  * v(T): verifying T rows in one forward over a cached prefix, over F;
  * per-sublayer redundancy: teacher-forced top-1 agreement with the full model when only
    that sublayer is skipped, and the cosine between the residual stream before and after it;
  * teacher-forced matchness of the uniform set and the best of N random sets at several r;
  * the speedup ceiling of chain drafting: max over draft length k of
    E[tokens per round] / (k c(r) + v(k + 1)) with i.i.d. per-token acceptance alpha,
    E = 1 + alpha + ... + alpha^k (decoding/planning.py's one formula), for the measured matchness
    and for alpha = 1.

    python scripts/cost_model.py --out docs/cost_model.json --plot docs/img/cost_model.png
"""
from __future__ import annotations

import argparse
import json
import operator
import random
import statistics
import sys
import time
from itertools import accumulate
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selfspec_cli.bench.suite_loader import load_suite  # noqa: E402
from selfspec_cli.decoding.planning import expected_tokens, round_gain  # noqa: E402
from selfspec_cli.engine import Engine, ForwardTaps, Route  # noqa: E402
from selfspec_cli.loading import load_model  # noqa: E402


def timeit(fn, n: int, rounds: int = 5) -> float:
    """Median over rounds of the mean time of n calls (seconds)."""
    for _ in range(max(3, n // 10)):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def uniform(num_layers: int, r: float) -> tuple[frozenset[int], frozenset[int]]:
    """Skip round(r * 2L) sublayers spread evenly, attention and MLP alternating, never layer 0 or L-1."""
    pool = [(kind, l) for l in range(1, num_layers - 1) for kind in ("attn", "mlp")]
    k = round(r * 2 * num_layers)
    k = min(k, len(pool))
    idx = [round(i * (len(pool) - 1) / max(1, k - 1)) for i in range(k)] if k > 1 else ([len(pool) // 2] if k else [])
    chosen = [pool[i] for i in sorted(set(idx))]
    return (frozenset(l for kind, l in chosen if kind == "attn"), frozenset(l for kind, l in chosen if kind == "mlp"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--suite", default="pystdlib")
    ap.add_argument("--prompts", type=int, default=24, help="teacher-forcing texts from the suite")
    ap.add_argument("--random-sets", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--timing-from", type=Path, default=None,
                    help="reuse F, c(r), v(T) from an earlier run's JSON (measure only redundancy and matchness, "
                         "e.g. while other work shares the CPU and timings would be meaningless)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32", device="cpu")
    eng = Engine(model)
    L = eng.num_layers
    res: dict = {"model": str(model.config.name_or_path), "num_layers": L, "threads": torch.get_num_threads()}

    # ---- timing: F, c(r), v(T) over a 300-token cached prefix
    if args.timing_from is not None:
        old = json.loads(args.timing_from.read_text())
        res.update({k: old[k] for k in ("full_step_ms", "lm_head_share", "c", "v")})
        res["timing_from"] = str(args.timing_from)
    else:
        measure_timing(eng, L, res)
    matchness_and_ceilings(args, eng, tok, L, res)


def measure_timing(eng, L: int, res: dict) -> None:
    prefix = torch.randint(10, eng.vocab_size, (300,))
    cache = eng.new_cache(400)
    eng.forward(cache, prefix, positions=0)

    def step(t: int, sa=frozenset(), sm=frozenset(), rows=slice(-1, None)):
        ids = prefix[:t]
        route = Route(skip_attn=sa, skip_mlp=sm)

        def f():
            eng.forward(cache, ids, positions=300, route=route, logits_rows=rows)
            cache.crop(300)
        return f

    F = timeit(step(1), 200)
    res["full_step_ms"] = round(F * 1e3, 3)
    res["lm_head_share"] = round(timeit(step(1, frozenset(range(L)), frozenset(range(L))), 200) / F, 4)
    ratios = [0.25, 0.35, 0.45, 0.55, 0.65, 0.75]
    res["c"] = {}
    for r in ratios:
        sa, sm = uniform(L, r)
        res["c"][str(r)] = round(timeit(step(1, sa, sm), 200) / F, 4)
    res["v"] = {}
    for t in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
        res["v"][str(t)] = round(timeit(step(t, rows=slice(None)), 100) / F, 4)



def matchness_and_ceilings(args, eng, tok, L: int, res: dict) -> None:
    # ---- teacher-forced redundancy and matchness on suite texts
    prompts = load_suite(args.suite)
    rng = random.Random(0)
    texts = [p.turns[0] for p in rng.sample(prompts, min(args.prompts, len(prompts)))]
    seqs = [torch.tensor(tok(t)["input_ids"][:256]) for t in texts]

    def run(sa=frozenset(), sm=frozenset(), cos=False):
        outs = []
        for s in seqs:
            c = eng.new_cache(len(s) + 1)
            o = eng.forward(c, s, positions=0, route=Route(skip_attn=sa, skip_mlp=sm), logits_rows=slice(None),
                            taps=ForwardTaps(attn_cosine=cos))
            outs.append(o)
        return outs

    full = run(cos=True)
    targets = [o.logits.argmax(-1) for o in full]

    def matchness(sa, sm) -> float:
        outs = run(sa, sm)
        hit = sum(int((o.logits.argmax(-1) == t).sum()) for o, t in zip(outs, targets))
        return hit / sum(len(t) for t in targets)

    res["attn_cosine"] = [round(float(x), 4) for x in torch.stack([o.attn_cosine for o in full]).mean(0)]
    res["single_skip_agreement"] = {
        "attn": [round(matchness(frozenset([l]), frozenset()), 4) for l in range(L)],
        "mlp": [round(matchness(frozenset(), frozenset([l])), 4) for l in range(L)],
    }
    pool = [(kind, l) for l in range(1, L - 1) for kind in ("attn", "mlp")]
    res["matchness"] = {}
    for r in (0.25, 0.35, 0.45, 0.55):
        sa, sm = uniform(L, r)
        k = len(sa) + len(sm)
        best = 0.0
        for _ in range(args.random_sets):
            pick = rng.sample(pool, k)
            best = max(best, matchness(frozenset(l for kd, l in pick if kd == "attn"), frozenset(l for kd, l in pick if kd == "mlp")))
        res["matchness"][str(r)] = {"uniform": round(matchness(sa, sm), 4), f"best_of_{args.random_sets}_random": round(best, 4)}

    # ---- ceilings
    v = {int(k): x for k, x in res["v"].items()}

    def ceiling(alpha: float, c: float) -> tuple[float, int]:
        best = (0.0, 0)
        for k in range(1, 13):
            vk = v.get(k + 1) or v[min(v, key=lambda t: abs(t - (k + 1)))]
            e = expected_tokens(accumulate([alpha] * k, operator.mul))  # 1 + alpha + ... + alpha^k
            best = max(best, (round_gain(e, k * c + vk), k))
        return round(best[0], 3), best[1]

    res["ceiling"] = {}
    for r in (0.25, 0.35, 0.45, 0.55):
        c = res["c"][str(r)]
        m = res["matchness"][str(r)]
        a_best = max(m.values())
        res["ceiling"][str(r)] = {
            "alpha=best matchness": {"alpha": a_best, "speedup": ceiling(a_best, c)[0], "k": ceiling(a_best, c)[1]},
            "alpha=0.9": {"speedup": ceiling(0.9, c)[0], "k": ceiling(0.9, c)[1]},
            "alpha=1": {"speedup": ceiling(1.0, c)[0], "k": ceiling(1.0, c)[1]},
        }
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        ax = axes[0]
        ax.plot([float(r) for r in res["c"]], list(res["c"].values()), "o-", label="measured c(r)")
        ax.plot([0, 1], [1, 0], "--", color="gray", label="Eq. 6 assumption c = 1 - r")
        ax.set_xlabel("skipped share of sublayers r")
        ax.set_ylabel("draft step / full step")
        ax.legend(fontsize=8)
        ax = axes[1]
        ax.plot([int(t) for t in res["v"]], list(res["v"].values()), "o-", label="measured v(T)")
        ax.axhline(1, ls="--", color="gray", label="Eq. 6 assumption v = 1")
        ax.set_xlabel("rows verified in one forward T")
        ax.set_ylabel("verify forward / full step")
        ax.legend(fontsize=8)
        ax = axes[2]
        xs = range(L)
        ax.plot(xs, res["single_skip_agreement"]["attn"], "o-", label="skip only attn l")
        ax.plot(xs, res["single_skip_agreement"]["mlp"], "s-", label="skip only mlp l")
        ax.set_xlabel("layer l")
        ax.set_ylabel("teacher-forced top-1 agreement")
        ax.legend(fontsize=8)
        fig.suptitle(f"{Path(res['model']).name}: cost model on this machine ({res['threads']} threads)")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
