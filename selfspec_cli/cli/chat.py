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
import time
from typing import Any, Optional

import typer

from ..artifacts import recording_loads
from ..config import GenerationConfig, check_choice, check_seed
from ..errors import ConfigError, PromptFileError, count
from ..engine.target import TARGET_PRECISIONS
from ..methods import METHODS, build
from ..prompts import encode_turn
from ..session import Session, apply_threads, check_device
from . import options as opt
from .common import log, set_exit_note
from .method_options import generation_config
from .streaming import TextStreamer, write_out


def chat(
    model: Optional[str] = opt.model(),
    method: str = opt.method(),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Exact upper bound on the tokens of each answer."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling (each answer's draws are reproducible from it)."),
    sampling_rule: str = opt.sampling_rule(),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
    threads: Optional[str] = opt.threads(),
) -> None:
    """Talk with the model: each stdin line is a turn, the answer streams to stdout (/reset starts over, /exit ends)."""
    check_choice(method, METHODS, "--method")
    check_seed(seed)
    cfg = generation_config(method, max_new_tokens, temperature, top_k, top_p, seed, sampling_rule)
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    apply_threads(threads)
    check_device(dtype, device)
    session = Session.open(model, dtype=dtype, device=device, chat_template=chat_template, lite=True)
    cfg = session.generation(cfg)
    if cfg.max_new_tokens >= session.context_length:  # no turn could ever fit: refused now, not at every turn
        raise ConfigError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a turn in the model's context of "
                          f"{session.context_length} tokens; pass a smaller --max-new-tokens")
    engine = session.engine(target_precision)
    with recording_loads() as used:
        meth = build(method, engine, session.tokenizer, None)
    engine.release_float_weights(panels=True)  # every draft is built: the float matrices the target no longer reads go
    for kind, path in used.items():
        log(f"[dim]using {kind} {path}[/dim]")
    set_exit_note("chat keeps no file: the answers so far were printed as they came")  # what an interrupt keeps
    if not meth.lossless:
        log(f"[yellow]--method {method} is lossy: its answers can differ from plain decoding's[/yellow]")
    log(f"[dim]chat with {session.model.config.model_type}, method {method}; /reset starts over, /exit (or /quit) "
        "ends[/dim]")
    converse(meth, session, cfg, stdin_lines())


def stdin_lines() -> Any:
    """stdin as text decoded as a prompt file is (prompts.py): strict UTF-8, a leading BOM dropped, CRLF as newlines."""
    import io

    if not hasattr(sys.stdin, "buffer"):  # already text (a test's stream)
        return sys.stdin
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", errors="strict", newline=None)


def converse(meth: Any, session: Session, cfg: GenerationConfig, lines: Any) -> int:
    """Answer every turn read from ``lines``; the number of answers."""
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
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = encode_turn(session.tokenizer, history, session.chat_template)
        if len(ids) + cfg.max_new_tokens > session.context_length:
            history.pop()
            log(f"the conversation ({len(ids)} token{'s' if len(ids) != 1 else ''}) and an answer of {cfg.max_new_tokens} "
                "no longer fit the model's "
                "context; /reset starts a new one")
            continue
        printer = TextStreamer(session.tokenizer, write_out)
        t0 = time.perf_counter()
        res = meth.generate(ids, cfg, on_tokens=printer.push)
        printer.end(torn=res.finish_reason == "length")
        write_out("\n")
        wall = time.perf_counter() - t0
        answer = session.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer.rstrip("\ufffd") if res.finish_reason == "length" else answer})
        answers += 1
        log(f"[dim]{count(len(res.token_ids), 'token')} in {wall:.1f} s ({len(res.token_ids) / max(wall, 1e-9):.1f} tok/s)[/dim]")
