"""Issue 14, "reliability as a new user meets it": inputs and artifacts are never destroyed,
bad values are one-line errors, threads, SIGTERM, prompt formats, method options.

Uses the session fixture ``tiny_model_dir`` (a saved tiny Llama + tokenizer); every test
runs under its own temporary ``SELFSPEC_HOME`` (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfspec_cli import artifacts, loading
from selfspec_cli.artifacts import save_json_artifact
from selfspec_cli.cli.app import main
from selfspec_cli.engine import kernels
from selfspec_cli.methods.self_sd import SKIP_SET
from selfspec_cli.session import default_threads

from .test_cli import PROMPTS, assert_user_error, gen_args, run_generate, write_jsonl, write_lines

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    return write_lines(tmp_path / "prompts.txt", PROMPTS)


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    """A stand-in for the shipped artifacts tree (the real one is never written by tests)."""
    d = tmp_path / "shipped-artifacts"
    d.mkdir()
    monkeypatch.setattr(loading, "ARTIFACTS_DIR", d)
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- 1. no input is ever destroyed


def test_output_that_is_the_prompt_file_is_refused(capsys, tiny_model_dir, tmp_path):
    src = tmp_path / "s.jsonl"
    write_jsonl(src, [{"prompt": p} for p in PROMPTS])
    before = src.read_bytes()
    for out in (str(src), str(tmp_path / "." / "s.jsonl")):
        for extra in ((), ("--force",), ("--append",)):
            assert_user_error(capsys, gen_args(tiny_model_dir, src, "-n", "2", "-o", out, *extra),
                              "is the input file", "destroy")
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    assert_user_error(capsys, gen_args(tiny_model_dir, src, "-n", "2", "-o", str(link), "--force"), "is the input file")
    assert src.read_bytes() == before


def test_existing_output_needs_force_or_append(capsys, tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "-n", "2", "-o", str(out)),
                      "already exists", "--force", "--append")
    assert out.read_text() == "precious\n"
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "-n", "2", "-o", str(out), "--force", "--append"),
                      "--force", "--append")
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "2", "-o", str(out), "--append")) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "precious" and [json.loads(x)["id"] for x in lines[1:]] == [1, 2, 3, 4]
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "2", "-o", str(out), "--force")) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [1, 2, 3, 4]
    assert list(tmp_path.glob("*.partial")) == []  # the partial file became the output


def test_forced_output_is_replaced_only_when_the_run_finishes(capsys, monkeypatch, tiny_model_dir, prompt_file, tmp_path):
    import importlib

    gen_mod = importlib.import_module("selfspec_cli.methods.application")  # where generate's records are decoded
    real, calls = gen_mod.run_prompt, {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(gen_mod, "run_prompt", crashing)
    out = tmp_path / "out.jsonl"
    out.write_text("old run\n")
    capsys.readouterr()
    with pytest.raises(RuntimeError):
        main(gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", str(out), "--force"))
    err = capsys.readouterr().err
    assert out.read_text() == "old run\n"  # untouched
    (partial,) = tmp_path.glob("out.jsonl.*.partial")
    assert str(partial) in err and "1 finished record" in err
    assert [json.loads(x)["id"] for x in partial.read_text().splitlines()] == [1]


# ---------------------------------------------------------------- 2, 3. artifacts are never replaced silently


def test_error_advice_never_names_an_existing_or_shipped_path(capsys, tiny_model_dir, prompt_file, tmp_path, shipped):
    from .conftest import make_tiny_model

    other = make_tiny_model("llama-gqa", seed=5)
    other_fp = loading.model_fingerprint(other)
    # "the code model's artifact", shipped, passed to another model
    skip = shipped / "self-sd" / "code-model.json"
    save_json_artifact(skip, {"kind": "self-sd-layers", "model_fingerprint": other_fp, "skip_attn": [], "skip_mlp": []})
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "self-sd", "--layers", str(skip)),
                            "made for another model", "selfspec calibrate --method self-sd")
    assert f"--output {skip}" not in msg and "--output" not in msg
    # heads: the specee folder passed as --heads
    exit_dir = shipped / "specee" / "code-model"
    artifacts.save_tensors_artifact(exit_dir, {}, {"kind": "specee-exit-mlp", "model_fingerprint": other_fp, "layers": []})
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "adadecode", "--heads", str(exit_dir)),
                            "selfspec train-heads --kind lm-heads")
    assert "--output" not in msg
    # a path that does not exist yet, outside the shipped tree, is fine to suggest
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "self-sd", "--layers",
                                             str(tmp_path / "new.json")), "does not exist")
    assert f"--output {tmp_path / 'new.json'}" in msg


def test_calibrate_writes_the_user_directory_and_never_replaces_silently(tiny_model_dir, prompt_file, shipped,
                                                                         selfspec_home):
    from .test_calibrate import run_cli, run_ok, user_error

    name = tiny_model_dir.name
    save_json_artifact(shipped / "self-sd" / f"{name}.json", {"kind": "self-sd-layers", "note": "committed"})
    before = _tree(shipped)
    args = ["calibrate", "--method", "self-sd", "--model", str(tiny_model_dir), "--device", "cpu", "-n", "4",
            "--prompt-file", str(prompt_file), "--trials", "1", "--repeats", "1"]
    summary = run_ok(args)
    art = Path(summary["artifact"])
    assert art.parent == selfspec_home / "artifacts" / "self-sd" and art.name.startswith(f"{name}-")
    assert summary["model_fingerprint"] in art.name
    assert _tree(shipped) == before  # the shipped artifact is untouched
    # one trial on a tiny random model is slower than ar: kept beside the default, not made it
    assert summary["below_ar"] and art.name.endswith(".below-ar.json")
    # it loads by name ...
    gen = ["generate", "-m", str(tiny_model_dir), "-p", str(prompt_file), "-n", "3", "--device", "cpu", "--method", "self-sd",
           "--layers", str(art)]
    rc, out, err = run_cli(gen)
    assert rc == 0, err
    # ... and the same command again resumes the study and replaces that result, its own (new-user finding 7),
    # while a file the user named is never replaced without --force
    again = run_ok(args)
    assert again["artifact"] == str(art) and again["trials"] == summary["trials"] and again["new_trials"] == 0
    mine = selfspec_home / "mine.json"
    run_ok([*args, "--output", str(mine)])
    first = mine.read_text()
    user_error([*args, "--output", str(mine)], "already exists", "--force")
    assert mine.read_text() == first
    # the shipped tree is never a write target without --force
    user_error([*args, "--output", str(shipped / "self-sd" / "mine.json")], "shipped artifacts", "read-only")
    assert _tree(shipped) == before


def test_specee_reports_every_missing_artifact_at_once(capsys, tiny_model_dir, prompt_file, shipped):
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "specee"),
                            "specee needs 3 artifacts", "(1)", "(2)", "(3)", "selfspec train-heads --kind lm-heads",
                            "selfspec train-heads --kind exit-mlp", "selfspec calibrate --method specee")
    assert msg.index("lm-heads") < msg.index("exit-mlp") < msg.index("calibrate --method specee")
    assert str(shipped) in msg and os.environ["SELFSPEC_HOME"] in msg  # both places looked


def test_model_dot_is_named_after_the_directory(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tiny_model_dir)
    assert artifacts.sanitized_model_name(".") == tiny_model_dir.name
    assert artifacts.sanitized_model_name("./") == tiny_model_dir.name
    model, _ = loading.load_model(".", device="cpu")
    assert SKIP_SET.default_path(model).name.startswith(f"{tiny_model_dir.name}-")


# ---------------------------------------------------------------- 4, 7, 8. input values


@pytest.mark.parametrize("record", [{"prompt": ""}, {"prompt": "   "}, {"turns": ["", "x"]}, {"turns": ["x", ""]}])
def test_empty_prompt_is_one_line_error(capsys, tiny_model_dir, tmp_path, record):
    f = write_jsonl(tmp_path / "pe.jsonl", [{"prompt": "import os"}, record])
    assert_user_error(capsys, gen_args(tiny_model_dir, f, "-n", "4"), "line 2", "empty")


def test_prompt_format_forces_plain_text(capsys, tiny_model_dir, tmp_path):
    f = write_lines(tmp_path / "code.txt", ["{a: 1 for a in range(3)}", "import os"])
    assert_user_error(capsys, gen_args(tiny_model_dir, f, "-n", "2"), "line 1", "not valid JSON", "--prompt-format text")
    recs = run_generate(capsys, tiny_model_dir, f, "-n", "2", "--prompt-format", "text")
    assert [r["id"] for r in recs] == [1, 2]
    j = write_jsonl(tmp_path / "p.data", [{"prompt": "import os"}])
    assert [r["id"] for r in run_generate(capsys, tiny_model_dir, j, "-n", "2", "--prompt-format", "jsonl")] == [1]
    assert_user_error(capsys, gen_args(tiny_model_dir, f, "--prompt-format", "yaml"), "--prompt-format", "yaml")


@pytest.mark.parametrize("args,fragment", [
    (("-t", "nan"), "--temperature"), (("-t", "inf"), "--temperature"), (("-t", "-inf"), "--temperature"),
    (("--top-p", "nan"), "--top-p"), (("--top-p", "-0.5"), "--top-p"), (("--stop", ""), "--stop"),
])
def test_bad_sampling_values_are_one_line_errors(capsys, tiny_model_dir, prompt_file, args, fragment):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, *args), fragment)


# ---------------------------------------------------------------- 11. options of other methods


@pytest.mark.parametrize("method,args,flag", [
    ("ar", ("--layers", "broken.json"), "--layers"),
    ("ar", ("--asd-m", "3"), "--asd-m"),
    ("asd", ("--heads", "x"), "--heads"),
    ("self-sd", ("--tree-nodes", "4"), "--tree-nodes"),
    ("adadecode", ("--specee-eval",), "--specee-eval"),
    ("ar", ("--save-layers", "x.json"), "--save-layers"),
])
def test_options_of_other_methods_are_refused(capsys, tiny_model_dir, prompt_file, method, args, flag):
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", method, *args), flag)
    assert f"not of '{method}'" in msg


def test_options_of_the_chosen_method_are_accepted(capsys, tiny_model_dir, prompt_file):
    recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "3", "--method", "self-sd", "--skip-attn", "1",
                        "--max-draft", "2")
    assert len(recs) == len(PROMPTS)


def test_bench_refuses_peer_options_without_the_peer(capsys, tiny_model_dir, prompt_file, tmp_path):
    assert_user_error(capsys, ["bench", "-m", str(tiny_model_dir), "-p", str(prompt_file), "--methods", "ar",
                               "--early-exit-layer", "1", "-o", str(tmp_path / "b")], "--early-exit-layer", "hf-early-exit")


def test_bench_refuses_then_clears_only_its_own_stale_files(capsys, tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "bench-out"
    (out / "records").mkdir(parents=True)
    (out / "records" / "old-method.jsonl").write_text("{}\n")
    (out / "results.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    argv = ["bench", "-m", str(tiny_model_dir), "-p", str(prompt_file), "--methods", "ar", "-n", "3", "--warmup", "0",
            "--no-plots", "--device", "cpu", "-o", str(out)]
    assert_user_error(capsys, argv, "earlier bench run", "--force", "records/old-method.jsonl")
    assert (out / "records" / "old-method.jsonl").exists()
    capsys.readouterr()
    assert main([*argv, "--force"]) == 0, capsys.readouterr().err
    assert not (out / "records" / "old-method.jsonl").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "records").iterdir()) == ["ar.jsonl"]
    env = json.loads((out / "results.json").read_text())["environment"]
    assert env["threads"] == env["pool_threads"] == default_threads() and env["cores"]["usable"] == default_threads()


def test_calibrate_help_says_prompts_are_required(capsys):
    assert main(["calibrate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # rich wraps help in a box
    assert "One of --prompt-file and --dataset is required" in text


# ---------------------------------------------------------------- 5. threads


@pytest.mark.parametrize("command", ["generate", "calibrate", "train-heads", "bench"])
def test_every_subcommand_has_threads(capsys, command):
    assert main([command, "--help"]) == 0
    assert "--threads" in capsys.readouterr().out


def test_threads_are_applied_and_recorded(capsys, tiny_model_dir, prompt_file):
    import torch

    saved = torch.get_num_threads()
    try:
        n = default_threads()  # the physical cores this process may use
        recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "2")
        assert {r["threads"] for r in recs} == {n} and torch.get_num_threads() == n == kernels.pool_threads()
        recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "2", "--threads", "1")
        assert {r["threads"] for r in recs} == {1} and torch.get_num_threads() == 1 == kernels.pool_threads()
        assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--threads", "0"), "--threads")
    finally:
        torch.set_num_threads(saved)
    env = artifacts.environment_info()
    assert {"threads", "interop_threads", "omp_wait_policy"} <= set(env)


def test_omp_wait_policy_is_passive_before_torch_loads():
    """The command line sets PASSIVE before torch loads; importing the package sets nothing (issue 36)."""
    code = ("import os, sys; import selfspec_cli; assert 'OMP_WAIT_POLICY' not in os.environ; "
            "from selfspec_cli.cli.entry import set_wait_policy; set_wait_policy(sys.argv[1:]); "
            "assert 'torch' not in sys.modules; import torch; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)

    def policy(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert policy("generate") == "PASSIVE None"
    assert policy("generate", "--threads", "auto") == "None 10000"  # auto's waiting threads spin briefly
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # an explicit choice wins (the first assert of the code is then skipped)
    code = code.replace("assert 'OMP_WAIT_POLICY' not in os.environ; ", "")
    assert policy("generate", "--threads", "auto") == "ACTIVE None"


# ---------------------------------------------------------------- 10. SIGTERM


def test_sigterm_keeps_finished_records_and_exits_143(tiny_model_dir, tmp_path):
    prompts = write_lines(tmp_path / "many.txt", PROMPTS * 25)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "selfspec_cli", "generate", "-m", str(tiny_model_dir), "-p", str(prompts),
                             "-n", "48", "--device", "cpu", "--method", "ar", "-o", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            parts = list(tmp_path.glob("out.jsonl.*.partial"))
            if parts and parts[0].read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("selfspec:")]
    assert len(lines) == 1 and lines[0].startswith("selfspec: terminated (SIGTERM)"), err
    assert not out.exists()
    (partial,) = tmp_path.glob("out.jsonl.*.partial")
    assert str(partial) in lines[0]
    recs = [json.loads(x) for x in partial.read_text().splitlines()]
    assert len(recs) >= 2 and [r["id"] for r in recs] == list(range(1, len(recs) + 1))
