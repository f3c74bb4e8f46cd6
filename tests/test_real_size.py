"""The models of the size users run (Qwen2.5-Coder-1.5B and 0.5B, Q4_K_M, from their PyPI part packages), read
straight from their blocks: a real-size check of what tests/test_gguf_direct.py checks on tiny files. Slow, and
skipped with the install line when the part packages are absent (`make setup` does not install them)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.engine.kernels import PartsLinear
from selfspec_cli.methods import build
from selfspec_cli.prompts import encode_turn

pytestmark = pytest.mark.slow


def _installed(model: loading.ChunkedModel) -> bool:
    return all(importlib.util.find_spec(model.package.format(i=i)) is not None for i in range(1, model.parts + 1))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_size_model_reads_its_blocks_and_methods_keep_ar_tokens(name):
    model_spec = loading.CHUNKED_MODELS[name]
    if not _installed(model_spec):
        pytest.skip(f"{model_spec.title} is not installed: {model_spec.install_all()}")
    model, tok = loading.load_model(name, dtype="float32", device="cpu", log=None, lite=True)
    gguf = loading.chunked_model_gguf(model_spec)
    where = loading.resolve_model_path(name)
    assert all(p.stat().st_size < gguf.stat().st_size for p in Path(where).rglob("*") if p.is_file())
    assert any(p.is_meta for p in model.parameters())  # the block matrices stay in the file
    eng = Engine(model, target_precision="auto")
    assert eng.target_precision == "gguf" and not eng.quantized("gguf").info["int8_fallback"]
    if name == "qwen2.5-coder-1.5b":  # half its layers: Q4_K q/k with a Q6_K v, side by side
        assert sum(isinstance(lin["qkv"], PartsLinear) for lin in eng._lin) == 14
    assert eng.quantized("gguf").nbytes() < gguf.stat().st_size
    ids = encode_turn(tok, [{"role": "user", "content": "Write a Python function that reverses a list."}], True)
    cfg = GenerationConfig(max_new_tokens=24, eos_token_ids=())
    ar = build("ar", eng, tok).generate(list(ids), cfg).token_ids
    for method in ("pld", "auto"):
        assert build(method, eng, tok).generate(list(ids), cfg).token_ids == ar, method
    assert "def" in tok.decode(ar)
