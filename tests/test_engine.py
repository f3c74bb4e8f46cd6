"""Exactness of the layer-execution engine against Hugging Face's own forward, fp32,
on tiny random models of every supported architecture."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from selfspec_cli.engine import Engine, ForwardTaps, Route
from selfspec_cli.engine.tree import root_to_leaf_paths, tree_mask_from_parents, tree_positions
from selfspec_cli.errors import UnsupportedModelError

from .conftest import ARCHS, VOCAB, make_tiny_model

ARCH_NAMES = list(ARCHS)
TOL = dict(atol=2e-5, rtol=1e-4)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g)


@pytest.fixture(params=ARCH_NAMES)
def model_and_engine(request):
    model = make_tiny_model(request.param)
    return model, Engine(model)


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def test_full_forward_equals_hf(model_and_engine):
    model, eng = model_and_engine
    ids = _ids(30)  # longer than the Mistral window (12): exercises sliding-window masks
    ref = _hf_logits(model, ids)
    out = eng.forward(eng.new_cache(64), ids, positions=0, logits_rows=slice(None))
    assert_close(out.logits, ref, **TOL)


def test_fused_weights_are_views_hf_forward_unchanged():
    model = make_tiny_model("qwen2-bias")
    ids = _ids(10)
    before = _hf_logits(model, ids)
    n_params = sum(p.numel() for p in model.parameters())
    Engine(model)
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert_close(_hf_logits(model, ids), before, atol=0, rtol=0)


def test_incremental_decoding_equals_full_recompute(model_and_engine):
    model, eng = model_and_engine
    ids = _ids(30, seed=2)
    ref = _hf_logits(model, ids)
    cache = eng.new_cache(8)  # small on purpose: must grow
    eng.forward(cache, ids[:10], positions=0)
    rows = []
    pos = 10
    for chunk in (1, 3, 1, 1, 5, 1, 8):
        out = eng.forward(cache, ids[pos : pos + chunk], positions=pos, logits_rows=slice(None))
        rows.append(out.logits)
        pos += chunk
    assert pos == 30 and cache.lengths == [30] * eng.num_layers
    assert_close(torch.cat(rows), ref[10:], **TOL)


def test_tree_forward_equals_chain_of_each_branch(model_and_engine):
    model, eng = model_and_engine
    prefix = _ids(14, seed=3)
    parents = [-1, 0, 0, 1, 1, 2, 3, -1]  # two roots; branches of different depths
    nodes = _ids(len(parents), seed=4)
    cache = eng.new_cache(64)
    eng.forward(cache, prefix, positions=0)
    tree = eng.forward(cache, nodes, positions=tree_positions(parents, len(prefix)),
                       tree_mask=tree_mask_from_parents(parents), logits_rows=slice(None))
    for path in root_to_leaf_paths(parents):
        chain = torch.cat([prefix, nodes[path]])
        ref = _hf_logits(model, chain)[len(prefix):]
        assert_close(tree.logits[path], ref, **TOL)


def test_compact_accepted_path_then_continue(model_and_engine):
    model, eng = model_and_engine
    prefix = _ids(14, seed=5)
    parents = [-1, 0, 0, 1, 2, 4]
    nodes = _ids(len(parents), seed=6)
    cache = eng.new_cache(64)
    eng.forward(cache, prefix, positions=0)
    eng.forward(cache, nodes, positions=tree_positions(parents, 14), tree_mask=tree_mask_from_parents(parents))
    path = [0, 2, 4]  # accept root -> second child -> its child
    cache.compact([14 + i for i in path], dst_start=14)
    nxt = _ids(3, seed=7)
    out = eng.forward(cache, nxt, positions=17, logits_rows=slice(None))
    ref = _hf_logits(model, torch.cat([prefix, nodes[path], nxt]))[17:]
    assert_close(out.logits, ref, **TOL)


def test_crop_then_recompute_equals_fresh_cache(model_and_engine):
    model, eng = model_and_engine
    ids = _ids(20, seed=8)
    other = _ids(6, seed=9)
    cache = eng.new_cache(64)
    eng.forward(cache, ids[:16], positions=0)
    eng.forward(cache, other, positions=16)  # a rejected continuation
    cache.crop(16)
    got = eng.forward(cache, ids[16:], positions=16, logits_rows=slice(None)).logits
    fresh = eng.new_cache(64)
    eng.forward(fresh, ids[:16], positions=0)
    want = eng.forward(fresh, ids[16:], positions=16, logits_rows=slice(None)).logits
    assert_close(got, want, atol=0, rtol=0)


def _zero_sublayers(model, skip_attn, skip_mlp):
    """Reference for skipping: a sublayer whose output projection is zero adds exactly 0."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for l, layer in enumerate(ref.model.layers):
            if l in skip_attn:
                layer.self_attn.o_proj.weight.zero_()
            if l in skip_mlp:
                layer.mlp.down_proj.weight.zero_()
    return ref


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_skip_sets_equal_zeroed_sublayers(arch):
    model = make_tiny_model(arch, layers=5)
    skip_attn, skip_mlp = {1, 3}, {0, 3, 4}
    ref_model = _zero_sublayers(model, skip_attn, skip_mlp)
    eng = Engine(model)
    ids = _ids(16, seed=10)
    ref = _hf_logits(ref_model, ids)
    out = eng.forward(eng.new_cache(32), ids, positions=0, route=Route(skip_attn, skip_mlp), logits_rows=slice(None))
    assert_close(out.logits, ref, **TOL)
    # cached drafting with the skip set: skipped attention layers write no K/V
    cache = eng.new_cache(32)
    eng.forward(cache, ids[:10], positions=0)
    rows = [eng.forward(cache, ids[i : i + 1], positions=i, route=Route(skip_attn, skip_mlp)).logits for i in range(10, 16)]
    assert cache.lengths[1] == 10 and cache.lengths[3] == 10 and cache.lengths[0] == 16
    # the draft attends to full-model K/V of the prefix and to its own (skip-set) K/V of the
    # drafted tokens: the independent reference is Hugging Face's forward of the zeroed model
    # continuing from the full model's cache of the prefix. (Neither the zeroed model alone nor
    # the full model alone matches: both differ from the draft rows by >= 0.1 here.)
    with torch.no_grad():
        past = model(ids[None, :10], use_cache=True).past_key_values
        mixed = ref_model(ids[None, 10:], past_key_values=past).logits[0].float()
    assert_close(torch.cat(rows), mixed, **TOL)
    cache.crop(10)
    assert cache.lengths == [10] * eng.num_layers


