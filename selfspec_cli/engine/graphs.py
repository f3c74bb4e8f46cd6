"""Fixed-shape forwards, replayed as CUDA graphs on a GPU: a decode step whose cost follows its work.

On a GPU a small model's step is bound by kernel launches, not bytes (docs/benchmarks.md, "GPU"):
the eager loop of :mod:`.runner` issues every op from Python with shapes that change each step.
:class:`StaticForward` runs the same layers over a fixed number of rows ``R`` (the real rows, then
padding) against the whole KV buffer, so every forward of one sublayer set has one shape and is
captured once as a CUDA graph and replayed (gpt-fast and vLLM's recipe; the static KV cache is the
engine's pooled buffer, :meth:`StaticForward.buffers`).

Invariants:

* **batch invariance by shape.** Every forward, one row or a k-row verification, runs the same
  kernels on ``R`` rows (a longer chain runs in ``R``-row chunks), so a row's result does not
  depend on how many real rows share its forward: a k-row verification equals k one-row steps bit
  for bit in any dtype, bf16 included (the matrix products and attention pick their kernel by
  shape; with one shape they pick one). Padding rows never touch a real row: each row attends only
  the slots its mask allows, and a padding row writes its K/V into the buffer's last ``R`` slots,
  which no real row uses (a forward first makes room for its rows below them).
* **slot == position.** A forward is taken here only when every layer it runs holds exactly the
  positions ``0..n-1`` in slots ``0..n-1`` (a dense cache; a tree's nodes sit at ``n..n+T-1`` and
  attend by the tree's mask, in ``R``-row chunks when it is wider). Anything else (holes,
  residual-stream inputs, a layer range, a quantized copy or a subset head, a draft's KV window) returns None and
  the caller runs the eager loop; :attr:`StaticForward.eager_fallbacks` counts those calls.
* **outputs are copies.** A graph's output buffers are overwritten by its next replay, so what a
  forward returns is cloned from them.

Without CUDA the same fixed-shape code runs eagerly (no capture): the CPU tests check the
invariants above on it, and ``selfspec`` never enables it on a CPU by default (the CPU kernels of
:mod:`.kernels` are already row-wise, and padding would cost a CPU real work).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .route import ForwardTaps, Route

if TYPE_CHECKING:
    from .cache import KVCache
    from .runner import Engine

DEFAULT_ROWS = 32  # rows of every fixed-shape forward: the widest verification (a tree's nodes) it takes whole
MAX_GRAPHS = 64  # captured sublayer sets kept (the least recently replayed goes first)
CAPACITY_STEP = 512  # the pooled KV buffer's capacity grows in these steps (each size is one set of graphs)


@dataclass(slots=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    out: tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]


class StaticForward:
    """The fixed-shape forward of an :class:`~.runner.Engine` (see the module docstring)."""

    def __init__(self, engine: Engine, rows: int = DEFAULT_ROWS, capture: bool | None = None) -> None:
        self.e, self.rows = engine, rows
        self.capture = engine.device.type == "cuda" if capture is None else capture
        dev = engine.device
        # the static inputs every graph reads: token ids, rotary positions, the first new slot, the new block's mask
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot0 = torch.zeros(1, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.long, device=dev)  # real rows; the rest are padding
        self._ar = torch.arange(rows, device=dev)
        self._tree_allowed: dict[int, torch.Tensor] = {}  # capacity -> (R, capacity) a tree chunk's mask
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._buffers: list[tuple[weakref.ref | None, torch.Tensor, torch.Tensor]] = []
        self.eager_fallbacks = 0
        self.replays = 0
        self.captures = 0

    # -- the KV buffers --------------------------------------------------------
    def buffers(self, capacity: int, shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A K and a V buffer of at least ``capacity`` slots (plus the padding rows), reused from an earlier
        cache that is gone, so that its captured graphs serve the new cache too."""
        need = capacity + self.rows
        for holder, k, v in self._buffers:
            if (holder is None or holder() is None) and k.shape[2] >= need:
                return k, v
        cap = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        layers, heads, dim = shape
        with torch.inference_mode():
            k = torch.zeros(layers, heads, cap, dim, dtype=dtype, device=self.e.device)
            v = torch.zeros_like(k)
        self._buffers = [b for b in self._buffers if b[0] is not None and b[0]() is not None]  # drop free ones
        self._drop_graphs_except({b[1].data_ptr() for b in self._buffers})
        self._buffers.append((None, k, v))
        return k, v

    def hold(self, cache: KVCache) -> None:
        """Record ``cache`` as the user of its buffer (free again once the cache is gone)."""
        self._buffers = [(weakref.ref(cache) if k is cache.k else h, k, v) for h, k, v in self._buffers]

    def _drop_graphs_except(self, ptrs: set[int]) -> None:
        for key in [k for k in self._graphs if k[0] not in ptrs]:
            del self._graphs[key]

    # -- one forward -------------------------------------------------------------
    def forward(self, cache: KVCache, input_ids: torch.Tensor | None, *, positions: int | torch.Tensor,
                hidden: torch.Tensor | None, start: int, end: int | None, route: Route, taps: ForwardTaps,
                tree_mask: torch.Tensor | None, logits_rows: Any) -> tuple | None:
        """:meth:`Engine.forward`'s result through the fixed-shape path as (logits, hidden, hidden states by
        layer, attention cosines), or None where it does not apply (a route other than the target's own
        weights, head and whole context; see the module docstring)."""
        e = self.e
        if (hidden is not None or input_ids is None or start != 0 or (end is not None and end != e.num_layers)
                or not route.is_target):
            return self._fallback()
        t = int(input_ids.shape[0])
        skip_attn, output_hidden = route.skip_attn, taps.hidden_at
        run = [l for l in range(e.num_layers) if l not in skip_attn]
        n = self._dense_length(cache, run)
        # a chain from the first free slot, or a tree whose root takes it; else (holes, explicit positions) eager
        first = positions if isinstance(positions, int) else (int(positions[0]) if tree_mask is not None else None)
        if n is None or first != n or (tree_mask is None) != isinstance(positions, int):
            return self._fallback()
        cache.ensure_capacity(n + t + self.rows)  # the real rows' slots, below the padding rows' last R
        e.ensure_rope(n + t + self.rows)
        key_sets = (route.skip_attn, route.skip_mlp, frozenset(output_hidden), taps.attn_cosine, tree_mask is not None)
        logits, hiddens, at, cos_sum = [], [], {l: [] for l in output_hidden}, None
        want_all = logits_rows is not None and not (isinstance(logits_rows, slice) and logits_rows == slice(-1, None))
        for s in range(0, t, self.rows):
            m = min(self.rows, t - s)
            self.ids.zero_()
            self.ids[:m] = input_ids[s:s + m]
            if tree_mask is None:
                self.pos.copy_(self._ar + (n + s))
            else:
                self.pos.copy_(self._ar + (n + t))  # padding rows: positions past the tree's
                self.pos[:m] = positions[s:s + m]
                self._tree_chunk(cache.k.shape[2], n, s, m, tree_mask)
            self.slot0.fill_(n + s)
            self.count.fill_(m)
            lg, h, hat, cos = self._replay(cache, key_sets)
            last = s + m == t
            if logits_rows is not None and (want_all or last):
                logits.append(lg[:m].clone())
            hiddens.append(h[:m].clone())
            for l in output_hidden:
                at[l].append(hat[l][:m].clone())
            if cos is not None:
                part = cos[:, :m].sum(dim=1)
                cos_sum = part if cos_sum is None else cos_sum + part
        q_list = list(range(n, n + t)) if tree_mask is None else positions.tolist()
        for l in run:
            cache.appended(l, q_list)
        out_logits = None
        if logits_rows is not None and e.num_layers:
            full = torch.cat(logits) if len(logits) > 1 else logits[0]
            out_logits = full[-1:] if not want_all else full[logits_rows]
        return (out_logits, torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0],
                {l: torch.cat(v) if len(v) > 1 else v[0] for l, v in at.items()}, None if cos_sum is None else cos_sum / t)

    @staticmethod
    def _dense_length(cache: KVCache, run: list[int]) -> int | None:
        """The length every layer in ``run`` holds with slot == position (0..n-1), or None (not dense)."""
        n = cache.length(run[0]) if run else 0
        return None if any(cache.length(l) != n or cache.last_position(l) != n - 1 for l in run) else n

    def _tree_chunk(self, cap: int, n: int, s: int, m: int, tree_mask: torch.Tensor) -> None:
        """The mask of a tree's rows ``s..s+m-1``: the cached prefix (slots below ``n``) and their ancestors
        and themselves among the nodes (at slots ``n..``); padding rows see the prefix and their own slot."""
        allowed = self._tree_allowed.get(cap)
        if allowed is None:
            allowed = self._tree_allowed[cap] = torch.zeros(self.rows, cap, dtype=torch.bool, device=self.e.device)
        allowed.zero_()
        allowed[:, :n] = True
        allowed[:m, n:n + s + m] = tree_mask[s:s + m, :s + m]
        pad = self._ar[m:]
        allowed[pad, cap - self.rows + pad] = True

    def _fallback(self) -> None:
        self.eager_fallbacks += 1
        return None

    def _replay(self, cache: KVCache, key_sets: tuple) -> tuple:
        key = (cache.k.data_ptr(), cache.k.shape[2], self.e.rope_length, *key_sets)
        got = self._graphs.get(key)
        if got is not None:
            self._graphs.move_to_end(key)
            got.graph.replay()
            self.replays += 1
            return got.out
        if not self.capture:
            return self._run(cache, *key_sets)
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)  # the least recently replayed set
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(cache, *key_sets)  # warm-up: the same writes the replay makes, so it changes nothing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # each graph its own memory pool: a shared pool is freed once every graph that used it is dropped
        # (a new KV buffer drops its graphs), and capturing into it afterwards fails
        with torch.cuda.graph(graph):
            out = self._run(cache, *key_sets)
        self._graphs[key] = _Captured(graph, out)
        self.captures += 1
        graph.replay()
        self.replays += 1
        return out

    def _run(self, cache: KVCache, skip_attn: frozenset[int], skip_mlp: frozenset[int], output_hidden: frozenset[int],
             attn_cosine: bool, tree: bool) -> tuple:
        allowed = self._tree_allowed[cache.k.shape[2]] if tree else None
        return self.e.fixed_forward(cache, self.ids, self.pos, self.slot0, self.count, allowed,
                                    route=Route(skip_attn, skip_mlp),
                                    taps=ForwardTaps(tuple(sorted(output_hidden)), attn_cosine))

    def describe(self) -> dict[str, Any]:
        return {"rows": self.rows, "cuda_graphs": self.capture, "graphs": len(self._graphs), "captures": self.captures,
                "replays": self.replays, "eager_fallbacks": self.eager_fallbacks}
