"""Self-SD calibration by many processes on one Optuna study (methods/self_sd/study.py).

Real processes (``python -m selfspec_cli calibrate`` in subprocesses), real storages (an
SQLite file, an Optuna journal file), a real SIGKILL. What must hold: the study ends with
exactly the trials asked for, no two complete trials share their parameters, a worker
killed mid-trial loses nothing (its trial is run again), and one process writes the artifact.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from selfspec_cli.methods.self_sd.study import CLAIMED, check_slot, finished_last, open_storage

from .test_calibrate import PROMPTS, calib_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("".join(x + "\n" for x in PROMPTS), encoding="utf-8")
    return p


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "selfspec_cli", *argv]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def load(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="self-sd", storage=open_storage(storage, 1))


def states(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def assert_exact(study: optuna.Study, n: int) -> list[optuna.trial.FrozenTrial]:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    assert len(done) == n, states(study)
    params = [tuple(sorted(t.params.items())) for t in done]
    assert len(set(params)) == len(params), "two complete trials share their parameters"
    assert not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return done


@pytest.mark.slow  # worker processes; fast: the pruning, one-writer and option tests
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_local_workers_finish_exactly_n_trials(kind, tiny_model_dir, prompt_file, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'study.journal'}"
    out = tmp_path / "skip.json"
    n = 16
    args = calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", str(n), "--storage", storage,
                      "--heartbeat", "1", "--output", str(out), "--max-new-tokens", "48", "--repeats", "2")
    proc = subprocess.run(cli(*args, "--workers", "2"),
                          capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["writer"] is True and summary["artifact"] == str(out) and summary["trials"] == n
    done = assert_exact(load(storage), n)
    assert len({t.user_attrs["worker"] for t in done}) == 1  # one command: one worker name
    assert {t.user_attrs["worker_index"] for t in done} == {0, 1}, proc.stderr  # both processes ran trials
    manifest = json.loads(out.read_text())
    assert manifest["trials"] == n and manifest["kind"] == "self-sd-layers"
    kept = load(storage).user_attrs["verify_curve"]  # the proxy's v(k), measured once for every worker
    assert set(kept) == {"t1_s", "ratios"} and kept["ratios"]["1"] == 1.0
    # a second run on the finished study runs nothing and rewrites the artifact from it
    again = subprocess.run(cli(*args, "--force"),
                           capture_output=True, text=True, env=env(), timeout=600)
    assert again.returncode == 0, again.stderr
    s2 = json.loads(again.stdout.strip().splitlines()[-1])
    assert s2["writer"] is True and s2["new_trials"] == 0 and s2["skip_attn"] == summary["skip_attn"]
    assert load(storage).user_attrs["verify_curve"] == kept  # a later run reads it, never measures it again


@pytest.mark.slow  # worker processes; fast: the pruning, one-writer and option tests
def test_a_worker_killed_mid_trial_loses_nothing(tiny_model_dir, prompt_file, tmp_path):
    """``--workers 2`` on a journal file; the helper process is SIGKILLed while a trial of its own
    runs (stopped first and checked: a kill that lands between two trials kills none). The first
    process fails the stale trial by its heartbeat, runs its copy, and the study ends with exactly
    N complete trials and the artifact written."""
    storage = f"journal:{tmp_path / 'study.journal'}"
    n = 16
    argv = cli(*calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", str(n), "--storage", storage,
                           "--heartbeat", "1", "--output", str(tmp_path / "skip.json"), "--max-new-tokens", "48",
                           "--repeats", "2", "--workers", "2"))
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    killed = None
    try:
        deadline = time.time() + 300
        while killed is None and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
            if not (tmp_path / "study.journal").exists():
                continue
            running = [t for t in load(storage).get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                       if t.user_attrs.get("worker_index") == 1]
            # stop the helper, then kill it only if that trial is still running: under load, it may
            # have finished between the read and the signal (its pid is written just after its index)
            pid = running[0].user_attrs.get("pid") if running else None
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                if running[0].number in {t.number for t in load(storage).get_trials(
                        deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}:
                    killed = running[0].number
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # the helper ended meanwhile
                pass
            finally:
                if killed is None:  # never leave it stopped
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
        assert killed is not None, "the helper never ran a trial"
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert "worker 1 ended with exit status -9" in err
    study = load(storage)
    done = assert_exact(study, n)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert trials[killed].state == optuna.trial.TrialState.FAIL  # failed by the survivor's heartbeat check
    retried = [t for t in done if t.system_attrs.get("failed_trial") == killed]
    assert len(retried) == 1 and retried[0].params == trials[killed].params  # its copy ran to completion
    assert retried[0].user_attrs["worker_index"] == 0
    assert json.loads(out.strip().splitlines()[-1])["writer"] is True


def test_surplus_and_duplicate_trials_are_pruned(tmp_path):
    """The rule behind "exactly N": a started trial runs only while the complete trials and the
    running ones numbered before it make fewer than N; one with the parameters of a complete or
    earlier running trial does not run."""
    storage = open_storage(f"journal:{tmp_path / 's.journal'}", 1)
    study = optuna.create_study(study_name="self-sd", storage=storage)
    dist = optuna.distributions.IntDistribution(0, 10)

    def start(x: int) -> optuna.Trial:
        study.enqueue_trial({"x": x})
        return study.ask({"x": dist})

    def claim(t: optuna.Trial) -> optuna.Trial:  # what the objective does once every parameter is suggested
        t.set_user_attr(CLAIMED, True)
        return t

    a, b = claim(start(1)), claim(start(2))
    assert check_slot(study, b, n_trials=2) is None  # a (running, before b) and b make 2
    assert check_slot(study, b, n_trials=1) == "surplus"
    assert check_slot(study, a, n_trials=1) is None  # a is first: b does not count against it
    c = start(1)  # the parameters of a, still arriving (not claimed): a does not give way to it
    assert check_slot(study, a, n_trials=10) is None
    claim(c)
    assert check_slot(study, c, n_trials=10) == "duplicate"  # a claimed them
    # the race two workers met: f checked while e's parameters were still partial, and runs; e, numbered
    # before f, claims and checks afterwards and must give way (the old rule let both run)
    e, f = start(3), claim(start(3))
    assert check_slot(study, f, n_trials=10) is None
    assert check_slot(study, claim(e), n_trials=10) == "duplicate"
    for t in (c, e, f):
        study.tell(t, state=optuna.trial.TrialState.PRUNED)
    study.tell(a, 1.0)
    assert check_slot(study, b, n_trials=1) == "surplus"  # a complete trial always counts
    study.tell(b, 2.0)
    d = start(2)
    assert check_slot(study, d, n_trials=10) == "duplicate"  # of a complete trial


def test_throughput_study_refuses_another_machine(tmp_path, monkeypatch):
    from selfspec_cli.methods.self_sd import study as study_mod
    from selfspec_cli.methods.self_sd.search import SearchConfig
    from selfspec_cli.errors import ConfigError

    search = SearchConfig(study_path=tmp_path / "t.db", objective="throughput")
    s, storage = study_mod.open_study(search, optuna.samplers.RandomSampler(0), {"kind": "x"})
    assert s.user_attrs["machine"] == study_mod.machine_id()
    monkeypatch.setattr(study_mod, "machine_id", lambda: "elsewhere (another CPU)")
    with pytest.raises(ConfigError, match="timed on .* not on this machine"):
        study_mod.open_study(search, optuna.samplers.RandomSampler(0), {"kind": "x"})
    # the proxy objective is the same on every machine: no refusal
    proxy = SearchConfig(study_path=tmp_path / "p.db", objective="proxy")
    study_mod.open_study(proxy, optuna.samplers.RandomSampler(0), {"kind": "x"})
    study_mod.open_study(proxy, optuna.samplers.RandomSampler(0), {"kind": "x"})


def test_finished_last_names_one_writer(tmp_path):
    from datetime import datetime, timedelta

    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}", 1)
    study = optuna.create_study(study_name="self-sd", storage=storage)
    before = datetime.now() - timedelta(hours=1)
    for i, who in enumerate(["A", "B", "A", "B"]):
        t = study.ask({"x": optuna.distributions.IntDistribution(0, 10)})
        t.set_user_attr("worker", who)
        study.tell(t, float(i))
    assert finished_last(study, "B", before) and not finished_last(study, "A", before)
    assert not finished_last(study, "C", before)  # joined before the end and ran nothing
    assert finished_last(study, "C", datetime.now() + timedelta(seconds=1))  # re-opened a finished study


def test_bad_storage_and_worker_options_get_one_line(tiny_model_dir, prompt_file, tmp_path):
    from .test_calibrate import user_error

    base = calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "2", "--output", str(tmp_path / "o.json"))
    user_error([*base, "--storage", "redis://host/0"], "neither a database URL", "journal")
    user_error([*base, "--storage", "postgresql://u:secret@nohost.invalid/db"], "--storage")
    user_error([*base, "--workers", "0"], "--workers must be >= 1")
    user_error([*base, "--storage", f"journal:{tmp_path / 'j.journal'}", "--study-path", str(tmp_path / "s.db")],
               "pass one of them")
    user_error(["calibrate", "--method", "specee", "--model", str(tiny_model_dir), "--prompt-file", str(prompt_file),
                "--workers", "2"], "is an option of --method self-sd")
    rc_line = user_error([*base, "--storage", "postgresql://u:secret@nohost.invalid/db"])
    assert "secret" not in rc_line  # a password in a URL is not printed
