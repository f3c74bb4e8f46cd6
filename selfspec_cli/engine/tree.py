"""Token trees for one-forward verification of several draft branches.

A tree of ``T`` nodes is given by ``parents[i]`` (index of node i's parent among
the nodes, or -1 for a root). Nodes must be in topological order (parent before
child). Each node attends to the cached prefix, its ancestors and itself; its
position id is ``prefix_len + depth``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def tree_depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for i, p in enumerate(parents):
        assert p < i, f"node {i} has parent {p}: nodes must be topologically ordered"
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_mask_from_parents(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, T) bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(device)


def tree_positions(parents: Sequence[int], prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([prefix_len + d for d in tree_depths(parents)], dtype=torch.long, device=device)


def root_to_leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path as a list of node indices: a leaf's ancestors and itself, which
    the topological order lists root first."""
    has_child = {p for p in parents if p >= 0}
    mask = tree_mask_from_parents(parents)
    return [mask[leaf].nonzero().flatten().tolist() for leaf in range(len(parents)) if leaf not in has_child]
