"""Defects 3, 4, 5, 8, 9, 15 (--prompt) and 17 of the new-user findings (2026-11-27): a failed
write of the output, an out-of-range --seed, an unwritable cache or home, records beside the
progress bar on a terminal, a byte order mark in a prompt file, prompts given as text, and an
--output that is a symbolic link.

Real parts throughout: the session's tiny saved Llama (tests/conftest.py), a real GGUF file
(tests/gguf_utils.py), /dev/full, a file-size limit (RLIMIT_FSIZE) for a disk that fills
part-way, and a pseudo-terminal for the progress bar.
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


# ---------------------------------------------------------------- 3. a failed write of the output


def test_an_output_that_refuses_writes_is_one_line(capsys, tiny_model_dir, prompt_file):
    """``-o /dev/full``: every write fails with ENOSPC; one line, status 2 (was a traceback, status 1)."""
    line = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", "/dev/full"),
                             "cannot write --output '/dev/full'", "No space left on device", "free some space",
                             only_line=False)
    assert "finished record" not in line  # a device keeps nothing


def test_a_stdout_that_refuses_writes_is_one_line(tiny_model_dir, prompt_file):
    """``> /dev/full``: one line naming stdout, status 2, and no 'Exception ignored' from the final flush."""
    with open("/dev/full", "w") as full:
        res = _selfspec(gen_args(tiny_model_dir, prompt_file, "-n", "3"), stdout=full, stderr=subprocess.PIPE)
    assert res.returncode == 2, res.stderr
    line = _one_error_line(res.stderr)
    assert "cannot write stdout (No space left on device)" in line and "free some space" in line, line


def test_a_disk_that_fills_part_way_keeps_and_names_the_finished_records(capsys, tiny_model_dir, prompt_file, tmp_path):
    """The file-size limit lets two records and half of the third reach the disk (a disk that fills
    part-way): one line, status 2, naming the partial file with its two whole records."""
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "5", "-o", str(tmp_path / "sizes.jsonl"))) == 0
    sizes = [len(line.encode()) for line in (tmp_path / "sizes.jsonl").read_text().splitlines(keepends=True)]
    limit = sizes[0] + sizes[1] + sizes[2] // 2  # timings vary by a few bytes; half a record does not

    import resource

    def limit_files() -> None:  # in the child only; Python ignores SIGXFSZ, so a write past it is EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "out.jsonl"
    res = _selfspec(gen_args(tiny_model_dir, prompt_file, "-n", "5", "-o", str(out)), capture_output=True,
                    preexec_fn=limit_files)
    assert res.returncode == 2, res.stderr
    line = _one_error_line(res.stderr)
    (partial,) = tmp_path.glob("out.jsonl.*.partial")
    assert f"cannot write --output '{out}' (File too large)" in line, line
    assert f"2 finished records are in {partial}" in line and "free some space" in line, line
    assert not out.exists()
    assert [json.loads(x)["id"] for x in partial.read_text().splitlines()] == [1, 2]  # whole lines only


# ---------------------------------------------------------------- 4. --seed out of range


SEEDS = ["-1", str(2**32), "99999999999999999999999"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("command", ["generate", "bench", "calibrate", "train-heads"])
def test_a_seed_out_of_range_is_refused_before_loading(capsys, prompt_file, tmp_path, command, seed):
    """The model does not exist: the seed must be refused first (was: accepted and wrapped modulo 2**64,
    or a traceback from torch's, numpy's or optuna's seeding after the model loaded)."""
    model = str(tmp_path / "no-such-model")
    argv = {"generate": ["generate", "-m", model, "-p", str(prompt_file), "--method", "ar", "-t", "0.7"],
            "bench": ["bench", "-m", model, "--methods", "ar", "-p", str(prompt_file), "-t", "0.5",
                      "-o", str(tmp_path / "b")],
            "calibrate": ["calibrate", "--method", "self-sd", "-m", model, "-p", str(prompt_file), "--trials", "1",
                          "-o", str(tmp_path / "cal.json")],
            "train-heads": ["train-heads", "--kind", "lm-heads", "-m", model, "-p", str(prompt_file),
                            "-o", str(tmp_path / "heads")]}[command]
    assert_user_error(capsys, [*argv, "--seed", seed, "--device", "cpu"], "--seed must be in 0..2**32-1", f"got {seed}")
    assert not (tmp_path / "cal.optuna.db").exists()


def test_the_largest_seed_samples(capsys, tiny_model_dir, prompt_file):
    recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "3", "-t", "0.8", "--seed", str(2**32 - 1))
    assert [r["id"] for r in recs] == [1, 2, 3, 4]


# ---------------------------------------------------------------- 5. an unwritable cache or home


@pytest.fixture
def tiny_gguf(tmp_path):
    from .gguf_utils import make_tiny_gguf

    return make_tiny_gguf(tmp_path / "src", seed=3)[0]


@pytest.mark.parametrize("variable,value,named", [("SELFSPEC_CACHE", "/proc/nope", "'/proc/nope' ($SELFSPEC_CACHE)"),
                                                  ("SELFSPEC_HOME", "/proc/nope2", "'/proc/nope2/cache' ($SELFSPEC_HOME/cache)")])
