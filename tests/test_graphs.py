"""The fixed-shape forward (engine/graphs.py), run eagerly on the CPU: the invariants its CUDA graphs
rely on. A GPU run of the same checks, with capture, is tests/test_gpu.py."""
from __future__ import annotations

import gc

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.layer_skip import DraftSettings
from selfspec_cli.engine import Engine
from selfspec_cli.engine.runner import ALL_ROWS
from selfspec_cli.methods import AR
from selfspec_cli.methods.self_sd import SelfSD, SkipSet

from .conftest import ARCHS, VOCAB, make_tiny_model

ROWS = 4  # small, so that chains longer than a forward's rows run in chunks


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _static(arch: str, layers: int = 4, dtype=torch.float32) -> Engine:
    return Engine(make_tiny_model(arch, layers=layers).to(dtype), fast_kernels=False, static_rows=ROWS)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_k_row_forward_equals_k_one_row_steps_bit_for_bit(arch, dtype):
    """Chains of 1..9 rows (more than a forward's rows: chunks), prompts past the sliding windows."""
    eng = _static(arch, dtype=dtype)
    prompt, follow = _prompt(13, 0), _prompt(9, 1)
    ids = torch.tensor(prompt + follow)
    one = eng.new_cache(64)
    eng.forward(one, ids[:13], positions=0, logits_rows=None)
    steps = [eng.forward(one, ids[13 + i : 14 + i], positions=13 + i).logits[0] for i in range(9)]
    for k in (1, 3, ROWS, ROWS + 1, 9):
        del one
        cache = eng.new_cache(64)
        eng.forward(cache, ids[:13], positions=0, logits_rows=None)
        out = eng.forward(cache, ids[13 : 13 + k], positions=13, logits_rows=ALL_ROWS)
        assert torch.equal(out.logits, torch.stack(steps[:k])), k
        assert cache.lengths == [13 + k] * eng.num_layers
        one = cache
    assert eng.static.eager_fallbacks == 0


@pytest.mark.parametrize("arch", ["llama-gqa", "mistral-window", "qwen3-qknorm", "gemma3-window"])
def test_the_fixed_shape_forward_computes_the_eager_forward(arch):
    """Same model, fixed-shape and eager engines: the same logits up to float rounding, and the same
    greedy tokens."""
    model = make_tiny_model(arch, layers=4)
    fixed, eager = Engine(model, fast_kernels=False, static_rows=ROWS), Engine(model, fast_kernels=False)
    prompt = _prompt(15, 2)
    ids = torch.tensor(prompt)
    a, b = fixed.new_cache(32), eager.new_cache(32)
    la = fixed.forward(a, ids, positions=0, logits_rows=ALL_ROWS).logits
    lb = eager.forward(b, ids, positions=0, logits_rows=ALL_ROWS).logits
    assert torch.allclose(la, lb, atol=1e-4, rtol=1e-4)
    cfg = GenerationConfig(max_new_tokens=20)
    assert AR(fixed).generate(prompt, cfg).token_ids == AR(eager).generate(prompt, cfg).token_ids


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias", "gemma3-window"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_layer_skip_drafting_on_the_fixed_path_keeps_parity(arch, tree):
    """Drafts (skip sets) and their verification, all through fixed-shape forwards: greedy output equals
    plain decoding's, and no forward fell back to the eager loop. Tree verification is not bit-exact
    on this engine, so a tree method verifies chains."""
    eng = _static(arch, layers=6)
    assert not eng.exact_trees
    ar = AR(eng)
    settings = DraftSettings(cost_aware=False, max_draft=6, threshold=0.3, tree=tree)
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=settings)
    assert sd.describe().verify == "chain"  # trees are not bit-exact on matrix-product attention
    drafted = 0
    for seed, n in [(0, 30), (1, 9)]:
        prompt = _prompt(6, seed)
        cfg = GenerationConfig(max_new_tokens=n)
        res = sd.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        drafted += res.stats.drafted_tokens
    assert drafted > 0
    assert eng.static.eager_fallbacks == 0


def test_asd_and_swift_run_on_the_fixed_path():
    from selfspec_cli.methods.asd import ASD, ASDConfig
    from selfspec_cli.methods.swift import Swift, SwiftConfig

    eng = _static("llama-gqa", layers=8)
    ar = AR(eng)
    asd = ASD(eng, config=ASDConfig(asd_alpha=0.5, asd_m=3, asd_n=2))
    sw = Swift(eng, config=SwiftConfig(context_window=8, bo_interval=4, paper_drafting=True, optimize_budget=1.0))
    for seed in range(2):
        prompt = _prompt(8, seed)
        cfg = GenerationConfig(max_new_tokens=24)
        want = ar.generate(prompt, cfg).token_ids
        assert asd.generate(prompt, cfg).token_ids == want
        assert sw.generate(prompt, cfg).token_ids == want
    assert eng.static.eager_fallbacks == 0


