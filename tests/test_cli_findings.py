"""Reproductions from the second new-user session (shared/notes/new-user-findings.md, items 6,
10, 12, 13, 14, 16 and 18), each with the behaviour a user should get: bench tables readable at
80 columns, the artifact a method loads named and a useless trained artifact kept off the
default path, no unsearched SWIFT skip set saved, options that are ignored or conflict refused
before the model loads, the README's flags equal to the commands' own."""
from __future__ import annotations

import io
import json
import shutil
import re
from pathlib import Path

import pytest

from selfspec_cli.cli.app import main

from .test_cli import assert_user_error, gen_args, prompt_file, run_generate, write_jsonl, write_lines  # noqa: F401 (fixture)

README = Path(__file__).resolve().parent.parent / "README.md"
COMMANDS = ("generate", "calibrate", "train-heads", "bench", "profile", "chat")


# ---------------------------------------------------------------- 6. bench tables at 80 columns


def _figures(summary: dict) -> list[str]:
    """The figures bench's main table shows, as it formats them."""
    out = []
    for m in summary.values():
        out += [f"{m['tokens_per_s']:.1f}", f"{m['tokens_per_s_min']:.1f}-{m['tokens_per_s_max']:.1f}"]
        out += [f"{m[k]:.2f}x" for k in ("speedup_vs_ar", "speedup_vs_hf") if m.get(k) is not None]
        if (p := m.get("paired_vs_ar")) and p.get("ci95"):
            out.append(f"{p['speedup']:.3f}x [{p['ci95'][0]:.2f}-{p['ci95'][1]:.2f}]")
        if m.get("parity"):
            out.append(f"{m['parity']['parity']:.0%} ({m['parity']['token_parity']:.1%} tok)")
    return out


