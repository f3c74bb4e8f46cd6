"""``selfspec bench`` over the ranks of ``torchrun`` (docs/benchmarks.md, "More than one process").

torchrun starts one process per rank and sets ``RANK``/``WORLD_SIZE``; torch.distributed (gloo,
on CPU) joins them. Each rank takes every ``world``-th prompt (``prompts[rank::world]``, so every
group of the suite spreads over the ranks), runs every contender on its prompts interleaved as
one process does, and sends its records to rank 0, which merges them and writes the one
``results.json``. Invariants:

* a prompt is decoded by every contender on the same rank, so each per-prompt ratio (the
  paired speedups) compares two timings taken on one process, as in a single-process run;
* the merged records are in the suite's order, pass by pass, each marked with its ``rank``;
* what a rank finished is on disk before anything is gathered (``records/rank<r>/``), so a
  rank that dies loses only its running prompt; rank 0 alone writes the merged outputs.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..decoding.output import OutputRecord
from ..errors import ConfigError

GATHER_TIMEOUT = datetime.timedelta(hours=48)  # ranks finish their shares at different times


@dataclass(frozen=True, slots=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def many(self) -> bool:
        return self.world > 1

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's items: every ``world``-th, from its own index."""
        return list(items[self.rank :: self.world])

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world}"


def from_env() -> Ranks:
    """The ranks torchrun set in the environment (one rank when it did not)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ConfigError("RANK and WORLD_SIZE must be integers (torchrun sets them); unset them to run one process") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is not in 0..WORLD_SIZE-1 ({world}); start the ranks with torchrun")
    return Ranks(rank, world)


def init(ranks: Ranks) -> None:
    """Join the process group (gloo: CPU tensors and Python objects; every rank must call it)."""
    if not ranks.many:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=GATHER_TIMEOUT)


def barrier(ranks: Ranks) -> None:
    if ranks.many:
        import torch.distributed as dist

        dist.barrier()


def gather(ranks: Ranks, payload: Any) -> list[Any] | None:
    """Every rank's ``payload`` on rank 0 (in rank order); None on the other ranks."""
    if not ranks.many:
        return [payload]
    import torch.distributed as dist

    out: list[Any] | None = [None] * ranks.world if ranks.lead else None
    dist.gather_object(payload, out, dst=0)
    return out


def close(ranks: Ranks) -> None:
    if ranks.many:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def merge_repeats(parts: Sequence[Sequence[Sequence[OutputRecord]]], order: Sequence[Any]) -> list[list[OutputRecord]]:
    """One contender's passes from every rank (``parts[rank][pass]`` = records) as one list of
    passes, each in the suite's prompt ``order`` (prompt ids)."""
    where = {pid: i for i, pid in enumerate(order)}
    passes = max((len(p) for p in parts), default=0)
    return [sorted((rec for p in parts if rep < len(p) for rec in p[rep]), key=lambda r: where[r.id])
            for rep in range(passes)]
