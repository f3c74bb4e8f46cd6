"""Prompt files: plain text and JSONL (``prompt`` / Spec-Bench ``turns``), paths and stdin."""
from __future__ import annotations

import io
import json

import pytest

from selfspec_cli.errors import PromptFileError, SelfSpecError
from selfspec_cli.prompts import Prompt, parse_prompts, read_prompts


def jsonl(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


# ---------------------------------------------------------------- plain text


def test_plain_text_one_prompt_per_line_ids_are_line_numbers():
    ps = parse_prompts("first prompt\nsecond prompt\n\n   \nfifth line\n", "p.txt")
    assert [p.id for p in ps] == [1, 2, 5]
    assert [p.turns for p in ps] == [("first prompt",), ("second prompt",), ("fifth line",)]
    assert all(p.category is None for p in ps)


def test_plain_text_keeps_line_verbatim_and_handles_crlf():
    ps = parse_prompts("  def f(x):  \r\nreturn {x}\r\n", "p.txt")
    assert [p.turns[0] for p in ps] == ["  def f(x):  ", "return {x}"]
    assert [p.id for p in ps] == [1, 2]


def test_plain_text_line_starting_with_brace_later_is_not_jsonl():
    ps = parse_prompts("hello\n{not json\n", "p.txt")
    assert [p.turns[0] for p in ps] == ["hello", "{not json"]


def test_jsonl_forced_off_treats_json_as_text():
    line = json.dumps({"prompt": "x"})
    ps = parse_prompts(line + "\n", "p.txt", jsonl=False)
    assert ps == [Prompt(id=1, turns=(line,))]


# ---------------------------------------------------------------- JSONL


def test_jsonl_prompt_field_ids_default_to_line_numbers():
    ps = parse_prompts(jsonl({"prompt": "a"}, {"prompt": "b"}) + "\n" + jsonl({"prompt": "c"}), "p.jsonl")
    assert [p.turns for p in ps] == [("a",), ("b",), ("c",)]
    assert [p.id for p in ps] == [1, 2, 4]


def test_jsonl_detected_from_content_without_extension():
    ps = parse_prompts("\n" + jsonl({"prompt": "a"}), "prompts")
    assert ps == [Prompt(id=2, turns=("a",))]


def test_jsonl_id_field_is_kept():
    ps = parse_prompts(jsonl({"id": "abc", "prompt": "a"}, {"id": 42, "prompt": "b"}), "p.jsonl")
    assert [p.id for p in ps] == ["abc", 42]


def test_jsonl_spec_bench_turns_question_id_and_category():
    text = jsonl(
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "math", "turns": ["2+2?"]},
    )
    ps = parse_prompts(text, "question.jsonl")
    assert ps[0] == Prompt(id=81, turns=("Write a poem.", "Now shorter."), category="writing")
    assert ps[1] == Prompt(id=82, turns=("2+2?",), category="math")


def test_jsonl_id_wins_over_question_id_and_non_string_category_is_dropped():
    ps = parse_prompts(jsonl({"id": "x", "question_id": 7, "category": 3, "prompt": "a"}), "p.jsonl")
    assert ps == [Prompt(id="x", turns=("a",), category=None)]


def test_jsonl_malformed_line_names_line_number():
    text = jsonl({"prompt": "ok"}) + "\n" + '{"prompt": "broken"\n'
    with pytest.raises(PromptFileError, match=r"p\.jsonl: line 3 is not valid JSON"):
        parse_prompts(text, "p.jsonl")


def test_jsonl_non_object_line():
    with pytest.raises(PromptFileError, match=r"line 2 is not a JSON object"):
        parse_prompts(jsonl({"prompt": "ok"}, ["a", "b"]), "p.jsonl")


def test_jsonl_missing_field_names_line():
    with pytest.raises(PromptFileError, match=r"line 2 has neither a 'prompt' nor a 'turns' field"):
        parse_prompts(jsonl({"prompt": "ok"}, {"text": "nope"}), "p.jsonl")


def test_jsonl_null_prompt_and_both_fields_are_named():
    with pytest.raises(PromptFileError, match=r"line 2: its 'prompt' is null"):
        parse_prompts(jsonl({"prompt": "ok"}, {"prompt": None}), "p.jsonl")
    with pytest.raises(PromptFileError, match=r"line 1 has both a 'prompt' and a 'turns' field"):
        parse_prompts(jsonl({"prompt": "a", "turns": ["b", "c"]}), "p.jsonl")
    assert parse_prompts(jsonl({"prompt": None, "turns": ["b"]}), "p.jsonl")[0].turns == ("b",)  # datasets' nulls


