"""What the wheel ships: the shipped artifacts, example prompts, bundled suites and data and
the kernel source are package data, read through the package (``selfspec_cli/shipped`` links
to the repository's ``artifacts/`` and ``examples/``, their one copy).

The file list is setuptools' own (its ``build_py`` command configured from pyproject.toml),
so a file that a wheel would leave out fails here without building one;
scripts/check_install.sh installs a real wheel and runs it from elsewhere (.ci/run).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from selfspec_cli import loading

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "selfspec_cli"
# tracked directories whose every file a wheel must hold
SHIPPED_TREES = ("artifacts", "examples", "selfspec_cli/bench/suites", "selfspec_cli/bench/data",
                 "selfspec_cli/engine/csrc", "selfspec_cli/cli/help.json")


def _tracked(tree: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--", tree], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def _wheel_data_files(monkeypatch) -> set[str]:
    """Package data files as setuptools would copy them into the wheel, as repository paths
    with the links resolved (selfspec_cli/shipped/artifacts/x -> artifacts/x)."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist = Distribution()
        apply_configuration(dist, "pyproject.toml")
        # package-data alone decides what is shipped; MANIFEST/SCM inclusion (on by default)
        # only adds files, and would run egg_info, which writes into the tree
        dist.include_package_data = False
        cmd = dist.get_command_obj("build_py")
        cmd.ensure_finalized()
        files = [Path(src, f) for _pkg, src, _build, names in cmd.data_files for f in names]
    return {Path(os.path.realpath(f)).relative_to(ROOT).as_posix() for f in files}


def test_links_lead_to_the_repository_trees():
    for name in ("artifacts", "examples"):
        link = PKG / "shipped" / name
        assert link.is_symlink() and os.readlink(link) == f"../../{name}", link
    assert loading.EXAMPLES_DIR == ROOT / "examples"
    if not os.environ.get("SELFSPEC_ARTIFACTS"):
        assert loading.ARTIFACTS_DIR == ROOT / "artifacts"
        assert loading.CODE_MODEL_DIR == ROOT / "artifacts" / "models" / loading.CODE_MODEL_NAME


def test_wheel_holds_every_shipped_file(monkeypatch):
    data = _wheel_data_files(monkeypatch)
    for tree in SHIPPED_TREES:
        files = _tracked(tree)
        assert files, tree
        missing = sorted(set(files) - data)
        assert not missing, f"tracked files a wheel would leave out (pyproject.toml package-data): {missing}"
    assert {f for f in data if not f.startswith(SHIPPED_TREES)} == set(), "package data outside the shipped trees"


def test_train_heads_default_prompts_are_shipped():
    from selfspec_cli.cli.train_heads import DEFAULT_PROMPTS

    assert Path(DEFAULT_PROMPTS).is_file() and Path(DEFAULT_PROMPTS).parent == loading.EXAMPLES_DIR