def test_bench_tables_keep_every_figure_whole_at_80_columns(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """The main table once squeezed 12 columns into 80 and cut the figures (`1.…`); now its
    columns are split over as many tables as the width needs, each repeating the method."""
    from rich.console import Console

    from selfspec_cli.bench.report import MethodSummary
    from selfspec_cli.cli import bench as bench_cli
    from selfspec_cli.cli import common

    monkeypatch.setattr(common.err_console, "width", 80)
    prompts = write_lines(tmp_path / "p.txt", ["alpha beta gamma", "one two three one two"])
    capsys.readouterr()
    assert main(["bench", "--methods", "ar,hf,pld,asd", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "6",
                 "--warmup", "0", "--repeats", "2", "--no-plots", "--no-costs", "--device", "cpu",
                 "-o", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "…" not in err
    table_lines = [line for line in err.splitlines() if set(line) & set("│┃┏┡└━─")]
    assert table_lines and max(len(line) for line in table_lines) <= 80
    summary = json.loads((tmp_path / "b" / "results.json").read_text())["methods"]
    for fig in _figures(summary):
        assert fig in err, fig
    for name in summary:
        assert re.search(rf"│ {re.escape(name)} +│", err), name  # the method names are whole too
    # one table when the width allows it
    wide = Console(width=250, record=True, file=io.StringIO())
    wide.print(bench_cli._table({n: MethodSummary.from_dict(m) for n, m in summary.items()}, "t", True, False))
    assert wide.export_text().count("method") == 1


# ---------------------------------------------------------------- 10. which artifact, and no useless default


def test_generate_names_the_artifact_it_loads(capsys, tiny_model_dir, prompt_file, tmp_path):
    from selfspec_cli.artifacts import save_json_artifact
    from selfspec_cli.loading import load_model
    from selfspec_cli.methods.self_sd import SKIP_SET

    model, _ = load_model(str(tiny_model_dir), device="cpu")
    art = tmp_path / "skip.json"
    save_json_artifact(art, {**SKIP_SET.header(model), "skip_attn": [1], "skip_mlp": [2]})
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, prompt_file, "-n", "4", "--method", "self-sd", "--layers", str(art))) == 0
    out, err = capsys.readouterr()
    assert f"using self-sd-layers {art}" in err
    recs = [json.loads(line) for line in out.splitlines()]
    assert recs and all(r["artifacts"] == {"self-sd-layers": str(art)} for r in recs)
    # a method that loads none says nothing of the kind
    recs = run_generate(capsys, tiny_model_dir, prompt_file, "-n", "3")
    assert all("artifacts" not in r for r in recs)


def _useless_model_dir(tmp_path, tokenizer) -> Path:
    """A tiny Llama whose last layer decides the output alone (its MLP scaled up a hundredfold), so
    no earlier layer's head can predict the model's token."""
    import torch

    from .conftest import make_tiny_model

    model = make_tiny_model("llama-gqa", seed=3)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(100.0)
    d = tmp_path / "last-layer-model"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_heads_that_predict_nothing_do_not_become_the_default(capsys, tiny_tokenizer, tmp_path, selfspec_home):
    """A throwaway train-heads run (top-1 0.000) once replaced the heads generate loads, silently."""
    model_dir = _useless_model_dir(tmp_path, tiny_tokenizer)
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(6)])
    capsys.readouterr()
    rc = main(["train-heads", "--kind", "lm-heads", "-m", str(model_dir), "-p", str(prompts), "-n", "8", "--layers", "0",
               "--epochs", "1", "--rank", "2", "--lr", "1e-9", "--device", "cpu", "--cache-dir", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["report"][0]["top1_after"] == 0.0  # the premise: a head of no use
    art = Path(summary["artifact"])
    assert art.name.endswith(".unusable") and summary["usable"] is False
    assert not (art.parent / art.name.removesuffix(".unusable") / "manifest.json").exists()  # no heads at the default
    warning = [line for line in err.splitlines() if "warning:" in line]
    assert len(warning) == 1 and "not made this model's default" in warning[0] and f"rm -r '{art}'" in warning[0]
    # generate finds no heads of this model: the useless ones are not its default
    assert_user_error(capsys, gen_args(model_dir, prompts, "-n", "3", "--method", "adadecode"), "no AdaDecode heads")


# ---------------------------------------------------------------- 12. swift --save-layers without a search


def test_swift_refuses_to_save_a_skip_set_it_never_searched(capsys, tiny_model_dir, prompt_file, tmp_path):
    saved = tmp_path / "swift.json"
    capsys.readouterr()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "4", "--method", "swift", "--save-layers", str(saved),
                       "-o", str(tmp_path / "out.jsonl")))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "evaluated no candidate" in err and "--optimize-budget" in err
    assert not saved.exists()
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4  # the records themselves are kept


# ---------------------------------------------------------------- 13, 14. refused up front


def test_train_heads_refuses_a_layer_listed_twice_before_loading(capsys, tmp_path):
    prompts = write_lines(tmp_path / "p.txt", ["a", "b", "c"])
    # a model that does not exist: a refusal that names --layers came before any loading
    assert_user_error(capsys, ["train-heads", "--kind", "lm-heads", "-m", str(tmp_path / "no-model"), "-p", str(prompts),
                               "--layers", "3,1,3"], "--layers", "layer 3 more than once")


@pytest.mark.parametrize("extra,fragments", [
    (("--append",), ("--append", "--output FILE")),
    (("--force",), ("--force", "--output FILE")),
    (("-o", "-", "--append"), ("--append",)),
    (("--top-k", "5"), ("--top-k", "--temperature")),
    (("--top-p", "0.9"), ("--top-p", "--temperature")),
    (("--sampling-rule", "speculative"), ("--sampling-rule", "--temperature")),
    (("--method", "auto", "--ngram-only", "--draft-precision", "int8"), ("--ngram-only/--draft-precision", "conflict")),
    (("--method", "specee", "-t", "0.5"), ("--method specee", "greedily", "--temperature 0")),
])
def test_ignored_or_conflicting_generate_options_are_refused_up_front(capsys, tmp_path, prompt_file, extra, fragments):
    """Each was accepted without a word (or refused only after the model loaded); a model path
    that does not exist shows that the refusal comes before any loading."""
    assert_user_error(capsys, gen_args(tmp_path / "no-model", prompt_file, *extra), *fragments)


