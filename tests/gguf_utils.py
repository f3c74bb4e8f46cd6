"""Write real GGUF files in-process, for tests of `--model some.gguf`.

`make_tiny_gguf` builds a tiny random `LlamaForCausalLM` over a tiny byte-level BPE tokenizer
(trained in-process, ChatML special tokens like SmolLM2's; or the repo's shipped 8192-token one)
and writes it, all tensors F32, with the `gguf` package's `GGUFWriter`, laid out the way
llama.cpp's `convert_hf_to_gguf.py` lays out a Llama:

* metadata under `llama.*` (context length, widths, head counts, rope base, RMS eps, rope dims);
* tensor names `token_embd.weight`, `blk.N.attn_q.weight`, ..., `output_norm.weight`, and
  `output.weight` only when the embeddings are untied (transformers infers
  `tie_word_embeddings` from whether `output.weight` is present -- it reads no key for it);
* `attn_q` / `attn_k` rows permuted for llama.cpp's interleaved-pair rope (HF rotates halves).
  transformers' GGUF loader applies the inverse (`LlamaTensorProcessor._reverse_permute_weights`),
  so a file written without the permutation loads without error but gives wrong logits;
* `tokenizer.ggml.model = "gpt2"` with the byte-level token strings, token types (CONTROL for
  added special tokens), merges, bos/eos/pad ids, `add_bos_token` and `tokenizer.chat_template`.

transformers then loads it back with
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` / `AutoTokenizer.from_pretrained(...)`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from selfspec_cli.loading import CODE_MODEL_DIR

SHIPPED_TOKENIZER_DIR = CODE_MODEL_DIR

# ChatML. The tiny tokenizer has <|im_start|>/<|im_end|> as special tokens (as SmolLM2 does); with
# the shipped tokenizer, which lacks them, they are plain text.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos
TINY_VOCAB = 384

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A user asks a question and the assistant answers it.
def add(x, y):
    return x + y

class Counter:
    def __init__(self):
        self.count = 0

    def step(self, n=1):
        self.count += n
        return self.count

Translate German to English: Der Hund schlaeft im Garten. The dog sleeps in the garden.
Summarize the following article in two sentences. The city council met on Tuesday to discuss
the new library, the budget for next year, and the repairs to the old bridge over the river.
What is 12 plus 30? The answer is 42. How many days are there in a week? There are seven days.
"""

# gguf.TokenType values (llama.cpp's llama_token_type)
_NORMAL, _CONTROL = 1, 3


def tiny_llama_config(vocab_size: int, tie_word_embeddings: bool = True, **overrides):
    """A tiny Llama config. Values deliberately differ from LlamaConfig's defaults (rope base, eps,
    context length) so a loader that ignored the GGUF metadata would be caught."""
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=50000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=tie_word_embeddings)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


