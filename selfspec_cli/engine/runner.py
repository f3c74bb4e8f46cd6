"""Run a model's decoder layers directly, sublayer by sublayer.

Why not call the Hugging Face modules: at batch 1 a small model's decode step is
dominated by per-operation overhead, not arithmetic. This loop does about 15
tensor ops per layer (fused q/k/v and gate/up projections, one rotary pass for q
and k together, a preallocated cache, scaled-dot-product attention called
directly) where the Hugging Face stack does several times more.

One call of :meth:`Engine.forward` processes ``T`` new rows through a contiguous
range of layers ``[start, end)``. Each layer is engine/layer.py's :func:`~.layer.decoder_layer`, the
one definition of what a layer computes: this module supplies its steps (the loop's ``_LoopOps``, the
fixed-shape forward's ``_FixedOps``) and what surrounds the layers (embedding, masks, the cache's
positions, the head):

* inputs are token ids (embedded here) or residual-stream rows from a previous
  call that stopped at ``start`` (AdaDecode's deferred layers);
* what runs is a ``route`` (engine/route.py :class:`~.route.Route`, default :data:`~.route.TARGET`), what is
  reported beside the logits ``taps`` (:class:`~.route.ForwardTaps`): named, typed values, so a drafter's
  new need is a field there, not a keyword argument here; a layer index the model lacks is refused;
* the route's ``skip_attn``/``skip_mlp`` remove sublayers: a skipped sublayer adds nothing to
  the residual stream and a skipped attention writes no K/V;
* each layer ``l`` appends its K/V after its own newest slot and attends to
  everything cached before it plus the new rows, causally for a chain or through
  ``tree_mask`` for a token tree; the cache records each slot's position and
  refuses rows that do not come after the layer's newest position, and sliding
  windows are cut by stored positions (so layers with holes stay right);
* ``positions`` are the rotary positions of the new rows: an int ``p`` means the
  chain ``p, p+1, ...``; a tensor gives explicit ids (trees);
* the route's ``kv_window`` = (sinks, window): a draft's cheap view of a long context, as in
  StreamingLLM and MagicDec: each row attends to the first ``sinks`` keys it may see and
  the newest ``window`` (kernel attention only; None, the target's exact attention);
* the route's ``weights`` picks the matrices: None, the target's own (``target_precision``: the weights as
  loaded, fp32, bf16/fp16 panels, or the GGUF's own blocks; engine/target.py); a precision name
  (``int8``, ``int8-g32``, ``gguf``, ``w4a8``), the quantized draft copy :meth:`Engine.quantized`
  builds (engine/quant.py). Norms, embeddings and the cache are the target's either way;
* :meth:`Engine.release_float_weights` frees the float matrices a block target no longer
  reads (the embedding rows then come from the head's own blocks, exactly);
* on the CPU kernel a forward of up to ATTEND_MAX_ROWS (1024) rows runs its whole layer range in one C++ call
  (csrc ``DecoderStack``, :meth:`Engine._stacked_layers`): the same kernels in the same order as
  the loop's :func:`~.layer.decoder_layer`, so every value is the loop's bit for bit; Python keeps the masks
  and the cache's position lists (``stack_layers = False`` runs the loop; tests/test_decoder_stack.py and
  tests/test_one_layer.py compare them);
* on a GPU a forward first goes through the fixed-shape path (engine/graphs.py,
  :meth:`Engine.fixed_forward`: padded rows, the whole KV buffer, one CUDA graph per sublayer
  set); what it does not take runs the loop here;
* hidden states (residual stream after layer ``l``) are returned for the layers in the taps'
  ``hidden_at`` and logits only for the rows in ``logits_rows``, over the whole
  vocabulary or over the route's subset ``head`` (:meth:`Engine.subset_head`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Collection, Iterator
from functools import partial
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from . import arena, kernels
from .kernels import A8Linear
from .adapter import LINEARS, ModelAdapter, model_fingerprint
from .threads import governor_for_new_engine
from .cache import KVCache
from .layer import decoder_layer
from .sublayers import Sublayers, compile_requested, rotate
from .graphs import DEFAULT_ROWS, StaticForward
from .quant import DraftWeights, build_draft, gguf_source, subset
from .route import NO_TAPS, TARGET, ForwardTaps, Route
from .target import PANEL_DTYPES, QUANT_TARGETS, resolve_target, target_linears


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor | None  # (R, V) for the requested rows, float32
    hidden: torch.Tensor  # (T, H) residual stream after the last layer run (before the final norm)
    hidden_at: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (T, H)
    attn_cosine: torch.Tensor | None = None  # (layers run,) mean cos(h before, h after) per attention sublayer


ALL_ROWS = slice(None)
KERNEL_HEAD_SIZES = (16, 32, 64, 128, 256)  # what csrc's attend() and rope_() take
ATTEND_MAX_ROWS = 1024  # up to this many new rows attention runs in the kernel; longer prefills use SDPA
LAST_ROW = slice(-1, None)


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps large freed blocks otherwise); no-op elsewhere."""
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass(slots=True)
class _FileLinear:
    """``F.linear`` over a matrix dequantized from its GGUF blocks for this call alone (``plain_linear`` on a model
    read from its GGUF: the reference never holds the float model, 6 GB for a 1.5B one)."""

    values: Callable[[], torch.Tensor]
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.values().to(x.dtype), self.bias)


