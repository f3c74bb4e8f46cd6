"""The model and tokenizer read without transformers (selfspec_cli/lite.py) are transformers' own:
the same fingerprint, rotary tables and logits bit for bit, the same tokens and text."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.engine.adapter import model_fingerprint
from selfspec_cli.engine.runner import ALL_ROWS
from selfspec_cli.lite import LiteTokenizer, lite_reason, load_lite_model
from selfspec_cli.loading import CODE_MODEL_DIR, load_model
from selfspec_cli.methods import AR
from selfspec_cli.prompts import encode_turn

from .conftest import make_tiny_model, needs_shipped_model

TEXTS = ["def main():\n    return value\n", "Hello, world! It's 3.14 -- isn't it?", "  spaces\tand\ttabs\n\n",
         "naïve café — ünïcödé ✓", ""]
CHATS = [[{"role": "user", "content": "Write a haiku."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
          {"role": "assistant", "content": "Because."}, {"role": "user", "content": "And then?"}]]


def _both(where):
    hf_model, hf_tok = load_model(str(where), dtype="float32", device="cpu")
    return (hf_model, hf_tok), (load_lite_model(where, torch.float32, torch.device("cpu")), LiteTokenizer(where))


def _check_same_model(hf_model, lite_model, ids: list[int], target: str | None = None) -> None:
    from selfspec_cli.artifacts import model_name

    assert model_fingerprint(lite_model) == model_fingerprint(hf_model)
    assert model_name(lite_model) == model_name(hf_model)  # artifacts are named after it
    a, b = Engine(hf_model, target_precision=target), Engine(lite_model, target_precision=target)
    for kind in a.adapter.rope_kinds:
        assert all(torch.equal(x, y) for x, y in zip(a.adapter.rope_table(300, kind), b.adapter.rope_table(300, kind)))
    ta = torch.tensor(ids)
    la = a.forward(a.new_cache(64), ta, positions=0, logits_rows=ALL_ROWS).logits
    lb = b.forward(b.new_cache(64), ta, positions=0, logits_rows=ALL_ROWS).logits
    assert torch.equal(la, lb)
    cfg = GenerationConfig(max_new_tokens=12)
    assert AR(a).generate(ids, cfg).token_ids == AR(b).generate(ids, cfg).token_ids


def _check_same_tokenizer(hf_tok, lite_tok, chat: bool) -> None:
    assert lite_tok.eos_token_id == hf_tok.eos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = hf_tok(text, add_special_tokens=special)["input_ids"]
            assert lite_tok(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
        ids = hf_tok(text, add_special_tokens=True)["input_ids"]
        for skip in (True, False):
            assert lite_tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    for history in CHATS:
        assert encode_turn(lite_tok, history, chat) == encode_turn(hf_tok, history, chat)


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-tied-rope3", "mistral-window", "qwen2-bias", "qwen3-qknorm"])
def test_a_saved_model_reads_the_same_without_transformers(tmp_path, tiny_tokenizer, arch):
    """Untied and tied heads; default and llama3 rotary scaling; Mistral's window, Qwen2's q/k/v biases,
    Qwen3's per-head q/k norms."""
    make_tiny_model(arch).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    (hf_model, hf_tok), (lite_model, lite_tok) = _both(tmp_path)
    _check_same_model(hf_model, lite_model, hf_tok("def main():\n    return value", add_special_tokens=True)["input_ids"])
    if arch == "qwen2-bias":  # transformers tokenizes it with Qwen2Tokenizer, not the file's own pipeline
        assert "tokenizer class" in lite_reason(tmp_path)
        assert lite_tok("def main():\n    return value")["input_ids"] != hf_tok("def main():\n    return value")["input_ids"]
        return
    assert lite_reason(tmp_path) is None
    _check_same_tokenizer(hf_tok, lite_tok, chat=False)


@needs_shipped_model
def test_the_code_model_reads_the_same_without_transformers():
    (hf_model, hf_tok), (lite_model, lite_tok) = _both(CODE_MODEL_DIR)
    _check_same_model(hf_model, lite_model, hf_tok("import os\n\n\ndef walk(root):\n")["input_ids"])
    _check_same_tokenizer(hf_tok, lite_tok, chat=True)


@pytest.mark.slow
def test_the_default_model_reads_the_same_without_transformers():
    from selfspec_cli.loading import resolve_model_path

    from selfspec_cli.lite import load_gguf_model

    where = Path(resolve_model_path(None))  # the GGUF's config and tokenizer; its blocks are the weights
    hf_model, hf_tok = load_model(str(where), dtype="float32", device="cpu")  # transformers', from the GGUF
    lite_model, lite_tok = load_gguf_model(where, torch.float32, torch.device("cpu")), LiteTokenizer(where)
    assert lite_tok.chat_template and lite_tok.chat_template == hf_tok.chat_template
    _check_same_tokenizer(hf_tok, lite_tok, chat=True)
    # the float target: the lite model's blocks dequantized, the values transformers' loader gives, bit for bit
    _check_same_model(hf_model, lite_model, encode_turn(hf_tok, CHATS[0], True), target="fp32")


def test_what_does_not_read_without_transformers_says_why(tmp_path, tiny_tokenizer, monkeypatch):
    make_tiny_model("gemma3-window").save_pretrained(tmp_path / "gemma")
    assert "model type 'gemma3_text'" in lite_reason(tmp_path / "gemma")
    assert lite_reason("HuggingFaceTB/SmolLM2-135M-Instruct") == "not a local directory"
    make_tiny_model("llama-gqa").save_pretrained(tmp_path / "llama")
    assert lite_reason(tmp_path / "llama") == "no tokenizer.json"
    tiny_tokenizer.save_pretrained(tmp_path / "llama")
    assert lite_reason(tmp_path / "llama") is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert lite_reason(bad) == "unreadable config (JSONDecodeError)"
    monkeypatch.setenv("SELFSPEC_LITE", "0")
    assert lite_reason(tmp_path / "llama") == "SELFSPEC_LITE=0"


def test_a_lite_model_refuses_a_hugging_face_forward(tiny_model_dir):
    model = load_lite_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="selfspec's engine only"):
        model(torch.tensor([[1, 2]]))


@needs_shipped_model
def test_generate_does_not_import_transformers():
    code = ("import sys; from selfspec_cli.cli.app import main; "
            "rc = main(['generate', '-m', 'pystdlib', '--method', 'ar', '-n', '2', '-P', 'def f():']); "
            "assert rc == 0, rc; assert 'transformers' not in sys.modules, 'transformers was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"token_ids"' in proc.stdout


def test_a_damaged_weights_file_is_one_line(tmp_path, tiny_tokenizer):
    """A truncated model.safetensors on the path without transformers: one line that names the file, exit 2."""
    make_tiny_model("llama-gqa").save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "selfspec_cli", "generate", "-m", str(tmp_path), "--method", "ar",
                           "-n", "2", "-P", "x"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-1500:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert "Traceback" not in proc.stderr and any("could not load the model" in l and str(tmp_path) in l for l in lines)
