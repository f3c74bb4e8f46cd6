"""A forward's decoder layers in one kernel call (csrc DecoderStack, ``Engine._stacked_layers``).

The stacked path must be the op-by-op loop of engine/runner.py, bit for bit: the same logits,
hidden states, K/V slots and position lists, for every kind of forward the methods make (a chain,
a token tree, skip sets, a layer range entered with hidden rows, kept hidden states, a draft's
StreamingLLM view, sliding windows that cut, quantized draft copies and block targets) and every
layer shape the engine runs (Llama, Qwen2's biases, Mistral's window, Qwen3's q/k norms, Gemma 3's
post norms, GeGLU and two rotary tables), and it must refuse an out-of-order
write before changing anything. Real tiny transformers models and a real GGUF file.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from selfspec_cli.engine import TARGET, Engine, ForwardTaps, Route, kernels
from selfspec_cli.engine.cache import CacheInvariantError
from selfspec_cli.engine.runner import ATTEND_MAX_ROWS

from .conftest import make_tiny_model

ext = kernels.load_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"kernel unavailable: {kernels.status()['reason']}")


def _both(eng: Engine, prefix: int, calls: list[dict], weights: str | None = None) -> list[tuple]:
    """Run the same forwards on a fresh cache with the stacked path on and off; returns both runs'
    (logits, hidden, hidden_at, k, v, positions) per call and the number of stacked forwards."""
    ids = torch.randint(0, 300, (prefix,), generator=torch.Generator().manual_seed(5))
    runs = []
    for stacked in (False, True):
        eng.stack_layers = stacked
        cache = eng.new_cache(64)
        eng.forward(cache, ids, positions=0, route=Route(weights=weights))
        before = eng.stacked_forwards  # the calls' forwards (the prefill may be stacked too)
        outs = []
        for kw in calls:  # each call's route, on the ``weights`` copy
            kw = {**kw, "route": dataclasses.replace(kw.get("route", TARGET), weights=weights)}
            o = eng.forward(cache, **kw)
            outs.append((o.logits, o.hidden, dict(o.hidden_at), cache.k.clone(), cache.v.clone(),
                         [list(p) for p in cache.positions]))
        runs.append((outs, eng.stacked_forwards - before))
    eng.stack_layers = True
    return runs


def _assert_same(runs: list[tuple], expect_stacked: int) -> None:
    (plain, n_plain), (stacked, n_stacked) = runs
    assert n_plain == 0 and n_stacked == expect_stacked
    for a, b in zip(plain, stacked):
        for x, y in zip(a[:2], b[:2]):
            assert (x is None and y is None) or torch.equal(x, y)
        assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][l], b[2][l]) for l in a[2])
        assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4]) and a[5] == b[5]


def _calls(eng: Engine, p: int) -> list[dict]:
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(9)
    tok = lambda n: torch.randint(0, 300, (n,), generator=g)  # noqa: E731
    has = lambda *ls: tuple(l for l in ls if l < eng.num_layers)  # noqa: E731  (a 2-layer model has no 2 or 3)
    return [
        dict(input_ids=tok(1), positions=p),  # one decode step
        dict(input_ids=tok(5), positions=p + 1, logits_rows=slice(None)),  # a chain verification
        dict(input_ids=tok(3), positions=p + 6, route=Route(skip_attn={1}, skip_mlp=has(0, 2)),
             taps=ForwardTaps(hidden_at=has(1, 3))),  # a skip draft
        dict(input_ids=tok(4), positions=torch.tensor([p + 9, p + 10, p + 10, p + 11]), tree_mask=tree,
             logits_rows=slice(None)),  # a token tree
        dict(input_ids=tok(2), positions=p + 12, route=Route(kv_window=(2, 4))),  # a draft's view of a long context
    ]


@needs_kernel
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias", "mistral-window", "qwen3-qknorm", "gemma3-window"])
def test_stacked_layers_are_the_op_by_op_loop_bit_for_bit(arch):
    # (the tiny Qwen3's heads of 24 are a size the kernel's attention does not take: 16 here)
    eng = Engine(make_tiny_model(arch, **({"head_dim": 16} if arch == "qwen3-qknorm" else {})))
    calls = _calls(eng, 6)
    # a range entered with hidden rows (AdaDecode's deferred layers): layers [2, 4) of rows left at layer 2
    runs = _both(eng, 6, calls)
    _assert_same(runs, expect_stacked=len(calls))
    eng.stack_layers = False
    c = eng.new_cache(32)
    eng.forward(c, torch.arange(6), positions=0)
    part = eng.forward(c, torch.tensor([7]), positions=6, end=2).hidden
    rest = []
    for stacked in (False, True):
        eng.stack_layers = stacked
        cc = eng.new_cache(32)
        eng.forward(cc, torch.arange(6), positions=0)
        eng.forward(cc, torch.tensor([7]), positions=6, end=2)
        rest.append(eng.forward(cc, hidden=part, positions=6, start=2).logits)
    assert torch.equal(*rest)


@needs_kernel
@pytest.mark.parametrize("arch", ["mistral-window", "gemma3-window"])
def test_a_window_that_cuts_is_the_loops_cut(arch):
    """Sliding windows (Mistral's tiny 12 positions; Gemma 3's local layers) cut the keys a row sees
    once the context passes them: the stacked path takes the loop's windowed masks."""
    eng = Engine(make_tiny_model(arch))
    window = min(w.sliding_window for w in eng.adapter.layers if w.sliding_window is not None)
    g = torch.Generator().manual_seed(3)
    calls = [dict(input_ids=torch.randint(0, 300, (3,), generator=g), positions=window + 2 + 3 * i,
                  logits_rows=slice(None), route=Route(skip_attn={1} if i == 1 else ())) for i in range(3)]
    _assert_same(_both(eng, window + 2, calls), expect_stacked=len(calls))


