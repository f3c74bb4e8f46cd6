"""End to end on the shipped demo model (artifacts/models/pystdlib-llama-12x256)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from selfspec_cli.cli.app import main
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.loading import EXAMPLES_DIR, load_model
from selfspec_cli.methods import AR
from selfspec_cli.methods import build
from selfspec_cli.prompts import read_prompts

from .conftest import needs_shipped_model

pytestmark = [needs_shipped_model, pytest.mark.slow]
EXAMPLES = EXAMPLES_DIR / "prompts.jsonl"


@pytest.fixture(scope="module")
def shipped():
    model, tok = load_model("pystdlib", device="cpu")
    return model, tok, Engine(model)


def _prompt_ids(tok):
    return [tok(p.turns[0])["input_ids"] for p in read_prompts(str(EXAMPLES))]


def test_shipped_model_loads_offline_and_is_a_llama(shipped):
    model, tok, eng = shipped
    assert model.config.model_type == "llama" and model.config.num_hidden_layers >= 12
    assert eng.dtype == torch.float32
    assert tok.chat_template is None  # a code model: prompts are continued as given


def test_ar_equals_hf_generate_on_all_example_prompts(shipped):
    model, tok, eng = shipped
    ar = AR(eng, tok)
    eos = model.generation_config.eos_token_id
    for ids in _prompt_ids(tok):
        got = ar.generate(ids, GenerationConfig(max_new_tokens=48, eos_token_ids=(eos,))).token_ids
        x = torch.tensor([ids])
        want = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48,
                              eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        assert got == want


def test_greedy_continuation_looks_like_python(shipped):
    model, tok, eng = shipped
    ids = tok("def read_lines(path):\n    with open(path) as f:\n")["input_ids"]
    out = AR(eng, tok).generate(ids, GenerationConfig(max_new_tokens=40)).token_ids
    text = tok.decode(out)
    assert len(out) == 40 and len(set(out)) >= 10, text  # not stuck repeating a few tokens
    words = re.findall(r"[A-Za-z_]\w*", text)
    assert len(words) >= 8, text  # mostly identifiers, not whitespace or punctuation
    # Python structure: a keyword as a whole word, a call or definition `name(`, and
    # space indentation in multiples of 4 with no tabs
    assert re.search(r"\b(def|return|for|in|if|with|import|class|self|None|is)\b", text), text
    assert re.search(r"[A-Za-z_]\w*\(", text), text
    assert "\t" not in text and all((len(l) - len(l.lstrip(" "))) % 4 == 0 for l in text.splitlines()), text


@pytest.mark.parametrize("method,opts", [
    ("asd", {}),
    ("swift", dict(context_window=16)),
    ("self-sd", dict(skip_attn=(2, 4, 6, 8), skip_mlp=(3, 5, 7))),
    ("self-sd", {}),  # the committed calibrated artifact
])
def test_layer_skipping_methods_equal_ar_on_example_prompts(shipped, method, opts):
    model, tok, eng = shipped
    ar = AR(eng, tok)
    meth = build(method, eng, tok, **opts)
    for ids in _prompt_ids(tok):
        cfg = GenerationConfig(max_new_tokens=48, eos_token_ids=(model.generation_config.eos_token_id,))
        assert meth.generate(ids, cfg).token_ids == ar.generate(ids, cfg).token_ids


def test_demo_command_runs(capsys):
    assert main(["generate", "--model", "pystdlib", "--prompt-file", str(EXAMPLES), "--max-new-tokens", "8", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 20 and all(json.loads(l)["new_tokens"] <= 8 for l in lines)
