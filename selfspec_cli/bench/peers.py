"""Outside peers run on the very same model object: Hugging Face ``generate``.

They are wrapped to the same ``generate(prompt_ids, cfg) -> DecodeResult`` call
as selfspec's methods so the bench times every contender with one timer.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import GenerationConfig
from ..decoding.loop import DecodeResult, DecodeStats, TokenSink


class HFGenerate:
    """``model.generate(do_sample=False)``: the speed every user compares against."""

    name = "hf"
    lossless = True

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **generate_kwargs: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kwargs = generate_kwargs

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        if not cfg.sampling.greedy:
            raise ValueError("the hf peer is benchmarked greedy only")
        dev = self.model.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        eos = None if cfg.ignore_eos else list(cfg.eos_token_ids) or None
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=(cfg.eos_token_ids[0] if cfg.eos_token_ids else 0),
            **self.kwargs,
        )
        new = out[0, len(prompt_ids):].tolist()
        sink = TokenSink(GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_token_ids=cfg.eos_token_ids,
                                          ignore_eos=cfg.ignore_eos))
        sink.push(new)
        stats = DecodeStats(target_forwards=len(sink.tokens), accept_lengths=[1] * len(sink.tokens))
        return sink.result(stats)
