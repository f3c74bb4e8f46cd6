"""The draft-verify core: exact greedy parity and exact sampling distribution."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from selfspec_cli.methods.asd import ASDConfig
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.methods.self_sd import SkipSet
from selfspec_cli.decoding.drafts import Chain, Tree
from selfspec_cli.decoding import driver, verify
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.decoding.layer_skip import AdaptiveThreshold, DraftSettings
from selfspec_cli.engine import Engine, ForwardTaps, Route
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods import AR
from selfspec_cli.methods.self_sd import SelfSD
from selfspec_cli.methods.base import DraftInputs

from .conftest import ARCHS, VOCAB, make_tiny_model
from .test_decoding import ALPHA, distribution_test


def _prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("vocab", [None, VOCAB // 3], ids=["full-vocab", "draft-vocab"])
def test_self_sd_greedy_equals_ar(arch, tree, vocab):
    """Also with FR-Spec's restricted draft vocabulary (a random third of the tokens)."""
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    ar = AR(eng)
    ids = None if vocab is None else torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:vocab]
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=DraftSettings(cost_aware=False, max_draft=6, threshold=0.3, tree=tree),
                inputs=DraftInputs(vocab=ids))
    if vocab is not None:
        assert sd.describe().draft_vocab == vocab
    drafted = 0
    for seed, n in [(0, 40), (1, 17), (2, 1), (3, 2)]:
        prompt = _prompt(6, seed)
        cfg = GenerationConfig(max_new_tokens=n)
        want = ar.generate(prompt, cfg).token_ids
        res = sd.generate(prompt, cfg)
        assert res.token_ids == want
        st = res.stats
        assert sum(st.accept_lengths) == len(res.token_ids) <= n
        assert st.target_forwards == len(st.accept_lengths)
        assert st.accepted_draft_tokens <= st.drafted_tokens
        drafted += st.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("cap", [1, 3, 7])
def test_tree_node_cap_bounds_every_tree_and_keeps_parity(cap, monkeypatch):
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    want_cfg = GenerationConfig(max_new_tokens=30)
    prompt = _prompt(6, 7)
    want = AR(eng).generate(prompt, want_cfg).token_ids
    # low threshold and wide top-k: without the cap these trees hold up to 6 x 4 nodes
    dc = DraftSettings(cost_aware=False, max_draft=6, threshold=0.0, adaptive=False, tree=True,
                     tree_topk=((1.0, 4),), tree_max_nodes=cap)
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=dc)
    sizes: list[int] = []
    orig = sd.drafter.draft

    def spy(ctx, budget):
        d = orig(ctx, budget)
        sizes.append(len(d.tokens) if isinstance(d, (Chain, Tree)) else 0)
        return d

    monkeypatch.setattr(sd.drafter, "draft", spy)
    res = sd.generate(prompt, want_cfg)
    assert res.token_ids == want
    assert sizes and max(sizes) <= cap
    assert max(sizes) == cap  # the budget is used, not just respected


def test_self_sd_respects_eos_inside_an_accepted_burst():
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    prompt = _prompt(6, 5)
    free = AR(eng).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    eos = free[9]
    cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,))
    sd = SelfSD(eng, skip=SkipSet([3], []), draft=DraftSettings(cost_aware=False, max_draft=8, threshold=0.0))
    res = sd.generate(prompt, cfg)
    assert res.token_ids == free[: free.index(eos) + 1] and res.finish_reason == "eos"


def test_skip_sets_out_of_range_rejected():
    eng = Engine(make_tiny_model("llama-gqa"))
    with pytest.raises(ConfigError, match="out of range"):
        SelfSD(eng, skip=SkipSet([4], []))
    with pytest.raises(ConfigError, match="out of range"):
        SelfSD(eng, skip=SkipSet([], [-1]))


def test_verify_rules_on_hand_built_logits():
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 3, 4, 5]):
        logits[row, tok] = 5.0
    v = verify.verify_chain_greedy([2, 3, 0], logits)
    assert v.accepted == [0, 1] and v.tokens == [2, 3, 4]
    v = verify.verify_chain_greedy([2, 3, 4], logits)
    assert v.tokens == [2, 3, 4, 5]
    # tree: root candidates 1, 2 (node 0, 1); node 1's children 9?, 3 (nodes 2, 3)
    t_logits = torch.full((5, 10), -5.0)
    t_logits[0, 2] = 5.0  # after pending: 2 -> node 1
    t_logits[2, 3] = 5.0  # after node 1: 3 -> node 3
    t_logits[4, 7] = 5.0  # after node 3: bonus 7
    v = verify.verify_tree([1, 2, 9, 3], [-1, -1, 1, 1], t_logits, SamplingConfig(), None)
    assert v.accepted == [1, 3] and v.tokens == [2, 3, 7]


