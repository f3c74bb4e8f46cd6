"""Defect 9 of the new-user findings (2026-11-27): a byte order mark in a prompt file.

Real parts throughout: the session's tiny saved Llama (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfspec_cli.cli.app import main
from selfspec_cli.prompts import read_prompts

from .test_cli import PROMPTS, assert_user_error, gen_args, run_generate, write_lines

ROOT = Path(__file__).resolve().parents[1]
BOM = "\ufeff"


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    return write_lines(tmp_path / "prompts.txt", PROMPTS)


def _selfspec(args: list[str], **kw) -> subprocess.CompletedProcess:
    """``python -m selfspec_cli ARGS`` on this checkout, in the test's environment (its SELFSPEC_HOME)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "selfspec_cli", *args], env=env, text=True, timeout=300, **kw)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("selfspec:")]
    assert len(lines) == 1 and lines[0].startswith("selfspec: error: "), err
    assert err.rstrip().splitlines()[-1] == lines[0], err  # nothing after it
    return lines[0]


# ---------------------------------------------------------------- 9. a UTF-8 byte order mark


def test_a_byte_order_mark_is_dropped(tmp_path, monkeypatch):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_text(BOM + '{"prompt": "Say hi."}\n', encoding="utf-8")
    assert [p.turns for p in read_prompts(str(jsonl))] == [("Say hi.",)]  # was: line 1 is not valid JSON
    txt = tmp_path / "bom.txt"
    txt.write_text(BOM + "Say hi.\nimport torch\n", encoding="utf-8")
    assert [p.turns for p in read_prompts(str(txt))] == [("Say hi.",), ("import torch",)]  # was: '\ufeffSay hi.'
    hidden = tmp_path / "hidden.txt"
    hidden.write_text(BOM + '{"id": "a", "prompt": "Say hi."}\n', encoding="utf-8")
    assert [(p.id, p.turns) for p in read_prompts(str(hidden))] == [("a", ("Say hi.",))]  # detected as JSONL
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(BOM + "Say hi.\n"))
    assert [p.turns for p in read_prompts("-")] == [("Say hi.",)]


def test_a_byte_order_mark_never_reaches_the_model(capsys, tiny_model_dir, tmp_path):
    plain = write_lines(tmp_path / "plain.txt", PROMPTS[:2])
    bom = tmp_path / "bom.txt"
    bom.write_text(BOM + plain.read_text(encoding="utf-8"), encoding="utf-8")
    want = run_generate(capsys, tiny_model_dir, plain, "-n", "4")
    got = run_generate(capsys, tiny_model_dir, bom, "-n", "4")
    assert [(r["prompt_tokens"], r["token_ids"]) for r in got] == [(r["prompt_tokens"], r["token_ids"]) for r in want]
