"""What a drafter offers in one round, as one of five typed values, and what it gets back.

The driver (:mod:`.driver`) matches on the draft's type, never on flags:

* :class:`NoDraft`: the round is a plain decoding step (``ar``; a drafter that declines);
* :class:`Chain`: tokens to verify with one full-depth forward of the pending token and the
  chain (``q``: the laws they were sampled from; None: deterministic drafts);
* :class:`Tree`: nodes with their parents (-1: a child of the pending token), verified by one
  tree-masked forward and the tree rule;
* :class:`Deferred`: a chain whose full-depth rows the drafter already computed (``logits``
  of ``[pending, *tokens]``, AdaDecode's); only the chain rule is applied;
* :class:`Decided`: a lossy drafter's final tokens (SpecEE), committed unverified.

``plan`` (drafting kinds): the planner's prediction for the round, expected tokens and cost in
plain steps (:mod:`.planning`, a :class:`Plan`); ``note``: the drafter's own typed record of how it
drafted (one class per kind of draft), which the driver never reads and hands back in :class:`Round`. After the round the drafter's ``accept``
receives a :class:`Round`: the draft, the verdict, the verification forward and the round's
measured cost in plain steps. Nothing the driver learns is written into a drafter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch

from ..engine import ForwardOutput
from ..engine.tree import tree_depths
from .verify import Verdict

class Plan(NamedTuple):
    """A planner's prediction for one round (:mod:`.planning`)."""

    expected_tokens: float
    cost: float  # in plain steps


@dataclass(slots=True)
class LayerSkipNote:
    """How a layer-skip round drafted (:mod:`.layer_skip`): whether the chain ran to its length
    limit (no confidence exit), how many nodes the layer-skip draft made, which drafter made
    them (``by``: the configuration whose statistics the round updates), and which nodes are
    the merged n-gram branch's path (hybrid rounds, :mod:`.hybrid`)."""

    hit_limit: bool
    chain_nodes: int
    by: Any = None
    ngram_path: list[int] | None = None


@dataclass(frozen=True, slots=True)
class NgramNote:
    """An n-gram draft's lookup: the order ``n`` of the suffix that matched (prompt lookup)."""

    n: int


@dataclass(frozen=True, slots=True)
class HeadsNote:
    """A deferred chain's early tokens: the layer whose head made each (AdaDecode)."""

    layers: list[int]


Note = Union[LayerSkipNote, NgramNote, HeadsNote, None]


@dataclass(frozen=True, slots=True)
class NoDraft:
    plan: Plan | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    tokens: list[int]
    q: torch.Tensor | None = None  # (k, V): the laws the tokens were sampled from; None: deterministic
    forwards: int = 0  # draft forwards the drafter made
    plan: Plan | None = None
    note: Note = None


@dataclass(frozen=True, slots=True)
class Tree:
    tokens: list[int]
    parents: list[int]  # parent node of each node (-1: child of the pending token)
    forwards: int = 0
    plan: Plan | None = None
    note: Note = None


@dataclass(frozen=True, slots=True)
class Deferred:
    tokens: list[int]
    logits: torch.Tensor  # target logits of [pending, *tokens], already computed at full depth
    q: torch.Tensor | None = None
    note: Note = None
    plan: Plan | None = None


@dataclass(frozen=True, slots=True)
class Decided:
    tokens: list[int]
    full_depth: bool = False  # made by a full-depth forward (counts as a target forward)
    plan: Plan | None = None


Draft = Union[NoDraft, Chain, Tree, Deferred, Decided]


def chain_or_tree(tokens: list[int], parents: list[int] | None, **kw: Any) -> Chain | Tree:
    """A chain, or a tree when ``parents`` is given (a tree takes no laws: its drafts are deterministic)."""
    if parents is None:
        return Chain(tokens, **kw)
    kw.pop("q", None)
    return Tree(tokens, parents, **kw)


def depth(draft: Draft) -> int:
    """Draft positions proposed: a chain's length, a tree's number of levels, 0 for no draft."""
    if isinstance(draft, Tree):
        return max(tree_depths(draft.parents), default=-1) + 1
    return 0 if isinstance(draft, NoDraft) else len(draft.tokens)


@dataclass(frozen=True, slots=True)
class Round:
    """What a drafter learns from one round (``accept``'s argument)."""

    draft: Draft
    verdict: Verdict
    out: ForwardOutput | None  # the verification forward (None: deferred rows or decided tokens)
    steps: float | None = None  # the round's seconds over a plain round's: its measured cost in plain steps
