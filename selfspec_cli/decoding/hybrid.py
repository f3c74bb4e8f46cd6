"""Hybrid drafts: a layer-skip chain (or tree) plus the n-gram continuation of the context as a
second branch of one tree, verified in one forward by the exact tree rule.

The n-gram source (prompt lookup's ``candidate(state, budget) -> (continuation, n)``) costs no
draft forward; its continuation's length is planned by a planner of its own, and the branch
is merged into the drafted chain sharing the nodes it agrees with (:func:`merge_branch`). With
cost-aware drafting the branch's rows are verified only when the merged round's expected
tokens per cost beat the chain's alone (:func:`merged_plan`); when layer skipping does not
pay this round, the n-gram branch alone may. The chain part is a layer-skip drafter or a
:class:`~.layer_skip.SkipOrFullDepth` of two (each answers ``configuration(state, budget)``
with the configuration that drafts this round); its length comes from that configuration's
policy (:class:`~.policy.LengthPolicy`), the branch's from its own policy (:class:`BranchPolicy`). The n-gram source
is composed in (:class:`~.ngram.NgramLookup`, or any :class:`NgramSource`), never patched on.
Invariant: every planner is asked in the order it was before the drafter/policy split, so a
round's plan and draft are what they were.
"""
from __future__ import annotations

from typing import Protocol

from ..engine import ForwardOutput
from .planning import Planner, round_plan
from .drafts import Chain, Draft, LayerSkipNote, NoDraft, Plan, Round, Tree, chain_or_tree
from .driver import Delegating
from .layer_skip import DraftSettings, Drafted, LayerSkipDrafter, LayerSkipReport, SkipOrFullDepth
from .policy import LengthPolicy
from .state import DecodeState
from .verify import tree_children


class NgramSource(Protocol):
    """Where a hybrid draft's n-gram branch comes from: this round's continuation and the order of
    the n-gram that found it; ``begin`` after each prefill."""

    def candidate(self, state: DecodeState, budget: int) -> tuple[list[int], int]: ...

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None: ...


