"""What the engine costs on this machine, against what the hardware allows (``selfspec profile``).

Every speedup selfspec can offer is bounded by two numbers of its engine: ``T(1)``, the
time of one decode step, and ``v(k)``, the cost of one forward of ``k`` rows divided
by ``T(1)`` (it decides whether verifying a draft can pay). This module measures:

* the **floor**: bytes of weights one decode step must read (every layer matrix, the
  norms and the LM head; not the embedding table, of which a step reads one row)
  divided by the memory read bandwidth measured here (``torch.sum`` over a buffer far
  larger than the last-level cache, with the same thread count as the engine);
* ``step_ms`` = ``T(1)``: a one-row forward with logits, at a real prompt's context;
* ``verify_cost[k]`` = ``v(k)`` for k in CURVE_ROWS (1..32): a k-row forward with logits for every
  row (what verification does), divided by ``T(1)``;
* ``draft_cost[r]`` = ``c(r)``: a one-row forward that skips a uniform share ``r`` of
  the sublayers (both sublayers of evenly spaced interior layers), divided by ``T(1)``;
  ``draft_cost_draft_vocab[r]`` the same with the model's FR-Spec draft vocabulary (when
  one is calibrated: methods/fr_spec/);
* ``lm_head_share``: final norm + LM head on one row, divided by ``T(1)``;
* ``products_ms``: every matrix product of a one-row step and the LM head, run alone
  (:meth:`Engine.run_products`), and ``non_product_share``: the rest of ``T(1)`` (norms, rotary,
  attention, dispatch), 1 - products / T(1), both at the context of a real prompt;
* ``step_parts`` (:func:`step_parts`): where a one-row step's time goes, at one thread and at the profile's
  thread count, at the prompt's context and at a long one: the kernel's per-op clock over the layers
  (csrc ``stack_profile``: norms, the q/k/v, o, gate/up and down products, rotary and K/V writes, attention,
  residual adds, the activation) and the rest of the step (LM head, embedding, Python);
* ``kernel_max_logit_diff``: the largest difference between the engine's fp32 logits
  with the CPU kernel (engine/kernels.py) and with plain ``F.linear``;
* **quantized drafts** (engine/quant.py), per precision (int8, int8-g32, and the GGUF's
  own blocks for a model converted from a GGUF): ``c``, a full-depth one-row forward on
  the draft copy over ``T(1)`` (timed in the same interleaved rounds; also with the FR-Spec
  draft vocabulary), its one-token top-1 agreement with the target along the target's
  greedy continuations (the context's KV from the target, as in the redundancy map), the
  draft copy's bytes and its load time (a disk-cache hit is the second-load time);
* a **redundancy map**: top-1 agreement with the full model of a one-token draft that
  skips a single sublayer (each of the 2L in turn), and of the calibrated skip set,
  with the full model's KV for the context, along greedy continuations of a few prompts;
* from those figures, no new timing: whether a full-depth copy can pay (:func:`draft_verdict`), and the
  **ceilings** (:func:`draft_ceilings`): the most each drafting family (n-gram, layer skip at r, each
  quantized copy) could gain here with every drafted token accepted.

Each section of ``profile.json`` (and bench's ``engine_costs``) is a frozen dataclass with typed fields
(:class:`EngineCosts`, :class:`StepParts`, :class:`Redundancy`, :class:`QuantizedDrafts`, :class:`DraftVerdict`,
:class:`DraftCeilings`, :class:`PredictedSpeedups`), on decoding/output.py's :class:`DraftReport` base:
serialized once, by ``to_json()``, where the document is written (bench/profile.py, bench/job.py), with the
keys, their order and values the dicts built here always had (tests/test_profile.py checks each).

Invariants: forwards that are timed run on a cache that is cropped back after each one,
so every measurement sees the same context; sizes are interleaved round by round (k=1,
2, ..., 16, then again) so that drift in machine load spreads over all of them; every
figure is a median. Nothing here changes the model.
"""
from __future__ import annotations

import dataclasses
import statistics
from functools import partial
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GenerationConfig
from ..decoding.cost_store import curve_for
from ..decoding.measure import VerifyCurve, timed, weight_bytes
from ..decoding.output import DraftReport, flat, optional
from ..decoding.planning import iid_chain_gains, predicted_speedup
from ..engine import Engine, KVCache, Route
from ..engine.quant import PRECISIONS, GGUFDraftError
from ..errors import SelfSpecError
from ..methods import build, fr_spec
from ..methods.self_sd.study import uniform_layers
from .plots import pyplot, save_figure
from ..jsonio import JsonObject

