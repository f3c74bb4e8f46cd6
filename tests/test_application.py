"""The application layer (selfspec_cli/methods/application.py): ``open_method`` opens a method as the commands
do, checks what must fit before anything is built and releases the float weights once; ``decode_prompts`` gives
the records ``run_prompt`` gives, tells its hooks as it goes, and carries a conversation (chat) so that its
answers are the turns ``generate`` decodes for one multi-turn prompt."""
from __future__ import annotations

import pytest

from selfspec_cli.config import GenerationConfig
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods.application import DecodeHooks, decode_prompts, open_method
from selfspec_cli.prompts import Prompt
from selfspec_cli.runtime import run_prompt

PROMPTS = [Prompt(id=1, turns=("def add(a, b):",)), Prompt(id="x", turns=("import torch", "and then"))]


@pytest.fixture(scope="module")
def opened(tiny_model_dir):
    return open_method(str(tiny_model_dir), "pld", cfg=GenerationConfig(max_new_tokens=6), prompts=PROMPTS,
                       device="cpu", chat_template=False)


def test_open_method_builds_the_method_and_releases_the_float_weights_once(opened):
    assert opened.name == "pld" and opened.method.lossless
    assert opened.cfg.eos_token_ids == opened.session.eos_token_ids  # the model's end-of-sequence ids
    assert opened.engine.release_float_weights(panels=True) == 0  # released already: nothing left to free


def test_open_method_refuses_a_prompt_that_does_not_fit_before_building(tiny_model_dir):
    built = []

    def check(session, cfg):
        built.append(cfg)
        raise ConfigError("no room")

    long = Prompt(id=1, turns=(" ".join(["word"] * 400),))
    with pytest.raises(ConfigError, match="longer than the model's context|exceeds the model's context"):
        open_method(str(tiny_model_dir), "ar", cfg=GenerationConfig(max_new_tokens=4), prompts=[long], device="cpu",
                    chat_template=False, check=check)
    assert built == []  # the fit is checked first
    with pytest.raises(ConfigError, match="no room"):
        open_method(str(tiny_model_dir), "ar", cfg=GenerationConfig(max_new_tokens=4), device="cpu", check=check)
    assert len(built) == 1 and built[0].eos_token_ids  # the command's check sees the model's config


class Heard(DecodeHooks):
    def __init__(self):
        self.events, self.records = [], []

    def prompt_started(self, index, prompt):
        self.events.append(("prompt", index, prompt.id))

    def turn_started(self, prompt, turn, prompt_tokens):
        self.events.append(("turn", prompt.id, turn))
        return None

    def kept(self, prompt, tokens):
        self.events.append(("kept", prompt.id, list(tokens)))

    def turn_ended(self, prompt, result):
        self.events.append(("ended", prompt.id, list(result.token_ids)))

    def record(self, prompt, record):
        self.records.append(record)
        self.events.append(("record", prompt.id))


def _plain(rec):
    """A record's fields that no timing moves."""
    return {k: getattr(rec, k) for k in ("id", "method", "lossless", "text", "token_ids", "new_tokens", "prompt_tokens",
                                "finish_reason")}


def test_decode_prompts_gives_run_prompts_records_and_tells_its_hooks(opened):
    tok, meth = opened.session.tokenizer, opened.method
    want = [run_prompt(meth.generate, tok, p, opened.cfg, opened.engine.device, "pld", False, True) for p in PROMPTS]
    heard = Heard()
    got = opened.decode(PROMPTS, heard)
    assert [_plain(r) for r in got] == [_plain(r) for r in want]
    assert all(a is b for a, b in zip(heard.records, got, strict=True))  # the hook is handed each record returned
    events = heard.events
    assert [e for e in events if e[0] in ("prompt", "turn", "record")] == [
        ("prompt", 0, 1), ("turn", 1, 0), ("record", 1), ("prompt", 1, "x"), ("turn", "x", 0), ("turn", "x", 1),
        ("record", "x")]
    for rec in got:  # the tokens kept, round by round, are the turns' tokens
        kept = [t for e in events if e[0] == "kept" and e[1] == rec.id for t in e[2]]
        assert kept == rec.token_ids


def test_decode_prompts_without_hooks_calls_generate_as_a_peer_takes_it(opened):
    calls = []

    def generate(ids, cfg):  # no on_tokens: a bench peer's signature
        calls.append(len(ids))
        return opened.method.generate(ids, cfg)

    [rec] = decode_prompts(generate, PROMPTS[:1], opened.session.tokenizer, opened.cfg, opened.engine.device, "peer",
                           chat_template=False)
    assert len(calls) == 1 and rec.method == "peer" and rec.new_tokens == len(rec.token_ids)


def test_a_carried_conversation_answers_as_one_multi_turn_prompt(opened):
    """chat's turns, one prompt each over a carried history, are generate's turns of the whole conversation."""
    whole = opened.decode([PROMPTS[1]])[0]
    history: list[dict[str, str]] = []
    answers = [opened.decode([Prompt(id=k, turns=(t,))], DecodeHooks(), history)[0] for k, t in enumerate(PROMPTS[1].turns)]
    assert [a.token_ids for a in answers] == [t.token_ids for t in whole.turns]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[-1]["content"] == whole.turns[-1].text