def test_skip_layers_out_of_range_are_refused_before_the_weights_load(capsys, tiny_model_dir, prompt_file, monkeypatch):
    from selfspec_cli import session

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(session, "load_model", no_loading)  # every command loads through the session (issue 36)
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "self-sd", "--skip-attn", "1,99"),
                      "--skip-attn/--skip-mlp", "[99]", "4-layer model")


def test_offline_steps_refuse_bad_paths_before_loading(capsys, tmp_path):
    prompts = write_lines(tmp_path / "p.txt", ["a", "b", "c"])
    missing = str(tmp_path / "no-model")
    (tmp_path / "notamodel").mkdir()
    assert_user_error(capsys, ["train-heads", "--kind", "exit-mlp", "-m", missing, "-p", str(prompts), "--heads",
                               str(tmp_path / "notamodel")], "--heads", "not an AdaDecode heads artifact",
                      "selfspec train-heads --kind lm-heads")
    assert_user_error(capsys, ["calibrate", "--method", "self-sd", "-m", missing, "-p", str(prompts), "--storage",
                               "bogus://x"], "--storage", "neither a database URL")


# ---------------------------------------------------------------- 16. the README's flags are the commands' own


def _section(command: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"### `selfspec {command}`")
    end = min(i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1)) if i > 0)
    return text[start:end]


def _synopsis(command: str) -> str:
    sec = _section(command)
    start = sec.index("```bash") + len("```bash")
    return sec[start:sec.index("```", start)]


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _help_options(command: str) -> list[set[str]]:
    """The long names of each option ``selfspec <command> --help`` lists (click's own list, hidden
    ones left out): ``{"--chat-template", "--no-chat-template"}`` is one option."""
    import typer

    from selfspec_cli.cli.app import app

    cmd = typer.main.get_command(app).commands[command]
    return [names for p in cmd.params if not getattr(p, "hidden", False)
            if (names := {o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} - {"--help"})]


def _help_flags(command: str) -> set[str]:
    return set().union(*_help_options(command))


def _method_table() -> list[tuple[set[str], str]]:
    """(flags, methods column) of each row of the README's method-flag table."""
    rows = []
    for line in _section("generate").splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append((set(FLAG.findall(cells[0])), cells[1]))
    return rows


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_flags_exist_in_the_commands_help(command):
    documented = set(FLAG.findall(_synopsis(command)))
    if command == "generate":
        documented |= {f for flags, _ in _method_table() for f in flags}
    help_flags = _help_flags(command)
    assert documented - help_flags == set(), f"the README documents flags {command} --help does not list"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_flag_is_in_the_readme(command):
    documented = set(FLAG.findall(_section(command)))
    missing = sorted(min(names) for names in _help_options(command) if not names & documented)
    assert missing == [], f"{command} --help lists options its README section never names"


def test_readme_method_table_names_the_methods_that_take_each_flag():
    from selfspec_cli.cli.method_options import flag, option_fields
    from selfspec_cli.methods import METHODS

    owners = {flag(name): set(methods) for name, (_, _, methods) in option_fields().items()}
    checked = 0
    for flags, column in _method_table():
        named = set(re.findall(r"[a-z][a-z0-9-]*", column)) & set(METHODS)
        for f in flags & set(owners):
            assert named == owners[f], (f, sorted(named), sorted(owners[f]))
            checked += 1
    assert checked > 20


def test_every_option_has_help_text():
    import typer

    from selfspec_cli.cli.app import app

    for name, cmd in typer.main.get_command(app).commands.items():
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                assert (p.help or "").strip(), (name, p.opts)


# ---------------------------------------------------------------- 18. small messages


