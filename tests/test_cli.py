"""The ``selfspec`` command line, in process: ``main([...])`` returns the exit status.

Uses the session fixture ``tiny_model_dir`` (a real saved tiny Llama + tokenizer).
Every run is pinned to ``--device cpu`` so float32 results compare exactly with
Hugging Face on the same machine, whether or not CUDA is present.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec_cli.cli.app import main

from .conftest import charge_forwards

PROMPTS = [
    "def run_prompt(tokenizer, prompt):",
    "import torch",
    "return the record for every turn",
    "class PreparedPrompt:",
]

MODEL_FIELDS = {"id", "method", "text", "token_ids", "new_tokens", "wall_time_s", "tokens_per_s", "stats"}


# ---------------------------------------------------------------- helpers


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_jsonl(path: Path, objs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    return write_lines(tmp_path / "prompts.txt", PROMPTS)


def gen_args(model: Path, prompts: Path | str, *extra: str) -> list[str]:
    """generate's arguments; plain decoding (``--method ar``) unless ``extra`` names a method (the
    default, auto, has its own test: test_generate_defaults_to_auto)."""
    method = () if "--method" in extra else ("--method", "ar")
    return ["generate", "-m", str(model), "-p", str(prompts), "--device", "cpu", *method, *extra]


def test_generate_defaults_to_auto(capsys, tiny_model_dir, prompt_file):
    capsys.readouterr()
    rc = main(["generate", "-m", str(tiny_model_dir), "-p", str(prompt_file), "--device", "cpu", "-n", "6"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert recs and all(r["method"] == "auto" and r["lossless"] for r in recs)
    assert "auto, target" in err and "tok/s" in err  # the summary line on stderr
    # the float32 checkpoint's target streams its packed panels: the float matrices are freed once auto is built
    assert "target fp32 (" in err and "MB of float matrices freed" in err
    assert "then decoding" in err and "tokens/s over the decode only" in err
    assert "ar ESTIMATED, not run" in err and "stored costs" in err and " ago" in err  # labelled, with its age


def test_the_summary_compares_decoding_with_ar_at_the_same_contexts():
    """The pace line sets the decoding after each prefill against the stored T(1) at every token's context
    (not the rate with the prefill against ar's decode-only rate, which understated every method)."""
    from selfspec_cli.cli.summary import Pace
    from selfspec_cli.decoding.measure import VerifyCurve

    from selfspec_cli.decoding.output import OutputRecord

    rec = OutputRecord.from_dict  # a record as generate writes it, read back
    pace = Pace()
    stats = {"prefill_s": 0.5}
    pace.add(rec({"new_tokens": 5, "wall_time_s": 0.52, "prompt_tokens": 64, "stats": stats}))  # 4 tokens in 0.02 s
    pace.add(rec({"new_tokens": 6, "wall_time_s": 1.53, "prompt_tokens": 200, "stats": {},  # two turns
                  "turns": [{"new_tokens": 1, "wall_time_s": 0.5, "prompt_tokens": 100, "stats": stats},  # prefill's only
                            {"new_tokens": 5, "wall_time_s": 1.03, "prompt_tokens": 100, "stats": stats}]}))  # 4 in 0.53 s
    assert pace.tokens == 11 and pace.decoded == [(64, 4, pytest.approx(0.02)), (100, 4, pytest.approx(0.53))]
    curve = VerifyCurve(t1_s=0.01, ratios={1: 1.0}, context=64, slope_s=0.001)
    store = {"stored": True, "t1_samples": 7, "age_s": 5400.0, "settled": True}
    line = pace.line(curve, store)
    ar_s = sum(0.01 + 0.001 * (ctx + i - 64) for ctx in (64, 100) for i in range(4))  # T(1) at each token's context
    assert f"then decoding {8 / 0.55:.1f} tok/s (tokens/s over the decode only: 8 tokens in 0.55 s)" in line
    assert "prefill 1.5 s (264 prompt tokens)" in line  # three prefills of 0.5 s: 64 + 100 + 100 tokens
    assert (f"ar ESTIMATED, not run: {8 / ar_s:.1f} tok/s for the same tokens at their contexts from this "
            f"machine's stored costs (T(1) 10.0 ms, median of 7 readings, stored 1.5 h ago), so about {ar_s / 0.55:.2f}x") in line
    assert "ESTIMATED" not in pace.line(None)  # no stored costs (ar itself): measured figures only
    assert "decoding" not in Pace(tokens=3, seconds=1.0).line(curve)  # nothing decoded after a prefill: no comparison
    # the rounds that drafted nothing, each an ar step, scale the stored costs to this process: from 16 of them
    few = dict(stats, plain_rounds={"count": 15, "verify_s": 0.3, "stored_t1_s": 0.2})
    pace = Pace()
    pace.add(rec({"new_tokens": 5, "wall_time_s": 0.52, "prompt_tokens": 64, "stats": few}))
    assert "scaled" not in pace.line(curve, store)
    pace.add(rec({"new_tokens": 5, "wall_time_s": 0.52, "prompt_tokens": 64, "stats": dict(few, plain_rounds={
        "count": 1, "verify_s": 0.06, "stored_t1_s": 0.04})}))
    line = pace.line(curve, store)
    ar_s = 1.5 * 2 * sum(0.01 + 0.001 * i for i in range(4))  # the rounds took 0.36 s where the store says 0.24
    assert "scaled by this call's 16 rounds that drafted nothing, each an ar step, which took 1.50x them" in line
    assert f"ar ESTIMATED, not run: {8 / ar_s:.1f} tok/s" in line and f"so about {ar_s / 0.04:.2f}x" in line


def test_the_driver_counts_the_rounds_that_drafted_nothing(tiny_model_dir):
    """What scales ar's estimate on the summary line: the driver's count of the rounds that drafted nothing, their
    verify seconds and the stored T(1) at their contexts (all of ar's rounds but the prefill's token)."""
    from selfspec_cli.session import Session
    from selfspec_cli.methods import build
    from selfspec_cli.config import GenerationConfig

    s = Session.open(str(tiny_model_dir), lite=True)
    method = build("pld", s.engine("auto"), s.tokenizer)
    res = method.generate([5, 6, 7, 8], s.generation(GenerationConfig(max_new_tokens=12)))
    rounds = len(res.stats.accept_lengths) - 1
    plain = res.stats.plain_rounds
    assert plain.count == rounds - res.stats.draft_rounds and plain.count > 0
    assert 0 < plain.verify_s and 0 < plain.stored_t1_s


def test_a_method_that_drafted_in_no_round_says_so_once_with_the_reason(capsys, tiny_model_dir, tmp_path, selfspec_home):
    """Issue 50: self-sd, asd, swift and specqd drafted in no round on the default model and silently ran as ar.
    Here this machine's stored costs make every verification dear (v(2) a thousand steps), so no draft pays."""
    from selfspec_cli.decoding import cost_store

    prompts = write_lines(tmp_path / "p.txt", ["one two three four", "five six seven eight"])
    args = gen_args(tiny_model_dir, prompts, "-n", "8", "--method", "self-sd", "--skip-attn", "1", "--skip-mlp", "0")
    capsys.readouterr()
    assert main(args) == 0  # stores this machine's costs (a short reading)
    [path] = (selfspec_home / "cache" / "costs").glob("*.json")
    rec = json.loads(path.read_text())
    rec["curve"]["times_s"] = {m: t * (1 if m == "1" else 1000) for m, t in rec["curve"]["times_s"].items()}
    path.write_text(json.dumps(rec))
    cost_store._CURVES.clear(), cost_store._READINGS.clear(), cost_store._ONLINE.clear()  # what a new process starts with
    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    recs = [json.loads(line) for line in out.splitlines()]
    assert len(recs) == 2 and all(r["stats"]["draft_round_share"] == 0.0 for r in recs)  # the premise
    notes = [line for line in err.splitlines() if "drafted in none of its" in line]
    assert len(notes) == 1, err  # once for the call, not per prompt
    rounds = sum(len(r["stats"]["accept_lengths"]) - 1 for r in recs)
    assert f"self-sd drafted in none of its {rounds} rounds, so it decoded as ar does" in notes[0]
    assert "predicts no draft pays" in notes[0] and "a draft step costs" in notes[0] and "--paper-drafting" in notes[0]
    assert "drafted in 0 of" in err  # and the summary line counts the rounds


def run_generate(capsys, model: Path, prompts: Path | str, *extra: str) -> list[dict]:
    """Run generate to stdout; returns the parsed records (asserts success)."""
    capsys.readouterr()
    rc = main(gen_args(model, prompts, *extra))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def assert_user_error(capsys, argv: list[str], *fragments: str, only_line: bool = True) -> str:
    """Exit status 2, one 'selfspec: error:' line (the last thing on stderr), no traceback."""
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    assert "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("selfspec: error:")]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0], err  # the message is one line, and nothing follows it
    if only_line:
        assert lines == errors, err
    for frag in fragments:
        assert frag in errors[0], (frag, errors[0])
    assert out == "", out
    return errors[0]


# ---------------------------------------------------------------- generate: output format


def check_record(rec: dict, max_new: int, method: str = "ar") -> None:
    assert MODEL_FIELDS <= set(rec)
    assert rec["method"] == method
    assert isinstance(rec["text"], str)
    assert isinstance(rec["token_ids"], list) and all(isinstance(t, int) for t in rec["token_ids"])
    assert rec["new_tokens"] == len(rec["token_ids"])
    assert 1 <= rec["new_tokens"] <= max_new
    assert rec["wall_time_s"] > 0 and rec["tokens_per_s"] > 0  # their values: test_generate_times_every_turn_on_a_known_clock
    st = rec["stats"]
    assert st["target_forwards"] >= 1
    assert isinstance(st["accept_lengths"], list) and sum(st["accept_lengths"]) == rec["new_tokens"]
    assert rec["finish_reason"] in ("length", "eos", "stop_string")
    if rec["finish_reason"] == "length":
        assert rec["new_tokens"] == max_new


def test_generate_jsonl_to_stdout(capsys, tiny_model_dir, prompt_file):
    recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "12")
    assert [r["id"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        check_record(r, 12)
        assert r["stats"]["target_forwards"] == r["new_tokens"]  # plain decoding: one forward per token
        assert r["stats"]["accept_lengths"] == [1] * r["new_tokens"]


def test_generate_ids_follow_line_numbers_and_input_ids(capsys, tiny_model_dir, tmp_path):
    txt = tmp_path / "gaps.txt"
    txt.write_text("import torch\n\n\nclass Engine:\n", encoding="utf-8")
    assert [r["id"] for r in run_generate(capsys, tiny_model_dir, txt, "-n", "3")] == [1, 4]
    js = write_jsonl(tmp_path / "ids.jsonl", [{"id": "alpha", "prompt": "import torch"}, {"id": 7, "prompt": "def f():"}])
    assert [r["id"] for r in run_generate(capsys, tiny_model_dir, js, "-n", "3")] == ["alpha", 7]


def test_generate_to_output_file(capsys, tiny_model_dir, prompt_file, tmp_path):
    out_file = tmp_path / "out.jsonl"
    capsys.readouterr()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "5", "--output", str(out_file)))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == ""  # records go to the file, not stdout
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(recs) == len(PROMPTS)
    for r in recs:
        check_record(r, 5)
    # the same records as on stdout (apart from timings)
    again = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "5")
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in recs]


