"""The reproducible sampling rule (``gumbel``, the default): a sample is a function of
(seed, position, the target's distribution) only (decoding/sampling.py, docs/sampling.md).

Exactness is shown in two parts, each with a control that fails:
* ``ar`` under the rule samples the target's law: chi-square of its (token 2, token 3)
  pairs against the exact pair law of a small-vocabulary model, enumerated;
* every lossless method gives, for every seed, ``ar``'s tokens token for token, whatever
  it drafts (so it has the same law): checked per seed over the same runs.
"""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding import sampling as sampling_mod
from selfspec_cli.decoding.sampling import PositionNoise
from selfspec_cli.engine import Engine, kernels
from selfspec_cli.methods import AR, build
from selfspec_cli.methods.adadecode import AdaDecode, AdaDecodeConfig

from .conftest import make_tiny_model
from .test_adadecode import random_heads
from .test_decoding import ALPHA, distribution_test
from .test_pld_auto import known_costs
from .test_speculative import SAMPLING, SMALL_VOCAB, _pair_samples, _prompt, small_vocab_setup  # noqa: F401 (fixture)

N = 2500


def test_noise_depends_on_seed_and_position_only():
    a, b = PositionNoise(7, 50), PositionNoise(7, 50)
    first = a(3).clone()
    b(9), b(1)  # other positions drawn first, in another order
    assert torch.equal(b(3), first)
    assert not torch.equal(PositionNoise(8, 50)(3), first) and not torch.equal(a(4), first)
    a.forget_before(4)
    assert torch.equal(a(3), first)  # redrawn identically after being forgotten


def test_gumbel_pick_is_distributed_as_the_processed_law():
    """One position, many seeds: the pick's frequencies against softmax of the processed scores."""
    logits = torch.randn(30, generator=torch.Generator().manual_seed(0)) * 2
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    picks = [sampling_mod.select_token(logits, cfg, None, PositionNoise(s, 30)(5)) for s in range(4000)]
    law = sampling_mod.processed_probs(logits, cfg).double().numpy()
    assert distribution_test(picks, law) > ALPHA


def test_ar_under_the_rule_samples_the_target_pair_law(small_vocab_setup):  # noqa: F811
    model, prompt, law = small_vocab_setup
    assert distribution_test(_pair_samples(AR(Engine(model)), prompt, N, "gumbel"), law) > ALPHA


def test_control_noise_shared_across_positions_fails(small_vocab_setup, monkeypatch):  # noqa: F811
    """Control: noise keyed by the seed alone (the same vector at every position) keeps each
    token's marginal law but couples consecutive tokens; the same test must reject it."""
    model, prompt, law = small_vocab_setup
    call = PositionNoise.__call__
    monkeypatch.setattr(PositionNoise, "__call__", lambda self, position: call(self, 0))
    assert distribution_test(_pair_samples(AR(Engine(model)), prompt, N, "gumbel"), law) < ALPHA


def _methods(model) -> dict[str, object]:
    eng = Engine(model)
    out = {
        "self-sd": build("self-sd", eng, None, skip_attn="1", skip_mlp="2", paper_drafting=True, max_draft=4,
                         draft_threshold=0.0),
        "self-sd-hybrid": build("self-sd", eng, None, skip_attn="1", skip_mlp="2", paper_drafting=True, max_draft=4,
                              draft_threshold=0.0, hybrid=True),
        "swift": build("swift", eng, None, paper_drafting=True),
        "asd": build("asd", eng, None, paper_drafting=True),
        "pld": build("pld", eng, None, paper_drafting=True),
        "auto": build("auto", eng, None, draft_precision="target"),
        "adadecode": AdaDecode(eng, heads=random_heads(model, [0, 1, 2], seed=3),
                               config=AdaDecodeConfig(paper_drafting=True, adadecode_threshold=0.0)),
    }
    if kernels.load_extension() is not None:  # the quantized draft needs the kernel
        out["specqd"] = build("specqd", eng, None, draft_precision="int8", paper_drafting=True)
    return out