def test_a_malformed_jsonl_line_names_its_column(capsys, tiny_model_dir, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "torn\n', encoding="utf-8")
    assert_user_error(capsys, gen_args(tiny_model_dir, bad), "line 2 is not valid JSON", "column 12")


def test_bench_messages(capsys, tiny_model_dir, prompt_file, tmp_path):
    assert_user_error(capsys, ["bench", "--methods", "ar,hf", "-m", str(tiny_model_dir), "-p", str(prompt_file), "-t", "0.8",
                               "-o", str(tmp_path / "b")], "hf runs greedy only")
    msg = assert_user_error(capsys, ["bench", "--methods", " , ", "-p", str(prompt_file), "-o", str(tmp_path / "b")],
                            "--methods names no contender", "choose from")
    assert "(none)" not in msg
    assert_user_error(capsys, ["bench", "--methods", "ar", "-p", str(prompt_file), "--top-k", "4", "-o",
                               str(tmp_path / "b")], "--top-k", "--temperature")


def test_advice_for_a_broken_layers_file_recreates_that_file(capsys, tiny_model_dir, prompt_file, tmp_path):
    junk = tmp_path / "mine.json"
    junk.write_text("not json", encoding="utf-8")
    msg = assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--method", "self-sd", "--layers", str(junk)),
                            "is not valid JSON", "delete it")
    assert f"--output {junk}" in msg and "--force" not in msg


def test_help_names_values_not_type_names(capsys):
    for command in COMMANDS:
        capsys.readouterr()
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "<str>" not in out and "<list" not in out and "<int>" not in out, command
    main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--method ar|self-sd|" in out and "--stop TEXT" in out and "--prompt-format auto|text|jsonl" in out


def test_a_failed_train_heads_run_leaves_no_empty_directory(capsys, tiny_model_dir, tmp_path):
    prompts = write_lines(tmp_path / "p.txt", ["a b", "c d", "e f"])
    out = tmp_path / "th_y"
    assert_user_error(capsys, ["train-heads", "--kind", "lm-heads", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "4",
                               "--layers", "9", "-o", str(out), "--device", "cpu"], "--layers", "0..2")
    assert not out.exists()


def test_an_unsupported_gguf_is_refused_from_its_header_before_it_is_hashed(capsys, tmp_path, prompt_file, monkeypatch):
    """A command-r GGUF was hashed (25 s for a real one) and remembered before its header was read."""
    from selfspec_cli import loading

    from .gguf_utils import write_non_llama_gguf

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = write_non_llama_gguf(tmp_path / "cmdr.gguf", "command-r")
    assert_user_error(capsys, gen_args(path, prompt_file), "architecture 'command-r'", "not supported")
    index = loading.model_cache_dir() / "hashes.json"
    assert not index.exists() or str(path.resolve()) not in index.read_text(encoding="utf-8")


def test_offline_step_flags_are_made_from_the_steps_options():
    """calibrate's and train-heads' step options are flags made from each step's typed Options
    (issue 36): one flag per field, named after it, hidden where the field says so, its help
    naming the steps that take it."""
    import dataclasses

    import typer

    from selfspec_cli.cli.app import app
    from selfspec_cli.methods import OFFLINE

    group = typer.main.get_command(app)
    seen = 0
    for (command, name), step in OFFLINE.items():
        params = {p.name: p for p in group.commands[command].params}
        for f in dataclasses.fields(step.Options or type("NoOptions", (), {"__dataclass_fields__": {}})):
            p = params[f.name]
            assert p.opts == ["--" + f.name.replace("_", "-")] and p.default is None
            assert p.hidden == bool(f.metadata.get("hidden")) and name in p.help, (command, f.name)
            seen += 1
    assert seen >= 12 + 7 + 6  # self-sd's, lm-heads' and exit-mlp's options


# ---------------------------------------------------------------- streaming to a terminal


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_stream_prints_each_records_text_as_it_comes(capsys, tiny_model_dir, tmp_path, method):
    """--stream (the default when stdout is a terminal) prints the texts the JSONL records hold, a header per
    prompt when there are several and a blank line between a conversation's turns, and nothing else; the
    text arrives in pieces (one write per kept round), not at the end."""
    from selfspec_cli.cli import generate as g

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f(x):"},
                                                 {"id": "b", "turns": ["Hello there", "And then"]}])
    records = run_generate(capsys, tiny_model_dir, prompts, "--method", method, "-n", "10")
    writes: list[str] = []
    real = g.write_out
    g.write_out = lambda text: (writes.append(text), real(text))
    try:
        capsys.readouterr()
        rc = main(gen_args(tiny_model_dir, prompts, "--method", method, "-n", "10", "--stream"))
    finally:
        g.write_out = real
    out, err = capsys.readouterr()
    assert rc == 0, err
    turns_b = records[1]["turns"]
    want = (f"--- a\n{records[0]['text']}\n" + f"\n--- b\n{turns_b[0]['text']}\n\n{turns_b[1]['text']}\n")
    assert out == want
    assert len([w for w in writes if w.strip()]) > 4  # pieces as they come