class Engine:
    """The shared execution engine. Batch size 1; rows are the sequence axis."""

    def __init__(self, model: torch.nn.Module, *, fast_kernels: bool = True, target_precision: str | None = None,
                 static_rows: int | None = None) -> None:
        self.model = model
        if getattr(model, "_selfspec_gguf", None) is not None:  # read from its GGUF blocks (lite.load_gguf_model)
            if target_precision is None:
                target_precision = "auto"  # the weights as loaded are the blocks
            elif target_precision not in ("auto", "gguf"):
                self._float_matrices()  # a float target is the float values, dequantized once
        self.adapter = a = ModelAdapter(model)
        self.governor = governor_for_new_engine()  # --threads auto (engine/threads.py), else None
        self.num_layers, self.dtype, self.device, self.vocab_size = a.num_layers, a.dtype, a.device, a.vocab_size
        self._hq, self._hkv, self._d = a.num_heads, a.num_kv_heads, a.head_dim
        self._qk_width = (self._hq + self._hkv) * self._d
        self._neg = torch.finfo(self.dtype).min
        self._unit_d = torch.ones(self._d, dtype=self.dtype, device=self.device)  # per-head norms' own weight
        self._gelu = a.activation == "gelu_tanh"
        self._windowed = any(w.sliding_window is not None for w in a.layers)  # Gemma 3's local layers: masks by layer
        self._grow_rope(max(256, min(a.max_positions, 4096)))
        # the matrix products, prepacked for the CPU kernel when it is available (kernels.py)
        t0 = time.perf_counter()
        reason = kernels.unavailable_reason(self.device) if fast_kernels else "fast_kernels=False"
        module = kernels.load_extension() if reason is None else None
        if reason is None and module is None:
            reason = kernels.status()["reason"]  # the build failed
        self._module, self._kernel_reason = module, reason
        self.drafts: dict[str, DraftWeights] = {}  # precision -> the quantized draft copy (draft())
        self._subset_heads: dict[tuple[str | None, bytes], Any] = {}  # (weights, ids' digest) -> subset_head()'s head
        # embedding rows from blocks: a model read from its GGUF (lite.load_gguf_model), or release_float_weights()
        self._embed_rows: Any = getattr(model, "_selfspec_embed_rows", None)
        self._float_released = False
        # the target's weights (engine/target.py): the model's own tensors, bf16 panels, or the GGUF's blocks
        self.target_precision, self.target_info = resolve_target(self, target_precision)
        if self.target_precision not in QUANT_TARGETS:  # a model read from its GGUF then runs its float values
            self._float_matrices()
        if self.target_precision in QUANT_TARGETS:
            self._lin, self.lm_head = target_linears(self, self.target_precision)  # no float panels are packed
        else:
            self._lin, self.lm_head = self._linears(module, PANEL_DTYPES.get(self.target_precision))
        self._to_huge_pages(self._lin, self.lm_head)  # the streamed panels on 2 MB pages (engine/arena.py)
        huge = arena.placed_bytes([lin for layer in self._lin for lin in layer.values()] + [self.lm_head])
        self._norm_kernel = module.rms_norm if module is not None and self.dtype == torch.float32 else None
        # float32 rotary, attention over a few rows and SwiGLU's product in one call each (csrc)
        self._ops = module if module is not None and self.dtype == torch.float32 and self._d in KERNEL_HEAD_SIZES else None
        # a forward's layers in one kernel call (csrc: DecoderStack; _stacked_layers)
        self.stack_layers = True  # False: every forward op by op (tests compare the two)
        self.stacked_forwards = 0  # forwards whose layers ran in one kernel call
        self._stacks: dict[int, tuple[Any, Any]] = {}  # id(layers' products) -> (those products, their DecoderStack)
        self.kernel_info = {"backend": "torch" if module is None else "small_gemm", "reason": reason,
                            "load_s": kernels.status()["load_s"] if module is not None else None,
                            "pack_s": round(time.perf_counter() - t0, 3), "huge_page_region_mb": round(huge / 1e6, 1),
                            # every op row-wise: a k-row forward equals k one-row steps bit for bit
                            "batch_invariant": self._ops is not None, "target": self.target_precision}
        # on a GPU, fixed-shape forwards replayed as CUDA graphs (engine/graphs.py; ``static_rows`` 0: off)
        if static_rows is None:
            static_rows = DEFAULT_ROWS if self.device.type == "cuda" and os.environ.get("SELFSPEC_CUDA_GRAPHS") != "0" else 0
        if static_rows and (module is not None or self.target_precision in QUANT_TARGETS):
            raise ValueError("fixed-shape forwards run the model's own float matrices: pass fast_kernels=False on a CPU")
        self.static = StaticForward(self, static_rows) if static_rows else None
        # the fixed-shape forward's sublayers, compiled under SELFSPEC_COMPILE=1 (engine/sublayers.py)
        self.sublayers = Sublayers.make(self.static is not None and compile_requested())
        if self.static is not None:
            self.kernel_info.update(backend="cuda_graphs" if self.static.capture else "static_rows", batch_invariant=True,
                                    compiled=self.sublayers.compiled)
        self.kernel_info["exact_trees"] = self.exact_trees

    @property
    def exact_trees(self) -> bool:
        """Whether a token tree's verified rows equal the one-row steps of their paths bit for bit. Only the
        CPU kernel's attention gives that: it sums over the keys a row may see, in slot order, so a node
        whose ancestors sit at other slots than a chain's still adds the same values in the same order.
        Matrix-product attention (SDPA; the fixed-shape forwards of a GPU) sums over every slot, masked
        ones as zeros, and the grouping of that sum follows the slots: a tree's rows then differ from the
        chain's in the last bits, so drafts are verified as chains there (decoding/stack.py)."""
        return self._ops is not None and self.static is None

    def _float_matrices(self) -> None:
        """Dequantize a model read from its GGUF blocks into float matrices (the very values a converted model
        holds), for a float target. (An int8 draft and ``plain_linear`` read one matrix at a time instead:
        ModelAdapter.float_values.)"""
        if any(p.is_meta for p in self.model.parameters()):
            self.model._selfspec_materialize()
            if hasattr(self, "adapter"):
                self.adapter = ModelAdapter(self.model)

    def quantized(self, precision: str) -> DraftWeights:
        """The quantized copy of the matrices at ``precision`` (engine/quant.py) that drafts read,
        built on first use (or read from the disk cache) and kept; ``forward(..., route=Route(weights=precision))``
        runs on it."""
        if precision == "w4a8" and precision not in self.drafts:  # the gguf copy's own codes, int8 activations
            base = self.quantized("gguf")
            def a8(q: Any) -> Any:
                return kernels.PartsLinear([A8Linear(p) for p in q.parts]) if isinstance(q, kernels.PartsLinear) else A8Linear(q)

            self.drafts[precision] = DraftWeights(precision, [{n: a8(q) for n, q in d.items()} for d in base.layers],
                                                  A8Linear(base.head), {**base.info, "precision": precision, "shares": "gguf"})
        if precision not in self.drafts:
            if self._float_released and precision not in QUANT_TARGETS:
                raise RuntimeError(f"the {precision} draft copy is built from the float matrices, which "
                                   "release_float_weights() freed: build every draft before releasing")
            where = getattr(self.model, "name_or_path", "") or ""
            # the GGUF's blocks are the target's weights only for the fp32 conversion (bf16 rounds them)
            gguf_file = (gguf_source(where) or {}).get("gguf_file") if self.dtype == torch.float32 else None
            self.drafts[precision] = d = build_draft(self.adapter, precision, model_fingerprint(self.model), gguf_file,
                                                     self._module, where or None)
            self._to_huge_pages(d.layers, d.head)
        return self.drafts[precision]

    def _to_huge_pages(self, layers: list[dict[str, Any]], head: Any) -> int:
        """Move the panels a step streams, in the forward's order, onto 2 MB pages (engine/arena.py: the same
        bytes, so the same results); the bytes moved. Only for the CPU kernel's panels."""
        if self._module is None or self.device.type != "cpu":
            return 0
        return arena.place([lin for layer in layers for lin in layer.values()] + [head])

    # -- setup -------------------------------------------------------------
    def _linears(self, module: Any | None, pack_dtype: torch.dtype | None = None
                 ) -> tuple[list[dict[str, kernels.Linear]], kernels.Linear]:
        """Every layer's matrix products (by :data:`LINEARS` name) and the LM head, prepacked
        for ``module`` (None: plain ``F.linear``), as ``pack_dtype`` panels (None: the weights' dtype)."""
        a, make = self.adapter, kernels.Linear.make
        return ([{k: make(getattr(w, f"w_{k}"), getattr(w, f"b_{k}"), module, pack_dtype) for k in LINEARS}
                 for w in a.layers], make(a.lm_head, None, module, pack_dtype))

    def _grow_rope(self, length: int) -> None:
        half = self._d // 2
        self._rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> cos, sin_signed (length, D)
        for kind in self.adapter.rope_kinds:  # one table, or one per layer type (Gemma 3)
            cos, sin = self.adapter.rope_table(length, kind)  # (length, D): rows 0..length-1
            # rotate_half(x) * sin == flip_halves(x) * sin_signed, with sin_signed = [-sin1, sin2]
            self._rope[kind] = cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self._rope_length = length

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim: the kernel's one-call version for float32 rows, else
        ``F.rms_norm``."""
        if self._norm_kernel is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self._norm_kernel(x, w, self.adapter.rms_eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.adapter.rms_eps)

    @contextlib.contextmanager
    def plain_linear(self) -> Iterator[None]:
        """Run every matrix product with ``F.linear`` inside the block (to compare logits)."""
        if self._float_released:
            raise RuntimeError("plain_linear() needs the float matrices, which release_float_weights() freed")
        saved = self._lin, self.lm_head, self._norm_kernel, self._ops
        if any(p.is_meta for p in self.model.parameters()):  # matrices still in the GGUF: one at a time, per call
            a = self.adapter
            self._lin = [{k: _FileLinear(partial(a.float_values, l, k), getattr(w, f"b_{k}")) for k in LINEARS}
                         for l, w in enumerate(a.layers)]
            self.lm_head = _FileLinear(partial(a.float_values, None, "head"), None)
        else:
            self._lin, self.lm_head = self._linears(None)
        self._norm_kernel = self._ops = None
        try:
            yield
        finally:
            self._lin, self.lm_head, self._norm_kernel, self._ops = saved

    def new_cache(self, capacity: int) -> KVCache:
        if self.static is None:
            return KVCache(self.num_layers, self._hkv, self._d, capacity, self.dtype, self.device)
        buffers = self.static.buffers(capacity, (self.num_layers, self._hkv, self._d), self.dtype)
        cache = KVCache(self.num_layers, self._hkv, self._d, capacity, self.dtype, self.device, buffers=buffers)
        self.static.hold(cache)
        return cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed_rows is not None:  # the float table was released: rows from the head's own blocks
            rows = self._embed_rows(input_ids)
        else:
            rows = F.embedding(input_ids, self.adapter.embed)
        scale = self.adapter.embed_scale  # Gemma: sqrt(hidden), as transformers multiplies it
        return rows if scale is None else rows * scale

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's float rows for the tokens ``ids`` (R, H); after :meth:`release_float_weights` freed
        a tied table, dequantized from the head's own blocks (the very values, as :meth:`embed` reads them)."""
        table = self.adapter.lm_head
        if (table.numel() == 0 or table.is_meta) and isinstance(self.lm_head, kernels.QLinear):  # freed, or never
            return self.lm_head.rows(ids)  # read (a GGUF model read straight from its blocks)
        return table[ids]

    def release_float_weights(self, panels: bool = False) -> int:
        """Free the model's float matrices when the target reads a quantized copy (a block target), and a
        tied embedding too, whose rows are then dequantized from the head's own blocks (the very values:
        checked on a sample first). Returns the bytes freed (0 for other targets). Afterwards the Hugging
        Face module cannot run, and no int8 copy can be built: callers release only once every method
        and draft they need is built (``selfspec generate`` does; docs/engine.md, "Memory").

        ``panels``: on a target that streams packed float panels (fp32, bf16, fp16 with the CPU kernel),
        free the layers' float matrices too, the panels being the target's weights (the embedding and
        LM head stay). For a process that runs plain decoding only (the bench's ``ar-fp32`` process): a
        draft built from the float matrices afterwards is refused."""
        self._stacks.clear()  # they hold the norms, which move below: rebuilt on the next forward
        if not self._may_release(panels):
            return 0
        self._float_released = True
        model_fingerprint(self.model)  # the model's id, kept on it before its weights go (artifacts check it)
        a, head = self.adapter, self.lm_head
        tied = a.lm_head.untyped_storage().data_ptr() == a.embed.untyped_storage().data_ptr() and not a.embed.is_meta
        gone = [t for t in self._releasable(tied) if not t.is_meta]  # a model read from its GGUF holds those in the file
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in gone}  # a tied table counts once
        freed = sum(st.nbytes() for st in storages.values())
        self._drop_references(storages.keys(), tied)
        self._own_memory(head)
        _trim_heap()
        self.kernel_info["float_weights_released_mb"] = round(freed / 2**20, 1)
        return freed

    def _may_release(self, panels: bool) -> bool:
        """Whether :meth:`release_float_weights` frees anything: a block target, or with ``panels`` a target whose
        every product streams packed float panels."""
        if panels and self.target_precision not in QUANT_TARGETS:
            lins = [self._lin[l][name] for l in range(self.num_layers) for name in LINEARS]
            return bool(lins) and all(isinstance(x, kernels.Linear) and x.packed is not None for x in lins)
        return self.target_precision in QUANT_TARGETS

    def _releasable(self, tied: bool) -> list[torch.Tensor]:
        """The float tensors no product reads once released: a tied embedding whose rows the head's blocks give
        exactly (checked on a sample; from then on :meth:`embed` reads the blocks), the matrices the target runs
        as its own blocks or packed panels (a GGUF type the kernel does not take, or a panel target's with
        ``panels``), and an untied block head."""
        a, head, gone = self.adapter, self.lm_head, []
        if tied and isinstance(head, kernels.QLinear) and self._embed_rows is None:
            probe = torch.arange(0, a.embed.shape[0], max(1, a.embed.shape[0] // 257), device=self.device)
            if torch.equal(head.rows(probe), F.embedding(probe, a.embed)):
                self._embed_rows = head.rows
                gone.append(a.embed)
        gone += [t for l, w in enumerate(a.layers) for name in LINEARS if self._own_weights(self._lin[l][name])
                 for t in w.held(name)]  # an unfused q/k/v: its parts (fusing them only to free them would cost)
        if not tied and isinstance(head, kernels.QLinear):
            gone.append(a.lm_head)
        return gone

    def _drop_references(self, ptrs: Collection[int], tied: bool) -> None:
        """Drop every reference to the storages ``ptrs``: the module's parameters (views into the fused
        matrices, or the loaded tensors, which safetensors may have memory-mapped) and the adapter's own."""
        a, head = self.adapter, self.lm_head
        for p in self.model.parameters():
            if p.untyped_storage().data_ptr() in ptrs:
                p.data = p.data.new_empty(0)
        for l, w in enumerate(a.layers):
            for name in LINEARS:
                if self._own_weights(lin := self._lin[l][name]):
                    setattr(w, f"w_{name}", w.held(name)[0].new_empty(0))
                    if isinstance(lin, kernels.Linear):
                        lin.weight = lin.weight.new_empty(0)
        if self._embed_rows is not None and not a.embed.is_meta:
            a.embed = a.embed.new_empty(0)
            if tied:
                a.lm_head = a.embed
        if not tied and isinstance(head, kernels.QLinear):
            a.lm_head = a.lm_head.new_empty(0)

    def _own_memory(self, head: Any) -> None:
        """The tensors that remain (norms, biases) may share one memory-mapped file with the released ones,
        which stays mapped (and resident) while any of them lives: give them memory of their own. Keyed by
        address: every replaced tensor is kept alive until all references are moved, so that no clone takes a
        freed tensor's address meanwhile (one did: a layer's MLP norm then read another's)."""
        a = self.adapter
        moved: dict[int, torch.Tensor] = {}
        replaced: list[torch.Tensor] = []
        for p in self.model.parameters():
            if p.numel() and not p.is_meta:
                replaced.append(p.data)
                moved[p.data_ptr()] = p.data = p.data.clone()
        for w in a.layers:
            for f in dataclasses.fields(w):
                t = getattr(w, f.name)
                if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() in moved:
                    setattr(w, f.name, moved[t.data_ptr()])
        for name in ("final_norm", "embed", "lm_head"):  # the adapter's own references, then a panel head's
            if (t := getattr(a, name)).numel() and t.data_ptr() in moved:
                setattr(a, name, moved[t.data_ptr()])
        if isinstance(head, kernels.Linear) and head.weight.numel() and head.weight.data_ptr() in moved:
            head.weight = moved[head.weight.data_ptr()]
        del replaced

    @staticmethod
    def _own_weights(lin: Any) -> bool:
        """Whether a matrix product reads weights of its own (blocks, or packed panels), not the float tensor."""
        return (isinstance(lin, (kernels.QLinear, kernels.PartsLinear))
                or (isinstance(lin, kernels.Linear) and lin.packed is not None))

    def final_logits(self, hidden: torch.Tensor, head: Any = None, weights: str | None = None) -> torch.Tensor:
        """Final norm + LM head on residual-stream rows (R, H) -> float32 logits (R, V), or
        (R, N) through ``head`` (a :meth:`subset_head`); ``weights``: the draft copy's head."""
        if head is None:
            head = self.lm_head if weights is None else self.drafts[weights].head
        return head(self._norm(hidden, self.adapter.final_norm)).float()

    def subset_head(self, ids: torch.Tensor, weights: str | None = None, *, share: bool = True) -> Any:
        """The LM head's rows for the tokens ``ids`` only (prepacked once per engine, weights and ids: every
        drafter of a method, and every method of a bench, that drafts over the same vocabulary shares one
        copy, read-only): logits column ``i`` is token ``ids[i]``'s logit, bit-identical to the full head's
        (same kernel, same per-output order). FR-Spec's draft vocabulary (methods/fr_spec/); with ``weights``,
        the rows of that draft copy's quantized head. ``share=False``: a copy of its own, not kept (a calibration
        that times many sizes once each)."""
        if weights is None and self.target_precision in QUANT_TARGETS:
            weights = self.target_precision  # the target's head is that copy's
        ids = ids.to(torch.int64)
        key = (weights, hashlib.blake2b(ids.cpu().numpy().tobytes(), digest_size=16).digest())  # the ids, in order
        if share and key in self._subset_heads:
            return self._subset_heads[key]
        if weights is not None:
            head = subset(self.quantized(weights).head, ids, self._module)
        else:
            head = kernels.Linear.make(self.adapter.lm_head[ids.to(self.device)].contiguous(), None, self._module,
                                       PANEL_DTYPES.get(self.target_precision))
        if share:
            self._subset_heads[key] = head
        return head

    @property
    def rope_length(self) -> int:
        """Positions the rotary tables cover."""
        return self._rope_length

    def ensure_rope(self, length: int) -> None:
        """Grow the rotary tables (by doubling) to cover ``length`` positions."""
        if length > self._rope_length:
            self._grow_rope(max(2 * self._rope_length, length))

    @torch.inference_mode()
    def run_products(self, rows: int = 1, weights: str | None = None) -> None:
        """Every matrix product of one forward of ``rows`` rows and the LM head (with the final norm), on
        fixed random inputs, and nothing else: what the products alone cost (``selfspec profile`` reports
        the rest of a step beside it)."""
        lins = self._lin if weights is None else self.quantized(weights).layers
        hidden, inter = self.adapter.hidden_size, self.model.config.intermediate_size
        g = torch.Generator().manual_seed(0)
        xs = {name: torch.randn(rows, width, generator=g).to(self.dtype)
              for name, width in (("qkv", hidden), ("o", self._hq * self._d), ("gate_up", hidden), ("down", inter))}
        for lin in lins:
            for name, x in xs.items():
                lin[name](x)
        self.final_logits(xs["qkv"], weights=weights)

    # -- one call for a forward's layers -------------------------------------
    def _stack(self, lins: list[dict[str, Any]]) -> Any | None:
        """The kernel's DecoderStack over these layers' products (built once per set and kept), or None
        where a product is not one the kernel runs (then the forward runs op by op)."""
        if (got := self._stacks.get(id(lins))) is not None and got[0] is lins:
            return got[1]
        ops = self._ops

        def mat(lin: Any) -> Any | None:
            if isinstance(lin, kernels.PartsLinear):
                parts = [mat(p) for p in lin.parts]
                return None if any(p is None for p in parts) else ops.mat_parts(parts)
            if isinstance(lin, A8Linear) and lin.base.meta.bits == 4 and lin.base.module is not None:
                b = lin.base
                return ops.mat(2, b.codes, b.scales, b.mins, b.bias, b.out_features, b.meta.group, 4, b.isa)
            lin = lin.base if isinstance(lin, A8Linear) else lin
            if isinstance(lin, kernels.QLinear) and lin.module is not None:
                return ops.mat(1, lin.codes, lin.scales, lin.mins, lin.bias, lin.out_features, lin.meta.group,
                               lin.meta.bits, lin.isa)
            if isinstance(lin, kernels.Linear) and lin.packed is not None:
                return ops.mat(0, lin.packed, None, None, lin.bias_f32, lin.n, 0, 0, lin.isa)
            return None

        stack = ops.DecoderStack(self._hq, self._hkv, self._d, float(self.adapter.rms_eps), self._gelu)
        kinds = self.adapter.rope_kinds
        for w, lin in zip(self.adapter.layers, lins):
            mats = [mat(lin[name]) for name in ("qkv", "o", "gate_up", "down")]
            if any(m is None for m in mats):
                return None
            stack.add(w.attn_norm, w.mlp_norm, w.qk_norm, w.post_attn_norm, w.post_mlp_norm, kinds.index(w.rope_kind),
                      *mats)
        self._stacks[id(lins)] = (lins, stack)
        return stack

    def _stacked_layers(self, stack: Any, cache: KVCache, h: torch.Tensor, layers: range, q_pos: torch.Tensor | None,
                        q_list: list[int], rope_rows: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
                        skip_attn: Collection[int], skip_mlp: Collection[int], tree_mask: torch.Tensor | None,
                        output_hidden: Collection[int], kv_window: tuple[int, int] | None
                        ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`_forward`'s layers in one kernel call (csrc: DecoderStack), with the loop's masks
        (:meth:`_layer_mask`), cache order checks (every layer's, before anything is written) and
        position lists."""
        t = h.shape[0]
        pasts: list[int] = []
        mask_of: list[int] = []
        masks: dict[tuple[int, int, int | None, int], torch.Tensor | None] = {}
        handed: list[torch.Tensor] = []  # the distinct masks, (T, past + T) each, as the kernel takes them
        index: dict[int, int] = {}  # id of a mask -> its place in ``handed``
        held, q0 = cache.positions[layers.start:layers.stop], q_list[0]
        # the common step: every layer holds positions 0..q0-1 (a strictly increasing list of q0 ending at q0 - 1)
        # and the rows continue them: what the loop below finds layer by layer (slot q0, no mask: causal), at once
        common = (q_pos is None and tree_mask is None and not skip_attn and not self._windowed
                  and q0 + t <= cache.capacity and all(len(p) == q0 and (not p or p[-1] == q0 - 1) for p in held))
        if common:
            pasts, mask_of = [q0] * len(held), [-1] * len(held)
        else:
            for l in layers:
                if l in skip_attn:
                    pasts.append(-1)
                    mask_of.append(-1)
                    continue
                pasts.append(cache.append_slot(l, q_list))  # raises, before anything is written, on a bad order
                mask = self._layer_mask(cache, l, self.adapter.layers[l].sliding_window, t, q_pos, q_list, tree_mask,
                                        masks, kernel=True)
                if mask is not None and id(mask) not in index:
                    index[id(mask)] = len(handed)
                    handed.append(mask[0, 0])
                mask_of.append(-1 if mask is None else index[id(mask)])
        keep = [int(l in output_hidden) for l in layers]
        kinds = self.adapter.rope_kinds
        out = stack.forward(h, cache.k, cache.v, layers.start, pasts, [int(l not in skip_mlp) for l in layers], keep,
                            handed, mask_of,
                            [rope_rows[k][0] for k in kinds], [rope_rows[k][1] for k in kinds], *(kv_window or (0, 0)))
        if common:
            for p in held:  # the cache's own lists
                p.extend(q_list)
        else:
            for l, past in zip(layers, pasts):
                if past >= 0:
                    cache.appended(l, q_list)
        kept = iter(out[1:])
        return out[0], {l: next(kept) for l, k in zip(layers, keep) if k}

    def _layer_mask(self, cache: KVCache, l: int, window: int | None, t: int, q_pos: torch.Tensor | None,
                    q_list: list[int], tree_mask: torch.Tensor | None,
                    masks: dict[tuple[int, int, int | None, int], torch.Tensor | None],
                    kernel: bool = False) -> torch.Tensor | None:
        """Layer ``l``'s additive mask for ``t`` new rows over its cached slots (read before this forward
        writes them), or None where attention over everything cached, causally for the new rows, is
        right. Layers with equal keys hold equal positions and share one mask (``masks``); a windowed
        layer with holes gets its own. ``kernel``: the CPU kernel's attention reads None as "row ``i`` sees
        the cached slots and the new rows up to its own" (SDPA's causal flag would align the rows to the
        first key instead), so a chain of rows right after a cache without holes needs no mask: a k-row
        verification builds none (and runs no aten op that would wake torch's own threads)."""
        past = cache.length(l)
        if q_pos is None and tree_mask is None and (window is None or t <= window) and (
                past == 0 or (kernel and cache.last_position(l) == past - 1 == q_list[0] - 1
                              and (window is None or q_list[-1] < window))):
            return None
        key = (past, cache.last_position(l), window, l if window is not None and cache.has_holes(l) else -1)
        if key not in masks:
            qp = q_pos if q_pos is not None else torch.arange(q_list[0], q_list[0] + t, device=self.device)
            masks[key] = self._mask(cache.positions[l][:past], qp, max(q_list), t, tree_mask, window)
        return masks[key]

    # -- masks -------------------------------------------------------------
    def _mask(self, k_positions: list[int], q_pos: torch.Tensor, q_max: int, t: int, tree_mask: torch.Tensor | None,
              window: int | None) -> torch.Tensor | None:
        """Additive mask (1, 1, T, past + T), or None when plain attention over
        everything cached is right (single row, no window cut). ``k_positions``: the
        stored positions of the layer's cached slots (they may have holes, so whether the
        window cuts is decided by positions, never by the number of slots)."""
        past = len(k_positions)
        total = past + t
        oldest = k_positions[0] if k_positions else int(q_pos.min())
        cut = window is not None and q_max - oldest >= window
        if tree_mask is None and not cut and t == 1:
            return None
        allowed = torch.ones(t, total, dtype=torch.bool, device=self.device)
        allowed[:, past:] = torch.ones(t, t, dtype=torch.bool, device=self.device).tril() if tree_mask is None else tree_mask
        if cut:
            k_pos = torch.cat([torch.tensor(k_positions, dtype=torch.long, device=self.device), q_pos])
            allowed &= (q_pos[:, None] - k_pos[None, :]) < window
        return torch.zeros(t, total, dtype=self.dtype, device=self.device).masked_fill_(~allowed, self._neg)[None, None]

    # -- forward -----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, cache: KVCache, input_ids: torch.Tensor | None = None, *, positions: int | torch.Tensor,
                hidden: torch.Tensor | None = None, start: int = 0, end: int | None = None, route: Route = TARGET,
                taps: ForwardTaps = NO_TAPS, tree_mask: torch.Tensor | None = None,
                logits_rows: slice | torch.Tensor | None = LAST_ROW) -> ForwardOutput:
        """One forward of ``T`` new rows (token ids ``input_ids``, or residual-stream rows ``hidden``) at
        ``positions`` through layers ``[start, end)``: the computation ``route`` names (engine/route.py;
        :data:`~.route.TARGET`, the target's own), reporting what ``taps`` asks beside the logits of
        ``logits_rows`` (see the module docstring). On a GPU through the fixed-shape CUDA graphs where they
        apply (engine/graphs.py); under ``--threads auto`` timed for the thread governor (engine/threads.py),
        which may change the thread count between forwards. A route or taps naming a layer the model does
        not have is refused (ValueError)."""
        if route.deepest >= self.num_layers or taps.deepest >= self.num_layers:
            self._refuse_layers(route, taps)
        if self.static is not None and (out := self.static.forward(
                cache, input_ids, positions=positions, hidden=hidden, start=start, end=end, route=route, taps=taps,
                tree_mask=tree_mask, logits_rows=logits_rows)) is not None:
            logits, hidden_out, hidden_at, cosines = out
            return ForwardOutput(logits=logits, hidden=hidden_out, hidden_at=hidden_at, attn_cosine=cosines)
        if self.governor is None:
            return self._forward(cache, input_ids, positions, hidden, start, end, route, taps, tree_mask, logits_rows)
        t0 = time.perf_counter()
        out = self._forward(cache, input_ids, positions, hidden, start, end, route, taps, tree_mask, logits_rows)
        rows = input_ids.shape[0] if input_ids is not None else hidden.shape[0]
        self.governor.observe(rows, time.perf_counter() - t0)
        return out

    def _refuse_layers(self, route: Route, taps: ForwardTaps) -> None:
        named = {"skip_attn": sorted(route.skip_attn), "skip_mlp": sorted(route.skip_mlp),
                 "hidden_at": list(taps.hidden_at)}
        bad = "; ".join(f"{k} {[l for l in v if l >= self.num_layers]}" for k, v in named.items()
                        if any(l >= self.num_layers for l in v))
        raise ValueError(f"a forward names layers this model does not have ({bad}); it has {self.num_layers} "
                         f"layers, 0..{self.num_layers - 1}")

    def fixed_forward(self, cache: KVCache, ids: torch.Tensor, pos: torch.Tensor, slot0: torch.Tensor,
                      count: torch.Tensor, allowed: torch.Tensor | None = None, *, route: Route = TARGET,
                      taps: ForwardTaps = NO_TAPS) -> tuple:
        """The fixed-shape forward of ``R = len(ids)`` rows at every layer (engine/graphs.py, whose CUDA
        graphs capture it): row ``i`` holds token ``ids[i]`` at rotary position ``pos[i]`` and writes its K/V
        at slot ``slot0 + i``. It attends causally (the slots before its own, its own included), or to
        the slots ``allowed[i]`` (R, capacity) marks (a token tree's rows). Rows from ``count`` on are
        padding: they write their K/V in the buffer's last ``R`` slots, which hold nothing (the caller
        keeps every real slot below them). Every op has the same shape whatever the real rows are; the
        cache's position lists are the caller's. Returns (logits (R, V) float32, residual stream (R, H),
        hidden states by layer, per-row attention cosines (L, R) or None). ``route`` gives the skip sets only
        (the graphs' caller takes no other route), ``taps`` what is reported."""
        assert route.is_target, "the fixed-shape forward runs the target's own weights, head and whole context"
        skip_attn, skip_mlp, output_hidden = route.skip_attn, route.skip_mlp, taps.hidden_at
        a, r = self.adapter, ids.shape[0]
        cap = cache.k.shape[2]
        ar = torch.arange(r, device=self.device)
        slots = torch.where(ar < count, slot0 + ar, ar + (cap - r))  # (R,) where the rows' K/V go
        slot_ids = torch.arange(cap, device=self.device)
        if allowed is None:  # a chain: the cached prefix, then the new rows causally (padding rows: theirs too)
            allowed = (slot_ids[None, :] < slot0).expand(r, cap).clone()
            allowed.scatter_(1, slots[None, :].expand(r, r), ar[:, None] >= ar[None, :])
        steps = _FixedOps(self, cache, pos, slots, slot_ids, allowed, taps.attn_cosine)
        h = self.embed(ids)  # (R, H)
        hidden_at: dict[int, torch.Tensor] = {}
        for l in range(self.num_layers):
            h = decoder_layer(h, l, a.layers[l], steps, attention=l not in skip_attn, mlp=l not in skip_mlp)
            if l in output_hidden:
                hidden_at[l] = h.clone()
        cosines = steps.cosines
        return (self.sublayers.logits(h, a.final_norm, a.rms_eps, self.lm_head.weight), h, hidden_at,
                torch.stack(cosines) if cosines else None)

    def _forward(self, cache: KVCache, input_ids: torch.Tensor | None, positions: int | torch.Tensor,
                 hidden: torch.Tensor | None, start: int, end: int | None, route: Route, taps: ForwardTaps,
                 tree_mask: torch.Tensor | None, logits_rows: slice | torch.Tensor | None) -> ForwardOutput:
        """:meth:`forward` through the op-by-op loop, or the one-call C++ forward (:meth:`_stacked_layers`)."""
        skip_attn, skip_mlp, weights, kv_window = route.skip_attn, route.skip_mlp, route.weights, route.kv_window
        output_hidden, attn_cosine = taps.hidden_at, taps.attn_cosine
        end = self.num_layers if end is None else end
        assert 0 <= start <= end <= self.num_layers, (start, end)
        assert hidden is not None or (input_ids is not None and input_ids.dim() == 1), "input_ids must be 1-D (T,)"
        h = self.embed(input_ids) if hidden is None else hidden  # (T, H)
        t = h.shape[0]

        # rotary rows for the new tokens
        if isinstance(positions, int):
            q_pos, rows, q_list = None, slice(positions, positions + t), list(range(positions, positions + t))
        else:
            q_pos, rows, q_list = positions, positions, positions.tolist()
        if max(q_list, default=-1) >= self._rope_length:
            self._grow_rope(max(2 * self._rope_length, max(q_list) + 1))
        ops = self._ops if h.dtype == torch.float32 else None
        few_rows = ops is not None and t <= ATTEND_MAX_ROWS  # the kernel's attention; SDPA for long prefills
        rope_rows = {kind: (c[rows], s[rows]) for kind, (c, s) in self._rope.items()}  # kind -> (T, D) each

        hidden_at: dict[int, torch.Tensor] = {}
        cache.ensure_capacity(max(map(len, cache.positions[start:end]), default=0) + t)
        cosines: list[torch.Tensor] = []
        lins = self._lin if weights is None else self.quantized(weights).layers

        layers = range(start, end)
        if few_rows and self.stack_layers and not attn_cosine and (stack := self._stack(lins)) is not None:
            h, hidden_at = self._stacked_layers(stack, cache, h, layers, q_pos, q_list, rope_rows, skip_attn, skip_mlp,
                                                tree_mask, output_hidden, kv_window)
            self.stacked_forwards += 1
            layers = range(end, end)  # done

        if len(layers):
            steps = _LoopOps(self, lins, ops, cache, rope_rows, q_pos, q_list, tree_mask, few_rows, kv_window, attn_cosine)
            for l in layers:
                h = decoder_layer(h, l, self.adapter.layers[l], steps, attention=l not in skip_attn,
                                  mlp=l not in skip_mlp)
                if l in output_hidden:
                    hidden_at[l] = h
            cosines = steps.cosines

        logits = (self.final_logits(h[logits_rows], route.head, weights)
                  if logits_rows is not None and end == self.num_layers else None)
        return ForwardOutput(logits=logits, hidden=h, hidden_at=hidden_at,
                             attn_cosine=torch.stack(cosines) if cosines else None)


class _LoopOps:
    """The op-by-op forward's steps of a layer (engine/layer.py ``LayerOps``), for one call of
    :meth:`Engine._forward`: the CPU kernel's norms, rotary, attention and SwiGLU product on float32 rows
    (``ops``), aten's otherwise; the products are ``lins``' (the target's, or a draft copy's)."""

    __slots__ = ("e", "lins", "ops", "cache", "rope_rows", "q_pos", "q_list", "tree_mask", "few_rows", "kv_window",
                 "attn_cosine", "masks", "cosines")

    def __init__(self, e: Engine, lins: list[dict[str, Any]], ops: Any, cache: KVCache,
                 rope_rows: dict[str | None, tuple[torch.Tensor, torch.Tensor]], q_pos: torch.Tensor | None,
                 q_list: list[int], tree_mask: torch.Tensor | None, few_rows: bool, kv_window: tuple[int, int] | None,
                 attn_cosine: bool) -> None:
        self.e, self.lins, self.ops, self.cache, self.rope_rows = e, lins, ops, cache, rope_rows
        self.q_pos, self.q_list, self.tree_mask, self.few_rows, self.kv_window = q_pos, q_list, tree_mask, few_rows, kv_window
        self.attn_cosine = attn_cosine
        self.masks: dict[tuple[int, int, int | None, int], torch.Tensor | None] = {}  # shared by equal layers
        self.cosines: list[torch.Tensor] = []

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.e._norm(x, weight)

    def linear(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.lins[layer][name](x)

    def heads(self, w: Any, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_rows: each row's rotated q heads then k heads, (T, >= (Hq + Hkv) D), as the kernel's attention
        reads them; the same as (T, Hq + Hkv, D); the v heads (T, Hkv, D))."""
        e, t = self.e, qkv.shape[0]
        hq, hkv, d, qkw = e._hq, e._hkv, e._d, e._qk_width
        v = qkv[:, qkw:].view(t, hkv, d)
        q_rows = qkv
        if w.qk_norm is not None:  # Qwen3, Gemma 3: each q and k head RMS-normed before the rotary
            heads = hq + hkv
            normed = e._norm(qkv[:, :qkw].reshape(t * heads, d), e._unit_d)
            q_rows = (normed.view(t, heads, d) * w.qk_norm).view(t, qkw)
        cos2, sin2 = self.rope_rows[w.rope_kind]  # (T, D)
        if self.ops is not None:
            self.ops.rope_(q_rows, hq + hkv, cos2, sin2)  # in place: q and k of every row
        qk = q_rows[:, :qkw].view(t, hq + hkv, d)
        if self.ops is None:
            qk = rotate(qk, cos2, sin2)
        return q_rows, qk, v

    def attend(self, layer: int, w: Any, heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        e, cache = self.e, self.cache
        q_rows, qk, v = heads
        t, hq = qk.shape[0], e._hq
        past = cache.length(layer)
        mask = e._layer_mask(cache, layer, w.sliding_window, t, self.q_pos, self.q_list, self.tree_mask,
                             self.masks, kernel=self.few_rows)  # None: causal
        kv = cache.write(layer, qk[:, hq:].transpose(0, 1), v.transpose(0, 1), self.q_list, views=not self.few_rows)
        if self.few_rows:  # mask None = causal after the `past` cached slots
            return self.ops.attend(q_rows, hq, cache.k[layer], cache.v[layer], past + t,
                                   None if mask is None else mask[0, 0], past, *(self.kv_window or (0, 0)))
        q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # (1, Hq, T, D)
        o = F.scaled_dot_product_attention(q, *kv, attn_mask=mask, is_causal=mask is None and t > 1,
                                           enable_gqa=hq != e._hkv)
        return o[0].transpose(0, 1).reshape(t, hq * e._d)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.e._gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def after_attention(self, layer: int, before: torch.Tensor, after: torch.Tensor | None) -> None:
        if self.attn_cosine:  # ASD: how much this attention sublayer turns the residual stream
            self.cosines.append(before.new_ones((), dtype=torch.float32) if after is None else
                                F.cosine_similarity(before.float(), after.float(), dim=-1).mean())


class _FixedOps:
    """The fixed-shape forward's steps of a layer (engine/layer.py ``LayerOps``; :meth:`Engine.fixed_forward`):
    engine/sublayers.py's pure steps (compiled under ``SELFSPEC_COMPILE=1``) on the model's own float
    matrices, each row's K/V written at its slot, attention over the whole buffer through ``allowed``."""

    __slots__ = ("e", "cache", "rope", "slots", "slot_ids", "allowed", "pos", "windows", "attn_cosine", "cosines")

    def __init__(self, e: Engine, cache: KVCache, pos: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor,
                 allowed: torch.Tensor, attn_cosine: bool) -> None:
        self.e, self.cache, self.pos, self.slots, self.slot_ids, self.allowed = e, cache, pos, slots, slot_ids, allowed
        self.rope = {kind: (c.index_select(0, pos), s.index_select(0, pos)) for kind, (c, s) in e._rope.items()}
        self.windows: dict[int, torch.Tensor] = {}
        self.attn_cosine = attn_cosine
        self.cosines: list[torch.Tensor] = []

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.e.sublayers.norm(x, weight, self.e.adapter.rms_eps)

    def linear(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        lin = self.e._lin[layer][name]
        return F.linear(x, lin.weight, lin.bias)

    def heads(self, w: Any, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.e
        return e.sublayers.heads(qkv, w.qk_norm, *self.rope[w.rope_kind], e._hq, e._hkv, e._d, e.adapter.rms_eps)

    def attend(self, layer: int, w: Any, heads: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        e, cache = self.e, self.cache
        qk, v = heads
        r, hq = qk.shape[0], e._hq
        cache.k[layer].index_copy_(1, self.slots, qk[:, hq:].transpose(0, 1))
        cache.v[layer].index_copy_(1, self.slots, v.transpose(0, 1))
        mask = self.allowed
        if (window := w.sliding_window) is not None:  # slot == position: the keys newer than position - window
            if window not in self.windows:
                self.windows[window] = self.allowed & (self.slot_ids[None, :] > self.pos[:, None] - window)
            mask = self.windows[window]
        q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # (1, Hq, R, D)
        o = F.scaled_dot_product_attention(q, cache.k[layer].unsqueeze(0), cache.v[layer].unsqueeze(0),
                                           attn_mask=mask[None, None], enable_gqa=hq != e._hkv)
        return o[0].transpose(0, 1).reshape(r, hq * e._d)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.e.sublayers.glu(gate_up, self.e._gelu)

    def after_attention(self, layer: int, before: torch.Tensor, after: torch.Tensor | None) -> None:
        if self.attn_cosine:  # per row
            self.cosines.append(torch.ones(before.shape[0], dtype=torch.float32, device=before.device) if after is None
                                else F.cosine_similarity(before.float(), after.float(), dim=-1))
