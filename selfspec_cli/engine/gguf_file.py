"""A GGUF file's tensors as the engine reads them: memory-mapped blocks, rows in the model's order.

The block target and the block drafts (engine/quant.py) read a GGUF's matrices as the file stores
them; a model loaded straight from the file (lite.py, :func:`selfspec_cli.lite.load_gguf_model`) holds
no float copy of those matrices at all. What both need of the file lives here:

* :func:`read_header` and :class:`GGUFTensors`: the file's header read without decoding its metadata arrays,
  and the file memory-mapped (a tensor's bytes are read from disk when touched, never copied whole), its
  tensors by name (shaped as gguf-py's reader shapes them), its architecture and head counts;
* :func:`row_order`: the row permutation that maps a file's q/k rows back to the Hugging Face order
  (llama.cpp stores a Llama's q and k heads with their two rotary halves interleaved; transformers'
  GGUF loader reverses it, ``LlamaTensorProcessor``), so a block matrix's row ``i`` is the float model's
  row ``i``;
* :meth:`GGUFTensors.dequantize_rows`: float32 rows of a tensor, dequantized with gguf-py as
  transformers' loader dequantizes the whole file (the very values of a converted model), for the
  embedding rows a step looks up, the fingerprint's samples and the float matrices a float target asks for.

Invariants: nothing here writes to the file or copies a whole quantized tensor; rows come back in the
float model's order; values are gguf-py's float32 dequantization, bit for bit.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# the architectures whose q/k rows llama.cpp stores permuted (transformers: TENSOR_PROCESSORS["llama"])
PERMUTED_QK = ("llama",)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    """One tensor of a GGUF file, as gguf-py's reader describes it: ``data`` is a read-only view of the mapped
    file, float32/float16 values for F32/F16, else uint8 rows of blocks (rows, bytes a row)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost (columns) first
    data_offset: int
    n_bytes: int
    data: Any = None