DRAFT_RATIOS = (0.2, 0.3, 0.4, 0.5, 0.6)
MAX_ACCEPTANCE = 0.999  # the highest i.i.d. acceptance the formula is read at: a verdict's cap, the ceilings' "every token"


@dataclass(frozen=True, slots=True)
class CurveFields(DraftReport):
    """T(1), its growth with the context and v(k), as profile.json and bench's ``engine_costs`` hold them
    (milliseconds and ratios, rounded as written; ``verify_ms``/``verify_cost`` keyed by k as a string)."""

    context_tokens: int
    step_ms: float
    step_ms_per_1k_context: float
    row_ms_per_1k_context: float | None
    verify_ms: dict[str, float]
    verify_cost: dict[str, float]
    curve_readings: int


@dataclass(frozen=True, slots=True)
class DraftVocabCosts(DraftReport):
    """c(r) of drafts that score only the FR-Spec draft vocabulary, and its size."""

    draft_vocab_size: int
    draft_cost_draft_vocab: dict[str, float]


@dataclass(frozen=True, slots=True)
class MeasuredCosts(DraftReport):
    """What :func:`measure_costs` times: the verify curve (its keys first), c(r) and the actual skipped share
    per r (keyed ``f"{r:g}"``), the LM head and the matrix products over a one-row step at the prompt's
    context, and, with a draft vocabulary, its c(r) (keys last)."""

    curve: CurveFields = flat()
    draft_context_tokens: int
    draft_cost: dict[str, float]
    draft_skip_ratio_actual: dict[str, float]
    lm_head_ms: float
    lm_head_share: float
    products_ms: float
    non_product_share: float
    rounds: int
    vocab: DraftVocabCosts | None = flat(omit=True, default=None)


@dataclass(frozen=True, slots=True)
class OneThread(DraftReport):
    """T(1), v(k) and the floor timed afresh at one thread (profile's ``one_thread``; not the planners' curve)."""

    step_ms: float
    verify_cost: dict[str, float]
    bandwidth_gbs: float
    floor_ms: float
    step_over_floor: float


@dataclass(frozen=True, slots=True)
class EngineCosts(DraftReport):
    """The floor and the measured costs in one record (what profile.json and bench's ``engine_costs`` hold):
    bytes per step, read bandwidth, floor, the measured costs (their keys in place), T(1) over the floor, the
    engine's kernel as it stood; profile adds ``one_thread`` (last)."""

    weight_bytes: int
    bandwidth_gbs: float
    floor_ms: float
    measured: MeasuredCosts = flat()
    step_over_floor: float
    kernel: dict[str, object]
    one_thread: OneThread | None = optional()

    @property
    def curve(self) -> CurveFields:
        return self.measured.curve

    def with_curve(self, curve: CurveFields) -> EngineCosts:
        """These costs with another reading of the verify curve (bench: the pool its last pass planned with),
        and T(1) over the floor restated with it (over the floor as written)."""
        return dataclasses.replace(self, measured=dataclasses.replace(self.measured, curve=curve),
                                   step_over_floor=round(curve.step_ms / self.floor_ms, 3))


@dataclass(frozen=True, slots=True)
class CalibratedAgreement(DraftReport):
    """The redundancy map's calibrated row: the skip set (sorted layer indices) and its agreement."""

    skip_attn: list[int]
    skip_mlp: list[int]
    agreement: float


@dataclass(frozen=True, slots=True)
class Redundancy(DraftReport):
    """The redundancy map (:func:`redundancy_map`): agreement per skipped attention and MLP sublayer, what it
    was read over, and the calibrated set's row when there is one."""

    attn: list[float]
    mlp: list[float]
    prompts: int
    tokens_per_prompt: int
    drafts_per_set: int
    calibrated: CalibratedAgreement | None = optional()


@dataclass(frozen=True, slots=True)
class Unavailable(DraftReport):
    """A quantized copy or a method's prediction that could not be measured, and why (one line)."""

    unavailable: str


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedDraft(DraftReport):
    """One measured quantized copy (:func:`quantized_drafts`): the copy as loaded (bytes, load time, cache,
    formats, ISA, what fell back to int8), then its cost c over T(1) (and with the draft vocabulary), its
    one-token agreement with the target (None when no position was compared) and its step time."""

    draft_bytes: int
    load_s: float
    cache: str
    formats: list[str]
    isa: str | None
    int8_fallback: list[str] | None = optional()
    c: float
    c_draft_vocab: float | None = optional()
    agreement: float | None
    draft_step_ms: float

    @property
    def draft_c(self) -> float:
        """c of the draft as specqd runs it: with the draft vocabulary when there is one."""
        return self.c if self.c_draft_vocab is None else self.c_draft_vocab


