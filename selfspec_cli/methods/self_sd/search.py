"""What Self-SD's skip-set search searches (Draft & Verify, Zhang et al., ACL 2024): :class:`SearchConfig`.

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

The parts, each entered once by a calibration: :mod:`.calibrate` (the offline step) builds a
:class:`~.study.CalibrationPlan` from its job and the :class:`~.measure.Candidates` that decode
and score every candidate, and hands both to :func:`~.study.run_calibration`; :mod:`.study`
runs the whole search (the study's setup, the starting points, one worker's loop, the best
trial, the confirmation: :func:`~.study.calibrate_self_sd`, which knows no job, no command line,
no decoder and no artifact) and returns a typed :class:`~.study.SelfSDCalibration`; the offline
step writes the artifact. This
module holds only the search's settings. Invariants: the search decodes
greedily (a sampling configuration is refused); two runs share a study only with the same
setup (model, prompts, tokens, passes, objective, draft settings, precisions, draft
vocabularies and the target's precision, whose costs the proxy reads; a study made before the setup
held it resumes on any); a worker that did not finish the study last returns no skip set (``writer``
False).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...decoding.layer_skip import DraftSettings
from ...errors import ConfigError
from . import DEFAULT_HEARTBEAT_S
from .measure import DEFAULT_DRAFT
from .study import describe

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
