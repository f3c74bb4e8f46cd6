"""The draft-verify core: exact greedy parity and exact sampling distribution."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding import speculative, verify
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.decoding.speculative import AdaptiveThreshold, DraftConfig
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods import AR
from selfspec_cli.methods.self_sd import SelfSD

from .conftest import ARCHS, VOCAB, make_tiny_model
from .test_decoding import ALPHA, distribution_test


def _prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_self_sd_greedy_equals_ar(arch, tree):
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    ar = AR(eng)
    sd = SelfSD(eng, skip_attn=[1, 3], skip_mlp=[2, 4], draft=DraftConfig(max_draft=6, threshold=0.3, tree=tree))
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


def test_self_sd_respects_eos_inside_an_accepted_burst():
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    prompt = _prompt(6, 5)
    free = AR(eng).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    eos = free[9]
    cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,))
    sd = SelfSD(eng, skip_attn=[3], skip_mlp=[], draft=DraftConfig(max_draft=8, threshold=0.0))
    res = sd.generate(prompt, cfg)
    assert res.token_ids == free[: free.index(eos) + 1] and res.finish_reason == "eos"


def test_skip_sets_out_of_range_rejected():
    eng = Engine(make_tiny_model("llama-gqa"))
    with pytest.raises(ConfigError, match="out of range"):
        SelfSD(eng, skip_attn=[4], skip_mlp=[])
    with pytest.raises(ConfigError, match="out of range"):
        SelfSD(eng, skip_attn=[], skip_mlp=[-1])


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


def test_adaptive_threshold_moves_toward_target():
    th = AdaptiveThreshold(0.6)
    for _ in range(20):
        th.update(accepted=1, drafted=10, hit_limit=False)
    assert th.value > 0.6
    th2 = AdaptiveThreshold(0.6)
    for _ in range(20):
        th2.update(accepted=10, drafted=10, hit_limit=False)
    assert th2.value < 0.6
    th3 = AdaptiveThreshold(0.6)
    th3.update(accepted=0, drafted=10, hit_limit=True)
    assert th3.value == 0.6


# --- sampling: the joint law of generated tokens 2 and 3 must be the target's -----------

SMALL_VOCAB = 40
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


def _pair_samples(method, prompt: list[int], n: int) -> list[int]:
    out = []
    for s in range(n):
        cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, s))
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
    sd = SelfSD(Engine(model), skip_attn=[1, 2], skip_mlp=[2], draft=DraftConfig(max_draft=4, threshold=0.0, tree=tree))
    samples = _pair_samples(sd, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


def test_sampling_test_catches_a_broken_acceptance_rule(small_vocab_setup, monkeypatch):
    """Control: accepting every sampled draft (ignoring p/q) must fail the same test."""
    model, prompt, law = small_vocab_setup

    def accept_all(draft_tokens, q, target_logits, cfg, gen):
        p = processed_probs(target_logits, cfg)
        return verify.Verdict(list(range(len(draft_tokens))), [*draft_tokens, int(torch.multinomial(p[len(draft_tokens)], 1, generator=gen))])

    monkeypatch.setattr(speculative, "verify_chain_sampling", accept_all)
    sd = SelfSD(Engine(model), skip_attn=[1, 2], skip_mlp=[2], draft=DraftConfig(max_draft=4, threshold=0.0))
    samples = _pair_samples(sd, prompt, 2500)
    assert distribution_test(samples, law) < ALPHA
