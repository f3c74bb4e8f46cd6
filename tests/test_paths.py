"""Where selfspec writes (paths.cache_root: one cache directory for every cache), and how:
paths.atomic_open / atomic_write, the one atomic-write helper."""
from __future__ import annotations

import os

import pytest

from selfspec_cli.errors import ArtifactError, ConfigError
from selfspec_cli.paths import atomic_open, atomic_write, cache_root


def test_atomic_write_hands_writers_that_take_a_path_the_temporary_file(tmp_path):
    """safetensors' save_file takes a path: it writes the temporary file, which then replaces the target."""
    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "sub" / "t.safetensors"
    atomic_write(path, lambda f: save_file({"a": torch.arange(4)}, f.name))
    assert torch.equal(load_file(str(path))["a"], torch.arange(4))
    assert sorted(os.listdir(path.parent)) == ["t.safetensors"]


def test_atomic_open_keeps_a_partial_file_only_when_asked(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path, "w", encoding="utf-8", keep=lambda p: seen.append(p) or True) as f:
            f.write("new\n")
            raise KeyboardInterrupt
    (partial,) = tmp_path.glob("out.jsonl.*.partial")
    assert seen == [partial] and partial.read_text() == "new\n" and path.read_text() == "old\n"
    partial.unlink()
    with pytest.raises(RuntimeError):  # keep says no: nothing left behind
        with atomic_open(path, "w", encoding="utf-8", keep=lambda p: False) as f:
            raise RuntimeError
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_atomic_open_words_its_own_failures_and_passes_the_blocks_on(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ArtifactError, match="cannot write .*; choose a writable location"):
        atomic_write(blocked / "x.json", lambda f: None)  # a file where a directory should be
    with pytest.raises(ConfigError, match="cannot write --output"):
        with atomic_open(blocked / "x", error=lambda exc: ConfigError(f"cannot write --output ({exc.strerror})")):
            pass
    with pytest.raises(OSError):  # an OSError of the block's own code is the caller's
        with atomic_open(tmp_path / "y"):
            raise OSError(5, "the caller's")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_one_cache_root_for_every_cache(monkeypatch, tmp_path):
    """SELFSPEC_CACHE, else SELFSPEC_HOME/cache, else ${XDG_CACHE_HOME:-~/.cache}/selfspec; the
    kernel, converted models, quantized drafts and on-policy data all live under it."""
    import torch

    from selfspec_cli import loading
    from selfspec_cli.engine import Engine, kernels, quant
    from selfspec_cli.methods.onpolicy import collect_on_policy

    from .conftest import make_tiny_model

    for var in ("SELFSPEC_CACHE", "SELFSPEC_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert cache_root() == tmp_path / "user" / ".cache" / "selfspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "selfspec"
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / "cache"
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache"
    assert cache_root() == root
    assert kernels.cache_dir() == root / "kernels"
    assert loading.model_cache_dir() == root / "models"
    assert quant.cache_path("fp", "int8").parent == root / "drafts"
    torch.manual_seed(0)
    data = collect_on_policy(Engine(make_tiny_model(layers=2)), [[2, 3, 4]], 3, "fp")
    assert (root / "onpolicy" / f"{data.key}.safetensors").is_file()
