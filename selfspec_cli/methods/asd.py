"""ASD: Adaptive Self-Speculative Decoding using Cosine Similarity (Metel et al., 2024).

Per prompt, with no search and no training: Algorithm 1 (ADMG) over the prompt's
hidden states, in the paper's 1-based layer numbers l = 1..L:

* ``C_l`` = mean over prompt positions of cos(h before, h after) the attention
  sublayer of layer l (residual stream included);
* remove_ATTN = {l : C_l >= alpha, l <= L - n};
* remove_MLP  = {l : l = j m for j in N, l <= L - n} (every m-th layer);
* remove_ATTN = remove_ATTN U remove_MLP.

Defaults alpha = 0.985, m = 3, n = 2 (the paper's Table 2 for Llama-2-13B). Drafting
uses Draft & Verify's adaptive draft exit; verification is exact.
"""
from __future__ import annotations

from typing import Any

import torch

from ..decoding.speculative import DraftConfig, RoundContext, SelfSpeculative
from ..engine import Engine, ForwardOutput
from ..errors import ConfigError
from .base import Method


def admg(cosines: list[float], alpha: float, m: int, n: int) -> tuple[frozenset[int], frozenset[int]]:
    """Algorithm 1 of the ASD paper; returns 0-based (skip_attn, skip_mlp)."""
    num_layers = len(cosines)
    attn = {l for l in range(1, num_layers + 1) if cosines[l - 1] >= alpha and l <= num_layers - n}
    mlp = {l for l in range(m, num_layers + 1, m) if l <= num_layers - n}
    attn |= mlp
    return frozenset(l - 1 for l in attn), frozenset(l - 1 for l in mlp)


class ASD(SelfSpeculative, Method):
    name = "asd"
    lossless = True
    description = "ASD: per-prompt skip set from attention cosine similarity (no search, no training)"
    needs_attn_cosine = True

    def __init__(self, engine: Engine, tokenizer: Any = None, *, alpha: float = 0.985, m: int = 3, n: int = 2,
                 draft: DraftConfig | None = None) -> None:
        if not 0 < alpha < 1:
            raise ConfigError(f"ASD alpha must be in (0, 1), got {alpha}")
        if m < 1 or n < 0:
            raise ConfigError(f"ASD needs m >= 1 and n >= 0, got m={m}, n={n}")
        Method.__init__(self, engine, tokenizer)
        SelfSpeculative.__init__(self, engine, draft or DraftConfig())
        self.alpha, self.m, self.n = alpha, m, n
        self._skip: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
        self._cosines: list[float] = []

    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        return self._skip

    def on_prefill(self, ctx: RoundContext, prompt: torch.Tensor, out: ForwardOutput) -> None:
        assert out.attn_cosine is not None
        self._cosines = out.attn_cosine.tolist()
        self._skip = admg(self._cosines, self.alpha, self.m, self.n)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "attn_cosine": [round(c, 5) for c in self._cosines]}
