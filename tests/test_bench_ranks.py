"""``selfspec bench`` under ``torchrun`` (bench/ranks.py): real processes, gloo, the shipped code model.

Two ranks split the suite; rank 0 gathers and writes one results.json. Greedy decoding is the
same computation whichever process runs it, so every prompt's tokens must equal those of a
one-process run, and each pass's merged records must be in the suite's order.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_cli.bench.ranks import Ranks, merge_repeats
from selfspec_cli.decoding.output import OutputRecord

from .conftest import needs_shipped_model

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["bench", "--model", "pystdlib", "--suite", "pystdlib-mini", "--methods", "ar,pld,swift", "-n", "12",
        "--no-costs", "--no-plots", "--repeats", "2"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def records(out: Path, name: str) -> list[dict]:
    return [json.loads(ln) for ln in (out / "records" / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.slow  # torchrun, 2 ranks; fast: the share/merge and fewer-prompts tests
@needs_shipped_model
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_two_ranks_give_the_one_process_tokens(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = subprocess.run([sys.executable, "-m", "selfspec_cli", *ARGS, "-o", str(one)], capture_output=True, text=True,
                        env=env(), timeout=900)
    assert p1.returncode == 0, p1.stderr
    p2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "selfspec_cli", *ARGS, "-o", str(two)], capture_output=True, text=True, env=env(), timeout=900)
    assert p2.returncode == 0, p2.stderr
    assert len([ln for ln in p2.stdout.splitlines() if ln.startswith("{")]) == 1  # rank 0 alone prints the headline
    r1, r2 = (json.loads((d / "results.json").read_text()) for d in (one, two))
    assert r2["setup"]["ranks"] == 2 and r1["setup"]["ranks"] == 1
    assert r2["setup"]["prompts"] == r1["setup"]["prompts"] == 8
    for name in ("ar", "pld", "swift"):
        a, b = records(one, name), records(two, name)
        assert [(r["repeat"], r["id"]) for r in a] == [(r["repeat"], r["id"]) for r in b]  # suite order, pass by pass
        assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
        assert {r["rank"] for r in b} == {0, 1}
        # each prompt ran every contender on one rank: the paired ratios compare timings of one process
        assert all(r["rank"] == i % 2 for r in b for i in [[p["id"] for p in a[:8]].index(r["id"])])
        assert r2["methods"][name]["parity"]["parity"] == 1.0
    per_rank = sorted(p.relative_to(two).as_posix() for p in (two / "records").glob("rank*/*.jsonl"))
    assert set(r2["methods"]) == {"ar", "pld", "swift"}  # what --methods lists, no more
    assert per_rank == sorted(f"records/rank{r}/{n}.jsonl" for r in (0, 1) for n in r2["methods"])


@needs_shipped_model
def test_fewer_prompts_than_ranks_is_one_line(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text('{"id": "a", "prompt": "def f():"}\n', encoding="utf-8")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "selfspec_cli", "bench", "--model", "pystdlib", "-p", str(one), "--methods", "ar",
                        "--no-costs", "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode != 0
    # both ranks print their line to the one stderr at once (they may share a physical line)
    said = re.findall(r"selfspec: error: (rank \d of 2): 1 prompts for 2 torchrun ranks", p.stderr)
    assert sorted(said) == ["rank 0 of 2", "rank 1 of 2"], p.stderr


def test_shares_cover_the_suite_once_and_merge_in_order():
    items = list(range(11))
    shares = [Ranks(r, 3).share(items) for r in range(3)]
    assert sorted(x for s in shares for x in s) == items
    recs = [[[OutputRecord.from_dict({"id": x}) for x in s]] for s in shares]  # one pass per rank
    assert [r.id for r in merge_repeats(recs, items)[0]] == items


def _rank_pid(rank: int) -> int | None:
    """The pid of the bench process torchrun started as ``rank`` (from its environment)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            envs = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"selfspec_cli" in cmd and b"bench" in cmd and f"RANK={rank}".encode() in envs:
            return int(d.name)
    return None


@pytest.mark.slow  # torchrun, 2 ranks; fast: the share/merge and fewer-prompts tests
@needs_shipped_model
def test_a_dead_rank_fails_the_run_and_resume_finishes_it(tmp_path):
    """SIGKILL rank 1 once it has finished a prompt: torchrun stops rank 0, which says where its
    records are; every finished record stays; the same command with --resume completes the run
    with the one-process tokens."""
    import signal
    import time

    out = tmp_path / "out"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "selfspec_cli",
            "bench", "--model", "pystdlib", "--suite", "pystdlib-mini", "--methods", "ar,pld", "-n", "48",
            "--no-costs", "--no-plots", "--repeats", "2", "-o", str(out)]
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        deadline = time.time() + 300
        rec1 = out / "records" / "rank1" / "ar.jsonl"
        while time.time() < deadline and run.poll() is None and not (rec1.exists() and rec1.read_text().strip()):
            time.sleep(0.2)
        pid = _rank_pid(1)
        assert pid is not None and run.poll() is None, "rank 1 finished before it could be killed"
        os.kill(pid, signal.SIGKILL)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert "rank 0 of 2: records are in" in err and "the same command with --resume" in err
    assert "rank      : 1" in err  # torchrun's report names the rank that died
    kept = {r: len((out / "records" / f"rank{r}" / "ar.jsonl").read_text().splitlines()) for r in (0, 1)}
    assert kept[1] >= 1
    assert not (out / "results.json").exists() or not json.loads((out / "results.json").read_text())["setup"]["complete"]
    done = subprocess.run(argv + ["--resume"], capture_output=True, text=True, env=env(), timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["complete"] and res["setup"]["ranks"] == 2 and res["methods"]["pld"]["parity"]["parity"] == 1.0
    assert len(records(out, "ar")) == 16  # 8 prompts x 2 passes, the kept ones included
