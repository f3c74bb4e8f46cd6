"""Quantized self-drafts: a low-precision copy of a model's own matrices, beside the target's.

The draft is the target model with every matrix product (q/k/v, o, gate/up, down, the LM
head) read from integer codes instead of the float weights; norms, embeddings, rotary
tables and the KV cache are the target's. Verification never touches this copy, so
every lossless method stays exact whatever the draft computes (docs/engine.md,
"Quantized drafts").

Precisions (``PRECISIONS``):

* ``int8``: symmetric round-to-nearest, one scale per output channel;
* ``int8-g32``: the same with one scale per 32 input weights;
* ``w4a8``: the ``gguf`` copy's 4-bit blocks times int8-quantized activations (kernels.A8Linear):
  no bytes of its own, several times fewer instructions per weight; the draft for a block target;
* ``gguf``: the GGUF file's own blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) for a model
  converted from a GGUF.
  Where the fp32 target was dequantized from that file, the block draft's weights *are*
  the target's weights (checked at build, row by row, exactly; only the summation order
  in the kernel differs). Tensors of other GGUF types (F16, BF16, ...) fall back to int8
  per channel, reported per matrix.

Invariants:

* the target's weights are never modified; the draft copy is built once per model and
  precision, cached on disk (beside a converted GGUF model, in its ``drafts/`` folder, else in
  ``drafts/`` of selfspec's cache, :func:`selfspec_cli.paths.cache_root`;
  ``<fingerprint>-<dtype>-<precision>-v<format>.panels`` (engine/panel_file.py), written atomically; an
  unreadable file is rebuilt),
  and a second load reads the cache instead of re-quantizing;
* every quantized weight is within its format's bound of the float weight it stands for
  (int8: half a scale step; tests/test_quant.py);
* the kernel (``kernels.QLinear``) is batch-invariant, like the float one.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ArtifactError
from ..paths import atomic_open, cache_root
from . import kernels, panel_file
from .adapter import LINEARS, ModelAdapter
from .kernels import PartsLinear, QLinear, QuantWeight, quantize_int8

PRECISIONS = ("int8", "int8-g32", "gguf", "w4a8")
_GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
               "down": ("ffn_down",)}


@dataclass
class DraftWeights:
    """One precision's matrices: ``layers[l][name]`` for :data:`LINEARS` and ``head``."""

    precision: str
    layers: list[dict[str, QLinear]]
    head: QLinear
    info: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(kernels.stream_bytes(q) for d in self.layers for q in d.values()) + kernels.stream_bytes(self.head)


# ------------------------------------------------------------------ building


def _int8(adapter: ModelAdapter, group: int | None) -> tuple[list[dict[str, QuantWeight]], QuantWeight, dict]:
    """Every matrix rounded to int8, one at a time (a model read from its GGUF blocks dequantizes each for this
    alone: ModelAdapter.float_values)."""
    return ([{n: quantize_int8(adapter.float_values(l, n), group) for n in LINEARS} for l in range(adapter.num_layers)],
            quantize_int8(adapter.float_values(None, "head"), group), {})


