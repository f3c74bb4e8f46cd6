"""stdin is decoded as a prompt file is (issue 50, point 4): strict UTF-8 with one line for bad bytes (no
traceback), a leading BOM dropped, CRLF as newlines; for generate's ``-p -`` and for chat's lines."""
from __future__ import annotations

import io
import sys

import pytest

from selfspec_cli.errors import PromptFileError
from selfspec_cli.prompts import read_prompts


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_invalid_utf8_on_stdin_is_one_line(monkeypatch, tmp_path):
    _stdin(monkeypatch, b"Hi\n\xff\xfe bad\n")
    with pytest.raises(PromptFileError, match="stdin is not UTF-8 text"):
        read_prompts("-")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"Hi\n\xff\xfe bad\n")
    with pytest.raises(PromptFileError, match="UTF-8"):  # the same bytes in a file: refused too
        read_prompts(str(bad))


@pytest.mark.parametrize("data", [b"\xef\xbb\xbfone\r\ntwo\r\n", b"one\ntwo\n", b"\xef\xbb\xbfone\ntwo"])
def test_bom_and_crlf_read_as_a_file_reads_them(monkeypatch, tmp_path, data):
    _stdin(monkeypatch, data)
    from_stdin = read_prompts("-")
    f = tmp_path / "p.txt"
    f.write_bytes(data)
    assert [p.turns for p in from_stdin] == [p.turns for p in read_prompts(str(f))] == [("one",), ("two",)]


def test_chat_lines_are_decoded_strictly(monkeypatch):
    from selfspec_cli.cli.chat import converse, stdin_lines

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf/reset\r\n\xff bad\n"), encoding="utf-8"))
    lines = stdin_lines()
    with pytest.raises(PromptFileError, match="a line of stdin is not UTF-8"):
        converse(None, lines)  # /reset is read (BOM and CR gone), then the bad line is refused


def test_version_answers_without_importing_torch():
    import subprocess

    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "selfspec_cli", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("selfspec ")
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "transformers" not in imported


def test_unwritable_output_is_refused_before_the_model_loads(monkeypatch, capsys):
    from selfspec_cli import loading
    from selfspec_cli.cli.app import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    assert main(["generate", "-P", "hi", "-n", "2", "-o", "/proc/selfspec-out.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write --output" in err[0]


def test_append_refuses_held_ids_and_numbers_prompt_texts_after_them(tmp_path):
    from selfspec_cli.cli.resume import check_append
    from selfspec_cli.errors import ConfigError
    from selfspec_cli.prompts import Prompt

    out = tmp_path / "a.jsonl"
    out.write_text('{"id": 1, "text": "a"}\n{"id": "q7", "text": "b"}\n{"id": 3, "text": "c"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="already holds a record of prompt id 'q7'"):
        check_append(out, [Prompt(id="q7", turns=("x",))])
    fresh = [Prompt(id="q8", turns=("x",))]
    assert check_append(out, fresh) == fresh
    texts = check_append(out, [Prompt(id=1, turns=("x",)), Prompt(id=2, turns=("y",))], numbered=True)
    assert [p.id for p in texts] == [4, 5] and [p.turns for p in texts] == [("x",), ("y",)]


def test_counts_take_their_plural():
    from selfspec_cli.cli.generate import Pace
    from selfspec_cli.errors import count

    assert (count(1, "prompt"), count(2, "prompt"), count(0, "thread")) == ("1 prompt", "2 prompts", "0 threads")
    pace = Pace()
    from selfspec_cli.decoding.output import OutputRecord

    pace.add(OutputRecord.from_dict({"new_tokens": 1, "wall_time_s": 0.5, "prompt_tokens": 3, "stats": {"prefill_s": 0.5}}))
    assert pace.line(None).startswith("1 token in 0.5 s")


def test_the_startup_figures_are_measured(monkeypatch):
    from selfspec_cli.session import Session, peak_rss_mb, process_age_s

    s = Session(model=None, tokenizer=None, load_s=1.234, ready_s=2.5)
    up = s.startup()
    assert up["model_load_s"] == 1.23 and up["model_ready_s"] == 2.5 and up["peak_rss_mb"] > 10
    assert 0 < process_age_s() < 3600 and peak_rss_mb() >= up["peak_rss_mb"] - 1