def test_generate_output_into_missing_directory(capsys, tiny_model_dir, prompt_file, tmp_path):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "-n", "2", "-o", str(tmp_path / "nope" / "o.jsonl")),
                      "does not exist", only_line=False)


def test_generate_turns_jsonl(capsys, tiny_model_dir, tmp_path):
    f = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "coding", "turns": ["def f(x):", "import torch"]},
        {"question_id": 82, "turns": ["class Engine:"]},
    ])
    recs = run_generate(capsys, tiny_model_dir, f, "-n", "6")
    assert [r["id"] for r in recs] == [81, 82]
    multi, single = recs
    assert multi["category"] == "coding"
    assert isinstance(multi["turns"], list) and len(multi["turns"]) == 2
    for t in multi["turns"]:
        assert {"text", "token_ids", "new_tokens", "prompt_tokens", "wall_time_s", "finish_reason", "stats"} <= set(t)
        assert t["new_tokens"] == len(t["token_ids"]) <= 6
    # the second turn sees the first turn, its answer and the new question
    assert multi["turns"][1]["prompt_tokens"] > multi["turns"][0]["prompt_tokens"]
    # top-level fields cover the whole record: totals, and the turns' outputs concatenated
    assert multi["num_turns"] == 2
    assert multi["new_tokens"] == sum(t["new_tokens"] for t in multi["turns"]) == len(multi["token_ids"])
    assert multi["text"] == "\n\n".join(t["text"] for t in multi["turns"])  # turns apart by a blank line
    assert multi["token_ids"] == [x for t in multi["turns"] for x in t["token_ids"]]
    assert multi["prompt_tokens"] == sum(t["prompt_tokens"] for t in multi["turns"])
    assert multi["finish_reason"] == multi["turns"][-1]["finish_reason"]
    assert multi["stats"]["target_forwards"] == sum(t["stats"]["target_forwards"] for t in multi["turns"])
    assert multi["stats"]["accept_lengths"] == [x for t in multi["turns"] for x in t["accept_lengths"]]
    for t in multi["turns"]:  # per-turn values
        assert sum(t["accept_lengths"]) == t["new_tokens"] and t["accept_lengths"] == t["stats"]["accept_lengths"]
    assert "turns" not in single and "category" not in single
    check_record(single, 6)


