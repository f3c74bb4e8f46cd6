"""The packed-panel cache's file: tensors laid out 64-byte aligned and memory-mapped back without a copy.

A block target's packed panels are as large as the model's weights (1.1 GB for a 1.5B Q4_K_M model). Read
back through safetensors they were copied into the process (and copied again to realign them: safetensors
hands tensors back 32 bytes into a buffer), so a warm start held two or three times the file. Here every
tensor starts on a 64-byte line of the file, and :func:`load` maps the file copy-on-write: the panels are the
page cache's pages, read from disk as the kernel first streams them, shared by every process that maps the
same file, and never copied.

Layout: 8 bytes (little-endian length ``N``), ``N`` bytes of JSON (``{"metadata": {...}, "tensors": {name:
{"dtype", "shape", "offset", "nbytes"}}}``), then each tensor's bytes at its ``offset`` (from the file's
start, a multiple of 64), zero-padded between.

Invariants: :func:`save` writes atomically (a reader sees the whole file or none); :func:`load` checks every
tensor lies inside the file and raises ``ValueError`` for a partial or foreign file (the caller rebuilds);
loaded tensors alias the mapping (no copy), start 64-byte aligned, and are never written by the engine.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..paths import atomic_write

MAGIC = b"SSPANEL1"  # the first 8 bytes; the header's length follows
ALIGN = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
           "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16, torch.uint8: np.uint8,
          torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def save(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write ``tensors`` (contiguous CPU tensors of the dtypes in ``_DTYPES``) and ``metadata`` (JSON) to ``path``."""
    index: dict[str, dict[str, Any]] = {}
    names = list(tensors)
    for name in names:
        t = tensors[name]
        index[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "nbytes": t.numel() * t.element_size()}
    # the header's size depends on the offsets' digits: lay out with a generous bound, then fix
    bound = len(json.dumps({"metadata": metadata, "tensors": index})) + 32 * len(index) + 64
    at = _up(len(MAGIC) + 8 + bound)
    for name in names:
        index[name]["offset"] = at
        at = _up(at + index[name]["nbytes"])
    header = json.dumps({"metadata": metadata, "tensors": index}).encode("utf-8")
    assert len(MAGIC) + 8 + len(header) <= index[names[0]]["offset"] if names else True

    def write(f: Any) -> None:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for name in names:
            f.write(b"\0" * (index[name]["offset"] - f.tell()))
            f.write(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().data if tensors[name].numel() else b"")

    atomic_write(path, write)


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors aliasing a copy-on-write mapping of ``path``, metadata). ``ValueError`` for a foreign or partial file."""
    mapped = np.memmap(str(path), dtype=np.uint8, mode="c")
    if mapped.shape[0] < len(MAGIC) + 8 or bytes(mapped[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"{path} is not a selfspec panel file")
    (n,) = struct.unpack("<Q", bytes(mapped[len(MAGIC):len(MAGIC) + 8]))
    head = json.loads(bytes(mapped[len(MAGIC) + 8:len(MAGIC) + 8 + n]).decode("utf-8"))
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
