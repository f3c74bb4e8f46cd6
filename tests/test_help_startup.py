"""``selfspec --help`` and ``selfspec <command> --help`` answer without importing torch (issue 50, point 10;
cli/helptext.py): the kept texts are what the commands render, and a help request prints them before any
heavy import. A changed option makes the first test fail until ``python -m selfspec_cli.cli.helptext``
writes them again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_cli.cli import helptext

ROOT = Path(__file__).resolve().parents[1]


def test_the_kept_help_is_what_the_commands_render():
    doc = json.loads(helptext.HELP_FILE.read_text(encoding="utf-8"))
    from selfspec_cli import __version__

    assert doc["version"] == __version__ and doc["width"] == helptext.WIDTH
    assert doc["texts"] == helptext.render(), "run `python -m selfspec_cli.cli.helptext` to write them again"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["generate", "--help"], ["chat", "-h"], ["bench", "--help"]])
def test_help_answers_without_importing_torch(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "selfspec_cli", *argv], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "transformers" not in imported and "typer" not in imported
    command = "" if argv[0].startswith("-") else argv[0]
    assert out.stdout == helptext.stored(command) + "\n"
    assert out.stdout.startswith(f"Usage: selfspec {command}".rstrip())


def test_help_printed_fast_is_the_help_printed_slowly(monkeypatch, capsys):
    """The same bytes as the full path prints (which the commands render on a terminal of 80 columns or more)."""
    from selfspec_cli.cli.app import main

    monkeypatch.setenv("COLUMNS", "100")
    for command in ("", "generate", "calibrate"):
        assert main([*([command] if command else []), "--help"]) == 0
        slow = capsys.readouterr().out
        assert helptext.stored(command) + "\n" == slow


def test_a_narrow_terminal_or_another_version_goes_the_full_way(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "60")
    assert helptext.stored("generate") is None  # click would wrap narrower than the kept text
    monkeypatch.setenv("COLUMNS", "80")
    assert helptext.stored("generate") is not None
    old = tmp_path / "help.json"
    old.write_text(json.dumps({"version": "0.0.0", "width": helptext.WIDTH, "texts": {"generate": "x"}}))
    monkeypatch.setattr(helptext, "HELP_FILE", old)
    assert helptext.stored("generate") is None
    assert helptext.help_request(["generate", "--help"]) == "generate" and helptext.help_request([]) == ""
    assert helptext.help_request(["generate", "-p", "x", "--help"]) is None  # not a plain help request