def _gguf_block(t: Any) -> QuantWeight | None:
    """A GGUF tensor's blocks as a QuantWeight (rows = the tensor's rows as stored), or None for a
    type the kernel does not take. The codes and per-group scales (and minimums) reproduce gguf-py's
    dequantization exactly (the same float32 products): Q8_0, Q4_0 and Q4_1 as they are; Q5_0, Q5_1 and
    Q5_K as bytes (5-bit codes, 1 byte a weight); Q6_K as 6-bit codes (``bits`` 6: int8 values -32..31,
    which the kernel's panels hold in 6 bits); Q4_K as 4-bit codes. The K-quants' groups
    (32 weights; Q6_K's 16) carry their sub-block's ``d * sc`` and ``-(dmin * m)`` as float32 scale and
    minimum, and their factors too (``sc``, ``m`` per group, ``d``, ``dmin`` per 256 weights: the kernel
    streams those and forms the same products, :class:`~selfspec_cli.engine.kernels.QuantWeight`)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    kind = t.tensor_type
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q4_K: 144, Q.Q5_K: 176,
            Q.Q6_K: 210}.get(kind)  # bytes per block (32 weights; 256 for the K-quants)
    if size is None:
        return None
    raw = np.asarray(t.data)
    n = raw.shape[0]
    b = raw.reshape(n, -1, size)
    nb = b.shape[1]

    def f16(at: int) -> np.ndarray:  # (n, blocks) float32 from the float16 at byte ``at`` of each block
        return b[:, :, at: at + 2].copy().view(np.float16).astype(np.float32)[..., 0]

    def rows(a: np.ndarray | None, dtype: Any = None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(n, -1))

    def qw(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, group: int, bits: int,
           factors: tuple[np.ndarray, ...] = (None, None, None, None)) -> QuantWeight:
        sc, m, d, dmin = factors
        return QuantWeight(kind.name.lower(), rows(codes), rows(scales, np.float32), rows(mins, np.float32), group, bits,
                           rows(sc, np.int8), rows(m, np.int8), rows(d, np.float32), rows(dmin, np.float32))

    def high_bits(qh: np.ndarray, count: int) -> np.ndarray:  # (n, nb, 4) bytes -> (n, nb, count) bits, LE
        word = qh.copy().view(np.uint32)  # (n, nb, 1)
        return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)

    if kind == Q.Q8_0:
        return qw(b[:, :, 2:].copy().view(np.int8), f16(0), None, 32, 8)
    if kind in (Q.Q4_0, Q.Q4_1):
        qs = b[:, :, size - 16:]  # (n, blocks, 16): weights j and j + 16
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return qw(codes, f16(0), f16(2) if kind == Q.Q4_1 else None, 32, 4)
    if kind in (Q.Q5_0, Q.Q5_1):  # d (, m), qh (4 bytes), qs (16): q = low nibble | bit << 4
        at = 2 if kind == Q.Q5_0 else 4
        qs = b[:, :, at + 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high_bits(b[:, :, at:at + 4], 32) << 4)
        if kind == Q.Q5_0:
            return qw(q.astype(np.int8) - np.int8(16), f16(0), None, 32, 8)
        return qw(q.astype(np.int8), f16(0), f16(2), 32, 8)
    if kind in (Q.Q4_K, Q.Q5_K):  # d, dmin, 12 bytes of 6-bit scales and minimums, (qh 32,) qs 128
        from gguf.quants import Q4_K as _Q4K

        sc, mn = _Q4K.get_scale_min(b[:, :, 4:16].reshape(n * nb, 12))
        sc, mn = sc.reshape(n, nb, 8), mn.reshape(n, nb, 8)  # 6-bit integers
        d = f16(0)[..., None] * sc.astype(np.float32)  # (n, nb, 8): gguf-py's products (exact in float32)
        dm = f16(2)[..., None] * mn.astype(np.float32)
        factors = (sc, mn, f16(0), f16(2))  # the kernel reads these and forms the same products
        qs = b[:, :, size - 128:].reshape(n, nb, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)  # sub-block 2i: low, 2i + 1: high
        if kind == Q.Q4_K:
            return qw(q, d, -dm, 32, 4, factors)
        qh = b[:, :, 16:48]  # bit i of byte j: the fifth bit of weight j of sub-block i
        q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1) << 4)
        return qw(q.astype(np.int8), d, -dm, 32, 8, factors)
    # Q6_K: ql 128, qh 64, 16 int8 scales, d; sub-blocks of 16
    ql = b[:, :, :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, nb, 8, 32)
    qh = b[:, :, 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, nb, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, :, 192:208].copy().view(np.int8)  # (n, nb, 16) int8
    d = f16(208)[..., None] * sc.astype(np.float32)  # exact in float32
    return qw(q, d, None, 16, 6, (sc, None, f16(208), None))


def _match_rows(block: QuantWeight, target: torch.Tensor) -> torch.Tensor | None:
    """The row order that makes ``block`` dequantize to ``target`` exactly (llama.cpp stores
    q/k rows permuted for its rotary layout), or None when some target row is not in the file."""
    deq = block.dequantize()
    if deq.shape != target.shape:
        return None
    if torch.equal(deq, target):
        return torch.arange(target.shape[0])
    where: dict[bytes, int] = {}  # a row's bytes -> the first file row holding them
    for i, row in enumerate(deq.numpy()):
        where.setdefault(row.tobytes(), i)
    order = [where.get(row.tobytes()) for row in target.detach().float().numpy()]
    return None if None in order else torch.tensor(order)


def _take_rows(q: QuantWeight, order: torch.Tensor) -> QuantWeight:
    return q.take_rows(order)


def _layout(q: QuantWeight) -> tuple[int, int, bool]:
    """What the kernel's arithmetic depends on: code width, group size, and whether minimums are added. Two
    GGUF types of one layout are one matrix to ``qlinear`` (Q5_0 and Q8_0: byte codes, a scale per 32)."""
    return q.bits, q.group, q.mins is None


def _cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Row-concatenate blocks of one layout (q/k/v or gate/up, fused as the engine fuses them); parts of
    several GGUF types (a Q4_K_M file's Q5_0 q/k with a Q8_0 v) are named together, ``q5_0+q8_0``."""
    return QuantWeight.cat(parts, "+".join(dict.fromkeys(p.fmt for p in parts)))


