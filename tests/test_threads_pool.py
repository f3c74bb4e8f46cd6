"""The kernel's thread pool (csrc ``par_for``, issue 48): every result is bit-identical at every thread count.

Splitting a loop by output rows, panels, (row, head) pairs or rows of a row-wise op never changes an
output's chain, so the logits of every forward, and so every method's token ids (greedy and seeded
sampling), must be the same at 1, 2 and 3 threads: on each family's tiny model, on float and block
targets. Tiny matrices fall under the loops' grains, so the tests post every loop to the pool
(``pool_split_all``) and check that the pool really ran loops. A forked child rebuilds its own pool.
"""
from __future__ import annotations

import os

import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.engine import Engine, kernels
from selfspec_cli.engine.kernels import QLinear, QuantWeight, quantize_int8
from selfspec_cli.methods import build

from .conftest import ARCHS, make_tiny_model
from .gguf_utils import make_tiny_gguf

ext = kernels.load_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"kernel unavailable: {kernels.status()['reason']}")
COUNTS = (1, 2, 3)


@pytest.fixture()
def split_all():
    """Post every loop to the pool; restore the default pool size and grains afterwards."""
    before = kernels.pool_threads()
    ext.pool_split_all(True)
    yield
    ext.pool_split_all(False)
    kernels.set_threads(before)


def _at_each_count(fn) -> list:
    outs = []
    for n in COUNTS:
        kernels.set_threads(n)
        loops = ext.pool_loops()
        outs.append(fn())
        assert (ext.pool_loops() > loops) == (n > 1), n  # the pool ran loops exactly when it had workers
    return outs


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_every_op_is_bit_identical_at_every_thread_count(split_all, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    packed = ext.pack(w)
    q8 = QLinear.make(quantize_int8(w, 32), None, ext)
    # 4-bit codes with minimums and 6-bit codes: the masked decodes; 200 outputs are 4 super-panels, 8 halves, so
    # 3 threads (and 5 chunks a thread) split panels into halves (csrc qrun)
    q4 = QLinear.make(QuantWeight("q4_1", torch.randint(0, 16, (200, 96), generator=g, dtype=torch.uint8),
                                  torch.rand(200, 3, generator=g) * 0.02, -torch.rand(200, 3, generator=g) * 0.1, 32, 4),
                      torch.randn(200, generator=g), ext)
    q6 = QLinear.make(QuantWeight("q6_k", torch.randint(-32, 32, (200, 96), generator=g, dtype=torch.int8),
                                  torch.rand(200, 6, generator=g) * 0.02, None, 16, 6), None, ext)
    hq, hkv, d, n_keys = 4, 2, 32, 40
    qkv = torch.randn(rows, hq * d, generator=g)
    k, v = torch.randn(hkv, 64, d, generator=g), torch.randn(hkv, 64, d, generator=g)
    norm_w, gu = torch.rand(96, generator=g), torch.randn(rows, 320, generator=g)

    def ops():
        return [ext.linear(x, packed, 200, None, "auto"), q8(x), q4(x), q6(x),
                ext.attend(qkv, hq, k, v, n_keys, None, n_keys - rows, 0, 0),
                ext.rms_norm(x, norm_w, 1e-6), ext.silu_mul(gu)]

    base, *rest = _at_each_count(ops)
    try:  # and with many chunks a thread (claimed in any order)
        ext.pool_chunks(5)
        rest += _at_each_count(ops)[1:]
    finally:
        ext.pool_chunks(1)
    for other in rest:
        assert all(torch.equal(a, b) for a, b in zip(base, other))


def _logits(eng: Engine, ids: list[int]) -> list[torch.Tensor]:
    cache = eng.new_cache(64)
    out = [eng.forward(cache, torch.tensor(ids), positions=0).logits]
    for t in range(3):  # one-row steps, then a 4-row verification-shaped forward
        out.append(eng.forward(cache, torch.tensor([7 + t]), positions=len(ids) + t).logits)
    out.append(eng.forward(cache, torch.tensor([3, 4, 5, 6]), positions=len(ids) + 3).logits)
    return out


@needs_kernel
@pytest.mark.parametrize("arch", list(ARCHS))
def test_forwards_are_bit_identical_at_every_thread_count(split_all, arch):
    eng = Engine(make_tiny_model(arch, layers=3))
    ids = list(range(5, 30))
    base, *rest = _at_each_count(lambda: _logits(eng, ids))
    if eng._d in (16, 32, 64, 128, 256):  # a head size the kernel's attention takes: the one-call forward ran
        assert eng.stacked_forwards > 0
    for other in rest:
        assert all(torch.equal(a, b) for a, b in zip(base, other))


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0+Q8_0"])
def test_block_target_is_bit_identical_at_every_thread_count(split_all, tmp_path, monkeypatch, qtype):
    from selfspec_cli import loading

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path, *_ = make_tiny_gguf(tmp_path / "src", seed=3, qtype=qtype, tie_word_embeddings=False)
    model, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    eng = Engine(model, target_precision="auto")
    assert eng.target_precision == "gguf"
    base, *rest = _at_each_count(lambda: _logits(eng, list(range(5, 30))))
    for other in rest:
        assert all(torch.equal(a, b) for a, b in zip(base, other))


METHODS = [("ar", {}), ("pld", {}), ("specqd", {"draft_precision": "int8", "paper_drafting": True}),
           ("self-sd", {"skip_attn": "1", "skip_mlp": "2", "paper_drafting": True}),
           ("swift", {}), ("auto", {"draft_precision": "int8"})]


@needs_kernel
@pytest.mark.parametrize("name,values", METHODS, ids=[m for m, _ in METHODS])
def test_method_tokens_are_identical_at_one_and_two_threads(split_all, tmp_path, monkeypatch, name, values):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = make_tiny_model("llama-gqa", layers=4)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    greedy = GenerationConfig(max_new_tokens=24)
    sampled = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, seed=11))
    runs = []
    for n in (1, 2):
        kernels.set_threads(n)
        m = build(name, Engine(model), None, **values)
        runs.append([m.generate(prompt, greedy).token_ids, m.generate(prompt, sampled).token_ids])
    assert runs[0] == runs[1]


@needs_kernel
def test_a_forked_child_rebuilds_the_pool(split_all):
    kernels.set_threads(2)
    x, w = torch.randn(3, 64), torch.randn(96, 64)
    packed = ext.pack(w)
    want = ext.linear(x, packed, 96, None, "auto")
    pid = os.fork()
    if pid == 0:  # the child: its parent's workers are not its own; a loop must still run, on new ones
        ok = torch.equal(ext.linear(x, packed, 96, None, "auto"), want) and ext.get_threads() == 2
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@needs_kernel
def test_pool_size_is_set_and_refused_below_one():
    before = kernels.pool_threads()
    try:
        kernels.set_threads(3)
        assert ext.get_threads() == 3 and kernels.pool_threads() == 3
        with pytest.raises(ValueError):
            kernels.set_threads(0)
    finally:
        kernels.set_threads(before)
