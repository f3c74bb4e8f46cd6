"""The engine's CPU fast path: prepacked weights and a small C++/AVX2 kernel
(``csrc/small_gemm.cpp``) for every matrix product (prefill, decode steps, verification)
and for float32 RMSNorm, on one persistent pool of threads (csrc ``par_for``; :func:`set_threads`).

Why (measured on the 2-core AVX2 EPYC this project runs on; docs/engine.md, "The kernel"):
``F.linear`` with one row reads the 49152 x 576 LM head at about 11 GB/s and costs
twice that for two rows; the kernel reads it at 27-33 GB/s, and for up to about
four rows the extra rows cost FMAs, not memory traffic.

Invariants:

* **batch invariance**: for every row count the kernel gives each row bit-identical
  outputs, wherever it sits in the batch, so the matrix products
  of a k-row verification forward match k one-row decode steps exactly (attention and
  the norms still may differ in the last bit: at most 1e-6 on the tiny test models,
  tests/test_kernels.py). Prompt prefill goes through the kernel too: at 100-800 rows it
  ran at 107-113 GFLOP/s on one core against MKL's 84-104 (docs/engine.md), and a prefilled
  row's products then equal a decoded row's.
* the kernel changes fp32 logits only by summation order (a single FMA chain per
  output instead of the BLAS blocking): 4e-5 to 5e-5 on SmolLM2's logits, reported by
  ``selfspec profile`` as ``kernel_max_logit_diff``.
* float panels hold float32, bfloat16 or float16 weights (16-bit panels: a bf16/fp16 target,
  engine/target.py; widened exactly, so a row's products equal fp32 panels' of the same values);
  quantized panels (:class:`QLinear`) hold 8-bit, 6-bit (GGUF Q6_K) or 4-bit codes with float32 or float16
  scales, or a K-quant's scales as their factors (float16 d per 256 weights, an integer per group: the same
  float32 products, formed in the kernel), and only their packed form; :class:`A8Linear` multiplies a QLinear's own 4-bit codes by int8-rounded
  activations (a draft's product, deterministic and batch-invariant, not the target's arithmetic).
* without a C++ compiler, AVX2/FMA, or on a GPU, every call is plain ``F.linear``
  (same results as before this module existed); ``SELFSPEC_KERNELS=0`` forces that.
* the extension is compiled once per machine (64 s on the 2-core AVX-512 EPYC, 151 s on a 2-core AVX2
  EPYC; ``make setup`` does it) into
  ``kernels/`` of selfspec's cache (:func:`selfspec_cli.paths.cache_root`) and loaded from
  there afterwards (well under a second); packing costs one copy of the weights, once per model load.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..paths import cache_root

_SOURCE = Path(__file__).with_name("csrc") / "small_gemm.cpp"
_lock = threading.Lock()
_state: dict[str, Any] = {}


def cache_dir() -> Path:
    """Where the compiled kernel lives: ``kernels/`` of selfspec's cache (:func:`selfspec_cli.paths.cache_root`)."""
    return cache_root() / "kernels"


_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def source_tag() -> str:
    """The sha256 tag of the kernel's source file (its path and bytes) and its compiler flags."""
    return hashlib.sha256(str(_SOURCE.resolve()).encode() + _SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:12]