def test_stream_with_an_output_file_is_one_line(capsys, tiny_model_dir, prompt_file, tmp_path):
    assert_user_error(capsys, gen_args(tiny_model_dir, prompt_file, "--stream", "-o", str(tmp_path / "o.jsonl")),
                      "--stream", "--output")


def test_text_streamer_holds_a_torn_character_back():
    class Bytes:  # a byte-level tokenizer: token i is byte i
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    said: list[str] = []
    from selfspec_cli.cli.streaming import TextStreamer

    s = TextStreamer(Bytes(), said.append)
    euro = list("€".encode())  # three bytes
    s.push([ord("a")])
    s.push(euro[:2])  # a torn character: nothing printed
    assert said == ["a"]
    s.push(euro[2:] + [ord("b")])
    s.push(euro[:1])
    s.end(torn=True)  # cut by the length limit: the torn tail is left out, as the record's text leaves it
    assert "".join(said) == "a€b" and said[1] == "€b"
    s.push([0xFF])  # an invalid byte that ends a turn stopped otherwise is kept, as in the record
    s.end(torn=False)
    assert said[-1] == "\ufffd"


@pytest.mark.parametrize("dtype,noted", [("bfloat16", True), ("float16", True), ("float32", False), ("auto", False)])
def test_16_bit_dtype_on_cpu_says_it_is_not_transformers_arithmetic(capsys, tiny_model_dir, prompt_file, dtype, noted):
    """Finding 11: 16-bit arithmetic on CPU can differ from transformers' generate at near-ties; one stderr
    line says so (and names the exact default), float32 says nothing."""
    capsys.readouterr()
    rc = main(gen_args(tiny_model_dir, prompt_file, "-n", "2", "--dtype", dtype))
    _, err = capsys.readouterr()
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "computes in 16 bits" in ln]
    assert len(lines) == (1 if noted else 0), err
    if noted:
        assert f"--dtype {dtype} on CPU" in lines[0] and "float32" in lines[0]


# ---------------------------------------------------------------- 15. generate --resume


def test_generate_resume_carries_on_an_interrupted_output(capsys, tiny_model_dir, tmp_path):
    """An interrupted run keeps its finished records in ``<output>.<random>.partial``; ``--resume``
    moves them into --output, decodes only the prompts still missing and adds theirs: every
    prompt once, each record as a fresh run makes it; a finished file is left alone, before any
    model loads; a file of another run (method, prompt text, model, settings) is refused in one line,
    and records written before they kept their settings are matched by id, method and text."""
    prompts = [{"id": f"q{i}", "prompt": f"question number {i} is"} for i in range(4)]
    pf = write_jsonl(tmp_path / "p.jsonl", prompts)
    fresh = run_generate(capsys, tiny_model_dir, pf, "-n", "5")
    out = tmp_path / "out.jsonl"
    # a run over the first prompt whose second record was torn by an interrupt (an --append run),
    # and a kept partial holding the first two (one already in out)
    assert fresh[0]["settings"]["max_new_tokens"] == 5 and fresh[0]["settings"]["model"] == str(tiny_model_dir)
    write_jsonl(out, [{k: v for k, v in fresh[0].items() if k != "settings"}])  # as an older version wrote it
    with out.open("a") as f:
        f.write(json.dumps(fresh[1])[:40])
    write_jsonl(tmp_path / "out.jsonl.x1y2.partial", fresh[:2])
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, pf, "-n", "5", "-o", str(out), "--resume")) == 0
    err = capsys.readouterr().err
    assert "holds 2 of 4" in err and "decoding the other 2" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in got] == ["q0", "q1", "q2", "q3"]
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in fresh]
    assert not list(tmp_path.glob("out.jsonl.*.partial"))
    capsys.readouterr()
    assert main(gen_args(tiny_model_dir, pf, "-n", "5", "-o", str(out), "--resume")) == 0
    assert "nothing to decode" in capsys.readouterr().err and len(out.read_text().splitlines()) == 4
    # refusals, each one line before any work
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-o", str(out), "--resume", "--method", "pld"),
                      "--resume", "--method ar", "--force")
    edited = write_jsonl(tmp_path / "p2.jsonl", [{**p, "prompt": p["prompt"] + "!"} if p["id"] == "q1" else p
                                                 for p in prompts])
    assert_user_error(capsys, gen_args(tiny_model_dir, edited, "-o", str(out), "--resume"), "another text", "q1")
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-n", "7", "-o", str(out), "--resume"),
                      "other settings", "--max-new-tokens 5 there, 7 now")
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-n", "5", "-o", str(out), "--resume", "-t", "0.7"),
                      "--temperature 0.0 there, 0.7 now")
    other = shutil.copytree(tiny_model_dir, tmp_path / "another-model")
    assert_user_error(capsys, gen_args(other, pf, "-n", "5", "-o", str(out), "--resume"), "--model", "another-model")
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "--resume"), "--resume", "--output FILE")
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-o", str(out), "--resume", "--force"), "drop --force")


