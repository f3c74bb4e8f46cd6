"""The target's weights: which copy of a model's matrices plain decoding and verification read.

A speedup only means something against the fastest exact plain decoding of the same weights,
so the target reads the weights as the checkpoint stores them (docs/engine.md, "The target's
weights"; ``--target-precision``):

* ``gguf``: the GGUF file's own blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; engine/quant.py)
  through the ``qlinear`` kernel, for a
  model converted from a GGUF whose fp32 weights are those blocks exactly (checked matrix by
  matrix, as the block draft is). A tensor of a type the kernel does not take stays a float
  matrix (``fp32_fallback``; 16-bit panels where its values allow, as an F16 or BF16 tensor's do), so the target's weights are still the file's;
* ``bf16``: bfloat16 weight panels (half the bytes of fp32), float32 activations and
  accumulation. Exact for a bfloat16 checkpoint loaded as float32 (every weight is a bf16
  value); for other weights it rounds them (``rounded_matrices`` says how many), which is then
  another target, chosen explicitly;
* ``fp16``: the same with float16 panels (a float16 checkpoint's own values);
* ``fp32``: the float32 tensors as loaded;
* ``auto``: the checkpoint's own storage: ``gguf`` when the blocks are the weights, else ``bf16``
  when every matrix holds bf16 values, else ``fp16`` when every one holds float16 values, else ``fp32``.

``None`` (the library's default) keeps the weights as loaded, in whatever dtype.

Invariants:

* the block and bf16 kernels keep one FMA chain per output in a fixed order, so a k-row
  verification on any target equals k one-row steps bit for bit (tests/test_target.py);
* a ``bf16`` target of bf16-valued weights gives the very bits of the fp32 target (bf16 widens
  to fp32 exactly inside the kernel), so its tokens are the fp32 target's;
* without the CPU kernel (no AVX2, a GPU, ``SELFSPEC_KERNELS=0``) only the weights as loaded
  can be the target: ``auto`` resolves to them, an explicit ``gguf``/``bf16`` is refused.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from .adapter import LINEARS
from .quant import GGUFDraftError

if TYPE_CHECKING:
    from .runner import Engine

TARGET_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "gguf")
PANEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # targets packed as 16-bit float panels
QUANT_TARGETS = ("gguf",)  # targets read from a quantized copy (engine.quantized(...))
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16-model", torch.float16: "fp16-model"}


def _matrices(engine: Engine) -> list[torch.Tensor]:
    a = engine.adapter
    return [getattr(w, f"w_{n}") for w in a.layers for n in LINEARS] + [a.lm_head]


def _exact(w: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(w.to(dtype).float(), w))


def _blocks(engine: Engine) -> tuple[str | None, dict[str, Any]]:
    """``gguf`` when the model's GGUF blocks are its weights (fallback matrices named), else None and why."""
    try:
        d = engine.quantized("gguf")
    except GGUFDraftError as exc:
        return None, {"gguf": str(exc)}
    if not d.info.get("exact_matrices", 1):  # an F32/F16 file: no block the kernel takes
        return None, {"gguf": "the GGUF file holds no block type the kernel takes (" + ", ".join(d.info.get("types", [])) + ")"}
    return "gguf", {"fp32_fallback": list(d.info.get("int8_fallback", []))}


def _auto(engine: Engine, kernel: bool, loaded: str, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``auto``'s target: the weights as loaded without the kernel, else the checkpoint's own storage (the GGUF
    blocks, then bf16, then fp16 values, then fp32)."""
    if not kernel:
        return loaded, {**info, "why": "the weights as loaded (no CPU kernel for block or bf16 panels, "
                                       "or a model not loaded in float32)"}
    got, extra = _blocks(engine)
    if got is not None:
        return got, {**info, **extra, "why": "the GGUF file's own blocks are the model's weights"}
    for name, dt in PANEL_DTYPES.items():
        if all(_exact(w, dt) for w in _matrices(engine)):
            return name, {**info, "why": f"every matrix holds {dt} values (a {name} checkpoint)"}
    return "fp32", {**info, "why": "float32 weights that bf16 and fp16 would round"}


def resolve_target(engine: Engine, asked: str | None) -> tuple[str, dict[str, Any]]:
    """(the target precision, what decided it) for ``asked`` (see the module docstring).
    Raises :class:`ConfigError` for an explicit precision this engine cannot run."""
    loaded = _NAMES.get(engine.dtype, str(engine.dtype).removeprefix("torch."))
    if asked is None:
        return loaded, {"asked": None}
    if asked not in TARGET_PRECISIONS:
        raise ConfigError(f"unknown target precision '{asked}'; choose one of: {', '.join(TARGET_PRECISIONS)}")
    info: dict[str, Any] = {"asked": asked}
    kernel = engine._module is not None and engine.dtype == torch.float32
    if asked == "auto":
        return _auto(engine, kernel, loaded, info)
    if asked == "fp32":
        if engine.dtype != torch.float32:
            raise ConfigError(f"--target-precision fp32 needs the model loaded in float32 (it is {engine.dtype}); "
                              "pass --dtype float32")
        return "fp32", info
    if not kernel:
        raise ConfigError(f"--target-precision {asked} needs the CPU kernel and a model loaded in float32 "
                          f"({engine._kernel_reason or engine.dtype}); use --target-precision auto or fp32")
    if asked == "gguf":
        got, extra = _blocks(engine)
        if got is None:
            raise ConfigError(f"--target-precision gguf: {extra['gguf']}; use --target-precision auto")
        return got, {**info, **extra}
    rounded = sum(not _exact(w, PANEL_DTYPES[asked]) for w in _matrices(engine))
    return asked, {**info, "rounded_matrices": rounded}


def target_linears(engine: Engine, precision: str) -> tuple[list[dict[str, Any]], Any]:
    """The block target's matrix products: the copy's blocks, with float panels (16-bit where exact,
    else float32) for the matrices whose GGUF type the kernel does not take as blocks (the copy holds
    int8 stand-ins for those, which are not the model's weights)."""
    from .kernels import Linear

    d = engine.quantized(precision)
    a = engine.adapter

    def pick(q: Any, weight: Callable[[], torch.Tensor], b: torch.Tensor | None) -> Any:
        if q.meta.fmt != "int8":
            return q
        w = weight()  # read (and q/k/v fused) only here: a block matrix never needs the float copy
        # a GGUF type the kernel does not take as blocks (F16, BF16, ...) or a fused matrix of mixed layouts:
        # float panels, 16-bit where every weight is such a value (an F16/BF16 tensor's are), else fp32
        exact = next((dt for dt in PANEL_DTYPES.values() if _exact(w, dt)), None)
        return Linear.make(w, b, engine._module, exact)

    layers = [{n: pick(d.layers[l][n], lambda l=l, n=n: a.float_matrix(l, n), getattr(w, f"b_{n}")) for n in LINEARS}
              for l, w in enumerate(a.layers)]
    return layers, pick(d.head, lambda: a.lm_head, None)
