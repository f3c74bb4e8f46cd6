"""Turn prompts into token ids, run a method on each, and build output records.

Shared by ``generate`` and ``bench`` so both count tokens and time the same way:
token counts come from generated ids, and ``wall_time_s`` spans prefill plus
decoding of one prompt (tokenization and model loading excluded), with a device
synchronize on each side when running on CUDA.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .config import GenerationConfig
from .decoding.measure import timed
from .decoding.output import TURN_SEPARATOR, DecodeResult, OutputRecord, TurnRecord, TurnStats
from .errors import ConfigError
from .prompts import Prompt, encode_turn


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids as ``model.generate`` uses them: the generation config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def context_length(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 0)


def check_prompt_fits(prompt: Prompt, tokenizer: Any, cfg: GenerationConfig, ctx: int, use_chat_template: bool) -> None:
    """Refuse up front a prompt that may not fit the model's context: its first turn plus
    --max-new-tokens, and for a conversation every turn with every answer at its longest
    (--max-new-tokens is an exact upper bound per turn, so the worst case must fit)."""
    if not ctx:
        return
    n = len(encode_turn(tokenizer, [{"role": "user", "content": prompt.turns[0]}], use_chat_template))
    if n >= ctx:
        raise ConfigError(f"prompt {prompt.id!r} has {n} tokens, longer than the model's context of {ctx}; shorten it")
    if n + cfg.max_new_tokens > ctx:
        raise ConfigError(
            f"prompt {prompt.id!r} ({n} tokens) plus --max-new-tokens {cfg.max_new_tokens} exceeds the model's "
            f"context of {ctx}; lower --max-new-tokens to at most {ctx - n} or shorten the prompt"
        )
    if len(prompt.turns) > 1:
        history = [{"role": "user", "content": prompt.turns[0]}]
        for turn in prompt.turns[1:]:  # the last turn's prefill with empty answers, then the answers
            history += [{"role": "assistant", "content": ""}, {"role": "user", "content": turn}]
        k = len(prompt.turns)
        total = len(encode_turn(tokenizer, history, use_chat_template)) + k * cfg.max_new_tokens
        if total > ctx:
            most = (ctx - (total - k * cfg.max_new_tokens)) // k
            fix = (f"lower --max-new-tokens to at most {most}" if most > 0 else "shorten the turns") + " or drop turns"
            raise ConfigError(f"prompt {prompt.id!r}: its {k} turns with answers of up to --max-new-tokens "
                              f"{cfg.max_new_tokens} each reach {total} tokens, more than the model's context of {ctx}; {fix}")


def run_prompt(
    generate: Callable[[list[int], GenerationConfig], DecodeResult],
    tokenizer: Any,
    prompt: Prompt,
    cfg: GenerationConfig,
    device: torch.device,
    method_name: str,
    use_chat_template: bool = True,
    lossless: bool = True,
    history: list[dict[str, str]] | None = None,
) -> OutputRecord:
    """Decode every turn of ``prompt`` and return its output record (an :class:`OutputRecord`; a writer
    serializes it once, :meth:`OutputRecord.to_dict`: the keys and values records always had). ``history``: the conversation before
    the prompt's first turn (``chat``), which its turns and answers extend in place; None: a conversation of its own.

    Top-level fields cover the whole record: for a multi-turn prompt ``token_ids`` are the
    turns' outputs concatenated and ``text`` the turns' texts joined by a blank line
    (:data:`TURN_SEPARATOR`); a turn cut by the length limit inside a multi-byte character
    leaves that torn character out of its text (never out of ``token_ids``); ``new_tokens``, ``prompt_tokens``
    (tokens prefilled: each turn's prompt holds the conversation so far),
    ``wall_time_s``, ``tokens_per_s`` and ``stats`` are totals over the turns, and
    ``finish_reason`` is the last turn's. Per-turn values are in ``turns[i]``
    (multi-turn records only; a one-turn record is its own turn).
    """
    history = [] if history is None else history
    turns: list[TurnRecord] = []
    for turn in prompt.turns:
        history.append({"role": "user", "content": turn})
        ids = encode_turn(tokenizer, history, use_chat_template)
        res, wall = timed(lambda: generate(ids, cfg), device)
        text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        if res.finish_reason == "length":  # cut inside a multi-byte character: drop the torn one (token_ids keep it)
            text = text.rstrip("\ufffd")
        history.append({"role": "assistant", "content": text})
        stats = res.stats.summary()
        turns.append(TurnRecord(text, res.token_ids, len(res.token_ids), list(stats.accept_lengths), len(ids), wall,
                                round(len(res.token_ids) / wall, 3) if wall > 0 else None, res.finish_reason, stats))
    new_tokens = sum(t.new_tokens for t in turns)
    wall = sum(t.wall_time_s for t in turns)
    return OutputRecord(
        id=prompt.id, method=method_name, lossless=lossless, text=TURN_SEPARATOR.join(t.text for t in turns),
        token_ids=[x for t in turns for x in t.token_ids], new_tokens=new_tokens,
        prompt_tokens=sum(t.prompt_tokens for t in turns), wall_time_s=round(wall, 6),
        tokens_per_s=round(new_tokens / wall, 3) if wall > 0 else None, finish_reason=turns[-1].finish_reason,
        stats=turns[0].stats if len(turns) == 1 else _merge_stats([t.stats for t in turns]), category=prompt.category,
        turns=None if len(turns) == 1 else tuple(dataclasses.replace(t, wall_time_s=round(t.wall_time_s, 6)) for t in turns),
    )


def _merge_stats(parts: list[TurnStats]) -> TurnStats:
    lengths = [x for p in parts for x in p.accept_lengths]
    return TurnStats(target_forwards=sum(p.target_forwards for p in parts), accept_lengths=lengths,
                     mean_accepted_length=sum(lengths) / len(lengths) if lengths else 0.0)
