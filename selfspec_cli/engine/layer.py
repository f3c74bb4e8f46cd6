"""What one decoder layer computes, written once: :func:`decoder_layer`.

Every family the engine runs (engine/adapter.py ``FAMILIES``: Llama, Mistral, Qwen2, Qwen3, Gemma 3,
Phi-3) is this one layer over the data of its :class:`~.adapter.LayerWeights`; the families differ by
data (biases present or not, per-head q/k norms, norms after the sublayers, the activation, the
rotary table and the window of each layer), never by code::

    attention sublayer (skipped: adds nothing, writes no K/V)
        x   = norm(h, attn_norm)
        qkv = linear(qkv)(x)                       # q, k, v heads side by side; biases where the layer has them
        hd  = heads(qkv)                           # q/k per-head RMSNorm (qk_norm), then the layer's rotary
        o   = attend(hd)                           # K/V appended to the cache; attention over what the row may
                                                   # see (causal or a tree's mask; the layer's sliding window)
        o   = linear(o)(o)
        o   = norm(o, post_attn_norm)              # Gemma 3 only
        h   = h + o
    MLP sublayer (skipped: adds nothing)
        x   = norm(h, mlp_norm)
        m   = linear(down)(act(gate) * up)         # gate, up = linear(gate_up)(x); SwiGLU, or GeGLU (tanh gelu)
        m   = norm(m, post_mlp_norm)               # Gemma 3 only
        h   = h + m

How each step runs is a backend's (:class:`LayerOps`): the op-by-op loop of
:meth:`~.runner.Engine._forward` (the CPU kernel's products, norms, rotary and attention, or aten's),
and the fixed-shape forward of a GPU (:meth:`~.runner.Engine.fixed_forward`, engine/sublayers.py's pure
pieces, whole-buffer attention). The one-call C++ forward (csrc ``DecoderStack``) runs this same sequence
in one call for up to 64 rows. tests/test_one_layer.py checks every backend against :func:`decoder_layer`
on every family's tiny config: the C++ forward bit for bit, the fixed-shape forward to rounding (it sums
attention over the whole buffer).

Invariants:

* **one definition.** No backend orders a layer's steps itself: it supplies the steps; the sequence and
  the residual adds are here.
* **row-wise.** Every step acts on each row alone, except ``attend`` (which reads the cache and the
  rows before it), so a backend whose ops are row-wise keeps a k-row forward equal to k one-row steps.
* **taps, not arguments.** What a drafter reads from inside a layer comes through a backend's
  ``after_attention`` tap (ASD's attention cosine) or what the forward returns (hidden states by layer),
  so a new need adds a tap, not a parameter of this function.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # typing only: adapter imports nothing from here
    from .adapter import LayerWeights


class LayerOps(Protocol):
    """The steps of a layer, as one backend runs them (see the module docstring)."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each row of ``x`` with ``weight`` (the model's epsilon)."""

    def linear(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s product ``name`` (adapter.LINEARS: qkv, o, gate_up, down) of the rows ``x``, bias added."""

    def heads(self, w: LayerWeights, qkv: torch.Tensor) -> Any:
        """The q/k heads of ``qkv``, per-head normed where ``w.qk_norm`` is set, rotated by ``w``'s rotary
        table, and the v heads: in whatever form this backend's ``attend`` takes."""

    def attend(self, layer: int, w: LayerWeights, heads: Any) -> torch.Tensor:
        """Write the rows' K/V into the cache and attend: the heads' outputs, (T, Hq D)."""

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the gate/up product's two halves (SwiGLU, or GeGLU for Gemma 3)."""

    def after_attention(self, layer: int, before: torch.Tensor, after: torch.Tensor | None) -> None:
        """The tap after the attention sublayer: the residual stream before and after it (``after`` None:
        the sublayer was skipped)."""


def attention_sublayer(h: torch.Tensor, layer: int, w: LayerWeights, ops: LayerOps) -> torch.Tensor:
    """The residual stream after layer ``layer``'s attention sublayer."""
    o = ops.attend(layer, w, ops.heads(w, ops.linear(layer, "qkv", ops.norm(h, w.attn_norm))))
    o = ops.linear(layer, "o", o)
    if w.post_attn_norm is not None:
        o = ops.norm(o, w.post_attn_norm)
    return h + o


def mlp_sublayer(h: torch.Tensor, layer: int, w: LayerWeights, ops: LayerOps) -> torch.Tensor:
    """The residual stream after layer ``layer``'s MLP sublayer."""
    m = ops.linear(layer, "down", ops.glu(ops.linear(layer, "gate_up", ops.norm(h, w.mlp_norm))))
    if w.post_mlp_norm is not None:
        m = ops.norm(m, w.post_mlp_norm)
    return h + m


def decoder_layer(h: torch.Tensor, layer: int, w: LayerWeights, ops: LayerOps, *, attention: bool = True,
                  mlp: bool = True) -> torch.Tensor:
    """The residual stream (T, H) after decoder layer ``layer`` (weights ``w``) on the rows ``h``; a sublayer
    turned off (a layer-skip draft's skip set) adds nothing, and a skipped attention writes no K/V."""
    if attention:
        before, h = h, attention_sublayer(h, layer, w, ops)
        ops.after_attention(layer, before, h)
    else:
        ops.after_attention(layer, h, None)
    if mlp:
        h = mlp_sublayer(h, layer, w, ops)
    return h
