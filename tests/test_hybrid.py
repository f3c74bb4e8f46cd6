"""Hybrid drafts (decoding/layer_skip.py): the n-gram continuation of the context merged into
the layer-skip draft as one candidate tree, verified in one forward by the exact tree rule."""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.artifacts import SkipSet
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding import driver, verify
from selfspec_cli.decoding.cost import Planner, VerifyCurve
from selfspec_cli.decoding.drafts import Chain, Tree
from selfspec_cli.decoding.layer_skip import DraftConfig, LayerSkipProposer, merge_branch
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.engine import Engine
from selfspec_cli.methods import AR, build
from selfspec_cli.methods.pld import lookup
from selfspec_cli.methods.self_sd import SelfSD

from .conftest import ARCHS, make_tiny_model
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


def _hybrid(eng, tree: bool = False, skip: SkipSet = SkipSet([1, 3], [2, 4])) -> SelfSD:
    sd = SelfSD(eng, skip=skip, draft=DraftConfig(cost_aware=False, max_draft=4, threshold=0.0, tree=tree))
    sd.ngram = lambda state, budget: lookup(state.committed, 3, 1, min(6, budget))
    return sd


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hybrid_greedy_equals_ar(arch, tree, monkeypatch):
    eng = Engine(make_tiny_model(arch, layers=6))
    ar, sd = AR(eng), _hybrid(eng, tree)
    offered = merged = 0
    real = LayerSkipProposer.propose

    def spy(self, state, budget):
        nonlocal offered, merged
        d = real(self, state, budget)
        path = getattr(d.note, "ngram_path", None) if isinstance(d, (Chain, Tree)) else None
        offered += path is not None
        merged += isinstance(d, Tree) and path is not None and d.forwards > 0
        return d

    monkeypatch.setattr(LayerSkipProposer, "propose", spy)
    for seed, n in [(0, 40), (1, 17), (2, 2)]:
        prompt = _repetitive(24, 5, seed, 300)
        cfg = GenerationConfig(max_new_tokens=n)
        assert sd.generate(prompt, cfg).token_ids == ar.generate(prompt, cfg).token_ids
    assert offered > 0  # n-gram branches were offered every time
    if arch == "llama-gqa":  # and on this model they left the layer-skip draft: real two-source trees
        assert merged > 0


def test_hybrid_through_the_registry_and_auto():
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    prompt = _repetitive(30, 4, 3, 300)
    cfg = GenerationConfig(max_new_tokens=30)
    want = AR(eng).generate(prompt, cfg).token_ids
    m = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2, 4), hybrid=True, draft_vocab="full")
    assert m.ngram is not None and m.generate(prompt, cfg).token_ids == want
    auto = build("auto", eng)
    assert auto.layer_skip is None or auto.layer_skip.ngram is not None
    assert auto.generate(prompt, cfg).token_ids == want
    assert build("auto", eng, None, hybrid=False).layer_skip.ngram is None


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


def test_hybrid_round_plans_both_branches():
    """A merged round's plan counts both branches: expected tokens at least the larger branch's,
    cost k c + v(nodes + 1) + o with every verified node (decoding/layer_skip.py ``_merged_plan``)."""
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=DraftConfig(max_draft=4, threshold=0.0))
    sd.ngram = lambda state, budget: lookup(state.committed, 3, 1, min(6, budget))
    # fixed costs (a verify curve with a 1 s plain step makes every draft forward cheap), so the
    # planners' choices do not depend on how loaded the machine is
    curve = VerifyCurve(1.0, {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.5, 16: 2.5})
    sd.planner = Planner(curve, sd.draft_cfg.max_draft)
    sd._ngram_planner = Planner(curve, sd.lookahead)
    for _ in range(100):  # both branches look worth drafting
        sd.planner.acceptance.observe(4, 4)
        sd._ngram_planner.acceptance.observe(6, 6)
    plans = []
    real = LayerSkipProposer.propose

    def spy(self, state, budget):
        d = real(self, state, budget)
        if isinstance(d, (Chain, Tree)) and d.forwards and d.note.ngram_path:
            ls, ng = self.planner.reach(d.forwards), self._ngram_planner.reach(len(d.note.ngram_path))
            plans.append((d.plan, ls, ng, len(d.tokens), d.forwards, self.planner.overhead.value))
        return d

    sd.propose = spy.__get__(sd)
    sd.generate(_repetitive(30, 5, 0, 64), GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert plans, "no merged round was drafted"
    # the merged rounds' measured costs taught the layer-skip planner its overhead (the round's owner)
    assert sd.planner.overhead.rounds > 0 and sd.planner.overhead.value == pytest.approx(plans[-1][-1], abs=1.0)
    for (e, cost), ls, ng, nodes, k, o in plans:
        assert e >= 1 + max(sum(ls), sum(ng)) - 1e-9 and e <= 1 + sum(ls) + sum(ng) + 1e-9
        assert cost == pytest.approx(k * sd.draft_cost() + sd.planner.curve.v(nodes + 1) + o, rel=0.3)