# ---------------------------------------------------------------- 15. an interactive chat


def test_chat_answers_each_turn_as_generate_does(capsys, tiny_model_dir, tmp_path, monkeypatch):
    """``selfspec chat`` answers each stdin line from the conversation so far: its answers are the
    turns of ``generate``'s record for a prompt with the same turns; /reset starts over (the next
    answer is a first turn's), and the end of input ends it with status 0."""
    pf = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "turns": ["hello there", "and then"]}, {"id": 2, "prompt": "again"}])
    recs = run_generate(capsys, tiny_model_dir, pf, "-n", "6", "--method", "pld")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand then\n/reset\nagain\n"))
    capsys.readouterr()
    rc = main(["chat", "-m", str(tiny_model_dir), "--device", "cpu", "-n", "6", "--method", "pld"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == "".join(t["text"] + "\n" for t in recs[0]["turns"]) + recs[1]["text"] + "\n"
    assert "a new conversation" in err and "Traceback" not in err
    assert_user_error(capsys, ["chat", "-m", str(tiny_model_dir), "--method", "nope"], "--method")
    # an answer length no turn can fit beside is refused before the first turn, not at every turn
    assert_user_error(capsys, ["chat", "-m", str(tiny_model_dir), "--device", "cpu", "-n", "100000"],
                      "--max-new-tokens 100000 leaves no room", "pass a smaller --max-new-tokens")
    # a lossy method says so, and the artifacts it loads are named (the shipped code model has specee's)
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n"))
    assert main(["chat", "-m", "pystdlib", "--device", "cpu", "-n", "4", "--method", "specee"]) == 0
    err = capsys.readouterr().err
    assert "--method specee is lossy" in err and "using " in err


def test_resume_finds_the_partial_of_an_output_whose_name_has_glob_characters(tmp_path):
    from selfspec_cli.cli.resume import kept_partials

    out = tmp_path / "run[1]*.jsonl"
    kept = tmp_path / "run[1]*.jsonl.ab12.partial"
    kept.write_text("")
    (tmp_path / "run1x.jsonl.cd34.partial").write_text("")  # what the unescaped pattern would also match
    assert kept_partials(out) == [kept]


def test_a_block_precision_on_a_model_without_gguf_blocks_names_the_flag_given(capsys, tiny_model_dir, tmp_path):
    """--target-precision gguf and --draft-precision gguf or w4a8 on a model not converted from a GGUF: the
    refusal names the flag and value the user gave, and a fix that flag takes."""
    pf = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "hello"}])
    err = assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-n", "2", "--target-precision", "gguf"),
                            "--target-precision gguf", "not loaded from a GGUF file", "use --target-precision auto")
    assert "--draft-precision" not in err and "int8" not in err
    for asked in ("gguf", "w4a8"):
        err = assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-n", "2", "--method", "specqd",
                                                 "--draft-precision", asked),
                                f"--draft-precision {asked} needs the model's GGUF blocks", "--draft-precision int8")


