"""The engine's CPU kernel (engine/kernels.py): close to F.linear, batch-invariant, with a
plain fallback; and the engine gives the same tokens with and without it."""
from __future__ import annotations

import os

import pytest
import torch

from selfspec_cli.errors import ConfigError
import torch.nn.functional as F

from selfspec_cli.engine import Engine, kernels

from .conftest import make_tiny_model

ext = kernels.load_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"kernel unavailable: {kernels.status()['reason']}")


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 64), (37, 64), (200, 100), (1000, 576), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = kernels.Linear.make(w, b, ext)
    assert lin.packed is not None
    for rows in (1, 2, 3, 5, 6, 7, 8, 13, 16, 33, 64, 301):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = lin(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        # one FMA chain per output: error of a k-term fp32 sum
        tol = 1e-5 * (k ** 0.5) * float(want.abs().max() + 1)
        assert float((got.double() - want).abs().max()) < tol, rows


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2"] + (["avx512"] if ext is not None and ext.qisa() == "avx512" else []))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_kernel_is_batch_invariant(wdtype, isa, monkeypatch):
    """Every row of a k-row product is bit-identical to the same row computed alone, at any
    position in the batch: what makes verification reproduce one-row decode steps exactly."""
    monkeypatch.setenv("SELFSPEC_ISA", isa)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g).to(wdtype)
    lin = kernels.Linear.make(w, torch.randn(300, generator=g).to(wdtype), ext)
    assert lin.isa == ("avx2" if isa == "avx2" else "auto")
    x = torch.randn(300, 576, generator=g)
    singles = torch.cat([lin(x[i:i + 1]) if wdtype == torch.float32 else lin(x[i:i + 1].to(wdtype)).float()
                         for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 64, 250):
        for start in (0, 1, 5):
            if start + rows > x.shape[0]:
                continue
            xs = x[start:start + rows]
            got = lin(xs) if wdtype == torch.float32 else lin(xs.to(wdtype)).float()
            assert torch.equal(got, singles[start:start + rows]), (rows, start)


HAS_AVX512 = ext is not None and ext.qisa() == "avx512"


@needs_kernel
@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: only the AVX2 path runs here")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_panels_give_the_same_bits_on_both_paths(wdtype):
    """The AVX-512 tile (one zmm a panel) keeps each output's FMA chain of the AVX2 tile (one lane of a ymm):
    every row count, both with a bias, outputs that fill no whole panel, equal bit for bit."""
    g = torch.Generator().manual_seed(7)
    for n, k in [(300, 576), (37, 100), (5, 3), (1100, 64)]:
        w = torch.randn(n, k, generator=g).to(wdtype)
        packed, b = ext.pack(w), torch.randn(n, generator=g)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 64):
            x = torch.randn(rows, k, generator=g)
            for bias in (None, b):
                assert torch.equal(ext.linear(x, packed, n, bias, "avx2"), ext.linear(x, packed, n, bias, "avx512")), (n, k, rows)
    with pytest.raises(RuntimeError, match="isa"):
        ext.linear(x, packed, n, None, "sse")


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_16_bit_panels_equal_float32_panels_of_the_same_values(wdtype):
    """A 16-bit panel is widened exactly in registers (bf16 of an even K packed as k-pairs, split by a shift
    and a mask), so its products equal those of float32 panels of the same values bit for bit, on both paths."""
    g = torch.Generator().manual_seed(11)
    isas = ["avx2"] + (["avx512"] if HAS_AVX512 else [])
    for n, k in [(300, 576), (37, 99), (5, 2), (70, 64)]:
        w = torch.randn(n, k, generator=g).to(wdtype)
        packed, ref = ext.pack(w), ext.pack(w.float())
        assert packed.shape[1:] == ((k // 2, 32) if wdtype == torch.bfloat16 and k % 2 == 0 else (k, 16))
        for rows in (1, 2, 3, 5, 8):
            x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
            for isa in isas:
                assert torch.equal(ext.linear(x, packed, n, b, isa), ext.linear(x, ref, n, b, isa)), (n, k, rows, isa)


@needs_kernel
def test_bfloat16_weights_are_exact_conversions():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 96, generator=g)
    got = ext.linear(x, ext.pack(w), 64, None, "auto")
    want = F.linear(x.double(), w.double())
    assert float((got.double() - want).abs().max()) < 1e-4


def test_without_the_kernel_it_is_f_linear(monkeypatch):
    w, b = torch.randn(20, 32), torch.randn(20)
    x = torch.randn(5, 32)
    plain = kernels.Linear.make(w, b, None)
    assert plain.packed is None and torch.equal(plain(x[:3]), F.linear(x[:3], w, b))
    monkeypatch.setenv("SELFSPEC_KERNELS", "0")
    assert "SELFSPEC_KERNELS" in kernels.unavailable_reason()
    assert kernels.unavailable_reason(torch.device("cuda")) is not None


@needs_kernel
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "gemma3-window"])
def test_engine_logits_with_and_without_kernel(arch):
    model = make_tiny_model(arch)
    eng = Engine(model)
    assert eng.kernel_info["backend"] == "small_gemm"
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    c1 = eng.new_cache(32)
    fast = eng.forward(c1, ids[:8], positions=0, logits_rows=slice(None)).logits
    with eng.plain_linear():
        c2 = eng.new_cache(32)
        plain = eng.forward(c2, ids[:8], positions=0, logits_rows=slice(None)).logits
    assert float((fast - plain).abs().max()) < 1e-3
    c4 = eng.new_cache(32)  # the block is left with the kernel back in place
    assert torch.equal(eng.forward(c4, ids[:8], positions=0, logits_rows=slice(None)).logits, fast)
    # a k-row verify forward equals k one-row steps bit for bit (batch invariance through the whole stack)
    c3 = eng.new_cache(32)
    eng.forward(c3, ids[:4], positions=0)
    many = eng.forward(c3, ids[4:10], positions=4, logits_rows=slice(None)).logits
    c3.crop(4)
    ones = torch.cat([eng.forward(c3, ids[4 + i:5 + i], positions=4 + i).logits for i in range(6)])
    if eng.kernel_info["batch_invariant"]:  # products, norms, rotary, attention and SwiGLU all row-wise
        assert torch.equal(many, ones)
    else:  # a head size the kernel's attention does not take: SDPA, last-bit differences
        assert float((many - ones).abs().max()) < 1e-5


