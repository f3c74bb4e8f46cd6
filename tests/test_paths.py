"""Where selfspec writes, and how: paths.atomic_open / atomic_write, the one atomic-write helper."""
from __future__ import annotations

import os

import pytest

from selfspec_cli.errors import ArtifactError, ConfigError
from selfspec_cli.paths import atomic_open, atomic_write


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