def test_generate_times_every_turn_on_a_known_clock(capsys, monkeypatch, virtual_clock, tiny_model_dir, tmp_path):
    """A record's wall time and tokens/s on a machine whose forwards cost known times
    (conftest.VirtualClock): a forward of m rows costs 1 ms + 0.1 ms per row, so a turn that
    prefills P prompt tokens and makes n tokens (the prefill makes the first) takes
    1 + 0.1 P + 1.1 (n - 1) ms; a two-turn record's figures are the turns' totals."""
    charge_forwards(monkeypatch, virtual_clock, lambda engine, rows, kw: 1e-3 + 1e-4 * rows)
    f = write_jsonl(tmp_path / "q.jsonl", [{"id": "one", "prompt": "import torch"},
                                           {"id": "two", "turns": ["def f(x):", "class Engine:"]}])
    one, two = run_generate(capsys, tiny_model_dir, f, "-n", "6")
    assert len(two["turns"]) == 2
    for rec in (one, two):
        walls = []
        for t in rec.get("turns") or [rec]:
            walls.append(1e-3 + 1e-4 * t["prompt_tokens"] + 1.1e-3 * (t["new_tokens"] - 1))
            assert t["wall_time_s"] == pytest.approx(walls[-1], abs=1e-6)
            assert t["tokens_per_s"] == pytest.approx(t["new_tokens"] / walls[-1], abs=2e-3)
        assert rec["wall_time_s"] == pytest.approx(sum(walls), abs=1e-6)
        assert rec["tokens_per_s"] == pytest.approx(rec["new_tokens"] / sum(walls), abs=2e-3)


