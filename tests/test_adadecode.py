"""AdaDecode: greedy output equals plain decoding token for token (with many early
predictions and rejections), and sampling follows exactly the target's law."""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding.drafts import NoDraft
from selfspec_cli.engine import Engine
from selfspec_cli.engine.adapter import GEMMA_TYPES, gemma_norm_weight
from selfspec_cli.methods.adadecode.heads import LowRankHead, init_head
from selfspec_cli.methods import AR
from selfspec_cli.methods import adadecode as ada
from selfspec_cli.methods.adadecode import AdaDecode, AdaDecodeConfig

from .conftest import ARCHS, make_tiny_model
from .test_decoding import ALPHA, distribution_test
from .test_speculative import _pair_samples, _prompt, small_vocab_setup  # noqa: F401 (fixture)


def random_heads(model, layers, rank=8, seed=0) -> dict[int, LowRankHead]:
    """Heads with a non-zero low-rank update, so the whole head path is exercised."""
    g = torch.Generator().manual_seed(seed)
    norm = model.model.norm.weight.detach()
    if model.config.model_type in GEMMA_TYPES:  # the final norm's weight is 1 + w there, as the engine reads it
        norm = gemma_norm_weight(norm)
    out = {}
    for k in layers:
        h = init_head(norm, rank, g)
        out[k] = LowRankHead(h.a, torch.randn(h.b.shape, generator=g) * 0.3, h.g)
    return out


def _record_rounds(method) -> list[tuple[int, list[int]]]:
    """Per round of ``method``: the tokens already emitted when it began, and the early predictions it drafted."""
    rounds: list[tuple[int, list[int]]] = []
    propose = method.drafter.draft

    def spy(state, budget):
        d = propose(state, budget)
        rounds.append((len(state.output), [] if isinstance(d, NoDraft) else list(d.tokens)))
        return d

    method.drafter.draft = spy
    return rounds


def _check_stats_replay(st, rounds, want) -> int:
    """The statistics replayed from the drafts against plain decoding's tokens ``want`` (which end where
    the output must: max_new_tokens or the end-of-sequence token): a round keeps the predictions that
    match ``want`` from where it started plus one token, cut where ``want`` ends. Returns the cut rounds."""
    lengths, accepted, cut = [1], 0, 0
    for done, tokens in rounds:
        match = next((j for j, t in enumerate(tokens) if done + j >= len(want) or t != want[done + j]), len(tokens))
        kept = min(match + 1, len(want) - done)
        cut += kept < match + 1
        lengths.append(kept)
        accepted += min(match, kept)
    assert st.accept_lengths == lengths and sum(lengths) == len(want)
    assert st.drafted_tokens == sum(len(t) for _, t in rounds) and st.accepted_draft_tokens == accepted
    assert st.draft_rounds == sum(1 for _, t in rounds if t)
    return cut


@pytest.mark.parametrize("arch", list(ARCHS))
def test_adadecode_greedy_equals_ar(arch):
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    ar = AR(eng)
    # a low threshold: many early predictions, many of them wrong (rejections and rollbacks)
    method = AdaDecode(eng, heads=random_heads(model, [0, 2, 3]), config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.02))
    rounds = _record_rounds(method)
    drafted = rejected = 0
    for seed, n in [(0, 40), (1, 17), (2, 1), (3, 2), (4, 33)]:
        prompt = _prompt(6, seed)
        cfg = GenerationConfig(max_new_tokens=n)
        rounds.clear()
        res = method.generate(prompt, cfg)
        want = ar.generate(prompt, cfg).token_ids
        assert res.token_ids == want
        st = res.stats
        _check_stats_replay(st, rounds, want)
        drafted += st.drafted_tokens
        rejected += st.drafted_tokens - st.accepted_draft_tokens
    assert drafted > 20
    if arch == "llama-gqa":
        assert rejected > 0  # the rollback path ran


def test_adadecode_pending_limit_and_eos():
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    prompt = _prompt(6, 5)
    free = AR(eng).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    eos = free[9]
    for max_pending in (1, 2, 5):
        m = AdaDecode(eng, heads=random_heads(model, [1, 3]), config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0, adadecode_max_pending=max_pending))
        res = m.generate(prompt, GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,)))
        assert res.token_ids == free[: free.index(eos) + 1] and res.finish_reason == "eos"
        assert max(res.stats.accept_lengths) <= max_pending + 1


def test_adadecode_statistics_when_every_early_token_is_right():
    """Heads that are always right: layers 3-5 add nothing and the head at layer 2 is the logit lens
    (the final norm and LM head on its output), so every early prediction is accepted and a round
    emits max_pending + 1 tokens, except the one whose early tokens end at the end-of-sequence
    token: the target's token after it is cut. The statistics are the replay of the drafts."""
    model = make_tiny_model("llama-gqa", layers=6)
    with torch.no_grad():
        for layer in model.model.layers[3:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    eng = Engine(model)
    lens = init_head(model.model.norm.weight.detach(), 8, torch.Generator().manual_seed(0))
    prompt = _prompt(6, 5)
    free = AR(eng).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    # an end-of-sequence token that first appears inside a round's early tokens (not as a round's last token)
    k = next(i for i in range(9, 40) if free[i] not in free[:i] and i % 4)
    m = AdaDecode(eng, heads={2: lens}, config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0,
                                                                adadecode_max_pending=3))
    rounds = _record_rounds(m)
    res = m.generate(prompt, GenerationConfig(max_new_tokens=40, eos_token_ids=(free[k],)))
    assert res.token_ids == free[: k + 1] and res.finish_reason == "eos"
    assert _check_stats_replay(res.stats, rounds, free[: k + 1]) == 1  # the round that reached the end was cut
    assert res.stats.accept_lengths[1:-1] == [4] * (len(rounds) - 1)  # three early tokens and the target's, each round
    assert res.stats.accepted_draft_tokens == res.stats.drafted_tokens == k - k // 4  # every token but the rounds' own


