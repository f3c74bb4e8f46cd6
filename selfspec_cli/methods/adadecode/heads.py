"""AdaDecode's intermediate LM heads (Wei et al. 2025, §2.1), as plain functions of tensors.

The same functions run in training (with autograd, :mod:`.train`) and at inference (under
inference mode, :mod:`selfspec_cli.methods.adadecode`), so a head sees exactly the same
computation in both places. Nothing here touches a cache or a decoding loop.

:func:`head_logits` is the head at layer ``i`` (``E^(i) = E* T^(i)``), with ``T^(i)``
parameterised as identity plus a rank-``r`` update applied before the *frozen* final LM
head ``E*``: ``u = g ⊙ rmsnorm(h)``, ``logits = E* (u + B A u)``. With ``B = 0`` and ``g`` =
the final norm's weight, the head is exactly the logit lens (the original head on the
intermediate state), so training starts from it and learns a correction. SpecEE drafts
with the shallowest of these heads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