class GGUFDraftError(ValueError):
    """The model's GGUF blocks cannot serve as its draft (no GGUF source, or other weights)."""


class _GGUFBlocks:
    """One GGUF file's blocks read for a model's matrices (:func:`_gguf`): what each matrix became is counted as it
    is read (``exact``: the file's own blocks; ``fallback``: quantized to int8 per channel instead, reported)."""

    def __init__(self, adapter: ModelAdapter, gguf_file: str, source: Any, pack: Any) -> None:
        self.adapter, self.gguf_file, self.source, self.pack = adapter, gguf_file, source, pack
        self.tensors = source.tensors
        self.fallback: list[str] = []
        self.exact = 0

    def load(self, name: str, target: torch.Tensor) -> QuantWeight:
        """The blocks of tensor ``name``, rows in ``target``'s order (or ``target`` quantized to int8 when the
        kernel does not take the tensor's type)."""
        from .gguf_file import row_order

        t = self.tensors.get(name)
        if t is None:
            raise GGUFDraftError(f"tensor '{name}' is missing from {self.gguf_file}")
        block = _gguf_block(t)
        if block is None:
            self.fallback.append(f"{name} ({t.tensor_type.name})")
            return quantize_int8(target)
        if target.is_meta:  # a model read from these very blocks (lite.load_gguf_model): rows in the file's order,
            self.exact += 1  # but a Llama's q/k, which llama.cpp stores permuted
            a = self.adapter
            order = row_order(self.source.architecture, name, target.shape[0], a.num_heads, a.num_kv_heads)
            return block if order is None else _take_rows(block, order)
        order = _match_rows(block, target.detach().float())
        if order is None:
            raise GGUFDraftError(f"the weights of '{name}' in {self.gguf_file} are not the model's (the target was "
                                 "not dequantized from this file); use --draft-precision int8")
        self.exact += 1
        return _take_rows(block, order)

    def layer(self, l: int, w: Any) -> dict[str, Any]:
        """Layer ``l``'s packed matrices by name."""
        return {name: self._matrix(l, name, w) for name in LINEARS}

    def _matrix(self, l: int, name: str, w: Any) -> Any:
        """The product of matrix ``name`` of layer ``l`` from its file parts: one block, the parts fused, the parts
        side by side (different layouts), or int8 (a part of a float type). The parts' tensors are dropped once
        read, and the unpacked parts are let go before the packing."""
        target, parts = getattr(w, f"w_{name}"), _GGUF_PARTS[name]
        pieces = target.split(_split_sizes(self.adapter, name, target))
        got = [self.load(f"blk.{l}.{p}.weight", piece) for p, piece in zip(parts, pieces)]
        for p in parts:
            self.source.drop(f"blk.{l}.{p}.weight")  # read: its pages leave the process (the page cache keeps them)
        if len(got) == 1:
            q = got[0]
        elif "int8" not in {g.fmt for g in got} and len({_layout(g) for g in got}) == 1:
            q = _cat_rows(got)
        elif "int8" not in {g.fmt for g in got}:  # parts of different layouts: each its own product, side by side
            bias = getattr(w, f"b_{name}")
            biases = [None] * len(got) if bias is None else bias.split([g.codes.shape[0] for g in got])
            return PartsLinear([self.pack(None, name, g, b) for g, b in zip(got, biases)])
        else:  # a part of a float type: the fused matrix runs as a float matrix (target_linears)
            self.fallback.append(f"blk.{l}.{'+'.join(parts)} (mixed types)")
            self.exact -= sum(g.fmt != "int8" for g in got)  # the parts load() had counted as exact
            q = quantize_int8(self.adapter.float_matrix(l, name))
        del got
        return self.pack(l, name, q)

    def head(self) -> Any:
        """The packed head: read by chunks of rows when the model was read from this file (no row order to
        match), else matched to the model's head like any matrix."""
        tensors, adapter = self.tensors, self.adapter
        head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        t = tensors[head_name]
        if adapter.lm_head.is_meta and _gguf_block(_Rows(t, 0, 64)) is not None:  # no row order to match: by chunks
            rows = adapter.lm_head.shape[0]
            head = _stacked((self.pack(None, "head", _gguf_block(_Rows(t, i, i + HEAD_CHUNK)))
                             for i in range(0, rows, HEAD_CHUNK)), rows)
            self.source.drop(head_name)
            self.exact += 1
            return head
        return self.pack(None, "head", self.load(head_name, adapter.lm_head))