def test_engine_without_kernel_reports_why(monkeypatch):
    eng = Engine(make_tiny_model("llama-gqa"), fast_kernels=False)
    assert eng.kernel_info == {"backend": "torch", "reason": "fast_kernels=False", "load_s": None,
                               "pack_s": eng.kernel_info["pack_s"], "huge_page_region_mb": 0.0, "batch_invariant": False,
                               "target": "fp32", "exact_trees": False}
    monkeypatch.setenv("SELFSPEC_KERNELS", "0")
    eng = Engine(make_tiny_model("llama-gqa"), target_precision="auto")  # auto without the kernel: weights as loaded
    assert eng.target_precision == "fp32" and "no CPU kernel" in eng.target_info["why"]
    with pytest.raises(ConfigError, match="needs the CPU kernel"):
        Engine(make_tiny_model("llama-gqa"), target_precision="bf16")
    assert eng.kernel_info["backend"] == "torch" and "SELFSPEC_KERNELS" in eng.kernel_info["reason"]
    assert all(lin.packed is None for lin in eng._lin[0].values()) and eng.lm_head.packed is None


@needs_kernel
def test_rms_norm_kernel_matches_and_is_row_wise():
    g = torch.Generator().manual_seed(3)
    for h in (64, 576, 100):
        x, w = torch.randn(9, h, generator=g) * 3, torch.randn(h, generator=g)
        got = ext.rms_norm(x, w, 1e-5)
        want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()
        assert float((got.double() - want).abs().max()) < 1e-5
        assert torch.equal(torch.cat([ext.rms_norm(x[i:i + 1], w, 1e-5) for i in range(9)]), got)


