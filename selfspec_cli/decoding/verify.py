"""Verification rules: which drafted tokens the target accepts, and the next token.

Every rule here is exact: greedy rules return what plain greedy decoding returns, and
sampling rules emit tokens distributed exactly as the target's processed
distribution ``p`` (temperature, top-k, top-p applied), whatever the draft did.

* :func:`verify_chain_sampling` — standard speculative sampling (Leviathan et al.
  2023; Chen et al. 2023) for a chain whose token ``d_i`` was *sampled* from the
  draft's processed distribution ``q_i``: accept with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; on rejection emit a sample of
  ``norm(max(p_i - q_i, 0))``; if all are accepted emit a bonus token from
  ``p_{k+1}``. Deterministic drafts are the special case ``q_i = one_hot(d_i)``.
* :func:`verify_tree` — a tree of *deterministic* candidates (e.g. SWIFT's top-k per
  depth), verified by sample-then-match: at each node draw ``x ~ p`` (argmax when
  greedy) and move to the child holding ``x`` if there is one, else emit ``x`` and
  stop. Every emitted token is a fresh draw from the target given its prefix, so
  the rule is lossless by construction; for deterministic candidate sets it is
  also the acceptance-optimal lossless rule (it accepts with probability
  ``sum_{c in children} p(c)``, the most any coupling can).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingConfig
from ..engine.kernels import argmax_rows
from .sampling import processed_probs, sample_from

GREEDY = SamplingConfig()  # the greedy rules' config (temperature 0)


@dataclass(frozen=True, slots=True)
class Verdict:
    """``accepted``: indices of accepted draft nodes, root to deepest, in draft order
    (for a chain: 0..n-1). ``tokens``: accepted draft tokens followed by the next token
    chosen by the target (correction or bonus)."""

    accepted: list[int]
    tokens: list[int]


def verify_chain_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """``target_logits``: (k+1, V), row i predicts the token after draft i-1 (row 0:
    after the pending token). Accept the longest prefix equal to the target argmax (the
    greedy tree rule on the chain's tree)."""
    return verify_tree(draft_tokens, range(-1, len(draft_tokens) - 1), target_logits, GREEDY, None)


def verify_chain_sampling(draft_tokens: Sequence[int], q_draft: torch.Tensor, target_logits: torch.Tensor,
                          cfg: SamplingConfig, generator: torch.Generator | None) -> Verdict:
    """Speculative sampling. ``q_draft``: (k, V) processed draft distributions each
    ``draft_tokens[i]`` was sampled from; ``target_logits``: (k+1, V) raw logits."""
    p_target = processed_probs(target_logits, cfg)  # (k+1, V)
    k = len(draft_tokens)
    rejected: list[bool] = []
    if k:
        idx = torch.as_tensor(draft_tokens, device=p_target.device)
        rows = torch.arange(k, device=p_target.device)
        ratio = (p_target[rows, idx] / q_draft[rows, idx]).clamp(max=1.0)  # (k,)
        rejected = (torch.rand(k, generator=generator, device=p_target.device) >= ratio).tolist()
    for i, rejected_i in enumerate(rejected):
        if rejected_i:
            residual = (p_target[i] - q_draft[i]).clamp(min=0.0)
            total = residual.sum()
            # total == 0 only if p == q, where rejection has probability 0; guard anyway
            token = sample_from(residual / total if total > 0 else p_target[i], generator)
            return Verdict(list(range(i)), [*draft_tokens[:i], token])
    return Verdict(list(range(k)), [*draft_tokens, sample_from(p_target[k], generator)])


def tree_children(tokens: Sequence[int], parents: Sequence[int]) -> dict[int, dict[int, int]]:
    """parent node -> {token: child node} (-1: the pending token); duplicate siblings: the first wins."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)
    return children


def verify_tree(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor, cfg: SamplingConfig,
                generator: torch.Generator | None) -> Verdict:
    """Sample-then-match over a candidate tree.

    ``tokens[i]``/``parents[i]``: the tree's draft nodes (parent -1 = child of the
    pending token). ``target_logits``: (1 + T, V); row 0 is the pending token's
    prediction, row ``1 + i`` node i's.
    """
    children = tree_children(tokens, parents)
    if cfg.greedy:
        best = argmax_rows(target_logits)
        pick = lambda row: best[row]  # noqa: E731
    else:
        probs = processed_probs(target_logits, cfg)
        pick = lambda row: sample_from(probs[row], generator)  # noqa: E731
    accepted: list[int] = []
    node = -1
    while True:
        x = pick(node + 1)
        nxt = children.get(node, {}).get(x)
        if nxt is None:
            return Verdict(accepted, [*(tokens[i] for i in accepted), x])
        accepted.append(nxt)
        node = nxt