@needs_kernel
def test_what_the_stack_does_not_take_runs_op_by_op():
    """ASD's per-layer attention cosines, and more rows than the kernel's attention takes (a long prefill)."""
    eng = Engine(make_tiny_model("llama-gqa"))
    runs = _both(eng, 6, [dict(input_ids=torch.tensor([3]), positions=6, taps=ForwardTaps(attn_cosine=True)),
                          dict(input_ids=torch.arange(ATTEND_MAX_ROWS + 6) % 300, positions=7,
                               logits_rows=slice(None))])
    _assert_same(runs, expect_stacked=0)


@needs_kernel
@pytest.mark.parametrize("weights", ["int8", "int8-g32"])
def test_stacked_draft_copies_are_the_loop_bit_for_bit(weights):
    eng = Engine(make_tiny_model("llama-gqa"))
    calls = _calls(eng, 6)
    _assert_same(_both(eng, 6, calls, weights=weights), expect_stacked=len(calls))


@needs_kernel
def test_stacked_block_target_and_w4a8_draft_are_the_loop_bit_for_bit(tmp_path, monkeypatch):
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    path, _, _ = make_tiny_gguf(tmp_path, qtype="Q4_1", name="tiny-Q4_1.gguf")
    eng = Engine(load_model(str(path), dtype="float32", device="cpu", log=None)[0], target_precision="gguf")
    assert eng.target_precision == "gguf"
    calls = _calls(eng, 6)
    _assert_same(_both(eng, 6, calls), expect_stacked=len(calls))
    _assert_same(_both(eng, 6, calls, weights="w4a8"), expect_stacked=len(calls))
    eng.release_float_weights()  # the stacks held the norms the release moves: rebuilt, same values
    _assert_same(_both(eng, 6, calls), expect_stacked=len(calls))


@needs_kernel
def test_an_out_of_order_write_is_refused_before_anything_changes():
    eng = Engine(make_tiny_model("llama-gqa"))
    cache = eng.new_cache(32)
    eng.forward(cache, torch.arange(6), positions=0)
    eng.forward(cache, torch.tensor([9]), positions=6, route=Route(skip_attn={2, 3}))  # layers 2-3 stay at 6 slots
    k, v, pos = cache.k.clone(), cache.v.clone(), [list(p) for p in cache.positions]
    with pytest.raises(CacheInvariantError, match="layer 0"):
        eng.forward(cache, torch.tensor([4]), positions=6)  # layers 0-1 already hold position 6
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.positions == pos


