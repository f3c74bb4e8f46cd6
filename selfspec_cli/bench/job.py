"""One ``selfspec bench`` run: the checks before the model loads, the contenders, the timed passes,
``--resume``, torchrun's ranks, what an interrupt keeps, and the files written. The command
(cli/bench.py) parses its options into a :class:`BenchRequest`, hands over its console through
:class:`BenchIO` and prints the tables of the :class:`BenchOutcome`.

Outputs (``--output-dir``): ``results.json`` (schema in docs/benchmarks.md), ``run.json`` (the
run's key, which ``--resume`` compares), ``records/<method>.jsonl`` (every timed pass, flushed
prompt by prompt; under torchrun ``records/rank<r>/`` per rank, merged by rank 0),
``answers/<method>.jsonl`` (Spec-Bench answer format), PNG plots.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from ..artifacts import environment_info, model_name, recording_loads
from ..config import GenerationConfig, SamplingConfig, check_choice, check_sampling_options, check_seed
from ..decoding.cost_store import curve_for, measure_fresh, refresh_curve
from ..engine import Engine, threads as governor
from ..engine.target import TARGET_PRECISIONS
from ..errors import ConfigError, count
from ..decoding.output import OutputRecord
from ..jsonio import JsonObject, dumps
from ..loading import resolve_device
from ..methods import METHODS, Method, build, config_for
from ..paths import atomic_write, check_not_input, cut_to_last_line
from ..prompts import PROMPT_FORMATS, Prompt, uses_chat_template
from ..session import Session, apply_threads
from . import engine_profile as prof, plots, ranks as rk
from .metrics import step_log
from .peer_process import PeerSpec, ProcessPeer
from .peers import PEERS, make_peer
from .report import MethodSummary, document, spec_bench_answers, summarize
from .runner import Contender, ContenderResult, run_bench
from .suite_loader import load_prompts

# contenders that are a method with non-default options: name -> (method, config fields, description suffix)
VARIANTS: dict[str, tuple[str, JsonObject, str]] = {
    "specee-empty": ("specee", {"specee_kv_mode": "empty"}, " [empty KV: deeper layers never get an exited token's K/V, as in the paper]"),
    "self-sd-hybrid": ("self-sd", {"hybrid": True}, " [hybrid: the n-gram continuation merged into the draft tree]"),
    "self-sd-full-vocab": ("self-sd", {"draft_vocab": "full"}, " [drafts over the full vocabulary, no FR-Spec subset]"),
    "auto-single": ("auto", {"hybrid": False}, " [one drafting source per round, no hybrid trees]"),
    "specqd-int8": ("specqd", {"draft_precision": "int8"}, " [int8 per-channel draft weights]"),
}
# plain decoding on another target than the run's (engine/target.py): the fp32 row beside a block or bf16 target,
# so a run can show what the faster target is worth; in the default list, and left out where the run's target is fp32
TARGET_PEERS: dict[str, str] = {"ar-fp32": "fp32"}
DEFAULT_METHODS = "ar,ar-fp32,hf,hf-pld," + ",".join(m for m in METHODS if m != "ar")
REFERENCE, BASELINE = "ar", "hf"

# files bench writes into --output-dir (and only these are ever deleted, with --force)
BENCH_FILES = ("results.json", "run.json", "speedup_by_category.png", "accept_lengths.png", "records/*.jsonl",
               "records/rank*/*.jsonl", "answers/*.jsonl", "*_skip_sets.png")


def bench_files(output_dir: Path) -> list[Path]:
    """Files of an earlier bench run in ``output_dir``: its fixed names, records/*.jsonl (and a
    torchrun run's records/rank<r>/*.jsonl), answers/*.jsonl and *_skip_sets.png. Nothing else
    there is touched."""
    return [p for pattern in BENCH_FILES for p in sorted(output_dir.glob(pattern)) if p.is_file()]


@dataclass(frozen=True)
class BenchRequest:
    """The options of one bench run, as parsed."""

    methods: str
    prompt_file: str | None
    prompt_format: str
    suite: str | None
    model: str | None
    max_new_tokens: int
    warmup: int
    repeats: int
    output_dir: Path
    force: bool
    resume: bool
    plot: bool
    costs: bool
    early_exit_layer: int | None
    assistant_model: str | None
    temperature: float
    top_p: float
    top_k: int
    sampling_rule: str
    seed: int
    threads: str | None
    chat_template: bool
    dtype: str
    target_precision: str
    device: str

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(m.strip() for m in self.methods.split(",") if m.strip()))


@dataclass
class BenchIO:
    """What the run says and writes through the command's console."""

    log: Callable[[str], None]  # one stderr line, rich markup allowed
    progress: Callable[..., Any]  # progress(disable=...) -> a context manager giving a bar (rich's Progress)
    write_record: Callable[[IO[str], JsonObject], None]  # one JSON line, flushed; a failed write is one line
    set_exit_note: Callable[[str], None]  # said on stderr when the run is interrupted
    invocation: str  # this command line, recorded in results.json


@dataclass
class BenchPlan:
    """What the checks before the model loads settled."""

    names: list[str]
    ranks: rk.Ranks
    stale: list[Path]
    cfg: GenerationConfig
    sampling: SamplingConfig
    decoding: str
    prompts: list[Prompt]
    source: JsonObject  # where the prompts came from, as results.json's setup says it
    say: Callable[[str], None]


@dataclass
class BenchOutcome:
    """What the command prints: the summary per contender and the results document."""

    summary: dict[str, MethodSummary]
    doc: JsonObject  # results.json, as written
    title: str
    reference: str | None
    baseline: str | None


@dataclass
class Contenders:
    """Every contender, built once up front (a missing artifact fails now, not after an hour)."""

    names: list[str]
    contenders: list[Contender] = field(default_factory=list)
    descriptions: dict[str, str] = field(default_factory=dict)
    offline: dict[str, JsonObject | None] = field(default_factory=dict)
    artifacts: dict[str, dict[str, str]] = field(default_factory=dict)
    built: dict[str, list[Method]] = field(default_factory=dict)  # each pass's method instances (search histories)
    processes: dict[str, ProcessPeer] = field(default_factory=dict)  # TARGET_PEERS' child processes


# ---------------------------------------------------------------- before the model loads


def check_names(names: list[str]) -> None:
    unknown = [m for m in names if m not in METHODS and m not in VARIANTS and m not in PEERS and m not in TARGET_PEERS]
    if not names or unknown:
        raise ConfigError((f"unknown --methods {', '.join(unknown)}" if unknown else "--methods names no contender")
                          + f"; choose from: {', '.join([*METHODS, *VARIANTS, *PEERS, *TARGET_PEERS])}")


def _check_options(req: BenchRequest, names: list[str]) -> None:
    if req.warmup < 0 or req.repeats < 1:
        raise ConfigError("--warmup must be >= 0 and --repeats >= 1")
    check_seed(req.seed)
    if req.output_dir.exists() and not req.output_dir.is_dir():
        raise ConfigError(f"--output-dir '{req.output_dir}' is a file; pass a directory")
    check_choice(req.prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(req.target_precision, TARGET_PRECISIONS, "--target-precision")
    for opt, value, peer in (("--early-exit-layer", req.early_exit_layer, "hf-early-exit"),
                             ("--assistant-model", req.assistant_model, "hf-assisted")):
        if value is not None and peer not in names:
            raise ConfigError(f"{opt} is an option of the {peer} peer; drop it or add {peer} to --methods")
    if req.temperature > 0 and (greedy_only := [n for n in names if n in PEERS or (
            (base := VARIANTS.get(n, (n,))[0]) in METHODS and METHODS[base].greedy_only)]):
        raise ConfigError(f"{', '.join(greedy_only)} {'runs' if len(greedy_only) == 1 else 'run'} greedy only; with "
                          "--temperature drop them from --methods (e.g. --methods ar,specqd,self-sd,swift,asd,pld,auto,adadecode)")
    if "hf-assisted" in names and req.assistant_model is None:
        raise ConfigError("hf-assisted needs a second model with the same tokenizer; pass --assistant-model DIR")


def _stale_files(req: BenchRequest) -> list[Path]:
    """The earlier run's files that --force deletes (none with --resume); refused without --force."""
    if req.resume and req.force:
        raise ConfigError("--resume keeps the earlier run's records and --force deletes them; pass one of them")
    stale = [] if req.resume else bench_files(req.output_dir)
    if stale and not req.force:
        shown = ", ".join(str(p.relative_to(req.output_dir)) for p in stale[:3]) + (
            f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise ConfigError(f"--output-dir '{req.output_dir}' holds files of an earlier bench run ({shown}); pass --force "
                          "to delete those files first, or choose another --output-dir")
    for f in stale:  # only with --force
        check_not_input(f, (req.prompt_file,), "--output-dir")
    return stale


def prepare(req: BenchRequest, io: BenchIO) -> BenchPlan:
    """Every check that needs no model, in the command's order; joins torchrun's ranks."""
    names = req.names
    check_names(names)
    _check_options(req, names)
    apply_threads(req.threads)
    ranks = rk.from_env()  # torchrun's ranks (one when not under torchrun)
    say = io.log if ranks.lead else (lambda _msg: None)  # the other ranks report through rank 0
    stale = _stale_files(req)
    rk.init(ranks)
    sampling = SamplingConfig(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                              rule=req.sampling_rule)
    cfg = GenerationConfig(max_new_tokens=req.max_new_tokens, sampling=sampling)  # validates first
    check_sampling_options(sampling)
    decoding = "greedy" if sampling.greedy else (f"sampling (temperature {req.temperature}, top-p {req.top_p}, top-k "
                                                 f"{req.top_k}, rule {req.sampling_rule}, seed {req.seed})")
    prompts, source = load_prompts(req.prompt_file, req.suite, req.prompt_format)
    if len({p.id for p in prompts}) != len(prompts):
        raise ConfigError("prompt ids repeat; give every prompt a unique 'id' so outputs can be compared")
    if len(prompts) < ranks.world:  # every rank checks the same thing, so all of them stop with this line
        raise ConfigError(f"{len(prompts)} prompts for {ranks.world} torchrun ranks: a rank would have none; "
                          "start fewer ranks (--nproc-per-node) or pass more prompts")
    return BenchPlan(names, ranks, stale, cfg, sampling, decoding, prompts, source, say)


# ---------------------------------------------------------------- the contenders


def _method_contender(c: Contenders, n: str, engine: Engine, tok: Any, seed: int) -> None:
    base, extra, note = VARIANTS.get(n, (n, {}, ""))
    fields = {f.name for f in dataclasses.fields(METHODS[base].Config)}
    conf = config_for(base, {**({"seed": seed} if "seed" in fields else {}), **extra})  # the run's seed where it has one
    with recording_loads() as c.artifacts[n]:  # the artifact files it reads, recorded in results.json
        first = build(base, engine, tok, conf)
    c.descriptions[n] = first.description + note
    c.offline[n] = (info := first.offline_info()) and info.to_json()  # calibration / training time, from its artifacts
    c.built[n] = []

    def make(b: str = base, conf: Any = conf, n: str = n) -> Any:
        c.built[n].append(build(b, engine, tok, conf))
        return c.built[n][-1].generate

    c.contenders.append(Contender(n, make, first.lossless))


def build_contenders(names: list[str], session: Session, engine: Engine, req: BenchRequest,
                     assistant: Any = None) -> Contenders:
    tok, mdl = session.tokenizer, session.model
    c = Contenders(names)
    # TARGET_PEERS decode in a process of their own (bench/peer_process.py), started first so that it loads
    # while the methods build: their float weights are never this process's memory, and the block target
    # can release its own (each row's peak_rss_mb is its own process's; docs/benchmarks.md, "Memory")
    c.processes = {n: ProcessPeer(PeerSpec(session.spec, session.dtype, session.device, TARGET_PEERS[n],
                                           torch.get_num_threads(), dict(governor.AUTO)))
                   for n in names if n in TARGET_PEERS}
    for n in names:
        if n in METHODS or n in VARIANTS:
            _method_contender(c, n, engine, tok, req.seed)
        elif n in TARGET_PEERS:
            c.descriptions[n] = (f"plain decoding on the {TARGET_PEERS[n]} target (the model's float32 tensors, in a "
                                 f"process of its own), beside ar on this run's {engine.target_precision} target")
            c.contenders.append(Contender(n, c.processes[n].make, True, kind="peer", pid=c.processes[n].pid))
        else:
            peer = make_peer(n, mdl, early_exit_layer=req.early_exit_layer, assistant=assistant)
            c.descriptions[n] = PEERS[n]
            c.contenders.append(Contender(n, (lambda peer=peer: peer.generate), peer.lossless, kind="peer"))
    if not any(n in PEERS for n in names):  # no contender in this process runs the float weights
        engine.release_float_weights()
    for n, proc in c.processes.items():
        if proc.wait_ready() != TARGET_PEERS[n]:
            raise ConfigError(f"{n}: the model cannot run on the {TARGET_PEERS[n]} target; drop {n} from --methods")
    return c


# ---------------------------------------------------------------- --resume


def run_key(req: BenchRequest, plan: BenchPlan, names: list[str], session: Session, engine: Engine) -> JsonObject:
    """What a resumed run must share with the interrupted one (run.json)."""
    return {"methods": names, "prompts": [p.id for p in plan.prompts], "max_new_tokens": req.max_new_tokens,
            "decoding": plan.decoding, "model_fingerprint": session.fingerprint, "dtype": str(engine.dtype),
            "target_precision": engine.target_precision, "chat_template": req.chat_template, "warmup": req.warmup,
            "seed": req.seed, "threads": torch.get_num_threads(), "early_exit_layer": req.early_exit_layer,
            "assistant_model": req.assistant_model,
            "prompts_sha256": hashlib.sha256(dumps([list(p.turns) for p in plan.prompts]).encode()).hexdigest(),
            "ranks": plan.ranks.world}


def earlier_records(output_dir: Path, key: JsonObject, names: list[str],
                    records_dir: Path) -> dict[str, dict[tuple[int, Any], OutputRecord]]:
    """--resume: the finished records of the interrupted run in ``output_dir``, per contender,
    keyed by (pass, prompt id); a torn last line is dropped. Refused when that run was another command."""
    try:
        earlier = json.loads((output_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"--resume: '{output_dir}' holds no interrupted bench run (no readable run.json); "
                          "drop --resume to start one") from None
    diff = [k for k in key if earlier.get(k) != key[k]]
    if diff:
        raise ConfigError(f"--resume: the run in '{output_dir}' was made with other settings ({', '.join(diff)}); "
                          "resume it with its own command, or choose another --output-dir")
    done: dict[str, dict[tuple[int, Any], OutputRecord]] = {}
    for n in names:
        path = records_dir / f"{n}.jsonl"
        if not path.is_file():
            continue
        cut_to_last_line(path)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                d = json.loads(line)
                done.setdefault(n, {})[(d["repeat"], d["id"])] = OutputRecord.from_dict(d)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConfigError(f"--resume: line {i} of '{path}' is not a bench record; start the run again "
                                  "with --force") from None
    return done


def complete_cells(partial: dict[str, ContenderResult], prompts: Sequence[Prompt]) -> dict[str, ContenderResult] | None:
    """The (pass, prompt) cells every contender finished, as results (None when there is none)."""
    if not partial:
        return None
    passes = min(len(r.repeats) for r in partial.values())
    out = {n: ContenderResult(r.name, r.lossless, r.kind, peak_rss_mb=r.peak_rss_mb) for n, r in partial.items()}
    for rep in range(passes):
        ids = set.intersection(*({rec.id for rec in r.repeats[rep]} for r in partial.values()))
        if not ids:
            continue
        for n, r in partial.items():
            out[n].repeats.append([rec for rec in r.repeats[rep] if rec.id in ids])
    return out if any(r.repeats for r in out.values()) else None


# ---------------------------------------------------------------- the run


@dataclass
class _Run:
    """The state one run carries from the model load to the results."""

    req: BenchRequest
    plan: BenchPlan
    io: BenchIO
    session: Session
    engine: Engine
    names: list[str]
    contenders: Contenders
    prompts: list[Prompt]  # this rank's share (every prompt in one process)
    records_dir: Path
    done: dict[str, dict[tuple[int, Any], OutputRecord]] = field(default_factory=dict)
    startup: dict[str, float] = field(default_factory=dict)  # the model's load and the memory then (Session.startup)

    @property
    def dev(self) -> torch.device:
        return torch.device(self.engine.device)


def run(req: BenchRequest, plan: BenchPlan, io: BenchIO) -> BenchOutcome | None:
    """Load the model, build the contenders, time them and write the results (rank 0 under torchrun;
    the other ranks return None)."""
    # without transformers where no Hugging Face peer runs in this process (selfspec_cli/lite.py): its
    # modules and tokenizer hold about 170 MB that no selfspec contender reads
    lite = not any(n in PEERS for n in plan.names)
    # what an interrupt keeps before the first record (cli/exits.py); _start and _time say more once they have it
    io.set_exit_note(f"the run stopped before its first record and wrote nothing to '{req.output_dir}'; "
                     + ("the same command with --resume carries on the earlier run there" if req.resume else
                        "there is nothing to resume: run the same command again"))
    session = Session.open(req.model, dtype=req.dtype, device=req.device, chat_template=req.chat_template, lite=lite)
    cfg = session.generation(plan.cfg)
    session.check_fits(plan.prompts, cfg)
    ranks = plan.ranks
    prompts = ranks.share(plan.prompts)  # this rank's prompts (all of them in one process)
    records_dir = req.output_dir / "records" / (f"rank{ranks.rank}" if ranks.many else "")
    assistant = None if req.assistant_model is None else Session.open(req.assistant_model, dtype=req.dtype,
                                                                      device=req.device).model
    if req.costs and ranks.lead:  # the bandwidth probe's 1 GiB buffer before the engine reads its weights (a block target's
        # panels are resident from the start: engine/arena.py) and before the contenders, not on top of them
        prof.bandwidth_gbs(resolve_device(req.device))
    engine = session.engine(req.target_precision)
    measure_fresh(engine)  # every run measures its own costs (and pools a new reading per pass), never the store's
    names = plan.names
    if "ar-fp32" in names and (engine.target_precision == "fp32" or engine.dtype != torch.float32):
        names = [n for n in names if n != "ar-fp32"]  # it would be ar itself, or a float32 copy of a model not loaded so
        why = "is the float32 weights already" if engine.dtype == torch.float32 else f"is loaded in {engine.dtype}"
        plan.say(f"[dim]ar-fp32 left out: the target {why}[/dim]")
    contenders = build_contenders(names, session, engine, req, assistant)
    r = _Run(req, plan, io, session, engine, names, contenders, prompts, records_dir, startup=session.startup())
    _start(r)
    engine_costs = _engine_costs(r) if req.costs and ranks.lead else None
    rk.barrier(ranks)  # every rank starts timing together, after rank 0's cost measurement
    results = _time(r, cfg)
    for proc in contenders.processes.values():
        proc.close()
    if ranks.many and not _gather(r, results):
        return None
    return _finish(r, results, engine_costs)


def _start(r: _Run) -> None:
    """--resume's records, the earlier run's files gone, the output folders and run.json; the run's header."""
    req, plan, ranks = r.req, r.plan, r.plan.ranks
    key = run_key(req, plan, r.names, r.session, r.engine)
    r.done = earlier_records(req.output_dir, key, r.names, r.records_dir) if req.resume else {}
    if ranks.lead:
        for f in plan.stale:
            f.unlink(missing_ok=True)
    rk.barrier(ranks)  # the earlier run's files are gone before any rank makes its own
    try:
        for d in (r.records_dir, req.output_dir / "answers"):
            d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --output-dir '{req.output_dir}' ({exc.strerror}); choose a writable "
                          "directory") from None
    if ranks.lead:
        atomic_write(req.output_dir / "run.json", lambda f: f.write((dumps(key, indent=2) + "\n").encode()))
    held = sum(len(v) for v in r.done.values())
    r.io.set_exit_note((f"{count(held, 'earlier record')} kept" if held else "no record was finished yet")
                       + f"; '{req.output_dir}' holds the run's setup (run.json), so the same command with --resume "
                       "carries on from there")
    say, engine, mdl = plan.say, r.engine, r.session.model
    if r.done:
        say(f"[dim]resuming: {sum(len(v) for v in r.done.values())} finished records kept[/dim]")
    cats = Counter(p.category or "all" for p in plan.prompts)
    if ranks.many:
        say(f"[dim]torchrun: {ranks.world} ranks, every {ranks.world}th prompt each; records per rank in "
            f"{req.output_dir}/records/rank<r>/[/dim]")
    say(f"[dim]model {model_name(mdl)} ({mdl.config.model_type}, {engine.num_layers} layers, {engine.dtype}, {r.dev}, "
        f"{count(torch.get_num_threads(), 'thread')}{' per rank' if ranks.many else ''}); {count(len(plan.prompts), 'prompt')} "
        f"({', '.join(f'{c} {k}' for c, k in cats.items())}) x {count(req.max_new_tokens, 'token')}; warm-up {req.warmup}, "
        f"repeats {req.repeats}; contenders {', '.join(r.names)}[/dim]")
    say(f"[dim]target: {engine.target_precision} ({engine.target_info.get('why') or 'asked'}); every speedup is "
        f"against ar on it; model loaded in {r.startup['model_load_s']:.1f} s, peak RSS {r.startup['peak_rss_mb']:.0f} "
        "MB with the contenders built[/dim]")


def _engine_costs(r: _Run) -> prof.EngineCosts:
    """The engine's costs, as ``selfspec profile`` measures them (rank 0 only)."""
    engine = r.engine
    ids = sorted(r.session.encode_first_turns(r.prompts), key=len)
    costs = prof.engine_costs(engine, ids[len(ids) // 2], rounds=7)  # as selfspec profile
    r.plan.say(f"[dim]engine costs: floor {costs.floor_ms:.1f} ms ({costs.bandwidth_gbs:.1f} GB/s), "
               f"T(1) {costs.curve.step_ms:.1f} ms ({costs.step_over_floor:.2f}x floor), "
               f"v(4) {costs.curve.verify_cost['4']:.2f}, v(8) {costs.curve.verify_cost['8']:.2f}, "
               f"c(0.5) {costs.measured.draft_cost['0.5']:.2f}, LM head {costs.measured.lm_head_share:.0%}; "
               f"matrix products: {engine.kernel_info['backend']}[/dim]")
    return costs


def _time(r: _Run, cfg: GenerationConfig) -> dict[str, ContenderResult]:
    """The timed passes, each record flushed as it finishes; an interrupt keeps what finished."""
    req, ranks, names = r.req, r.plan.ranks, r.names
    partial: dict[str, ContenderResult] = {}
    with ExitStack() as stack, r.io.progress(disable=not ranks.lead) as bar:
        files = {n: stack.enter_context((r.records_dir / f"{n}.jsonl").open("a" if req.resume else "w", encoding="utf-8"))
                 for n in names}
        running = {n: Counter() for n in names}  # new tokens and seconds so far, per contender
        task = bar.add_task("bench", total=len(r.prompts) * len(r.contenders.contenders) * req.repeats, info="")
        bar.update(task, advance=sum(len(v) for v in r.done.values()))

        def on_record(name: str, rep: int, rec: OutputRecord) -> None:
            r.io.write_record(files[name], rec.to_dict())
            c = running[name]
            c.update(tokens=rec.new_tokens, seconds=rec.wall_time_s)
            bar.update(task, advance=1, info=f"{name} {c['tokens'] / max(c['seconds'], 1e-9):.1f} tok/s")

        try:
            # one process: pool another verify-curve reading before each pass (decoding/cost_store.py, refresh_curve)
            return run_bench(r.contenders.contenders, r.prompts, r.session.tokenizer, cfg, r.dev, req.warmup,
                             req.repeats, req.chat_template, on_record=on_record, done=r.done, partial=partial,
                             between_passes=None if ranks.many else lambda: refresh_curve(r.engine),
                             rank=ranks.rank if ranks.many else None)
        except KeyboardInterrupt:
            stack.close()
            _keep_interrupted(r, partial)
            raise


def _keep_interrupted(r: _Run, partial: dict[str, ContenderResult]) -> None:
    """After an interrupt: results.json of the cells every contender finished, and the exit note."""
    ranks, c = r.plan.ranks, r.contenders
    kept = complete_cells(partial, r.prompts)
    note = f"records are in {r.records_dir}; the same command with --resume finishes the run"
    if ranks.many:  # torchrun stops every rank when one fails; rank 0 alone cannot summarize the run
        r.io.set_exit_note(f"{ranks}: {note}")
        return
    if kept is not None:
        ref = REFERENCE if REFERENCE in kept else None
        base = BASELINE if BASELINE in kept else None
        summary = summarize(kept, ref, base, c.descriptions, c.offline, num_layers=r.engine.num_layers)
        doc = document(summary, setup={**r.plan.source, "complete": False, "command": r.io.invocation,
                                       "decoding": r.plan.decoding},
                       environment=environment_info(r.dev, r.engine.dtype), model={"name": model_name(r.session.model)},
                       reference=ref, baseline=base, files={})
        atomic_write(r.req.output_dir / "results.json", lambda f: f.write((dumps(doc, indent=2) + "\n").encode()))
        note = f"results.json holds the prompts every contender finished (marked incomplete); {note}"
    r.io.set_exit_note(note)


def _gather(r: _Run, results: dict[str, ContenderResult]) -> bool:
    """torchrun: rank 0 gathers every rank's passes and merges them in the suite's order; False on the other ranks."""
    ranks = r.plan.ranks
    parts = rk.gather(ranks, {n: {"repeats": res.repeats, "peak_rss_mb": res.peak_rss_mb, "peak_cuda_mb": res.peak_cuda_mb}
                              for n, res in results.items()})
    rk.close(ranks)
    if not ranks.lead:
        return False
    for n, res in results.items():
        res.repeats = rk.merge_repeats([part[n]["repeats"] for part in parts], [p.id for p in r.plan.prompts])
        for k in ("peak_rss_mb", "peak_cuda_mb"):
            setattr(res, k, max((v for part in parts if (v := part[n][k]) is not None), default=None))
        write_jsonl(r.req.output_dir / "records" / f"{n}.jsonl",
                    (rec.to_dict() for passed in res.repeats for rec in passed), r.io.write_record)
    r.prompts = r.plan.prompts
    return True


def _finish(r: _Run, results: dict[str, ContenderResult], engine_costs: prof.EngineCosts | None) -> BenchOutcome:
    """results.json, the answers and the plots."""
    req, plan, engine, mdl, c = r.req, r.plan, r.engine, r.session.model, r.contenders
    ref = REFERENCE if REFERENCE in results else None
    base = BASELINE if BASELINE in results else None
    summary = summarize(results, ref, base, c.descriptions, c.offline, num_layers=engine.num_layers)
    for n, m in summary.items():
        m.artifacts = c.artifacts.get(n, {})
    setup = {**plan.source, "prompts": len(r.prompts), "categories": dict(Counter(p.category or "all" for p in plan.prompts)),
             "max_new_tokens": req.max_new_tokens, "warmup": req.warmup, "repeats": req.repeats,
             "decoding": plan.decoding, "batch_size": 1,
             # whether the prompts were wrapped in a chat template (asked, and the tokenizer has one)
             "chat_template": uses_chat_template(r.session.tokenizer, req.chat_template),
             "chat_template_asked": req.chat_template, "seed": req.seed,
             "command": r.io.invocation, "complete": True, "early_exit_layer": req.early_exit_layer,
             "assistant_model": req.assistant_model, "ranks": plan.ranks.world}
    model_info = {"name": model_name(mdl), "architecture": mdl.config.model_type, "num_layers": engine.num_layers,
                  "fingerprint": r.session.fingerprint, "parameters": r.session.parameters,
                  "startup": r.startup}
    out = req.output_dir
    file_map: dict[str, Any] = {"results": str(out / "results.json"),
                                "records": {n: str(out / "records" / f"{n}.jsonl") for n in r.names},
                                "answers": {n: str(out / "answers" / f"{n}.jsonl") for n in results}}
    for n, res in results.items():
        write_jsonl(file_map["answers"][n], spec_bench_answers(res.records, f"{model_name(mdl)}-{n}"), r.io.write_record)
    if req.plot:
        file_map["plots"] = make_plots(results, summary, engine.num_layers, out, ref, c.built)
    doc = document(summary, setup=setup, environment=environment_info(r.dev, engine.dtype), model=model_info,
                   reference=ref, baseline=base, files=file_map)
    if engine_costs is not None:  # the curve the last pass's planners read (pooled over the passes), serialized here
        engine_costs = engine_costs.with_curve(prof.curve_fields(curve_for(engine)))
    doc["engine_costs"] = None if engine_costs is None else engine_costs.to_json()
    if engine.static is not None:  # GPU: the fixed-shape forwards (graphs captured, replays, eager fallbacks)
        doc["fixed_forwards"] = engine.static.describe()
    atomic_write(out / "results.json", lambda f: f.write((dumps(doc, indent=2) + "\n").encode()))
    title = (f"selfspec bench: {plan.source.get('suite') or plan.source.get('prompt_file')}, {count(len(r.prompts), 'prompt')} x "
             f"{count(req.max_new_tokens, 'token')}, {r.dev}, {str(engine.dtype).replace('torch.', '')}, {plan.decoding}, "
             f"median of {req.repeats} pass{'es' if req.repeats > 1 else ''}")
    return BenchOutcome(summary, doc, title, ref, base)


def write_jsonl(path: Path | str, rows: Iterable[JsonObject], write_record: Callable[[IO[str], JsonObject], None]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            write_record(f, row)


def make_plots(results: dict[str, ContenderResult], summary: dict[str, MethodSummary], num_layers: int,
               out: Path, ref: str | None, built: dict[str, list[Method]]) -> dict[str, str]:
    logs = {n: step_log(r.records).accept_lengths for n, r in results.items()
            if summary[n].overall.acceptance_rate is not None}
    made = {"speedup_by_category": plots.speedup_by_category(summary, out / "speedup_by_category.png", reference=ref)
            if ref else None,
            "accept_lengths": plots.accept_length_histogram(logs, out / "accept_lengths.png")}
    for n, methods in built.items():
        history = (methods[-1].search_history() if methods else None) or []  # no search: no plot
        title = f"{n}: skipped sublayers over optimization steps (last pass)"
        made[f"{n}_skip_sets"] = plots.swift_heatmap(history, num_layers, out / f"{n}_skip_sets.png", title=title)
    return {name: str(p) for name, p in made.items() if p}  # a plot with nothing to show is not written
