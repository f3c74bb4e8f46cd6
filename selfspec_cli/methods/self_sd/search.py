"""Self-SD's skip-set search as one call: :func:`calibrate_self_sd` (Draft & Verify, Zhang et al., ACL 2024).

The paper searches, by Bayesian optimization, which of the 2L sublayers (L attention,
L MLP) the draft skips, maximizing measured decoding throughput on a few
calibration prompts. Here:

* search space: one categorical 0/1 parameter per sublayer, ``attn_<l>`` and
  ``mlp_<l>`` (free cardinality, first and last layers included, as in Self-SD), and,
  when more than one draft precision is searched, a categorical ``precision`` (the
  target's own weights, or a quantized copy: engine/quant.py): skip set and precision are
  searched together, the skip set on top of the quantized weights;
* objective (``proxy``, the default): each candidate decodes the prompts for real
  (:class:`selfspec_cli.methods.self_sd.SelfSD`, greedy, ``max_new_tokens`` per prompt),
  and its score is the predicted speedup :func:`~.measure.proxy_speedup`: tokens after the
  prefills over the rounds' cost in plain steps, ``k c + v(k + 1)`` per round, with ``c`` from
  weight bytes and ``v`` from the verify curve kept in the study; nothing in the score is
  timed per trial, so machine load cannot reorder candidates and trials from different
  machines compare. ``throughput`` (the paper's): tokens / wall seconds of the decode calls.
  Greedy Self-SD is lossless, so every trial produces the same tokens; mean accepted length
  M and acceptance rate are kept per trial (``user_attrs``);
* sampler: Optuna's multivariate TPE by default (``gp`` and ``random`` on request);
  see ``docs/calibrate.md`` for the measurements behind that choice;
* starting points: uniform SWIFT-style sets (interior layers at even spacing, both
  sublayers) at skip ratios 0.3 and 0.45 at every searched precision, and the empty set
  (full depth) at every quantized one (and at the target's own weights when its drafts
  score a draft vocabulary), are enqueued first (:func:`~.study.seed_points`);
* storage: an Optuna study in an SQLite file by default, or any storage Optuna shares
  between processes and machines (a database URL, a journal file: :mod:`.study`),
  worked on by one or many workers at once. Optuna commits each trial when it finishes,
  so a Ctrl-C loses at most the running trial, and a re-run with the same study resumes:
  ``n_trials`` counts COMPLETE trials, only the rest are run; a worker killed mid-trial
  is detected by heartbeat and its trial run again. The proxy's measured inputs (the
  verify curve, a quantized draft's full-depth cost) are measured by the first worker and
  kept in the study, so every worker scores trials with the same numbers;
* confirmation: after the search, the best set, the starting points and plain
  autoregressive decoding are measured again back to back, so the reported
  speedups compare numbers taken under the same machine load (the best trial's
  own value is biased upward: it is the maximum of noisy measurements). It reports; it
  does not choose: the search's best set is the result whatever one short re-measurement
  under the host's load says, so a finished study gives the same set every time. Where a
  starting point re-measured clearly faster (:data:`CONTRADICTED`), the log says so.

The parts: :mod:`.measure` decodes and scores the candidates, :mod:`.study` holds the
Optuna study and one worker's loop over it; this module joins them (the study's setup, the
starting points, the best trial, the confirmation) and knows no job, no command line and no
artifact: :mod:`.calibrate` is the offline step around it. Invariants: the search decodes
greedily (a sampling configuration is refused); two runs share a study only with the same
setup (model, prompts, tokens, passes, objective, draft settings, precisions, draft
vocabularies and the target's precision, whose costs the proxy reads; a study made before the setup
held it resumes on any); a worker that did not finish the study last returns no skip set (``writer``
False).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import GenerationConfig
from ...decoding.layer_skip import DraftSettings
from ...engine import Engine
from ...errors import ConfigError
from .measure import DEFAULT_DRAFT, Candidates
from .study import DEFAULT_HEARTBEAT_S, TrialReport, describe, run_search, seed_points, skip_sets_from_params

SAMPLERS = ("tpe", "gp", "random")
OBJECTIVES = ("proxy", "throughput")


@dataclass(frozen=True, slots=True)
class SearchConfig:
    """What to search and where the study lives (the CLI validates the rest before it loads the model)."""

    study_path: Path | None  # the SQLite file (None: not chosen yet; the offline step puts it beside --output)
    n_trials: int = 100  # COMPLETE trials wanted in the study, resumed ones included
    seed: int = 0
    sampler: str = "tpe"
    repeats: int = 1  # passes per measurement; per prompt the fastest counts
    objective: str = "proxy"  # "proxy" (timing-free, proxy_speedup) or "throughput" (measured tokens/s)
    draft: DraftSettings = DEFAULT_DRAFT
    precisions: tuple[str, ...] = ("target",)  # draft weights searched with the skip set (engine/quant.py)
    storage: str | None = None  # an Optuna storage (.study); None: the SQLite file study_path
    heartbeat_s: int = DEFAULT_HEARTBEAT_S  # seconds between a running trial's heartbeats
    worker_index: int = 0  # this process among the --workers of one command (0: the one that writes)
    search_only: bool = False  # a helper worker: run trials, never the confirmation or the artifact
    worker: str = ""  # this worker's name in the study (the helpers of --workers share their first process's)

    def where(self) -> str:
        """The study as log lines and the artifact show it: the storage without a URL's credentials, or the file."""
        return describe(self.storage) if self.storage is not None else str(self.study_path)

    def __post_init__(self) -> None:
        for flag, value in (("trials", self.n_trials), ("repeats", self.repeats), ("heartbeat", self.heartbeat_s)):
            if value < 1:
                raise ConfigError(f"--{flag} must be >= 1, got {value}")
        for flag, value, choices in (("objective", self.objective, OBJECTIVES), ("sampler", self.sampler, SAMPLERS)):
            if value not in choices:
                raise ConfigError(f"unknown --{flag} '{value}'; choose one of: {', '.join(choices)}")


