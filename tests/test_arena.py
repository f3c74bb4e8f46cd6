"""The streamed panels on 2 MB pages (engine/arena.py): the same bytes in one advised region, each tensor 64-byte
aligned and the region 2 MB aligned, moved once, products bit-identical before and after; a block target's logits
are the same with huge pages on and off; ``SELFSPEC_HUGE_PAGES=0`` moves nothing."""
from __future__ import annotations

import gc

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.engine import Engine, arena, kernels, panel_file
from selfspec_cli.engine.kernels import A8Linear, Linear, PartsLinear, QLinear, QuantWeight

from .gguf_utils import make_tiny_gguf

ext = kernels.load_extension()
needs_kernel = pytest.mark.skipif(ext is None or not arena.enabled(), reason="needs the CPU kernel and Linux madvise")


def _q4(n: int, k: int, g: torch.Generator) -> QuantWeight:
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    return QuantWeight("q4_1", codes, torch.rand(n, k // 32, generator=g) * 0.02,
                       -torch.rand(n, k // 32, generator=g) * 0.1, 32, 4)


@needs_kernel
def test_place_moves_the_same_bytes_once_and_keeps_every_product():
    g = torch.Generator().manual_seed(0)
    a = QLinear.make(_q4(200, 256, g), None, ext)
    b = QLinear.make(_q4(70, 512, g), torch.randn(70, generator=g), ext)
    parts = PartsLinear([QLinear.make(_q4(64, 256, g), None, ext), QLinear.make(_q4(40, 256, g), None, ext)])
    dense = Linear.make(torch.randn(96, 256, generator=g), None, ext)
    shared = A8Linear(a)  # the int8-activation view holds a's own codes: moved with a, once
    lins = [a, b, parts, dense, shared]
    xs = {256: torch.randn(3, 256, generator=g), 512: torch.randn(3, 512, generator=g)}
    ins = [xs[256], xs[512], xs[256], xs[256], xs[256]]
    before = [lin(x) for lin, x in zip(lins, ins)]
    tensors = [a.codes, a.scales, a.mins, b.codes, b.scales, b.mins, *(t for p in parts.parts for t in (p.codes, p.scales, p.mins)),
               dense.packed]
    expect = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    moved = arena.place(lins)
    assert moved == expect
    after = [a.codes, a.scales, a.mins, b.codes, b.scales, b.mins, *(t for p in parts.parts for t in (p.codes, p.scales, p.mins)),
             dense.packed]
    for old, new in zip(tensors, after):
        assert new.data_ptr() != old.data_ptr() and new.data_ptr() % 64 == 0
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
    assert a.codes.data_ptr() % arena.HUGE == 0  # the region's first tensor starts a 2 MB page
    assert shared.base.codes is a.codes
    for lin, x, y in zip(lins, ins, before):
        assert torch.equal(lin(x), y)
    assert arena.place(lins) == 0  # already there
    assert arena.placed_bytes(lins) == sum(t.numel() * t.element_size() for t in after)


@needs_kernel
def test_off_switch_moves_nothing(monkeypatch):
    monkeypatch.setenv("SELFSPEC_HUGE_PAGES", "0")
    q = QLinear.make(_q4(64, 256, torch.Generator().manual_seed(1)), None, ext)
    ptr = q.codes.data_ptr()
    assert not arena.enabled() and arena.place([q]) == 0 and q.codes.data_ptr() == ptr


@pytest.mark.skipif(not arena.enabled(), reason="needs Linux madvise")
@pytest.mark.parametrize("huge", [True, False])
def test_panel_file_reads_into_a_region_or_maps(tmp_path, huge):
    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randint(0, 255, (5, 300, 64), generator=g, dtype=torch.uint8),
               "b": torch.randn(3, 7, generator=g).to(torch.float16), "c": torch.randn(1000, generator=g)}
    path = tmp_path / "p.panels"
    panel_file.save(path, tensors, {"k": 1})
    got, meta = panel_file.load(path, huge=huge)
    assert meta == {"k": 1}
    for name, t in tensors.items():
        assert torch.equal(got[name], t) and got[name].data_ptr() % 64 == 0
    in_region = any(lo <= got["a"].data_ptr() < hi for lo, hi in arena._regions)
    assert in_region == huge


@needs_kernel
def test_a_block_target_gives_the_same_logits_with_and_without_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path, _, tok = make_tiny_gguf(tmp_path / "src", seed=3, qtype="Q4_1", tie_word_embeddings=False)
    model, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    ids = torch.tensor(tok("A question about the weather, answered.")["input_ids"])
    on = Engine(model, target_precision="auto")
    assert on.kernel_info["huge_page_region_mb"] > 0
    assert arena.placed_bytes([lin for layer in on._lin for lin in layer.values()] + [on.lm_head]) > 0
    monkeypatch.setenv("SELFSPEC_HUGE_PAGES", "0")
    off = Engine(model, target_precision="auto")
    assert off.kernel_info["huge_page_region_mb"] == 0
    la = on.forward(on.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    lb = off.forward(off.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert torch.equal(la, lb)


def test_region_is_2mb_aligned_and_sized():
    if not arena.enabled():
        pytest.skip("needs Linux madvise")
    r = arena.region(3 << 20)
    assert r.numel() == 3 << 20 and r.data_ptr() % arena.HUGE == 0 and r.dtype == torch.uint8
    r.fill_(7)
    assert int(r[-1]) == 7 and int(r.sum()) == 7 * (3 << 20)
    span = (r.data_ptr(), r.data_ptr() + r.numel())
    view = r[5:9]
    del r
    gc.collect()
    assert span in arena._regions  # a view still holds the mapping
    del view
    gc.collect()
    assert span not in arena._regions  # unmapped: its addresses may hold anything later, never "already placed"
