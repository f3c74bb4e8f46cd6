"""Quantized self-drafts (engine/quant.py, the kernel's qlinear, methods/specqd.py).

* the kernel: close to a float64 product with the dequantized weights, batch-invariant, and
  bit-identical on its AVX2 and AVX-512 paths;
* quantization: every int8 weight within half a scale step of the float weight;
* GGUF blocks: a draft read from a Q4_0 / Q4_1 / Q8_0 file has exactly the target's weights
  (the target was dequantized from the same file); a model that is not the file's is refused;
* the disk cache: a second build reads it and gives the same codes;
* exactness: greedy parity with ``ar`` for every method drafting over quantized weights;
  speculative sampling with a quantized draft law, by exact enumeration and by a chi-square
  test, each with a control that hands the verifier the wrong law (the unquantized one).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfspec_cli.bench import engine_profile
from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding import measure
from selfspec_cli.decoding import layer_skip as layer_skip_mod
from selfspec_cli.decoding import policy as policy_mod
from selfspec_cli.decoding.drafts import Chain
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.engine import Engine, Route, kernels, quant
from selfspec_cli.engine.kernels import QLinear, QuantWeight, quantize_int8
from selfspec_cli.methods import AR, build
from selfspec_cli.runtime import encode_turn

from .conftest import make_tiny_model
from .test_decoding import ALPHA, distribution_test

ext = kernels.load_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"kernel unavailable: {kernels.status()['reason']}")
HAS_AVX512 = ext is not None and ext.qisa() == "avx512"


@pytest.fixture(autouse=True)
def draft_cache(tmp_path, monkeypatch):
    """Draft copies are cached under a fresh directory (the compiled kernel is already loaded)."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _q4(n: int, k: int, g: torch.Generator, with_min: bool) -> QuantWeight:
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02
    mins = -torch.rand(n, k // 32, generator=g) * 0.1 if with_min else None
    return QuantWeight("q4_1" if with_min else "q4_0", codes, scales, mins, 32, 4)


FORMATS = {
    "int8": lambda n, k, g: quantize_int8(torch.randn(n, k, generator=g)),
    "int8-g32": lambda n, k, g: quantize_int8(torch.randn(n, k, generator=g), 32),
    "q4_1": lambda n, k, g: _q4(n, k, g, True),
    "q4_0": lambda n, k, g: _q4(n, k, g, False),
    # 5-bit codes held as bytes with a minimum (GGUF Q5_1, Q5_K), groups of 16 (Q6_K's sub-blocks)
    "q5_1": lambda n, k, g: QuantWeight("q5_1", torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8),
                                        torch.rand(n, k // 16, generator=g) * 0.02,
                                        -torch.rand(n, k // 16, generator=g) * 0.1, 16, 8),
}


@needs_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", [(16, 64), (37, 96), (600, 576)])
def test_qlinear_matches_the_dequantized_product(fmt, n, k):
    g = torch.Generator().manual_seed(n + k)
    qw = FORMATS[fmt](n, k, g)
    b = torch.randn(n, generator=g)
    lin = QLinear.make(qw, b, ext)
    for rows in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x.double(), qw.dequantize().double(), b.double())
        got = lin(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        tol = 2e-6 * k * float(want.abs().max() + 1)  # fp32 sums of k terms, grouped
        assert float((got.double() - want).abs().max()) < tol, rows


@pytest.mark.parametrize("bits", [4, 6])
def test_packing_a_few_super_panels_at_a_time_is_packing_the_whole(monkeypatch, bits):
    """QLinear.make packs 4- and 6-bit codes PACK_PANELS super-panels at a time (its temporaries stay small on a
    large head): the same bytes as one pass over the matrix, padded outputs and all, and the same codes back."""
    g = torch.Generator().manual_seed(bits)
    n, k = 64 * 5 + 23, 64
    codes = (torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8) if bits == 4
             else torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8))
    whole = kernels._packed_codes(codes, bits, 6)
    monkeypatch.setattr(kernels, "PACK_PANELS", 2)
    assert torch.equal(kernels._packed_codes(codes, bits, 6), whole)
    padded = torch.zeros(6 * 64, k, dtype=codes.dtype)
    padded[:n] = codes
    assert torch.equal(whole, kernels._pack_nibbles(padded).view(6, k // 2, 64) if bits == 4 else kernels._pack6(padded))
    back = (kernels._unpack_nibbles(whole.view(torch.int32).view(6, k // 8, 64)) if bits == 4
            else kernels._unpack6(whole, k))
    assert torch.equal(back[:n].to(codes.dtype), codes) and not back[n:].any()  # padded outputs: code 0


@needs_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_qlinear_is_batch_invariant_and_isa_independent(fmt):
    g = torch.Generator().manual_seed(3)
    qw = FORMATS[fmt](300, 192, g)
    lin = QLinear.make(qw, torch.randn(300, generator=g), ext)
    x = torch.randn(40, 192, generator=g)
    singles = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 25, 33):  # every AVX-512 tile (1-6 rows; 7-12 over halves), AVX2's (1-4)
        for start in (0, 3):
            assert torch.equal(lin(x[start:start + rows]), singles[start:start + rows]), (rows, start)
    if HAS_AVX512:  # the AVX2 path on the same machine: the same FMA chain per output lane
        lin.isa = "avx2"
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(40)]), singles)
        assert torch.equal(lin(x), singles)
        for rows in (2, 3, 5):
            assert torch.equal(lin(x[:rows]), singles[:rows]), rows


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx2"] if HAS_AVX512 else ["avx2"])
def test_masked_decode_gives_the_shifted_decodes_bits(isa):
    """4-bit codes with minimums and 6-bit codes are decoded by masking against a prescaled x (small_gemm.cpp,
    mk_prescale); a call holding a value too small to prescale exactly shifts its codes down instead (4-bit: the
    table decode). Rows are independent, so the other rows of that call are the shifted decode's bits for the
    same x: they must equal the masked call's."""
    g = torch.Generator().manual_seed(11)
    for qw in (_q4(200, 256, g, True), _k_quant("Q4_K", 130, 512), _k_quant("Q6_K", 100, 512)):
        lin = QLinear.make(qw, torch.randn(qw.codes.shape[0], generator=g), ext)
        lin.isa = isa
        k = qw.codes.shape[1]
        x = torch.randn(7, k, generator=g) * torch.logspace(-20, 20, k).float()  # across the exponent range
        assert float(x.abs().min()) > 2.0 ** -102  # so the first call is masked
        tiny = torch.zeros(1, k)
        tiny[0, 5] = 1e-33  # below 2^-102: not prescaled
        masked = lin(x)
        table = lin(torch.cat([x, tiny]))[:7]
        assert torch.equal(masked, table)
        for rows in (1, 2, 6):
            assert torch.equal(lin(torch.cat([x[:rows], tiny])), torch.cat([table[:rows], lin(tiny)]))

def _k_quant(qtype: str, rows: int, cols: int, seed: int = 3) -> QuantWeight:
    """A GGUF K-quant tensor of random blocks (gguf-py cannot quantize them) with finite float16 d and dmin,
    read by ``_gguf_block``."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    kind = Q[qtype]
    per, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype]:
        raw[:, :, at:at + 2] = rng.uniform(0.001, 0.1, (rows, cols // per)).astype(np.float16).view(np.uint8).reshape(
            rows, cols // per, 2)
    raw[0, 0, :4] = 0  # a zero d and dmin: every product of the block's groups is +-0

    class Tensor:
        tensor_type, data = kind, raw.reshape(rows, -1)

    return quant._gguf_block(Tensor())


def _unfactored(q: QuantWeight) -> QuantWeight:
    """The representation before factored scales and 6-bit panels: the same codes with the float32 products as
    scales; Q6_K's as bytes u = q + 32 with the minimum -32 s, the form the 6-bit panels are read in (csrc:
    decode6_512), so the same chain."""
    if q.bits != 6:
        return dataclasses.replace(q, sc=None, m=None, d=None, dmin=None)
    return dataclasses.replace(q, codes=(q.codes.to(torch.int16) + 32).to(torch.int8), mins=-32.0 * q.scales, sc=None,
                               m=None, d=None, dmin=None, bits=8)


KQ_ISAS = ["avx2"] + (["avx512"] if HAS_AVX512 else [])


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_factored_k_quant_scales_give_the_stored_products_bits(qtype):
    """A K-quant's scales read as d (float16 per 256 weights) times a small integer per group, formed in the
    kernel, give bit for bit the outputs of the float32 products stored per group: every row count 1..64 (so
    batch-invariant too), both instruction sets, with a bias; and the panels stream the file's factors, not
    the products (and Q6_K's codes in 6 bits, not a byte): Q6_K then reads exactly the file's 210 bytes per
    256 weights."""
    new = _k_quant(qtype, 150, 768)
    assert new.factored and torch.equal(new.d.repeat_interleave(256 // new.group, 1) * new.sc.float(), new.scales)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(150, generator=g)
    fac, old = QLinear.make(new, bias, ext), QLinear.make(_unfactored(new), bias, ext)
    assert fac.scales.dim() == 4 and old.scales.dim() == 3
    x = torch.randn(64, 768, generator=g)
    for isa in KQ_ISAS:
        fac.isa = old.isa = isa
        singles = torch.cat([fac(x[i:i + 1]) for i in range(64)])
        assert torch.equal(singles, old(x)), isa
        for rows in range(1, 65):
            assert torch.equal(fac(x[:rows]), singles[:rows]), (isa, rows)
        assert torch.equal(fac(x[7:12]), singles[7:12])
    weights = 150 * 768
    per_256 = {"Q4_K": 128 + 2 * (8 + 2), "Q5_K": 256 + 2 * (8 + 2), "Q6_K": 192 + 16 + 2}[qtype]
    assert kernels.stream_bytes(fac) == weights // 256 * per_256 < kernels.stream_bytes(old)
    back = fac.quant  # unpacked from the panels: the same codes, products and factors
    for name in ("codes", "scales", "mins", "sc", "m", "d", "dmin"):
        a, b = getattr(back, name), getattr(new, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert torch.equal(back.dequantize(), new.dequantize())
    ids = torch.tensor([0, 149, 64, 3, 3, 127, 128])  # rows read from the panels alone (a tied embedding's)
    assert torch.equal(fac.rows(ids), new.dequantize()[ids]) and torch.equal(old.rows(ids), new.dequantize()[ids])


@needs_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_from_the_panels_are_the_dequantized_rows(fmt):
    qw = FORMATS[fmt](300, 192, torch.Generator().manual_seed(7))
    ids = torch.tensor([299, 0, 63, 64, 5, 5, 200])
    assert torch.equal(QLinear.make(qw, None, ext).rows(ids), qw.dequantize()[ids])


@needs_kernel
def test_factored_panels_round_trip_the_cache_and_keep_w4a8():
    """Factored panels saved as the draft cache saves them (engine/panel_file) load back to the same outputs (no
    repacking), and the W4A8 product over Q4_K's codes gives the same bits with factored scales as with the
    stored products."""
    from selfspec_cli.engine import panel_file

    new = _k_quant("Q4_K", 100, 512, seed=5)
    fac, old = QLinear.make(new, None, ext), QLinear.make(_unfactored(new), None, ext)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    path = quant.cache_path("f" * 16, "gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    panel_file.save(path, {"codes": fac.codes, "scales": fac.scales, "mins": fac.mins}, {})
    t, _ = panel_file.load(path)
    again = QLinear.from_panels(fac.meta.fmt, fac.meta.group, fac.meta.bits, t["codes"], t["scales"], t["mins"], None,
                                ext, 100, kernels.stream_bytes(fac))
    assert torch.equal(again(x), fac(x)) and torch.equal(fac(x), old(x))
    for isa in KQ_ISAS:
        fac.isa = old.isa = isa
        a8, a8_old = kernels.A8Linear(fac), kernels.A8Linear(old)
        got = a8(x)
        assert torch.equal(got, a8_old(x)), isa
        assert torch.equal(torch.cat([a8(x[i:i + 1]) for i in range(9)]), got)


@needs_kernel
@pytest.mark.parametrize("kinds", [("Q4_K", "Q4_K"), ("Q5_K", "Q5_1")])
def test_rows_and_fused_parts_keep_their_factors_where_all_have_them(kinds):
    parts = [_k_quant(kinds[0], 70, 512, seed=1)]
    if kinds[1] == "Q4_K":
        parts.append(_k_quant("Q4_K", 30, 512, seed=2))
    else:  # a Q5_1-like part of the same layout (byte codes, a scale and minimum per 32) has no factors
        parts.append(_unfactored(_k_quant("Q5_K", 30, 512, seed=2)))
    fused = quant._cat_rows(parts)
    assert fused.factored == (kinds[1] == "Q4_K") and fused.codes.shape == (100, 512)
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    rows = quant._take_rows(fused, order)
    assert torch.equal(rows.dequantize(), fused.dequantize()[order]) and rows.factored == fused.factored
    lin, ref = QLinear.make(rows, None, ext), QLinear.make(_unfactored(rows), None, ext)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    assert torch.equal(lin(x), ref(x))


@pytest.mark.parametrize("group", [None, 32])
def test_int8_error_is_within_half_a_step(group):
    w = torch.randn(97, 128, generator=torch.Generator().manual_seed(5)) * 3
    w[0] = 0.0  # an all-zero channel quantizes to zeros
    qw = quantize_int8(w, group)
    assert qw.codes.dtype == torch.int8 and int(qw.codes.abs().max()) <= 127
    step = qw.scales.repeat_interleave(qw.group, dim=1)
    err = (qw.dequantize() - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-6) + 1e-12).all())
    assert torch.equal(qw.dequantize()[0], torch.zeros(128))
    # the bound is tight: round-to-nearest reaches close to half a step somewhere
    assert float((err / step.clamp_min(1e-30))[1:].max()) > 0.45


@needs_kernel
@pytest.mark.parametrize("qtype,formats", [("Q4_1", {"q4_1"}), ("Q4_0", {"q4_0"}), ("Q8_0", {"q8_0"})])
def test_gguf_block_draft_is_the_targets_weights(tmp_path, monkeypatch, qtype, formats):
    """The target is dequantized from the file; the block draft reads the same blocks, so every
    matrix dequantizes to the target's weights exactly (q/k rows matched through llama.cpp's
    permutation); greedy decoding with the block draft is the target's."""
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    path, _, _ = make_tiny_gguf(tmp_path, qtype=qtype, name=f"tiny-{qtype}.gguf")
    model, _ = load_model(str(path), dtype="float32", device="cpu", log=None)
    eng = Engine(model)
    draft = eng.quantized("gguf")
    assert set(draft.info["formats"]) == formats and draft.info["int8_fallback"] == []
    a = eng.adapter
    for l, w in enumerate(a.layers):
        for name in quant.LINEARS:
            assert torch.equal(draft.layers[l][name].quant.dequantize(), getattr(w, f"w_{name}")), (l, name)
    assert torch.equal(draft.head.quant.dequantize(), a.lm_head)
    # the draft's own logits are the target's up to summation order
    ids = torch.arange(2, 14)
    c1, c2 = eng.new_cache(16), eng.new_cache(16)
    want = eng.forward(c1, ids, positions=0, logits_rows=slice(None)).logits
    got = eng.forward(c2, ids, positions=0, logits_rows=slice(None), route=Route(weights="gguf")).logits
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert float((want - got).abs().max()) < 1e-3
    # a second engine on the same model reads the cache (beside the converted model)
    again = Engine(model).quantized("gguf")
    assert again.info["cache"] == "hit" and "drafts" in again.info["path"]
    for l in range(len(a.layers)):
        assert torch.equal(again.layers[l]["qkv"].quant.codes, draft.layers[l]["qkv"].quant.codes)


