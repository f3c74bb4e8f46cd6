"""Reproductions from a new user's session (issue: seeded sampling and the defects a new
user meets), each with the behaviour the docs promise."""
from __future__ import annotations

import json
import math
import os
import threading

import pytest

from selfspec_cli.cli.app import main
from selfspec_cli.jsonio import dumps

from .test_cli import assert_user_error, gen_args, interrupt_at, prompt_file, run_generate, write_jsonl, write_lines  # noqa: F401 (fixture)


def test_seed_reproduces_ars_tokens_with_every_lossless_method(capsys, tiny_model_dir, tmp_path):
    """The first reproduction: `-t 0.9 --seed 7` run twice gave other tokens with pld, auto,
    adadecode (no heads here) and self-sd; now every lossless method gives ar's tokens."""
    prompts = write_lines(tmp_path / "q.txt", ["the quick brown fox", "one two three four one two"])
    args = ("-n", "24", "-t", "0.9", "--seed", "7")
    ar = [r["token_ids"] for r in run_generate(capsys, tiny_model_dir, prompts, *args)]
    for method, extra in (("pld", ()), ("auto", ()), ("self-sd", ("--skip-attn", "1", "--skip-mlp", "2")), ("swift", ()),
                          ("asd", ())):
        for _ in range(2):
            got = [r["token_ids"] for r in run_generate(capsys, tiny_model_dir, prompts, *args, "--method", method, *extra)]
            assert got == ar, method
    other = [r["token_ids"] for r in run_generate(capsys, tiny_model_dir, prompts, "-n", "24", "-t", "0.9", "--seed", "8")]
    assert other != ar


def test_append_to_a_file_without_a_final_newline(capsys, tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "f.jsonl"
    out.write_text('{"prompt":"x"}', encoding="utf-8")
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", str(out), "--append")) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    assert lines[0] == '{"prompt":"x"}'
    assert all(json.loads(line) for line in lines)  # every line is one whole record


@pytest.mark.parametrize("extra", [(), ("--force",)])
def test_a_named_pipe_output_is_written_in_place(capsys, tiny_model_dir, prompt_file, tmp_path, extra):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")))
    reader.start()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", str(fifo), *extra))
    reader.join(timeout=60)
    assert rc == 0 and not reader.is_alive()
    assert fifo.is_fifo()  # not replaced by a regular file
    assert len([json.loads(line) for line in got[0].splitlines()]) >= 1


def test_character_devices_are_accepted_as_output(capsys, tiny_model_dir, prompt_file):
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "3", "-o", "/dev/null")) == 0
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_json_out_is_strict():
    text = dumps({"kl": float("nan"), "rows": [1.0, float("inf")], "ok": 0.5})
    assert json.loads(text) == {"kl": None, "rows": [1.0, None], "ok": 0.5}
    assert "NaN" not in text and "Infinity" not in text
    assert math.isfinite(json.loads(dumps(1e300)))


