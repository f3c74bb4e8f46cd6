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
    """One intermediate head: ``a`` (r, d), ``b`` (d, r), ``g`` (d,), and ``vocab``: the token ids
    its logits score (column ``i`` is token ``vocab[i]``), a draft vocabulary (FR-Spec,
    methods/fr_spec/); None: the whole vocabulary. The head's own parameters do not depend on
    it (the LM head is the frozen model's); what does is the cost of a check and of training: on
    Gemma 3's 262k tokens a check over the whole vocabulary is over half a step, one over 16k
    tokens a sixteenth of that. Greedy output never depends on it (the full model verifies every
    early token); sampling stays exact because an early token is a point-mass proposal."""

    a: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor
    vocab: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LowRankHead:
        vocab = None if self.vocab is None else self.vocab.to(device, torch.int64)
        return LowRankHead(self.a.to(device, dtype), self.b.to(device, dtype), self.g.to(device, dtype), vocab)

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of logits columns (the identity for a head over the whole vocabulary)."""
        return columns if self.vocab is None else self.vocab.to(columns.device)[columns]

    def rows(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The rows of the (V, d) LM head matrix this head scores."""
        return lm_head if self.vocab is None else lm_head[self.vocab.to(lm_head.device)]


def head_logits(h: torch.Tensor, head: LowRankHead, lm_head: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                eps: float) -> torch.Tensor:
    """(R, d) residual rows after the head's layer -> (R, N) logits of the head over its
    vocabulary (N = V for a head over the whole vocabulary). ``lm_head`` is the (N, d) matrix
    of those rows (:meth:`LowRankHead.rows`), or a prepacked head over them (``engine.lm_head``,
    or ``engine.subset_head(head.vocab)``: the same product)."""
    u = F.rms_norm(h, (h.shape[-1],), head.g, eps)
    u = u + F.linear(F.linear(u, head.a), head.b)  # the corrected normalised state u + B A u, before E*
    return lm_head(u) if callable(lm_head) else F.linear(u, lm_head)


def init_head(final_norm: torch.Tensor, rank: int, generator: torch.Generator | None = None,
              vocab: torch.Tensor | None = None) -> LowRankHead:
    """Logit-lens initialisation: ``B = 0``, ``A ~ N(0, 1/d)``, ``g`` = final norm weight."""
    d = final_norm.shape[0]
    a = torch.randn(rank, d, generator=generator) / d**0.5
    return LowRankHead(a, torch.zeros(d, rank), final_norm.detach().float().clone(), vocab)