def test_every_lossless_method_gives_ars_tokens_for_every_seed(small_vocab_setup, monkeypatch, virtual_clock):  # noqa: F811
    """Parity per seed under sampling: the emitted tokens are ar's, whatever was drafted and
    accepted (drafts are rejected often on this flattened model). The costs are known (test_pld_auto's
    ``known_costs``), so whether ``auto`` drafts does not depend on the host's load (on a busy host it
    measured that no draft paid, and drafted nothing)."""
    known_costs(monkeypatch, virtual_clock)
    model, prompt, _ = small_vocab_setup
    ar = AR(Engine(model))
    for name, m in _methods(model).items():
        drafted = accepted = 0
        for seed in range(40):
            cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0, 25, 0.95, seed))
            res = m.generate(prompt, cfg)
            assert res.token_ids == ar.generate(prompt, cfg).token_ids, (name, seed)
            drafted += res.stats.drafted_tokens
            accepted += res.stats.accepted_draft_tokens
        assert drafted > 0, name  # the drafting paths ran ...
        if name in ("self-sd", "self-sd-hybrid", "adadecode"):
            assert accepted < drafted, name  # ... with rejections


def test_control_verification_reading_another_positions_noise_breaks_parity(small_vocab_setup, monkeypatch):  # noqa: F811
    """Control: verification that reads another position's noise (off by one) is no longer ar's rule;
    the parity check must see it."""
    model, prompt, _ = small_vocab_setup
    from selfspec_cli.decoding import state as state_mod

    rows = state_mod.DecodeState.row_positions
    # only rounds with drafts read the wrong noise (a plain round, as ar's, keeps the right one)
    monkeypatch.setattr(state_mod.DecodeState, "row_positions",
                        lambda self, n, parents=None: [p + (n > 1) for p in rows(self, n, parents)])
    m = _methods(model)["self-sd"]
    ar = AR(Engine(model))
    differ = 0
    for seed in range(20):
        cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0, 25, 0.95, seed))
        differ += m.generate(prompt, cfg).token_ids != ar.generate(prompt, cfg).token_ids
    assert differ > 0


def test_speculative_rule_is_kept_and_is_not_reproducible_across_methods(small_vocab_setup):  # noqa: F811
    """--sampling-rule speculative: the old rule, exact in law (its own tests), other samples than ar's."""
    model, prompt, _ = small_vocab_setup
    ar, sd = AR(Engine(model)), _methods(model)["self-sd"]
    same = 0
    for seed in range(20):
        cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0, 25, 0.95, seed, "speculative"))
        assert sd.generate(prompt, cfg).token_ids == sd.generate(prompt, cfg).token_ids  # reproducible per method
        same += sd.generate(prompt, cfg).token_ids == ar.generate(prompt, cfg).token_ids
    assert same < 20


def test_unknown_rule_is_refused():
    from selfspec_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="--sampling-rule"):
        SamplingConfig(temperature=1.0, rule="metropolis")


def test_a_draft_equal_to_the_target_is_accepted_under_the_same_noise(small_vocab_setup, monkeypatch):  # noqa: F811
    """Drafts read the noise of the position they draft: a draft that is the target itself (no
    sublayer skipped) agrees with the target's pick almost always; reading the next position's
    noise (control) makes it agree only by chance."""
    from selfspec_cli.decoding import state as state_mod

    model, prompt, _ = small_vocab_setup

    def acceptance() -> float:
        m = build("self-sd", Engine(model), None, skip_attn="", skip_mlp="", draft_precision="target",
                  paper_drafting=True, max_draft=4, draft_threshold=0.0)
        drafted = accepted = 0
        for seed in range(15):
            st = m.generate(prompt, GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0, 0, 1.0, seed))).stats
            drafted, accepted = drafted + st.drafted_tokens, accepted + st.accepted_draft_tokens
        return accepted / drafted

    assert acceptance() > 0.9
    nxt = state_mod.DecodeState.next_position
    monkeypatch.setattr(state_mod.DecodeState, "next_position", property(lambda self: nxt.fget(self) + 1))
    assert acceptance() < 0.6