@needs_kernel
def test_a_prefill_in_one_call_equals_it_in_pieces_and_row_by_row():
    """Prefills up to ATTEND_MAX_ROWS rows run in the kernel (its attention and the stack's products are
    row-invariant), so the cache and the last logits are the same bit for bit whether a prompt goes in at
    once, in pieces, or one token at a time; and a chain of rows after the cache builds no mask."""
    eng = Engine(make_tiny_model("llama-gqa"))
    ids = torch.arange(90) % 300
    outs = []
    for cuts in ([0, 90], [0, 1, 34, 90], list(range(91))):
        cache = eng.new_cache(96)
        for a, b in zip(cuts, cuts[1:]):
            out = eng.forward(cache, ids[a:b], positions=a)
        outs.append((out.logits[-1], cache.k[:, :, :90].clone(), cache.v[:, :, :90].clone()))
    for other in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs[0], other))
    cache = eng.new_cache(96)
    eng.forward(cache, ids[:40], positions=0)
    w = eng.adapter.layers[0].sliding_window
    assert eng._layer_mask(cache, 0, w, 4, None, [40, 41, 42, 43], None, {}, kernel=True) is None
    assert eng._layer_mask(cache, 0, w, 4, None, [40, 41, 42, 43], None, {}, kernel=False) is not None  # SDPA's
    cache.crop(30)
    cache.positions[0][-1] = 35  # a hole: the rows' positions no longer follow the slots
    assert eng._layer_mask(cache, 0, w, 4, None, [40, 41, 42, 43], None, {}, kernel=True) is not None


@needs_kernel
def test_the_common_step_finds_every_layers_slot_at_once(monkeypatch):
    """A step whose rows continue a cache holding 0..p-1 at every layer (the common case) takes its slots and
    masks at once instead of layer by layer (``Engine._stacked_layers``): no per-layer check runs, and its
    outputs, K/V and position lists are the loop's. A cache with a layer behind the others, or a draft's
    skipped layer, goes layer by layer."""
    from selfspec_cli.engine.cache import KVCache

    eng = Engine(make_tiny_model("llama-gqa"))
    checked = []
    real = KVCache.append_slot
    monkeypatch.setattr(KVCache, "append_slot", lambda self, l, pos: checked.append(l) or real(self, l, pos))
    g = torch.Generator().manual_seed(11)
    calls = [dict(input_ids=torch.randint(0, 300, (1,), generator=g), positions=6),
             dict(input_ids=torch.randint(0, 300, (4,), generator=g), positions=7, logits_rows=slice(None))]
    runs = _both(eng, 6, calls)
    _assert_same(runs, expect_stacked=len(calls))
    per_layer_calls = len(checked)
    checked.clear()
    cache = eng.new_cache(32)
    eng.forward(cache, torch.arange(6), positions=0)
    eng.forward(cache, torch.tensor([5]), positions=6)
    assert checked == []  # the stacked prefill and step: no layer checked alone
    eng.forward(cache, torch.tensor([9]), positions=7, route=Route(skip_attn={1}))  # layer 1 stays behind
    assert checked == [l for l in range(eng.num_layers) if l != 1]
    checked.clear()
    eng.forward(cache, torch.tensor([3]), positions=8)
    assert checked == list(range(eng.num_layers)) and cache.positions[1] == [0, 1, 2, 3, 4, 5, 6, 8]
    assert per_layer_calls > 0  # the op-by-op loop of _both checks each layer (cache.write)


@needs_kernel
def test_a_layer_whose_widths_disagree_is_refused_when_added():
    """DecoderStack writes a layer's o and down products into rows of the hidden width (one buffer a forward), so
    add() refuses a layer whose norms or o/down outputs are not that width, and a forward refuses rows of another
    width, before anything runs."""
    hq, hkv, d, h, inter = 2, 1, 16, 32, 48
    g = torch.Generator().manual_seed(1)

    def mat(n: int, k: int):
        return ext.mat(0, ext.pack(torch.randn(n, k, generator=g)), None, None, None, n, 0, 0, "auto")

    norm = torch.ones(h)
    good = [mat((hq + 2 * hkv) * d, h), mat(h, hq * d), mat(2 * inter, h), mat(h, inter)]
    stack = ext.DecoderStack(hq, hkv, d, 1e-6, False)
    stack.add(norm, norm, None, None, None, 0, *good)
    for bad in ([good[0], mat(h - 8, hq * d), *good[2:]], [*good[:3], mat(h + 16, inter)]):
        with pytest.raises(RuntimeError, match="o and down"):
            stack.add(norm, norm, None, None, None, 0, *bad)
    with pytest.raises(RuntimeError, match="bad weight"):
        stack.add(norm, torch.ones(h + 1), None, None, None, 0, *good)
    kc = torch.zeros(1, hkv, 8, d)
    rope = [torch.ones(1, d)], [torch.zeros(1, d)]
    with pytest.raises(RuntimeError, match="rows of width"):
        stack.forward(torch.randn(1, h + 8), kc, kc.clone(), 0, [0], [1], [0], [], [-1], *rope, 0, 0)
    assert stack.forward(torch.randn(1, h), kc, kc.clone(), 0, [0], [1], [0], [], [-1], *rope, 0, 0)[0].shape == (1, h)