def test_an_unwritable_cache_fails_before_the_conversion(capsys, monkeypatch, tiny_gguf, prompt_file, variable, value, named):
    """A GGUF model is converted into the cache: an unwritable cache is one line naming the directory
    and its variable, before the conversion (was: a traceback after converting)."""
    monkeypatch.delenv("SELFSPEC_CACHE", raising=False)
    monkeypatch.setenv(variable, value)
    capsys.readouterr()
    line = assert_user_error(capsys, gen_args(tiny_gguf, prompt_file, "-n", "2"), named, f"set {variable}")
    assert "converting" not in line


def test_an_unwritable_home_fails_before_calibrating(capsys, monkeypatch, selfspec_home, tiny_model_dir, prompt_file):
    """calibrate's artifact goes to the home by default: an unwritable home is one line before the model loads."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(selfspec_home / "cache"))  # a writable cache (the shared kernel)
    monkeypatch.setenv("SELFSPEC_HOME", "/proc/nope2")
    assert_user_error(capsys, ["calibrate", "--method", "self-sd", "-m", str(tiny_model_dir), "-p", str(prompt_file),
                               "--trials", "1", "--num-prompts", "1", "-n", "2", "--device", "cpu"],
                      "cannot write selfspec's home directory '/proc/nope2' ($SELFSPEC_HOME)", "set SELFSPEC_HOME")


# ---------------------------------------------------------------- 8. records and the progress bar on one terminal


_CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_records_never_share_a_line_with_the_progress_bar(tiny_model_dir, prompt_file):
    """stdout and stderr on one pseudo-terminal, as in a shell: every record starts its own line (after
    the bar is erased) and the bar is drawn again under it (was: ``generate ━━━ 0/4 0:00:00 {"id": 1, ...``)."""
    import pty

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TERM="xterm-256color", COLUMNS="120")
    proc = subprocess.Popen([sys.executable, "-m", "selfspec_cli", *gen_args(tiny_model_dir, prompt_file, "-n", "4", "--no-stream")],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    raw, deadline = b"", time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        assert proc.wait(timeout=60) == 0, raw.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = raw.decode("utf-8", errors="replace")
    assert "generate" in _CSI.sub("", text)  # the bar was drawn
    starts = [seg for seg in text.split("\n") if '{"id"' in seg]
    assert len(starts) == len(PROMPTS), text
    for seg in starts:
        before, record = seg[:seg.index('{"id"')], seg[seg.index('{"id"'):]
        shown = _CSI.sub("", before).rsplit("\r", 1)[-1]  # what the terminal shows before the record
        assert shown == "", repr(seg)
        assert json.loads(record.rstrip("\r"))["method"] == "ar", repr(seg)  # the bar never cuts into a record


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


# ---------------------------------------------------------------- 15. --prompt TEXT


def test_prompts_given_as_text(capsys, tiny_model_dir, tmp_path):
    """--prompt (-P), repeatable: ids 1..n, the same records as the same lines in a file."""
    capsys.readouterr()
    argv = ["generate", "-m", str(tiny_model_dir), "--device", "cpu", "--method", "ar", "-n", "4"]
    assert main([*argv, "--prompt", PROMPTS[0], "-P", PROMPTS[1]]) == 0
    out, err = capsys.readouterr()
    recs = [json.loads(line) for line in out.splitlines()]
    from_file = run_generate(capsys, tiny_model_dir, write_lines(tmp_path / "two.txt", PROMPTS[:2]), "-n", "4")
    assert [r["id"] for r in recs] == [1, 2]
    assert [r["token_ids"] for r in recs] == [r["token_ids"] for r in from_file]


@pytest.mark.parametrize("extra,fragments", [
    ([], ("Missing option '--prompt-file'", "'--prompt' / '-P'")),
    (["-p", "PROMPTS", "-P", "import torch"], ("--prompt-file and --prompt both give the prompts",)),
    (["-P", "import torch", "-P", "  "], ("--prompt number 2 is empty",)),
    (["-P", "import torch", "--prompt-format", "jsonl"], ("--prompt-format is an option of --prompt-file",)),
])
def test_prompt_and_prompt_file_are_one_of_two(capsys, tiny_model_dir, prompt_file, extra, fragments):
    extra = [str(prompt_file) if a == "PROMPTS" else a for a in extra]
    assert_user_error(capsys, ["generate", "-m", str(tiny_model_dir), "--device", "cpu", "--method", "ar", *extra],
                      *fragments)


# ---------------------------------------------------------------- 17. --output through a symbolic link


def test_forced_output_through_a_link_replaces_the_file_it_points_to(capsys, tiny_model_dir, prompt_file, tmp_path):
    """The link stays a link; the file it points to (in another directory) gets the records, written
    atomically beside that file (was: the link was replaced by a regular file, its target unchanged)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "links").mkdir()
    target = tmp_path / "data" / "keep.jsonl"
    target.write_text("old\n")
    link = tmp_path / "links" / "keeplink.jsonl"
    link.symlink_to(target)
    capsys.readouterr()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", str(link), "--force"))
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [json.loads(x)["id"] for x in target.read_text().splitlines()] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "data")) == ["keep.jsonl"] and os.listdir(tmp_path / "links") == ["keeplink.jsonl"]