def test_generate_prompt_from_stdin(capsys, monkeypatch, tiny_model_dir, prompt_file):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(PROMPTS[:2]) + "\n"))
    recs = run_generate(capsys, tiny_model_dir, "-", "-n", "6")
    assert [r["id"] for r in recs] == [1, 2]
    from_file = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "6")
    assert [r["token_ids"] for r in recs] == [r["token_ids"] for r in from_file[:2]]


# ---------------------------------------------------------------- generate: correctness


def test_greedy_ar_matches_hf_generate(capsys, tiny_model_dir, prompt_file):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recs = run_generate(capsys, tiny_model_dir, prompt_file, "--method", "ar", "-n", "12")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not getattr(tok, "chat_template", None)
    for text, rec in zip(PROMPTS, recs, strict=True):
        ids = tok(text)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=12, eos_token_id=1, pad_token_id=1)
        expected = out[0, len(ids):].tolist()
        assert rec["token_ids"] == expected, text
        text = tok.decode(expected, skip_special_tokens=True)
        assert rec["text"] == (text.rstrip("\ufffd") if rec["finish_reason"] == "length" else text)  # no torn last char
        assert rec["finish_reason"] == ("eos" if expected[-1] == 1 else "length")


def test_seeded_sampling_is_reproducible(capsys, tiny_model_dir, prompt_file):
    args = ("-n", "12", "--temperature", "0.8", "--top-p", "0.9")
    a = run_generate(capsys, tiny_model_dir, prompt_file, *args, "--seed", "3")
    b = run_generate(capsys, tiny_model_dir, prompt_file, *args, "--seed", "3")
    c = run_generate(capsys, tiny_model_dir, prompt_file, *args, "--seed", "4")
    greedy = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "12")
    ids = lambda recs: [r["token_ids"] for r in recs]  # noqa: E731
    assert ids(a) == ids(b)
    assert [r["text"] for r in a] == [r["text"] for r in b]
    assert ids(a) != ids(c)
    assert ids(a) != ids(greedy)
    for r in a + c:
        check_record(r, 12)


