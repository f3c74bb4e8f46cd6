"""Interrupts (issue 50, point 7; cli/exits.py): one line per signal, naming what was kept (nothing, the records
written, a bench's run directory and how to resume it), status 130 for SIGINT and 143 for SIGTERM, at every stage:
while the modules import, while the model loads, while a chat waits, and in a bench before its first record.
Real signals to real subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_cli import PROMPTS, write_lines

ROOT = Path(__file__).resolve().parents[1]


def _start(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # SIGINT at its default in the child (a shell's background job would start it ignored)
    return subprocess.Popen([sys.executable, "-m", "selfspec_cli", *args], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def _wait_for(stream, needle: str, timeout: float = 180) -> list[str]:
    """Lines of ``stream`` read until one holds ``needle`` (the lines so far)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}: {''.join(seen)}")


def _selfspec_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("selfspec:")]


def test_sigterm_while_importing_is_one_line_and_143():
    """It used to end with status 143 and no word: the handler was installed after the imports."""
    proc = _start(["generate", "-p", "x"])
    time.sleep(1.0)  # torch is still loading (seconds on these hosts)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert err.strip() == "selfspec: terminated (SIGTERM); it had finished nothing, so nothing was kept"


def test_sigint_while_the_model_loads_claims_nothing_kept(tiny_model_dir, tmp_path):
    """'everything finished before the interrupt was kept' was said when nothing had finished."""
    proc = _start(["generate", "-m", str(tiny_model_dir), "-P", "hi", "-n", "4", "--device", "cpu"])
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = _selfspec_lines(err)
    assert lines == ["selfspec: interrupted (SIGINT); it had finished nothing, so nothing was kept"], err


def test_sigint_after_records_went_to_stdout_names_them(tiny_model_dir, tmp_path):
    prompts = write_lines(tmp_path / "many.txt", PROMPTS * 40)
    proc = _start(["generate", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "48", "--device", "cpu",
                   "--method", "ar"])
    first = proc.stdout.readline()
    assert json.loads(first)["id"] == 1
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    n = 1 + len(out.splitlines())
    [line] = _selfspec_lines(err)
    assert line.startswith("selfspec: interrupted (SIGINT); ") and line.endswith("written to stdout"), err
    assert f"{n} finished record" in line


@pytest.mark.parametrize("sig,status,word", [(signal.SIGINT, 130, "interrupted (SIGINT)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_chat_interrupted_says_it_keeps_no_file(tiny_model_dir, sig, status, word):
    proc = _start(["chat", "-m", str(tiny_model_dir), "-n", "4", "--device", "cpu"], stdin=subprocess.PIPE)
    _wait_for(proc.stderr, "chat with")  # loaded, waiting for a turn
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert _selfspec_lines(err) == [f"selfspec: {word}; chat keeps no file: the answers so far were printed as they came"]


def test_a_bench_interrupted_before_its_first_record_can_be_resumed(tiny_model_dir, tmp_path):
    """A bench interrupted at 22 s wrote no directory and --resume found nothing. Interrupted once its run
    directory is set up (the header's target line), before any record, it says so, and --resume finishes it."""
    out = tmp_path / "bench-out"
    args = ["bench", "-m", str(tiny_model_dir), "--device", "cpu", "--methods", "ar,pld", "-n", "4", "--no-plots",
            "--suite", str(write_lines(tmp_path / "p.txt", PROMPTS[:2])), "--output-dir", str(out)]
    args[args.index("--suite")] = "--prompt-file"
    proc = _start(args)
    _wait_for(proc.stderr, "target:")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    [line] = _selfspec_lines(err)
    assert line.startswith("selfspec: interrupted (SIGINT); ") and "--resume" in line, err
    assert (out / "run.json").is_file()
    done = subprocess.run([sys.executable, "-m", "selfspec_cli", *args, "--resume"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "results.json").read_text())["setup"]["complete"] is True