def test_jsonl_repeated_ids_are_refused():
    """Records are matched to prompts by id (--resume, the bench), so an id may not repeat; a line's
    default id is its line number, which an explicit id can collide with."""
    with pytest.raises(PromptFileError, match=r"p\.jsonl: line 3 repeats the id 1 of line 1; give each prompt its own id"):
        parse_prompts(jsonl({"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}, {"prompt": "c", "id": "1"}), "p.jsonl")
    with pytest.raises(PromptFileError, match=r"line 2 repeats the id 2 of line 1"):
        parse_prompts(jsonl({"prompt": "a", "id": 2}, {"prompt": "b"}), "p.jsonl")
    assert [p.id for p in parse_prompts(jsonl({"prompt": "a", "id": "x"}, {"prompt": "b"}), "p.jsonl")] == ["x", 2]


@pytest.mark.parametrize("bad", [{"prompt": 3}, {"prompt": None}, {"turns": []}, {"turns": "a"}, {"turns": ["a", 1]}])
def test_jsonl_wrong_field_types(bad):
    with pytest.raises(PromptFileError, match=r"line 1"):
        parse_prompts(jsonl(bad), "p.jsonl")


# ---------------------------------------------------------------- empty / files / stdin


@pytest.mark.parametrize("text", ["", "\n\n", "   \n\t\n"])
def test_empty_input_is_an_error(text):
    with pytest.raises(PromptFileError, match="is empty"):
        parse_prompts(text, "p.txt")


def test_read_prompts_plain_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one\n\ntwo\n", encoding="utf-8")
    ps = read_prompts(str(f))
    assert [(p.id, p.turns) for p in ps] == [(1, ("one",)), (3, ("two",))]


def test_read_prompts_jsonl_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(jsonl({"id": "q", "prompt": "é ünïcode"}), encoding="utf-8")
    assert read_prompts(str(f)) == [Prompt(id="q", turns=("é ünïcode",))]


def test_read_prompts_empty_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    with pytest.raises(PromptFileError, match="empty"):
        read_prompts(str(f))


def test_read_prompts_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(PromptFileError, match="does not exist") as ei:
        read_prompts(str(missing))
    assert str(missing) in str(ei.value)
    assert isinstance(ei.value, SelfSpecError)


def test_read_prompts_directory(tmp_path):
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(str(tmp_path))


def test_read_prompts_not_utf8(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9\xff\xfe\n")
    with pytest.raises(PromptFileError, match="cannot read prompt file"):
        read_prompts(str(f))


def test_read_prompts_malformed_jsonl_file_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(jsonl({"prompt": "a"}) + "{oops\n")
    with pytest.raises(PromptFileError, match=r"bad\.jsonl: line 2"):
        read_prompts(str(f))


def test_read_prompts_stdin_plain(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("alpha\nbeta\n"))
    ps = read_prompts("-")
    assert [(p.id, p.turns) for p in ps] == [(1, ("alpha",)), (2, ("beta",))]


def test_read_prompts_stdin_jsonl(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl({"question_id": 5, "turns": ["a", "b"]})))
    assert read_prompts("-") == [Prompt(id=5, turns=("a", "b"))]


def test_read_prompts_stdin_errors_name_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "a"}\n{bad\n'))
    with pytest.raises(PromptFileError, match=r"^stdin: line 2"):
        read_prompts("-")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(PromptFileError, match="stdin holds no prompt; pipe at least one"):
        read_prompts("-")


def test_a_conversation_is_tokenized_once_when_checked_then_decoded(tiny_tokenizer):
    """chat checks that a conversation fits, then decodes it: the template and the tokenizer run once for both
    (encode_turn keeps the last few); another conversation, another flag or another template is encoded anew."""
    import copy

    from selfspec_cli.prompts import encode_turn

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    calls = []
    real = tok.apply_chat_template

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tok.apply_chat_template = counted
    history = [{"role": "user", "content": "def g(x):"}]
    first = encode_turn(tok, history, True)
    assert encode_turn(tok, list(history), True) == first and len(calls) == 1
    first.append(0)  # a caller's list is its own
    assert encode_turn(tok, history, True) == first[:-1]
    assert encode_turn(tok, [*history, {"role": "assistant", "content": "1"}, {"role": "user", "content": "2"}],
                       True) != first[:-1] and len(calls) == 2
    assert encode_turn(tok, history, False) == tok("def g(x):")["input_ids"] and len(calls) == 2
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert encode_turn(tok, history, True) != first[:-1] and len(calls) == 3


def test_a_tokenizer_with_named_chat_templates_is_encoded(tiny_tokenizer):
    """transformers allows a dict of named chat templates: encode_turn's memo must not need it hashable."""
    import copy

    from selfspec_cli.prompts import encode_turn

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = {"default": "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"}
    history = [{"role": "user", "content": "def h():"}]
    assert encode_turn(tok, history, False) == tok("def h():")["input_ids"]
    assert encode_turn(tok, history, False) == tok("def h():")["input_ids"]
