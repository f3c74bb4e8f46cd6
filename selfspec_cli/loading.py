"""Load a Hugging Face causal LM and its tokenizer: a local directory, a hub id, or
the shipped default model under ``artifacts/models/``."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from .engine.adapter import SUPPORTED_MODEL_TYPES
from .errors import ConfigError, ModelLoadError, UnsupportedModelError

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS_DIR = Path(os.environ.get("SELFSPEC_ARTIFACTS", REPO_ROOT / "artifacts"))
DEFAULT_MODEL_NAME = "pystdlib-llama-12x256"
DEFAULT_MODEL_DIR = ARTIFACTS_DIR / "models" / DEFAULT_MODEL_NAME

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown --device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"unknown --dtype '{dtype}'; use auto, float32, float16 or bfloat16")
    return DTYPES[dtype]


_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


def _looks_local(spec: str) -> bool:
    """A path unless it has the shape of a hub id ('name' or 'org/name')."""
    return spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec)


def resolve_model_path(spec: str | None) -> str:
    """The local directory or hub id to load; checks local directories up front."""
    if spec is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError(
                f"the shipped model is missing at {DEFAULT_MODEL_DIR}; restore it with git, or pass --model"
            )
        return str(DEFAULT_MODEL_DIR)
    path = Path(spec).expanduser()
    if path.exists() or _looks_local(spec):
        if not path.is_dir():
            raise ModelLoadError(f"model directory '{spec}' does not exist; pass --model a local Hugging Face directory or a hub id")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{spec}' has no config.json; pass --model a Hugging Face model directory (config.json + weights + tokenizer)")
        if not os.access(path / "config.json", os.R_OK):
            raise ModelLoadError(f"cannot read '{path / 'config.json'}'; fix the file permissions")
        return str(path)
    return spec  # a hub id


def check_supported(config: Any) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported architecture '{mt}'; selfspec supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_model(spec: str | None = None, dtype: str = "auto", device: str = "auto") -> tuple[torch.nn.Module, Any]:
    """Load (model, tokenizer) in eval mode. Errors are SelfSpecError with a fix."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for selfspec's own progress
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    where = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"could not load the model config from '{where}' ({first}); pass --model a local directory, "
            "or check the hub id and network access"
        ) from None
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dt)
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load the model or tokenizer from '{where}' ({first})") from None
    model.to(dev).eval()
    return model, tokenizer


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short, stable id of a model's architecture and weights (artifacts record it,
    and refuse to load on another model). Hashes the config and a strided sample
    of every parameter, so it is cheap even for large models, and does not depend on
    the dtype the model was loaded in."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    keep = {k: cfg.get(k) for k in sorted(cfg) if k in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    h.update(json.dumps(keep, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            h.update(name.encode())
            # bfloat16-rounded samples: the same checkpoint loaded as fp32, fp16 or bf16 gives one id
            h.update(flat[::step][:64].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