def merge_branch(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Add the chain ``branch`` (continuing the pending token) to a draft tree, sharing the
    nodes it agrees with: ``(tokens, parents, the branch's node indices)``."""
    tokens, parents = list(tokens), list(parents)
    children = tree_children(tokens, parents)
    node, path = -1, []
    for t in branch:
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            nxt = len(tokens)
            tokens.append(t)
            parents.append(node)
            children.setdefault(node, {})[t] = nxt
        path.append(nxt)
        node = nxt
    return tokens, parents, path


def merged_plan(chain: Planner, ngram: Planner, k: int, n: int, nodes: int, c: float) -> Plan:
    """Expected tokens and cost of a hybrid round: a k-token layer-skip draft (planner ``chain``,
    draft cost ``c``) and an n-token n-gram branch, ``nodes`` verified nodes in all. Depth j is
    reached when either branch reaches it; without joint statistics the larger of the two
    chances is taken (a lower bound, so the prediction errs low)."""
    ls, ng = chain.reach(k), ngram.reach(n)
    reach = [max(ls[j] if j < k else 0.0, ng[j] if j < n else 0.0) for j in range(max(k, n))]
    return round_plan(chain.curve, k, reach, c, nodes, chain.overhead.value, chain.context)


class BranchPolicy:
    """The n-gram branch's draft policy in hybrid drafts: how many looked-up tokens pay (they cost no
    draft forward; a planner of its own, made on the first cost-aware round with the chain's verify
    curve), and whether merging the branch into a drafted chain pays (:func:`merged_plan` against
    the chain's own plan). Unplanned (no ``cost_aware``): the whole branch, always merged."""

    def __init__(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.planner: Planner | None = None

    def length(self, cont: list[int], chain: LengthPolicy, context: int) -> list[int]:
        """The looked-up tokens worth verifying this round."""
        if not (cont and self.settings.cost_aware):
            return cont
        if self.planner is None:
            self.planner = Planner(chain.planner.curve, self.settings.lookahead)
        return cont[: self.planner.at(context).plan(0.0, len(cont))]

    def alone(self, fallback: Plan | None) -> Plan | None:
        """The plan of a round that verifies the branch alone (the chain's ``fallback`` when unplanned)."""
        return self.planner.last if self.planner is not None else fallback

    def merge(self, chain: LengthPolicy, plan: Plan | None, steps: int, branch: int, nodes: int,
              chain_nodes: int) -> tuple[bool, Plan | None]:
        """Whether to merge a ``branch``-token branch into a chain drafted in ``steps`` steps
        (``chain_nodes`` nodes, ``nodes`` merged), and the round's plan then (unplanned: always)."""
        if plan is None or self.planner is None:
            return True, plan
        # the branch's rows are verified only when its expected extra tokens pay for them: against a
        # chain accepted 98 % of the time they seldom do (and the merged estimate errs low)
        m_plan = merged_plan(chain.planner, self.planner, steps, branch, nodes, chain.draft_cost())
        merge = nodes == chain_nodes or m_plan[0] / m_plan[1] > plan[0] / plan[1]
        return merge, m_plan if merge else plan

    def observe(self, rnd: Round, note: LayerSkipNote) -> None:
        """After a round that carried the branch (its path's accepted nodes), or was the branch alone (its cost)."""
        if self.planner is None:
            return
        if note.ngram_path:
            path = note.ngram_path
            self.planner.observe(len(path), len(set(path) & set(rnd.verdict.accepted)))
        if not rnd.draft.forwards:  # the n-gram branch's own round
            self.planner.observe_round(rnd.steps, rnd.draft.plan)


class Hybrid(Delegating):
    """A layer-skip chain source (``chain``, the delegate) with an n-gram branch (``ngram``) merged into
    its drafts, as long as the branch's policy (:class:`BranchPolicy`) says."""

    def __init__(self, chain: LayerSkipDrafter | SkipOrFullDepth, ngram: NgramSource, settings: DraftSettings) -> None:
        super().__init__(chain)
        self.chain, self.ngram, self.settings = chain, ngram, settings
        self.branch = BranchPolicy(settings)

    @property
    def ngram_planner(self) -> Planner | None:
        """The branch policy's planner (None before a cost-aware round looked anything up)."""
        return self.branch.planner

    @ngram_planner.setter
    def ngram_planner(self, planner: Planner | None) -> None:
        self.branch.planner = planner

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.chain.begin(state, prefill)
        self.ngram.begin(state, prefill)

    def draft(self, state: DecodeState, budget: int) -> Draft:
        s = self.settings
        cont = state.through_stop(self.ngram.candidate(state, budget)[0]) if budget > 0 else []
        budget = min(s.max_draft, budget)
        if budget <= 0:
            return NoDraft()
        drafter = self.chain.configuration(state, budget)
        k, plan = drafter.policy.length(budget, state.pos)
        cont = self.branch.length(cont, drafter.policy, state.pos)  # how many looked-up tokens pay
        if k <= 0:
            if cont:  # layer skipping does not pay this round, the n-gram branch alone may (its own plan)
                note = LayerSkipNote(hit_limit=True, chain_nodes=0, by=drafter, ngram_path=list(range(len(cont))))
                return Chain(cont, note=note, plan=self.branch.alone(plan))
            return NoDraft(plan=plan)
        made = drafter.draw(state, k, deterministic=bool(cont))
        plan = drafter.as_drafted(plan, made, k)
        note = LayerSkipNote(hit_limit=made.hit_limit, chain_nodes=len(made.tokens), by=drafter)
        tokens, tree = made.tokens, made.parents
        if cont:
            tokens, tree, plan = self._merge(drafter, made, cont, plan, note)
        return chain_or_tree(tokens, tree, q=made.q, forwards=made.steps, note=note, plan=plan)

    def _merge(self, drafter: LayerSkipDrafter, made: Drafted, cont: list[int], plan: Plan | None,
               note: LayerSkipNote) -> tuple[list[int], list[int] | None, Plan | None]:
        """The draft with the n-gram branch merged in when it pays (unplanned: always, the paper-style hybrid)."""
        chain_parents = made.parents if made.parents is not None else list(range(-1, len(made.tokens) - 1))
        merged, merged_parents, path = merge_branch(made.tokens, chain_parents, cont)
        merge, plan = self.branch.merge(drafter.policy, plan, made.steps, len(cont), len(merged), len(made.tokens))
        if not merge:
            return made.tokens, made.parents, plan
        note.ngram_path = path
        return merged, merged_parents if len(merged) > len(chain_parents) else made.parents, plan

    def accept(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        if not isinstance(draft, (Chain, Tree)) or not isinstance(draft.note, LayerSkipNote):
            return
        if draft.forwards:  # the layer-skip draft's own statistics
            draft.note.by.accept(state, rnd)
        self.branch.observe(rnd, draft.note)

    def end(self) -> LayerSkipReport:
        return self.chain.end()