def test_adaptive_threshold_follows_draft_and_verify_update_exactly():
    """Draft & Verify's update, value by value (layer_skip.AdaptiveThreshold): acceptance EMA
    m <- 0.5 m + 0.5 a/d from m = 1; candidate th +- 0.01 (up while m < 0.9); th <- 0.9 th + 0.1
    candidate, so each counted round moves th by exactly 0.001; a round that hit its length limit
    updates m only; th stays in [0, 1]. Computed by hand, not by re-running the formula."""
    th = AdaptiveThreshold(0.6)
    # (accepted, drafted, hit_limit) -> (m, th) after the round
    steps = [
        ((5, 10, False), (0.75, 0.601)),  # m < 0.9: up by 0.1 * 0.01
        ((10, 10, False), (0.875, 0.602)),  # still below the target: up
        ((10, 10, False), (0.9375, 0.601)),  # m >= 0.9: down
        ((0, 10, True), (0.46875, 0.601)),  # hit the length limit: th unchanged, m still moves
        ((4, 8, False), (0.484375, 0.602)),  # a/d = 0.5 (not a whole number of tenths)
        ((8, 8, False), (0.7421875, 0.603)),
        ((8, 8, False), (0.87109375, 0.604)),
        ((8, 8, False), (0.935546875, 0.603)),
    ]
    for (accepted, drafted, hit_limit), (m, value) in steps:
        th.update(accepted=accepted, drafted=drafted, hit_limit=hit_limit)
        assert (th.ema, th.value) == pytest.approx((m, value), abs=1e-12), (accepted, drafted, hit_limit)
    at_target = AdaptiveThreshold(0.6)
    at_target.update(accepted=8, drafted=10, hit_limit=False)  # m = 0.9 exactly: not below the target, so down
    assert (at_target.ema, at_target.value) == pytest.approx((0.9, 0.599), abs=1e-12)
    # clamped to [0, 1]: at 1.0 with low acceptance (0.9 + 0.101 = 1.001), at 0.0 with full acceptance (-0.001)
    top, bottom = AdaptiveThreshold(1.0), AdaptiveThreshold(0.0)
    top.update(accepted=0, drafted=4, hit_limit=False)
    bottom.update(accepted=4, drafted=4, hit_limit=False)
    assert top.value == 1.0 and bottom.value == 0.0


# --- sampling: the joint law of generated tokens 2 and 3 must be the target's -----------
# Every sample decodes 6 tokens, so the first round after the prefill has a draft budget
# of 4 (at most max_draft): tokens 2 and 3 come from accepted drafts, rejections at index
# 0 or 1, or bonus tokens, depending on the path.

SMALL_VOCAB = 40
PAIR_RUN = 6  # tokens decoded per sample: a draft budget of 4 in the first round
SAMPLING = SamplingConfig(temperature=1.0, top_k=25, top_p=0.95)


def _exact_pair_law(model, prompt: list[int]) -> np.ndarray:
    """P(t2, t3 | prompt) under the target's processed distribution, by enumeration."""
    v = SMALL_VOCAB
    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([prompt])).logits[0, -1], SAMPLING)  # (V,)
        seq2 = torch.tensor([prompt + [a] for a in range(v)])
        p2 = processed_probs(model(seq2).logits[:, -1], SAMPLING)  # (V, V): [t1, t2]
        seq3 = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(v), range(v))])
        p3 = processed_probs(model(seq3).logits[:, -1], SAMPLING).view(v, v, v)  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).double().numpy().reshape(-1)  # over (t2, t3)


def _pair_samples(method, prompt: list[int], n: int, rule: str = "speculative") -> list[int]:
    """Tokens 2 and 3 of ``n`` seeded runs. The sampling tests of each method run the
    speculative rule (their controls break its verifier); tests/test_sampling_rule.py runs
    the gumbel rule."""
    out = []
    for s in range(n):
        cfg = GenerationConfig(max_new_tokens=PAIR_RUN, sampling=SamplingConfig(SAMPLING.temperature, SAMPLING.top_k,
                                                                                SAMPLING.top_p, s, rule))
        t = method.generate(prompt, cfg).token_ids
        out.append(t[1] * SMALL_VOCAB + t[2])
    return out


@pytest.fixture(scope="module")
def small_vocab_setup():
    model = make_tiny_model("llama-gqa", vocab=SMALL_VOCAB, layers=4)
    with torch.no_grad():  # flatten a little so that drafts get rejected often enough
        model.lm_head.weight.mul_(0.25)
    prompt = _prompt(5, 11, SMALL_VOCAB)
    return model, prompt, _exact_pair_law(model, prompt)


