"""SpecEE (lossy): exits only where the verification passes, deferred mode keeps the
KV exact (every full-depth token then agrees with the full model), empty mode leaves
deeper layers short, and the evaluation counters are consistent."""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods.specee.predictor import NUM_FEATURES, PREDICTOR_HIDDEN, ExitPredictor, specee_features
from selfspec_cli.methods import AR
from selfspec_cli.methods.specee import SpecEE, SpecEEConfig

from .conftest import ARCHS, make_tiny_model
from .test_adadecode import random_heads
from .test_speculative import _prompt


def constant_predictor(score: float) -> ExitPredictor:
    return ExitPredictor(torch.zeros(PREDICTOR_HIDDEN, NUM_FEATURES), torch.zeros(PREDICTOR_HIDDEN),
                         torch.zeros(1, PREDICTOR_HIDDEN), torch.tensor([score]))


def random_predictor(seed: int) -> ExitPredictor:
    g = torch.Generator().manual_seed(seed)
    return ExitPredictor(torch.randn(PREDICTOR_HIDDEN, NUM_FEATURES, generator=g), torch.randn(PREDICTOR_HIDDEN, generator=g),
                         torch.randn(1, PREDICTOR_HIDDEN, generator=g) * 0.1, torch.zeros(1))


def _specee(model, score=None, kv_mode="deferred", evaluate=True, layers=6):
    heads = random_heads(model, [1])
    preds = {l: (constant_predictor(score) if score is not None else random_predictor(l)) for l in range(1, layers - 1)}
    return SpecEE(Engine(model), drafter_layer=1, drafter=heads[1], predictors=preds, offline_layers=[2, 3],
                  config=SpecEEConfig(specee_kv_mode=kv_mode, specee_eval=evaluate))


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3-qknorm"])
def test_specee_never_exiting_equals_ar(arch):
    model = make_tiny_model(arch, layers=6)
    m = _specee(model, score=-20.0)
    ar = AR(Engine(model))
    for seed in range(2):
        cfg = GenerationConfig(max_new_tokens=25)
        res = m.generate(_prompt(6, seed), cfg)
        assert res.token_ids == ar.generate(_prompt(6, seed), cfg).token_ids
        ev = res.stats.report.to_json()["evaluation"]
        assert ev["early_exits"] == 0 and ev["identical_prefix_share"] == 1.0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_specee_deferred_mode_keeps_full_depth_tokens_exact(arch):
    """With the KV preserved, only an exit can disagree with the full model: every
    token decoded at full depth matches the shadow decoder."""
    model = make_tiny_model(arch, layers=6)
    m = _specee(model, score=20.0, kv_mode="deferred")
    res = m.generate(_prompt(6, 1), GenerationConfig(max_new_tokens=40))
    ev, st = res.stats.report.to_json()["evaluation"], res.stats.report.to_json()
    assert ev["early_exits"] == sum(st["early_exits"].values()) > 0
    disagreements = ev["early_exits"] - round(ev["early_exit_agreement"] * ev["early_exits"])
    assert round(ev["token_agreement"] * 39) == 39 - disagreements
    assert st["failed_verifications"] + ev["early_exits"] <= st["verifications"]


def test_specee_empty_mode_leaves_deep_kv_short(monkeypatch):
    model = make_tiny_model("llama-gqa", layers=6)
    m = _specee(model, score=20.0, kv_mode="empty", evaluate=False)
    seen = {}
    real = m.engine.new_cache

    def spy(capacity):
        seen["cache"] = real(capacity)
        return seen["cache"]

    monkeypatch.setattr(m.engine, "new_cache", spy)
    res = m.generate(_prompt(6, 2), GenerationConfig(max_new_tokens=30))
    lengths = seen["cache"].lengths
    exits = sum(res.stats.report.early_exits.values())
    assert exits > 0 and lengths[0] > lengths[-1]
    assert lengths[0] - lengths[-1] <= exits


