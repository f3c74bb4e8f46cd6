"""``selfspec chat``: a conversation on the terminal (or over a pipe), one method, the answer's text
printed as its tokens come.

Each line read from stdin is a user turn; the answer is decoded from the whole conversation so
far (the chat template's rendering of every turn, as ``generate`` does for a multi-turn prompt),
so an answer here is the token-for-token answer ``generate`` gives the same turns. ``/reset``
starts a new conversation, ``/exit`` (or the end of input) ends it. The answer goes to stdout,
the prompt marker and each turn's pace to stderr, so ``printf 'hi\\n' | selfspec chat`` pipes the
answers alone.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from ..config import GenerationConfig, check_choice
from ..decoding.output import DecodeResult
from ..errors import ConfigError, PromptFileError, count
from ..engine.target import TARGET_PRECISIONS
from ..methods.application import DecodeHooks, Opened, open_method
from ..prompts import Prompt, encode_turn
from ..session import Session, apply_threads, check_device
from . import options as opt
from .common import log, set_exit_note
from .method_options import choose_method
from .streaming import TextStreamer, write_out


def chat(
    model: Optional[str] = opt.model(),
    method: str = opt.method(),
    max_new_tokens: int = opt.max_new_tokens(256, "Exact upper bound on the tokens of each answer."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    seed: int = opt.seed("Seed for sampling (each answer's draws are reproducible from it)."),
    sampling_rule: str = opt.sampling_rule(),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
    threads: Optional[str] = opt.threads(),
) -> None:
    """Talk with the model: each stdin line is a turn, the answer streams to stdout (/reset starts over, /exit ends)."""
    choice = choose_method(method, seed, max_new_tokens, temperature, top_k, top_p, sampling_rule)
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    apply_threads(threads)
    check_device(dtype, device)
    opened = open_method(model, method, None, cfg=choice.generation, dtype=dtype, device=device,
                         chat_template=chat_template, target_precision=target_precision, check=_check_room)
    for kind, path in opened.artifacts.items():
        log(f"[dim]using {kind} {path}[/dim]")
    set_exit_note("chat keeps no file: the answers so far were printed as they came")  # what an interrupt keeps
    if not opened.method.lossless:
        log(f"[yellow]--method {method} is lossy: its answers can differ from plain decoding's[/yellow]")
    log(f"[dim]chat with {opened.session.model.config.model_type}, method {method}; /reset starts over, /exit (or "
        "/quit) ends[/dim]")
    converse(opened, stdin_lines())


def _check_room(session: Session, cfg: GenerationConfig) -> None:
    """No turn could ever fit: refused now, not at every turn."""
    if cfg.max_new_tokens >= session.context_length:
        raise ConfigError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a turn in the model's context of "
                          f"{session.context_length} tokens; pass a smaller --max-new-tokens")


class _Answer(DecodeHooks):
    """A turn's answer printed to stdout as its tokens come."""

    def __init__(self, tokenizer: Any) -> None:
        self.printer = TextStreamer(tokenizer, write_out)

    def kept(self, prompt: Prompt, tokens: list[int]) -> None:
        self.printer.push(tokens)

    def turn_ended(self, prompt: Prompt, result: DecodeResult) -> None:
        self.printer.end(torn=result.finish_reason == "length")


def stdin_lines() -> Any:
    """stdin as text decoded as a prompt file is (prompts.py): strict UTF-8, a leading BOM dropped, CRLF as newlines."""
    import io

    if not hasattr(sys.stdin, "buffer"):  # already text (a test's stream)
        return sys.stdin
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", errors="strict", newline=None)


def converse(opened: Opened, lines: Any) -> int:
    """Answer every turn read from ``lines`` with the opened method; the number of answers."""
    history: list[dict[str, str]] = []
    answers = 0
    tty = lines.isatty()
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = lines.readline()
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"a line of stdin is not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r}); "
                                  "convert it first, e.g. with iconv -t UTF-8") from None
        if not line or line.strip() in ("/exit", "/quit"):
            return answers
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history.clear()
            log("[dim]a new conversation[/dim]")
            continue
        if text.strip() and _answer(opened, history, text):
            answers += 1


def _answer(opened: Opened, history: list[dict[str, str]], text: str) -> bool:
    """The answer to ``text`` after ``history`` (which it extends), printed as it comes and its pace on stderr;
    False, and one line, when the conversation and an answer no longer fit the model's context."""
    session, cfg = opened.session, opened.cfg
    n = len(encode_turn(session.tokenizer, [*history, {"role": "user", "content": text}], session.chat_template))
    if n + cfg.max_new_tokens > session.context_length:
        log(f"the conversation ({n} token{'s' if n != 1 else ''}) and an answer of {cfg.max_new_tokens} "
            "no longer fit the model's context; /reset starts a new one")
        return False
    [rec] = opened.decode([Prompt(id=len(history) // 2 + 1, turns=(text,))], _Answer(session.tokenizer), history)
    write_out("\n")
    wall = rec.wall_time_s
    log(f"[dim]{count(rec.new_tokens, 'token')} in {wall:.1f} s ({rec.new_tokens / max(wall, 1e-9):.1f} tok/s)[/dim]")
    return True
