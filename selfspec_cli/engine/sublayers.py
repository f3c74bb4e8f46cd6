"""The fixed-shape forward's steps of a decoder layer as pure functions of tensors, optionally compiled
(engine/graphs.py, :meth:`~.runner.Engine.fixed_forward`; engine/layer.py orders them into a layer).

On a GPU a small model's step costs its kernel launches, about 35 per layer in eager PyTorch
(docs/benchmarks.md, "GPU"): an RMSNorm alone is five kernels, the rotary four. ``torch.compile``
fuses each step's element-wise work (the norm into one kernel, the per-head norms and the rotary
into one, SwiGLU's activation and product into one), so a captured CUDA graph replays fewer, larger
kernels. The matrix products (``F.linear``), the residual adds, the KV-cache writes and attention stay
outside: the compiled functions mutate nothing.

Invariants:

* **pure.** Every function reads only its arguments (tensors, and ints, floats and flags that are the
  same for every layer of a model) and returns new tensors, so one compiled graph serves every layer
  of one shape and every sublayer set: a skip set changes which functions run, not what they are.
* **one definition.** The eager fixed-shape forward (``SELFSPEC_COMPILE`` off, and the CPU tests) calls
  the same functions uncompiled, so the two differ only by the compiler's fusion and rounding.
* **batch invariance holds compiled.** The fixed-shape forward calls each function at one shape
  (``R`` rows), so the compiled kernels are one set: a row's result does not depend on the other rows,
  and a k-row verification equals k one-row steps bit for bit, compiled or not (tests/test_graphs.py).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary on heads ``qk`` (T, heads, D) with rows' tables (T, D): ``x cos + flip_halves(x) sin_signed``."""
    t, heads, d = qk.shape
    return qk * cos[:, None, :] + qk.view(t, heads, 2, d // 2).flip(2).view(t, heads, d) * sin[:, None, :]


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (R, H)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def heads(qkv: torch.Tensor, qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
          d: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k/v product's rows (R, (Hq + 2 Hkv) D) -> rotated q and k heads (R, Hq + Hkv, D) and the v
    heads (R, Hkv, D); per-head q/k norms first where the layer has them (Qwen3, Gemma 3: ``qk_norm``
    (Hq + Hkv, D))."""
    r, n = qkv.shape[0], hq + hkv
    v = qkv[:, n * d:].reshape(r, hkv, d)
    qk = qkv[:, :n * d].reshape(r, n, d)
    if qk_norm is not None:
        qk = F.rms_norm(qk, (d,), None, eps) * qk_norm
    return rotate(qk, cos, sin), v


def glu(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up``: SwiGLU, or GeGLU with the tanh approximation (Gemma 3)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def logits(h: torch.Tensor, norm: torch.Tensor, eps: float, w_head: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head: float32 logits (R, V)."""
    return F.linear(F.rms_norm(h, (h.shape[-1],), norm, eps), w_head).float()


RECOMPILE_LIMIT = 64  # compiled variants of one function a process keeps (model shapes x dtypes x optional tensors)


def compile_requested() -> bool:
    """``SELFSPEC_COMPILE=1``: compile the fixed-shape forward's sublayers (off by default: docs/engine.md,
    "On a GPU")."""
    return os.environ.get("SELFSPEC_COMPILE", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class Sublayers:
    """The pure steps a fixed-shape forward runs (engine/layer.py orders them), plain or compiled."""

    norm: Callable[..., torch.Tensor]
    heads: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    glu: Callable[..., torch.Tensor]
    logits: Callable[..., torch.Tensor]
    compiled: bool

    @classmethod
    def make(cls, compiled: bool) -> "Sublayers":
        fns = (norm, heads, glu, logits)
        if compiled:
            # one graph per function, model shape and dtype (and per optional tensor present or not): a handful
            # for one model, but every engine of a process shares a function's compiled graphs, so dynamo's
            # recompile limit (8) is raised for processes that load several models (the tests, the bench's
            # peers); no CUDA graphs of its own (graphs.py captures the whole forward); shapes static (R rows)
            import torch._dynamo  # noqa: PLC0415 (loaded only when compiling)

            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
            fns = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fns)
        return cls(*fns, compiled=compiled)
