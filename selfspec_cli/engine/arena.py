"""The weights a step streams, moved into one memory region backed by 2 MB pages (docs/engine.md, "Huge pages").

Why: a decode step reads every packed matrix once, front to back. On 4 KB pages that stream misses the TLB
every 4 KB (a 1 GB model is 250,000 pages; Zen 4's second-level TLB holds 3,072), and each miss is a page walk
in the middle of the stream. Linux backs an anonymous mapping with 2 MB pages where it is told to
(``madvise(MADV_HUGEPAGE)``: this is what a host whose transparent huge pages are set to ``madvise``, the
common default, asks for), and then a step's TLB misses fall 512-fold.

How: :func:`place` copies the packed tensors of a list of products (:class:`~.kernels.QLinear` codes, scales
and minimums, :class:`~.kernels.Linear` panels) one after another, in the order given (a forward's order:
layer by layer, then the head), into one private anonymous mapping that starts on a 2 MB boundary and is
advised so (and faulted in at once where the kernel can), and points each product at its copy. Each original is freed as soon as it is copied, so the
peak grows by one matrix, not by the model.

Invariants: the values are the same bytes (a copy; no arithmetic changes, so every output is bit-identical);
each tensor starts on a 64-byte boundary (the kernel's loads); the mapping lives as long as any tensor in it
(torch holds the buffer); where the platform has no ``MADV_HUGEPAGE`` or ``SELFSPEC_HUGE_PAGES=0`` is set,
nothing moves. Whether the kernel gave 2 MB pages is its decision (memory fragmentation can refuse);
:func:`huge_bytes` reads what it gave.
"""
from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .kernels import A8Linear, Linear, PartsLinear, QLinear

HUGE = 2 << 20  # bytes of a huge page on x86-64
ALIGN = 64  # a tensor's start in the region: one cache line
_regions: list[tuple[int, int]] = []  # the live regions' address ranges (a tensor in one is not moved again)


def enabled() -> bool:
    """Whether :func:`place` moves anything: Linux's ``MADV_HUGEPAGE`` exists and ``SELFSPEC_HUGE_PAGES`` is not 0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("SELFSPEC_HUGE_PAGES", "1") != "0"


def _slots(lin: Any) -> list[str]:
    """The tensor attributes of one product that a step streams (none for an F.linear fallback)."""
    if isinstance(lin, QLinear):
        return ["codes", "scales", "mins"] if lin.module is not None else []
    return ["packed"] if isinstance(lin, Linear) else []


def _products(lins: Iterable[Any]) -> list[Any]:
    """The products themselves, unwrapping fused parts and the int8-activation view (which shares its base's codes)."""
    out: list[Any] = []
    for lin in lins:
        if isinstance(lin, PartsLinear):
            out += _products(lin.parts)
        elif isinstance(lin, A8Linear):
            out.append(lin.base)
        elif lin is not None:
            out.append(lin)
    return out


def region(nbytes: int, populate: bool = True) -> torch.Tensor:
    """``nbytes`` of fresh memory as a uint8 tensor that starts on a 2 MB boundary, advised onto 2 MB pages and,
    with ``populate``, faulted in at once where the kernel can (Linux 5.14+: 0.1-1.2 s a GB on this project's
    virtual machines, against 0.7 s page by page from one thread); the tensor keeps its mapping alive. Call only
    where :func:`enabled`."""
    mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` for as long as any view of it lives
    start = (-whole.data_ptr()) % HUGE  # the first 2 MB boundary
    if nbytes:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    if nbytes and populate:
        try:
            mapping.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), start, nbytes)
        except OSError:
            pass
    out = whole[start:start + nbytes]
    span = (out.data_ptr(), out.data_ptr() + nbytes)
    _regions.append(span)
    weakref.finalize(mapping, _regions.remove, span)  # unmapped once no tensor holds it: its addresses may be reused
    return out


def place(lins: Iterable[Any]) -> int:
    """Move the streamed tensors of ``lins`` (in this order) into one 2 MB-page region; returns the bytes moved
    (0 where :func:`enabled` is False or nothing is left to move). A tensor already moved, on another device,
    or shared by two products is moved once."""
    if not enabled():
        return 0
    todo: list[tuple[Any, str]] = []  # (product, attribute): no reference to a tensor, so each is freed once copied
    sizes: dict[int, int] = {}  # a tensor's address -> its bytes (two products may share one)
    for lin in {id(p): p for p in _products(lins)}.values():  # a product listed twice (an A8Linear's base): once
        for name in _slots(lin):
            t = getattr(lin, name, None)
            if (t is None or t.device.type != "cpu" or not t.is_contiguous() or any(lo <= t.data_ptr() < hi for lo, hi in _regions)):
                continue
            todo.append((lin, name))
            sizes.setdefault(t.data_ptr(), t.numel() * t.element_size())
    total = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes.values())
    if total == 0:
        return 0
    whole = region(total)
    moved: dict[int, torch.Tensor] = {}
    at = 0
    for lin, name in todo:
        t = getattr(lin, name)
        key = t.data_ptr()
        if key not in moved:
            n = sizes[key]
            moved[key] = whole[at:at + n].view(t.dtype).view(t.shape)
            moved[key].copy_(t)
            at += (n + ALIGN - 1) // ALIGN * ALIGN
        setattr(lin, name, moved[key])
        del t
    return at


def placed_bytes(lins: Iterable[Any]) -> int:
    """Bytes of the streamed tensors of ``lins`` that lie in a region :func:`place` filled (each tensor once)."""
    seen: dict[int, int] = {}
    for lin in _products(lins):
        for name in _slots(lin):
            t = getattr(lin, name, None)
            if t is not None and any(lo <= t.data_ptr() < hi for lo, hi in _regions):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def huge_bytes() -> int:
    """This process's anonymous memory on 2 MB pages (``AnonHugePages`` of /proc/self/smaps_rollup), in bytes;
    0 where it cannot be read."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
