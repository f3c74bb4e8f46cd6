"""``--threads auto``: two threads while they pay, one the moment another process takes a core.

Written when every product was an OpenMP region: a spinning team ran a step 1.4-1.8x faster idle
and collapsed to 0.2-0.4x next to another process. The kernel's own pool (csrc ``par_for``) waits
for chunks, not threads, and yields its idle cores, so it degrades to one thread's pace by itself
(docs/engine.md, "Threads"; README, "Threads"); the governor stays for hosts whose cores are taken
for long stretches.
The governor watches the engine's own forwards and switches the thread count (the kernel pool's and
torch's) at run time:

* it starts at one thread for ``warm`` forwards, then goes to ``n``; per thread count and
  row-count bucket (powers of two) it keeps the best forward time; at ``n`` threads, two
  consecutive forwards slower than ``drop`` x their best, or than ``one_margin`` x the best
  one-thread forward of that bucket, mean contention: one thread;
* at one thread, after ``interval`` forwards it probes ``n`` threads again; a probe whose first
  timed forward is slower than ``probe_ok`` x the best goes back at once and doubles the interval
  (up to ``max_interval``), a good probe stays and resets it;
* the first forward after going up to ``n`` threads is neither timed as a best nor judged: it
  pays the wake-up of threads that slept while one thread ran (measured on SmolLM2: 31 ms
  against a 25 ms one-thread step, and 18 ms against a 12 ms team step), and judging it made
  every probe, the first one included, fail on an idle machine.

Invariant: only the thread count changes, never the decoding rules; outputs at ``auto`` are
checked equal to one thread's (tests/test_threads.py on a tiny model; on the default model,
docs/engine.md, "Threads"). The kernel pool's waiting is its own (spin, yield, park); torch's threads
keep the policy chosen before torch loads (``cli/entry.py``: libgomp's default with
``GOMP_SPINCOUNT=10000``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def set_both(n: int) -> None:
    """The kernel pool's size (every product of a forward runs on it) and torch's intra-op threads."""
    from . import kernels

    torch.set_num_threads(n)
    kernels.set_threads(n)


@dataclass
class ThreadGovernor:
    threads: int
    drop: float = 1.8
    probe_ok: float = 1.3
    interval: int = 50
    max_interval: int = 1600
    warm: int = 8  # forwards at one thread first, so that a team slowed from the start is seen as slow
    one_margin: float = 1.25  # "slower than one thread": than its best x this (the context grows meanwhile)
    set_threads: object = None  # injectable for tests; None: the kernel pool and torch (set_both)
    current: int = 0
    switches: int = 0
    _best: dict[tuple[int, int], float] = field(default_factory=dict)  # (threads, bucket) -> best seconds
    _slow: int = 0
    _since: int = 0
    _probing: bool = False
    _base_interval: int = 0
    _settle: bool = False  # skip the next forward: the team's first after a switch up

    def __post_init__(self) -> None:
        if self.set_threads is None:
            self.set_threads = set_both
        self._base_interval, self.current = self.interval, 1
        self.set_threads(1)

    def observe(self, rows: int, seconds: float) -> None:
        """One forward of ``rows`` rows took ``seconds`` at the current thread count."""
        if self._settle:  # the first forward after going to n threads pays the sleeping team's wake-up
            self._settle = False
            return
        bucket = min(rows, 1 << 10).bit_length()
        key = (self.current, bucket)
        best = self._best.get(key)
        self._best[key] = seconds if best is None else min(best, seconds)
        if self.current != self.threads:
            self._since += 1
            if self._since >= (self.warm if not self.switches else self.interval):
                self._since, self._probing = 0, True
                self._set(self.threads)
            return
        one = self._best.get((1, bucket))  # slower than one thread ever was: contended, whatever the team's best
        if self._probing:
            self._probing = False
            if (best is not None and seconds > self.probe_ok * best) or (one is not None and seconds > self.one_margin * one):
                self.interval = min(2 * self.interval, self.max_interval)
                self._set(1)
                return
            self.interval = self._base_interval
        slow = (best is not None and seconds > self.drop * best) or (one is not None and seconds > self.one_margin * one)
        self._slow = self._slow + 1 if slow else 0
        if self._slow >= 2:
            self._set(1)

    def _set(self, n: int) -> None:
        if n != self.current:
            self.set_threads(n)
            self.current, self.switches, self._slow, self._settle = n, self.switches + 1, 0, n > 1

    def describe(self) -> dict[str, int]:
        return {"threads": self.current, "switches": self.switches}


AUTO: dict[str, int] = {}  # set by the CLI's --threads auto: {"threads": n}; engines made after it get a governor


def governor_for_new_engine() -> ThreadGovernor | None:
    return ThreadGovernor(AUTO["threads"]) if AUTO else None