def test_skip_draft_rows_match_batched_skip_forward():
    """A chain drafted one token at a time with a skip set equals one batched skip forward
    over the same tokens on the same prefix cache."""
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    ids = _ids(18, seed=11)
    skip_attn, skip_mlp = {2, 4}, {1}
    a = eng.new_cache(32)
    eng.forward(a, ids[:12], positions=0)
    one = [eng.forward(a, ids[i : i + 1], positions=i, route=Route(skip_attn, skip_mlp)).logits for i in range(12, 18)]
    b = eng.new_cache(32)
    eng.forward(b, ids[:12], positions=0)
    batched = eng.forward(b, ids[12:], positions=12, route=Route(skip_attn, skip_mlp), logits_rows=slice(None)).logits
    assert_close(torch.cat(one), batched, **TOL)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3-qknorm"])
def test_deferred_deep_layers_batched_with_next_token(arch):
    """AdaDecode pattern: token A stops after layer k; its deep layers run later,
    batched with token B. The result equals plain chain decoding."""
    model = make_tiny_model(arch, layers=6)
    eng = Engine(model)
    ids = _ids(14, seed=12)
    k = 3
    cache = eng.new_cache(32)
    eng.forward(cache, ids[:12], positions=0)
    h_a = eng.forward(cache, ids[12:13], positions=12, end=k).hidden
    h_b = eng.forward(cache, ids[13:14], positions=13, end=k).hidden
    assert cache.lengths == [14] * k + [12] * (6 - k)
    out = eng.forward(cache, hidden=torch.cat([h_a, h_b]), positions=12, start=k, logits_rows=slice(None))
    assert cache.lengths == [14] * 6
    assert_close(out.logits, _hf_logits(model, ids)[12:14], **TOL)


def test_hidden_states_at_requested_layers(model_and_engine):
    model, eng = model_and_engine
    ids = _ids(12, seed=13)
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    want = [0, 2]
    out = eng.forward(eng.new_cache(16), ids, positions=0, taps=ForwardTaps(hidden_at=want))
    assert sorted(out.hidden_at) == want
    for l in want:
        assert_close(out.hidden_at[l], hs[l + 1][0], **TOL)


def test_unsupported_architecture_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        Engine(model)
