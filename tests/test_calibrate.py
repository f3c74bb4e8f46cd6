"""``selfspec calibrate --method self-sd`` and the artifact format.

Real components throughout: the session fixture ``tiny_model_dir`` (a saved 4-layer
tiny Llama + tokenizer), real Optuna studies in real SQLite files, real
``datasets`` loading of a local JSONL file, real safetensors files. Trials decode
8 tokens per prompt, so the whole module takes seconds on one thread.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_cli.engine import kernels
import torch

from selfspec_cli import artifacts, loading
from selfspec_cli.artifacts import load_tensors_artifact, save_json_artifact, save_tensors_artifact
from selfspec_cli.methods.self_sd import SKIP_SET, SkipSet
from selfspec_cli.prompts import prompts_from_dataset
from selfspec_cli.methods.self_sd.study import seed_points, uniform_layers
from selfspec_cli.cli.app import main
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ArtifactError
from selfspec_cli.loading import load_model, model_fingerprint
from selfspec_cli.methods import AR
from selfspec_cli.methods.self_sd import SelfSD

from .conftest import make_tiny_model

PROMPTS = ["def run_prompt(tokenizer, prompt):", "import torch", "return the record for every turn", "class PreparedPrompt:"]
MANIFEST_KEYS = {"kind", "format_version", "model_fingerprint", "model_name_or_path", "num_layers", "skip_attn",
                 "skip_mlp", "objective", "trials", "search", "environment", "created"}


# ---------------------------------------------------------------- helpers


def calib_args(model: Path, *extra: str) -> list[str]:
    """A Self-SD calibration over the target's own weights only (the paper's search space), unless
    ``extra`` names another --draft-precision (test_joint_precision_search)."""
    precision = [] if "--draft-precision" in extra else ["--draft-precision", "target"]
    return ["calibrate", "--method", "self-sd", "--model", str(model), "--device", "cpu", "--max-new-tokens", "8",
            *precision, *extra]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_ok(argv: list[str]) -> dict:
    rc, out, err = run_cli(argv)
    assert rc == 0, err
    assert "Traceback" not in err
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out  # one JSON line on stdout, everything else on stderr
    return json.loads(lines[0])


def user_error(argv: list[str], *fragments: str) -> str:
    rc, out, err = run_cli(argv)
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("selfspec: error:"), err
    assert sum(ln.startswith("selfspec: error:") for ln in lines) == 1, err
    for frag in fragments:
        assert frag in lines[-1], (frag, lines[-1])
    return lines[-1]


def complete_trials(db: Path) -> int:
    """COMPLETE trials, read straight from the SQLite file (no Optuna in the loop)."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        return con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]


