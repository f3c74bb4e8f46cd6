"""The packed-panel cache's file: tensors laid out 64-byte aligned and memory-mapped back without a copy.

A block target's packed panels are as large as the model's weights (1.1 GB for a 1.5B Q4_K_M model). Read
back through safetensors they were copied into the process (and copied again to realign them: safetensors
hands tensors back 32 bytes into a buffer), so a warm start held two or three times the file. Here every
tensor starts on a 64-byte line of the file, and :func:`load` reads the file whole into one region of 2 MB pages
(engine/arena.py: a step's stream then misses the TLB 512 times less), or, with huge pages off, maps it
copy-on-write: the panels are then the page cache's pages, read from disk as the kernel first streams them,
shared by every process that maps the same file, and never copied.

Layout: the 8 bytes ``SSPANEL2``, the header's offset and length (two little-endian 8-byte integers), each
tensor's bytes at its ``offset`` (from the file's start, a multiple of 64), zero-padded between, then the header,
``N`` bytes of JSON (``{"metadata": {...}, "tensors": {name: {"dtype", "shape", "offset", "nbytes"}}}``). The
header comes last so that a :class:`Writer` streams each tensor to the file as it is made and holds none of them
(building a 1.5B model's block copy held the whole gigabyte before it was written). Files of the first layout
(``SSPANEL1``: the header's length and the header first) are still read.

Invariants: :func:`save` and :class:`Writer` write atomically (a reader sees the whole file or none); :func:`load` checks every
tensor lies inside the file and raises ``ValueError`` for a partial or foreign file (the caller rebuilds);
loaded tensors alias the region or the mapping (no further copy), start 64-byte aligned, and are never written by
the engine.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from ..paths import atomic_write
from . import arena

MAGIC = b"SSPANEL2"  # the first 8 bytes; the header's offset and length follow
MAGIC_V1 = b"SSPANEL1"  # the first layout: the header's length, then the header, then the tensors
ALIGN = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
           "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16, torch.uint8: np.uint8,
          torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Writer:
    """Tensors streamed into an open binary file (:func:`selfspec_cli.paths.atomic_open`'s temporary file), each
    written when :meth:`add` gets it, so the caller may let it go; :meth:`finish` writes the header. A tensor's name
    is written once."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.index: dict[str, dict[str, Any]] = {}
        f.write(MAGIC + b"\0" * (ALIGN - len(MAGIC)))  # the header's offset and length are filled in by finish()
        self.at = ALIGN

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write ``t`` (a CPU tensor of a dtype in ``_DTYPES``) at the next 64-byte line."""
        if name in self.index:
            raise ValueError(f"tensor {name} written twice")
        if t.dtype not in _NUMPY:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not stored")
        nbytes = t.numel() * t.element_size()
        self.index[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": nbytes,
                            "offset": self.at}
        if nbytes:
            self.f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.f.write(b"\0" * (_up(self.at + nbytes) - self.at - nbytes))
        self.at = _up(self.at + nbytes)

    def finish(self, metadata: dict[str, Any]) -> None:
        """Write the header (``metadata``: JSON) after the tensors, and its place at the file's start."""
        header = json.dumps({"metadata": metadata, "tensors": self.index}).encode("utf-8")
        self.f.write(header)
        self.f.seek(len(MAGIC))
        self.f.write(struct.pack("<QQ", self.at, len(header)))
        self.f.seek(0, 2)


def save(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write ``tensors`` (contiguous CPU tensors of the dtypes in ``_DTYPES``) and ``metadata`` (JSON) to ``path``."""

    def write(f: Any) -> None:
        out = Writer(f)
        for name, t in tensors.items():
            out.add(name, t)
        out.finish(metadata)

    atomic_write(path, write)


def _read_whole(path: str | Path) -> np.ndarray:
    """The file's bytes in a fresh 2 MB-page region (engine/arena.py), read by up to 4 threads in 2 MB-aligned
    slices: the region's pages are faulted in by the reads themselves, in parallel (0.14-0.3 s for a gigabyte in the
    page cache here, against 0.1-1.2 s for a one-call fault-in and then the read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out = arena.region(size, populate=False).numpy()
        view = memoryview(out)
        threads = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, size >> 26))
        step = -(-size // threads // arena.HUGE) * arena.HUGE
        errors: list[BaseException] = []

        def read(lo: int) -> None:
            hi = min(size, lo + step)
            try:
                while lo < hi:
                    n = os.preadv(fd, [view[lo:min(hi, lo + (64 << 20))]], lo)
                    if n <= 0:
                        raise ValueError(f"{path} is shorter than when it was opened")
                    lo += n
            except BaseException as e:  # noqa: BLE001  re-raised in the caller's thread
                errors.append(e)

        workers = [threading.Thread(target=read, args=(lo,)) for lo in range(0, size, step)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        return out
    finally:
        os.close(fd)


def load(path: str | Path, huge: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata). ``ValueError`` for a foreign or partial file. The tensors alias a copy-on-write mapping
    of ``path``, or with ``huge`` (default: where engine/arena.py's huge pages are on) a private region on 2 MB
    pages that the file is read into whole (a step then streams them with 512 times fewer TLB misses)."""
    if huge if huge is not None else arena.enabled():
        mapped = _read_whole(path)
    else:
        mapped = np.memmap(str(path), dtype=np.uint8, mode="c")
    size = mapped.shape[0]
    magic = bytes(mapped[:len(MAGIC)]) if size >= ALIGN else b""
    if magic == MAGIC:
        at, n = struct.unpack("<QQ", bytes(mapped[len(MAGIC):len(MAGIC) + 16]))
    elif magic == MAGIC_V1:
        at, (n,) = len(MAGIC) + 8, struct.unpack("<Q", bytes(mapped[len(MAGIC):len(MAGIC) + 8]))
    else:
        raise ValueError(f"{path} is not a selfspec panel file")
    if at + n > size or n == 0:
        raise ValueError(f"{path}: its header lies outside the file (a partial file)")
    head = json.loads(bytes(mapped[at:at + n]).decode("utf-8"))
    out: dict[str, torch.Tensor] = {}
    for name, t in head["tensors"].items():
        dtype = _DTYPES[t["dtype"]]
        start, size = int(t["offset"]), int(t["nbytes"])
        if start % ALIGN or start + size > mapped.shape[0]:
            raise ValueError(f"{path}: tensor {name} lies outside the file (a partial file)")
        array = mapped[start:start + size].view(_NUMPY[dtype]).reshape(t["shape"])
        tensor = torch.from_numpy(array)
        out[name] = tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
    return out, head["metadata"]
