"""A preallocated KV cache that records the sequence position of every slot.

Invariants, checked on every write (:meth:`KVCache.write` raises on a violation):

* for every layer ``l``, slots ``[0, lengths[l])`` of ``k[l]``/``v[l]`` hold keys and
  values in increasing position order, and ``positions[l][i]`` is the position of
  slot ``i``;
* a write appends rows whose positions are all greater than the layer's last stored
  position (a chain, or a token tree whose root continues the sequence).

Layers may hold different positions: a drafting round with a skip set writes only
the layers it runs, AdaDecode fills deep layers later, and SpecEE's empty-KV mode
never writes an exited token's deep layers (holes). Masks are therefore built from
the stored positions, never from slot indices. Nothing here copies the whole cache:
``crop`` only moves lengths, and ``compact`` copies just the accepted slots, for all
layers in one indexing op.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F


class CacheInvariantError(AssertionError):
    """A write would break the position order of a layer (a bug in a caller)."""


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        if buffers is not None:  # the engine's pooled static buffers (engine/graphs.py): any capacity >= this one
            self.k, self.v = buffers
        else:  # inference tensors: every update happens under inference mode (engine forward, compact)
            with torch.inference_mode():
                self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, Hkv, S, D)
                self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions: list[list[int]] = [[] for _ in range(num_layers)]  # slot -> sequence position

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.positions]

    def length(self, layer: int) -> int:
        return len(self.positions[layer])

    def last_position(self, layer: int) -> int:
        """The position of the layer's newest slot, -1 when it is empty."""
        p = self.positions[layer]
        return p[-1] if p else -1

    def has_holes(self, layer: int) -> bool:
        p = self.positions[layer]
        return bool(p) and p[-1] != len(p) - 1

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @torch.inference_mode()
    def ensure_capacity(self, needed: int) -> None:
        """Grow (by doubling) so that ``needed`` slots fit; rare, so a copy is fine."""
        if needed <= self.capacity:
            return
        extra = max(needed, 2 * self.capacity) - self.capacity
        self.k, self.v = (F.pad(x, (0, 0, 0, extra)) for x in (self.k, self.v))  # zero slots after the old ones

    def append_slot(self, layer: int, positions: Sequence[int]) -> int:
        """The slot where rows holding ``positions`` go at the layer's end (its length), after checking
        the invariants: the rows come after the layer's newest position and fit the capacity."""
        pos = self.positions[layer]
        if pos and min(positions) <= pos[-1]:
            raise CacheInvariantError(f"layer {layer}: rows at positions {min(positions)}.. written after position "
                                      f"{pos[-1]}; roll the cache back first")
        if len(pos) + len(positions) > self.capacity:
            raise CacheInvariantError(f"layer {layer}: {len(pos) + len(positions)} slots exceed the capacity "
                                      f"{self.capacity}")
        return len(pos)

    def appended(self, layer: int, positions: Sequence[int]) -> None:
        """Record rows holding ``positions`` that a kernel wrote at :meth:`append_slot` (engine/runner.py's
        one-call forward writes K/V in C++; the position list stays this object's)."""
        self.positions[layer].extend(positions)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
              positions: Sequence[int], views: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Append ``T`` rows (``k_new``, ``v_new``: (Hkv, T, D)) holding ``positions`` at the
        layer's end and return views of its keys/values including them: (1, Hkv, len, D)
        (None with ``views=False``: the caller reads ``k``/``v`` directly)."""
        start, t = self.append_slot(layer, positions), k_new.shape[1]
        end = start + t
        self.k[layer].narrow(1, start, t).copy_(k_new)
        self.v[layer].narrow(1, start, t).copy_(v_new)
        self.appended(layer, positions)
        return (self.k[layer, :, :end].unsqueeze(0), self.v[layer, :, :end].unsqueeze(0)) if views else None

    def crop(self, length: int) -> None:
        """Roll every layer back to at most ``length`` slots."""
        assert length >= 0, length
        for p in self.positions:
            del p[length:]

    @torch.inference_mode()
    def compact(self, src_slots: Sequence[int], dst_start: int) -> None:
        """Move the K/V at ``src_slots`` (e.g. an accepted tree path) to contiguous slots
        ``[dst_start, dst_start + n)`` in every layer, and set every layer's length to
        ``dst_start + n``. All layers must already hold the source slots."""
        slots = [int(i) for i in src_slots]  # a Python list: no device sync for the bounds check
        n = len(slots)
        assert not slots or min(self.lengths) > max(slots), (self.lengths, slots)
        if n:
            src = torch.tensor(slots, dtype=torch.long, device=self.k.device)
            self.k[:, :, dst_start : dst_start + n] = self.k.index_select(2, src)
            self.v[:, :, dst_start : dst_start + n] = self.v.index_select(2, src)
        self.positions = [p[:dst_start] + [p[s] for s in slots] for p in self.positions]

    @contextmanager
    def scratch(self, length: int, rows: int) -> Iterator[KVCache]:
        """Temporarily roll every layer back to ``length`` slots so that a side computation
        (SWIFT's teacher-forced scoring of a candidate skip set) can write ``rows`` new
        slots there; on exit the overwritten slots and all positions are restored.
        Costs a copy of ``rows`` slots, never of the whole cache."""
        saved = [list(p) for p in self.positions]
        self.ensure_capacity(length + rows)
        with torch.inference_mode():
            k_saved, v_saved = (x[:, :, length : length + rows].clone() for x in (self.k, self.v))
        self.crop(length)
        try:
            yield self
        finally:
            with torch.inference_mode():
                self.k[:, :, length : length + rows] = k_saved
                self.v[:, :, length : length + rows] = v_saved
            self.positions = saved