# False-positive rate per test: ALPHA = 1e-3.
@pytest.mark.slow  # 2,500 decodes; fast: test_verify_exact's AdaDecode enumeration
def test_adadecode_sampling_is_exact(small_vocab_setup):  # noqa: F811
    model, prompt, law = small_vocab_setup
    m = AdaDecode(Engine(model), heads=random_heads(model, [0, 1, 2], seed=3), config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0))
    samples = _pair_samples(m, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


@pytest.mark.slow  # 2,500 decodes; fast: test_verify_exact's AdaDecode enumeration
def test_sampling_test_catches_the_papers_rule(small_vocab_setup, monkeypatch):  # noqa: F811
    """Control: the paper's rule (draft law = the head's distribution although the
    token was taken deterministically) is biased, and the same test must reject it."""
    model, prompt, law = small_vocab_setup
    monkeypatch.setattr(ada, "proposal_law", lambda head_probs, token: head_probs)
    m = AdaDecode(Engine(model), heads=random_heads(model, [0, 1, 2], seed=3), config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0))
    samples = _pair_samples(m, prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


def test_cost_aware_heads_stay_exact_and_stop_checking_useless_heads():
    """Default (cost-aware) AdaDecode: greedy output unchanged; a head whose exits are never
    accepted stops being checked except for rare probes."""
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    m = AdaDecode(eng, heads=random_heads(model, [0, 2, 3]), config=AdaDecodeConfig(adadecode_threshold=0.02))
    assert m.policy.head_cost > 0
    ar = AR(eng)
    for seed in range(3):
        prompt = _prompt(10, seed)
        cfg = GenerationConfig(max_new_tokens=40)
        res = m.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        assert res.stats.predicted_gain is None  # its early tokens are not planned: no prediction claimed
    # random heads at a low threshold fire and are mostly wrong: checks become rare probes
    checks = {k: v[0] - 2 for k, v in m.policy.head_stats.items()}
    paper = AdaDecode(eng, heads=random_heads(model, [0, 2, 3]), config=AdaDecodeConfig(adadecode_threshold=0.02, paper_drafting=True))
    for seed in range(3):
        paper.generate(_prompt(10, seed), GenerationConfig(max_new_tokens=40))
    paper_checks = {k: v[0] - 2 for k, v in paper.policy.head_stats.items()}
    assert sum(checks.values()) < 0.5 * sum(paper_checks.values()), (checks, paper_checks)
    # a token for which no head is worth checking is a plain step: one forward (an empty draft),
    # not one call per segment
    plain = 0
    real = m.drafter.draft

    def spy(state, budget):
        nonlocal plain
        d = real(state, budget)
        plain += isinstance(d, NoDraft)
        return d

    m.drafter.draft = spy
    res = m.generate(_prompt(10, 5), GenerationConfig(max_new_tokens=40))
    assert res.token_ids == ar.generate(_prompt(10, 5), GenerationConfig(max_new_tokens=40)).token_ids
    assert plain >= 20, plain


def vocab_heads(model, layers, vocab, rank=8, seed=0) -> dict[int, LowRankHead]:
    """:func:`random_heads` over a draft vocabulary ``vocab`` (token ids)."""
    return {k: LowRankHead(h.a, h.b, h.g, vocab) for k, h in random_heads(model, layers, rank, seed).items()}


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-window"])
def test_heads_over_a_draft_vocabulary_keep_greedy_output_and_propose_only_its_tokens(arch):
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    vocab = torch.randperm(eng.vocab_size, generator=torch.Generator().manual_seed(1))[: eng.vocab_size // 3]
    method = AdaDecode(eng, heads=vocab_heads(model, [0, 2, 3], vocab),
                       config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.02))
    assert method.describe().head_vocab == vocab.numel()
    rounds = _record_rounds(method)
    ar = AR(eng)
    for seed, n in [(0, 40), (1, 17), (4, 33)]:
        cfg = GenerationConfig(max_new_tokens=n)
        assert method.generate(_prompt(6, seed), cfg).token_ids == ar.generate(_prompt(6, seed), cfg).token_ids
    drafted = [t for _, ts in rounds for t in ts]
    assert len(drafted) > 10 and set(drafted) <= set(vocab.tolist())


# False-positive rate per test: ALPHA = 1e-3.
@pytest.mark.slow  # 2 x 2,500 decodes; fast: the greedy test above and test_verify_exact's AdaDecode enumeration
@pytest.mark.parametrize("rule", ["speculative", "gumbel"])
def test_adadecode_sampling_with_vocabulary_heads_is_exact(small_vocab_setup, rule):  # noqa: F811
    """The early token of a head over a draft vocabulary is a token id outside the head's columns'
    numbering, and under ``speculative`` its point-mass law is handed over at that id (a law over
    the head's columns would be scored against the wrong tokens)."""
    model, prompt, law = small_vocab_setup
    eng = Engine(model)
    vocab = torch.randperm(eng.vocab_size, generator=torch.Generator().manual_seed(2))[: eng.vocab_size // 2]
    m = AdaDecode(eng, heads=vocab_heads(model, [0, 1, 2], vocab, seed=3),
                  config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0))
    samples = _pair_samples(m, prompt, 2500, rule=rule)
    assert distribution_test(samples, law) > ALPHA