def test_a_model_directory_without_a_tokenizer_is_one_line(capsys, tiny_model_dir, tmp_path):
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template")):
            shutil.copy(f, bare / f.name)
    pf = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "hello"}])
    assert_user_error(capsys, gen_args(bare, pf, "-n", "2"), "has no tokenizer", "copy the model's tokenizer files")


def test_exit_predictors_that_never_fire_do_not_become_the_default(capsys, tiny_model_dir, tmp_path, selfspec_home):
    """Predictors none of which fires at its threshold go beside the default path as .unusable with one
    warning, as useless heads do; named explicitly, they are written there, and a schedule of no early exit from
    them says so."""
    prompts = write_lines(tmp_path / "p.txt", ["prompt number one is", "prompt number two is", "the third prompt says",
                                               "four", "five five five", "six is here"])
    base = ["-m", str(tiny_model_dir), "-p", str(prompts), "-n", "8", "--device", "cpu"]
    assert main(["train-heads", "--kind", "lm-heads", *base, "--epochs", "1", "--rank", "2"]) == 0
    capsys.readouterr()
    assert main(["train-heads", "--kind", "exit-mlp", *base, "--epochs", "1"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert all(r["fire_share_at_threshold"] == 0 for r in summary["report"])  # the premise, on this random model
    art = Path(summary["artifact"])
    assert art.name.endswith(".unusable") and summary["usable"] is False and "SpecEE would never exit" in err
    default = art.with_name(art.name.removesuffix(".unusable"))
    assert not (default / "manifest.json").exists()
    # written where the user names it (the warning says it is of no use), a schedule from it exits nowhere
    assert main(["train-heads", "--kind", "exit-mlp", *base, "--epochs", "1", "-o", str(default)]) == 0
    assert "is of no use" in capsys.readouterr().err
    assert main(["calibrate", "--method", "specee", *base]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["exit_rate"] == 0 and "exited early" in err and "--specee-threshold" in err
    # issue 50: a schedule that rests on no exit is too little data: beside the default, never the default
    sched = Path(summary["artifact"])
    assert sched.name.endswith(".too-little-data.json") and summary["too_little_data"] is True
    assert sched.is_file() and not sched.with_name(sched.name.replace(".too-little-data", "")).exists()
    assert main(["calibrate", "--method", "specee", *base, "--force"]) == 0  # --force makes it the default on purpose
    forced = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert forced["artifact"] == str(sched.with_name(sched.name.replace(".too-little-data", "")))
    # heads retrained after the predictors and the schedule were made from the old ones: specee refuses the mix
    assert main(["train-heads", "--kind", "lm-heads", *base, "--epochs", "1", "--rank", "2", "--force"]) == 0
    assert_user_error(capsys, gen_args(tiny_model_dir, prompts, "-n", "3", "--method", "specee"),
                      "trained on the drafts of another heads artifact", "selfspec train-heads --kind exit-mlp")


def test_a_user_artifact_directory_without_its_manifest_is_one_line_not_a_fallback(capsys, tiny_model_dir, tmp_path,
                                                                                selfspec_home):
    """An interrupted first write leaves the tensors without the manifest: generate says so and how to remake it,
    instead of reading the shipped artifact (or none) as if the user had made nothing."""
    from selfspec_cli.loading import load_model
    from selfspec_cli.methods.adadecode import HEADS

    model, _ = load_model(str(tiny_model_dir), device="cpu")
    user = HEADS.default_path(model)
    user.mkdir(parents=True)
    (user / "tensors.safetensors").write_bytes(b"\0" * 16)
    pf = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "hello"}])
    assert_user_error(capsys, gen_args(tiny_model_dir, pf, "-n", "2", "--method", "adadecode"), "holds no manifest",
                      "an interrupted write", "--force", "delete it")