def test_train_heads_refuses_too_few_prompts_for_a_test_split(capsys, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello there"}, {"prompt": "a b c"}])
    msg = assert_user_error(capsys, ["train-heads", "--kind", "lm-heads", "-m", str(tiny_model_dir), "-p", str(prompts),
                                     "-n", "4", "-o", str(tmp_path / "h.safetensors")], "at least 3 prompts", "more prompts")
    assert "--num-prompts" not in msg  # named only when it is what holds the count down (it defaults to 1000)
    prompts = write_jsonl(tmp_path / "p3.jsonl", [{"prompt": f"prompt {i}"} for i in range(4)])
    assert_user_error(capsys, ["train-heads", "--kind", "lm-heads", "-m", str(tmp_path / "no-model"), "-p", str(prompts),
                               "--num-prompts", "2"], "at least 3 prompts, got 2", "--num-prompts 3")


def test_an_interrupted_bench_writes_what_it_has_and_resumes(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C mid-run (injected at the 5th timed prompt): the finished records stay, results.json
    holds the prompts every contender finished (marked incomplete), and the same command with
    --resume runs only what is missing and ends with the run's full results."""
    from selfspec_cli.methods import application  # where bench's prompts are decoded

    prompts = write_lines(tmp_path / "p.txt", ["alpha beta gamma", "one two three", "red green blue"])
    out = tmp_path / "b"
    argv = ["bench", "--methods", "ar,pld", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "6", "--warmup", "0",
            "--repeats", "2", "--no-plots", "--no-costs", "--device", "cpu", "-o", str(out)]
    real = application.run_prompt
    calls = {"n": 0}
    monkeypatch.setattr(application, "run_prompt", interrupt_at(5, real, calls))
    capsys.readouterr()
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--resume" in err
    partial = json.loads((out / "results.json").read_text())
    assert partial["setup"]["complete"] is False
    assert partial["methods"]["pld"]["prompts"] == 2  # prompts 1 and 2 of pass 1 by both contenders
    monkeypatch.setattr(application, "run_prompt", lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), real(*a, **k))[1])
    calls["n"] = 0
    assert main([*argv, "--resume"]) == 0
    assert calls["n"] == 2 * 3 * 2 - 4  # only the missing cells ran
    full = json.loads((out / "results.json").read_text())
    assert full["setup"]["complete"] is True and full["methods"]["pld"]["parity"]["parity"] == 1.0
    for name in ("ar", "pld"):
        recs = [json.loads(line) for line in (out / "records" / f"{name}.jsonl").read_text().splitlines()]
        assert sorted((r["repeat"], r["id"]) for r in recs) == [(r, i) for r in range(2) for i in (1, 2, 3)]
    # another command cannot resume this run
    assert_user_error(capsys, [*argv[:-2], "-n", "7", "-o", str(out), "--resume"], "--resume", "other settings")


def test_a_conversation_that_may_overflow_the_context_is_refused_up_front(capsys, tiny_model_dir, tmp_path):
    """Two turns that fit one by one but not together with their answers (the tiny model's context
    is 256): refused before any decoding, naming the fix; -n small enough runs."""
    turn = " ".join(["word"] * 25)  # about 100 tokens with the tiny tokenizer
    prompts = write_jsonl(tmp_path / "t.jsonl", [{"turns": [turn, turn]}])
    assert_user_error(capsys, gen_args(tiny_model_dir, prompts, "-n", "40"), "2 turns", "context of 256",
                      "--max-new-tokens to at most")
    recs = run_generate(capsys, tiny_model_dir, prompts, "-n", "4")
    assert len(recs) == 1


def test_more_threads_than_cores_run_and_say_so(capsys, tiny_model_dir, prompt_file):
    from selfspec_cli.engine import kernels
    from selfspec_cli.engine.cores import usable_cores
    from selfspec_cli.session import apply_threads

    n = usable_cores() + 1
    try:
        capsys.readouterr()
        assert main(gen_args(tiny_model_dir, prompt_file, "-n", "4", "--threads", str(n))) == 0
        out, err = capsys.readouterr()
        assert out.strip() and err.count("oversubscribes") == 1 and "Traceback" not in err
        assert kernels.pool_threads() == n
    finally:
        apply_threads(None)


@pytest.mark.parametrize("value,fragment", [("0", ">= 1"), ("-2", ">= 1"), ("two", "whole number or auto")])
def test_bad_thread_counts_are_one_line(capsys, tiny_model_dir, prompt_file, value, fragment):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--threads", value), "--threads", fragment)


def test_version_and_short_help(capsys):
    from selfspec_cli import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"selfspec {__version__}"
    assert main(["generate", "-h"]) == 0 and "--prompt-file" in capsys.readouterr().out


@pytest.mark.parametrize("argv,fragment", [(["generate", "--bogus-flag"], "No such option: --bogus-flag"),
                                           (["generate", "-p", "x", "-n", "nan"], "--max-new-tokens"),
                                           (["generate"], "Missing option '--prompt-file'")])
def test_usage_errors_are_one_line(capsys, argv, fragment):
    assert_user_error(capsys, argv, fragment, "--help")