@dataclass(frozen=True, slots=True)
class QuantizedMeta(DraftReport):
    """How the quantized copies were measured (profile.json's ``quantized_drafts["_"]``)."""

    t1_ms: float
    agreement_positions: int
    rounds: int


@dataclass(frozen=True, slots=True)
class QuantizedDrafts(DraftReport):
    """Per draft precision, in the order asked, a measured copy or why there is none; ``meta`` (written
    under ``"_"``, last) when any copy was measured."""

    drafts: dict[str, QuantizedDraft | Unavailable]
    meta: QuantizedMeta | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {name: d.to_json() for name, d in self.drafts.items()}
        if self.meta is not None:
            out["_"] = self.meta.to_json()
        return out


@dataclass(frozen=True, slots=True)
class VerdictEntry(DraftReport):
    """One copy's best chain: its c (with the draft vocabulary when measured), agreement, length and gain."""

    c: float
    agreement: float
    best_k: int
    best_gain: float


@dataclass(frozen=True, slots=True)
class DraftVerdict(DraftReport):
    """Whether any full-depth copy can pay (:func:`draft_verdict`): per copy, and one line."""

    drafts: dict[str, VerdictEntry]
    summary: str


@dataclass(frozen=True, slots=True)
class Ceiling(DraftReport):
    """The most one drafting source could gain here: its c, and its best chain length and gain with every
    drafted token accepted."""

    source: str
    c: float
    best_k: int
    gain: float


@dataclass(frozen=True, slots=True)
class DraftCeilings(DraftReport):
    """What no draft can exceed on this machine (:func:`draft_ceilings`): per source, and one line."""

    entries: list[Ceiling]
    summary: str


@dataclass(frozen=True, slots=True)
class Predicted(DraftReport):
    """A method's predicted speedup over plain decoding (None without plans) and its share of drafting rounds."""

    predicted_speedup: float | None
    draft_round_share: float


@dataclass(frozen=True, slots=True)
class PredictedSpeedups(DraftReport):
    """Per method asked, in that order, its prediction or why there is none."""

    methods: dict[str, Predicted | Unavailable] = flat()


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Best-of-``repeats`` read bandwidth of ``torch.sum`` over ``nbytes`` of float32 (GB/s) on ``device``
    (the engine's: a GPU's floor is its own memory's, not the host's)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buf.sum()  # touch every page before timing
    return nbytes / min(timed(buf.sum, buf.device)[1] for _ in range(repeats)) / 1e9


_BANDWIDTH: dict[tuple[str, int], float] = {}  # (device, threads) -> GB/s, read once per process


