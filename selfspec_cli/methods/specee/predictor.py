"""SpecEE's exit predictors (Xu et al. 2025, §4.3.1), as plain functions of tensors: the same
code runs in training (:mod:`.train`) and at inference (:mod:`selfspec_cli.methods.specee`).

* :func:`specee_features` — the 12 predictor features: the 4 speculative-token logits ``s``
  of the normalised state, their local probabilities ``q = softmax(s)`` and the change
  ``q - q_prev`` since the previous layer (``q`` itself at the first layer that has
  speculative tokens).
* :func:`exit_probability` — the per-layer predictor: Linear(12, 512), ReLU, Linear(512, 1),
  sigmoid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_SPEC_TOKENS = 4
NUM_FEATURES = 3 * NUM_SPEC_TOKENS
PREDICTOR_HIDDEN = 512


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