def _stop_candidate(tok, recs):
    """A 2-3 character printable substring from the middle of a greedy answer, and the
    number of tokens after which it first appears (strictly before the end)."""
    for rec in recs:
        ids, text = rec["token_ids"], rec["text"]
        for width in (3, 2):
            for start in range(len(text) // 3, len(text) - width):
                s = text[start:start + width]
                if not (s.isascii() and s.isprintable() and s.strip() == s and s):
                    continue
                k = next(k for k in range(1, len(ids) + 1) if s in tok.decode(ids[:k], skip_special_tokens=True))
                if 2 <= k < len(ids):
                    return rec, s, k
    return None


def test_stop_string(capsys, tiny_model_dir, prompt_file, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "24")
    found = _stop_candidate(tok, full)
    assert found is not None, [r["text"] for r in full]
    rec, stop, k = found
    one = write_lines(tmp_path / "one.txt", [PROMPTS[rec["id"] - 1]])
    (out,) = run_generate(capsys, tiny_model_dir, one, "-n", "24", "--stop", stop)
    assert out["finish_reason"] == "stop_string"
    assert stop in out["text"]
    assert out["token_ids"] == rec["token_ids"][:k]  # stopped on the token that completed the stop string
    assert stop not in tok.decode(out["token_ids"][:-1], skip_special_tokens=True)
    assert out["new_tokens"] == k < rec["new_tokens"]
    # a stop string that never appears changes nothing
    (same,) = run_generate(capsys, tiny_model_dir, one, "-n", "24", "--stop", "\u2603never\u2603")
    assert same["token_ids"] == rec["token_ids"]


# ---------------------------------------------------------------- bad input: exit 2, one line


def test_missing_model_directory(capsys, tmp_path, prompt_file):
    assert_user_error(capsys, gen_args(tmp_path / "no-such-model", prompt_file), "does not exist", "no-such-model")


def test_model_directory_without_config(capsys, tmp_path, prompt_file):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert_user_error(capsys, gen_args(empty, prompt_file), "config.json")


def test_unsupported_architecture(capsys, tmp_path, prompt_file):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(d)
    assert_user_error(capsys, gen_args(d, prompt_file), "unsupported architecture 'gpt2'", "llama")


def test_missing_prompt_file(capsys, tiny_model_dir, tmp_path):
    assert_user_error(capsys, gen_args(tiny_model_dir, tmp_path / "nope.txt"), "does not exist", "nope.txt")


def test_prompt_file_is_directory(capsys, tiny_model_dir, tmp_path):
    assert_user_error(capsys, gen_args(tiny_model_dir, tmp_path), "is a directory")


def test_empty_prompt_file(capsys, tiny_model_dir, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n  \n")
    assert_user_error(capsys, gen_args(tiny_model_dir, f), "empty")


def test_malformed_jsonl_names_line(capsys, tiny_model_dir, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "import torch"}\n\n{"prompt": "x",,}\n')
    assert_user_error(capsys, gen_args(tiny_model_dir, f), "bad.jsonl", "line 3", "not valid JSON")


def test_jsonl_missing_field(capsys, tiny_model_dir, tmp_path):
    f = write_jsonl(tmp_path / "nofield.jsonl", [{"text": "import torch"}])
    assert_user_error(capsys, gen_args(tiny_model_dir, f), "line 1", "'prompt'")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bad_max_new_tokens(capsys, tiny_model_dir, prompt_file, value):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--max-new-tokens", value),
                      "--max-new-tokens", value)


def test_negative_temperature(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--temperature", "-1"), "--temperature")


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_bad_top_p(capsys, tiny_model_dir, prompt_file, value):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--top-p", value), "--top-p")


def test_bad_tree_nodes(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "swift", "--tree-nodes", "0"),
                      "--tree-nodes", "0")


def test_negative_top_k(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--top-k", "-2"), "--top-k")


def test_unknown_method(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "medusa"), "--method", "medusa", "ar")


def test_bad_device_and_dtype(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, ["generate", "-m", str(tiny_model_dir), "-p", str(prompt_file), "--device", "tpu9"],
                      "--device")
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--dtype", "int3"), "--dtype")


def _long_text(tok, n_tokens: int) -> str:
    words = "def run_prompt tokenizer history encode_turn import torch return record".split()
    text, i = "", 0
    while len(tok(text)["input_ids"]) <= n_tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text


def test_prompt_longer_than_context(capsys, tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    ctx = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    assert ctx == 256
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = _long_text(tok, ctx + 10)
    assert len(tok(text)["input_ids"]) > ctx
    f = write_lines(tmp_path / "long.txt", ["import torch", text])
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, f, "-n", "4"), "prompt 2", "context of 256",
                            only_line=False)
    assert "shorten" in msg