def bandwidth_gbs(device: torch.device | str = "cpu") -> float:
    """:func:`read_bandwidth_gbs` once per process, device and thread count (what the reading depends on). A bench
    takes it before it builds its contenders, so that the probe's 1 GiB buffer never sits on top of them and the
    mapped model (docs/benchmarks.md, "Memory"); its engine costs then use that reading."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and the engine's "cuda:0" are one device: one reading
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), torch.get_num_threads())
    if key not in _BANDWIDTH:
        _BANDWIDTH[key] = read_bandwidth_gbs(device=dev)
    return _BANDWIDTH[key]


def _prefill(engine: Engine, ids: Sequence[int], extra: int) -> KVCache:
    cache = engine.new_cache(len(ids) + extra + 1)
    engine.forward(cache, torch.tensor(list(ids), device=engine.device), positions=0)
    return cache


def _median_times(engine: Engine, cache: KVCache, ctx: int, jobs: dict[str, Callable[[], Any]], warm: Sequence[str],
                  rounds: int, on_round: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Median seconds of each job over ``rounds`` interleaved rounds, after one untimed call of
    each ``warm`` job; the cache is cropped back to ``ctx`` after every call."""
    for key in warm:
        jobs[key]()
        cache.crop(ctx)
    times: dict[str, list[float]] = {key: [] for key in jobs}
    for i in range(rounds):
        for key, fn in jobs.items():
            times[key].append(timed(fn, engine.device)[1])
            cache.crop(ctx)
        if on_round is not None:
            on_round(i + 1, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def _agreement(engine: Engine, prompts: Sequence[Sequence[int]], tokens: int, drafts: Sequence[Route],
               on_token: Callable[[int, int], None] | None = None) -> tuple[list[int], int]:
    """Top-1 hits of one-token drafts (each the :class:`~selfspec_cli.engine.route.Route` of one draft) against
    the full model along its greedy continuation of each prompt, and the positions compared.
    The context's KV always comes from the full model: a draft row is cropped away before the
    full row is computed."""
    hits = [0] * len(drafts)
    total = 0
    for ids in prompts:
        cache = _prefill(engine, ids[:-1], tokens + 1)
        tok = torch.tensor(list(ids[-1:]), device=engine.device)
        for pos in range(len(ids) - 1, len(ids) - 1 + tokens):
            guesses = []
            for route in drafts:
                guesses.append(int(engine.forward(cache, tok, positions=pos, route=route).logits[0].argmax()))
                cache.crop(pos)
            full = int(engine.forward(cache, tok, positions=pos).logits[0].argmax())
            hits = [h + (g == full) for h, g in zip(hits, guesses)]
            total += 1
            if on_token is not None:
                on_token(total, len(prompts) * tokens)
            tok = torch.tensor([full], device=engine.device)
    return hits, total


def measure_costs(engine: Engine, prompt_ids: Sequence[int], *, rounds: int = 7, rows: Sequence[int] = (1,),
                  ratios: Sequence[float] = DRAFT_RATIOS, on_round: Callable[[int, int], None] | None = None,
                  draft_vocab: torch.Tensor | None = None) -> MeasuredCosts:
    """T(1) and v(k) (the engine's verify curve, :class:`~selfspec_cli.decoding.measure.VerifyCurve`:
    one full reading per engine, shared with the planners, read from this machine's store of costs
    when it holds a full one, else measured and stored), and c(r) and the LM head's share at
    the context of ``prompt_ids`` (over a one-row step timed there, the median of ``rounds``);
    with a ``draft_vocab`` (FR-Spec's token ids) also c(r) of drafts that score only those tokens."""
    ctx = len(prompt_ids)
    cache = _prefill(engine, prompt_ids, max(rows))
    # real tokens for the k-row forwards, the prompt's tail repeated when it is shorter than max(rows)
    toks = torch.tensor(list(prompt_ids) * -(-max(rows) // len(prompt_ids)), device=engine.device)[-max(rows):]
    L = engine.num_layers
    draft_sets = {r: uniform_layers(L, r) for r in ratios}
    sub = engine.subset_head(draft_vocab) if draft_vocab is not None else None
    # one round, in order: v(k) for every k, c(r) (and with the draft vocabulary) for every r, the LM head
    jobs: dict[str, Callable[[], Any]] = {
        f"v{k}": partial(engine.forward, cache, toks[:k], positions=ctx, logits_rows=slice(None)) for k in rows}
    for r, s in draft_sets.items():
        for prefix, head in ({"c": None} if sub is None else {"c": None, "cv": sub}).items():
            jobs[f"{prefix}{r}"] = partial(engine.forward, cache, toks[:1], positions=ctx,
                                           route=Route(skip_attn=s, skip_mlp=s, head=head))
    jobs["products"] = partial(engine.run_products, 1)
    jobs["head"] = partial(engine.final_logits,
                           torch.zeros(1, engine.adapter.hidden_size, dtype=engine.dtype, device=engine.device))
    warm = [f"v{k}" for k in rows[:3]]  # warm-up: first calls allocate
    med = {k: v * 1e3 for k, v in _median_times(engine, cache, ctx, jobs, warm, rounds, on_round).items()}
    step = med["v1"]  # c(r) and the head over a one-row step at this same context
    vocab = None if sub is None else DraftVocabCosts(
        draft_vocab_size=int(draft_vocab.numel()),
        draft_cost_draft_vocab={f"{r:g}": round(med[f"cv{r}"] / step, 3) for r in ratios})
    # T(1) and v(k): the engine's one verify curve, the reading the planners use (decoding/cost_store.py)
    return MeasuredCosts(
        curve=curve_fields(curve_for(engine, full=True)), draft_context_tokens=ctx,
        draft_cost={f"{r:g}": round(med[f"c{r}"] / step, 3) for r in ratios},
        draft_skip_ratio_actual={f"{r:g}": round(len(s) / L, 3) for r, s in draft_sets.items()},
        lm_head_ms=round(med["head"], 3), lm_head_share=round(med["head"] / step, 3),
        products_ms=round(med["products"], 3), non_product_share=round(max(0.0, 1 - med["products"] / step), 3),
        rounds=rounds, vocab=vocab)


def curve_fields(curve: VerifyCurve) -> CurveFields:
    """T(1), its growth with the context and v(k), as profile.json and bench's ``engine_costs`` hold them."""
    return CurveFields(
        context_tokens=curve.context, step_ms=round(curve.t1_s * 1e3, 3),
        step_ms_per_1k_context=round(curve.slope_s * 1e6, 3),
        row_ms_per_1k_context=None if curve.row_slope_s is None else round(curve.row_slope_s * 1e6, 3),
        verify_ms={str(k): round(t * 1e3, 3) for k, t in curve.times_s.items()},
        verify_cost={str(k): round(v, 3) for k, v in curve.ratios.items()}, curve_readings=curve.readings)


def engine_costs(engine: Engine, prompt_ids: Sequence[int], rounds: int = 7,
                 on_round: Callable[[int, int], None] | None = None) -> EngineCosts:
    """The floor and the measured costs in one record (what profile.json and bench's
    ``engine_costs`` hold): bandwidth, weight bytes, floor, T(1), v(k), c(r), LM head share."""
    bw = bandwidth_gbs(engine.device)
    wbytes = weight_bytes(engine)
    floor_ms = wbytes / (bw * 1e9) * 1e3
    vocab = fr_spec.resolve("auto", engine.model)  # this model's FR-Spec draft vocabulary, if calibrated
    costs = measure_costs(engine, prompt_ids, rounds=rounds, on_round=on_round,
                          draft_vocab=None if vocab is None else vocab.ids)
    return EngineCosts(weight_bytes=wbytes, bandwidth_gbs=round(bw, 2), floor_ms=round(floor_ms, 3), measured=costs,
                       step_over_floor=round(costs.curve.step_ms / floor_ms, 3), kernel=dict(engine.kernel_info))


STACK_PARTS = ("norms", "qkv", "rotary_kv", "attention", "o", "residual_adds", "gate_up", "activation", "down")


@dataclass(frozen=True, slots=True)
class StepPart(DraftReport):
    """One thread count at one context: T(1) (the median step while the clock runs), the layers' ops in
    milliseconds a step (keys: :data:`STACK_PARTS`; means over the steps), and the mean step less those
    (``outside_layers_ms``: the LM head, the final norm, the embedding row, Python)."""

    threads: int
    context_tokens: int
    step_ms: float
    parts_ms: dict[str, float]
    outside_layers_ms: float


@dataclass(frozen=True, slots=True)
class StepParts(DraftReport):
    """Where a one-row step's time goes, per thread count and context (profile.json's ``step_parts``); what a
    second thread buys is the ratio of two rows' figures."""

    rows: list[StepPart]


def step_parts(engine: Engine, prompt_ids: Sequence[int], threads: Sequence[int], contexts: Sequence[int],
               steps: int = 40, set_threads: Callable[[int], None] | None = None) -> StepParts | None:
    """Time ``steps`` one-row forwards at each context length (the prompt's ids, repeated to length) and thread
    count with the kernel's per-op clock on (csrc ``stack_profile``, off again afterwards); None where the
    forward does not run as one kernel call (no kernel, a GPU). The thread count is restored."""
    from ..engine import kernels
    from ..engine.threads import set_both

    module = kernels.load_extension()
    if module is None or engine.device.type != "cpu" or not engine.stack_layers:
        return None
    set_threads = set_threads or set_both
    before = kernels.pool_threads()
    rows: list[StepPart] = []
    try:
        for ctx in contexts:
            ids = (list(prompt_ids) * (ctx // max(1, len(prompt_ids)) + 1))[:ctx]
            cache = _prefill(engine, ids[:-1], 2)
            tok = torch.tensor(ids[-1:], device=engine.device)
            step = partial(engine.forward, cache, tok, positions=ctx - 1)
            for n in threads:
                set_threads(n)
                for _ in range(3):
                    step()
                    cache.crop(ctx - 1)
                stacked = engine.stacked_forwards
                module.stack_profile_read()
                module.stack_profile(True)
                times = []
                try:
                    for _ in range(steps):
                        times.append(timed(step, engine.device)[1])
                        cache.crop(ctx - 1)
                finally:
                    module.stack_profile(False)
                got = module.stack_profile_read()
                if engine.stacked_forwards - stacked != steps or got[0] != steps:
                    return None  # the layers did not run as one call each (a route the stack does not take)
                parts = {name: round(sec / steps * 1e3, 4) for name, sec in zip(STACK_PARTS, got[1:])}
                total = sum(times) / steps * 1e3
                rows.append(StepPart(threads=n, context_tokens=ctx, step_ms=round(statistics.median(times) * 1e3, 4),
                                     parts_ms=parts, outside_layers_ms=round(total - sum(parts.values()), 4)))
    finally:
        set_threads(before)
    return StepParts(rows=rows)


@torch.inference_mode()
def kernel_logit_diff(engine: Engine, prompt_ids: Sequence[int], steps: int = 4) -> float | None:
    """Largest |logit| difference between the engine with its CPU kernel and with F.linear over ``steps`` rows
    after the prompt (the prompt's last token again, then the kernel's greedy continuation), each way in one
    ``steps``-row forward (None when no kernel is in use). One forward, not ``steps``: on a model read from its
    GGUF, F.linear's matrices are dequantized from the file per call (``Engine.plain_linear``), 40 s a pass for a
    1.5B model here; the kernel's rows equal its one-row steps bit for bit (batch invariance)."""
    if engine.kernel_info.get("backend") != "small_gemm":
        return None
    n = len(prompt_ids)
    cache = _prefill(engine, prompt_ids, steps)
    toks = [int(prompt_ids[-1])]
    for pos in range(n, n + steps - 1):  # the rows: the kernel's own greedy walk
        toks.append(int(engine.forward(cache, torch.tensor(toks[-1:], device=engine.device), positions=pos).logits[-1].argmax()))
    cache.crop(n)
    rows = torch.tensor(toks, device=engine.device)
    fast = engine.forward(cache, rows, positions=n, logits_rows=slice(None)).logits
    cache.crop(n)
    with engine.plain_linear():
        plain = engine.forward(cache, rows, positions=n, logits_rows=slice(None)).logits
    return float((fast - plain).abs().max())


@torch.inference_mode()
def redundancy_map(engine: Engine, prompts: Sequence[Sequence[int]], tokens: int,
                   calibrated: tuple[frozenset[int], frozenset[int]] | None = None,
                   on_token: Callable[[int, int], None] | None = None) -> Redundancy:
    """Top-1 agreement with the full model of one-token drafts that skip one sublayer (each in
    turn) or the calibrated set, along the full model's greedy continuation of each prompt.
    The context's KV always comes from the full model: the draft row is cropped away before
    the full row is computed."""
    L = engine.num_layers
    none: frozenset[int] = frozenset()
    # (skip_attn, skip_mlp): attention 0..L-1, then MLP 0..L-1, then the calibrated set
    sets = [(frozenset([l]), none) for l in range(L)] + [(none, frozenset([l])) for l in range(L)]
    sets += [calibrated] if calibrated is not None else []
    hits, total = _agreement(engine, prompts, tokens, [Route(skip_attn=sa, skip_mlp=sm) for sa, sm in sets], on_token)
    agree = [round(h / total, 4) for h in hits]
    cal = None if calibrated is None else CalibratedAgreement(
        skip_attn=sorted(calibrated[0]), skip_mlp=sorted(calibrated[1]), agreement=agree[-1])
    return Redundancy(attn=agree[:L], mlp=agree[L:2 * L], prompts=len(prompts), tokens_per_prompt=tokens,
                      drafts_per_set=total, calibrated=cal)


def verify_cost_plot(profile: JsonObject, path: Any) -> Any:
    """v(k) of a written profile document (profile.json), as a line plot."""
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    ax.plot([int(k) for k in profile["verify_cost"]], list(profile["verify_cost"].values()), marker="o",
            label="measured v(k)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="one row")
    ax.set(xlabel="rows in one forward (k)", ylabel="cost / one-row step", ylim=(0, None))
    ax.set_title(f"verification cost v(k): T(1) = {profile['step_ms']:.1f} ms, floor {profile['floor_ms']:.1f} ms",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def redundancy_plot(red: JsonObject, path: Any, title: str = "") -> Any:
    """A written redundancy map (profile.json's ``redundancy``) as a 2 x L heatmap."""
    L = len(red["attn"])
    fig, ax = pyplot().subplots(figsize=(max(6, 0.28 * L + 1.5), 2.4))
    im = ax.imshow([red["attn"], red["mlp"]], aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_yticks([0, 1], ["attention", "MLP"])
    ax.set(xticks=range(0, L, max(1, L // 15)), xlabel="layer")
    sub = f"; calibrated set: {red['calibrated']['agreement']:.2f}" if red.get("calibrated") else ""
    ax.set_title((title + ": " if title else "") + f"top-1 agreement when one sublayer is skipped{sub}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    return save_figure(fig, path)


PREDICT_METHODS = ("pld", "auto", "specqd", "self-sd", "asd", "swift", "adadecode")


@torch.inference_mode()
def quantized_drafts(engine: Engine, ctx_ids: Sequence[int], prompts: Sequence[Sequence[int]], tokens: int,
                     rounds: int = 7, precisions: Sequence[str] = PRECISIONS,
                     draft_vocab: torch.Tensor | None = None) -> QuantizedDrafts:
    """Per draft precision: c (full depth, and with the draft vocabulary), one-token agreement
    with the target along its greedy continuations of ``prompts``, bytes and load time."""
    missing: dict[str, Unavailable] = {}
    info: dict[str, dict[str, Any]] = {}  # the copy's own info (engine/quant.py), per precision loaded
    for p in precisions:
        if p == engine.target_precision:  # a copy at the target's own precision is the target
            missing[p] = Unavailable(f"the {p} target itself")
            continue
        try:
            info[p] = engine.quantized(p).info
        except GGUFDraftError as exc:
            missing[p] = Unavailable(str(exc).split(";")[0])
    avail = list(info)
    if not avail:
        return QuantizedDrafts(dict(missing))
    ctx = len(ctx_ids)
    cache = _prefill(engine, ctx_ids, 2)
    tok = torch.tensor(list(ctx_ids[-1:]), device=engine.device)
    subs = {p: engine.subset_head(draft_vocab, p) for p in avail} if draft_vocab is not None else {}
    jobs: dict[str, Callable[[], Any]] = {"t1": partial(engine.forward, cache, tok, positions=ctx)}
    for p in avail:
        jobs[p] = partial(engine.forward, cache, tok, positions=ctx, route=Route(weights=p))
        if p in subs:
            jobs[p + "/vocab"] = partial(engine.forward, cache, tok, positions=ctx,
                                         route=Route(weights=p, head=subs[p]))
    med = _median_times(engine, cache, ctx, jobs, list(jobs), rounds)  # every job warmed up once
    hits, total = _agreement(engine, prompts, tokens, [Route(weights=p) for p in avail])
    measured = {p: QuantizedDraft(
        draft_bytes=info[p]["bytes"], load_s=info[p]["load_s"], cache=info[p]["cache"], formats=info[p]["formats"],
        isa=info[p].get("isa"), int8_fallback=info[p].get("int8_fallback") or None, c=round(med[p] / med["t1"], 3),
        c_draft_vocab=round(med[p + "/vocab"] / med["t1"], 3) if p + "/vocab" in med else None,
        agreement=round(h / total, 4) if total else None, draft_step_ms=round(med[p] * 1e3, 3))
        for p, h in zip(avail, hits)}
    drafts = {p: missing[p] if p in missing else measured[p] for p in precisions}  # in the order asked
    return QuantizedDrafts(drafts, QuantizedMeta(t1_ms=round(med["t1"] * 1e3, 3), agreement_positions=total,
                                                 rounds=rounds))


def draft_verdict(quantized: QuantizedDrafts, verify_cost: dict[str, float]) -> DraftVerdict:
    """Whether any full-depth copy can pay against this target: for each draft with a measured c and
    one-token agreement a, the best expected gain of a chain of k drafts, 1 + a + ... + a^k tokens per
    k c + v(k+1) target steps (a i.i.d. per token, an optimistic reading: the planners' one round-cost
    formula, decoding/planning.py's ``iid_chain_gains``), over the k the verify curve covers. A draft at
    the target's own precision is the target and is left out."""
    per: dict[str, VerdictEntry] = {}
    curve, ks = _table_curve(verify_cost)
    for name, q in quantized.drafts.items():
        if not isinstance(q, QuantizedDraft) or q.agreement is None:
            continue
        c, a = q.draft_c, min(q.agreement, MAX_ACCEPTANCE)
        gains = iid_chain_gains(curve, a, c, ks)
        best = max(gains, key=gains.get)
        per[name] = VerdictEntry(c=c, agreement=q.agreement, best_k=best, best_gain=round(gains[best], 3))
    paying = {n: v for n, v in per.items() if v.best_gain > 1.0 and v.c < 0.98}
    if not per:
        summary = "no quantized copy measured"
    elif paying:
        n = max(paying, key=lambda n: paying[n].best_gain)
        summary = f"{n} can pay: up to {paying[n].best_gain:.2f}x at {paying[n].best_k} drafts (c {paying[n].c:.2f})"
    else:
        summary = ("nothing cheaper than the target pays here: no full-depth copy gains over plain decoding "
                   "(layer skipping and n-gram drafts are measured by selfspec bench)")
    return DraftVerdict(per, summary)


def _table_curve(verify_cost: dict[str, float]) -> tuple[VerifyCurve, list[int]]:
    """A verify curve read from a written ``verify_cost`` table as it is (T(1) 1: costs in plain steps), and the
    draft lengths it covers: the verified rows less the pending token."""
    curve = VerifyCurve(1.0, {int(k): float(v) for k, v in verify_cost.items()})
    return curve, sorted(int(k) - 1 for k in verify_cost if int(k) >= 2)


def _best_chain(curve: VerifyCurve, ks: list[int], source: str, c: float) -> Ceiling:
    gains = iid_chain_gains(curve, MAX_ACCEPTANCE, c, ks)
    best = max(gains, key=gains.get)
    return Ceiling(source=source, c=c, best_k=best, gain=round(gains[best], 3))


def draft_ceilings(verify_cost: dict[str, float], draft_cost: dict[str, float],
                   quantized: QuantizedDrafts | None) -> DraftCeilings:
    """What no draft of each family can exceed here: the best gain of a chain of k drafts if every drafted
    token were accepted (a = :data:`MAX_ACCEPTANCE`; the planners' one round-cost formula,
    decoding/planning.py's ``iid_chain_gains``, as :func:`draft_verdict`), over the k the verify curve covers,
    per source: ``n-gram`` (c = 0: pld, auto's n-gram source), ``layer skip at r`` for each measured c(r)
    (self-sd, swift, asd: a draft that skips a share r of the sublayers), and each quantized copy with a
    measured c (specqd; with the draft vocabulary when measured). The summary names the best of each family."""
    curve, ks = _table_curve(verify_cost)
    if not ks:
        return DraftCeilings([], "no verify cost beyond one row measured: no ceiling")
    ngram = _best_chain(curve, ks, "n-gram", 0.0)
    skips = {r: _best_chain(curve, ks, f"layer skip at {r}", c) for r, c in draft_cost.items()}
    copies = [_best_chain(curve, ks, name, q.draft_c) for name, q in (quantized.drafts if quantized else {}).items()
              if isinstance(q, QuantizedDraft)]
    parts = [f"{ngram.gain:.2f}x for n-gram drafts (k {ngram.best_k})"]
    if skips:
        r = max(skips, key=lambda r: skips[r].gain)
        parts.append(f"{skips[r].gain:.2f}x skipping {float(r):.0%} of the sublayers (k {skips[r].best_k})")
    if copies:
        q = max(copies, key=lambda e: e.gain)
        parts.append(f"{q.gain:.2f}x for the {q.source} copy (k {q.best_k})")
    return DraftCeilings([ngram, *skips.values(), *copies], "at most " + ", ".join(parts)
                         + ", even if every drafted token is accepted (v(k) and c measured here)")


def predicted_speedups(engine: Engine, tokenizer: Any, prompt_ids: Sequence[list[int]], methods: Sequence[str],
                       max_new_tokens: int, eos_ids: tuple[int, ...] = (),
                       on_method: Callable[[int, str], None] | None = None) -> PredictedSpeedups:
    """Each cost-aware method's predicted speedup over plain decoding on this machine: its
    rounds' expected tokens over their cost in plain steps (decoding/planning.py), summed over
    greedy decodes of ``prompt_ids``; the costs are the engine's measured verify curve and
    draft costs, the acceptance what the method saw on these prompts. A method whose
    artifacts are missing is reported with the reason."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids)
    out: dict[str, Predicted | Unavailable] = {}
    for i, name in enumerate(methods):
        if on_method is not None:
            on_method(i, name)
        try:
            method = build(name, engine, tokenizer)
        except SelfSpecError as exc:
            out[name] = Unavailable(str(exc).split(";")[0])
            continue
        stats = [method.generate(list(ids), cfg).stats for ids in prompt_ids]
        plans = [(p.expected_tokens, p.cost_steps) for st in stats if (p := st.summary().plan) is not None]
        rounds = sum(len(st.accept_lengths) - 1 for st in stats)
        predicted = predicted_speedup(plans)
        out[name] = Predicted(predicted_speedup=round(predicted, 4) if predicted is not None else None,
                              draft_round_share=round(sum(st.draft_rounds for st in stats) / rounds, 4) if rounds else 0.0)
    return PredictedSpeedups(out)