# False-positive rate per test: ALPHA = 1e-3.
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_self_sd_sampling_is_exact(small_vocab_setup, tree):
    model, prompt, law = small_vocab_setup
    sd = SelfSD(Engine(model), skip=SkipSet([1, 2], [2]), draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.0, tree=tree))
    samples = _pair_samples(sd, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


def accept_all(draft_tokens, q, target_logits, cfg, gen):
    """A broken chain rule for the controls: every draft accepted (p and q ignored)."""
    p = processed_probs(target_logits, cfg)
    return verify.Verdict(list(range(len(draft_tokens))), [*draft_tokens, int(torch.multinomial(p[len(draft_tokens)], 1, generator=gen))])


def test_sampling_test_catches_a_broken_acceptance_rule(small_vocab_setup, monkeypatch):
    """Control: accepting every sampled draft (ignoring p/q) must fail the same test."""
    model, prompt, law = small_vocab_setup
    monkeypatch.setattr(driver, "verify_chain_sampling", accept_all)
    sd = SelfSD(Engine(model), skip=SkipSet([1, 2], [2]), draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.0))
    samples = _pair_samples(sd, prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


# --- ASD ----------------------------------------------------------------------------------

def test_admg_rules():
    from selfspec_cli.methods.asd import admg

    cos = [0.90, 0.99, 0.97, 0.995, 0.99, 0.999, 0.98, 0.999]  # L = 8
    attn, mlp = admg(cos, alpha=0.985, m=3, n=2)
    # 1-based: CS rule {2, 4, 5, 6} (8 excluded by n=2, 8 > 6); MLP every 3rd: {3, 6}; attn |= mlp
    assert mlp == {2, 5}
    assert attn == {1, 3, 4, 5, 2}


def test_engine_attention_cosine_matches_hooks():
    model = make_tiny_model("llama-gqa", layers=4)
    ids = torch.tensor(_prompt(9, 0))
    # reference: cos between residual before attention and after adding its output
    with torch.no_grad():
        hs = []
        h = model.model.embed_tokens(ids[None])
        pos = torch.arange(len(ids))[None]
        pe = model.model.rotary_emb(h, pos)
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        for layer in model.model.layers:
            a, _ = layer.self_attn(layer.input_layernorm(h), position_embeddings=pe, attention_mask=mask)
            hs.append(torch.nn.functional.cosine_similarity(h, h + a, dim=-1).mean().item())
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    eng = Engine(model)
    out = eng.forward(eng.new_cache(16), ids, positions=0, taps=ForwardTaps(attn_cosine=True))
    assert out.attn_cosine.tolist() == pytest.approx(hs, abs=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_asd_greedy_equals_ar(arch):
    from selfspec_cli.methods.asd import ASD

    model = make_tiny_model(arch, layers=8)
    eng = Engine(model)
    ar = AR(eng)
    asd = ASD(eng, config=ASDConfig(asd_alpha=0.5, asd_m=3, asd_n=2))  # low alpha: random tiny models have low cosines
    for seed in range(3):
        prompt = _prompt(8, seed)
        cfg = GenerationConfig(max_new_tokens=30)
        res = asd.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        assert res.stats.report.skip_mlp == [2, 5]


def test_asd_sampling_is_exact(small_vocab_setup):
    from selfspec_cli.methods.asd import ASD

    model, prompt, law = small_vocab_setup
    asd = ASD(Engine(model), config=ASDConfig(asd_alpha=0.3, asd_m=2, asd_n=1), draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.0))
    samples = _pair_samples(asd, prompt, 2500)
    assert asd.skip_sets()[0] or asd.skip_sets()[1]
    assert distribution_test(samples, law) > ALPHA


# --- SWIFT --------------------------------------------------------------------------------

def _swift(eng, **kw):
    from selfspec_cli.methods.swift import Swift, SwiftConfig

    return Swift(eng, config=SwiftConfig(**{"context_window": 8, "bo_interval": 4, "paper_drafting": True, "optimize_budget": 1.0, **kw}))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_swift_greedy_equals_ar_and_carries_state(arch):
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    ar = AR(eng)
    sw = _swift(eng)
    steps = []
    for seed in range(3):
        prompt = _prompt(7, seed)
        cfg = GenerationConfig(max_new_tokens=40)
        res = sw.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        steps.append(res.stats.report.source.swift.step)
    assert steps[0] > 0 and steps == sorted(steps)  # optimization state carried across prompts
    assert all(len(h.skip[0]) + len(h.skip[1]) >= 1 for h in sw.search.history)


def test_swift_scoring_leaves_the_cache_intact():
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    ids = torch.tensor(_prompt(20, 3))
    cache = eng.new_cache(64)
    eng.forward(cache, ids, positions=0)
    k_before, v_before, len_before = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    with cache.scratch(12, 8):
        eng.forward(cache, ids[12:20], positions=12, route=Route(skip_attn={1, 2}, skip_mlp={3}))
    assert cache.lengths == len_before
    assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before)