def build_id() -> str:
    """The compiled kernel's identity and the name of its build directory in :func:`cache_dir`: one
    build per source file (:func:`source_tag`) and torch version, so that two checkouts sharing the
    cache never load, or rebuild over, each other's extension (the cost store keys on it too:
    decoding/cost_store.py)."""
    return f"torch-{torch.__version__}-{source_tag()}"


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the fast path cannot run here, or None when it can."""
    if os.environ.get("SELFSPEC_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return "disabled by SELFSPEC_KERNELS=0"
    if device is not None and device.type != "cpu":
        return f"device {device.type} (the kernel is for CPUs)"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"CPU capability {cap} (the kernel needs AVX2 and FMA)"
    return None


def _built(build: Path, name: str) -> Any | None:
    """The extension already compiled in ``build`` (its name holds the source's hash and torch's version, so a
    library there is this source's), imported without asking ninja: ninja rebuilds one whose folder moved
    (a copied or restored cache: 1-3 minutes for nothing) and takes a tenth of a second to say it need not.
    None when there is none, or it does not load (a torn build): the caller builds."""
    import importlib.util

    so = build / f"{name}.so"
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module if hasattr(module, "qlinear") and hasattr(module, "linear") else None


def load_extension() -> Any | None:
    """Build (first time on this machine) or load the compiled kernel; None when it cannot
    be had, with the reason in :func:`status`."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        reason = unavailable_reason()
        module = None
        if reason is None:
            t0 = time.perf_counter()
            try:
                from torch.utils.cpp_extension import load

                build = cache_dir() / build_id()
                build.mkdir(parents=True, exist_ok=True)
                name = f"selfspec_small_gemm_{source_tag()}"
                module = _built(build, name)
                if module is None:
                    if not any(build.glob("*.so")):  # a fresh cache compiles it: a silent wait of 1-3 minutes otherwise
                        print(f"selfspec: building the C++ kernel for this machine into {build} (once per cache; "
                              "about 1-3 minutes)", file=sys.stderr, flush=True)
                    module = load(name=name, sources=[str(_SOURCE)], build_directory=str(build),
                                  extra_cflags=_CFLAGS)
            except Exception as exc:  # no compiler, no headers, a failed build: fall back, say why once
                reason = f"the C++ kernel could not be built ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''})"
                print(f"selfspec: {reason}; using F.linear (slower). Set SELFSPEC_KERNELS=0 to silence.", file=sys.stderr)
            _state["load_s"] = round(time.perf_counter() - t0, 3)
        _state.update(module=module, reason=reason)
        if module is not None:
            module.set_threads(_pool_threads(), -1, -1)
        return module


def _pool_threads() -> int:
    n = _state.get("threads")
    if n is None:  # a library caller that never chose: the CLI's default (engine/cores.py)
        from .cores import usable_cores

        n = _state["threads"] = usable_cores()
    return int(n)


def set_threads(n: int) -> None:
    """The kernel pool's size: ``n`` threads in all run every product, attention and row-wise op
    (csrc: ``par_for``; docs/engine.md, "Threads"). Token ids do not depend on it. Applied now if the
    kernel is loaded, else when it loads."""
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _state["threads"] = int(n)
    module = _state.get("module")
    if module is not None:
        module.set_threads(int(n), -1, -1)


def pool_threads() -> int:
    """The pool's size now (the value :func:`set_threads` last set, or the default it will get)."""
    return _pool_threads()


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of (R, N) logits, or of one (N,) row, as ``torch.argmax`` gives it (the first of equal
    maxima, the first NaN where there is one): the kernel's one pass (csrc ``argmax_rows``) on CPU float32, aten
    elsewhere. A greedy pick over SmolLM2's 49,152 logits: about 43 us in aten, and an OpenMP region for k rows."""
    rows = x if x.dim() == 2 else x.reshape(1, -1)
    module = _state.get("module")
    if module is None or rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.stride(-1) != 1:
        return rows.argmax(dim=-1).tolist()
    return module.argmax_rows(rows).tolist()


def status() -> dict[str, Any]:
    """What :func:`load_extension` found in this process (nothing is built here)."""
    return {"backend": "small_gemm" if _state.get("module") is not None else "torch",
            "reason": _state.get("reason"), "load_s": _state.get("load_s")}


@dataclass(slots=True)
class Linear:
    """``y = x W^T + b`` with ``W`` prepacked for the kernel when the fast path is on."""

    weight: torch.Tensor  # (N, K), the model's own tensor (kept: F.linear fallback, HF peers)
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    bias_f32: torch.Tensor | None
    module: Any
    n: int = 0  # outputs (the weight's rows): kept, since a released engine empties ``weight`` (panels only then)
    isa: str = "auto"  # the kernel's path: AVX-512 where the CPU has it, unless SELFSPEC_ISA=avx2 (the same bits)

    @classmethod
    def make(cls, weight: torch.Tensor, bias: torch.Tensor | None, module: Any | None,
             pack_dtype: torch.dtype | None = None) -> "Linear":
        """``pack_dtype`` bfloat16 or float16: panels of the weights rounded to it (half the bytes a step
        streams; exact when the weights are such values, as a bf16 or fp16 checkpoint's are), widened
        exactly in the kernel, so a row's products equal those of fp32 panels of the same values."""
        packed = bias_f32 = None
        if module is not None and weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu":
            packed = module.pack(weight.detach() if pack_dtype is None else weight.detach().to(pack_dtype))
            bias_f32 = None if bias is None else bias.detach().float().contiguous()
        return cls(weight, bias, packed, bias_f32, module, weight.shape[0], "avx2" if _avx2_forced() else "auto")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if x.dtype == torch.float32:  # the decode path: no float()/to() calls (about 1 % of a SmolLM2 step)
            return self.module.linear(x, self.packed, self.n, self.bias_f32, self.isa)
        return self.module.linear(x.float(), self.packed, self.n, self.bias_f32, self.isa).to(x.dtype)


SUPER = 256  # weights per GGUF K-quant super-block: the span of one factored scale's d (QuantWeight.d)


@dataclass(slots=True)
class QuantWeight:
    """A matrix as integer codes with per-group scales (and minimums): ``W[n, k] = scale[n, g] *
    codes[n, k] (+ mins[n, g])`` for ``g = k // group``. ``bits`` 8: signed codes; 4: codes in
    0..15, ``W = s q + m`` with minimums (GGUF Q4_1) or ``W = s (q - 8)`` without (GGUF Q4_0).

    Factored scales (GGUF K-quants; ``d`` not None): each scale is ``d[n, k // 256] * sc[n, g]`` and each
    minimum ``-(dmin[n, k // 256] * m[n, g])``, with ``d``, ``dmin`` float16 values and ``sc``, ``m`` integers
    of at most 8 bits, so the products are exact in float32: ``scales`` and ``mins`` hold them as those
    float32 values, and :class:`QLinear` streams the factors instead (a byte a group and 2 bytes per 256
    weights), computing the same float32 values in registers."""

    fmt: str
    codes: torch.Tensor  # (N, K) int8 (8-bit) or uint8 (4-bit)
    scales: torch.Tensor  # (N, K // group) float32
    mins: torch.Tensor | None  # (N, K // group) float32 or None
    group: int
    bits: int
    sc: torch.Tensor | None = None  # (N, K // group) int8: factored scales' integer factors
    m: torch.Tensor | None = None  # (N, K // group) int8: factored minimums' integer factors (with mins)
    d: torch.Tensor | None = None  # (N, K // 256) float32 of float16 values: factored scales' d
    dmin: torch.Tensor | None = None  # (N, K // 256) float32 of float16 values (with mins)

    @property
    def factored(self) -> bool:
        return self.d is not None

    def _parts(self) -> dict[str, torch.Tensor | None]:
        return {"codes": self.codes, "scales": self.scales, "mins": self.mins, "sc": self.sc, "m": self.m,
                "d": self.d, "dmin": self.dmin}

    def take_rows(self, order: torch.Tensor) -> "QuantWeight":
        """The rows ``order`` (factors and all)."""
        return QuantWeight(self.fmt, group=self.group, bits=self.bits,
                           **{k: None if t is None else t[order].contiguous() for k, t in self._parts().items()})

    @staticmethod
    def cat(parts: list["QuantWeight"], fmt: str) -> "QuantWeight":
        """Row-concatenation of weights of one layout; factored only where every part is."""
        first, fac = parts[0], all(p.factored for p in parts)
        cols = {k: None if first._parts()[k] is None or (k in ("sc", "m", "d", "dmin") and not fac)
                else torch.cat([p._parts()[k] for p in parts]) for k in first._parts()}
        return QuantWeight(fmt, group=first.group, bits=first.bits, **cols)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these codes stand for, computed as the file formats define them
        (``s * q``, or ``s * q + m`` with two roundings, as gguf-py does)."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // self.group, self.group)
        if self.bits == 4 and self.mins is None:  # Q4_0: d (q - 8)
            q = q - 8.0
        w = q * self.scales[:, :, None]
        if self.mins is not None:
            w = w + self.mins[:, :, None]
        return w.view(n, k)

    def half_scales(self) -> bool:
        """Whether every scale and minimum is a float16 value (the GGUF's blocks store them so)."""
        return all(t is None or torch.equal(t.half().float(), t) for t in (self.scales, self.mins))

    def nbytes(self) -> int:
        """Bytes a decode step streams: codes at their bit width plus scales and minimums (2 bytes each where
        all are float16 values, as :class:`QLinear` then stores them, else 4; factored: a byte a group and 2
        bytes per 256 weights, each)."""
        codes = (self.codes.numel() * self.bits) // 8
        if self.factored:
            return codes + (self.sc.numel() + 2 * self.d.numel()) * (2 if self.mins is not None else 1)
        per = 2 if self.half_scales() else 4
        return codes + per * self.scales.numel() * (2 if self.mins is not None else 1)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantWeight:
    """Symmetric round-to-nearest int8 with one scale per output channel (``group=None``) or per
    ``group`` input weights (``K`` not a multiple of ``group``: per channel): ``s = max|w| / 127``, ``q = round(w / s)``; every weight is then
    within ``s / 2`` of ``s q`` (tests/test_quant.py)."""
    w = w.detach().float()
    n, k = w.shape
    g = k if group is None or k % group else group
    blocks = w.view(n, k // g, g)
    scales = blocks.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, :, None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return QuantWeight("int8" if g == k else f"int8-g{g}", codes, scales.contiguous(), None, g, 8)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """(np * 64, K) codes 0..15 -> (np, K/8, 64, 4) bytes: dword [b, o] = sum_n q(o, 8b + n) << 4n."""
    pairs = u[:, 0::2] | (u[:, 1::2] << 4)  # byte i of a dword: codes 2i and 2i + 1
    # four consecutive bytes are one little-endian dword: (np, 64, K/8, 4) -> (np, K/8, 64, 4)
    return pairs.view(-1, 64, u.shape[1] // 8, 4).transpose(1, 2).contiguous()


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """(np, K/8, 64) int32 dwords of :func:`_pack_nibbles` -> (np * 64, K) int64 codes."""
    nib = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> (4 * torch.arange(8))) & 15  # (np, K/8, 64, 8)
    return nib.permute(0, 2, 1, 3).reshape(words.shape[0] * 64, -1)


# 6-bit codes (GGUF Q6_K, q in -32..31, u = q + 32): per 4 k, three lines of 16 dwords (csrc: decode6_512), byte b of
# dword i for k + b: line A holds lo(u) of outputs i and 16 + i in its low and high nibble, line B those of 32 + i and
# 48 + i, line C the four hi = u >> 4 of outputs i, 16 + i, 32 + i, 48 + i at bits 0, 2, 4, 6; (np, 3K/4, 64) bytes.
def _pack6(q: torch.Tensor) -> torch.Tensor:
    """(np * 64, K) int8 codes -32..31 -> (np, 3K/4, 64) bytes."""
    k = q.shape[1]
    u = (q + 32).view(torch.uint8).view(-1, 4, 16, k // 4, 4)  # (np, j, i, K/4, b); q + 32 is 0..63: no overflow
    lo, hi = u & 15, u >> 4
    lines = torch.stack([lo[:, 0] | (lo[:, 1] << 4), lo[:, 2] | (lo[:, 3] << 4),
                         hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)], dim=2)  # (np, i, 3, K/4, b)
    return lines.permute(0, 3, 2, 1, 4).contiguous().view(-1, 3 * k // 4, 64)  # (np, K/4, 3, i, b)


PACK_PANELS = 64  # super-panels (of 64 outputs) packed at a time: bounds the temporaries of a large matrix's packing


def _packed_codes(codes: torch.Tensor, bits: int, np_: int) -> torch.Tensor:
    """(N, K) codes (4-bit 0..15, or 6-bit int8 -32..31) -> (np, K/2 or 3K/4, 64) bytes, zero-padded outputs, packed
    PACK_PANELS super-panels at a time: each super-panel's bytes depend on its own 64 rows only, so the result is
    the whole matrix's packing, with temporaries of a few MB instead of several times the matrix (a 32,768-row
    Q6_K head subset took 0.37 GB above its own 41 MB)."""
    n, k = codes.shape
    out = torch.empty(np_, k // 2 if bits == 4 else 3 * k // 4, 64, dtype=torch.uint8)
    for p in range(0, np_, PACK_PANELS):
        q = min(PACK_PANELS, np_ - p)
        rows = codes[p * 64:(p + q) * 64]
        padded = torch.zeros(q * 64, k, dtype=torch.uint8 if bits == 4 else torch.int8)
        padded[:rows.shape[0]] = rows
        out[p:p + q] = _pack_nibbles(padded).view(q, k // 2, 64) if bits == 4 else _pack6(padded)
    return out


def _decode6(v: torch.Tensor, j: torch.Tensor | int) -> torch.Tensor:
    """(..., 3, 4) bytes (lines A, B, C of one dword, bytes b) of output group ``j`` (0..3, broadcast against
    ``...``) -> (..., 4) int8 codes of k + b."""
    v = v.to(torch.int16)
    j = torch.as_tensor(j, dtype=torch.int16)
    line = torch.where(j < 2, v[..., 0, :], v[..., 1, :])
    lo = (line >> (4 * (j % 2))) & 15
    hi = (v[..., 2, :] >> (2 * j)) & 3
    return (lo + 16 * hi - 32).to(torch.int8)


def _unpack6(codes: torch.Tensor, k: int) -> torch.Tensor:
    """(np, 3K/4, 64) bytes of :func:`_pack6` -> (np * 64, K) int8 codes."""
    v = codes.view(-1, k // 4, 3, 16, 4).permute(0, 3, 1, 2, 4)[:, None]  # (np, 1, i, K/4, 3, b)
    q = _decode6(v, torch.arange(4).view(1, 4, 1, 1, 1))  # (np, j, i, K/4, b)
    return q.reshape(-1, k)


@dataclass(slots=True)
class QLinear:
    """``y = x W^T + b`` over a :class:`QuantWeight`, packed for the kernel's ``qlinear``
    (csrc/small_gemm.cpp: 8-bit, 6-bit and 4-bit panels, per-group or factored scales, fp32 accumulation,
    batch-invariant; AVX-512 where the CPU has it, else AVX2). Only the packed form is held
    (:meth:`make` drops the unpacked codes): :attr:`quant` unpacks them again when asked (FR-Spec's
    subsets, the F.linear fallback, tests), so a copy costs its streamed bytes and no more."""

    meta: QuantWeight  # format, group, bits and sizes; its codes/scales/mins are empty placeholders
    bias: torch.Tensor | None
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    module: Any
    isa: str = "auto"
    out_features: int = 0
    _nbytes: int = 0

    @property
    def quant(self) -> QuantWeight:
        """The :class:`QuantWeight` these panels hold, unpacked from them (exactly: codes, and scales
        widened from float16 where they were stored so)."""
        n, m = self.out_features, self.meta
        k = self.codes.shape[1] * 8 // m.bits if m.bits in (4, 6) else self.codes.shape[1]

        def rows(t: torch.Tensor) -> torch.Tensor:  # (np, C, 64) -> (N, C)
            return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].contiguous()

        if m.bits == 4:
            codes = _unpack_nibbles(self.codes.view(torch.int32).view(-1, k // 8, 64))[:n].to(torch.uint8).contiguous()
        elif m.bits == 6:
            codes = _unpack6(self.codes, k)[:n].contiguous()
        else:
            codes = self.codes.view(torch.int8).transpose(1, 2).reshape(-1, k)[:n].contiguous()
        if self.scales.dim() == 4:  # factored: (np, K/256, 2 + G, 64) int8, d's float16 then the G integer lines
            g = SUPER // m.group

            def factors(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                ints = rows(t[:, :, 2:].reshape(t.shape[0], -1, 64))
                d = rows(t[:, :, :2].contiguous().view(torch.float16).reshape(t.shape[0], -1, 64)).float()
                return ints, d

            sc, d = factors(self.scales)
            scales = d.repeat_interleave(g, dim=1) * sc.float()  # exact: a float16 times an 8-bit integer
            mm = dmin = mins = None
            if self.mins is not None:
                mm, dmin = factors(self.mins)
                mins = -(dmin.repeat_interleave(g, dim=1) * mm.float())
            return QuantWeight(m.fmt, codes, scales, mins, m.group, m.bits, sc, mm, d, dmin)
        return QuantWeight(m.fmt, codes, rows(self.scales).float(), None if self.mins is None else rows(self.mins).float(),
                           m.group, m.bits)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` (T, K) of the matrix, read from the panels alone (a tied embedding's rows from
        its LM head's blocks) and computed as :meth:`QuantWeight.dequantize` computes them, whatever the format."""
        m, sp, lane = self.meta, ids // 64, ids % 64
        t, ng = len(ids), self.scales.shape[1] if self.scales.dim() == 3 else self.scales.shape[1] * SUPER // self.meta.group
        k = ng * m.group
        if m.bits == 8:
            q = self.codes.view(torch.int8)[sp, :, lane].float()
        elif m.bits == 4:
            words = self.codes.view(torch.int32).view(-1, k // 8, 64)[sp, :, lane].to(torch.int64) & 0xFFFFFFFF
            q = ((words[..., None] >> (4 * torch.arange(8))) & 15).reshape(t, k).float()
        else:
            v = self.codes.view(-1, k // 4, 3, 16, 4)[sp, :, :, lane % 16]  # (T, K/4, 3, b)
            q = _decode6(v, (lane // 16).view(-1, 1, 1)).reshape(t, k).float()

        def per_group(p: torch.Tensor) -> torch.Tensor:  # (T, K / group) float32 scales or minimums
            if p.dim() == 3:
                return p[sp, :, lane].float()
            g = SUPER // m.group
            ints = p[:, :, 2:][sp, :, :, lane].reshape(t, ng).float()
            halves = p[:, :, :2].reshape(p.shape[0], p.shape[1], 128)
            d = torch.stack([halves[sp, :, 2 * lane], halves[sp, :, 2 * lane + 1]], -1).view(torch.float16)[..., 0]
            return d.float().repeat_interleave(g, dim=1) * ints

        q = q.view(t, ng, m.group)
        if m.bits == 4 and self.mins is None:
            q = q - 8.0
        w = q * per_group(self.scales)[:, :, None]
        if self.mins is not None:
            mins = per_group(self.mins)
            w = w + (-mins if self.mins.dim() == 4 else mins)[:, :, None]
        return w.view(t, k)

    @classmethod
    def make(cls, quant: QuantWeight, bias: torch.Tensor | None, module: Any) -> "QLinear":
        n, k = quant.codes.shape
        np_ = (n + 63) // 64

        def panels(t: torch.Tensor) -> torch.Tensor:  # (N, C) -> (np, C, 64), zero-padded outputs
            padded = t.new_zeros(np_ * 64, t.shape[1])
            padded[:n] = t
            return padded.view(np_, 64, t.shape[1]).transpose(1, 2).contiguous()

        if quant.bits in (4, 6):  # 4-bit: dword [b, o] = sum_n q(o, 8b + n) << 4n, as (np, K/2, 64) bytes (csrc: qlinear)
            codes = _packed_codes(quant.codes, quant.bits, np_)
        else:
            codes = panels(quant.codes).view(torch.uint8)
        if quant.factored:  # (np, K/256, 2 + G, 64) int8: per super-block d's float16, then G lines of factors
            g = SUPER // quant.group

            def factored(ints: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
                lines = panels(ints.to(torch.int8)).view(np_, -1, g, 64)
                halves = panels(d.to(torch.float16)).view(torch.int8).view(np_, -1, 2, 64)
                return torch.cat([halves, lines], dim=2).contiguous()

            return cls.from_panels(quant.fmt, quant.group, quant.bits, codes, factored(quant.sc, quant.d),
                                   factored(quant.m, quant.dmin) if quant.mins is not None else None, bias, module, n,
                                   quant.nbytes())
        # float16 scales (and minimums) where each is a float16 value, as the GGUF's blocks store them: 2 bytes
        # a group less to stream, widened exactly in the kernel
        sdt = torch.float16 if quant.half_scales() else torch.float32
        return cls.from_panels(quant.fmt, quant.group, quant.bits, codes, panels(quant.scales.to(sdt)),
                               panels(quant.mins.to(sdt)) if quant.mins is not None else None, bias, module, n, quant.nbytes())

    @classmethod
    def from_panels(cls, fmt: str, group: int, bits: int, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor | None, bias: torch.Tensor | None, module: Any, out_features: int,
                    nbytes: int) -> "QLinear":
        """A product over panels already packed as :meth:`make` packs them (the draft cache stores them so,
        engine/quant.py): nothing is repacked."""
        empty = torch.empty(0)
        meta = QuantWeight(fmt, empty, empty, None, group, bits)
        return cls(meta, None if bias is None else bias.detach().float().contiguous(), codes, scales, mins, module,
                   "avx2" if _avx2_forced() else "auto", out_features, nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is None or x.dim() != 2:
            return F.linear(x.float(), self.quant.dequantize(), self.bias).to(x.dtype)
        y = self.module.qlinear(x if x.dtype == torch.float32 else x.float(), self.codes, self.scales, self.mins,
                                self.out_features, self.meta.group, self.meta.bits, self.bias, self.isa)
        return y if x.dtype == torch.float32 else y.to(x.dtype)  # fp32 rows: no to() call on the draft's path


@dataclass(slots=True)
class A8Linear:
    """The int8-activation product (W4A8, csrc ``qlinear_a8``) over a :class:`QLinear`'s own 4-bit codes:
    a draft for the block target that streams the same bytes with several times fewer instructions per
    weight, and holds nothing of its own. Each row's x is rounded to int8 per weight group, so it is not
    the target's arithmetic; it is deterministic and batch-invariant. 8-bit matrices (Q8_0) keep the
    float path."""

    base: QLinear

    @property
    def quant(self) -> QuantWeight:
        return self.base.quant

    @property
    def meta(self) -> QuantWeight:
        return self.base.meta

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b = self.base
        if b.module is None or x.dim() != 2 or b.meta.bits != 4:
            return b(x)
        y = b.module.qlinear_a8(x if x.dtype == torch.float32 else x.float(), b.codes, b.scales, b.mins,
                                b.out_features, b.meta.group, b.bias, b.isa)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


@dataclass(slots=True)
class PartsLinear:
    """Products side by side: a fused matrix (q/k/v) whose parts a GGUF stores in blocks of different layouts
    (a Q4_K_M file's Q4_K q/k with a Q6_K v), each part its own :class:`QLinear` (or :class:`A8Linear`) over its
    own blocks, outputs concatenated. Each output keeps its part's chain, so the product stays exact and
    batch-invariant like its parts; csrc's ``mat_parts`` runs it inside a DecoderStack."""

    parts: list[Any]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def meta(self) -> QuantWeight:
        """The parts' format names joined (``q4_k|q6_k``); group and bits of the first part."""
        first = self.parts[0].meta
        empty = torch.empty(0)
        return QuantWeight("|".join(dict.fromkeys(p.meta.fmt for p in self.parts)), empty, empty, None, first.group,
                           first.bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def stream_bytes(lin: Linear | QLinear | A8Linear | PartsLinear) -> int:
    """Bytes one call reads of a matrix: its codes, scales and minimums, its packed panels (bf16
    panels: 2 per weight), or the weight tensor itself on the F.linear path."""
    if isinstance(lin, PartsLinear):
        return sum(stream_bytes(p) for p in lin.parts)
    if isinstance(lin, A8Linear):
        lin = lin.base  # the same codes
    if isinstance(lin, QLinear):
        return lin._nbytes
    t = lin.packed if lin.packed is not None else lin.weight
    return t.numel() * t.element_size()


def _avx2_forced() -> bool:
    return os.environ.get("SELFSPEC_ISA", "").strip().lower() == "avx2"


def isa() -> str | None:
    """The instruction set the kernels (quantized and float panels) use on this CPU ("avx512" or "avx2"), or None
    without the kernel. ``SELFSPEC_ISA=avx2`` forces the AVX2 path on an AVX-512 CPU."""
    module = load_extension()
    return None if module is None else "avx2" if _avx2_forced() else module.qisa()


def main() -> None:
    """Build the kernel now; ``make setup`` runs this."""
    t0 = time.perf_counter()
    if load_extension() is None:
        print(f"selfspec kernels: not built ({status()['reason']}); the engine uses F.linear", file=sys.stderr)
    else:
        print(f"selfspec kernels: ready in {time.perf_counter() - t0:.1f} s ({cache_dir()})", file=sys.stderr)


if __name__ == "__main__":
    main()