def _keep_all(key: str, q: Any) -> Any:
    return q


def _gguf(adapter: ModelAdapter, gguf_file: str, pack: Any,
          keep: Callable[[str, Any], Any] = _keep_all) -> tuple[list[dict[str, Any]], Any, dict]:
    """The GGUF's own blocks for every matrix, rows matched to the target's, each handed to ``pack(layer, name,
    QuantWeight)`` as soon as it is read (so the unpacked codes of one matrix at a time are held; the head of a
    model read from the file, the largest matrix, in super-panels of rows), then to ``keep(key, packed)``, whose
    result is what the returned layers hold (a writer that streams each matrix to the cache file returns None).
    A tensor whose type the kernel does not take is quantized to int8 per channel instead (reported)."""
    from .gguf_file import GGUFTensors

    if not Path(gguf_file).is_file():
        raise GGUFDraftError(f"the GGUF file the model was converted from is gone ({gguf_file})")
    try:
        source = GGUFTensors(gguf_file)
    except (OSError, ValueError) as exc:
        raise GGUFDraftError(f"cannot read {gguf_file} ({exc})") from None
    blocks = _GGUFBlocks(adapter, gguf_file, source, pack)
    layers = [{n: keep(f"{l}.{n}", q) for n, q in blocks.layer(l, w).items()} for l, w in enumerate(adapter.layers)]
    head = keep("head", blocks.head())
    info = {"gguf_file": gguf_file, "exact_matrices": blocks.exact, "int8_fallback": blocks.fallback,
            "types": sorted({t.tensor_type.name for t in blocks.tensors.values() if t.name.endswith(".weight")})}
    return layers, head, info


def _stacked(chunks: Iterator[QLinear], rows: int) -> QLinear:
    """One product over the ``rows`` rows of ``chunks`` (each but the last a whole number of 64-output super-panels,
    so their packed panels follow each other), copied into the whole matrix's panels as each chunk is made: one
    chunk is held beside the result, not all of them."""
    supers = (rows + 63) // 64
    out: dict[str, torch.Tensor | None] = {}
    at, n, nbytes, first = 0, 0, 0, None
    for c in chunks:
        first = first or c
        for key in ("codes", "scales", "mins"):
            t = getattr(c, key)
            if key not in out:
                out[key] = None if t is None else t.new_empty((supers, *t.shape[1:]))
            if t is not None:
                out[key][at:at + t.shape[0]] = t
        at, n, nbytes = at + c.codes.shape[0], n + c.out_features, nbytes + kernels.stream_bytes(c)
    assert first is not None and at == supers and n == rows
    return QLinear.from_panels(first.meta.fmt, first.meta.group, first.meta.bits, out["codes"], out["scales"],
                               out["mins"], None, first.module, rows, nbytes)


HEAD_CHUNK = 8192  # rows of a head read at a time (a multiple of the kernel's 64-output super-panels)


