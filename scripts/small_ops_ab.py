"""A/B in one process: the engine kernel's small ops (attend, rope_, silu_mul) on vs off, interleaved
(SmolLM2, fp32, 1 thread, 200-token context; T(1), v(4), v(8) medians of 15 rounds). Run: python scripts/small_ops_ab.py"""
import time, torch, statistics
torch.set_num_threads(1)
from selfspec_cli.loading import load_model
from selfspec_cli.engine.runner import Engine
m, tok = load_model(None)
e = Engine(m)
ops = e._ops
c = e.new_cache(512)
ctx = 200
e.forward(c, torch.randint(0, 40000, (ctx,), generator=torch.Generator().manual_seed(0)), positions=0)
toks = torch.randint(0, 40000, (16,))
def run(k):
    e.forward(c, toks[:k], positions=ctx, logits_rows=slice(None)); c.crop(ctx)
res = {}
for rnd in range(15):
    for on in (True, False):
        e._ops = ops if on else None
        for k in (1, 4, 8):
            t0 = time.perf_counter(); run(k); res.setdefault((on, k), []).append(time.perf_counter() - t0)
for on in (True, False):
    t1 = statistics.median(res[(on, 1)]) * 1e3
    print("small ops" if on else "aten ops ", f"T(1) {t1:.2f} ms", " ".join(f"v({k}) {statistics.median(res[(on, k)])*1e3/t1:.2f}" for k in (4, 8)))
