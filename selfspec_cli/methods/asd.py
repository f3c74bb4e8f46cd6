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

from dataclasses import dataclass

from ..decoding.drafts import Round
from ..decoding.layer_skip import NO_SKIPS, SkipPair, SkipSource
from ..decoding.output import DraftReport
from ..decoding.state import DecodeState
from ..engine import ForwardOutput
from .base import LayerSkipMethod, LayerSkipOptions, option, require


def admg(cosines: list[float], alpha: float, m: int, n: int) -> tuple[frozenset[int], frozenset[int]]:
    """Algorithm 1 of the ASD paper; returns 0-based (skip_attn, skip_mlp)."""
    num_layers = len(cosines)
    attn = {l for l in range(1, num_layers + 1) if cosines[l - 1] >= alpha and l <= num_layers - n}
    mlp = {l for l in range(m, num_layers + 1, m) if l <= num_layers - n}
    attn |= mlp
    return frozenset(l - 1 for l in attn), frozenset(l - 1 for l in mlp)


@dataclass(frozen=True)
class ASDConfig(LayerSkipOptions):
    asd_alpha: float = option(0.985, "cosine-similarity threshold")
    asd_m: int = option(3, "skip every m-th layer's MLP and attention")
    asd_n: int = option(2, "never skip the last n layers")

    def __post_init__(self) -> None:
        LayerSkipOptions.__post_init__(self)
        require(0 < self.asd_alpha < 1, "asd_alpha", "in (0, 1)", self.asd_alpha)
        require(self.asd_m >= 1, "asd_m", ">= 1", self.asd_m)
        require(self.asd_n >= 0, "asd_n", ">= 0", self.asd_n)


class PromptSkips(SkipSource):
    """ASD's skip set, chosen per prompt from the prefill's attention cosines (Algorithm 1)."""

    adapts = True
    needs_attn_cosine = True

    def __init__(self, config: ASDConfig) -> None:
        self.config = config
        self.skip: SkipPair = NO_SKIPS
        self.cosines: list[float] = []

    def sets(self) -> SkipPair:
        return self.skip

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        c = self.config
        self.cosines = prefill.attn_cosine.tolist()
        self.skip = admg(self.cosines, c.asd_alpha, c.asd_m, c.asd_n)

    def update(self, state: DecodeState, rnd: Round, own: bool) -> None:
        pass

    def describe(self) -> CosineReport:
        return CosineReport([round(c, 5) for c in self.cosines])


@dataclass(frozen=True, slots=True)
class CosineReport(DraftReport):
    """ASD's skip source in its drafter's report: the prefill's per-layer attention cosines."""

    attn_cosine: list[float]


class ASD(LayerSkipMethod):
    name = "asd"
    lossless = True
    description = "ASD: per-prompt skip set from attention cosine similarity (no search, no training)"
    Config = ASDConfig

    def skip_source(self) -> SkipSource:
        return PromptSkips(self.config)
