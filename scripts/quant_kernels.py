"""Matrix-product kernels for a quantized self-draft, timed side by side (docs/engine.md,
"Quantized drafts"): all 211 matrices of a SmolLM2-135M step (30 layers x q/k/v fused, o,
gate/up fused, down, and the 49152 x 576 LM head), one call each, one row (and four), one
thread, best of 5 passes. Random weights of the real shapes; what is timed is the kernel.

    python scripts/quant_kernels.py            # JSON on stdout

Contenders: fp32 F.linear and small_gemm; torch's CPU weight-only kernels
``_weight_int8pack_mm`` (int8 per channel) and ``_weight_int4pack_mm_for_cpu`` (int4, 32 per
group, scale and zero) with bf16 and fp32 activations; selfspec's ``qlinear`` int8 per channel,
int8 per 32, Q4_1, each on the CPU's own instruction set and on the AVX2 path.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from selfspec_cli.engine import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def best(fn, reps: int = 5) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return round(out * 1e3, 2)


def run(calls: list, rows: int, dtype=torch.float32) -> float:
    xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
    return best(lambda: [f(xs[k]) for (_, k), f in zip(SHAPES, calls)])


def main() -> None:
    torch.set_num_threads(1)
    m = kernels.load_extension()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]
    out: dict[str, dict[str, float | str]] = {}

    def record(name: str, calls: list, dtype=torch.float32) -> None:
        try:
            out[name] = {"1_row_ms": run(calls, 1, dtype), "4_rows_ms": run(calls, 4, dtype)}
        except Exception as exc:  # a kernel this torch build lacks
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        print(name, out[name], file=sys.stderr, flush=True)

    record("fp32 F.linear", [lambda x, w=w: F.linear(x, w) for w in ws])
    fp = [kernels.Linear.make(w, None, m) for w in ws]
    record("fp32 small_gemm", fp)
    del fp
    q8 = [kernels.quantize_int8(w) for w in ws]
    for dt, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        packs = [(q.codes, q.scales[:, 0].to(dt)) for q in q8]
        record(f"torch _weight_int8pack_mm ({label} x)",
               [lambda x, c=c, s=s: torch.ops.aten._weight_int8pack_mm(x, c, s) for c, s in packs], dt)
    try:
        int4 = []
        for w in ws:
            n, k = w.shape
            b = w.view(n, k // 32, 32)
            lo, hi = b.amin(-1), b.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            q = torch.round((b - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            zero = lo + 8 * scale  # tinygemm: w = (q - 8) * scale + zero
            int4.append((packed, torch.stack([scale, zero], -1).transpose(0, 1).contiguous()))
        for dt, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            record(f"torch _weight_int4pack_mm_for_cpu ({label} x)",
                   [lambda x, p=p, sz=sz.to(dt): torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)
                    for p, sz in int4], dt)
    except Exception as exc:  # noqa: BLE001
        out["torch _weight_int4pack_mm_for_cpu"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    try:  # torchao's weight-only configs (not a dependency: timed when importable)
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        configs = {"int8 weight-only": Int8WeightOnlyConfig()}
        try:
            from torchao.quantization import Int4WeightOnlyConfig

            configs["int4 weight-only, 32 per group"] = Int4WeightOnlyConfig(group_size=32, int4_packing_format="opaque")
        except Exception as exc:  # noqa: BLE001  (the CPU layout's name moves between releases)
            out["torchao int4 weight-only"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        for label, cfg in configs.items():
            for dt, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                try:
                    mods = [torch.nn.Linear(k, n, bias=False).to(dt) for n, k in SHAPES]
                    for mod, w in zip(mods, ws):
                        mod.weight.data.copy_(w.to(dt))
                        quantize_(mod, cfg)
                    with torch.inference_mode():
                        record(f"torchao {torchao.__version__} {label} ({dname} x)", mods, dt)
                except Exception as exc:  # noqa: BLE001
                    out[f"torchao {label} ({dname} x)"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    except ImportError:
        out["torchao"] = {"error": "not installed"}
    if m is not None:
        formats = {"qlinear int8 per channel": q8,
                   "qlinear int8 per 32": [kernels.quantize_int8(w, 32) for w in ws],
                   "qlinear Q4_1": [kernels.QuantWeight("q4_1", torch.randint(0, 16, w.shape, dtype=torch.uint8),
                                                        torch.rand(w.shape[0], w.shape[1] // 32),
                                                        torch.rand(w.shape[0], w.shape[1] // 32), 32, 4) for w in ws]}
        for name, qs in formats.items():
            lins = [kernels.QLinear.make(q, None, m) for q in qs]
            record(f"{name} ({m.qisa()})", lins)
            if m.qisa() == "avx512":
                for lin in lins:
                    lin.isa = "avx2"
                record(f"{name} (avx2 path)", lins)
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split() if sys.platform == "linux" else []
    print(json.dumps({"torch": torch.__version__, "threads": 1, "matrices": len(SHAPES),
                      "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "avx2", "fma", "avx_vnni"))),
                      "kernels": out}, indent=1))


if __name__ == "__main__":
    main()