class _HeaderCursor:
    """A read position in a mapped GGUF header: strings, metadata values (arrays skipped) and tensor infos,
    each read at the position and the position moved past it. ``struct.error`` escapes when the header ends
    early (:func:`read_header` turns it into ValueError)."""

    def __init__(self, buf: Any, at: int) -> None:
        self.buf = buf
        self.at = at

    def unpack(self, fmt: str, skip: int | None = None) -> tuple[Any, ...]:
        """``fmt`` unpacked at the position, which moves past it (or by ``skip`` bytes when given)."""
        import struct

        out = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt) if skip is None else skip
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q", 8)
        self.at += n
        if self.at > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", errors="replace")

    def skip_array(self) -> None:
        """Move past an array value (its element type and count first), decoding none of it."""
        import struct

        inner, count = self.unpack("<IQ", 12)
        if inner == _STRING:
            for _ in range(count):
                (n,) = self.unpack("<Q", 8)
                self.at += n
        elif inner in _SCALAR:
            self.at += count * struct.calcsize(_SCALAR[inner])
        else:
            for _ in range(count):
                self.value(inner)

    def value(self, kind: int) -> Any:
        """A metadata value of type ``kind``: a scalar or a string; None for an array (skipped)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self.skip_array()
            return None
        fmt = _SCALAR.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata type {kind}")
        (v,) = self.unpack(fmt)
        return v

    def tensor_info(self) -> TensorInfo:
        """One tensor's entry: its name, dimensions, type and offset (relative to the data section)."""
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.string()
        (n_dims,) = struct.unpack_from("<I", self.buf, self.at)
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.at + 4)
        kind, offset = struct.unpack_from("<IQ", self.buf, self.at + 4 + 8 * n_dims)
        self.at += 4 + 8 * n_dims + 12
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims))
        return TensorInfo(name, qtype, tuple(int(d) for d in dims), offset, n_elems * size // block)


def read_header(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """(scalar and string metadata, tensor infos, file offset of the tensor data) of a GGUF file, read from its
    header only: arrays (the tokenizer's vocabulary) are skipped, not decoded, so this takes milliseconds where
    gguf-py's reader decodes every field (seconds for a 150k-token vocabulary). Raises ValueError for a file
    that is not a well-formed GGUF of version 2 or 3."""
    import mmap
    import struct

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (selfspec reads 2 and 3)")
        cur = _HeaderCursor(buf, 24)
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (kind,) = cur.unpack("<I")
            meta[key] = cur.value(kind)
        infos = [cur.tensor_info() for _ in range(n_tensors)]
        align = int(meta.get("general.alignment") or 32)
        start = (cur.at + align - 1) // align * align
    except struct.error as exc:
        raise ValueError(f"the header ends early ({exc})") from None
    finally:
        buf.close()
    for t in infos:
        t.data_offset += start
    return meta, infos, start


class GGUFTensors:
    """The tensors of one GGUF file by name (memory-mapped: a tensor's bytes are read when touched), and the
    facts about it the engine needs."""

    _fd = -1  # (set first in __init__; __del__ reads it even when __init__ failed)

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

        self.path = str(path)
        meta, infos, _ = read_header(path)
        size = Path(path).stat().st_size
        short = [t.name for t in infos if t.data_offset + t.n_bytes > size]
        if short:
            raise ValueError(f"tensor data of {short[0]} lies past the end of the file (truncated)")
        self._mapped = mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._fd = os.open(self.path, os.O_RDONLY)  # for a few rows at a time (dequantize_rows)
        for t in infos:  # as gguf-py's reader shapes them
            raw = mapped[t.data_offset:t.data_offset + t.n_bytes]
            rows = tuple(reversed(t.shape))
            if t.tensor_type in (Q.F32, Q.F16):
                t.data = raw.view(np.float32 if t.tensor_type == Q.F32 else np.float16).reshape(rows)
            else:
                block, bsize = GGML_QUANT_SIZES[t.tensor_type]
                t.data = raw.reshape(*rows[:-1], rows[-1] // block * bsize)
        self.tensors = {t.name: t for t in infos}
        self.architecture = str(meta.get("general.architecture") or "")
        arch = self.architecture
        self.num_heads = meta.get(f"{arch}.attention.head_count")
        self.num_kv_heads = meta.get(f"{arch}.attention.head_count_kv") or self.num_heads

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def drop(self, name: str) -> None:
        """Unmap tensor ``name``'s pages from this process (they stay in the page cache): a block copy built from the
        file (engine/quant.py) then holds one matrix of the file at a time, not the whole file."""
        import mmap

        t, page = self.tensors[name], mmap.PAGESIZE
        start = t.data_offset // page * page
        with contextlib.suppress(AttributeError, OSError, ValueError):
            self._mapped._mmap.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as the float model holds it (rows first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def order(self, name: str) -> torch.Tensor | None:
        """The file rows that make the float model's rows 0, 1, ... of tensor ``name`` (None: the same order)."""
        return row_order(self.architecture, name, self.shape(name)[0], self.num_heads, self.num_kv_heads)

    def dequantize_rows(self, name: str, rows: Any = None) -> torch.Tensor:
        """Float32 rows ``rows`` (float-model order; None: all) of tensor ``name``, as gguf-py dequantizes them."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        n_rows = self.shape(name)[0]
        order = self.order(name)
        if rows is None:
            raw = np.asarray(t.data)
            raw = raw.reshape(n_rows, -1) if raw.ndim != 2 or raw.shape[0] != n_rows else raw
            idx = np.arange(n_rows) if order is None else order.numpy()
            values = dequantize(raw[idx], t.tensor_type)
        else:  # a few rows: read with pread, not through the mapping, whose faults map 64 KB around each page touched
            idx = np.asarray(rows, dtype=np.int64).reshape(-1)
            if order is not None:
                idx = order.numpy()[idx]
            size = t.n_bytes // n_rows
            buf = b"".join(os.pread(self._fd, size, t.data_offset + int(i) * size) for i in idx)
            raw = np.frombuffer(buf, dtype=t.data.dtype).reshape(len(idx), -1)
            values = dequantize(raw, t.tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(len(idx), -1)
        # float32 rows read with pread come back as the read-only bytes themselves: a tensor owns its own copy
        return torch.from_numpy(values if values.flags.writeable else values.copy())


def row_order(architecture: str, name: str, rows: int, num_heads: int | None, num_kv_heads: int | None) -> torch.Tensor | None:
    """The inverse of llama.cpp's q/k row permutation for ``name`` (``blk.N.attn_q.weight`` or ``attn_k``), as
    transformers' ``_reverse_permute_weights`` applies it, as a row index; None where rows are stored in order."""
    if architecture not in PERMUTED_QK or not num_heads:
        return None
    if ".attn_q." in name:
        heads = num_heads
    elif ".attn_k." in name:
        heads = num_kv_heads or num_heads
    else:
        return None
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


# the GGUF types the block kernel reads as blocks (engine/quant.py); a matrix of another type (F32, F16,
# BF16, ...) is a float matrix of the model
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str, tied: bool = False) -> str:
    """The GGUF tensor behind a Llama-family parameter name (transformers' names; llama.cpp's in the file)."""
    if hf_name == "model.embed_tokens.weight" or (tied and hf_name == "lm_head.weight"):
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(hf_name)
