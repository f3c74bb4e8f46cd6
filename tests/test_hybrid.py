"""Hybrid drafts (decoding/hybrid.py): the n-gram continuation of the context merged into
the layer-skip draft as one candidate tree, verified in one forward by the exact tree rule."""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.methods.self_sd import SkipSet
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding import driver, verify
from selfspec_cli.decoding import cost_store
from selfspec_cli.decoding.measure import VerifyCurve, prior_draft_cost
from selfspec_cli.decoding.planning import Planner
from selfspec_cli.decoding.drafts import Chain, Tree
from selfspec_cli.decoding.hybrid import Hybrid, merge_branch, merged_plan
from selfspec_cli.decoding.layer_skip import DraftSettings
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.engine import TARGET, Engine
from selfspec_cli.methods import AR, build
from selfspec_cli.methods.base import DraftInputs
from selfspec_cli.methods.pld import lookup
from selfspec_cli.methods.self_sd import SelfSD

from .conftest import ARCHS, charge_forwards, make_tiny_model
from .test_decoding import ALPHA, distribution_test
from .test_speculative import SMALL_VOCAB, _exact_pair_law, _pair_samples


def test_merge_branch_shares_the_agreeing_prefix():
    # chain a b c; branch a b x y -> x, y hang under b
    tokens, parents, path = merge_branch([5, 6, 7], [-1, 0, 1], [5, 6, 8, 9])
    assert tokens == [5, 6, 7, 8, 9] and parents == [-1, 0, 1, 1, 3] and path == [0, 1, 3, 4]
    # a branch inside the tree adds nothing
    assert merge_branch([5, 6], [-1, 0], [5, 6]) == ([5, 6], [-1, 0], [0, 1])
    # a branch that disagrees at once becomes a sibling of the root's child
    assert merge_branch([5], [-1], [4, 4])[:2] == ([5, 4, 4], [-1, -1, 1])