def test_the_fixed_path_refuses_the_cpu_kernels_matrices():
    """Its sublayers read the model's own float matrices: an engine whose products are packed for the CPU kernel
    (or a block target) cannot take it."""
    from selfspec_cli.engine import kernels

    if kernels.load_extension() is None:
        pytest.skip("no CPU kernel on this host")
    with pytest.raises(ValueError, match="fast_kernels=False"):
        Engine(make_tiny_model("llama-gqa"), static_rows=ROWS)


def test_what_the_fixed_path_does_not_take_runs_eagerly():
    """A residual-stream input (AdaDecode's deferred layers) and a cache with holes go to the eager loop."""
    eng = _static("llama-gqa")
    cache = eng.new_cache(32)
    ids = torch.tensor(_prompt(5, 0))
    out = eng.forward(cache, ids, positions=0, end=2, logits_rows=None)  # a layer range
    assert eng.static.eager_fallbacks == 1
    eng.forward(cache, hidden=out.hidden[-1:], positions=4, start=2, logits_rows=None)
    assert eng.static.eager_fallbacks == 2


def test_the_kv_buffer_is_reused_once_its_cache_is_gone():
    eng = _static("llama-gqa")
    a = eng.new_cache(40)
    ptr = a.k.data_ptr()
    b = eng.new_cache(40)  # a lives: b gets its own buffer
    assert b.k.data_ptr() != ptr
    del a
    gc.collect()
    c = eng.new_cache(30)  # fits a's free buffer
    assert c.k.data_ptr() == ptr and c.lengths == [0] * eng.num_layers
    assert c.capacity >= 30 + ROWS


def test_a_tree_wider_than_a_forward_runs_in_chunks():
    """The fixed path verifies a tree of more nodes than a forward's rows: each node's logits are its
    path's (to rounding: tree rows are not bit-exact on matrix-product attention)."""
    from selfspec_cli.engine.tree import tree_mask_from_parents, tree_positions

    eng = _static("llama-gqa")
    prompt, path = _prompt(9, 3), _prompt(6, 4)
    parents = [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # two chains from the root: nodes 0,1,3,5,7,9,11 and 2,4,...
    tokens = [path[0]] + [t for pair in zip(path[1:], _prompt(5, 5)) for t in pair] + [path[5]]
    tokens = tokens[:len(parents)]
    cache = eng.new_cache(64)
    eng.forward(cache, torch.tensor(prompt), positions=0, logits_rows=None)
    out = eng.forward(cache, torch.tensor(tokens), positions=tree_positions(parents, 9),
                      tree_mask=tree_mask_from_parents(parents), logits_rows=ALL_ROWS)
    chain_nodes = [0, 1, 3, 5, 7, 9]
    cache.crop(9)
    chain = eng.forward(cache, torch.tensor([tokens[i] for i in chain_nodes]), positions=9, logits_rows=ALL_ROWS)
    assert torch.allclose(out.logits[chain_nodes], chain.logits, atol=1e-4, rtol=1e-4)
    assert eng.static.eager_fallbacks == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3-qknorm", "gemma3-window"])
def test_compiled_sublayers_keep_the_invariants(arch, monkeypatch):
    """SELFSPEC_COMPILE=1 (engine/sublayers.py, compiled by inductor here as on a GPU): k rows still equal
    k one-row steps bit for bit, the compiled forward computes the plain one to rounding, and a layer-skip
    draft keeps parity with ar on it. The arches cover the per-head q/k norms, post-norms and GeGLU."""
    model = make_tiny_model(arch, layers=4)
    plain = Engine(model, fast_kernels=False, static_rows=ROWS)
    monkeypatch.setenv("SELFSPEC_COMPILE", "1")
    eng = Engine(model, fast_kernels=False, static_rows=ROWS)
    assert eng.sublayers.compiled and not plain.sublayers.compiled and eng.kernel_info["compiled"]
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    ids = torch.tensor(_prompt(13, 0) + _prompt(7, 1))
    one = eng.new_cache(64)
    eng.forward(one, ids[:13], positions=0, logits_rows=None)
    steps = torch.stack([eng.forward(one, ids[13 + i: 14 + i], positions=13 + i).logits[0] for i in range(7)])
    cache = eng.new_cache(64)
    eng.forward(cache, ids[:13], positions=0, logits_rows=None)
    assert torch.equal(eng.forward(cache, ids[13:], positions=13, logits_rows=ALL_ROWS).logits, steps)
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo compiled the sublayers (not plain calls)
    ref = plain.new_cache(64)
    want = plain.forward(ref, ids, positions=0, logits_rows=ALL_ROWS).logits[13:]
    torch.testing.assert_close(steps, want, rtol=1e-4, atol=1e-4)
    prompt, cfg = _prompt(11, 2), GenerationConfig(max_new_tokens=16)
    sd = SelfSD(eng, skip=SkipSet([1], [2]), draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.3))
    res = sd.generate(prompt, cfg)
    assert res.token_ids == AR(eng).generate(prompt, cfg).token_ids and res.stats.drafted_tokens > 0
    assert eng.static.eager_fallbacks == 0