@dataclass
class _Rows:
    """Rows [start, stop) of a GGUF tensor, as :func:`_gguf_block` reads a tensor."""

    whole: Any
    start: int
    stop: int

    @property
    def tensor_type(self) -> Any:
        return self.whole.tensor_type

    @property
    def data(self) -> Any:
        return self.whole.data[self.start:self.stop]


def _split_sizes(adapter: ModelAdapter, name: str, fused: torch.Tensor) -> list[int]:
    """Row counts of the parts of matrix ``name``: q, k, v; gate, up; or the one matrix."""
    if name == "qkv":
        d = adapter.head_dim
        return [adapter.num_heads * d, adapter.num_kv_heads * d, adapter.num_kv_heads * d]
    n = len(_GGUF_PARTS[name])
    return [fused.shape[0] // n] * n


# ------------------------------------------------------------------ cache


def gguf_source(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The GGUF a cached model directory was converted from (``selfspec-source.json``, written by
    :func:`selfspec_cli.loading.gguf_to_hf_dir`), or None."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((Path(model_dir) / "selfspec-source.json").read_text(encoding="utf-8"))
    return None


CACHE_FORMAT = 7  # bump when the quantizers, the kernel's panel layout or the file layout change: older files are
# not read (2: fused parts of different GGUF types but one layout, such as Q5_0 q/k with a Q8_0 v, stay blocks;
# 3: the kernel's packed panels, read without repacking; 4: K-quants' scales as their factors, d per 256 weights
# and an integer per group; 5: engine/panel_file's 64-byte aligned file, memory-mapped back; 6: Q6_K's codes in 6
# bits; 7: Q6_K's 6-bit lines laid out per dword, four k to a dword, for the kernel's masked decode)


def cache_path(fingerprint: str, precision: str, model_dir: str | None = None, dtype: str = "float32") -> Path:
    """Beside the converted model when the model is one of selfspec's GGUF conversions, else in
    ``drafts/`` of selfspec's cache (:func:`selfspec_cli.paths.cache_root`); keyed by the
    model's fingerprint (dtype-independent), the dtype the weights were loaded in (an int8
    copy of bf16-rounded weights is another copy), the precision and :data:`CACHE_FORMAT`.
    A model read straight from its GGUF's blocks keeps only its blocks' copy beside it: a copy at
    another precision (int8 of a 4-bit file: 1.5 GB for Qwen2.5-Coder-1.5B's 1.1 GB) goes to the
    cache's ``drafts/``, so that nothing in a model's directory is larger than its file."""
    name = f"{fingerprint}-{dtype}-{precision}-v{CACHE_FORMAT}.panels"
    source = gguf_source(model_dir) if model_dir else None
    if source is not None and os.access(model_dir, os.W_OK) and (precision == "gguf" or source.get("weights") != "gguf"):
        return Path(model_dir) / "drafts" / name
    return cache_root() / "drafts" / name


def _entries(key: str, q: QLinear | PartsLinear) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Matrix ``key``'s packed panels as the kernel reads them (codes, scales, minimums; a product of parts: each part
    its own entry, ``<key>.part<i>``), and its format entries: per matrix its format, group, bits, outputs and
    streamed bytes."""
    formats: list[str] = []
    items: list[tuple[str, QLinear]] = [(key, q)]
    if isinstance(q, PartsLinear):
        items = [(f"{key}.part{i}", p) for i, p in enumerate(q.parts)]
        formats.append(f"{key}=parts:{len(q.parts)}")
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, m in items:
        tensors += [(f"{name}.{part}", t) for part in ("codes", "scales", "mins") if (t := getattr(m, part)) is not None]
        formats.append(f"{name}={m.meta.fmt}:{m.meta.group}:{m.meta.bits}:{m.out_features}:{kernels.stream_bytes(m)}")
    return tensors, formats


def _save(path: Path, draft: DraftWeights, meta: dict[str, Any]) -> None:
    """The whole copy, so that a load repacks nothing (engine/panel_file.py: 64-byte aligned, read back
    memory-mapped)."""
    tensors: dict[str, torch.Tensor] = {}
    formats: list[str] = []
    for key, q in [*((f"{l}.{n}", q) for l, d in enumerate(draft.layers) for n, q in d.items()), ("head", draft.head)]:
        got, fm = _entries(key, q)
        tensors.update((name, t.contiguous()) for name, t in got)
        formats += fm
    panel_file.save(path, tensors, {"info": json.dumps(meta), "formats": ";".join(formats)})


def _gguf_to_file(path: Path, adapter: ModelAdapter, gguf_file: str, pack: Any, t0: float,
                  module: Any) -> tuple[list[dict[str, QLinear]], QLinear, dict[str, Any]] | None:
    """The GGUF's blocks packed straight into the cache file at ``path``, each matrix written as soon as it is packed
    and let go (a 1.5B model's copy is a gigabyte: held whole before its write, it set the first call's peak), then
    mapped back as :func:`_load` reads it. None when the cache cannot be written (the caller builds in memory)."""
    try:
        with atomic_open(path) as f:
            out, formats = panel_file.Writer(f), []

            def keep(key: str, q: QLinear | PartsLinear) -> None:
                got, fm = _entries(key, q)
                for name, t in got:
                    out.add(name, t)
                formats.extend(fm)

            _, _, extra = _gguf(adapter, gguf_file, pack, keep)
            meta = {"precision": "gguf", "built_s": round(time.perf_counter() - t0, 2), **extra}
            out.finish({"info": json.dumps(meta), "formats": ";".join(formats)})
    except (ArtifactError, OSError):
        return None
    return _load(path, adapter, module)


def _load(path: Path, adapter: ModelAdapter, module: Any) -> tuple[list[dict[str, QLinear]], QLinear, dict[str, Any]] | None:
    """The copy :func:`_save` wrote, or None when the file is absent, partial, foreign or of other shapes. The
    panels alias the file's pages (no copy: a warm start holds the copy once, in the page cache)."""
    try:
        tensors, meta = panel_file.load(path)
        formats = dict(item.split("=", 1) for item in meta.get("formats", "").split(";") if "=" in item)

        def get(key: str, bias: torch.Tensor | None, rows: int) -> QLinear | PartsLinear:
            if formats[key].startswith("parts:"):
                got = [get(f"{key}.part{i}", None, -1) for i in range(int(formats[key].split(":")[1]))]
                if sum(g.out_features for g in got) != rows:
                    raise ValueError(f"{key}: {sum(g.out_features for g in got)} outputs stored, {rows} in the model")
                if bias is not None:
                    for g, b in zip(got, bias.split([g.out_features for g in got])):
                        g.bias = b.detach().float().contiguous()
                return PartsLinear(got)
            fmt, group, bits, n, nbytes = formats[key].split(":")
            rows = int(n) if rows == -1 else rows
            codes = tensors[f"{key}.codes"]
            if int(n) != rows or codes.dim() != 3 or codes.shape[0] * 64 < rows:
                raise ValueError(f"{key}: {n} outputs stored, {rows} in the model")
            return QLinear.from_panels(fmt, int(group), int(bits), codes, tensors[f"{key}.scales"],
                                       tensors.get(f"{key}.mins"), bias, module, rows, int(nbytes))

        layers = [{n: get(f"{l}.{n}", getattr(w, f"b_{n}"), adapter.out_features(l, n)) for n in LINEARS}
                  for l, w in enumerate(adapter.layers)]
        return layers, get("head", None, adapter.head_rows), json.loads(meta.get("info", "{}"))
    except Exception:  # noqa: BLE001  absent, partial or foreign: rebuild
        return None


def _drop_older_formats(path: Path) -> None:
    """Remove the copies of older cache formats beside ``path`` (and the agreement readings kept beside
    them): no load reads them again."""
    stem = path.name.removesuffix(f"-v{CACHE_FORMAT}.panels")
    for old in path.parent.glob(f"{stem}-v*"):  # (formats up to 4 were .safetensors files)
        version = old.name[len(stem) + 2:].split(".", 1)[0]
        if version.isdigit() and int(version) < CACHE_FORMAT:
            with contextlib.suppress(OSError):
                old.unlink()


def _packer(adapter: ModelAdapter, module: Any) -> Callable[[int | None, str, QuantWeight], QLinear]:
    """``pack(layer, name, q, bias=None)``: ``q`` packed for the kernel, with layer ``layer``'s bias of matrix
    ``name`` (layer None: ``bias``)."""

    def pack(layer: int | None, name: str, q: QuantWeight, bias: torch.Tensor | None = None) -> QLinear:
        return QLinear.make(q, bias if layer is None else getattr(adapter.layers[layer], f"b_{name}"), module)

    return pack


def build_draft(adapter: ModelAdapter, precision: str, fingerprint: str | None, gguf_file: str | None,
                module: Any, model_dir: str | None = None) -> DraftWeights:
    """The draft copy at ``precision``: from the disk cache when it holds one for this model
    (``fingerprint``), else quantized now and cached. Raises :class:`GGUFDraftError` for
    ``gguf`` without a usable GGUF source."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown draft precision '{precision}'; choose one of: {', '.join(PRECISIONS)}")
    t0 = time.perf_counter()
    path = cache_path(fingerprint, precision, model_dir, str(adapter.dtype).removeprefix("torch.")) if fingerprint else None
    loaded = _load(path, adapter, module) if path is not None and path.is_file() else None
    cache = "hit"
    if loaded is None and precision == "gguf" and gguf_file and path is not None:
        loaded, cache = _gguf_to_file(path, adapter, gguf_file, _packer(adapter, module), t0, module), "miss"
    if loaded is not None:
        layers_q, head_q, meta = loaded
        draft = DraftWeights(precision, layers_q, head_q)
        info = {"cache": cache, **meta}
        if cache == "miss":
            _drop_older_formats(path)
    else:
        pack = _packer(adapter, module)
        if precision == "gguf":
            if not gguf_file:
                raise GGUFDraftError("the model was not loaded from a GGUF file")
            layers, head, extra = _gguf(adapter, gguf_file, pack)
        else:
            layers_q, head_q, extra = _int8(adapter, 32 if precision == "int8-g32" else None)
            layers = [{n: pack(l, n, q) for n, q in d.items()} for l, d in enumerate(layers_q)]
            head = pack(None, "head", head_q)
        meta = {"precision": precision, "built_s": round(time.perf_counter() - t0, 2), **extra}
        draft = DraftWeights(precision, layers, head)
        if path is not None:
            try:
                _save(path, draft, meta)
            except ArtifactError:
                path = None  # a read-only cache only costs the next load the quantization
            else:
                _drop_older_formats(path)
        info = {"cache": "miss" if path is not None else "off", **meta}
    draft.info = {**info, "load_s": round(time.perf_counter() - t0, 3), "bytes": draft.nbytes(),
                  "formats": sorted({q.meta.fmt for d in draft.layers for q in d.values()} | {draft.head.meta.fmt}),
                  "isa": kernels.isa() if module is not None else None}
    if path is not None:
        draft.info["path"] = str(path)
    return draft


def subset(head: QLinear, ids: torch.Tensor, module: Any, chunk: int = HEAD_CHUNK) -> QLinear:
    """The quantized head's rows for ``ids`` (FR-Spec's draft vocabulary over the draft copy): row ``i`` is token
    ``ids[i]``'s, the same codes and scales. The head's panels are unpacked ``chunk`` rows at a time (a multiple of
    the 64-output super-panels), only where ``ids`` fall: Qwen2.5's 151,936-row Q6_K head unpacked whole held
    2.7 GB for a moment, more than the model."""
    base = getattr(head, "base", head)  # an int8-activation wrapper holds its panels in ``base``
    ids = ids.cpu().to(torch.int64)
    n, m = base.out_features, base.meta
    parts: list[QuantWeight] = []
    where: list[torch.Tensor] = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        sel = torch.nonzero((ids >= start) & (ids < stop)).flatten()
        if sel.numel() == 0:
            continue
        sp = slice(start // 64, (stop + 63) // 64)
        rows = QLinear.from_panels(m.fmt, m.group, m.bits, base.codes[sp], base.scales[sp],
                                   None if base.mins is None else base.mins[sp], None, base.module, stop - start, 0)
        parts.append(_take_rows(rows.quant, ids[sel] - start))
        where.append(sel)
    q = parts[0] if len(parts) == 1 else QuantWeight.cat(parts, parts[0].fmt)
    order = torch.empty_like(ids)
    order[torch.cat(where)] = torch.arange(ids.numel())  # row j of q is token ids[where[j]]: back to ids' order
    return QLinear.make(_take_rows(q, order), None, module)
