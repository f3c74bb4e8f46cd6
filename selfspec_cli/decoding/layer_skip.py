"""The layer-skip proposer shared by Self-SD, SWIFT and ASD.

A round, gpt-fast style: draft with the target itself over its own KV cache but
with a *skip set* (attention and MLP sublayers that add nothing to the residual
stream and write no K/V), one token at a time from the pending token, until the
draft budget is spent or the draft's confidence drops below the threshold (that
last token is still kept). The driver then drops the draft K/V, verifies the
pending token plus the drafts at full depth, as a chain or as SWIFT's candidate
tree (top-k siblings per depth, chosen by confidence), and keeps the accepted K/V.

Subclasses choose the skip set (:meth:`LayerSkipProposer.skip_sets`) and may
adapt it after each round. The draft's precision is a second dimension
(:meth:`LayerSkipProposer.use_precision`): draft forwards may read the quantized copy of
the model's own matrices (engine/quant.py: int8, or a GGUF's own blocks), the skip set
on top; verification always runs the target's weights. With a quantized draft and cost-
aware drafting, each round also weighs the quantized model at full depth (no skips)
against the skip set on top of it, each with its own measured cost and acceptance, and
drafts with the one of higher expected gain: skipping is used only where it pays. With ``cost_aware`` (the default) each round first asks
the :class:`~.cost.Planner` how far drafting pays at the measured draft cost and
acceptance, and does not draft at all when it does not pay. Greedy drafts are the draft's argmax; sampled chain
drafts are drawn from the draft's processed distribution and handed to the driver
with their laws, so the driver's speculative-sampling rule is exact.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import Engine
from ..prompts import encode_turn
from .cost import Planner, VerifyCurve, draft_agreement, draft_cost_for, ema, observe_draft_step
from .drafts import Chain, Draft, NoDraft, Round, Tree, chain_or_tree
from .driver import Proposer
from .sampling import processed_scores, sample_from
from .state import DecodeState
from .verify import tree_children

PAPER_TREE_TOPK = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """How drafts are made and verified.

    ``max_draft``: at most this many draft tokens per round. ``threshold``: initial
    draft-exit threshold (stop after a token whose draft confidence is below it).
    ``adaptive``: Draft & Verify's adaptive threshold. ``tree``: SWIFT's dynamic
    verification; ``tree_topk`` maps confidence bins (upper bounds) to the number of
    candidates kept at a depth; ``tree_max_nodes`` caps the candidate nodes of one tree
    (None: no cap, the paper's GPU setting). On a CPU every verified row costs a few
    per cent of a step, so a large tree can cost more than it wins.
    """

    max_draft: int = 12
    threshold: float = 0.6
    adaptive: bool = True
    tree: bool = False
    tree_topk: tuple[tuple[float, int], ...] = PAPER_TREE_TOPK
    tree_max_nodes: int | None = None
    cost_aware: bool = True  # plan each round's draft length from measured costs (decoding/cost.py)
    kv_window: tuple[int, int] | None = None  # (sinks, window): drafts attend to those keys only (engine/runner.py)

    def topk_for(self, confidence: float) -> int:
        return next((k for upper, k in self.tree_topk if confidence <= upper), self.tree_topk[-1][1])


@dataclass(slots=True)
class CostSlot:
    """The cost state of one draft variant: its planner, its draft step (EMA, seconds), and the
    step timed before its first draft."""

    planner: Planner | None = None
    step_c: float | None = None
    c0: float | None = None


@dataclass(slots=True)
class AdaptiveThreshold:
    """Draft & Verify (Zhang et al. 2024) draft-exit threshold, carried across prompts:
    acceptance EMA ``m <- 0.5 m + 0.5 (accepted / drafted)``; candidate
    ``th' = th + 0.01`` if ``m < 0.9`` else ``th - 0.01`` (unchanged when the draft hit
    its length limit, since the threshold did not end it); ``th <- 0.9 th + 0.1 th'``."""

    value: float
    ema: float = 1.0
    target: float = 0.9
    step: float = 0.01

    def update(self, accepted: int, drafted: int, hit_limit: bool) -> None:
        """After a round that drafted ``drafted > 0`` tokens."""
        self.ema = 0.5 * self.ema + 0.5 * (accepted / drafted)
        if hit_limit:
            return
        cand = self.value + self.step if self.ema < self.target else self.value - self.step
        self.value = min(1.0, max(0.0, 0.9 * self.value + 0.1 * cand))


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


