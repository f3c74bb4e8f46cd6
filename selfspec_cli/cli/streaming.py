"""Text printed to stdout as tokens come (``generate --stream``, ``chat``): whole characters only,
exactly the text a record keeps."""
from __future__ import annotations

import sys
from typing import Any

from .common import OutputClosed


def write_out(text: str) -> None:
    """Write ``text`` to stdout at once (a closed reader: :class:`OutputClosed`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise OutputClosed from None


class TextStreamer:
    """A turn's text, printed as its tokens come: the decoded text grows by whole characters (a token that
    ends inside a multi-byte character waits for the next), so what is printed is exactly the record's text."""

    def __init__(self, tokenizer: Any, say: Any) -> None:
        self.tokenizer, self.say = tokenizer, say
        self.ids: list[int] = []
        self.shown = 0
        self.turns = 0  # turns ended

    def push(self, tokens: list[int]) -> None:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character still being spelled out
            return
        if len(text) > self.shown:
            self.say(text[self.shown:])
        self.shown = len(text)

    def end(self, torn: bool) -> None:
        """The turn is over: what is left, without the torn last character of a turn cut by the length
        limit (as run_prompt leaves it out of the record's text)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if torn:
            text = text.rstrip("\ufffd")
        if len(text) > self.shown:
            self.say(text[self.shown:])
        self.ids, self.shown, self.turns = [], 0, self.turns + 1
