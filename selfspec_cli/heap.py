"""Keep the C heap from holding freed tensor memory: large blocks go straight back to the system.

glibc's malloc serves a block above its mmap threshold with a mapping of its own, returned to the
system on free; below it, from the heap, whose freed memory stays resident while anything above it
lives. The threshold starts at 128 KiB but rises (up to 32 MiB) each time such a mapping is freed,
so after loading a model every activation, logits buffer and scratch tensor of a decode comes from
the heap, which fragments and grows prompt after prompt: over the default suite a bench of the
default model grew from 507 to 547 MB of anonymous memory, against 432-443 MB with the threshold
pinned (docs/benchmarks.md, "Memory"). Pinning it costs one mapping per block over 1 MiB
(a k-row logits buffer, a prefill's activations), microseconds against a step of milliseconds.

Called once by the command line at start-up and by the bench's peer process; a library user's
process is left as it is. Invariant: a no-op (returning False) where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops the dynamic adjustment
THRESHOLD = 1 << 20


def bound_heap(threshold: int = THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes; False where that is not possible."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
