"""Time contenders side by side: same prompts, same warm-up, same timer.

Throughput of a contender = total generated tokens / total wall time over all
prompts of a repeat; the reported figure is the median over repeats. Speedup of A
over B is the ratio of their mean throughputs (Spec-Bench's definition). Parity
compares generated token ids with the reference contender prompt by prompt.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GenerationConfig
from ..prompts import Prompt
from ..runtime import run_prompt


@dataclass(slots=True)
class Contender:
    name: str
    generate: Callable[..., Any]
    lossless: bool = True


@dataclass(slots=True)
class ContenderResult:
    name: str
    throughputs: list[float] = field(default_factory=list)  # tokens/s, one per repeat
    records: list[dict[str, Any]] = field(default_factory=list)  # last repeat's per-prompt records

    @property
    def median_tps(self) -> float:
        return statistics.median(self.throughputs)

    @property
    def mean_tps(self) -> float:
        return statistics.fmean(self.throughputs)


def throughput(records: Sequence[dict[str, Any]]) -> float:
    tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_time_s"] for r in records)
    return tokens / wall if wall > 0 else 0.0


def parity(records: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> tuple[float, list[Any]]:
    """Share of prompts whose generated ids equal the reference's, and the ids that differ."""
    ref = {r["id"]: r for r in reference}
    differ = [r["id"] for r in records if r["id"] not in ref or r["token_ids"] != ref[r["id"]]["token_ids"]]
    missing = [i for i in ref if i not in {r["id"] for r in records}]
    differ += missing
    n = max(len(ref), 1)
    return (n - len(differ)) / n, differ


def run_bench(
    contenders: Sequence[Contender],
    prompts: Sequence[Prompt],
    tokenizer: Any,
    cfg: GenerationConfig,
    device: torch.device,
    warmup: int = 1,
    repeats: int = 1,
    use_chat_template: bool = True,
    on_prompt: Callable[[str], None] | None = None,
) -> dict[str, ContenderResult]:
    results = {c.name: ContenderResult(c.name) for c in contenders}
    for c in contenders:
        for _ in range(warmup):
            run_prompt(c.generate, tokenizer, prompts[0], cfg, device, c.name, use_chat_template, c.lossless)
    # interleave contenders per repeat so slow drifts of the machine hit all alike
    for _ in range(repeats):
        for c in contenders:
            recs = []
            for p in prompts:
                recs.append(run_prompt(c.generate, tokenizer, p, cfg, device, c.name, use_chat_template, c.lossless))
                if on_prompt:
                    on_prompt(c.name)
            results[c.name].throughputs.append(throughput(recs))
            results[c.name].records = recs
    return results