def _permute_for_gguf(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: within each head, rows [0..d/2) and [d/2..d) (HF's rotate-half
    pairing) become interleaved pairs (2i, 2i+1). `n_head` is the number of heads this projection has
    (num_key_value_heads for k_proj). transformers' `_reverse_permute_weights` is its inverse."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _tokenizer_vocab(tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges "a b") from a fast byte-level BPE tokenizer."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are supported, got {model['type']}")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for token, index in vocab.items():
        tokens[index] = token
    missing = [i for i, t in enumerate(tokens) if not t]
    if missing:
        raise ValueError(f"tokenizer ids are not contiguous: no token for ids {missing[:5]}...")
    types = [_CONTROL if i in special else _NORMAL for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def write_gguf(model, tokenizer, path, chat_template: str | None = CHATML_TEMPLATE, *,
               permute_qk: bool = True, qtype: str | None = None) -> Path:
    """Write `model` (a LlamaForCausalLM) and `tokenizer` (fast byte-level BPE) as an all-F32 GGUF.

    `permute_qk=False` skips llama.cpp's q/k row permutation -- only for tests showing it matters.
    `qtype` ("Q4_0", "Q4_1", "Q8_0", "Q5_0", ...): every matrix stored in that block format (quantized with the
    `gguf` package, as llama.cpp's quantizer lays it out); norms stay F32. "A+B": B for `attn_v` and the
    embedding, A for the other matrices: "Q5_0+Q8_0" as a Q4_K_M file of a model whose widths the K-quants do
    not divide (Gemma 3 270M) stores them; "Q4_1+Q8_0" gives a q/k/v of two layouts (4-bit with minimums, 8-bit),
    as a Q4_K_M file's Q4_K q/k with a Q6_K v.
    """
    import gguf

    path = Path(path)
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    tokens, types, merges = _tokenizer_vocab(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, model vocab_size is {cfg.vocab_size}")

    w = gguf.GGUFWriter(str(path), "llama")  # writes general.architecture
    w.add_name("selfspec-tiny-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")  # not in transformers' split table: GPT2Tokenizer's own regex is kept
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for name, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                         ("pad_token_id", w.add_pad_token_id)):
        token_id = getattr(tokenizer, name, None)
        if token_id is None:
            token_id = getattr(cfg, name, None)
        if token_id is not None:
            setter(int(token_id))
    w.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if chat_template:
        w.add_chat_template(chat_template)

    def put(name: str, tensor: torch.Tensor, heads: int | None = None):
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if heads is not None and permute_qk:
            array = _permute_for_gguf(array, heads)
        if qtype is not None and array.ndim == 2:
            if "+" in qtype:  # "A+B": B for attn_v and the embedding, A for the other matrices
                rest, v_and_embd = qtype.split("+")
                kind = gguf.GGMLQuantizationType[v_and_embd if name.endswith(("attn_v.weight", "token_embd.weight")) else rest]
            else:
                kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)
            return
        w.add_tensor(name, np.ascontiguousarray(array))  # float32 ndarray -> GGML F32

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", sd[p + "self_attn.q_proj.weight"], heads=n_head)
        put(f"blk.{i}.attn_k.weight", sd[p + "self_attn.k_proj.weight"], heads=n_kv)
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_bpe_tokenizer(vocab_size: int = TINY_VOCAB):
    """A small byte-level BPE tokenizer (GPT-2 style pre-tokenizer and decoder) trained in-process
    on a fixed corpus, so the GGUF's vocabulary metadata stays small and fast to parse.
    <|endoftext|>=0 (pad), <|im_start|>=1 (bos), <|im_end|>=2 (eos) are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS * 4], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2])
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (0, 1, 2)
    return fast


def load_shipped_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER_DIR))


def make_tiny_gguf(tmp_dir, seed: int = 0, tie_word_embeddings: bool = True,
                   chat_template: str | None = CHATML_TEMPLATE, name: str = "tiny-llama-f32.gguf",
                   tokenizer="tiny", qtype: str | None = None, layers: int = 2):
    """Write a tiny random Llama to `tmp_dir/name`, over `tokenizer`: "tiny" (`tiny_bpe_tokenizer()`,
    the default: its small vocabulary keeps transformers' GGUF metadata parsing fast), "shipped" (the
    repo's 8192-token tokenizer; each load then spends seconds parsing the vocabulary), or a fast
    byte-level BPE tokenizer object.

    Returns `(path, hf_model, hf_tokenizer)`; the model is fp32, eval mode, with randomized norm
    weights and sharpened logits so that layout mistakes show up in the logits.
    """
    from transformers import LlamaForCausalLM

    if tokenizer == "tiny":
        tokenizer = tiny_bpe_tokenizer()
    elif tokenizer == "shipped":
        tokenizer = load_shipped_tokenizer()
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids = {k: (v if v is not None else ids["eos_token_id"]) for k, v in ids.items()}
    config = tiny_llama_config(len(tokenizer), tie_word_embeddings=tie_word_embeddings, num_hidden_layers=layers, **ids)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):  # all-ones norms would hide a mis-mapped norm tensor
                param.uniform_(0.5, 1.5)
        (model.model.embed_tokens if tie_word_embeddings else model.lm_head).weight.mul_(4.0)
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    path = write_gguf(model, tokenizer, tmp_dir / name, chat_template=chat_template, qtype=qtype)
    return path, model, tokenizer


def write_non_llama_gguf(path, architecture: str = "bert") -> Path:
    """A syntactically valid GGUF whose `general.architecture` transformers' GGUF loader does not
    support, with minimal metadata and one tiny tensor -- for error-path tests."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name(f"tiny-{architecture}")
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