@needs_kernel
def test_gguf_draft_refuses_a_model_that_is_not_the_files():
    from selfspec_cli.engine.quant import GGUFDraftError

    eng = Engine(make_tiny_model("llama-gqa"))
    with pytest.raises(GGUFDraftError, match="GGUF"):
        eng.quantized("gguf")


@needs_kernel
def test_int8_draft_cache_round_trip(draft_cache):
    model = make_tiny_model("qwen2-bias")
    first = Engine(model).quantized("int8")
    assert first.info["cache"] == "miss" and first.info["bytes"] > 0
    second = Engine(model).quantized("int8")
    assert second.info["cache"] == "hit" and str(draft_cache) in second.info["path"]
    for a, b in zip(first.layers, second.layers):
        for name in quant.LINEARS:
            assert torch.equal(a[name].quant.codes, b[name].quant.codes)
            assert torch.equal(a[name].quant.scales, b[name].quant.scales)
            assert (a[name].bias is None) == (b[name].bias is None)  # Qwen2's q/k/v biases are kept


@needs_kernel
def test_the_cache_holds_the_kernels_panels_and_a_load_repacks_nothing(draft_cache, monkeypatch, tmp_path):
    """The copy on disk is the packed panels the kernel reads: a second load builds no panel (QLinear.make
    is not called) and gives the same panels, biases, sizes and logits; an older format's file beside it
    is removed once the new one is written; a file whose shapes are not the model's is rebuilt."""
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    path, _, _ = make_tiny_gguf(tmp_path, qtype="Q4_1", name="tiny-cache.gguf")
    model, _ = load_model(str(path), dtype="float32", device="cpu", log=None)
    first = Engine(model).quantized("gguf")
    where = Path(first.info["path"])
    stale = where.with_name(where.name.replace(f"-v{quant.CACHE_FORMAT}.", "-v1."))
    stale.write_bytes(b"old")
    where.unlink()
    first = Engine(model).quantized("gguf")  # built again, written, the old format dropped
    assert first.info["cache"] == "miss" and not stale.exists() and where.is_file()

    def no_packing(*a, **k):
        raise AssertionError("a cached copy was repacked")

    with monkeypatch.context() as mp:
        mp.setattr(kernels.QLinear, "make", no_packing)
        eng = Engine(model)
        second = eng.quantized("gguf")
    assert second.info["cache"] == "hit"
    for a, b in [*((x[n], y[n]) for x, y in zip(first.layers, second.layers) for n in quant.LINEARS),
                 (first.head, second.head)]:
        assert a.meta.fmt == b.meta.fmt and (a.meta.group, a.meta.bits) == (b.meta.group, b.meta.bits)
        assert (a.out_features, kernels.stream_bytes(a)) == (b.out_features, kernels.stream_bytes(b))
        for t, u in [(a.codes, b.codes), (a.scales, b.scales), (a.mins, b.mins), (a.bias, b.bias)]:
            assert (t is None and u is None) or (t.dtype == u.dtype and torch.equal(t, u))
        # the panels start on a cache line, as freshly packed ones do (a line of codes read in one access)
        assert all(t.data_ptr() % 64 == 0 for t in (b.codes, b.scales, b.mins) if t is not None)
    ids = torch.arange(2, 12)
    c1, c2 = eng.new_cache(16), eng.new_cache(16)
    got = eng.forward(c1, ids, positions=0, logits_rows=slice(None), route=Route(weights="gguf")).logits
    eng.drafts["gguf"] = first
    assert torch.equal(got, eng.forward(c2, ids, positions=0, logits_rows=slice(None), route=Route(weights="gguf")).logits)
    # a file of the right name whose matrices have other shapes (another model's) is not read
    other = quant._load(where, Engine(make_tiny_model("llama-gqa", layers=2)).adapter, None)
    assert other is None


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_kernel
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "mistral-window"])
@pytest.mark.parametrize("method,options", [
    ("specqd", {"draft_precision": "int8", "paper_drafting": True}),
    ("specqd", {"draft_precision": "int8-g32", "hybrid": True, "paper_drafting": True}),
    ("specqd", {"draft_precision": "int8"}),  # planned: may decline to draft on a tiny model, stays exact
    ("self-sd", {"draft_precision": "int8", "skip_attn": "1", "skip_mlp": "2", "paper_drafting": True}),
    ("swift", {"draft_precision": "int8", "paper_drafting": True}),
    ("asd", {"draft_precision": "int8", "paper_drafting": True}),
    ("auto", {"draft_precision": "int8"}),
])
def test_quantized_drafts_keep_greedy_parity(arch, method, options):
    model = make_tiny_model(arch, layers=4)
    eng = Engine(model)
    m = build(method, eng, None, **options)
    ar = AR(eng)
    drafted = 0
    for seed, n in [(0, 40), (1, 13), (2, 2)]:
        prompt = _prompt(6, seed, model.config.vocab_size)
        cfg = GenerationConfig(max_new_tokens=n)
        res = m.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        drafted += res.stats.drafted_tokens
    info = m.describe().to_json()
    assert (info.get("quant") or info.get("layer_skip") or info)["draft_precision"] == options["draft_precision"]
    if options.get("paper_drafting"):
        assert drafted > 0


