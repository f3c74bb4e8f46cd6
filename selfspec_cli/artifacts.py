"""Read and write selfspec artifacts: JSON manifests and safetensors files.

An artifact is something a command computes once and later commands load: Self-SD's
skip set, FR-Spec's draft vocabulary, AdaDecode's heads, SpecEE's predictors and schedule.
Each kind is one :class:`ArtifactSpec`, declared in its method's package beside the offline
step that makes it (docs/design.md, "A method is one package"). Invariants:

* writes are atomic (:func:`selfspec_cli.paths.atomic_write`): a temporary file in the
  destination directory, flushed and fsynced, then ``os.replace``; a crash or Ctrl-C
  leaves the old file or the new one, never a torn one, and no temporary file behind;
* every artifact records ``kind``, ``format_version`` and ``model_fingerprint``
  (:func:`selfspec_cli.loading.model_fingerprint`) and refuses to load as another kind or
  on another model;
* every failure a user can cause is an :class:`ArtifactError` with a one-line
  message that names the fix (the command that makes the artifact).

A JSON artifact is one manifest (the spec's suffix ends in ``.json``). A tensors artifact
is a directory with ``tensors.safetensors`` and ``manifest.json`` (or ``X.safetensors``
beside ``X.manifest.json``); both carry the same random ``artifact_id`` so a half-replaced
pair is detected.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import uuid
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from . import loading, paths
from .errors import ArtifactError, ConfigError, first_line
from .jsonio import dumps
from .paths import atomic_write

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"


# ---------------------------------------------------------------- names and paths


def model_name(model_or_spec: Any) -> str:
    """The model's local directory or hub id as it was loaded (``config.name_or_path``)."""
    if isinstance(model_or_spec, (str, os.PathLike)):
        return str(model_or_spec)
    cfg = getattr(model_or_spec, "config", None)
    return str(getattr(cfg, "name_or_path", "") or getattr(cfg, "_name_or_path", "") or "model")


def sanitized_model_name(model_or_spec: Any) -> str:
    """A file-name-safe model name: a local directory's basename (after resolving it, so
    ``-m .`` is named after the directory), or a hub id with ``/`` replaced by ``--``
    (``org/name`` -> ``org--name``)."""
    name = model_name(model_or_spec)
    name = name.rstrip("/\\") or name
    path = Path(name).expanduser()
    if path.is_dir() or loading.looks_local(name):
        try:
            name = path.resolve().name or "model"
        except OSError:
            name = path.name or "model"
    else:
        name = name.replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "model"


def user_artifact_path(kind: str, model: torch.nn.Module, suffix: str = "") -> Path:
    """Where selfspec writes an artifact for ``model`` by default:
    ``<selfspec home>/artifacts/<kind>/<model name>-<fingerprint><suffix>``."""
    return paths.user_artifacts_dir() / kind / f"{sanitized_model_name(model)}-{loading.model_fingerprint(model)}{suffix}"


def shipped_artifact_path(kind: str, model_or_spec: Any, suffix: str = "") -> Path:
    """The read-only artifact shipped with selfspec: ``artifacts/<kind>/<model name><suffix>``."""
    return Path(loading.ARTIFACTS_DIR) / kind / f"{sanitized_model_name(model_or_spec)}{suffix}"