def test_swift_lowers_skip_ratio_when_acceptance_stays_low():
    model = make_tiny_model("llama-gqa", layers=8)
    eng = Engine(model)
    sw = _swift(eng, skip_ratio=0.6, acceptance_tolerance=0.99, acceptance_window=4, max_steps=3)
    for seed in range(2):
        sw.generate(_prompt(7, seed), GenerationConfig(max_new_tokens=40))
    assert sw.search.ratio < 0.6


def test_swift_sampling_is_exact(small_vocab_setup):
    model, prompt, law = small_vocab_setup
    sw = _swift(Engine(model), context_window=2)
    samples = _pair_samples(sw, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


def test_swift_save_layers_loads_into_self_sd(tmp_path):
    from selfspec_cli.methods.self_sd import SkipSet

    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    sw = _swift(eng)
    sw.generate(_prompt(7, 0), GenerationConfig(max_new_tokens=30))
    path = sw.save_layers(tmp_path / "swift.json")
    s = SkipSet.load(path, model)
    attn, mlp, manifest = s.attn, s.mlp, s.manifest
    assert (attn, mlp) == sw.skip_sets() and manifest["search"]["method"] == "swift"
    sd = SelfSD(eng, skip=SkipSet(attn, mlp))
    cfg = GenerationConfig(max_new_tokens=20)
    assert sd.generate(_prompt(5, 1), cfg).token_ids == AR(eng).generate(_prompt(5, 1), cfg).token_ids


def test_swift_search_keeps_to_its_budget(monkeypatch):
    """optimize_budget 0: no skip set is ever scored; a full budget: the search runs."""
    from selfspec_cli.methods.swift import SwiftSearch

    scored = []
    real = SwiftSearch._score
    monkeypatch.setattr(SwiftSearch, "_score", lambda self, *a: scored.append(1) or real(self, *a))
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    prompt, cfg = _prompt(6, 0), GenerationConfig(max_new_tokens=40)
    _swift(eng, optimize_budget=0.0).generate(prompt, cfg)
    assert not scored
    _swift(eng, optimize_budget=1.0).generate(prompt, cfg)
    assert scored


@pytest.mark.parametrize("seed", range(6))
def test_swift_gaussian_process_is_scikit_learns(seed):
    """SWIFT's Matern-5/2 regressor (NumPy) against scikit-learn's GaussianProcessRegressor with the
    same kernel, noise and normalization, on binary candidates like SWIFT's: a length scale at least as
    likely, and then the same predictions and the same UCB pick."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import Matern

    from selfspec_cli.methods.swift import MaternGP

    rng = np.random.default_rng(seed)
    P, k, n = 12, 4, 8 + 4 * seed  # SWIFT-like: few sublayers, k of them skipped, 8-28 observations
    X = np.zeros((n, P))
    for row in X:
        row[rng.choice(P, k, replace=False)] = 1.0
    y = rng.random(n)
    Xs = np.zeros((64, P))
    for row in Xs:
        row[rng.choice(P, k, replace=False)] = 1.0
    sk = GaussianProcessRegressor(kernel=Matern(nu=2.5), alpha=1e-2, normalize_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        sk.fit(X, y)
    ours = MaternGP().fit(X, y)
    sk_length = float(sk.kernel_.length_scale)
    # its length scale is at least as likely as the one scikit-learn's optimizer stops at
    assert ours._lml(np.log(ours.length)) >= ours._lml(np.log(sk_length)) - 1e-6
    assert ours._lml(np.log(sk_length)) == pytest.approx(sk.log_marginal_likelihood_value_, abs=1e-6)
    # and at that length scale its posterior is scikit-learn's, to rounding, and so is the UCB pick
    fixed = GaussianProcessRegressor(kernel=Matern(length_scale=ours.length, length_scale_bounds="fixed", nu=2.5),
                                     alpha=1e-2, normalize_y=True, optimizer=None).fit(X, y)
    mu, sd = ours.predict(Xs)
    smu, ssd = fixed.predict(Xs, return_std=True)
    assert np.allclose(mu, smu, rtol=1e-6, atol=1e-9) and np.allclose(sd, ssd, rtol=1e-5, atol=1e-9)
    assert int(np.argmax(mu + 2.0 * sd)) == int(np.argmax(smu + 2.0 * ssd))