# ---- sampling: exact enumeration with a real quantized draft law ------------------------------


def _coarse_draft(eng: Engine, levels: int = 16) -> None:
    """Replace the engine's int8 copy by a coarse one in the 4-bit format (``levels`` code values
    per group of 32 weights, with a scale and a minimum), so that the draft law differs clearly
    from the target's and a wrong law shows."""
    def q4(w: torch.Tensor) -> QuantWeight:
        n, k = w.shape
        b = w.detach().float().view(n, k // 32, 32)
        lo, hi = b.amin(-1), b.amax(-1)
        s = ((hi - lo) / (levels - 1)).clamp_min(1e-8)
        codes = torch.round((b - lo[..., None]) / s[..., None]).clamp(0, levels - 1).to(torch.uint8).view(n, k)
        return QuantWeight("q4_1", codes, s.contiguous(), lo.contiguous(), 32, 4)

    a = eng.adapter
    layers = [{n: QLinear.make(q4(getattr(w, f"w_{n}")), getattr(w, f"b_{n}"), ext) for n in quant.LINEARS}
              for w in a.layers]
    eng.drafts["int8"] = quant.DraftWeights("int8", layers, QLinear.make(q4(a.lm_head), None, ext))


@needs_kernel
@pytest.mark.parametrize("k", [1, 2, 3])
def test_quantized_draft_law_is_exact_by_enumeration(monkeypatch, k):
    """The real chain rule, its randomness enumerated, with p the target's and q the quantized
    draft's own processed laws along one chain of a tiny 4-token model: the output law is the
    target's. Control: the verifier told the unquantized draft's law (the target's) fails."""
    from . import test_verify_exact as ve

    model = make_tiny_model("llama-gqa", vocab=ve.V, layers=2, hidden_size=64, intermediate_size=128)
    eng = Engine(model)
    _coarse_draft(eng)
    chain = [2, 1, 3, 0, 2, 1, 3]
    ids = torch.tensor(chain)
    c1, c2 = eng.new_cache(16), eng.new_cache(16)
    p_logits = eng.forward(c1, ids, positions=0, logits_rows=slice(None)).logits.double()
    q_logits = eng.forward(c2, ids, positions=0, logits_rows=slice(None), route=Route(weights="int8")).logits.double()
    p = processed_probs(p_logits, ve.SAMPLING).double()
    q = processed_probs(q_logits, ve.SAMPLING).double()
    assert float((p - q).abs().max()) > 0.02  # the coarse draft's law is not the target's

    class WrongLaw(ve.ChainHarness):
        def verifier_q(self, kk):
            return self.p[:kk]

    # the law the rule targets is the processed law of the logits it is handed (log p), as it computes it
    target = processed_probs(p.log(), ve.SAMPLING).double()
    for harness, exact in ((ve.ChainHarness, True), (WrongLaw, False)):
        h = harness(monkeypatch, p=p, q=q)
        law, branch = h.law(k)
        dev = ve.law_deviation(law, lambda y: target[len(y)].tolist(), k + 1)
        if exact:
            assert all(b > 1e-4 for b in branch), branch
            assert dev <= 1e-6  # float32 rounding of real laws (test_verify_exact gets 1e-9 from /16 rows)
        else:
            assert dev > ve.BROKEN


# ---- sampling: the whole method, chi-square against the target's exact law --------------------

SMALL_VOCAB = 40
PAIR_RUN = 6
SAMPLING = SamplingConfig(temperature=1.0, top_k=25, top_p=0.95)


@pytest.fixture(scope="module")
def small_setup():
    from .test_speculative import _exact_pair_law

    model = make_tiny_model("llama-gqa", vocab=SMALL_VOCAB, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = _prompt(5, 11, SMALL_VOCAB)
    return model, prompt, _exact_pair_law(model, prompt)


def _pairs(method, prompt: list[int], n: int) -> list[int]:
    out = []
    for s in range(n):
        cfg = GenerationConfig(max_new_tokens=PAIR_RUN, sampling=SamplingConfig(SAMPLING.temperature, SAMPLING.top_k,
                                                                                SAMPLING.top_p, s, "speculative"))
        t = method.generate(prompt, cfg).token_ids
        out.append(t[1] * SMALL_VOCAB + t[2])
    return out


def _specqd(model) -> object:
    eng = Engine(model)
    m = build("specqd", eng, None, draft_precision="int8", paper_drafting=True, max_draft=4)
    _coarse_draft(eng, levels=2)  # after build: the proposer reads engine.drafts["int8"] at every forward
    return m


@needs_kernel
def test_specqd_sampling_is_exact(small_setup):
    model, prompt, law = small_setup
    m = _specqd(model)
    samples = _pairs(m, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


@needs_kernel
def test_specqd_sampling_control_wrong_law_fails(small_setup, monkeypatch):
    """Control: drafts sampled from the quantized law, the verifier handed the law the target's
    weights give at the same position (what a draft that forgot its precision would report)."""
    model, prompt, law = small_setup
    m = _specqd(model)
    orig_propose = layer_skip_mod.LayerSkipDrafter.draft

    def propose(self, state, budget):
        draft = orig_propose(self, state, budget)
        if isinstance(draft, Chain) and draft.q is not None and draft.tokens:  # recompute each row's law from the target's weights
            rows = []
            fed = [state.pending, *draft.tokens[:-1]]
            state.rollback()
            out = state.verify_forward(fed[1:]) if len(fed) > 1 else state.verify_forward([])
            state.rollback()
            for i in range(len(draft.tokens)):
                rows.append(processed_probs(out.logits[i], state.sampling))
            for t in draft.tokens:
                state.feed(t)
            draft = dataclasses.replace(draft, q=torch.stack(rows))
        return draft

    monkeypatch.setattr(layer_skip_mod.LayerSkipDrafter, "draft", propose)
    samples = _pairs(m, prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


@needs_kernel
@pytest.mark.parametrize("method,options", [("self-sd", {"skip_attn": "1,3", "skip_mlp": "2,4"}), ("asd", {})])
def test_skip_set_and_full_depth_variants_keep_parity(method, options):
    """Cost-aware drafting over a quantized copy weighs the method's skip set against full depth
    each round (decoding/layer_skip.py, SkipOrFullDepth): both configurations are planned and the
    output stays the target's."""
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    m = build(method, eng, None, draft_precision="int8", **options)
    ar = AR(eng)
    for seed, n in [(0, 40), (1, 17)]:
        prompt = _prompt(6, seed, model.config.vocab_size)
        cfg = GenerationConfig(max_new_tokens=n)
        assert m.generate(prompt, cfg).token_ids == ar.generate(prompt, cfg).token_ids
    info = m.describe().to_json()
    assert any(info["skip_attn"] + info["skip_mlp"]) and "full_depth" in info  # both variants have planners
    assert info["cost_model"]["c"] > 0 and info["full_depth"]["cost_model"]["c"] > 0
    assert m.describe().to_json() == info  # describing changes nothing


def test_artifact_precision_falls_back_when_this_engine_cannot_have_it(tmp_path):
    """A skip set calibrated on GGUF blocks, loaded for a model that is not a GGUF conversion:
    the method drafts on what ``auto`` gives here instead of refusing (the user asked for nothing)."""
    from selfspec_cli.artifacts import environment_info, save_json_artifact
    from selfspec_cli.methods.self_sd import SkipSet

    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    manifest = SkipSet(frozenset({1}), frozenset()).to_manifest(
        model, objective={"name": "test", "value": 1.0, "unit": "x"}, trials=1, search={},
        environment=environment_info(eng.device, eng.dtype), draft_precision="gguf")
    path = save_json_artifact(tmp_path / "s.json", manifest)
    m = build("self-sd", eng, None, layers=path)
    assert m.describe().draft_precision == ("int8" if ext is not None else "target")


@needs_kernel
def test_draft_window_reaches_the_draft_forward():
    """--draft-window N: drafts attend to 4 sinks + the newest N keys (not with --paper-drafting);
    the engine's forward changes only once the context is longer than that."""
    from selfspec_cli.methods.base import DRAFT_SINKS

    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    assert build("specqd", eng, None, draft_precision="int8", draft_window=8).parts.settings.kv_window == (DRAFT_SINKS, 8)
    assert build("specqd", eng, None, draft_precision="int8").parts.settings.kv_window is None  # off by default
    assert build("specqd", eng, None, draft_precision="int8", draft_window=8,
                 paper_drafting=True).parts.settings.kv_window is None
    ids = torch.arange(2, 42)

    def last_logits(n: int, window) -> torch.Tensor:
        cache = eng.new_cache(64)
        eng.forward(cache, ids[:n], positions=0)
        return eng.forward(cache, ids[n:n + 1], positions=n, route=Route(weights="int8", kv_window=window)).logits

    assert torch.equal(last_logits(10, (DRAFT_SINKS, 8)), last_logits(10, None))  # 11 keys <= 4 + 8
    assert not torch.equal(last_logits(39, (DRAFT_SINKS, 8)), last_logits(39, None))


@needs_kernel
@pytest.mark.parametrize("method,options", [
    ("specqd", {"draft_precision": "int8", "paper_drafting": True}),
    ("specqd", {"draft_precision": "int8-g32", "paper_drafting": True}),
])
def test_a_draft_ends_at_an_end_of_sequence_token(method, options):
    """Nothing after an end of sequence can be emitted: a chain draft stops at a stop token
    instead of spending draft and verification rows past it (answers that end early)."""
    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    prompt = _prompt(6, 0, model.config.vocab_size)
    free = AR(eng).generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
    stop = free[12]  # a token the answer reaches mid-way: made the end of sequence
    cfg = GenerationConfig(max_new_tokens=24, eos_token_ids=(stop,))
    m = build(method, eng, None, **options)
    drafts = []
    propose = m.drafter.draft

    def spy(state, budget):
        d = propose(state, budget)
        drafts.append(list(d.tokens) if isinstance(d, Chain) else [])
        return d

    m.drafter.draft = spy
    res = m.generate(prompt, cfg)
    assert res.token_ids == AR(eng).generate(prompt, cfg).token_ids
    assert res.token_ids[-1] == stop
    assert any(d and d[-1] == stop for d in drafts)  # the draft reached the stop token ...
    assert all(stop not in d[:-1] for d in drafts)  # ... and never drafted past it


# ---- the full-depth quantized draft's prior: its measured agreement --------------------------


@needs_kernel
def test_draft_agreement_counts_the_drafts_top1_and_is_kept_beside_the_copy(draft_cache):
    model = make_tiny_model("llama-gqa")
    eng = Engine(model)
    eng.quantized("int8")
    _coarse_draft(eng, levels=8)  # a draft that disagrees now and then (22 of 24 here), so the count is not trivially all or none
    eng.drafts["int8"].info = {"path": str(draft_cache / "drafts" / "copy.safetensors")}
    ctx = _prompt(6, 0, model.config.vocab_size)
    hits, n = measure.draft_agreement(eng, "int8", ctx, tokens=24)
    assert n == 24 and [hits] == engine_profile._agreement(eng, [ctx], 24, [Route(weights="int8")])[0]  # profile's count
    assert 0 < hits < n
    side = list((draft_cache / "drafts").glob("copy.safetensors.agreement-*.json"))
    assert len(side) == 1 and json.loads(side[0].read_text())["hits"] == hits
    # a later process reads the file instead of measuring again (a changed count shows it was read)
    side[0].write_text(json.dumps({"hits": 3, "positions": 24}))
    again = Engine(model)
    again.drafts["int8"] = eng.drafts["int8"]
    assert measure.draft_agreement(again, "int8", ctx, tokens=24) == (3, 24)


@needs_kernel
def test_full_depth_quantized_planners_start_from_the_measured_agreement(tiny_tokenizer):
    eng = Engine(make_tiny_model("llama-gqa"))
    ids = encode_turn(tiny_tokenizer, [{"role": "user", "content": policy_mod.AGREEMENT_PROMPT}], True)
    hits, n = measure.draft_agreement(eng, "int8", ids)
    q = (hits + 1) / (n + 2)
    assert q != 0.5
    specqd = build("specqd", eng, tiny_tokenizer, draft_precision="int8")
    assert specqd.policy.planner.prior == q and specqd.policy.planner.acceptance.rate(1) == pytest.approx(q)
    # a skip set on top: its own planner knows nothing yet; full depth on the same weights starts from q
    ssd = build("self-sd", eng, tiny_tokenizer, draft_precision="int8", skip_attn="1", skip_mlp="2")
    assert ssd.drafter.skip.policy.planner.prior == 0.5
    assert ssd.drafter.full.policy.planner.prior == q
    # target-precision drafts and drafts without a tokenizer keep the flat prior
    assert build("self-sd", eng, tiny_tokenizer, draft_precision="target", skip_attn="1").policy.planner.prior == 0.5
    assert build("specqd", eng, None, draft_precision="int8").policy.planner.prior == 0.5


def test_a_direct_gguf_models_directory_keeps_only_its_blocks_copy(tmp_path, draft_cache):
    """Nothing in a model's directory is larger than its file (issue 47): a model read straight from its GGUF keeps
    the copy of its own blocks beside it, and a copy at another precision (int8 of a 4-bit file is larger than the
    file) goes to the cache's drafts/; a GGUF converted to float weights keeps every copy beside it, as before."""
    import json as _json

    direct, converted = tmp_path / "direct", tmp_path / "converted"
    for where, weights in ((direct, "gguf"), (converted, "float32")):
        where.mkdir()
        (where / "selfspec-source.json").write_text(_json.dumps({"weights": weights}))
    assert quant.cache_path("f", "gguf", str(direct)).parent == direct / "drafts"
    for precision in ("int8", "int8-g32"):
        assert quant.cache_path("f", precision, str(direct)).parent == draft_cache / "drafts"
        assert quant.cache_path("f", precision, str(converted)).parent == converted / "drafts"
    assert quant.cache_path("f", "int8", None).parent == draft_cache / "drafts"


def test_a_first_build_streams_each_matrix_into_its_cache_file(draft_cache, monkeypatch, tmp_path):
    """A copy built from the GGUF's blocks is written matrix by matrix into its cache file (quant._gguf_to_file: the
    panel file's index last), never held whole and saved afterwards (``_save``, the in-memory path, is not called:
    a streaming failure would otherwise fall back to it unseen), and it holds the panels the in-memory build makes."""
    from selfspec_cli.engine import panel_file
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    path, _, _ = make_tiny_gguf(tmp_path, qtype="Q4_1", name="tiny-stream.gguf")
    model, _ = load_model(str(path), dtype="float32", device="cpu", log=None)

    def held_whole(*a, **k):
        raise AssertionError("the copy was built in memory and saved whole")

    with monkeypatch.context() as mp:
        mp.setattr(quant, "_save", held_whole)
        streamed = Engine(model).quantized("gguf")
    where = Path(streamed.info["path"])
    assert streamed.info["cache"] == "miss" and where.read_bytes()[:8] == panel_file.MAGIC
    where.unlink()
    with monkeypatch.context() as mp:
        mp.setattr(quant, "_gguf_to_file", lambda *a, **k: None)  # the in-memory build, then _save
        held = Engine(model).quantized("gguf")
    assert held.info["cache"] == "miss" and where.is_file()
    for a, b in [*((x[n], y[n]) for x, y in zip(streamed.layers, held.layers) for n in quant.LINEARS),
                 (streamed.head, held.head)]:
        assert (a.meta.fmt, a.out_features) == (b.meta.fmt, b.out_features)
        for t, u in [(a.codes, b.codes), (a.scales, b.scales), (a.mins, b.mins), (a.bias, b.bias)]:
            assert (t is None and u is None) or (t.dtype == u.dtype and torch.equal(t, u))