def test_specee_random_predictors_exit_at_several_layers_and_keep_their_books_in_both_modes():
    """Random predictors (a sliding-window model) fire at several layers and often fail the
    verification, so exits, failed checks and full-depth tokens mix. In both modes the counters
    agree with each other (every exit passed a verification; a token that exits after layer l ran
    l + 1 layers, any other all L). Empty mode: layer j's cache misses exactly the tokens that
    exited below it. Deferred mode: every layer's cache holds every token except those still
    waiting to enter it, and every token decoded at full depth agrees with the full model."""
    model = make_tiny_model("mistral-window", layers=6)
    L, tokens = 6, 30
    prompt = _prompt(6, 3)
    for mode in ("empty", "deferred"):
        m = _specee(model, kv_mode=mode)
        caches = []
        real = m.engine.new_cache
        m.engine.new_cache = lambda capacity: caches.append(real(capacity)) or caches[-1]
        res = m.generate(prompt, GenerationConfig(max_new_tokens=tokens))
        st, ev = res.stats.report.to_json(), res.stats.report.to_json()["evaluation"]
        assert len(res.token_ids) == tokens and st["kv_mode"] == mode
        rounds = tokens - 1  # the prefill decides the first token
        exits = {int(l): n for l, n in st["early_exits"].items()}
        n_exits = sum(exits.values())
        assert len(exits) >= 2 and 0 < n_exits < rounds, exits  # several exit layers, and full-depth tokens
        assert ev["early_exits"] == n_exits and st["exit_rate"] == pytest.approx(n_exits / rounds)
        assert st["verifications"] == n_exits + st["failed_verifications"] and st["failed_verifications"] > 0
        assert st["predictor_checks"] >= st["verifications"]
        layers_run = rounds * L - sum(n * (L - 1 - l) for l, n in exits.items())
        assert st["mean_layers_run_per_token"] == pytest.approx(layers_run / rounds)
        lengths = caches[0].lengths  # the decoder's own cache (caches[1] is the evaluation's shadow)
        assert lengths[0] == len(prompt) + rounds  # every token fed enters layer 0
        if mode == "empty":
            assert [lengths[0] - n for n in lengths] == [sum(exits.get(x, 0) for x in range(j)) for j in range(L)]
        else:
            waiting = {s: rows.shape[0] for s, rows in m.drafter._waiting.items()}
            assert [lengths[0] - n for n in lengths] == [sum(w for s, w in waiting.items() if s <= j) for j in range(L)]
            wrong_exits = n_exits - round(ev["early_exit_agreement"] * n_exits)
            assert rounds - round(ev["token_agreement"] * rounds) == wrong_exits  # only exits disagree


def test_specee_is_greedy_only_and_validates_mode():
    model = make_tiny_model("llama-gqa", layers=6)
    with pytest.raises(ConfigError, match="greedily"):
        _specee(model).generate(_prompt(6, 0), GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.0)))
    with pytest.raises(ConfigError, match="specee_kv_mode"):
        SpecEEConfig(specee_kv_mode="propagate-ish")


def test_features_match_between_first_and_later_layers():
    s = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    f0 = specee_features(s, None)
    assert torch.allclose(f0[:, 4:8], f0[:, 8:]) and f0.shape == (1, 12)
    f1 = specee_features(s, s)
    assert torch.allclose(f1[:, 8:], torch.zeros(1, 4))


def test_a_drafter_over_a_draft_vocabulary_speculates_token_ids():
    """A drafter head over a draft vocabulary (FR-Spec) speculates the token ids of its top
    columns: with a never-exiting predictor SpecEE still equals ar, and the speculative tokens
    checked by a firing one all lie in the vocabulary."""
    from .test_adadecode import vocab_heads

    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    vocab = torch.randperm(eng.vocab_size, generator=torch.Generator().manual_seed(4))[:60]
    drafter = vocab_heads(model, [1], vocab)[1]
    prompt, cfg = _prompt(6, 0), GenerationConfig(max_new_tokens=20)
    never = SpecEE(eng, drafter_layer=1, drafter=drafter, predictors={l: constant_predictor(-30.0) for l in range(1, 5)},
                   offline_layers=[2, 3])
    assert never.generate(prompt, cfg).token_ids == AR(eng).generate(prompt, cfg).token_ids
    seen: list[int] = []
    real = eng.head_rows
    eng.head_rows = lambda ids: seen.extend(ids.tolist()) or real(ids)
    always = SpecEE(eng, drafter_layer=1, drafter=drafter, predictors={l: constant_predictor(30.0) for l in range(1, 5)},
                    offline_layers=[2, 3])
    always.generate(prompt, cfg)
    assert seen and set(seen) <= set(vocab.tolist())