def _repetitive(n: int, period: int, seed: int, vocab: int) -> list[int]:
    base = torch.randint(2, vocab, (period,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (base * (n // period + 1))[:n]


class _Lookup:
    """An n-gram source: prompt lookup of 3- down to 1-grams, at most 6 tokens."""

    def candidate(self, state, budget):
        return lookup(state.committed, 3, 1, min(6, budget))

    def begin(self, state, prefill):
        pass


def _hybrid(eng, tree: bool = False, skip: SkipSet = SkipSet([1, 3], [2, 4])) -> SelfSD:
    return SelfSD(eng, skip=skip, draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.0, tree=tree),
                  inputs=DraftInputs(ngram=_Lookup()))


def _is_hybrid(drafter) -> bool:
    """The stack merges an n-gram branch (outside it at most the adapting skip source's wrapper)."""
    return isinstance(drafter, Hybrid) or isinstance(getattr(drafter, "inner", None), Hybrid)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hybrid_greedy_equals_ar(arch, tree, monkeypatch):
    eng = Engine(make_tiny_model(arch, layers=6))
    ar, sd = AR(eng), _hybrid(eng, tree)
    offered = merged = 0
    real = Hybrid.draft

    def spy(self, state, budget):
        nonlocal offered, merged
        d = real(self, state, budget)
        path = getattr(d.note, "ngram_path", None) if isinstance(d, (Chain, Tree)) else None
        offered += path is not None
        merged += isinstance(d, Tree) and path is not None and d.forwards > 0
        return d

    monkeypatch.setattr(Hybrid, "draft", spy)
    for seed, n in [(0, 40), (1, 17), (2, 2)]:
        prompt = _repetitive(24, 5, seed, 300)
        cfg = GenerationConfig(max_new_tokens=n)
        assert sd.generate(prompt, cfg).token_ids == ar.generate(prompt, cfg).token_ids
    if not eng.exact_trees:  # a head size the kernel's attention does not take: no trees, so no n-gram branch
        assert offered == 0 and not _is_hybrid(sd.drafter)
        return
    assert offered > 0  # n-gram branches were offered every time
    if arch == "llama-gqa":  # and on this model they left the layer-skip draft: real two-source trees
        assert merged > 0


def test_hybrid_through_the_registry_and_auto():
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    prompt = _repetitive(30, 4, 3, 300)
    cfg = GenerationConfig(max_new_tokens=30)
    want = AR(eng).generate(prompt, cfg).token_ids
    m = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2, 4), hybrid=True, draft_vocab="full")
    assert _is_hybrid(m.drafter) and m.generate(prompt, cfg).token_ids == want
    auto = build("auto", eng)
    assert auto.layer_skip is None or _is_hybrid(auto.layer_skip.drafter)
    assert auto.generate(prompt, cfg).token_ids == want
    assert not _is_hybrid(build("auto", eng, None, hybrid=False).layer_skip.drafter)


@pytest.fixture(scope="module")
def repetitive_setup():
    model = make_tiny_model("llama-gqa", vocab=SMALL_VOCAB, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = _repetitive(9, 3, 4, SMALL_VOCAB)
    return model, prompt, _exact_pair_law(model, prompt)


# False-positive rate per test: ALPHA = 1e-3.
def test_hybrid_sampling_is_exact(repetitive_setup):
    model, prompt, law = repetitive_setup
    samples = _pair_samples(_hybrid(Engine(model), skip=SkipSet([1, 2], [2])), prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


def _first_branch_always(tokens, parents, target_logits, cfg, generator):
    """A broken tree rule for the control: walk the first child at every node, accepting it unseen."""
    accepted, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            p = processed_probs(target_logits[node + 1], cfg)
            return verify.Verdict(accepted, [*(tokens[i] for i in accepted), int(torch.multinomial(p, 1, generator=generator))])
        accepted.append(kids[0])
        node = kids[0]


def test_hybrid_sampling_test_catches_a_broken_tree_rule(repetitive_setup, monkeypatch):
    model, prompt, law = repetitive_setup
    monkeypatch.setattr(driver, "verify_tree", _first_branch_always)
    samples = _pair_samples(_hybrid(Engine(model), skip=SkipSet([1, 2], [2])), prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


# v(m) for every row count a hybrid round verifies (at most 4 + 6 nodes + the pending token), 1 s plain step
VH = {m: 1.0 + 0.05 * (m - 1) for m in range(1, 17)}


def _self_sd_on_curve(curve: VerifyCurve, **parts) -> SelfSD:
    """Self-SD on a 6-layer tiny model skipping 4 of its 12 sublayers, planning with ``curve``."""
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    cost_store.set_curve(eng, curve)  # the engine's curve: the planners and the driver's unit read it
    return SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=DraftSettings(max_draft=4, threshold=0.0), **parts)


def test_merged_plan_by_hand():
    """A hybrid round's plan (``merged_plan``): depth j is reached with the larger of the two
    branches' chances, each branch counted up to its own length; the cost is k draft steps, one
    verification of every node and the learned overhead. Here with acceptances set by hand."""
    curve = VerifyCurve(1.0, {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.5, 16: 2.5})
    drafter = _self_sd_on_curve(curve).configuration
    ngram = Planner(curve, drafter.lookahead)
    for _ in range(10):
        drafter.policy.planner.acceptance.observe(2, 2)  # layer skip: depths 1-2 accepted 10 of 10 -> 11/12, then 71/72
    ngram.acceptance.observe(3, 3)  # n-gram: depths 1-3 accepted 1 of 1 -> 2/3, 7/9, 23/27
    drafter.policy.planner.overhead.value = 0.1
    # a 2-token layer-skip chain, a 3-token n-gram branch, 5 nodes in all
    e, cost = merged_plan(drafter.policy.planner, ngram, 2, 3, 5, drafter.policy.draft_cost())
    ls = [11 / 12, 11 / 12 * 71 / 72]
    ng = [2 / 3, 2 / 3 * 7 / 9, 2 / 3 * 7 / 9 * 23 / 27]
    assert e == pytest.approx(1 + ls[0] + ls[1] + ng[2])  # layer skip is the likelier at depths 1-2, only n-gram reaches 3
    # c: the weight bytes the skip set reads over a step's (no draft timed yet); v(6) = 1.15 + 2 * (1.5 - 1.15) / 4
    c = prior_draft_cost(drafter.engine, frozenset({1, 3}), frozenset({2, 4}))
    assert 0.5 < c < 0.9 and cost == pytest.approx(2 * c + 1.325 + 0.1)


def test_hybrid_round_plans_both_branches(monkeypatch, virtual_clock):
    """On a machine whose forwards cost exactly what the planners assume (a draft step the share of
    sublayers it runs, a verification of m rows v(m) plain steps; conftest.VirtualClock), every
    drafting round, merged ones included, costs what its plan said: the driver's ``Round.steps``
    equals the plan's cost and neither planner learns an overhead. Each round teaches its owner:
    the layer-skip planner when it drafted, the n-gram planner for an n-gram-only round."""
    curve = VerifyCurve(1.0, dict(VH))
    L = 6

    def cost(engine, rows, kw):
        if isinstance(kw["positions"], int) and kw["positions"] == 0:  # prefill (a tree's positions are a tensor)
            return 0.0
        route = kw.get("route", TARGET)
        skipped = len(route.skip_attn) + len(route.skip_mlp)
        return prior_draft_cost(engine, route.skip_attn, route.skip_mlp) if skipped else VH[rows]

    charge_forwards(monkeypatch, virtual_clock, cost)
    sd = _self_sd_on_curve(curve, inputs=DraftInputs(ngram=_Lookup()))
    hybrid = sd.drafter
    drafter = hybrid.chain
    hybrid.ngram_planner = Planner(curve, drafter.lookahead)
    for _ in range(100):  # both branches look worth drafting
        drafter.policy.planner.acceptance.observe(4, 4)
        hybrid.ngram_planner.acceptance.observe(6, 6)
    rounds = []
    real = hybrid.accept

    def spy(state, rnd):
        d = rnd.draft
        if isinstance(d, (Chain, Tree)) and d.tokens:
            path = d.note.ngram_path or []
            ls, ng = drafter.policy.planner.reach(d.forwards), hybrid.ngram_planner.reach(len(path))
            rounds.append((d.plan, rnd.steps, d.forwards, bool(path), ls, ng))
        real(state, rnd)

    hybrid.accept = spy
    sd.generate(_repetitive(30, 5, 0, 64), GenerationConfig(max_new_tokens=24, ignore_eos=True))
    merged = [r for r in rounds if r[2] and r[3]]
    assert merged, "no merged round was drafted"
    # the draft step as timed: the share of the weight bytes it reads, as the prior said
    assert drafter.policy.draft_cost() == pytest.approx(prior_draft_cost(drafter.engine, *drafter.skip_sets()))
    for (e, planned), measured, k, _, ls, ng in rounds:
        assert measured == pytest.approx(planned, abs=1e-9), rounds  # the plan is what the round cost
    for (e, _), _, k, _, ls, ng in merged:
        assert 1 + max(sum(ls), sum(ng)) - 1e-9 <= e <= 1 + sum(ls) + sum(ng) + 1e-9
    assert drafter.policy.planner.overhead.value == pytest.approx(0.0, abs=1e-9)
    assert hybrid.ngram_planner.overhead.value == pytest.approx(0.0, abs=1e-9)
    assert drafter.policy.planner.overhead.rounds == sum(1 for r in rounds if r[2])
    assert hybrid.ngram_planner.overhead.rounds == sum(1 for r in rounds if not r[2])
