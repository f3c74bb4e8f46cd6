"""A model and tokenizer read without transformers: the fast start of ``generate`` and ``chat``.

Importing transformers and building its model and tokenizer takes about 4 s on a 2-core machine,
several times the decode of a short answer (docs/engine.md, "Start-up"). selfspec's engine needs
none of transformers' modules: only the weights under their names, the config's numbers, the
rotary table, and a tokenizer. For a local Hugging Face directory of a Llama, Mistral, Qwen2 or
Qwen3 model (the default model's converted cache and the shipped code model among them) this
module builds:

* :class:`LiteConfig`: config.json's fields, with transformers' defaults for the ones the engine
  reads (``head_dim``, ``num_key_value_heads``); ``to_dict()`` as transformers gives it for those;
* :class:`LiteLlama`: a plain ``torch.nn.Module`` tree with transformers' parameter names and
  biases
  (``model.layers.<i>.self_attn.q_proj.weight``, ...; a tied head is the embedding's Parameter),
  the safetensors tensors assigned without a copy beyond the dtype cast, and a rotary module that
  computes cos and sin as transformers' ``LlamaRotaryEmbedding`` does (default and ``llama3``
  scaling), so the engine, the model's fingerprint and every artifact see the very same model;
* :class:`LiteTokenizer`: the ``tokenizers`` library's own tokenizer from tokenizer.json (what
  transformers wraps), and the chat template rendered with jinja2 as transformers renders it.

Invariants (tests/test_lite.py, against transformers on the same directories): the same
fingerprint, the same rotary tables bit for bit, the same tokens for text and chat turns, the
same decoded text. Anything else (another architecture or rope type, several weight files, a
hub id, ``SELFSPEC_LITE=0``) loads through transformers (:func:`lite_reason` says why).
The lite model cannot run Hugging Face's forward or ``generate``: the bench's peers load the
transformers model.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

LITE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers' tokenizer.json-only classes


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters as transformers 5 normalizes them (``rope_parameters``, else the older
    ``rope_theta`` and ``rope_scaling``)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def lite_reason(where: str | os.PathLike) -> str | None:
    """Why the directory ``where`` does not load without transformers (None: it does)."""
    if os.environ.get("SELFSPEC_LITE") == "0":
        return "SELFSPEC_LITE=0"
    d = Path(where)
    if not d.is_dir():
        return "not a local directory"
    try:
        cfg = _read_json(d / "config.json")
    except (OSError, ValueError) as exc:  # transformers' loader says what is wrong with the file
        return f"unreadable config ({type(exc).__name__})"
    if cfg.get("model_type") not in LITE_TYPES:
        return f"model type {cfg.get('model_type')!r} (lite: {', '.join(LITE_TYPES)})"
    if _rope(cfg)["rope_type"] not in ROPE_TYPES:
        return f"rope type {_rope(cfg)['rope_type']!r}"
    if cfg.get("quantization_config"):
        return "quantized weights"
    if cfg.get("model_type") in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and not cfg.get("layer_types"):
        return "sliding windows without layer_types (transformers derives them)"
    for name in ("model.safetensors", "tokenizer.json"):
        if not (d / name).is_file():
            return f"no {name}"
    return lite_tokenizer_reason(d) or (None if _available("safetensors") else "safetensors is not installed")


# texts a GGUF's saved tokenizer is checked on (:func:`same_tokenizer`): code, punctuation, whitespace runs,
# digits, accents and symbols, CJK, emoji, special-token text, and a chat of two turns
PROBE_TEXTS = ("def main():\n    return value  # 42\n", "Hello, world! It's 3.14 -- isn't it?  Yes...",
               "  spaces\tand\ttabs\n\n\n   end", "naïve café — ünïcödé ✓ ½ ∑", "中文分词测试，日本語のテキスト",
               "emoji 🚀🔥 and <|im_start|> text", "12345678901234567890 1,234.5e-10", "", "\r\n\u00a0x")
PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort [3, 1, 2] in Python."},
              {"role": "assistant", "content": "sorted([3, 1, 2])"}, {"role": "user", "content": "And reversed?"}]


def same_tokenizer(hf_tok: Any, lite_tok: LiteTokenizer) -> bool:
    """Whether ``lite_tok`` gives ``hf_tok``'s token ids and text on :data:`PROBE_TEXTS` and its chat template's ids
    on :data:`PROBE_CHAT` (evidence, checked once when a GGUF's tokenizer is saved, that transformers' own class
    adds nothing to the saved tokenizer.json pipeline)."""
    try:
        for text in PROBE_TEXTS:
            for special in (True, False):
                ids = hf_tok(text, add_special_tokens=special)["input_ids"]
                if lite_tok.encode(text, add_special_tokens=special) != list(ids):
                    return False
                if lite_tok.decode(ids) != hf_tok.decode(ids):
                    return False
        if getattr(hf_tok, "chat_template", None):
            want = hf_tok.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
            return lite_tok.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False) == want
    except Exception:  # noqa: BLE001  any failure of either side: not the same
        return False
    return True


def lite_tokenizer_reason(where: str | os.PathLike) -> str | None:
    """Why the tokenizer of the directory ``where`` does not load without transformers (None: it does)."""
    if os.environ.get("SELFSPEC_LITE") == "0":
        return "SELFSPEC_LITE=0"
    d = Path(where)
    try:
        cfg, tok_cfg = _read_json(d / "config.json"), _read_json(d / "tokenizer_config.json")
    except (OSError, ValueError) as exc:
        return f"unreadable config ({type(exc).__name__})"
    if not (d / "tokenizer.json").is_file():
        return "no tokenizer.json"
    if _read_json(d / GGUF_SOURCE_FILE).get("lite_tokenizer") == "checked" and _available("tokenizers"):
        return None  # checked against transformers' own tokenizer when the directory was written
    # the tokenizers library's own pipeline is transformers' only for its generic backend; a class of its
    # own (Qwen2Tokenizer, LlamaTokenizer, ...) may build another pre-tokenizer from the vocabulary, and
    # transformers 5 tokenizes every qwen2 model with Qwen2Tokenizer whatever the file names
    tok_class = tok_cfg.get("tokenizer_class")
    if tok_class not in GENERIC_TOKENIZERS or cfg.get("model_type") == "qwen2":
        return f"tokenizer class {tok_class!r} with model type {cfg.get('model_type')!r} (lite: the generic backend)"
    if not _available("tokenizers"):
        return "tokenizers is not installed"
    return None


def _available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class LiteConfig:
    """config.json as attributes (what the engine and the artifacts read)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        f = dict(fields)
        if f.get("num_key_value_heads") is None:
            f["num_key_value_heads"] = f["num_attention_heads"]
        # head_dim as transformers' config holds it (the fingerprint reads it): Llama and Mistral compute
        # a missing one, Qwen3 defaults to 128, Qwen2 keeps none
        if f.get("model_type") in ("llama", "mistral") and f.get("head_dim") is None:
            f["head_dim"] = f["hidden_size"] // f["num_attention_heads"]
        elif f.get("model_type") == "qwen3":
            f.setdefault("head_dim", 128)
        f.setdefault("tie_word_embeddings", False)
        f.setdefault("hidden_act", "silu")
        f.setdefault("rms_norm_eps", 1e-6)
        f.setdefault("max_position_embeddings", 2048)
        if f.get("model_type") == "mistral":
            f.setdefault("sliding_window", 4096)  # transformers' MistralConfig default
        f["rope_parameters"] = _rope(f)
        self.__dict__.update(f)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Weight(nn.Module):
    """A module that holds one weight (a norm's, an embedding's, a bias-free projection's), made without
    initializing it (torch's own layers run an init, which on the meta device imports torch._dynamo:
    1.6 s); the loaded tensor is assigned to it."""

    def __init__(self, *shape: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(shape[0], device="meta"), requires_grad=False) if bias else None