def no_temp_files(directory: Path) -> None:
    left = [p.name for p in directory.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    assert left == [], left


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("".join(x + "\n" for x in PROMPTS), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    return model, tok


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tiny_model_dir, prompt_file) -> tuple[Path, dict]:
    """One 4-trial calibration (artifact + study), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("calib") / "out" / "tiny.json"  # parent is created by the command
    summary = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "4", "--output", str(out)))
    return out, summary


# ---------------------------------------------------------------- calibrate: the artifact


def test_calibrate_writes_artifact(calibrated, tiny_model):
    out, summary = calibrated
    model, _ = tiny_model
    man = json.loads(out.read_text())
    assert MANIFEST_KEYS <= set(man)
    assert man["kind"] == "self-sd-layers"
    assert man["model_fingerprint"] == model_fingerprint(model) == summary["model_fingerprint"]
    assert man["num_layers"] == 4 and man["trials"] == 4
    for key in ("skip_attn", "skip_mlp"):
        assert man[key] == sorted(set(man[key])) and all(0 <= i < 4 for i in man[key])
        assert summary[key] == man[key]
    obj = man["objective"]
    assert obj["unit"] == "x ar" and obj["value"] > 0 and "proxy" in obj["name"]  # the default objective
    assert summary["objective"] == obj["value"]
    # the uniform baseline and plain decoding, re-measured in the same run
    assert obj["baseline"]["name"].startswith("uniform-")
    assert set(obj["confirm"]) == {"ar", "best", "uniform-0.3", "uniform-0.45"}
    assert all(v["tokens_per_s"] > 0 and v["tokens"] > 0 for v in obj["confirm"].values())
    assert obj["confirm"]["ar"]["mean_accepted_length"] == 1.0
    assert summary["baseline"]["confirm"] > 0 and summary["speedup_vs_ar"] > 0
    # lossless: every decoder produced the same number of tokens
    assert len({v["tokens"] for v in obj["confirm"].values()}) == 1
    s = man["search"]
    assert s["sampler"] == "tpe" and s["seed"] == 0 and s["max_new_tokens"] == 8
    assert s["target_precision"] == "fp32"  # random float32 weights: no bf16, fp16 or block target holds them
    assert s["prompts"]["num_prompts"] == len(PROMPTS)
    assert Path(s["study_path"]) == out.with_name("tiny.optuna.db")
    assert [p["name"] for p in s["seed_points"]] == ["uniform-0.3", "uniform-0.45"]
    env = man["environment"]
    assert {"torch", "transformers", "python", "device", "dtype", "threads", "cpu"} <= set(env)
    assert env["device"] == "cpu" and env["dtype"] == "float32"
    assert man["created"].endswith("+00:00")
    assert summary["artifact"] == str(out) and summary["trials"] == 4 and summary["new_trials"] == 4
    no_temp_files(out.parent)


def test_study_is_sqlite_with_trial_statistics(calibrated):
    import optuna

    out, _ = calibrated
    db = out.with_name("tiny.optuna.db")
    assert db.read_bytes()[:16] == b"SQLite format 3\x00"
    assert complete_trials(db) == 4
    study = optuna.load_study(study_name="self-sd", storage=f"sqlite:///{db}")
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    # 2L = 8 binary parameters; the uniform starting points ran first
    assert all(sorted(t.params) == sorted([f"attn_{i}" for i in range(4)] + [f"mlp_{i}" for i in range(4)]) for t in trials)
    assert [t.user_attrs.get("seed_point") for t in trials[:2]] == ["uniform-0.3", "uniform-0.45"]
    for t in trials:
        assert t.value > 0
        assert t.user_attrs["mean_accepted_length"] >= 1.0
        assert "acceptance_rate" in t.user_attrs and "skip_ratio" in t.user_attrs


def test_resume_runs_only_the_remaining_trials(calibrated, tiny_model_dir, prompt_file, tmp_path):
    out, _ = calibrated
    db = tmp_path / "copy.optuna.db"
    shutil.copy(out.with_name("tiny.optuna.db"), db)
    new_out = tmp_path / "resumed.json"
    summary = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "6",
                                "--study-path", str(db), "--output", str(new_out)))
    assert summary["trials"] == 6 and summary["new_trials"] == 2
    assert complete_trials(db) == 6
    assert json.loads(new_out.read_text())["trials"] == 6
    # the artifact exists now: replacing it needs --force (checked before any trial runs)
    before = new_out.read_text()
    user_error(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "5",
                          "--study-path", str(db), "--output", str(new_out)), "already exists", "--force")
    assert new_out.read_text() == before
    # nothing left to run: no new trials, the artifact is rewritten from the study
    again = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "5",
                              "--study-path", str(db), "--output", str(new_out), "--force"))
    assert again["new_trials"] == 0 and again["trials"] == 6 and complete_trials(db) == 6


def test_resume_refuses_another_setup(calibrated, tiny_model_dir, prompt_file, tmp_path):
    out, _ = calibrated
    db = tmp_path / "copy.optuna.db"
    shutil.copy(out.with_name("tiny.optuna.db"), db)
    args = ["--prompt-file", str(prompt_file), "--trials", "6", "--study-path", str(db), "--output", str(tmp_path / "x.json")]
    argv = calib_args(tiny_model_dir, *args)
    argv[argv.index("--max-new-tokens") + 1] = "9"
    user_error(argv, "max_new_tokens", "--study-path")
    assert complete_trials(db) == 4
    if kernels.load_extension() is not None:  # the verify curve and draft costs are the target's: another target
        user_error([*calib_args(tiny_model_dir, *args), "--target-precision", "bf16"], "target_precision", "fp32 then")
    # a study made before the setup held the target precision resumes as before
    import optuna

    from selfspec_cli.methods.self_sd.study import STUDY_NAME, sqlite_url
    study = optuna.load_study(study_name=STUDY_NAME, storage=sqlite_url(db))
    study.set_user_attr("setup", {k: v for k, v in study.user_attrs["setup"].items() if k != "target_precision"})
    assert main(calib_args(tiny_model_dir, *args)) == 0 and complete_trials(db) == 6


def test_interrupt_keeps_finished_trials(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    import selfspec_cli.methods.self_sd.measure as mod

    real, calls = mod.measure_self_sd, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # warm-up, trial 0, trial 1, then Ctrl-C during trial 2
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "measure_self_sd", flaky)
    db, out = tmp_path / "s.db", tmp_path / "a.json"
    argv = calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "3", "--study-path", str(db), "--output", str(out))
    rc, stdout, err = run_cli(argv)
    assert rc == 130 and "Traceback" not in err
    assert "2 finished trials are saved" in err and "resume" in err
    assert complete_trials(db) == 2 and not out.exists()
    monkeypatch.setattr(mod, "measure_self_sd", real)
    summary = run_ok(argv)
    assert summary["new_trials"] == 1 and summary["trials"] == 3 and complete_trials(db) == 3


def test_ctrl_c_during_bookkeeping_is_deferred(tiny_model, tmp_path):
    """A SIGINT outside a decode (here: in the progress callback, as it could land in
    Optuna's SQLite writes) is raised only after the trial is saved, and the default
    handler is restored."""
    import signal

    from selfspec_cli.prompts import prompts_digest
    from selfspec_cli.methods.self_sd.measure import Candidates
    from selfspec_cli.methods.self_sd.search import SearchConfig
    from selfspec_cli.methods.self_sd.study import calibrate_self_sd

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    model, tok = tiny_model
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    cfg = GenerationConfig(max_new_tokens=4)
    db = tmp_path / "s.db"

    def on_trial(r):
        if r.done == 2:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        eng = Engine(model)
        calibrate_self_sd(eng, len(ids), cfg, SearchConfig(study_path=db, n_trials=5), Candidates(eng, tok, ids, cfg, ["target"]),
                          fingerprint="f", prompts_sha=prompts_digest(ids), on_trial=on_trial)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("SELECT state, count(*) FROM trials GROUP BY state").fetchall() == [("COMPLETE", 2)]


def test_the_search_decodes_only_through_its_scorer(tiny_model):
    """study.py runs the search over whatever Scorer it is handed (the offline step passes measure.Candidates) and
    imports no decoder, so a calibration never goes back from the search into the measuring module; Candidates
    refuse a sampling configuration before anything is decoded."""
    import ast

    from selfspec_cli.config import SamplingConfig
    from selfspec_cli.errors import ConfigError
    from selfspec_cli.methods.self_sd import study
    from selfspec_cli.methods.self_sd.measure import Candidates

    tree = ast.parse(Path(study.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert "measure" not in imported and not any(m and m.startswith(("ar", "decoding")) for m in imported)
    model, tok = tiny_model
    sampling = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0.7))
    with pytest.raises(ConfigError, match="greedily"):
        Candidates(Engine(model), tok, [tok(PROMPTS[0])["input_ids"]], sampling, ["target"])


# ---------------------------------------------------------------- loading skip sets


def test_load_skip_artifact_same_model(calibrated, tiny_model):
    out, summary = calibrated
    model, tok = tiny_model
    s = SkipSet.load(out, model)
    attn, mlp, man = s.attn, s.mlp, s.manifest
    assert attn == frozenset(summary["skip_attn"]) and mlp == frozenset(summary["skip_mlp"])
    assert man["kind"] == "self-sd-layers"
    eng = Engine(model)
    ids = tok(PROMPTS[0])["input_ids"]
    cfg = GenerationConfig(max_new_tokens=12)
    assert SelfSD(eng, tok, skip=SkipSet(attn, mlp)).generate(ids, cfg).token_ids == AR(eng, tok).generate(ids, cfg).token_ids


def test_load_skip_artifact_other_model(calibrated, tiny_tokenizer, tmp_path, tiny_model, tiny_model_dir):
    out, _ = calibrated
    other_dir = tmp_path / "other-tiny"
    make_tiny_model("llama-gqa", seed=1).save_pretrained(other_dir)
    tiny_tokenizer.save_pretrained(other_dir)
    other, _ = load_model(str(other_dir), dtype="float32", device="cpu")
    fp_other, fp_ours = model_fingerprint(other), model_fingerprint(tiny_model[0])
    assert fp_other != fp_ours
    with pytest.raises(ArtifactError) as ei:
        SkipSet.load(out, other)
    msg = str(ei.value)
    assert "made for another model" in msg and fp_ours in msg and fp_other in msg
    assert "selfspec calibrate --method self-sd --model" in msg and str(other_dir) in msg
    assert "\n" not in msg
    # the same checkpoint in another dtype is the same model: the artifact loads
    bf16, _ = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    assert model_fingerprint(bf16) == fp_ours
    SkipSet.load(out, bf16)


def test_missing_artifact_names_the_command(tiny_model, tmp_path, monkeypatch):
    model, _ = tiny_model
    with pytest.raises(ArtifactError) as ei:
        SkipSet.load(tmp_path / "nope.json", model)
    msg = str(ei.value)
    assert "does not exist" in msg and "nope.json" in msg
    assert "selfspec calibrate --method self-sd --model" in msg and f"--output {tmp_path / 'nope.json'}" in msg
    # the default location: the user's data directory, named with the model's name and fingerprint
    home = Path(os.environ["SELFSPEC_HOME"])
    expected = home / "artifacts" / "self-sd" / f"{Path(model.config.name_or_path).name}-{model_fingerprint(model)}.json"
    assert SKIP_SET.default_path(model) == expected
    monkeypatch.setattr(loading, "ARTIFACTS_DIR", tmp_path / "arts")
    shipped = tmp_path / "arts" / "self-sd" / f"{Path(model.config.name_or_path).name}.json"
    with pytest.raises(ArtifactError) as ei:
        SkipSet.load(None, model)
    msg = str(ei.value)
    assert str(expected) in msg and str(shipped) in msg and "--output" not in msg  # both places looked, in order
    assert msg.index(str(expected)) < msg.index(str(shipped))


def test_default_path_names():
    root = Path(loading.ARTIFACTS_DIR) / "self-sd"
    assert artifacts.shipped_artifact_path("self-sd", "meta-llama/Llama-3.2-1B", ".json") == root / "meta-llama--Llama-3.2-1B.json"
    assert artifacts.shipped_artifact_path("self-sd", "Qwen2-0.5B", ".json") == root / "Qwen2-0.5B.json"
    assert artifacts.shipped_artifact_path("self-sd", "/some/where/my model/", ".json") == root / "my_model.json"
    assert artifacts.shipped_artifact_path("self-sd", "./rel/dir", ".json") == root / "dir.json"


def test_bad_artifacts(tiny_model, tmp_path):
    model, _ = tiny_model
    fp = model_fingerprint(model)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON.*selfspec calibrate"):
        SkipSet.load(bad, model)
    save_json_artifact(bad, {"kind": "specee-heads", "model_fingerprint": fp})
    with pytest.raises(ArtifactError, match="'specee-heads' artifact, not a Self-SD skip-set artifact"):
        SkipSet.load(bad, model)
    save_json_artifact(bad, ["a list"])
    with pytest.raises(ArtifactError, match="not a JSON object"):
        SkipSet.load(bad, model)
    save_json_artifact(bad, {"kind": "self-sd-layers", "model_fingerprint": fp, "skip_attn": [1, 9], "skip_mlp": []})
    with pytest.raises(ArtifactError, match=r"\[9\] are out of range"):
        SkipSet.load(bad, model)
    save_json_artifact(bad, {"kind": "self-sd-layers", "model_fingerprint": fp, "skip_attn": "1,2", "skip_mlp": []})
    with pytest.raises(ArtifactError, match="'skip_attn' must be a list"):
        SkipSet.load(bad, model)


# ---------------------------------------------------------------- atomic writes and tensors artifacts


def test_atomic_json_write(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "a.json"
    save_json_artifact(path, {"kind": "x", "v": 1})
    assert json.loads(path.read_text()) == {"kind": "x", "v": 1}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    no_temp_files(path.parent)

    # a failure or Ctrl-C while writing keeps the old file and leaves no temporary file
    for exc in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        def boom(*_a, exc=exc, **_k):
            raise exc

        monkeypatch.setattr(artifacts.os, "replace", boom)
        with pytest.raises(ArtifactError if isinstance(exc, OSError) else KeyboardInterrupt):
            save_json_artifact(path, {"kind": "x", "v": 2})
        monkeypatch.undo()
        assert json.loads(path.read_text()) == {"kind": "x", "v": 1}
        no_temp_files(path.parent)


def test_tensors_artifact_roundtrip(tiny_model, tmp_path):
    model, _ = tiny_model
    fp = model_fingerprint(model)
    tensors = {"head.weight": torch.randn(3, 4), "head.bias": torch.arange(3, dtype=torch.int64),
               "half": torch.randn(2, 2).to(torch.bfloat16)}
    for target in (tmp_path / "heads", tmp_path / "flat" / "exit.safetensors"):
        mpath = save_tensors_artifact(target, tensors, {"kind": "test-heads", "model_fingerprint": fp, "note": "x"})
        assert mpath.name in ("manifest.json", "exit.manifest.json")
        got, man = load_tensors_artifact(target, model, kind="test-heads")
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v)
        assert man["note"] == "x" and man["tensors"]["head.weight"] == {"shape": [3, 4], "dtype": "float32"}
        no_temp_files(mpath.parent)
    with pytest.raises(ArtifactError, match="not 'other-kind'"):
        load_tensors_artifact(tmp_path / "heads", kind="other-kind")
    with pytest.raises(ArtifactError, match="made for another model"):
        load_tensors_artifact(tmp_path / "heads", make_tiny_model(seed=2))
    with pytest.raises(ArtifactError, match="does not exist"):
        load_tensors_artifact(tmp_path / "missing")
    # a tensors file from another write of the same artifact (torn pair) is refused
    shutil.copy(tmp_path / "flat" / "exit.safetensors", tmp_path / "heads" / "tensors.safetensors")
    with pytest.raises(ArtifactError, match="does not belong"):
        load_tensors_artifact(tmp_path / "heads", model)
    (tmp_path / "heads" / "tensors.safetensors").unlink()
    with pytest.raises(ArtifactError, match="are missing"):
        load_tensors_artifact(tmp_path / "heads", model)


# ---------------------------------------------------------------- prompts from a dataset


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


def test_prompts_from_local_jsonl_dataset(tmp_path, datasets_cache):
    f = tmp_path / "calib.jsonl"
    rows = [{"text": p, "turns": [p, "follow-up"], "n": i} for i, p in enumerate(PROMPTS)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert prompts_from_dataset(str(f), "text", 3) == PROMPTS[:3]
    assert prompts_from_dataset(str(f), "turns", 8) == PROMPTS  # Spec-Bench turns: the first one
    from selfspec_cli.errors import PromptFileError

    with pytest.raises(PromptFileError, match="no column 'prompt'.*--dataset-field"):
        prompts_from_dataset(str(f), "prompt", 8)
    with pytest.raises(PromptFileError, match="not a non-empty string"):
        prompts_from_dataset(str(f), "n", 8)
    with pytest.raises(PromptFileError, match="does not exist"):
        prompts_from_dataset(str(tmp_path / "nope.jsonl"), "text", 8)


def test_calibrate_from_dataset(tiny_model_dir, tmp_path, datasets_cache):
    f = tmp_path / "calib.jsonl"
    f.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS), encoding="utf-8")
    out = tmp_path / "ds.json"
    summary = run_ok(calib_args(tiny_model_dir, "--dataset", str(f), "--dataset-field", "text", "--num-prompts", "2",
                                "--trials", "1", "--repeats", "2", "--output", str(out)))
    assert summary["trials"] == 1
    search = json.loads(out.read_text())["search"]
    assert search["repeats"] == 2
    prompts = search["prompts"]
    assert prompts["source"] == str(f) and prompts["num_prompts"] == 2 and prompts["dataset_field"] == "text"


# ---------------------------------------------------------------- search space helpers, CLI errors


def test_uniform_starting_points():
    spread = sorted(uniform_layers(40, 0.45))  # 18 layers, evenly spread, never the first or last
    assert len(spread) == 18 and spread[0] >= 1 and spread[-1] <= 38
    assert {b - a for a, b in zip(spread, spread[1:])} <= {2, 3}
    assert uniform_layers(12, 0.45) == frozenset({1, 3, 5, 7, 9})
    assert [sorted(p.skip_attn) for p in seed_points(4)] == [[1], [1, 2]]
    assert seed_points(2) == []  # no interior layer
    # full depth on the target's own weights pays only when its draft scores a draft vocabulary (FR-Spec)
    assert "full-depth-target" not in [p.name for p in seed_points(4, precisions=("target", "int8"))]
    cheap = seed_points(4, precisions=("target", "int8"), cheap_head=("target",))
    assert [(p.name, p.precision) for p in cheap if not p.skip_attn and not p.skip_mlp] == [
        ("full-depth-target", "target"), ("full-depth-int8", "int8")]
    for p in seed_points(32):
        assert p.skip_attn == p.skip_mlp and 0 not in p.skip_attn and 31 not in p.skip_attn


def test_calibrate_bad_input(tiny_model_dir, prompt_file, tmp_path):
    p = ("--prompt-file", str(prompt_file))
    user_error(calib_args(tiny_model_dir, *p, "--method", "eagle"), "unknown --method 'eagle'", "self-sd", "specee")
    # specee needs the trained exit predictors first: the error names the command that makes them
    specee = ["calibrate", "--method", "specee", "--model", str(tiny_model_dir), "--device", "cpu", *p]
    user_error(specee, "selfspec train-heads --kind lm-heads")
    # an option of another step is refused before the model loads, naming the step it belongs to
    user_error([*specee, "--draft-precision", "target"], "--draft-precision is an option of --method self-sd", "drop it")
    user_error(["calibrate", "--model", str(tiny_model_dir), *p], "calibrate needs --method", "self-sd")
    user_error(calib_args(tiny_model_dir), "exactly one of --prompt-file and --dataset")
    user_error(calib_args(tiny_model_dir, *p, "--dataset", str(prompt_file)), "exactly one of")
    user_error(calib_args(tiny_model_dir, *p, "--trials", "0"), "--trials must be >= 1")
    user_error(calib_args(tiny_model_dir, *p, "--sampler", "cmaes"), "--sampler", "tpe")
    user_error(calib_args(tiny_model_dir, *p, "--num-prompts", "0"), "--num-prompts")
    user_error(calib_args(tiny_model_dir, *p, "--repeats", "0"), "--repeats must be >= 1")
    user_error(calib_args(tiny_model_dir, "--prompt-file", str(tmp_path / "none.txt")), "none.txt", "does not exist")
    user_error(calib_args(tiny_model_dir, *p, "--output", str(tmp_path)), "is a directory")
    not_db = tmp_path / "not-a-db.db"
    not_db.write_text("hello, not sqlite\n" * 100)
    user_error(calib_args(tiny_model_dir, *p, "--study-path", str(not_db), "--output", str(tmp_path / "o.json")),
               "cannot open the Optuna study", "--study-path")


def test_help_lists_calibrate():
    rc, out, _ = run_cli(["--help"])
    assert rc == 0 and "calibrate" in out
    rc, out, _ = run_cli(["calibrate", "--help"])
    assert rc == 0
    for opt in ("--method", "--trials", "--study-path", "--dataset-field", "--num-prompts", "--output"):
        assert opt in out


def test_calibrate_package_imports_no_cli_libraries():
    code = ("import sys, selfspec_cli.methods.self_sd.calibrate, selfspec_cli.prompts, selfspec_cli.artifacts; "
            "bad = [m for m in ('typer', 'rich', 'optuna', 'datasets') if m in sys.modules]; "
            "assert not bad, bad")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120, cwd=Path(__file__).parent.parent)


@pytest.mark.skipif(kernels.load_extension() is None, reason="quantized drafts need the CPU kernel")
def test_joint_precision_search(tmp_path, tiny_model_dir, prompt_file):
    """--draft-precision auto searches the skip set and the draft weights together: the study has a
    ``precision`` parameter, the quantized full-depth draft is a starting point, the quantized
    draft's full-depth cost is measured once and kept in the study (a resumed run reuses it), and
    the artifact names the precision, which self-sd then drafts with."""
    import optuna

    from selfspec_cli.methods.self_sd import SkipSet
    from selfspec_cli.engine import Engine
    from selfspec_cli.loading import load_model
    from selfspec_cli.methods import build

    out = tmp_path / "joint.json"
    db = tmp_path / "joint.db"
    run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "6", "--output", str(out),
                      "--study-path", str(db), "--draft-precision", "auto"))
    man = json.loads(out.read_text())
    assert man["search"]["precisions"] == ["target", "int8"]  # a tiny in-memory model has no GGUF blocks
    assert man["draft_precision"] in ("target", "int8")
    names = [p["name"] for p in man["search"]["seed_points"]]
    assert "full-depth-int8" in names and "uniform-0.3-target" in names and "uniform-0.3-int8" in names
    study = optuna.load_study(study_name="self-sd", storage=f"sqlite:///{db}")
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 6 and all(t.params["precision"] in ("target", "int8") for t in trials)
    assert {t.params["precision"] for t in trials} == {"target", "int8"}  # the seeds cover both
    full_c = study.user_attrs["full_depth_c"]
    assert full_c["target"] == 1.0 and 0 < full_c["int8"]
    # resuming with more trials keeps the measured cost (the proxy of old and new trials compare)
    run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "7", "--output", str(out),
                      "--study-path", str(db), "--draft-precision", "auto", "--force"))
    assert optuna.load_study(study_name="self-sd", storage=f"sqlite:///{db}").user_attrs["full_depth_c"] == full_c
    model, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu", log=None)
    skip = SkipSet.load(out, model)
    assert skip.draft_precision == json.loads(out.read_text())["draft_precision"]
    method = build("self-sd", Engine(model), None, layers=out)
    assert method.describe().draft_precision == (skip.draft_precision or "target")


def test_a_set_slower_than_ar_never_becomes_the_default(tmp_path, tiny_model_dir, prompt_file, tiny_model, monkeypatch):
    """One random trial on a tiny random model skips too much to pay (its predicted speedup
    is far below 1): written beside the default path and named, never made the default."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    model, _ = tiny_model
    summary = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "1", "--seed", "3"))
    default = SKIP_SET.default_path(model)
    assert summary["objective"] < 1.0 and summary["below_ar"] is True
    assert not default.exists()
    assert Path(summary["artifact"]) == default.with_name(default.stem + ".below-ar.json")
    assert Path(summary["artifact"]).is_file()
    # the same command again resumes the study and replaces its own below-ar result (finding 7: it stopped
    # with "already exists; pass --force", an --output the user never gave)
    again = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "1", "--seed", "3"))
    assert again["artifact"] == summary["artifact"] and again["below_ar"] is True
    # asked for by name, it is written where asked (and still reported as below ar)
    named = run_ok(calib_args(tiny_model_dir, "--prompt-file", str(prompt_file), "--trials", "1", "--seed", "3",
                              "--output", str(tmp_path / "mine.json")))
    assert named["artifact"] == str(tmp_path / "mine.json") and named["below_ar"] is True