@dataclass(slots=True)
class SelfSDCalibration:
    """What :func:`calibrate_self_sd` found: the best set, the study's numbers and the confirmation."""

    num_layers: int
    skip_attn: frozenset[int]
    skip_mlp: frozenset[int]
    precision: str
    best_trial: int
    best_value: float  # tokens/s measured in the search
    best_attrs: dict[str, Any]
    trials: int  # COMPLETE trials in the study
    new_trials: int  # trials run by this call
    study_path: Path | str  # the SQLite file, or the --storage as given (the manifest hides its password)
    baseline: dict[str, Any] | None  # the better uniform set
    confirm: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> Measurement.as_dict()
    seed_points: list[dict[str, Any]] = field(default_factory=list)
    search_time_s: float | None = None  # wall time of every complete trial in the study (resumed runs included)
    writer: bool = True  # False: another worker finished the study last and writes the artifact
    draft_vocab: dict[str, int | str] = field(default_factory=dict)  # precision -> tokens its drafts score ("full": all)


CONTRADICTED = 1.10  # a starting point re-measured this much faster than the chosen set is worth a line


def faster_starting_point(confirm: dict[str, dict[str, Any]], seeds: Sequence[dict[str, Any]], finished: Sequence[Any],
                          num_layers: int, default_precision: str, margin: float = 1.0) -> tuple[str, Any] | None:
    """The starting point that re-measured fastest, if more than ``margin`` times as fast as the search's best set
    (``confirm["best"]``), with its best complete trial; else None. A starting point no trial completed is left out."""
    best = confirm["best"]["tokens_per_s"] * margin
    for s in sorted(seeds, key=lambda s: -confirm.get(s["name"], {}).get("tokens_per_s", float("-inf"))):
        if confirm.get(s["name"], {}).get("tokens_per_s", float("-inf")) <= best:
            return None
        want = (frozenset(s["skip_attn"]), frozenset(s["skip_mlp"]), s["precision"])
        trials = [t for t in finished if t.value is not None
                  and (*skip_sets_from_params(t.params, num_layers), t.params.get("precision", default_precision)) == want]
        if trials:
            return s["name"], max(trials, key=lambda t: t.value)
    return None