@needs_kernel
@pytest.mark.parametrize("d", [16, 64, 256])  # 256: Gemma 3's head size
@pytest.mark.parametrize("t", [1, 5])
def test_small_ops_match_torch(d, t):
    """attend / rope_ / silu_mul against SDPA and the eager formulas: causal after `past` cached
    slots, an explicit mask with holes (a tree or a window), GQA."""
    m = kernels.load_extension()
    g = torch.Generator().manual_seed(d + t)
    hq, hkv, past = 6, 2, 9
    n = past + t
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    k, v = torch.randn(hkv, n + 3, d, generator=g), torch.randn(hkv, n + 3, d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d).transpose(0, 1)[None]
    causal = torch.ones(t, n, dtype=torch.bool).tril(past)
    holes = causal & (torch.rand(t, n, generator=g) > 0.3)
    holes[:, 0] = True
    for allowed, mask in ((causal, None), (holes, holes)):
        add = torch.zeros(t, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        ref = F.scaled_dot_product_attention(q, k[None, :, :n], v[None, :, :n], attn_mask=add[None, None], enable_gqa=True)
        got = m.attend(qkv, hq, k, v, n, None if mask is None else add, past, 0, 0)
        assert float((got - ref[0].transpose(0, 1).reshape(t, hq * d)).abs().max()) < 1e-5
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    x = qkv.clone()
    m.rope_(x, hq + hkv, cos, sin)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    ref = qk * cos[:, None] + qk.view(t, hq + hkv, 2, d // 2).flip(2).view(t, hq + hkv, d) * sin[:, None]
    assert float((x[:, : (hq + hkv) * d] - ref.reshape(t, -1)).abs().max()) < 1e-5
    assert torch.equal(x[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # v untouched
    gu = torch.randn(t, 2 * 40, generator=g) * 6
    gate, up = gu.chunk(2, dim=-1)
    assert float((m.silu_mul(gu) - F.silu(gate) * up).abs().max()) < 1e-5


@needs_kernel
@pytest.mark.parametrize("d", [16, 64, 256])
def test_attend_window_is_attention_over_sinks_and_recent_keys(d):
    """A draft's (sinks, window) view: bit-identical to attending over the gathered keys (the
    first ``sinks`` and the newest ``window``), and the plain call when the context is short."""
    m = kernels.load_extension()
    g = torch.Generator().manual_seed(d)
    hq, hkv, sinks, window = 6, 2, 4, 16
    for n in (10, 20, 21, 57, 300):
        qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g)
        k, v = torch.randn(hkv, n + 2, d, generator=g), torch.randn(hkv, n + 2, d, generator=g)
        got = m.attend(qkv, hq, k, v, n, None, n - 1, sinks, window)
        if n <= sinks + window:
            assert torch.equal(got, m.attend(qkv, hq, k, v, n, None, n - 1, 0, 0))
            continue
        keep = list(range(sinks)) + list(range(n - window, n))
        kk, vv = k[:, keep].contiguous(), v[:, keep].contiguous()
        assert torch.equal(got, m.attend(qkv, hq, kk, vv, len(keep), None, len(keep) - 1, 0, 0)), n
        assert not torch.equal(got, m.attend(qkv, hq, k, v, n, None, n - 1, 0, 0))


def test_a_fresh_cache_says_it_builds_the_kernel(monkeypatch, tmp_path, capsys):
    """A fresh cache compiles the C++ kernel (1-3 minutes): one stderr line says so before the wait; a
    cache that holds the built library says nothing. (The compiler itself is replaced here; the
    real build runs in `make setup` and scripts/check_install.sh.)"""
    import torch.utils.cpp_extension as cpp

    if kernels.unavailable_reason() is not None:
        pytest.skip(kernels.unavailable_reason())
    built = []
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    import types

    fake = types.SimpleNamespace(set_threads=lambda *a: None)  # stands for the built module
    monkeypatch.setattr(cpp, "load", lambda **kw: built.append(kw["build_directory"]) or fake)
    monkeypatch.setattr(kernels, "_state", {})
    capsys.readouterr()
    assert kernels.load_extension() is not None and built
    err = capsys.readouterr().err
    assert "building the C++ kernel" in err and str(tmp_path) in err
    (tmp_path / kernels.build_id() / "selfspec_small_gemm.so").write_bytes(b"")
    monkeypatch.setattr(kernels, "_state", {})
    kernels.load_extension()
    assert "building" not in capsys.readouterr().err and len(built) == 2


@needs_kernel
def test_a_moved_build_folder_is_loaded_not_rebuilt(tmp_path):
    """A cache copied or restored elsewhere holds this source's compiled library under its build id: it is
    imported as it is (ninja would rebuild a moved folder: 1-3 minutes), and nothing in the folder is rewritten;
    a torn library is not loaded (the caller then builds)."""
    import shutil
    import subprocess
    import sys

    src = kernels.cache_dir() / kernels.build_id()
    dst = tmp_path / "kernels" / kernels.build_id()
    shutil.copytree(src, dst)
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    code = "from selfspec_cli.engine import kernels; m = kernels.load_extension(); print(m is not None, m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SELFSPEC_CACHE": str(tmp_path)},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "building" not in out.stderr and out.stdout.split()[0] == "True" and str(dst) in out.stdout
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "selfspec_small_gemm_x.so").write_bytes(b"not a library")
    assert kernels._built(torn, "selfspec_small_gemm_x") is None


@needs_kernel
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (9, 3), (4, 4), (32, 2)])  # 32 / 2: a group longer than one walk
def test_attend_walks_a_groups_heads_together_with_each_heads_own_chain(d, hq, hkv):
    """attend() walks the keys of one GQA group once for all of its heads in a chunk (csrc attend_heads):
    every head's output must equal attending with that head alone, bit for bit, whatever the rows, the
    thread count (which cuts the groups into different runs) or the mask."""
    m = kernels.load_extension()
    g = torch.Generator().manual_seed(d + hq)
    before = kernels.pool_threads()
    try:
        for t, past in ((1, 150), (3, 70), (20, 40)):
            n = past + t
            qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2
            k, v = torch.randn(hkv, n + 3, d, generator=g), torch.randn(hkv, n + 3, d, generator=g)
            add = torch.zeros(t, n).masked_fill_(torch.rand(t, n, generator=g) < 0.3, torch.finfo(torch.float32).min)
            add[:, 0] = 0
            for mask in (None, add):
                alone = torch.cat([m.attend(qkv[:, h * d:(h + 1) * d].contiguous(), 1, k[h // (hq // hkv)][None],
                                            v[h // (hq // hkv)][None], n, mask, past, 0, 0) for h in range(hq)], 1)
                for threads in (1, 2, 3):
                    kernels.set_threads(threads)
                    assert torch.equal(m.attend(qkv, hq, k, v, n, mask, past, 0, 0), alone), (t, threads)
    finally:
        kernels.set_threads(before)


@needs_kernel
def test_stack_profile_times_each_op_kind_only_when_on():
    """The per-op clock `selfspec profile` reads (csrc stack_profile): off, a forward adds nothing; on, every
    part of a one-row forward is timed and the call counted; a read resets."""
    from selfspec_cli.engine import Engine

    from .conftest import make_tiny_model

    m = kernels.load_extension()
    eng = Engine(make_tiny_model("llama-gqa"))
    cache = eng.new_cache(16)
    eng.forward(cache, torch.tensor([1, 2, 3]), positions=0)
    m.stack_profile_read()
    eng.forward(cache, torch.tensor([4]), positions=3)
    assert m.stack_profile_read() == [0.0] * 10
    m.stack_profile(True)
    try:
        eng.forward(cache, torch.tensor([5]), positions=4)
        got = m.stack_profile_read()
    finally:
        m.stack_profile(False)
    assert got[0] == 1 and all(s >= 0 for s in got[1:]) and got[2] > 0 and got[4] > 0 and got[9] > 0
    assert m.stack_profile_read() == [0.0] * 10


@needs_kernel
def test_argmax_rows_is_torch_argmax():
    """The greedy pick (csrc argmax_rows, used by sampling.select_token and the tree verifier) must be
    torch.argmax exactly: the first of equal maxima (in any lane, and -0 equal to +0), the first NaN,
    rows of every length around the 8-lane width, all -inf."""
    m = kernels.load_extension()
    g = torch.Generator().manual_seed(7)
    cases = []
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 63, 1000, 49152):
        x = torch.randn(5, n, generator=g)
        cases.append(x)
        t = x.clone()
        t[:, n // 3] = 9.0
        t[:, n - 1] = 9.0
        t[:, n // 2] = 9.0  # ties, the first wins
        cases.append(t)
        z = torch.zeros(3, n)
        z[0, n // 2:] = -0.0
        z[1, :] = float("-inf")
        cases.append(z)
        q = torch.randn(3, n, generator=g)
        q[0, n - 1] = float("nan")
        q[1, n // 2] = float("nan")
        q[1, 0] = float("inf")
        q[2, :] = float("nan")
        cases.append(q)
        r = torch.randint(-3, 3, (4, n), generator=g).float()  # many ties in every lane
        cases.append(r)
    for x in cases:
        assert m.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist(), x.shape
        assert kernels.argmax_rows(x) == x.argmax(dim=-1).tolist()
        assert kernels.argmax_rows(x[0]) == [int(x[0].argmax())]
    wide = torch.randn(4, 100, generator=g)[:, ::2]  # a column stride other than 1: aten's answer
    assert kernels.argmax_rows(wide) == wide.argmax(dim=-1).tolist()
