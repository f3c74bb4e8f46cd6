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
policy (:class:`~.policy.LengthPolicy`), the branch's from the planner here. The n-gram source
is composed in (:class:`~.ngram.NgramLookup`, or any :class:`NgramSource`), never patched on.
Invariant: every planner is asked in the order it was before the drafter/policy split, so a
round's plan and draft are what they were.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..engine import ForwardOutput
from .planning import Planner, round_plan
from .drafts import Chain, Draft, LayerSkipNote, NoDraft, Plan, Round, Tree, chain_or_tree
from .driver import Delegating
from .layer_skip import DraftSettings, Drafted, LayerSkipDrafter, SkipOrFullDepth
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


class Hybrid(Delegating):
    """A layer-skip chain source (``chain``, the delegate) with an n-gram branch (``ngram``) merged into its drafts."""

    def __init__(self, chain: LayerSkipDrafter | SkipOrFullDepth, ngram: NgramSource, settings: DraftSettings) -> None:
        super().__init__(chain)
        self.chain, self.ngram, self.settings = chain, ngram, settings
        self.ngram_planner: Planner | None = None

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
        if cont and s.cost_aware:  # how many looked-up tokens pay (they cost no draft forward)
            if self.ngram_planner is None:
                self.ngram_planner = Planner(drafter.policy.planner.curve, s.lookahead)
            cont = cont[: self.ngram_planner.at(state.pos).plan(0.0, len(cont))]
        if k <= 0:
            if cont:  # layer skipping does not pay this round, the n-gram branch alone may (its own plan)
                note = LayerSkipNote(hit_limit=True, chain_nodes=0, by=drafter, ngram_path=list(range(len(cont))))
                return Chain(cont, note=note, plan=self.ngram_planner.last if self.ngram_planner is not None else plan)
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
        merge = plan is None or self.ngram_planner is None
        if not merge:
            # the branch's rows are verified only when its expected extra tokens pay for them: against a
            # chain accepted 98 % of the time they seldom do (and the merged estimate errs low)
            m_plan = merged_plan(drafter.policy.planner, self.ngram_planner, made.steps, len(cont), len(merged),
                                 drafter.policy.draft_cost())
            merge = len(merged) == len(made.tokens) or m_plan[0] / m_plan[1] > plan[0] / plan[1]
            if merge:
                plan = m_plan
        if not merge:
            return made.tokens, made.parents, plan
        note.ngram_path = path
        return merged, merged_parents if len(merged) > len(chain_parents) else made.parents, plan

    def accept(self, state: DecodeState, rnd: Round) -> None:
        draft = rnd.draft
        if not isinstance(draft, (Chain, Tree)) or not isinstance(draft.note, LayerSkipNote):
            return
        note = draft.note
        if draft.forwards:  # the layer-skip draft's own statistics
            note.by.accept(state, rnd)
        if note.ngram_path and self.ngram_planner is not None:
            path = note.ngram_path
            self.ngram_planner.observe(len(path), len(set(path) & set(rnd.verdict.accepted)))
        if not draft.forwards and self.ngram_planner is not None:  # the n-gram branch's own round
            self.ngram_planner.observe_round(rnd.steps, draft.plan)

    def end(self) -> dict[str, Any]:
        return self.chain.end()