def test_prompt_plus_max_new_tokens_exceeds_context(capsys, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = _long_text(tok, 200)
    n = len(tok(text)["input_ids"])
    assert n < 256
    f = write_lines(tmp_path / "long.txt", [text])
    assert_user_error(capsys, gen_args(tiny_model_dir, f, "-n", "100"), "--max-new-tokens 100",
                      f"at most {256 - n}", only_line=False)


def test_bench_unknown_methods(capsys, tiny_model_dir, prompt_file):
    assert_user_error(capsys, ["bench", "--methods", "ar,eagle", "-m", str(tiny_model_dir), "-p", str(prompt_file)],
                      "eagle", "--methods")
    assert_user_error(capsys, ["bench", "--methods", " , ", "-m", str(tiny_model_dir), "-p", str(prompt_file)],
                      "--methods")


# ---------------------------------------------------------------- interrupt


def interrupt_at(call: int, real, calls: dict | None = None):
    """``real`` that raises KeyboardInterrupt (a Ctrl-C) on its ``call``-th call; ``calls["n"]`` counts."""
    calls = {"n": 0} if calls is None else calls

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return flaky


def test_interrupt_keeps_finished_records(capsys, monkeypatch, tiny_model_dir, prompt_file, tmp_path):
    app_mod = importlib.import_module("selfspec_cli.methods.application")  # where generate's records are decoded
    monkeypatch.setattr(app_mod, "run_prompt", interrupt_at(3, app_mod.run_prompt))
    out_file = tmp_path / "partial.jsonl"
    capsys.readouterr()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "5", "-o", str(out_file)))
    _, err = capsys.readouterr()
    assert rc == 130
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("selfspec:")]
    assert len(lines) == 1 and lines[0].startswith("selfspec: interrupted"), err
    # the target is written only by a finished run; the finished records are in the partial file the message names
    assert not out_file.exists()
    (partial,) = tmp_path.glob("partial.jsonl.*.partial")
    assert str(partial) in lines[0] and "2 finished records" in lines[0]
    raw = partial.read_text()
    assert raw.endswith("\n")
    lines = raw.splitlines()
    assert len(lines) == 2
    recs = [json.loads(line) for line in lines]
    assert [r["id"] for r in recs] == [1, 2]
    for r in recs:
        check_record(r, 5)


# ---------------------------------------------------------------- bench


