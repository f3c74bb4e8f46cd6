"""Time contenders side by side: same prompts, same warm-up, same timer.

Every contender (selfspec method or outside peer) is a factory that returns a fresh
``generate(prompt_ids, cfg) -> DecodeResult``. A fresh instance is made for every
timed pass, so a method that learns while it decodes (SWIFT's layer search carries
across the prompts of a run) starts each repeat from scratch and its optimization time
is paid, and counted, in every repeat. Contenders are interleaved prompt by prompt (see
:func:`run_bench`) so slow drifts of a shared machine hit all contenders alike.
Each prompt is decoded by :func:`selfspec_cli.methods.application.decode_prompts`, as ``generate`` and
``chat`` decode theirs, and timed by :func:`selfspec_cli.runtime.run_prompt` (tokenization outside, CUDA
synchronized on both sides).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GenerationConfig
from ..decoding.output import DecodeResult, OutputRecord
from ..prompts import Prompt
from ..methods.application import decode_prompts

Generate = Callable[[list[int], GenerationConfig], DecodeResult]


@dataclass(slots=True)
class Contender:
    name: str
    make: Callable[[], Generate]  # a fresh instance per timed pass
    lossless: bool = True
    kind: str = "selfspec"  # "selfspec" | "peer"
    pid: int | None = None  # the process that decodes it (bench/peer_process.py), None: this one


@dataclass(slots=True)
class ContenderResult:
    name: str
    lossless: bool
    kind: str
    repeats: list[list[OutputRecord]] = field(default_factory=list)  # per timed pass: per-prompt records
    peak_rss_mb: float | None = None
    peak_cuda_mb: float | None = None

    @property
    def records(self) -> list[OutputRecord]:
        """The last pass's records (answers and plots use them)."""
        return self.repeats[-1] if self.repeats else []


def _rss_bytes(pid: int | None = None) -> int:
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MemorySampler:
    """Peak resident set size per contender, sampled by one thread every ``interval`` s and
    attributed to whichever contender is running (a read of /proc every 50 ms costs the
    timed code nothing measurable). The process sampled is the contender's own: this one, or
    the child a :class:`~selfspec_cli.bench.peer_process.ProcessPeer` decodes in."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.current: tuple[str, int | None] | None = None  # (contender, its process), one attribute: read atomically
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _note(self) -> None:
        if (cur := self.current) is not None:  # read once: the sampling thread races the timed one
            self.peaks[cur[0]] = max(self.peaks.get(cur[0], 0), _rss_bytes(cur[1]))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._note()

    def running(self, name: str | None, pid: int | None = None) -> None:
        self._note()
        self.current = None if name is None else (name, pid)
        self._note()

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._note()


def _timed_record(c: Contender, gen: Generate, res: ContenderResult, mem: MemorySampler, tokenizer: Any, p: Prompt,
                  cfg: GenerationConfig, device: torch.device, use_chat_template: bool) -> OutputRecord:
    """One timed decode of prompt ``p`` by contender ``c``: its memory attributed to it while it runs, and its
    CUDA peak (on a GPU) folded into ``res``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    mem.running(c.name, c.pid)
    [rec] = decode_prompts(gen, [p], tokenizer, cfg, device, c.name, chat_template=use_chat_template, lossless=c.lossless)
    mem.running(None)
    if cuda:
        res.peak_cuda_mb = max(res.peak_cuda_mb or 0.0, torch.cuda.max_memory_allocated(device) / 2**20)
    return rec


def run_bench(contenders: Sequence[Contender], prompts: Sequence[Prompt], tokenizer: Any, cfg: GenerationConfig,
              device: torch.device, warmup: int = 1, repeats: int = 1, use_chat_template: bool = True,
              on_record: Callable[[str, int, OutputRecord], None] | None = None,
              done: dict[str, dict[tuple[int, Any], OutputRecord]] | None = None,
              partial: dict[str, ContenderResult] | None = None,
              between_passes: Callable[[], None] | None = None, rank: int | None = None) -> dict[str, ContenderResult]:
    """Warm up each contender on the first prompt, then ``repeats`` timed passes.

    Within a pass the order is prompt-major: every contender decodes prompt 1, then every
    contender decodes prompt 2, ..., the contender order rotating from prompt to prompt.
    A slowdown of a shared machine (another job, CPU steal) then lands on all contenders
    within seconds of each other instead of on whichever ran during it. Each contender's
    instance lives for the whole pass (SWIFT's state carries across its prompts).

    ``done``: records of an interrupted run, per contender and (pass, prompt id), kept as
    they are and not run again (``bench --resume``). ``partial``: filled as the run goes, so
    that a caller interrupted mid-run has every finished record. ``between_passes``: run before
    every pass after the first, outside any timed region (the bench pools cost readings there). Each timed
    record is marked with its pass (``repeat``) and ``rank`` (torchrun's; None: one process) before it is
    kept and handed to ``on_record``.
    """
    done = done or {}
    results = {c.name: ContenderResult(c.name, c.lossless, c.kind) for c in contenders}
    if partial is not None:
        partial.update(results)
    for c in contenders:
        for _ in range(warmup):
            decode_prompts(c.make(), prompts[:1], tokenizer, cfg, device, c.name, chat_template=use_chat_template,
                           lossless=c.lossless)
    with MemorySampler() as mem:
        for rep in range(repeats):
            if rep and between_passes is not None:
                between_passes()
            gens = {c.name: c.make() for c in contenders}
            for res in results.values():
                res.repeats.append([])
            for i, p in enumerate(prompts):
                for j in range(len(contenders)):
                    c = contenders[(i + rep + j) % len(contenders)]
                    res = results[c.name]
                    if (rep, p.id) in done.get(c.name, {}):
                        res.repeats[-1].append(done[c.name][(rep, p.id)])
                        continue
                    rec = _timed_record(c, gens[c.name], res, mem, tokenizer, p, cfg, device, use_chat_template)
                    rec = dataclasses.replace(rec, repeat=rep, rank=rank)
                    res.repeats[-1].append(rec)
                    if on_record:
                        on_record(c.name, rep, rec)
    for name, res in results.items():
        res.peak_rss_mb = mem.peaks[name] / 2**20 if name in mem.peaks else None
    return results