def _linear(n_in: int, n_out: int, bias: bool = False) -> _Weight:
    return _Weight(n_out, n_in, bias=bias)


def _biases(cfg: LiteConfig) -> tuple[bool, bool, bool]:
    """Which projections carry a bias, as transformers builds each architecture: (q/k/v, o, MLP)."""
    if cfg.model_type == "qwen2":
        return True, False, False
    if cfg.model_type == "mistral":
        return False, False, False
    attn = bool(getattr(cfg, "attention_bias", False))
    return attn, attn, bool(getattr(cfg, "mlp_bias", False)) and cfg.model_type == "llama"


class LiteRotary(nn.Module):
    """cos and sin of the rotary embedding, computed as transformers' ``LlamaRotaryEmbedding``:
    float32 inverse frequencies (``default``, or ``llama3``'s smoothed scaling), a float32 product with
    the positions, ``cat(freqs, freqs)``, then cos and sin cast to the input's dtype."""

    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        rope, dim = cfg.rope_parameters, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        base = float(rope["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        if rope["rope_type"] == "llama3":
            inv_freq = _llama3(inv_freq, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        pos = position_ids[:, None, :].float()
        freqs = (inv.float() @ pos.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency scaling, as transformers' ``_compute_llama3_parameters``."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class _Layer(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        h, d, i = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size
        qkv_bias, o_bias, mlp_bias = _biases(cfg)
        self.self_attn = nn.Module()
        for name, n_out in (("q_proj", cfg.num_attention_heads * d), ("k_proj", cfg.num_key_value_heads * d),
                            ("v_proj", cfg.num_key_value_heads * d)):
            setattr(self.self_attn, name, _linear(h, n_out, qkv_bias))
        self.self_attn.o_proj = _linear(cfg.num_attention_heads * d, h, o_bias)
        if cfg.model_type == "qwen3":  # RMSNorm of each head's q and k before the rotary
            self.self_attn.q_norm, self.self_attn.k_norm = _Weight(d), _Weight(d)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = _linear(h, i, mlp_bias), _linear(h, i, mlp_bias)
        self.mlp.down_proj = _linear(i, h, mlp_bias)
        self.input_layernorm, self.post_attention_layernorm = _Weight(h), _Weight(h)


class LiteLlama(nn.Module):
    """A Llama-architecture causal LM's weights under transformers' names, for selfspec's engine (Mistral,
    Qwen2 and Qwen3 are the same tree with their biases, windows and per-head q/k norms)."""

    def __init__(self, cfg: LiteConfig, eos_token_id: Any) -> None:
        super().__init__()
        self.config, self.name_or_path = cfg, cfg.name_or_path
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos_token_id})()
        self.model = nn.Module()
        self.model.embed_tokens = _Weight(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = _Weight(cfg.hidden_size)
        self.model.rotary_emb = LiteRotary(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def device(self) -> torch.device:  # the final norm's: a model read from its GGUF holds its embedding there
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a lite model runs in selfspec's engine only (SELFSPEC_LITE=0 loads transformers')")


def load_lite_model(where: str | os.PathLike, dtype: torch.dtype, device: torch.device) -> LiteLlama:
    """The model in ``where`` (see :func:`lite_reason`) with its weights in ``dtype`` on ``device``."""
    from safetensors.torch import load_file

    d = Path(where)
    # where it was loaded from, as transformers records it (artifacts are named after it)
    cfg = LiteConfig({**_read_json(d / "config.json"), "name_or_path": str(where), "_name_or_path": str(where)})
    gen = _read_json(d / "generation_config.json")
    model = LiteLlama(cfg, gen.get("eos_token_id", getattr(cfg, "eos_token_id", None)))
    state = {k: v.to(device=device, dtype=dtype) for k, v in load_file(str(d / "model.safetensors")).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not match a {cfg.model_type} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


class LiteTokenizer:
    """tokenizer.json through the ``tokenizers`` library, and the chat template through jinja2, as
    transformers' tokenizer does for these directories."""

    def __init__(self, where: str | os.PathLike) -> None:
        from tokenizers import Tokenizer

        d = Path(where)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        self._special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()
                         if k.endswith("_token") and isinstance(v, (str, dict))}
        template = d / "chat_template.jinja"
        self.chat_template: str | None = template.read_text(encoding="utf-8") if template.is_file() else cfg.get("chat_template")
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces", False))
        self._compiled: Any = None

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> Any:
        if self._compiled is None:
            self._compiled = _jinja_env().from_string(self.chat_template)
        text = self._compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                                     **self._special)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _jinja_env() -> Any:
    """The environment transformers renders chat templates in: sandboxed, trimmed blocks, loop controls,
    and its two helpers."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


# ---------------------------------------------------------------- a model read straight from its GGUF blocks

GGUF_SOURCE_FILE = "selfspec-source.json"  # a model directory's record of the GGUF it was made from


def gguf_weights_file(where: str | os.PathLike) -> str | None:
    """The GGUF file whose blocks are the weights of the model directory ``where``: a directory that holds only
    the GGUF's config and tokenizer (``"weights": "gguf"`` in its source record) and no weights of its own.
    None for any other directory."""
    src = _read_json(Path(where) / GGUF_SOURCE_FILE) if Path(where).is_dir() else {}
    return src.get("gguf_file") if src.get("weights") == "gguf" else None


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Parameter ``name`` of ``model`` becomes ``value`` (a meta parameter cannot take another device's data)."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
    if owner == "model.embed_tokens" and getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def _float_groups(g: Any, cfg: Any) -> set[str]:
    """The parameters of every fused product (q/k/v, gate/up) with a part of a float type: such a product runs
    as one float matrix, so all its parts are read as float."""
    from .engine.gguf_file import BLOCK_TYPES, gguf_name

    whole = set()
    for layer in range(cfg.num_hidden_layers):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            names = [f"model.layers.{layer}.{part}.weight" for part in group]
            if any(g.type_name(gguf_name(n)) not in BLOCK_TYPES for n in names if gguf_name(n) in g):
                whole.update(names)
    return whole


def _read_float_params(model: nn.Module, g: Any, path: str, whole: set[str], tied: bool, device: torch.device,
                       dtype: torch.dtype) -> list[str]:
    """Every parameter checked against the file (present, same shape); those not left in the file's blocks (norms,
    biases, matrices of float types and the parts of ``whole``) dequantized into the model. The float matrices,
    named with their types."""
    from .engine.gguf_file import BLOCK_TYPES, gguf_name

    floats: list[str] = []
    for name, p in dict(model.named_parameters()).items():  # a tied head is the embedding's parameter, listed once
        gname = gguf_name(name, tied)
        if gname not in g:
            raise ValueError(f"tensor '{gname}' ({name}) is missing from {path}")
        if g.shape(gname) != tuple(p.shape):
            raise ValueError(f"tensor '{gname}' in {path} has shape {g.shape(gname)}, the config says {tuple(p.shape)}")
        blocks = g.type_name(gname) in BLOCK_TYPES
        if p.dim() == 2 and blocks and name not in whole:
            continue  # read from the file's blocks
        if p.dim() == 2:
            floats.append(f"{gname} ({g.type_name(gname)})")
        _set(model, name, g.dequantize_rows(gname).reshape(p.shape).to(device=device, dtype=dtype))
    return floats


class _EmbedRows:
    """Embedding rows looked up from the file's blocks. Rows already read, newest last: a decode step reads one
    row, which gguf-py's dequantize takes about 0.3 ms to give (a tenth of a SmolLM2 step at 2 threads); the same
    float32 values from here. Bounded to 16 MB."""

    EMBED = "token_embd.weight"

    def __init__(self, g: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.g, self.device, self.dtype = g, device, dtype
        self.seen: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.keep = max(64, (16 << 20) // (4 * g.shape(self.EMBED)[1]))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        seen = self.seen
        flat = [int(i) for i in ids.reshape(-1).tolist()]
        missing = sorted({i for i in flat if i not in seen})
        if missing:
            for i, row in zip(missing, self.g.dequantize_rows(self.EMBED, np.asarray(missing, dtype=np.int64))):
                seen[i] = row.to(device=self.device, dtype=self.dtype)
        rows = []
        for i in flat:
            seen.move_to_end(i)
            rows.append(seen[i])
        while len(seen) > self.keep:
            seen.popitem(last=False)
        return torch.stack(rows)


def _attach_file(model: nn.Module, g: Any, tied: bool, device: torch.device, dtype: torch.dtype) -> None:
    """The hooks through which the engine reads the matrices left in the file: the file itself, embedding rows,
    the fingerprint's samples and the dequantization of one or every matrix (see :func:`load_gguf_model`)."""
    from .engine.gguf_file import gguf_name

    def sample(name: str, index: torch.Tensor) -> torch.Tensor:
        """Elements ``index`` of parameter ``name`` flattened (the fingerprint's strided sample)."""
        k = model.get_parameter(name).shape[-1]
        rows, cols = index // k, index % k
        wanted = torch.unique(rows)
        values = g.dequantize_rows(gguf_name(name, tied), wanted.numpy())
        return values[torch.searchsorted(wanted, rows), cols]

    def values(name: str, p: torch.Tensor) -> torch.Tensor:
        """Parameter ``name`` (``p``, still in the file) as float values."""
        return g.dequantize_rows(gguf_name(name, tied)).reshape(p.shape).to(device=device, dtype=dtype)

    def materialize() -> None:
        """Every matrix still in the file as float32 values in the model (once)."""
        for name, p in list(model.named_parameters()):
            if p.is_meta:
                _set(model, name, values(name, p))
        model._selfspec_embed_rows = None  # the float table is there now

    def name_of(p: torch.Tensor) -> str:
        return next(n for n, q in model.named_parameters() if q is p)

    def materialize_param(p: torch.Tensor) -> None:
        """The one parameter ``p`` (still in the file) as float values in the model."""
        name = name_of(p)
        _set(model, name, values(name, p))

    def float_param(p: torch.Tensor) -> torch.Tensor:
        """The one parameter ``p`` (still in the file) as float values, not kept: the caller lets them go."""
        return values(name_of(p), p)

    model._selfspec_materialize_param = materialize_param
    model._selfspec_float_param = float_param
    model._selfspec_gguf = g
    model._selfspec_embed_rows = _EmbedRows(g, device, dtype)
    model._selfspec_sample = sample
    model._selfspec_materialize = materialize


def load_gguf_model(where: str | os.PathLike, dtype: torch.dtype, device: torch.device, log: Any = None) -> LiteLlama:
    """The model of the directory ``where`` (config and tokenizer only; :func:`gguf_weights_file`) over its GGUF:

    * every matrix of a type the block kernel reads (Q4_K, Q6_K, Q8_0, ...) and the embedding stay in the
      file: their parameters are shapes on the meta device, the engine reads the blocks (engine/quant.py) and
      looks embedding rows up from them (``_selfspec_embed_rows``), so no float copy of them is made;
    * norms, biases and matrices of float types (F32, F16, BF16) are float32 tensors, as transformers' loader
      dequantizes them;
    * ``_selfspec_materialize()`` dequantizes every matrix into the parameters (a float target), the very
      values a converted model holds; ``_selfspec_float_param(p)`` gives one parameter's values without keeping
      them (an int8 draft, the profile's F.linear reference: one matrix at a time); ``_selfspec_sample`` gives the fingerprint its
      samples without it (the same id as the converted model's).
    """
    from .engine.gguf_file import GGUFTensors

    d = Path(where)
    path = gguf_weights_file(d)
    if path is None or not Path(path).is_file():
        raise ValueError(f"the GGUF file the model directory {d} reads ({path}) is gone")
    g = GGUFTensors(path)
    cfg = LiteConfig({**_read_json(d / "config.json"), "name_or_path": str(where), "_name_or_path": str(where)})
    gen = _read_json(d / "generation_config.json")
    model = LiteLlama(cfg, gen.get("eos_token_id", getattr(cfg, "eos_token_id", None)))
    tied = bool(cfg.tie_word_embeddings)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    floats = _read_float_params(model, g, path, _float_groups(g, cfg), tied, device, dtype)
    if floats and log is not None:
        log(f"{len(floats)} matrices of {Path(path).name} are float types and run as float matrices: "
            f"{', '.join(floats[:3])}{', ...' if len(floats) > 3 else ''}")
    _attach_file(model, g, tied, device, dtype)
    model.model.rotary_emb.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
