"""Token selection from logits: greedy, or sampling from the processed distribution.

Two sampling rules (``SamplingConfig.rule``; docs/sampling.md proves both exact):

* ``gumbel`` (the default, reproducible): the token at absolute position ``n`` is
  ``argmax(s_n + g_n)``, ``s_n`` the processed log-probabilities and ``g_n`` a vector of
  i.i.d. standard Gumbel noise that depends on ``(seed, n)`` only (:class:`PositionNoise`).
  By the Gumbel-max theorem the token is distributed exactly as ``softmax(s_n)``; ``g_n``
  is independent of the prefix (made of earlier positions' noise), so the sequence has the
  target's law. A sample is then a function of the seed, the position and the target's
  distribution: every lossless method reproduces ``ar``'s tokens for a seed, whatever it
  drafted and however long its rounds were (verification is the greedy rule on ``s + g``);
* ``speculative``: draws from a seeded generator consumed round by round, verified by
  standard speculative sampling (:mod:`.verify`); exact in law, not reproducible across
  methods or plans.

``processed_probs`` reproduces Hugging Face's TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper chain (same order, same tie rules), so that
"the target's distribution" means the same thing here as in ``model.generate``.
Speculative methods apply the *same* processing to draft logits, which is what
makes their acceptance rules exact.
"""
from __future__ import annotations

import torch

from ..config import SamplingConfig
from ..engine.kernels import argmax_rows


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> float32 probabilities of the processed distribution (filtered
    entries at probability 0)."""
    return processed_scores(logits, cfg).softmax(dim=-1)


def processed_scores(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> float32 log-probabilities of the processed distribution up to a
    constant per row (filtered entries at -inf)."""
    assert not cfg.greedy, "processed_scores is for sampling; greedy uses argmax"
    scores = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionNoise:
    """Standard Gumbel noise over the vocabulary for each absolute position, a function of
    ``(seed, position)`` only (a generator seeded by a hash of the pair; cached while the
    position can still be drafted or verified). Positions count from the first prompt token.

    On a CUDA device the noise is drawn there, by the device's own generator: no host work and no copy
    per position (on one core a 49,152-token vocabulary's noise takes about 0.4 ms, against a GPU step of
    0.9-2.8 ms, docs/benchmarks.md "GPU"). A seed's samples are then a function of the device type too: the
    CPU and a GPU draw different noise for one seed."""

    def __init__(self, seed: int, vocab: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.vocab, self.device = seed, vocab, torch.device(device)
        self._cache: dict[int, torch.Tensor] = {}

    def __call__(self, position: int) -> torch.Tensor:
        g = self._cache.get(position)
        if g is None:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            gen = torch.Generator(device=dev).manual_seed(_mix64(_mix64(self.seed & _MASK64) ^ position) >> 1)
            u = torch.rand(self.vocab, generator=gen, dtype=torch.float64, device=dev)
            g = (-torch.log(-torch.log(u))).float().to(self.device)  # u == 0 gives -inf: never picked
            self._cache[position] = g
        return g

    def rows(self, positions: list[int]) -> torch.Tensor:
        return torch.stack([self(p) for p in positions])

    def forget_before(self, position: int) -> None:
        """Committed positions are never drawn again."""
        for p in [p for p in self._cache if p < position]:
            del self._cache[p]


def gumbel_scores(logits: torch.Tensor, cfg: SamplingConfig, noise: torch.Tensor) -> torch.Tensor:
    """Processed log-probabilities plus the positions' Gumbel noise: their argmax is an exact
    sample, and the greedy rules applied to them verify exactly (docs/sampling.md)."""
    return processed_scores(logits, cfg) + noise


def make_generator(cfg: SamplingConfig, device: torch.device | str) -> torch.Generator | None:
    """A seeded generator for reproducible sampling; None for greedy."""
    if cfg.greedy:
        return None
    g = torch.Generator(device=device)
    if cfg.seed is None:
        g.seed()
    else:
        g.manual_seed(cfg.seed)
    return g


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a (V,) probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))


def select_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
                 noise: torch.Tensor | None = None) -> int:
    """Next token from (V,) logits: argmax when greedy, the Gumbel pick with the position's
    ``noise`` (rule ``gumbel``), else a sample of the processed distribution."""
    if cfg.greedy:
        return argmax_rows(logits)[0]
    if noise is not None:
        return int(gumbel_scores(logits, cfg, noise).argmax())
    return sample_from(processed_probs(logits, cfg), generator)