def test_help_keeps_every_option_name_at_80_columns(monkeypatch):
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "selfspec_cli", "generate", "--help"], capture_output=True, text=True,
                         env=env, timeout=120).stdout
    for name in ("--draft-threshold", "--adadecode-layers", "--no-chat-template", "--sampling-rule"):
        assert name in out, name
    assert "…" not in out
    assert "[default: no-hybrid]" not in out


def test_a_missing_hub_id_fails_at_once_in_one_line(capsys, prompt_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_user_error(capsys, gen_args("nosuchorg/nosuchmodel", prompt_file), "nosuchorg/nosuchmodel", "not in the Hugging Face cache")


def test_a_closed_pipe_ends_quietly(tiny_model_dir, prompt_file):
    import subprocess
    import sys

    cmd = (f"{sys.executable} -m selfspec_cli generate -m {tiny_model_dir} -p {prompt_file} -n 3 --device cpu | head -n1; "
           "echo \"status ${PIPESTATUS[0]}\"")
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert res.stdout.strip().splitlines()[-1] == "status 0"
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr
    assert json.loads(res.stdout.splitlines()[0])["token_ids"]


def test_ctrl_c_while_importing_is_one_line(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    # SIGINT at its default in the child (a shell's background job would start it ignored)
    proc = subprocess.Popen([sys.executable, "-m", "selfspec_cli", "generate", "-p", "x"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.3)  # torch and transformers are still loading
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), err  # a shell reports both as 130
    assert "Traceback" not in err and err.strip() == "selfspec: interrupted (SIGINT); it had finished nothing, so nothing was kept"


def test_profile_refuses_to_predict_a_method_without_plans(capsys, tiny_model_dir):
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "--device", "cpu", "--predict", "specee"],
                      "specee does not plan", "choose from")


def test_multi_turn_text_separates_the_turns_and_drops_a_torn_last_character(capsys, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    prompts = write_jsonl(tmp_path / "t.jsonl", [{"turns": ["first question", "second question"]}])
    rec = run_generate(capsys, tiny_model_dir, prompts, "-n", "5")[0]
    assert rec["text"] == "\n\n".join(t["text"] for t in rec["turns"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torn = 0
    many = write_lines(tmp_path / "m.txt", [f"prompt number {i}" for i in range(12)])
    for r in run_generate(capsys, tiny_model_dir, many, "-n", "3"):
        raw = tok.decode(r["token_ids"], skip_special_tokens=True)
        assert not r["text"].endswith("\ufffd") or r["finish_reason"] != "length"
        assert raw.startswith(r["text"])
        torn += raw != r["text"]
    assert torn > 0  # the tiny model's random tokens end inside a character often enough


def test_bare_command_shows_its_help(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: selfspec") and "generate" in err and "selfspec: error" not in err


def test_bench_sampling_refuses_greedy_only_contenders_up_front(capsys, tiny_model_dir, prompt_file, tmp_path):
    assert_user_error(capsys, ["bench", "--methods", "ar,hf,specee", "-m", str(tiny_model_dir), "-p", str(prompt_file),
                               "-t", "0.8", "-o", str(tmp_path / "b")], "hf, specee run greedy only", "--methods")
    assert not (tmp_path / "b").exists()  # refused before anything was written


def test_paper_drafting_does_not_time_the_engine_inside_a_decode():
    """--paper-drafting plans nothing: its first decode must not measure the verify curve (seconds
    of forwards inside a timed run) nor report a cost model."""
    from selfspec_cli.config import GenerationConfig
    from selfspec_cli.decoding import cost_store
    from selfspec_cli.engine import Engine
    from selfspec_cli.methods import build

    from .conftest import make_tiny_model

    eng = Engine(make_tiny_model("llama-gqa", layers=4))
    m = build("self-sd", eng, None, skip_attn="1", skip_mlp="2", paper_drafting=True)
    res = m.generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=12))
    assert res.stats.drafted_tokens > 0
    assert cost_store.held_curve(eng) is None and "cost_model" not in res.stats.report.to_json()
