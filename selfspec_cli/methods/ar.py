"""Plain autoregressive decoding: the baseline every speedup is measured against.

One full-depth forward per token over the engine's preallocated cache. Invariant
in the loop: every emitted token except the newest is in the cache; the newest
is fed as the next step's single input row.
"""
from __future__ import annotations

import torch

from ..config import GenerationConfig
from ..decoding.loop import DecodeResult, DecodeStats, TokenSink
from ..decoding.sampling import make_generator, select_token
from .base import Method


class AR(Method):
    name = "ar"
    lossless = True
    description = "plain autoregressive decoding (the baseline)"

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        eng = self.engine
        sink = TokenSink(cfg, self.tokenizer)
        stats = DecodeStats()
        gen = make_generator(cfg.sampling, eng.device)
        n = len(prompt_ids)
        cache = eng.new_cache(n + cfg.max_new_tokens + 1)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=eng.device)
        # 1) prefill: logits for the last prompt position only
        logits = eng.forward(cache, ids, positions=0).logits[0]
        pos = n
        while True:
            # 2) select and emit
            token = select_token(logits, cfg.sampling, gen)
            stats.target_forwards += 1
            stats.accept_lengths.append(1)
            sink.push([token])
            if sink.done:
                break
            # 3) feed the new token
            logits = eng.forward(cache, ids.new_tensor([token]), positions=pos).logits[0]
            pos += 1
        return sink.result(stats)