def is_shipped(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies in the shipped (read-only) artifacts tree."""
    return paths.is_inside(path, loading.ARTIFACTS_DIR)


def check_new_artifact(path: Path, force: bool, option: str = "--output") -> None:
    """Refuse to replace an existing artifact without ``--force``, and never write into the shipped tree."""
    if is_shipped(path) and not force:
        raise ArtifactError(f"'{path}' is in selfspec's shipped artifacts ({loading.ARTIFACTS_DIR}), which are "
                            f"read-only data; drop {option} to write the default location under "
                            f"{paths.user_artifacts_dir()}, or choose another path")
    exists = any(path.iterdir()) if path.is_dir() else path.exists()  # an empty directory holds no artifact
    if exists and not force:
        raise ArtifactError(f"{option} '{path}' already exists; pass --force to replace it, or choose another {option}")


def save_json_artifact(path: str | os.PathLike, obj: Mapping[str, Any], first: tuple[Path, bytes] | None = None) -> Path:
    """Write ``obj`` as indented JSON, atomically; ``first``: a file and its bytes written (atomically) before it,
    the tensors a manifest describes (:func:`save_tensors_artifact`)."""
    data = (dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    if first is not None:
        atomic_write(first[0], lambda f: f.write(first[1]))
    return atomic_write(path, lambda f: f.write(data))


def read_json_artifact(path: Path, what: str, create_hint: str, again_hint: str | None = None) -> dict[str, Any]:
    """The JSON object in ``path``; each failure an :class:`ArtifactError` naming ``what`` and
    the fix (``create_hint``: how to make it; ``again_hint``: how to make it once the broken file
    is deleted, when that differs)."""
    if not path.exists():
        raise ArtifactError(f"{what} '{path}' does not exist; {create_hint}")
    if path.is_dir():
        raise ArtifactError(f"{what} '{path}' is a directory, not a JSON file; pass the .json file")
    again_hint = again_hint or create_hint
    again = f"delete it and {again_hint[0].lower()}{again_hint[1:]}"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{what} '{path}' is not valid JSON ({exc.msg}: line {exc.lineno}); {again}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read {what} '{path}' ({exc.__class__.__name__}); check permissions") from None
    if not isinstance(obj, dict):
        raise ArtifactError(f"{what} '{path}' is not a JSON object; {again}")
    return obj


def check_fingerprint(manifest: Mapping[str, Any], model: torch.nn.Module, path: Path, fix: str) -> None:
    """Refuse (:class:`ArtifactError`, with ``fix``) an artifact made for another model."""
    theirs = manifest.get("model_fingerprint")
    ours = loading.model_fingerprint(model)
    if theirs != ours:
        raise ArtifactError(f"artifact '{path}' was made for another model (fingerprint {theirs}, this model {ours}); {fix}")


def environment_info(device: torch.device | str | None = None, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """Software and hardware a measurement was made on (artifacts record it)."""
    import transformers

    dev = torch.device(device if device is not None else "cpu")
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "platform": platform.platform(), "device": str(dev),
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
    }
    from .engine import kernels
    from .engine.cores import cores

    # the kernel pool's size (every product of a forward runs on it) and the cores the process saw
    info.update(pool_threads=kernels.pool_threads(), cores=cores().describe())
    # the version only: optuna itself is imported where searches live (and it is a dependency)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["optuna"] = importlib.metadata.version("optuna")
    if dev.type == "cuda" and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda)
    return info


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- tensors artifacts (safetensors)


def tensors_artifact_paths(dir_or_path: str | os.PathLike) -> tuple[Path, Path]:
    """``(tensors file, manifest file)``: ``D/tensors.safetensors`` + ``D/manifest.json`` for a
    directory ``D``, or ``X.safetensors`` + ``X.manifest.json`` for a path ending in .safetensors."""
    p = Path(dir_or_path)
    if p.suffix == ".safetensors":
        return p, p.with_name(p.stem + ".manifest.json")
    return p / TENSORS_FILE, p / MANIFEST_FILE


def save_tensors_artifact(dir_or_path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                          manifest: Mapping[str, Any]) -> Path:
    """Write tensors (safetensors) and their manifest (JSON), each atomically.

    ``manifest`` needs ``kind`` and ``model_fingerprint``; ``created``,
    ``format_version``, ``artifact_id`` and the tensor inventory are added. The
    tensors file is replaced first and the manifest last, so a reader never sees a
    manifest describing tensors that were not written. Returns the manifest path.
    """
    return save_json_artifact(*tensors_files(dir_or_path, tensors, manifest))


def tensors_files(dir_or_path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                  manifest: Mapping[str, Any]) -> tuple[Path, dict[str, Any], tuple[Path, bytes]]:
    """What :func:`save_tensors_artifact` writes: ``(manifest file, full manifest, (tensors file, its bytes))``."""
    from safetensors.torch import save as st_save

    for key in ("kind", "model_fingerprint"):
        if key not in manifest:
            raise ValueError(f"tensors artifact manifest needs '{key}'")
    tfile, mfile = tensors_artifact_paths(dir_or_path)
    artifact_id = uuid.uuid4().hex
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    data = st_save(tensors, metadata={"artifact_id": artifact_id, "kind": str(manifest["kind"])})
    full = {
        "format_version": FORMAT_VERSION,
        **manifest,
        "artifact_id": artifact_id,
        "tensors_file": tfile.name,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()},
        "created": manifest.get("created") or now_iso(),
    }
    return mfile, full, (tfile, data)


def load_tensors_artifact(dir_or_path: str | os.PathLike, model: torch.nn.Module | None = None, *,
                          kind: str | None = None, device: torch.device | str = "cpu",
                          create_hint: str = "create it with the selfspec command that makes it",
                          ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load ``(tensors, manifest)``; checks the kind, the model fingerprint (when
    ``model`` is given) and that the tensors file belongs to this manifest."""
    from safetensors import SafetensorError, safe_open

    tfile, mfile = tensors_artifact_paths(dir_or_path)
    manifest = read_json_artifact(mfile, "artifact manifest", create_hint)
    if kind is not None and (found := manifest.get("kind")) != kind:
        what = f"a {found!r} artifact" if found is not None else "not a selfspec artifact (it has no 'kind')"
        raise ArtifactError(f"'{mfile}' is {what}, not {kind!r}; {create_hint}")
    if model is not None:
        check_fingerprint(manifest, model, mfile, f"recreate it for this model ({create_hint})")
    if not tfile.is_file():
        raise ArtifactError(f"artifact tensors '{tfile}' are missing (the manifest '{mfile}' names them); {create_hint}")
    try:
        with safe_open(str(tfile), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read artifact tensors '{tfile}' ({first_line(exc)}); {create_hint}") from None
    if meta.get("artifact_id") != manifest.get("artifact_id"):
        raise ArtifactError(f"'{tfile}' does not belong to '{mfile}' (artifact ids differ: a partial copy or an "
                            f"interrupted write); {create_hint}")
    return tensors, manifest


# ---------------------------------------------------------------- which artifacts a run loaded

_RECORDERS: list[dict[str, str]] = []


@contextlib.contextmanager
def recording_loads() -> Any:
    """Inside it, every :meth:`ArtifactSpec.load` adds ``kind -> absolute path`` to the dict it
    gives (so a command can say which artifact files a method loaded)."""
    used: dict[str, str] = {}
    _RECORDERS.append(used)
    try:
        yield used
    finally:
        _RECORDERS.remove(used)


# ---------------------------------------------------------------- the artifact spec


@dataclass(frozen=True)
class ArtifactSpec:
    """One kind of artifact, as its method's package declares it (docs/design.md, "A method is
    one package"): the manifest's ``kind``, where it lives, what makes it, and the checks every
    load makes. A JSON artifact has a ``suffix`` ending in ``.json``; any other is a tensors
    artifact (a directory with safetensors and a manifest).

    Loading resolves the path (explicit, else the user's fingerprint-keyed default, else the
    shipped one), reads the manifest, refuses another kind or another model's fingerprint, and
    reads the tensors; each failure is one :class:`ArtifactError` naming :meth:`command`. The
    method parses the fields it owns and reports a bad one with :meth:`error`."""

    kind: str
    folder: str  # <selfspec home>/artifacts/<folder>/ (user's) and artifacts/<folder>/ (shipped)
    what: str  # for messages: "Self-SD skip-set artifact"
    make: str  # the command that makes it, before the model flag: "selfspec calibrate --method self-sd"
    args: str = ""  # the command's arguments after the model flag: " --prompt-file <prompts>"
    suffix: str = ""
    alternative: str = ""  # how else to go on without it, for the missing-artifact message

    @property
    def is_json(self) -> bool:
        return self.suffix.endswith(".json")

    def default_path(self, model: torch.nn.Module) -> Path:
        """Where the command writes by default (see :func:`user_artifact_path`)."""
        return user_artifact_path(self.folder, model, self.suffix)

    def command(self, model_or_spec: Any, path: Path | None = None, deleted: bool = False) -> str:
        """The command that (re)creates it for this model, written to where it will be found. It names
        ``--model`` unless the model is the default one; for a loaded model it adds the ``--output``/``--force``
        part, chosen so that it can never replace the shipped artifacts or a file that exists: an explicit
        ``path`` is kept only when nothing is there and it is outside the shipped tree; otherwise the command
        writes the fingerprint-keyed default (with ``--force`` when that one exists and is unusable). ``deleted``:
        the advice follows "delete it", so ``path`` counts as not existing."""
        name = model_name(model_or_spec)
        cmd = self.make + ("" if loading.is_default_model(name) else f" --model {loading.model_alias(name)}") + self.args
        if not isinstance(model_or_spec, torch.nn.Module):
            return cmd
        default = self.default_path(model_or_spec)
        gone = deleted or (path is not None and not Path(path).exists())
        if path is not None and Path(path) != default and gone and not is_shipped(path):
            return f"{cmd} --output {path}"
        return cmd + (" --force" if default.exists() and not (deleted and Path(path or "") == default) else "")

    def hint(self, model: Any, path: Path | None = None, deleted: bool = False) -> str:
        return f"create it with `{self.command(model, path, deleted)}`"

    def error(self, path: Path, model: Any, problem: str) -> ArtifactError:
        """A bad field of an artifact of this kind: one line naming the command that remakes it."""
        return ArtifactError(f"'{path}': {problem}; {self.hint(model, path)}")

    def exists(self, path: Path) -> bool:
        return path.is_file() if self.is_json else tensors_artifact_paths(path)[1].is_file()

    def find(self, model: torch.nn.Module) -> tuple[Path | None, list[Path]]:
        """``(first existing default or None, every default looked at)``: the user's, then the shipped one."""
        cands = [self.default_path(model), shipped_artifact_path(self.folder, model, self.suffix)]
        user = cands[0]
        if not self.is_json and user.is_dir() and any(user.iterdir()) and not self.exists(user):
            # what an interrupted first write leaves (the tensors go before the manifest): never a silent fallback
            raise ArtifactError(f"'{user}' holds no manifest (an interrupted write?), so it is not a {self.what}; "
                                f"remake it with `{self.command(model)}`, or delete it to use the shipped one")
        return next((c for c in cands if self.exists(c)), None), cands

    def resolve(self, path: str | os.PathLike | None, model: torch.nn.Module) -> Path:
        """An explicit path, else the first default that exists; none: one error naming both."""
        if path is not None:
            return Path(path)
        found, looked = self.find(model)
        if found is None:
            raise ArtifactError(f"no {self.what} for this model (looked for {looked[0]} and {looked[1]}); "
                                f"{self.hint(model)}{self.alternative}")
        return found

    def precheck(self, path: str | os.PathLike, option: str) -> None:
        """Refuse, before any model loads, an explicit ``path`` that holds no artifact of this kind
        (missing, or no manifest of this kind); the model's fingerprint is checked when it loads."""
        mfile = Path(path) if self.is_json else tensors_artifact_paths(path)[1]
        if not Path(path).exists():
            raise ArtifactError(f"{option} '{path}' does not exist; pass a {self.what} made by `{self.make}`")
        try:
            kind = json.loads(mfile.read_text(encoding="utf-8")).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind != self.kind:
            article = "an" if self.what[:1].upper() in "AEIOU" else "a"
            raise ArtifactError(f"{option} '{path}' is not {article} {self.what} (no manifest of kind {self.kind!r} in it); "
                                f"pass one made by `{self.make}`")

    def load(self, path: str | os.PathLike | None, model: torch.nn.Module) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
        """``(path, manifest, tensors)`` of this model's artifact (tensors empty for a JSON one)."""
        p = self.resolve(path, model)
        for used in _RECORDERS:
            used[self.kind] = os.path.abspath(p)
        hint = self.hint(model, p)
        if not self.is_json:
            tensors, manifest = load_tensors_artifact(p, model, kind=self.kind, create_hint=hint)
            return p, manifest, tensors
        manifest = read_json_artifact(p, self.what, hint, self.hint(model, p, deleted=True))
        if (kind := manifest.get("kind")) != self.kind:
            found = f"a {kind!r} artifact" if kind is not None else "not a selfspec artifact (it has no 'kind')"
            raise ArtifactError(f"'{p}' is {found}, not a {self.what} (kind {self.kind!r}); pass a file made by "
                                f"`{self.command(model, p)}`")
        check_fingerprint(manifest, model, p, f"remake it with `{self.command(model, p)}`")
        return p, manifest, {}

    def header(self, model: torch.nn.Module) -> dict[str, Any]:
        """The fields every manifest of this kind starts with."""
        return {"kind": self.kind, "format_version": FORMAT_VERSION, "model_fingerprint": loading.model_fingerprint(model),
                "model_name_or_path": model_name(model), "num_layers": int(model.config.num_hidden_layers)}

    def save(self, path: str | os.PathLike, model: torch.nn.Module, manifest: Mapping[str, Any],
             tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write it atomically: the header, ``manifest``, the creation time (and the tensors)."""
        full = {**self.header(model), **manifest, "created": manifest.get("created") or now_iso()}
        # a tensors artifact: its tensors file first, then the manifest that describes it
        files = (path, full, None) if self.is_json else tensors_files(path, tensors or {}, full)
        return save_json_artifact(*files)

    def set_aside(self, path: Path, tag: str) -> Path:
        """Where a result that may not become the default is written, beside ``path`` and named by ``tag``
        (``below-ar``, ``unusable``, ``too-little-data``): ``x.json`` -> ``x.<tag>.json``, a directory ``x``
        -> ``x.<tag>``. No loader looks there (:meth:`find` reads the default paths only)."""
        return path.with_name(f"{path.stem}.{tag}.json" if self.is_json else f"{path.name}.{tag}")

    def check_output(self, path: Path, force: bool) -> Path:
        """Refuse an output path that exists (without ``--force``), is shipped, or cannot be written."""
        check_new_artifact(path, force)
        check_writable(path if self.is_json else path / MANIFEST_FILE, "--output")
        return path


def check_writable(path: Path, option: str) -> None:
    """Refuse a file ``path`` that cannot be written; ``option`` names it. Nothing is created (the
    write makes missing directories), so a run that fails later leaves no empty directory behind."""
    if path.is_dir():
        raise ConfigError(f"{option} '{path}' is a directory; pass a file path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the nearest directory that exists
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot create the directory of {option} '{path}' ('{parent}' is a file); "
                          "choose a writable path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {option} '{path}' ('{parent}' is not writable); choose a writable path")


def save_layers(spec: ArtifactSpec, path: Path, model: torch.nn.Module, items: Mapping[int, Any],
                manifest: Mapping[str, Any]) -> Path:
    """A per-layer tensors artifact: tensors ``layer<k>.<field>`` of each layer's dataclass (float32;
    integer tensors, token ids, as int32; a field that is None is not written)."""
    def stored(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32) if not t.is_floating_point() else t.float()

    tensors = {f"layer{k}.{f.name}": stored(getattr(v, f.name)) for k, v in items.items() for f in fields(v)
               if getattr(v, f.name) is not None}
    return spec.save(path, model, {**manifest, "layers": sorted(items)}, tensors)


def _stored_field(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A saved field: float32 as written, token ids back to int64."""
    t = tensors[name]
    return t if t.is_floating_point() else t.to(torch.int64)


def load_layers(spec: ArtifactSpec, path: Path | None, model: torch.nn.Module, build: Any,
                what: str) -> tuple[dict[int, Any], dict[str, Any]]:
    """The per-layer dataclasses ``build`` of a :func:`save_layers` artifact, and its manifest."""
    p, manifest, tensors = spec.load(path, model)
    out: dict[int, Any] = {}
    L = int(model.config.num_hidden_layers)
    for k in manifest.get("layers", []):
        if not 0 <= int(k) < L - 1:
            raise spec.error(p, model, f"{what} layer {k} is out of range for a {L}-layer model")
        try:  # a field with a default (an optional tensor) may be absent
            out[int(k)] = build(**{f.name: _stored_field(tensors, f"layer{k}.{f.name}")
                                   for f in fields(build) if f"layer{k}.{f.name}" in tensors or f.default is MISSING})
        except KeyError:
            raise spec.error(p, model, f"it lacks the tensors of {what} layer {k}") from None
    if not out:
        raise spec.error(p, model, f"it holds no {what}s")
    return out, manifest
