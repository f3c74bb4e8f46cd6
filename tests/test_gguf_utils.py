"""The GGUF files tests/gguf_utils.py writes load through transformers' own GGUF support and
reproduce the source model exactly (fp32 end to end)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers refuses gguf_file= without it

from tests.gguf_utils import (  # noqa: E402
    CHATML_TEMPLATE, SHIPPED_TOKENIZER_DIR, make_tiny_gguf, write_gguf, write_non_llama_gguf,
)

TEXTS = [
    "import os\nprint(os.path.join('a', 'b'))",
    "def add(x, y):\n    return x + y",
    "class Foo:\n    pass",
]


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def _assert_same_logits(src, loaded, tokenizer):
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tokenizer(text).input_ids])
            torch.testing.assert_close(loaded(ids).logits, src(ids).logits)
        # a batch of equal-length rows, too
        batch = torch.randint(0, src.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(loaded(batch).logits, src(batch).logits)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path, src_model, src_tok = make_tiny_gguf(tmp_path_factory.mktemp("gguf"), seed=0)
    model, tokenizer = _load(path)
    return path, src_model, src_tok, model, tokenizer


def test_config_read_from_gguf_metadata(tied):
    path, src, _, loaded, _ = tied
    assert path.suffix == ".gguf" and path.is_file()
    a, b = src.config, loaded.config
    assert b.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "bos_token_id", "eos_token_id",
                "pad_token_id"):
        assert getattr(b, key) == getattr(a, key), key
    assert b.rope_parameters["rope_theta"] == a.rope_parameters["rope_theta"] == 50000.0
    assert b.rms_norm_eps == pytest.approx(a.rms_norm_eps)  # stored as float32 in the file
    assert b.tie_word_embeddings is True
    assert loaded.dtype == torch.float32


def test_logits_match_source_model(tied):
    _, src, src_tok, loaded, _ = tied
    _assert_same_logits(src, loaded, src_tok)


ROUND_TRIP = TEXTS + ["  héllo wörld\t<|im_start|>user\nhi<|im_end|> ünïcode 😀 <|endoftext|>"]


def _assert_same_tokenization(src_tok, tok):
    for text in ROUND_TRIP:
        ids = tok(text).input_ids
        assert ids == src_tok(text).input_ids, text
        assert tok.decode(ids) == src_tok.decode(ids) == text
    assert len(tok) == len(src_tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        src_tok.bos_token_id, src_tok.eos_token_id, src_tok.pad_token_id)


def test_tokenizer_round_trips(tied):
    _, _, src_tok, _, tok = tied
    _assert_same_tokenization(src_tok, tok)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert tok("<|im_start|>x<|im_end|>").input_ids[0] == 1  # special tokens stay whole
    assert tok.decode(tok("<|im_end|>").input_ids, skip_special_tokens=True) == ""


@pytest.mark.skipif(not (SHIPPED_TOKENIZER_DIR / "tokenizer.json").is_file(), reason="shipped tokenizer absent")
def test_shipped_tokenizer_round_trips(tmp_path):
    """The repo's 8192-token byte-level BPE survives the GGUF metadata too (tokenizer only: parsing
    its vocabulary is what makes a load slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tests.gguf_utils import load_shipped_tokenizer, tiny_llama_config

    src_tok = load_shipped_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_llama_config(len(src_tok), num_hidden_layers=1))
    path = write_gguf(model, src_tok, tmp_path / "shipped-tok.gguf")
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    _assert_same_tokenization(src_tok, tok)


def test_chat_template_present(tied):
    *_, tok = tied
    assert tok.chat_template == CHATML_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids


def test_untied_embeddings_write_output_tensor(tmp_path):
    import gguf

    path, src, src_tok = make_tiny_gguf(tmp_path, seed=1, tie_word_embeddings=False)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" in names
    loaded, _ = _load(path)
    assert loaded.config.tie_word_embeddings is False
    _assert_same_logits(src, loaded, src_tok)


def test_qk_permutation_is_needed(tied, tmp_path):
    """Without llama.cpp's q/k row permutation the file still loads, with wrong logits."""
    from transformers import AutoModelForCausalLM

    _, src, src_tok, _, _ = tied
    path = write_gguf(src, src_tok, tmp_path / "unpermuted.gguf", permute_qk=False)
    wrong = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name).eval()
    ids = torch.tensor([src_tok(TEXTS[0]).input_ids])
    with torch.no_grad():
        assert not torch.allclose(wrong(ids).logits, src(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["bert", "rwkv7"])
def test_unsupported_architecture_error(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_non_llama_gguf(tmp_path / f"{arch}.gguf", architecture=arch)
    message = f"GGUF model with architecture {arch} is not supported yet."
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    with pytest.raises(ValueError, match=message):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
