"""Token selection from logits: greedy, or sampling from the processed distribution.

``processed_probs`` reproduces Hugging Face's TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper chain (same order, same tie rules), so that
"the target's distribution" means the same thing here as in ``model.generate``.
Speculative methods apply the *same* processing to draft logits, which is what
makes their acceptance rules exact.
"""
from __future__ import annotations

import torch

from ..config import SamplingConfig


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> float32 probabilities of the processed distribution (filtered
    entries at probability 0)."""
    assert not cfg.greedy, "processed_probs is for sampling; greedy uses argmax"
    scores = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        k = min(cfg.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


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


def select_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """Next token from (V,) logits: argmax when greedy, else a sample of the processed distribution."""
    if cfg.greedy:
        return int(logits.argmax())
    return sample_from(processed_probs(logits, cfg), generator)