def test_the_manifest_does_not_keep_a_storage_password(tiny_model):
    """A shared study's database URL may carry a password: the artifact records the storage as the
    log lines show it (``describe``), never the raw ``--storage`` value."""
    from selfspec_cli.methods.self_sd.calibrate import build_manifest
    from selfspec_cli.methods.self_sd.search import SearchConfig
    from selfspec_cli.methods.self_sd.study import SelfSDCalibration

    model, _ = tiny_model
    confirm = {"ar": {"tokens_per_s": 10.0}, "best": {"tokens_per_s": 12.0}}
    result = SelfSDCalibration(num_layers=2, skip_attn=frozenset({1}), skip_mlp=frozenset(), precision="target",
                               best_trial=0, best_value=1.2, best_attrs={}, trials=1, new_trials=1,
                               study_path="postgresql://alice:s3cret@db.example:5432/studies", baseline=None,
                               confirm=confirm)
    search = SearchConfig(study_path=None, storage="postgresql://alice:s3cret@db.example:5432/studies")
    manifest = build_manifest(result, model=model, cfg=GenerationConfig(max_new_tokens=4), search=search,
                              prompts={}, environment={})
    assert manifest["search"]["study_path"] == "postgresql://***@db.example:5432/studies"
    assert "s3cret" not in json.dumps(manifest)


