"""What a forward computes and reports are named, typed values (engine/route.py; docs/design.md, "Drafters
and policies"):

* a :class:`Route` and a :class:`ForwardTaps` are frozen and hashable, and equal needs compare equal;
* the engine refuses a route or taps naming a layer the model does not have, with one clear error
  (it used to run every layer silently);
* a layer-skip drafter's draft forward is described by one ``Route`` (its skip sets, weights copy,
  KV window, head), and the driver's forwards carry the drafter's ``Taps`` as ``ForwardTaps``;
* no forward of the engine, its fixed-shape path or the decode state takes free keyword arguments.
"""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.driver import Taps
from selfspec_cli.decoding.layer_skip import LayerSkipDrafter
from selfspec_cli.decoding.state import DecodeState
from selfspec_cli.engine import NO_TAPS, TARGET, Engine, ForwardTaps, Route
from selfspec_cli.engine.graphs import StaticForward
from selfspec_cli.methods import build

from .conftest import make_tiny_model

LAYERS = 4


@pytest.fixture(scope="module")
def eng():
    return Engine(make_tiny_model("llama-gqa", layers=LAYERS))


def test_a_route_is_frozen_hashable_and_normalized():
    a = Route(skip_attn=[3, 1], skip_mlp=(2,), weights="int8", kv_window=(4, 8))
    b = Route(skip_attn=frozenset({1, 3}), skip_mlp={2}, weights="int8", kv_window=(4, 8))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.skip_attn == frozenset({1, 3}) and isinstance(a.skip_mlp, frozenset)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.weights = None  # type: ignore[misc]
    assert Route() == TARGET and TARGET.is_target and not a.is_target
    head = object()
    assert Route(head=head) == Route(head=head) and Route(head=head) != Route(head=object())  # by identity
    assert ForwardTaps(hidden_at=[2, 0, 2]).hidden_at == (2, 0)  # the caller's order, no repeats
    assert ForwardTaps() == NO_TAPS and not NO_TAPS.per_row and ForwardTaps(attn_cosine=True).per_row


@pytest.mark.parametrize("bad", [dict(skip_attn={-1}), dict(skip_mlp={"1"}), dict(skip_attn={True}),
                                 dict(kv_window=(0, 0))])
def test_a_route_refuses_what_is_no_layer_index(bad):
    with pytest.raises(ValueError):
        Route(**bad)


@pytest.mark.parametrize("route, taps, named", [
    (Route(skip_attn={1, LAYERS}), NO_TAPS, f"skip_attn [{LAYERS}]"),
    (Route(skip_mlp={LAYERS + 3}), NO_TAPS, f"skip_mlp [{LAYERS + 3}]"),
    (TARGET, ForwardTaps(hidden_at=(0, LAYERS)), f"hidden_at [{LAYERS}]"),
])
def test_the_engine_refuses_a_layer_the_model_does_not_have(eng, route, taps, named):
    cache = eng.new_cache(8)
    with pytest.raises(ValueError, match=re.escape(f"({named}); it has {LAYERS} layers")):
        eng.forward(cache, torch.tensor([1, 2]), positions=0, route=route, taps=taps)
    assert cache.lengths == [0] * LAYERS  # refused before anything was written


def test_the_route_and_taps_are_what_the_forward_computes(eng):
    """A route with a skip set is the skipped forward, the target route the plain one; taps report what they
    name and nothing else."""
    ids = torch.arange(2, 12)
    plain = eng.forward(eng.new_cache(16), ids, positions=0)
    assert torch.equal(eng.forward(eng.new_cache(16), ids, positions=0, route=TARGET).logits, plain.logits)
    assert plain.hidden_at == {} and plain.attn_cosine is None
    skipped = eng.forward(eng.new_cache(16), ids, positions=0, route=Route(skip_attn={1}, skip_mlp={2}),
                          taps=ForwardTaps(hidden_at=(0, 2), attn_cosine=True))
    assert not torch.equal(skipped.logits, plain.logits)
    assert sorted(skipped.hidden_at) == [0, 2] and skipped.attn_cosine.shape == (LAYERS,)
    assert skipped.attn_cosine[1] == 1.0  # a skipped attention turns nothing


def test_a_layer_skip_draft_is_one_route(eng, monkeypatch):
    """Every draft forward of a layer-skip drafter runs exactly its :meth:`LayerSkipDrafter.route`; the
    driver's prefill and verify forwards run the target's route with the drafter's taps."""
    m = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2,), paper_drafting=True, max_draft=3)
    drafter = m.drafter.configuration(None, 3)
    assert isinstance(drafter, LayerSkipDrafter)
    route = drafter.route()
    assert route == Route(skip_attn={1, 3}, skip_mlp={2}, weights=drafter.weights,
                          kv_window=drafter.settings.kv_window, head=drafter.model.vocab_head)
    seen: list[tuple[Route, ForwardTaps]] = []
    forward = Engine.forward

    def spy(self, cache, input_ids=None, *, route=TARGET, taps=NO_TAPS, **kw):
        seen.append((route, taps))
        return forward(self, cache, input_ids, route=route, taps=taps, **kw)

    monkeypatch.setattr(Engine, "forward", spy)
    m.generate([5, 6, 7, 5, 6, 7, 5], GenerationConfig(max_new_tokens=6))
    assert {r for r, _ in seen} == {TARGET, route}  # the target's forwards and the one draft route
    assert {t for _, t in seen} == {NO_TAPS}


def test_the_drivers_taps_become_forward_taps(eng):
    taps = Taps(attn_cosine=True, hidden=(2, 0))
    assert taps.prefill_taps() == ForwardTaps(hidden_at=(2, 0), attn_cosine=True)
    assert taps.verify_taps() == ForwardTaps(hidden_at=(2, 0))  # cosines are the prefill's only
    assert Taps().verify_taps() is NO_TAPS and Taps().prefill_taps() == NO_TAPS
    state = DecodeState(eng, [3, 4, 5], max_new_tokens=2, lookahead=0, sampling=GenerationConfig().sampling,
                        generator=None)
    out = state.prefill(taps.prefill_taps())
    assert sorted(out.hidden_at) == [0, 2] and out.attn_cosine is not None


@pytest.mark.parametrize("fn", [Engine.forward, StaticForward.forward, Engine.fixed_forward, DecodeState.prefill,
                                DecodeState.run, DecodeState.verify_forward, DecodeState.replay])
def test_no_forward_takes_free_keyword_arguments(fn):
    """A drafter's new need is a field of Route or ForwardTaps, never a keyword threaded through these."""
    kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds
