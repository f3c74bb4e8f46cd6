"""The trained pieces of AdaDecode and SpecEE, as plain functions of tensors.

The same functions run in training (with autograd) and at inference (under
inference mode), so a head or a predictor sees exactly the same computation in
both places. Nothing here touches a cache or a decoding loop.

* :func:`head_logits` — AdaDecode's intermediate LM head at layer ``i``
  (Wei et al. 2025, §2.1: ``E^(i) = E* T^(i)``), with ``T^(i)`` parameterised as
  identity plus a rank-``r`` update applied before the *frozen* final LM head ``E*``:
  ``u = g ⊙ rmsnorm(h)``, ``logits = E* (u + B A u)``. With ``B = 0`` and ``g`` = the
  final norm's weight, the head is exactly the logit lens (the original head on the
  intermediate state), so training starts from it and learns a correction.
* :func:`specee_features` — SpecEE's 12 predictor features (Xu et al. 2025, §4.3.1):
  the 4 speculative-token logits ``s`` of the normalised state, their local
  probabilities ``q = softmax(s)`` and the change ``q - q_prev`` since the previous
  layer (``q`` itself at the first layer that has speculative tokens).
* :func:`exit_probability` — the per-layer predictor: Linear(12, 512), ReLU,
  Linear(512, 1), sigmoid.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_SPEC_TOKENS = 4
NUM_FEATURES = 3 * NUM_SPEC_TOKENS
PREDICTOR_HIDDEN = 512


@dataclass(frozen=True, slots=True)
class LowRankHead:
    """One intermediate head: ``a`` (r, d), ``b`` (d, r), ``g`` (d,)."""

    a: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LowRankHead:
        return LowRankHead(self.a.to(device, dtype), self.b.to(device, dtype), self.g.to(device, dtype))


def head_logits(h: torch.Tensor, head: LowRankHead, lm_head: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                eps: float) -> torch.Tensor:
    """(R, d) residual rows after the head's layer -> (R, V) logits of the head. ``lm_head`` is
    the (V, d) matrix, or the engine's prepacked LM head (``engine.lm_head``, same product)."""
    u = F.rms_norm(h, (h.shape[-1],), head.g, eps)
    u = u + F.linear(F.linear(u, head.a), head.b)  # the corrected normalised state u + B A u, before E*
    return lm_head(u) if callable(lm_head) else F.linear(u, lm_head)


def init_head(final_norm: torch.Tensor, rank: int, generator: torch.Generator | None = None) -> LowRankHead:
    """Logit-lens initialisation: ``B = 0``, ``A ~ N(0, 1/d)``, ``g`` = final norm weight."""
    d = final_norm.shape[0]
    a = torch.randn(rank, d, generator=generator) / d**0.5
    return LowRankHead(a, torch.zeros(d, rank), final_norm.detach().float().clone())


@dataclass(frozen=True, slots=True)
class ExitPredictor:
    """SpecEE's 2-layer MLP: ``w1`` (512, 12), ``b1`` (512,), ``w2`` (1, 512), ``b2`` (1,)."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ExitPredictor:
        return ExitPredictor(*(t.to(device, dtype) for t in (self.w1, self.b1, self.w2, self.b2)))


def exit_logit(features: torch.Tensor, p: ExitPredictor) -> torch.Tensor:
    """(..., 12) -> (...,) pre-sigmoid score."""
    return F.linear(F.relu(F.linear(features, p.w1, p.b1)), p.w2, p.b2)[..., 0]


def exit_probability(features: torch.Tensor, p: ExitPredictor) -> torch.Tensor:
    return torch.sigmoid(exit_logit(features, p))


def spec_local(h: torch.Tensor, spec_rows: torch.Tensor, final_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Speculative-token logits ``s`` of the normalised state: (R, d) rows, ``spec_rows``
    (R, 4, d) or (4, d) LM-head rows of each row's speculative tokens -> (R, 4)."""
    z = F.rms_norm(h, (h.shape[-1],), final_norm, eps)
    if spec_rows.dim() == 2:
        return F.linear(z, spec_rows)
    return torch.einsum("rd,rkd->rk", z, spec_rows)


def specee_features(s: torch.Tensor, s_prev: torch.Tensor | None) -> torch.Tensor:
    """(R, 4) logits at this layer (and at the previous layer, or None at the first
    layer with speculative tokens) -> (R, 12) features ``[s, q, q - q_prev]``."""
    q = s.float().softmax(dim=-1)
    delta = q if s_prev is None else q - s_prev.float().softmax(dim=-1)
    return torch.cat([s.float(), q, delta], dim=-1)
