"""Per-architecture access to a Hugging Face causal LM's weights.

This is the only module that touches transformers internals. It reads the
embeddings, per-layer norms and projections, the final norm, the LM head and the
rotary table, and fuses q/k/v and gate/up into single matrices *in place* when first
read (:class:`Fused`; a block target never reads them): the original ``nn.Linear``
parameters become views into the fused tensors, so no weight is held twice and the
Hugging Face forward keeps working on the same storage (the ``hf`` peers in ``selfspec
bench`` run on the very same weights).

Supported: Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, Phi-3 (:data:`FAMILIES`, one :class:`Family`
entry each; engine/layer.py is the one layer they all run). The differences between them are
handled by data, not subclasses: the modules' names (Phi-3's fused ``qkv_proj`` and ``gate_up_proj``),
optional q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), per-layer sliding windows
(Mistral and Phi-3 on every layer; Qwen2/Qwen3/Gemma 3 by ``layer_types``), and Gemma 3's terms: RMSNorm weights
applied as ``1 + w`` (stored here already added, in float32 as transformers computes
them), a norm after each sublayer as well as before it, GeGLU (``gelu`` with the tanh
approximation), the embedding scale ``sqrt(hidden)``, the attention scale
``query_pre_attn_scalar ** -0.5`` (folded into the q norm's weights) and one rotary table
per layer type (a local base for sliding layers, the global base and its scaling for full ones).

:func:`model_fingerprint` is a model's short id (its config and a sample of its weights):
artifacts record it, and the quantized-draft cache is keyed by it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError



@dataclass(frozen=True, slots=True)
class Family:
    """What tells one model family's decoder layers apart, as data (the layer itself is engine/layer.py's,
    one for every family). Present or absent tensors (biases, per-head q/k norms) are read from the
    modules; a family names only what cannot be read that way."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # the attention module's products giving q, k, v in order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # the MLP module's products giving gate, then up
    gemma: bool = False  # Gemma terms: (1 + w) norms, sublayer post-norms, GeGLU, embedding scale, query_pre_attn_scalar
    window_on_every_layer: bool = False  # the config's sliding_window cuts every layer (else the ones layer_types marks)
    gguf: str | None = None  # the ``general.architecture`` of a GGUF file selfspec reads this family from


# model_type -> its family: adding a family that the layer already computes is one entry here (and its tiny
# config in tests/conftest.py ARCHS)
FAMILIES: dict[str, Family] = {
    "llama": Family(gguf="llama"),
    "mistral": Family(window_on_every_layer=True, gguf="mistral"),
    "qwen2": Family(gguf="qwen2"),  # q/k/v biases
    "qwen3": Family(gguf="qwen3"),  # per-head q/k norms
    "gemma3_text": Family(gemma=True, gguf="gemma3"),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), window_on_every_layer=True),  # fused products
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
GEMMA_TYPES = tuple(t for t, f in FAMILIES.items() if f.gemma)
# a GGUF's ``general.architecture`` -> the model_type transformers gives the converted model
GGUF_ARCHITECTURES = {f.gguf: t for t, f in FAMILIES.items() if f.gguf is not None}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config value -> the engine's MLP product