def test_bench_ar_vs_hf(capsys, monkeypatch, virtual_clock, tiny_model_dir, prompt_file, tmp_path):
    """ar against Hugging Face generate on a machine with known costs (conftest.VirtualClock):
    each of the engine's forwards costs 1 ms, each of Hugging Face's model calls 2 ms, so ar makes
    1000 tokens/s, hf 500, and every speedup is known. Injected faults: ar's second of three passes
    differs from its first at token 1 of prompt 3, its third at token 5 of prompt 2. Parity
    compares every pass with the reference's first and reports the worst, so ar is 3 of 4
    identical with prompt 3 differing at 1, and hf, which matches ar's first pass, 4 of 4."""
    import transformers
    from collections import Counter

    from selfspec_cli.methods import application  # where bench's prompts are decoded

    charge_forwards(monkeypatch, virtual_clock, lambda engine, rows, kw: 1e-3)
    hf_forward = transformers.LlamaForCausalLM.forward

    def charged_hf_forward(self, *args, **kwargs):
        virtual_clock.advance(2e-3)
        return hf_forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", charged_hf_forward)
    runs, real_run = Counter(), application.run_prompt
    faults = {(2, 3): 1, (3, 2): 5}  # (ar's pass, counting from 1; prompt id) -> the token made to differ

    def run_prompt(generate, tokenizer, prompt, *args):
        rec = real_run(generate, tokenizer, prompt, *args)
        runs[rec.method, prompt.id] += 1
        if rec.method == "ar" and (i := faults.get((runs["ar", prompt.id], prompt.id))) is not None:
            ids = rec.token_ids
            assert len(ids) > i
            rec = dataclasses.replace(rec, token_ids=[*ids[:i], (ids[i] + 1) % 320, *ids[i + 1:]])
        return rec

    monkeypatch.setattr(application, "run_prompt", run_prompt)  # bench decodes through it
    out_dir = tmp_path / "bench-out"
    capsys.readouterr()
    rc = main(["bench", "--methods", "ar,hf", "--model", str(tiny_model_dir), "-n", "8", "--warmup", "0",
               "--repeats", "3", "-p", str(prompt_file), "--device", "cpu", "--output-dir", str(out_dir), "--no-plots",
               "--no-costs"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    head = json.loads(out.strip().splitlines()[-1])
    assert head["prompts"] == len(PROMPTS) and head["max_new_tokens"] == 8
    doc = json.loads((out_dir / "results.json").read_text())
    assert head["results"] == str(out_dir / "results.json")
    assert doc["reference"] == "ar" and doc["baseline"] == "hf"
    ar, hf = doc["methods"]["ar"], doc["methods"]["hf"]
    assert ar["parity"]["parity"] == 0.75 and ar["parity"]["differing"] == [{"id": 3, "first_divergence": 1}]
    assert hf["parity"]["parity"] == 1.0 and hf["parity"]["differing"] == []  # HF generate: ar's greedy ids
    assert {"tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "parity"} <= set(head["methods"]["hf"])
    assert head["methods"]["ar"]["parity"] == 0.75 and head["methods"]["hf"]["parity"] == 1.0
    # the figures the known costs make
    assert ar["tokens_per_s"] == ar["tokens_per_s_min"] == ar["tokens_per_s_max"] == pytest.approx(1000.0)
    assert hf["tokens_per_s"] == pytest.approx(500.0) and ar["decode_tokens_per_s"] == pytest.approx(1000.0)
    assert hf["speedup_vs_ar"] == 0.5 and ar["speedup_vs_hf"] == 2.0
    assert hf["paired_vs_ar"] == {"speedup": 0.5, "ci95": [0.5, 0.5], "pairs": 3 * len(PROMPTS)}
    assert hf["decode_speedup_vs_ar"] is None  # HF reports no prefill time
    assert 0 < ar["new_tokens"] == hf["new_tokens"] <= 8 * len(PROMPTS)
    recs = {name: [json.loads(line) for line in (out_dir / "records" / f"{name}.jsonl").read_text().splitlines()]
            for name in ("ar", "hf")}
    for name, rs in recs.items():
        assert [(r["repeat"], r["id"]) for r in rs] == [(p, i) for p in range(3) for i in (1, 2, 3, 4)]
        assert all(r["method"] == name and r["new_tokens"] <= 8 for r in rs)
    first = [r["token_ids"] for r in recs["ar"][:4]]
    assert all([r["token_ids"] for r in recs["hf"][4 * p: 4 * p + 4]] == first for p in range(3))


# ---------------------------------------------------------------- help


def test_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--prompt-file" in out and "--max-new-tokens" in out
    assert main(["bench", "--help"]) == 0
    assert "--methods" in capsys.readouterr().out


# ---------------------------------------------------------------- the installed console script


def test_console_script_bad_input_exits_2(tmp_path, tiny_model_dir):
    exe = shutil.which("selfspec")
    if exe is None:
        candidate = Path(sys.executable).with_name("selfspec")
        exe = str(candidate) if candidate.exists() else None
    if exe is None:
        pytest.skip("the selfspec console script is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([exe, "generate", "-m", str(tiny_model_dir), "-p", str(tmp_path / "missing.txt")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("selfspec: error:"), proc.stderr
    assert "missing.txt" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("argv", [["generate"], ["generate", "-p", "x.txt", "--bogus"], ["generate", "-p", "x.txt", "-n", "abc"]])
def test_usage_errors_exit_2_without_traceback(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


def test_chat_template_used_when_present_and_flag_turns_it_off(capsys, tiny_model_dir, tiny_tokenizer, tmp_path):
    from selfspec_cli.runtime import encode_turn

    d = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, d)
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tok.save_pretrained(d)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f():\n")
    history = [{"role": "user", "content": "def f():"}]
    with_tpl = encode_turn(tok, history, True)
    ref = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert with_tpl == list(ref)
    assert tok.decode(with_tpl).startswith("<s>user: def f():")
    assert encode_turn(tok, history, False) == tok("def f():")["input_ids"]
    assert main(["generate", "-p", str(prompts), "--model", str(d), "-n", "4", "--device", "cpu"]) == 0
    on = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["generate", "-p", str(prompts), "--model", str(d), "-n", "4", "--device", "cpu", "--no-chat-template"]) == 0
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on["prompt_tokens"] == len(with_tpl) > off["prompt_tokens"]


def test_self_sd_without_artifact_names_the_calibrate_command(capsys, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    import selfspec_cli.loading as loading

    monkeypatch.setattr(loading, "ARTIFACTS_DIR", tmp_path)
    for argv in (["generate", "-p", str(prompt_file), "--method", "self-sd"], ["bench", "--methods", "ar,self-sd", "-p", str(prompt_file)]):
        assert main([*argv, "--model", str(tiny_model_dir), "-n", "4", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "selfspec calibrate --method self-sd" in err and "Traceback" not in err


def test_hybrid_and_draft_vocab_flags(capsys, tiny_model_dir, prompt_file):
    """--hybrid / --no-hybrid (a switch auto has on) and --draft-vocab reach the methods; exact output."""
    want = [r["token_ids"] for r in run_generate(capsys, tiny_model_dir, prompt_file, "-n", "12")]
    for extra in (["--method", "self-sd", "--skip-attn", "1", "--skip-mlp", "1", "--hybrid", "--draft-vocab", "full"],
                  ["--method", "auto", "--no-hybrid"], ["--method", "auto", "--hybrid"]):
        got = [r["token_ids"] for r in run_generate(capsys, tiny_model_dir, prompt_file, "-n", "12", *extra)]
        assert got == want, extra
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "self-sd", "--skip-attn", "1",
                                       "--draft-vocab", "full", "--draft-vocab-size", "8"), "--draft-vocab-size")
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "pld", "--hybrid"), "--hybrid", "pld")


def test_option_metavars_without_typers_display_type(monkeypatch):
    """Before typer 0.16 an option has no ``display_type`` (a GPU machine's image had such a typer): the
    help's value names then come from click's type names, and every command still builds."""
    import typer

    from selfspec_cli.cli import app as app_mod

    from types import SimpleNamespace

    cmd = typer.main.get_command(app_mod.app)
    click_names = {"<int>": "integer", "<float>": "float", "<path>": "path"}  # click's ParamType.name
    for c in cmd.commands.values():
        for p in c.params:
            if p.param_type_name == "option":  # what an older typer's option holds: click's type, no display_type
                p.type = SimpleNamespace(name=click_names.get(str(p.display_type(None)), "text"))
            p.metavar = None
    option = next(p for p in cmd.commands["generate"].params if p.param_type_name == "option")
    owner = next(c for c in type(option).__mro__ if "display_type" in c.__dict__)
    monkeypatch.delattr(owner, "display_type")
    app_mod._metavars(cmd)
    shown = {p.name: p.metavar for p in cmd.commands["generate"].params}
    assert shown["max_new_tokens"] == "N" and shown["temperature"] == "X" and shown["model"] == "TEXT"


def test_a_long_prompt_says_its_prefill_and_the_rate_is_over_the_decode(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 50: a 6,034-token prompt prefilled for 82 s while the bar sat at 0/1, and the summary then read
    '4 tokens in 82.4 s, 0.0 tok/s'. A long prompt's prefill is said before it starts; the rate is the decode's.
    (The tiny model's context is 256 tokens: the threshold is lowered to fit it.)"""
    from selfspec_cli.cli import generate

    monkeypatch.setattr(generate, "LONG_PROMPT", 64)
    LONG_PROMPT = generate.LONG_PROMPT
    long_text = " ".join(f"word{i}" for i in range(20))
    short = write_lines(tmp_path / "p.txt", [long_text, "short prompt"])
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, short, "-n", "4", "--no-chat-template")) == 0
    out, err = capsys.readouterr()
    recs = [json.loads(line) for line in out.splitlines()]
    assert recs[0]["prompt_tokens"] >= LONG_PROMPT > recs[1]["prompt_tokens"]  # the premise
    said = [line for line in err.splitlines() if "prefilling" in line]
    assert len(said) == 1 and said[0].startswith(f"1: prefilling {recs[0]['prompt_tokens']} prompt tokens")
    assert "tokens/s over the decode only" in err


def test_a_long_prompts_prefill_progress_advances_per_chunk(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 50: a long prefill's progress advances. The prefill runs in chunks (DecodeState.prefill), and the bar
    hears of each: 'prefilled 8/N', '16/N', ... 'N/N', in order, for the long prompt only; the tokens are the
    same as with one chunk (the chunks give the same bits)."""
    from rich.progress import Progress

    from selfspec_cli.cli import generate
    from selfspec_cli.decoding import state

    monkeypatch.setattr(generate, "LONG_PROMPT", 64)
    prompts = write_lines(tmp_path / "p.txt", [" ".join(f"word{i}" for i in range(20)), "short prompt"])
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, prompts, "-n", "4", "--no-chat-template")) == 0
    whole = [json.loads(line)["token_ids"] for line in capsys.readouterr()[0].splitlines()]

    infos: list[str] = []
    real = Progress.update
    monkeypatch.setattr(Progress, "update", lambda self, task, **kw: infos.append(kw.get("info", "")) or real(self, task, **kw))
    monkeypatch.setattr(state, "PREFILL_CHUNK", 8)
    assert main(gen_args(tiny_model_dir, prompts, "-n", "4", "--no-chat-template")) == 0
    recs = [json.loads(line) for line in capsys.readouterr()[0].splitlines()]
    assert [r["token_ids"] for r in recs] == whole
    n = recs[0]["prompt_tokens"]
    done = [int(i.split("prefilled ")[1].split("/")[0]) for i in infos if "prefilled" in i]
    assert done == list(range(8, n, 8)) + [n], (done, n)
    assert all(i.startswith("1: ") for i in infos if "prefilled" in i)
