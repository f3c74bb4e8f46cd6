"""T(1) and v(8) within one process, the weights' packed panels re-allocated between measurements (issue 23 (12)).

Run: python scripts/weight_placement.py  (default model, 1 thread, about 2 min; first run 2026-11-26)
"""
import gc, statistics, torch
torch.set_num_threads(1)
from selfspec_cli.loading import load_model
from selfspec_cli.engine import Engine, kernels
from selfspec_cli.decoding.measure import VerifyCurve
mdl, tok = load_model(None)
eng = Engine(mdl)
lins = [o for o in gc.get_objects() if isinstance(o, kernels.Linear) and o.packed is not None]
print("packed linears", len(lins), "MB", round(sum(l.packed.numel() * l.packed.element_size() for l in lins) / 1e6))
keep = []
for trial in range(6):
    a = [VerifyCurve.measure(eng) for _ in range(2)]
    print(f"placement {trial}: T(1) ms", [round(c.t1_s * 1e3, 2) for c in a], "v(8)", [round(c.ratios[8], 3) for c in a], flush=True)
    keep.append([l.packed for l in lins])  # hold the old panels so the new ones land elsewhere
    for l in lins:
        l.packed = l.packed.clone()