@dataclass(slots=True)
class DraftNote:
    """How a layer-skip round drafted (handed back to ``update``): whether the chain ran to its
    length limit (no confidence exit), how many nodes the layer-skip draft made, and which nodes
    are the merged n-gram branch's path (hybrid rounds)."""

    hit_limit: bool
    chain_nodes: int
    ngram_path: list[int] | None = None


# the instruction whose greedy answer a quantized draft's agreement prior is read along (any neutral request)
AGREEMENT_PROMPT = "Write a short paragraph about a topic of your choice."


class LayerSkipProposer(Proposer):
    """Layer-skipping drafts; subclasses choose the skip sets."""

    never_skips = False  # a subclass whose skip sets are always empty (SpecQD: the quantized model at full depth)

    def __init__(self, engine: Engine, tokenizer: Any, draft: DraftConfig) -> None:
        Proposer.__init__(self, engine, tokenizer)  # not super(): a method class mixes this in beside methods.Method
        self.draft_cfg = draft
        self.threshold = AdaptiveThreshold(draft.threshold)
        self.lookahead = draft.max_draft if not draft.tree else (draft.tree_max_nodes or 64)
        self.planner: Planner | None = None
        self._step_c: float | None = None  # EMA of one draft forward over the plain step at its context
        # hybrid drafts: an n-gram source (state, budget) -> (continuation, n); its continuation joins
        # the layer-skip draft as a second branch of one tree (deterministic nodes, the exact tree rule)
        self.ngram: Callable[[DecodeState, int], tuple[list[int], int]] | None = None
        self._ngram_planner: Planner | None = None
        self.precision: str | None = None  # None: the target's own weights; else engine.draft(precision)
        self._c0: float | None = None  # c before any draft (draft_cost_for: stored, or timed)
        self._q0 = 0.5  # a full-depth quantized draft's prior acceptance (_reset_cost)
        # quantized drafts: the inactive variant's cost state (the skip set, or full depth; see _pick_variant)
        self._full = False  # this round drafts at full depth, no skips
        self._other = CostSlot()
        self.full_depth_variant = True  # weigh full depth against the skip set (auto turns it off: it has its own)
        self._turn = False
        self.full_depth_rounds = 0
        self.use_draft_vocab(None)  # FR-Spec: drafts may score only some tokens (methods/fr_spec/)
        if draft.cost_aware:
            self._planner()  # measures the engine's verify curve now (once per engine), not inside a timed decode

    def use_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft over the tokens ``ids`` only (None: the whole vocabulary). Verification keeps
        the full head, so greedy output is unchanged; sampled drafts are drawn from the
        draft law restricted to ``ids`` and handed over as that law (zero elsewhere), which
        keeps speculative sampling exact (proof: methods/fr_spec/)."""
        if ids is None or int(ids.numel()) >= self.engine.vocab_size:
            self.vocab_ids = self._vocab_head = self._vocab_index = None
            return
        ids = ids.to(torch.int64)
        self.vocab_ids = ids.tolist()
        self._vocab_index = ids.to(self.engine.device)
        self._vocab_head = self.engine.subset_head(ids, self.precision)
        self._reset_cost()

    def use_precision(self, precision: str | None) -> None:
        """Draft with the matrices at ``precision`` (None: the target's own). The quantized copy
        is built (or read from its disk cache) now, and the draft cost re-measured."""
        self.precision = precision
        if precision is not None:
            self.engine.draft(precision)
        if self.vocab_ids is not None:
            self._vocab_head = self.engine.subset_head(self._vocab_index, precision)
        self._reset_cost()

    def _reset_cost(self) -> None:
        """Forget the measured draft costs and acceptance; a quantized draft's costs are timed now,
        and its full-depth prior read now (:meth:`_agreement_prior`), not inside a timed decode."""
        if self._full:
            self._swap()
        self._step_c = self._c0 = None
        self._other = CostSlot()
        self._q0 = 0.5
        if self.precision is not None and self.draft_cfg.cost_aware:
            self._c0 = draft_cost_for(self.engine, self.precision, *self.skip_sets())
            self._other.c0 = draft_cost_for(self.engine, self.precision)
            self._q0 = self._agreement_prior()
        if self.draft_cfg.cost_aware:
            self.planner = None
            self._planner()

    def _agreement_prior(self) -> float:
        """Depth 1's prior acceptance for the full-depth quantized draft: its top-1 agreement with
        the target along the target's own greedy answer to a neutral instruction
        (:func:`~selfspec_cli.decoding.cost.draft_agreement`, as (hits + 1) / (positions + 2)),
        so that a fresh decode starts from what the copy is known to do rather than from 0.5,
        which prices a draft that costs c per token below plain decoding until a few rounds have
        run (docs/engine.md, "Quantized drafts"). 0.5 without a tokenizer."""
        if self.tokenizer is None:
            return 0.5
        ids = encode_turn(self.tokenizer, [{"role": "user", "content": AGREEMENT_PROMPT}], True)
        hits, n = draft_agreement(self.engine, self.precision, ids)
        return (hits + 1) / (n + 2)

    # -- quantized drafts: skip set on top, or full depth -------------------
    def _swap(self) -> None:
        """Make the other variant (skip set / full depth) the active one."""
        o = self._other
        self.planner, o.planner = o.planner, self.planner
        self._step_c, o.step_c = o.step_c, self._step_c
        self._c0, o.c0 = o.c0, self._c0
        self._full = not self._full

    def _sets(self) -> tuple[frozenset[int], frozenset[int]]:
        """The sublayers this round's draft skips: the method's set, or none at full depth."""
        return (frozenset(), frozenset()) if self._full else self.skip_sets()

    def _has_variants(self) -> bool:
        return (self.full_depth_variant and self.precision is not None and self.draft_cfg.cost_aware
                and any(self.skip_sets()))

    def _gains(self, budget: int) -> tuple[float, float]:
        """Expected gains of the skip set and of full depth this round (no side effects)."""
        if self._full:
            self._swap()
        g_skip = self._planner().best(self.draft_cost(), budget)[1]
        if not self._has_variants():
            return g_skip, 0.0
        self._swap()
        g_full = self._planner().best(self.draft_cost(), budget)[1]
        self._swap()
        return g_skip, g_full

    def _pick_variant(self, budget: int) -> None:
        """Activate the variant with the higher expected gain (ties: the method's own skip set);
        when neither pays, they take turns, so that each one's own probes still run."""
        g_skip, g_full = self._gains(budget)
        if max(g_skip, g_full) <= 1.0:
            self._turn = not self._turn
            if self._turn:
                self._swap()
        elif g_full > g_skip:
            self._swap()

    def _full_law(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft law over the subset as a law over the whole vocabulary (zero outside)."""
        if self._vocab_index is None:
            return probs
        return probs.new_zeros(self.engine.vocab_size).index_copy_(0, self._vocab_index, probs)

    def draft_cost(self) -> float:
        """c: one draft forward over one plain step, measured (before any draft: the share
        of sublayers the skip set keeps)."""
        if self._step_c is not None and self.planner is not None:
            return self._step_c
        attn, mlp = self._sets()
        if self.precision is None:
            return 1.0 - (len(attn) + len(mlp)) / (2 * self.engine.num_layers)
        if self._c0 is None:  # a quantized draft's cost is not its share of sublayers: time one
            self._c0 = draft_cost_for(self.engine, self.precision, attn, mlp)
        return self._c0

    def _planner(self) -> Planner:
        if self.planner is None:
            full_depth_quant = self.precision is not None and (self._full or self.never_skips)
            self.planner = Planner(VerifyCurve.for_engine(self.engine), self.draft_cfg.max_draft,
                                   width=2 if self.draft_cfg.tree and not self._full else 1,
                                   prior=self._q0 if full_depth_quant else 0.5)
            self.curve = self.planner.curve
        return self.planner

    def expected_gain(self, budget: int) -> float:
        """The best expected gain of drafting this round (1.0: drafting does not pay)."""
        return max(self._gains(min(self.draft_cfg.max_draft, budget)))

    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        if self._full:
            self._swap()
        attn, mlp = self.skip_sets()
        out = {"skip_attn": sorted(attn), "skip_mlp": sorted(mlp), "draft_precision": self.precision or "target",
               "draft_threshold": round(self.threshold.value, 4),
               "draft_vocab": len(self.vocab_ids) if self.vocab_ids is not None else "full"}
        if self.planner is not None:
            out["cost_model"] = {"c": round(self.draft_cost(), 4), **self.planner.report()}
        if self._has_variants():
            self._swap()
            if self.planner is not None:
                out["full_depth"] = {"rounds": self.full_depth_rounds,
                                     "cost_model": {"c": round(self.draft_cost(), 4), **self.planner.report()}}
            self._swap()
        return out

    def propose(self, state: DecodeState, budget: int) -> Draft:
        dc = self.draft_cfg
        cont = state.through_stop(self.ngram(state, budget)[0]) if self.ngram is not None and budget > 0 else []
        budget = min(dc.max_draft, budget)
        plan = None
        if budget > 0 and self._has_variants():
            self._pick_variant(budget)
        elif self._full:
            self._swap()
        if budget > 0 and dc.cost_aware:
            budget = self._planner().plan(self.draft_cost(), budget)
            plan = self.planner.last
        self.full_depth_rounds += self._full and budget > 0
        if cont and dc.cost_aware:  # how many looked-up tokens pay (they cost no draft forward)
            if self._ngram_planner is None:
                self._ngram_planner = Planner(self._planner().curve, self.lookahead)
            cont = cont[: self._ngram_planner.plan(0.0, len(cont))]
        if budget <= 0:
            if cont:  # layer skipping does not pay this round, the n-gram branch alone may (its own plan)
                return Chain(cont, note=DraftNote(hit_limit=True, chain_nodes=0, ngram_path=list(range(len(cont)))),
                             plan=self._ngram_planner.last if self._ngram_planner is not None else plan)
            return NoDraft(plan=plan)
        t0 = time.perf_counter()
        skip_attn, skip_mlp = self._sets()
        # the quantized full-depth variant drafts as specqd does: a chain, no confidence exit
        use_tree = dc.tree and not self._full
        threshold = 0.0 if self._full else self.threshold.value
        tokens, parents, q_rows = [], [], []
        chain_parent = -1
        max_k = max(k for _, k in dc.tree_topk)
        inp = torch.empty(1, dtype=torch.long, device=self.engine.device)
        d, hit_limit = state.pending, True  # d: the newest token fed, drafted from next
        vocab = self.vocab_ids
        node_cap = dc.tree_max_nodes
        if use_tree and dc.cost_aware:  # a planned depth k: verify at most 2k nodes
            node_cap = min(node_cap or 2 * budget, 2 * budget)
        for steps in range(1, budget + 1):
            inp[0] = d
            # logits over the whole vocabulary, or over the draft vocabulary (column i: token vocab[i])
            logits = state.run(inp, skip_attn=skip_attn, skip_mlp=skip_mlp, head=self._vocab_head,
                               weights=self.precision, kv_window=dc.kv_window).logits[0]
            key = None  # rule gumbel: the position's perturbed scores, whose argmax the target takes too
            if state.sampling.greedy:
                probs = logits.softmax(-1)
            else:
                scores = processed_scores(logits, state.sampling)
                probs = scores.softmax(-1)
                if state.noise is not None:
                    g = state.noise(state.next_position)
                    key = scores + (g if vocab is None else g[self._vocab_index])
            if use_tree:
                # one top-k and one host sync: the top-1 probability picks how many siblings to keep
                # (rule gumbel: the candidates in the order the target's perturbed argmax would take them)
                indices = torch.topk(probs if key is None else key, min(max_k, probs.shape[-1])).indices
                values, indices = probs[indices].tolist(), indices.tolist()
                if vocab is not None:
                    indices = [vocab[i] for i in indices]
                conf, d = values[0], indices[0]
                width = dc.topk_for(conf)
                if node_cap is not None:
                    width = max(1, min(width, node_cap - len(tokens)))
                parents.extend([chain_parent] * width)
                chain_parent = len(tokens)
                tokens.extend(indices[:width])
                if node_cap is not None and len(tokens) >= node_cap:
                    break  # node budget spent (counts as the length limit: hit_limit stays True)
            else:
                if key is not None:  # the Gumbel pick: deterministic given the noise, coupled with the target's
                    d, conf = key.argmax(), probs.max()
                elif state.sampling.greedy or cont:  # hybrid trees hold deterministic nodes only
                    conf, d = probs.max(-1)
                else:
                    d = sample_from(probs, state.generator)
                    q_rows.append(self._full_law(probs))  # the law d was drawn from, over the whole vocabulary
                    conf = probs.max()
                conf, d = float(conf), int(d)
                d = d if vocab is None else vocab[d]
                tokens.append(d)
            state.feed(d)
            if conf < threshold:
                hit_limit = False
                break
            if d in state.eos:  # nothing after an end of sequence can be emitted
                break
        if self.planner is not None:  # one draft step over the plain step at this context (VerifyCurve.t1_at)
            step_s, at = (time.perf_counter() - t0) / steps, state.pos + steps // 2
            self._step_c = ema(self._step_c, step_s / self.planner.curve.t1_at(at))
            if self.precision is not None:  # a timed (quantized) draft's c: the store's online refresh
                observe_draft_step(self.engine, self.precision, *self._sets(), step_s, at)
        if plan is not None and (steps < budget or use_tree):  # the round as drafted, not as planned
            plan = self.planner.drafted(steps, len(tokens), self.draft_cost())
        note = DraftNote(hit_limit=hit_limit, chain_nodes=len(tokens))
        tree = parents if use_tree else None
        if cont:
            chain_parents = parents if use_tree else list(range(-1, len(tokens) - 1))
            merged, merged_parents, path = merge_branch(tokens, chain_parents, cont)
            merge = plan is None or self._ngram_planner is None  # unplanned: always merge (the paper-style hybrid)
            if not merge:
                # the branch's rows are verified only when its expected extra tokens pay for them: against a
                # chain accepted 98 % of the time they seldom do (and the merged estimate errs low)
                m_plan = self._merged_plan(steps, len(cont), len(merged))
                merge = len(merged) == len(tokens) or m_plan[0] / m_plan[1] > plan[0] / plan[1]
                if merge:
                    plan = m_plan
            if merge:
                tokens, tree, note.ngram_path = merged, merged_parents if len(merged) > len(chain_parents) else tree, path
        return chain_or_tree(tokens, tree, q=torch.stack(q_rows) if q_rows else None, forwards=steps, note=note, plan=plan)

    def _merged_plan(self, k: int, n: int, nodes: int) -> tuple[float, float]:
        """Expected tokens and cost of a hybrid round: a k-token layer-skip draft and an
        n-token n-gram branch, ``nodes`` verified nodes in all. Depth j is reached when either
        branch reaches it; without joint statistics the larger of the two chances is taken
        (a lower bound, so the prediction errs low)."""
        ls, ng = self.planner.reach(k), self._ngram_planner.reach(n)
        reach = [max(ls[j] if j < k else 0.0, ng[j] if j < n else 0.0) for j in range(max(k, n))]
        return 1.0 + sum(reach), k * self.draft_cost() + self.planner.curve.v(nodes + 1) + self.planner.overhead.value

    def update(self, state: DecodeState, rnd: Round) -> None:
        draft, verdict = rnd.draft, rnd.verdict
        if not isinstance(draft, (Chain, Tree)):  # no draft this round: nothing to learn
            return
        note: DraftNote = draft.note
        steps = draft.forwards
        # the layer-skip draft's own acceptance: accepted nodes among its chain (or tree) nodes
        own = sum(1 for i in verdict.accepted if i < note.chain_nodes)
        if self.draft_cfg.adaptive and steps and not self._full:  # the skip set's own threshold
            self.threshold.update(own, steps, note.hit_limit)
        if self.planner is not None:
            self.planner.observe(steps, own)
        if note.ngram_path and self._ngram_planner is not None:
            self._ngram_planner.observe(len(note.ngram_path), len(set(note.ngram_path) & set(verdict.accepted)))
        owner = self.planner if steps else self._ngram_planner  # the planner whose plan the round was
        if owner is not None:
            owner.observe_round(rnd.steps, draft.plan)