def test_describe_hides_only_a_urls_credentials():
    from selfspec_cli.methods.self_sd.study import describe

    assert describe("postgresql://alice:s3cret@db.example:5432/studies") == "postgresql://***@db.example:5432/studies"
    assert describe("mysql://bob@db/s") == "mysql://***@db/s"
    assert describe("journal:///tmp/a@b/study.journal") == "journal:///tmp/a@b/study.journal"  # a path, no credentials
    assert describe("sqlite:////home/x@y/study.db") == "sqlite:////home/x@y/study.db"
    assert describe("/tmp/plain.db") == "/tmp/plain.db"


def test_the_confirmation_names_a_starting_point_that_re_measured_faster_than_the_search_best():
    """faster_starting_point (methods/self_sd/study.py), what calibrate's warning names (it never changes the
    result): the fastest re-measured starting point past the margin, only one whose trial completed, with
    that point's best trial (real Optuna trials)."""
    import optuna

    from selfspec_cli.methods.self_sd.study import faster_starting_point
    from selfspec_cli.methods.self_sd.study import params_for

    L = 2
    dist = {k: optuna.distributions.IntDistribution(0, 1) for k in params_for(L, frozenset(), frozenset())}

    def trial(number, attn, mlp, value):
        return optuna.trial.create_trial(params=params_for(L, frozenset(attn), frozenset(mlp)), distributions=dist,
                                         value=value, user_attrs={"n": number})

    seeds = [{"name": "full-depth", "skip_attn": [], "skip_mlp": [], "precision": "target"},
             {"name": "uniform-50", "skip_attn": [1], "skip_mlp": [1], "precision": "target"},
             {"name": "never-ran", "skip_attn": [0], "skip_mlp": [0], "precision": "target"}]
    finished = [trial(0, [], [], 0.9), trial(1, [], [], 1.1), trial(2, [1], [1], 1.0), trial(3, [0, 1], [], 1.3)]
    tps = lambda **kv: {"ar": {"tokens_per_s": 10.0}, **{k.replace("_", "-"): {"tokens_per_s": v} for k, v in kv.items()}}
    assert faster_starting_point(tps(best=12.0, full_depth=11.0, uniform_50=11.5), seeds, finished, L, "target") is None
    name, t = faster_starting_point(tps(best=12.0, full_depth=13.0, uniform_50=12.5), seeds, finished, L, "target")
    assert name == "full-depth" and t.user_attrs["n"] == 1  # its better trial
    # the fastest re-measured point never completed a trial: the next faster one, if any beats the best
    name, _ = faster_starting_point(tps(best=12.0, full_depth=9.0, uniform_50=12.5, never_ran=20.0), seeds, finished, L,
                                    "target")
    assert name == "uniform-50"
    assert faster_starting_point(tps(best=12.0, full_depth=9.0, uniform_50=11.0, never_ran=20.0), seeds, finished, L,
                                 "target") is None
    assert faster_starting_point(tps(best=12.0, full_depth=13.0), seeds, finished, L, "target", 1.1) is None