def calibrate_self_sd(
    engine: Engine,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    cfg: GenerationConfig,
    search: SearchConfig,
    *,
    fingerprint: str,
    prompts_sha: str,
    on_trial: Callable[[TrialReport], None] = lambda _report: None,
    log: Callable[[str], None] = lambda _msg: None,
    on_ready: Callable[[], None] = lambda: None,
    before_finish: Callable[[], None] = lambda: None,
) -> SelfSDCalibration:
    """Run (or resume, or join) the search until the study holds ``search.n_trials`` COMPLETE
    trials. ``on_ready``: called once the study holds its setup, starting points and measured
    costs (other workers may start then); ``before_finish``: called when the study is complete,
    before this worker decides whether it writes the result (wait for the other local workers)."""
    if not cfg.sampling.greedy:
        raise ConfigError("Self-SD calibration decodes greedily; pass a greedy GenerationConfig")
    L = engine.num_layers
    precisions = search.precisions
    # what must not change between runs that share a study (values would not compare)
    setup = {"kind": "self-sd-layers", "model_fingerprint": fingerprint, "num_layers": L,
             "max_new_tokens": cfg.max_new_tokens, "prompts_sha256": prompts_sha, "num_prompts": len(prompt_ids),
             "repeats": search.repeats, "objective": search.objective,
             "target_precision": engine.target_precision,  # the verify curve and the drafts' costs are this target's
             "draft": {k: getattr(search.draft, k) for k in ("max_draft", "threshold", "adaptive")}}
    if precisions != ("target",):
        setup["precisions"] = list(precisions)
    candidates = Candidates(engine, tokenizer, prompt_ids, cfg, precisions, draft=search.draft, repeats=search.repeats,
                            proxy=search.objective == "proxy")
    points = seed_points(L, precisions=precisions, cheap_head=candidates.cheap_heads())
    if candidates.cheap_heads():  # drafts over an FR-Spec vocabulary: their sizes
        setup["draft_vocab"] = candidates.vocab_sizes()
    found = run_search(search, setup, points, L, candidates.measure, candidates.inputs, candidates.warm_up,
                       on_trial=on_trial, log=log, on_ready=on_ready, before_finish=before_finish)
    finished, best_t, durations, seeds_in_study, writer, me = (found.finished, found.best, found.durations, found.seeds,
                                                               found.writer, found.worker)

    # the fields of both results: a writer's, and that of a worker that leaves the artifact to another
    common = dict(num_layers=L, draft_vocab=candidates.vocab_sizes(), best_trial=best_t.number,
                  best_value=float(best_t.value), best_attrs=dict(best_t.user_attrs), trials=len(finished),
                  new_trials=sum(t.user_attrs.get("worker") == me for t in finished),
                  study_path=search.storage if search.storage is not None else search.study_path)
    if not writer:
        return SelfSDCalibration(skip_attn=frozenset(), skip_mlp=frozenset(), precision=precisions[0],
                                 baseline=None, writer=False, **common)
    attn, mlp = skip_sets_from_params(best_t.params, L)
    best_p = best_t.params.get("precision", precisions[0])
    log("re-measuring the best set, the starting points and plain decoding back to back")
    confirm = candidates.confirm((attn, mlp, best_p), points)
    faster = faster_starting_point(confirm, seeds_in_study, finished, L, precisions[0], CONTRADICTED)
    if faster is not None:  # said, not acted on: one short timing must not pick the result (module docstring)
        name, t = faster
        log(f"[yellow]the starting point {name} (trial {t.number}) re-measured at "
            f"{confirm[name]['tokens_per_s']:.1f} tok/s, the chosen set at {confirm['best']['tokens_per_s']:.1f}: "
            f"the search's {'prediction' if search.objective == 'proxy' else 'timing'} and this re-measurement "
            "disagree; more prompts or tokens measure both better[/yellow]")
    # the better uniform set, by the back-to-back re-measurement
    uniform = [s for s in seeds_in_study if s["name"].startswith("uniform-")]  # the paper-style baselines
    base = max(uniform, key=lambda s: confirm[s["name"]]["tokens_per_s"], default=None)
    return SelfSDCalibration(skip_attn=attn, skip_mlp=mlp, precision=best_p, seed_points=seeds_in_study,
                             baseline=base and {**base, "confirm": confirm[base["name"]]}, confirm=confirm,
                             search_time_s=round(sum(durations), 3) if durations else None, **common)
