"""The drafter contract (decoding/driver.py; docs/design.md, "Drafters and policies"):

* every method *has* a drafter (``Drafter``: begin, draft, accept, end; lookahead, taps) and a
  policy (``DraftPolicy``: curve, gain), and is neither itself;
* the driver calls a drafter's four verbs and reads its two fields, nothing else: a drafter
  seen through a wrapper that offers only those decodes the same tokens with the same stats;
* a drafter's constructor runs no forward (measuring is its policy's setup);
* a layer-skip method's parts are typed fields, and its hybrid n-gram branch is composed in.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.driver import Drafter, DraftPolicy, decode
from selfspec_cli.decoding.layer_skip import DraftModel, DraftSettings, FixedSkips, LayerSkipDrafter
from selfspec_cli.decoding.ngram import NgramLookup
from selfspec_cli.decoding.policy import LengthPolicy
from selfspec_cli.decoding.stack import DraftParts
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build
from selfspec_cli.methods.adadecode import AdaDecode, AdaDecodeConfig
from selfspec_cli.methods.base import DraftInputs, LayerSkipMethod, Method
from selfspec_cli.methods.specee import SpecEE, SpecEEConfig

from .conftest import make_tiny_model
from .test_adadecode import random_heads
from .test_specee import constant_predictor
from .test_speculative import _prompt

LAYERS = 6
FIXED = {"paper_drafting": True, "max_draft": 4}  # no cost planning: drafts every round, nothing timed


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama-gqa", layers=LAYERS)
    return model, Engine(model)


def _methods(model, eng) -> dict[str, Method]:
    heads = random_heads(model, [1, 3])
    return {
        "ar": build("ar", eng),
        "pld": build("pld", eng, None, paper_drafting=True),
        "self-sd": build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2,), draft_threshold=0.3, **FIXED),
        "self-sd-hybrid": build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2,), hybrid=True, draft_vocab="full",
                                **FIXED),
        "asd": build("asd", eng, None, asd_alpha=0.3, **FIXED),
        "swift": build("swift", eng, None, context_window=4, tree_nodes=8, optimize_budget=0.0, **FIXED),
        "adadecode": AdaDecode(eng, heads=heads, config=AdaDecodeConfig(adadecode_threshold=0.02, paper_drafting=True)),
        "specee": SpecEE(eng, None, SpecEEConfig(specee_threshold=0.5), drafter_layer=1, drafter=heads[1],
                         predictors={l: constant_predictor(20.0) for l in range(1, LAYERS - 1)}, offline_layers=[2, 3]),
    }


def test_every_method_has_a_drafter_and_a_policy_and_is_neither(tiny):
    model, eng = tiny
    for name, m in _methods(model, eng).items():
        assert isinstance(m.drafter, Drafter) and isinstance(m.policy, DraftPolicy), name
        assert not isinstance(m, Drafter) and not hasattr(m, "draft") and not hasattr(m, "propose"), name
        assert isinstance(m.drafter.lookahead, int) and m.drafter.lookahead >= 0, name
    assert build("ar", eng).policy.curve is None  # nothing planned: no verify curve


class OnlyTheContract:
    """A drafter seen through the contract alone: the four verbs and the two fields, nothing else."""

    __slots__ = ("_inner", "lookahead", "taps")

    def __init__(self, inner: Drafter) -> None:
        self._inner, self.lookahead, self.taps = inner, inner.lookahead, inner.taps

    def begin(self, state, prefill):
        return self._inner.begin(state, prefill)

    def draft(self, state, budget):
        return self._inner.draft(state, budget)

    def accept(self, state, rnd):
        return self._inner.accept(state, rnd)

    def end(self):
        return self._inner.end()


def test_the_driver_uses_only_the_contract(tiny):
    """Each method decoded by the driver through the contract alone gives what its own ``generate``
    gives (fresh methods each side: the same tokens, the same counters)."""
    model, eng = tiny
    cfg = GenerationConfig(max_new_tokens=20)
    prompt = _prompt(8, 2)
    own = {n: m.generate(prompt, cfg) for n, m in _methods(model, eng).items()}
    for name, m in _methods(model, eng).items():
        got = decode(eng, None, OnlyTheContract(m.drafter), prompt, cfg, policy=m.policy)
        want = own[name]
        assert got.token_ids == want.token_ids, name
        assert got.stats.accept_lengths == want.stats.accept_lengths, name
        assert got.stats.draft_lengths == want.stats.draft_lengths, name
    ar = own["ar"].token_ids
    assert all(r.token_ids == ar for n, r in own.items() if n != "specee")  # the lossless ones are exact


def test_a_drafters_constructor_runs_no_forward(tiny, monkeypatch):
    """Measuring is the policy's (its setup, before a decode), never the drafter's constructor."""
    _, eng = tiny
    settings = DraftSettings(max_draft=4)  # cost-aware: the policy plans with measured costs
    model = DraftModel.build(eng, FixedSkips(frozenset({1}), frozenset({2})))
    LengthPolicy.measure_curve(eng, settings)
    policy = LengthPolicy(eng, settings, model).setup()
    assert policy.curve is not None and policy.draft_cost() > 0

    def no_forward(*a, **kw):
        raise AssertionError("a drafter's constructor ran a forward")

    monkeypatch.setattr(Engine, "forward", no_forward)
    drafter = LayerSkipDrafter(eng, settings, model, policy)
    assert drafter.policy is policy and drafter.skip_sets() == (frozenset({1}), frozenset({2}))


def test_a_layer_skip_methods_parts_are_typed_and_its_ngram_branch_composed(tiny):
    _, eng = tiny
    m = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2,), hybrid=True, draft_vocab="full", **FIXED)
    assert isinstance(m, LayerSkipMethod) and isinstance(m.parts, DraftParts) and dataclasses.is_dataclass(m.parts)
    assert isinstance(m.parts.ngram, NgramLookup)  # the n-gram branch: a lookup composed in, not a patched class
    assert not hasattr(LayerSkipMethod, "ngram_source")
    inputs = type(m).draft_inputs(eng, None, m.config)
    assert isinstance(inputs, DraftInputs) and isinstance(inputs.ngram, NgramLookup)
    plain = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2,), draft_vocab="full", **FIXED)
    assert plain.parts.ngram is None and isinstance(plain.configuration, LayerSkipDrafter)
    assert torch.equal(torch.tensor(plain.generate(_prompt(6, 1), GenerationConfig(max_new_tokens=12)).token_ids),
                       torch.tensor(m.generate(_prompt(6, 1), GenerationConfig(max_new_tokens=12)).token_ids))