def check_supported(config: Any) -> str:
    """The config's ``model_type``; an architecture selfspec does not run is refused."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"unsupported architecture '{mt}'; selfspec supports: "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return mt


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short, stable id of a model's architecture and weights (artifacts record it,
    and refuse to load on another model). Hashes the config and a strided sample
    of every parameter, so it is cheap even for large models, and does not depend on
    the dtype the model was loaded in. Computed once per model object and kept on it, so that a model
    whose float weights a block target released (Engine.release_float_weights) keeps its id."""
    if (known := getattr(model, "_selfspec_fingerprint", None)) is not None:
        return known
    h = hashlib.sha256()
    keep = {k: v for k, v in model.config.to_dict().items() if k in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    h.update(json.dumps(keep, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            step = max(1, p.numel() // 64)
            if p.is_meta:  # a matrix still in its GGUF blocks (lite.load_gguf_model): the same elements, read there
                picked = model._selfspec_sample(name, torch.arange(0, p.numel(), step)[:64])
            else:
                picked = p.detach().reshape(-1)[::step][:64]
            h.update(name.encode())
            # bfloat16-rounded samples: the same checkpoint loaded as fp32, fp16 or bf16 gives one id
            h.update(picked.to(torch.bfloat16).float().cpu().numpy().tobytes())
    model._selfspec_fingerprint = h.hexdigest()[:16]
    return model._selfspec_fingerprint


LINEARS = ("qkv", "o", "gate_up", "down")  # a layer's matrix products (LayerWeights' w_<name>, b_<name>)


class Fused:
    """Matrices concatenated along their outputs (q/k/v, gate/up), built on first use: a target that reads
    its own blocks or panels never needs the float copy, so loading does not make one. Once built, the
    parts' ``nn.Linear`` weights are views into it (no weight is held twice)."""

    __slots__ = ("parts", "tensor")

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts, self.tensor = parts, None

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = _fuse_weights(self.parts)
        return self.tensor

    def held(self) -> list[torch.Tensor]:
        """The tensors that hold these weights now: the fused one, or the parts' own."""
        return [self.tensor] if self.tensor is not None else [m.weight for m in self.parts]


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (H,)
    qkv: Fused  # w_qkv: ((Hq + 2 Hkv) D, H)
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # (H, Hq D)
    b_o: torch.Tensor | None
    qk_norm: torch.Tensor | None  # (Hq + Hkv, D): q_norm rows then k_norm rows (Qwen3)
    mlp_norm: torch.Tensor  # (H,)
    gate_up: Fused  # w_gate_up: (2 I, H)
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # (H, I)
    b_down: torch.Tensor | None
    sliding_window: int | None
    post_attn_norm: torch.Tensor | None = None  # (H,) Gemma: RMSNorm of the attention output before the residual add
    post_mlp_norm: torch.Tensor | None = None  # (H,) Gemma: RMSNorm of the MLP output before the residual add
    rope_kind: str | None = None  # which rotary table (ModelAdapter.rope_kinds): None, the model's one table

    @property
    def w_qkv(self) -> torch.Tensor:
        return self.qkv.get()

    @w_qkv.setter
    def w_qkv(self, t: torch.Tensor) -> None:
        self.qkv.tensor = t

    @property
    def w_gate_up(self) -> torch.Tensor:
        return self.gate_up.get()

    @w_gate_up.setter
    def w_gate_up(self, t: torch.Tensor) -> None:
        self.gate_up.tensor = t

    def held(self, name: str) -> list[torch.Tensor]:
        """The tensors that hold matrix ``name`` (:data:`LINEARS`) now, without fusing anything."""
        attr = getattr(self, name) if name in ("qkv", "gate_up") else None
        return attr.held() if isinstance(attr, Fused) else [getattr(self, f"w_{name}")]


def gemma_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm's effective weight ``1 + w``, computed in float32 as transformers does
    (``output * (1.0 + self.weight.float())``), in the weight's dtype."""
    return (1.0 + weight.detach().float()).to(weight.dtype)


def _fuse_weights(linears: list[nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of ``linears`` along the output dim and rebind each module's weight to a
    view of the fused tensor."""
    w = torch.cat([m.weight.data for m in linears], dim=0).contiguous()
    for m, view in zip(linears, w.split([m.weight.shape[0] for m in linears])):
        m.weight.data = view
    return w


def _fuse_biases(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The same for the biases (all or none: mixed ones are refused)."""
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise UnsupportedModelError("mixed biased and unbiased projections are not supported")
    if not all(has_bias):
        return None
    b = torch.cat([m.bias.data for m in linears], dim=0).contiguous()
    for m, view in zip(linears, b.split([m.weight.shape[0] for m in linears])):
        m.bias.data = view
    return b


def _activation(cfg: Any, family: Family) -> str:
    """The MLP's activation as the engine names it (:data:`ACTIVATIONS`): silu, or Gemma's tanh gelu."""
    act = getattr(cfg, "hidden_activation", None) if family.gemma else getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS or (not family.gemma and act != "silu"):
        raise UnsupportedModelError(f"hidden activation '{act}' is not supported (silu; gelu_pytorch_tanh for Gemma)")
    return ACTIVATIONS[act]


def _check_terms(cfg: Any, family: Family) -> None:
    """Refuse a config term the layer does not compute (softcapping, bidirectional attention, a rotary whose
    frequencies depend on the length, a rotary over part of each head)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise UnsupportedModelError(f"{name} = {getattr(cfg, name)} is not supported (Gemma 3 has none)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention is not supported (a causal LM is)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    ropes = list(rope.values()) if family.gemma and isinstance(rope, dict) else [rope]  # Gemma: one per layer type
    for r in ropes:
        r = r if isinstance(r, dict) else {}
        rope_type = r.get("rope_type", r.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise UnsupportedModelError(f"rope type '{rope_type}' (length-dependent frequencies) is not supported; "
                                        "supported: default, linear, llama3, yarn")
        partial = r.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor = {partial} (a rotary over part of each head) is "
                                        "not supported; the engine rotates whole heads")


class ModelAdapter:
    """Reads a supported ``*ForCausalLM`` model into plain tensors for the engine."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        family = FAMILIES[check_supported(cfg)]
        self._model = model
        inner = model.model
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size: int = cfg.vocab_size
        self.max_positions: int = getattr(cfg, "max_position_embeddings", 2048)
        self.rms_eps: float = float(cfg.rms_norm_eps)
        self.activation: str = _activation(cfg, family)
        _check_terms(cfg, family)
        self.embed: torch.Tensor = inner.embed_tokens.weight
        self.final_norm: torch.Tensor = gemma_norm_weight(inner.norm.weight) if family.gemma else inner.norm.weight
        self.lm_head: torch.Tensor = model.lm_head.weight
        self.head_rows: int = self.lm_head.shape[0]  # kept: a released head is empty (the block cache checks it)
        self.rotary = inner.rotary_emb
        # the final norm's (a model read from its GGUF blocks holds its embedding there, on the meta device)
        self.dtype = inner.norm.weight.dtype
        self.device = inner.norm.weight.device
        # Gemma: embeddings times sqrt(hidden), a float32 scalar cast to the weights' dtype (as transformers does)
        scale = getattr(inner.embed_tokens, "embed_scale", None) if family.gemma else None
        self.embed_scale: torch.Tensor | None = None if scale is None else scale.detach().to(self.dtype).to(self.device)
        self.layers: list[LayerWeights] = [self._layer(cfg, family, idx, layer) for idx, layer in enumerate(inner.layers)]
        self._out_features = [{n: sum(t.shape[0] for t in w.held(n)) for n in LINEARS} for w in self.layers]
        self.rope_kinds: list[str | None] = sorted({w.rope_kind for w in self.layers}, key=str)

    def _layer(self, cfg: Any, family: Family, idx: int, layer: nn.Module) -> LayerWeights:
        """Decoder layer ``idx``'s weights and terms."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [getattr(attn, n) for n in family.qkv], [getattr(mlp, n) for n in family.gate_up]
        layer_types = getattr(cfg, "layer_types", None)
        sliding = family.window_on_every_layer or (layer_types is not None and layer_types[idx] == "sliding_attention")
        if family.gemma:
            norms = {"attn_norm": gemma_norm_weight(layer.input_layernorm.weight),
                     "post_attn_norm": gemma_norm_weight(layer.post_attention_layernorm.weight),
                     "mlp_norm": gemma_norm_weight(layer.pre_feedforward_layernorm.weight),
                     "post_mlp_norm": gemma_norm_weight(layer.post_feedforward_layernorm.weight)}
        else:
            norms = {"attn_norm": layer.input_layernorm.weight, "mlp_norm": layer.post_attention_layernorm.weight}
        return LayerWeights(
            qkv=Fused(qkv), b_qkv=_fuse_biases(qkv), w_o=attn.o_proj.weight, b_o=attn.o_proj.bias,
            qk_norm=self._qk_norm(cfg, family, attn), gate_up=Fused(gate_up), b_gate_up=_fuse_biases(gate_up),
            w_down=mlp.down_proj.weight, b_down=mlp.down_proj.bias,
            sliding_window=getattr(cfg, "sliding_window", None) if sliding else None,
            rope_kind=layer_types[idx] if family.gemma else None, **norms)

    def _qk_norm(self, cfg: Any, family: Family, attn: nn.Module) -> torch.Tensor | None:
        """The per-head q/k norms' weights, (Hq + Hkv, D): q_norm rows then k_norm rows (Qwen3, Gemma 3), or
        None. Gemma's attention scale ``query_pre_attn_scalar ** -0.5`` is folded into the q rows as the
        factor q_scale (1/sqrt(D) is the kernel's and SDPA's; exactly 1.0 when the two agree)."""
        if not hasattr(attn, "q_norm"):
            return None
        qn, kn = attn.q_norm.weight, attn.k_norm.weight
        if family.gemma:
            qn, kn = gemma_norm_weight(qn), gemma_norm_weight(kn)
            if cfg.query_pre_attn_scalar != self.head_dim:
                qn = qn * (float(cfg.query_pre_attn_scalar) ** -0.5 * self.head_dim ** 0.5)
        return torch.cat([qn.data.expand(self.num_heads, -1), kn.data.expand(self.num_kv_heads, -1)]).contiguous()

    def float_matrix(self, layer: int, name: str) -> torch.Tensor:
        """Layer ``layer``'s matrix ``name`` as float values: a model read from its GGUF blocks
        (lite.load_gguf_model) holds none for a block matrix, so one that must run as a float matrix (parts of
        mixed block layouts) is dequantized into the model here, once."""
        w = self.layers[layer]
        attr = getattr(w, name) if name in ("qkv", "gate_up") else None
        for m in attr.parts if isinstance(attr, Fused) else []:
            if m.weight.is_meta:
                self._model._selfspec_materialize_param(m.weight)
                attr.tensor = None
        return getattr(w, f"w_{name}")

    def float_values(self, layer: int | None, name: str) -> torch.Tensor:
        """Matrix ``name`` of layer ``layer`` (``layer`` None: the LM head) as float values, without keeping them:
        a matrix still in a GGUF file (lite.load_gguf_model) is dequantized for the caller alone, so a caller that
        walks the matrices one at a time (an int8 draft's build, an F.linear reference) never holds the float model."""
        held = [self.lm_head] if layer is None else self.layers[layer].held(name)
        fetch = getattr(self._model, "_selfspec_float_param", None)
        if fetch is not None and any(t.is_meta for t in held):
            attr = getattr(self.layers[layer], name) if layer is not None and name in ("qkv", "gate_up") else None
            # a fused matrix still in the file: its parts (the model's own parameters, which the file names)
            held = [m.weight for m in attr.parts] if isinstance(attr, Fused) else held
            held = [fetch(t) if t.is_meta else t for t in held]
        return held[0] if len(held) == 1 else torch.cat(held, dim=0)

    def out_features(self, layer: int, name: str) -> int:
        """Rows of layer ``layer``'s matrix ``name`` (:data:`LINEARS`), read from the model's shapes as loaded
        (a released matrix keeps its count)."""
        return self._out_features[layer][name]

    @torch.no_grad()
    def rope_table(self, length: int, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (length, D) exactly as the model's rotary module computes
        them (rope scaling types with a fixed inverse frequency: default, linear,
        llama3, yarn, ...); ``kind``: the layer type whose table (Gemma 3: local and global)."""
        pos = torch.arange(length, device=self.device)[None]
        x = torch.empty(0, dtype=self.dtype, device=self.device)  # only its dtype and device are read
        cos, sin = self.rotary(x, pos) if kind is None else self.rotary(x, pos, kind)
        return cos[0], sin[0]
