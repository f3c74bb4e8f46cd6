"""SWIFT: on-the-fly self-speculative decoding (Xia et al., ICLR 2025), arXiv:2410.06916.

The skipped-layer set is optimized *during* decoding, with no offline phase:

* optimization phase: start from uniform skipping (odd layers 1, 3, ..., L-3, attention
  and MLP); once the first ``gamma + 1`` generated tokens of a prompt are cached (the
  context window), every decoding round evaluates one candidate set: random search,
  except every ``beta``-th step a Gaussian-process (Matern 2.5) UCB suggestion. A
  candidate skips exactly ``k = int(2 (L - 2) r)`` sublayers among layers 1..L-2.
  Its *matchness* is one teacher-forced forward of the skipped model over the window,
  reusing the prompt's full-model K/V: the share of window tokens it predicts (argmax),
  over the draft's own weights (the quantized copy when the draft is quantized, so skip
  set and precision are searched together; with cost-aware drafting each round also
  weighs the quantized model at full depth against the skip set: decoding/layer_skip.py).
  The best candidate so far drafts. Optimization stops when matchness exceeds
  ``max_score``, after ``max_tolerance`` steps without improvement, or after
  ``max_steps``;
* state (best set, observations, step counter) is carried across the prompts of one
  run: a prompt file is an input stream. On a new prompt the best set is re-scored on
  the new window, so that candidates are always compared on the same context (the
  reference compares scores from different prompts);
* drafting stops early when draft confidence falls below ``epsilon`` (0.8), and
  verification is SWIFT's dynamic tree (top-10/5/3/1 candidates by confidence);
* the skip ratio ``r`` is lowered automatically (by ``ratio_step``) when the draft
  acceptance rate over the last ``acceptance_window`` rounds stays below
  ``acceptance_tolerance``; the paper describes this, its released code lacks it.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifacts import environment_info
from ..decoding.drafts import Round
from ..decoding.layer_skip import DraftSettings, SkipPair, SkipSource
from ..decoding.output import DraftReport
from ..decoding.state import DecodeState
from ..engine import Engine, ForwardOutput, Route
from ..errors import ConfigError
from .base import LayerSkipMethod, LayerSkipOptions, SearchPoint, option, require
from .self_sd import SKIP_SET, SkipSet


@dataclass(frozen=True)
class SwiftConfig(LayerSkipOptions):
    max_draft: int = option(25, "most draft tokens per round")
    draft_threshold: float = option(0.8, "draft-exit confidence threshold epsilon")
    skip_ratio: float = option(0.45, "share of sublayers skipped (lowered automatically when acceptance stays low)")
    context_window: int = option(32, "generated tokens used to score candidate skip sets (gamma)")
    tree_nodes: int | None = option(None, "most candidate nodes in one verification tree (default: no cap, the "
                                          "paper's GPU setting; on a CPU each verified row costs a few per cent of a step)")
    optimize_budget: float = option(0.01, "most share of decoding time the on-the-fly skip-set search may take "
                                          "(the paper: no limit, 1.0)")
    max_steps: int = 1000  # S
    bo_interval: int = 25  # beta
    max_score: float = 0.95
    max_tolerance: int = 300
    ucb_kappa: float = 2.5
    acceptance_tolerance: float = 0.7
    acceptance_window: int = 32
    ratio_step: float = 0.05
    min_ratio: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        LayerSkipOptions.__post_init__(self)
        require(0 < self.skip_ratio < 1, "skip_ratio", "in (0, 1)", self.skip_ratio)
        require(self.context_window >= 2, "context_window", ">= 2", self.context_window)
        require(0 <= self.optimize_budget <= 1, "optimize_budget", "in [0, 1]", self.optimize_budget)
        require(self.tree_nodes is None or self.tree_nodes >= 1, "tree_nodes", ">= 1", self.tree_nodes)


class MaternGP:
    """Gaussian-process regression with a Matern (nu = 5/2) kernel of one length scale, observation
    noise ``alpha`` on the diagonal and standardized targets: what scikit-learn's
    ``GaussianProcessRegressor(kernel=Matern(nu=2.5), alpha=1e-2, normalize_y=True)`` computes, in
    NumPy. The length scale maximizes the log marginal likelihood over ``[1e-5, 1e5]`` (a grid in
    log space, then golden-section refinement around its best point; scikit-learn climbs from 1 with
    L-BFGS-B), so it is at least as likely as scikit-learn's. Written out because importing
    scikit-learn's regressor holds about 140 MB of libraries for the rest of a decoding process.
    tests/test_speculative.py checks it against scikit-learn."""

    LOG_BOUNDS = (np.log(1e-5), np.log(1e5))

    def __init__(self, alpha: float = 1e-2) -> None:
        self.alpha = alpha

    @staticmethod
    def kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
        d = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0)) / length * np.sqrt(5.0)
        return (1.0 + d + d * d / 3.0) * np.exp(-d)

    def _lml(self, log_length: float) -> float:
        k = self.kernel(self.x, self.x, float(np.exp(log_length))) + self.alpha * np.eye(len(self.x))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            return -np.inf
        a = np.linalg.solve(chol.T, np.linalg.solve(chol, self.yn))
        return float(-0.5 * self.yn @ a - np.log(np.diag(chol)).sum() - 0.5 * len(self.x) * np.log(2 * np.pi))

    def fit(self, x: np.ndarray, y: np.ndarray) -> MaternGP:
        self.x = np.asarray(x, dtype=float)
        y = np.asarray(y, dtype=float)
        self.y_mean, self.y_std = float(y.mean()), float(y.std())
        if self.y_std == 0.0:
            self.y_std = 1.0
        self.yn = (y - self.y_mean) / self.y_std
        lo, hi = self.LOG_BOUNDS
        grid = np.linspace(lo, hi, 101)
        vals = [self._lml(g) for g in grid]
        i = int(np.argmax(vals))
        a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
        ratio = (np.sqrt(5.0) - 1) / 2
        for _ in range(40):  # golden section on the bracket around the grid's best
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            if self._lml(c) >= self._lml(d):
                b = d
            else:
                a = c
        best = max((grid[i], (a + b) / 2), key=self._lml)
        self.length = float(np.exp(best))
        k = self.kernel(self.x, self.x, self.length) + self.alpha * np.eye(len(self.x))
        self.chol = np.linalg.cholesky(k)
        self.weights = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, self.yn))
        return self

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation at the rows of ``x``, in the targets' units."""
        ks = self.kernel(np.asarray(x, dtype=float), self.x, self.length)
        v = np.linalg.solve(self.chol, ks.T)
        var = np.maximum(1.0 - (v * v).sum(0), 0.0)
        return ks @ self.weights * self.y_std + self.y_mean, np.sqrt(var) * self.y_std


class SwiftSearch(SkipSource):
    """SWIFT's skip set, searched while decoding (see the module docstring), scored over the
    draft's own ``weights`` (None: the target's)."""

    adapts = True

    def __init__(self, engine: Engine, config: SwiftConfig, weights: str | None) -> None:
        self.config, self.weights = config, weights
        L = engine.num_layers
        if L < 4:
            raise ConfigError(f"SWIFT needs at least 4 layers (it never skips the first or last), got {L}")
        # candidate pool: attention then MLP sublayers of layers 1..L-2
        self.pool: list[tuple[str, int]] = [("attn", l) for l in range(1, L - 1)] + [("mlp", l) for l in range(1, L - 1)]
        self.rng = random.Random(self.config.seed)
        self.ratio = self.config.skip_ratio
        # uniform start: odd layers 1, 3, ..., L-3 (pool indices come out sorted)
        self.best: tuple[int, ...] = tuple(i for i, (_, l) in enumerate(self.pool) if l % 2 == 1 and l <= L - 3)
        self.best_score, self.since_improved, self.optimizing = -1.0, 0, True
        self.step = 0
        self.observations: list[tuple[tuple[int, ...], float]] = []
        self.history: list[SearchPoint] = []  # every evaluated candidate, for plots
        # (accepted, drafted) of the last drafting rounds since the ratio last changed; it fills no faster
        # than rounds pass, so a full window also means acceptance_window rounds at this ratio
        self._acceptance: deque[tuple[int, int]] = deque(maxlen=self.config.acceptance_window)
        self.optimize_s = 0.0  # search time of the current prompt
        self._spent_s = self._decoded_s = 0.0  # search and decoding time over the run (the budget)
        self._search_step_s = 0.0  # the last search step's cost

    # -- skip sets ---------------------------------------------------------
    @property
    def k(self) -> int:
        return max(1, int(len(self.pool) * self.ratio))

    def _as_sets(self, idx: tuple[int, ...]) -> tuple[frozenset[int], frozenset[int]]:
        return tuple(frozenset(self.pool[i][1] for i in idx if self.pool[i][0] == kind) for kind in ("attn", "mlp"))

    def sets(self) -> SkipPair:
        return self._as_sets(self.best)

    # -- optimization ------------------------------------------------------
    def _score(self, state: DecodeState, idx: tuple[int, ...]) -> float:
        """Matchness: teacher-forced skipped forward over the context window (the first
        ``gamma + 1`` generated tokens), in scratch slots."""
        attn, mlp = self._as_sets(idx)
        n = self.config.context_window + 1
        # over the weights the draft runs on: the skip set is searched on top of a quantized copy when there is one
        route = Route(skip_attn=attn, skip_mlp=mlp, weights=self.weights)
        logits = state.replay(state.prompt_len, n, route=route, logits_rows=slice(0, -1)).logits
        return float((logits.argmax(-1) == state.ids(state.output[1:n])).float().mean())

    def _random_candidate(self) -> tuple[int, ...]:
        return tuple(sorted(self.rng.sample(range(len(self.pool)), self.k)))

    def _bo_candidate(self) -> tuple[int, ...]:
        """GP-UCB over binary candidates with exactly k ones: random subsets plus
        one-swap neighbours of the best set (the acquisition is maximized over
        candidates that can actually be run, instead of rounding a continuous point)."""
        P = len(self.pool)
        obs = [(c, s) for c, s in self.observations if len(c) == self.k]
        if len(obs) < 3:
            return self._random_candidate()

        def onehot(c: tuple[int, ...]) -> np.ndarray:
            v = np.zeros(P)
            v[list(c)] = 1.0
            return v

        X = np.stack([onehot(c) for c, _ in obs])
        y = np.array([s for _, s in obs])
        self.rng.randrange(2**31)  # (the draw the regressor's seed took: the candidates' stream is unchanged)
        gp = MaternGP().fit(X, y)
        cands = {self._random_candidate() for _ in range(512)}
        best = list(self.best) if len(self.best) == self.k else list(self._random_candidate())
        cands |= {tuple(sorted([x for x in best if x != a] + [b])) for a in best for b in range(P) if b not in best}
        cands -= {c for c, _ in self.observations}
        if not cands:
            return self._random_candidate()
        cl = sorted(cands)
        mu, sd = gp.predict(np.stack([onehot(c) for c in cl]))
        return cl[int(np.argmax(mu + self.config.ucb_kappa * sd))]

    def _optimization_step(self, state: DecodeState) -> None:
        cfg = self.config
        self.step += 1
        use_bo = self.step % cfg.bo_interval == 0
        cand = self._bo_candidate() if use_bo else self._random_candidate()
        score = self._score(state, cand)
        self.observations.append((cand, score))
        improved = score > self.best_score
        attn, mlp = ([int(l) for l in sorted(s)] for s in self._as_sets(cand))
        self.history.append(SearchPoint(self.step, (attn, mlp), round(score, 4), use_bo, improved, round(self.ratio, 3)))
        if improved:
            self.best, self.best_score, self.since_improved = cand, score, 0
        else:
            self.since_improved += 1
        if self.best_score >= cfg.max_score or self.since_improved >= cfg.max_tolerance or self.step >= cfg.max_steps:
            self.optimizing = False

    def _maybe_lower_ratio(self) -> None:
        cfg = self.config
        if len(self._acceptance) < cfg.acceptance_window:
            return
        acc = sum(a for a, _ in self._acceptance) / max(1, sum(d for _, d in self._acceptance))
        if acc >= cfg.acceptance_tolerance or self.ratio - cfg.ratio_step < cfg.min_ratio:
            return
        self.ratio = round(self.ratio - cfg.ratio_step, 4)
        # keep the best set's most useful part: drop random members down to the new k, restart the search
        keep = list(self.best)
        self.rng.shuffle(keep)
        self.best = tuple(sorted(keep[: self.k]))
        self.best_score, self.since_improved, self.optimizing = -1.0, 0, True
        self._acceptance.clear()

    # -- hooks -------------------------------------------------------------
    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._windowed = False  # per prompt: the scoring window is cached
        self.optimize_s = 0.0
        self._last = time.perf_counter()

    def update(self, state: DecodeState, rnd: Round, own: bool) -> None:
        if own:  # the skip set's own rounds
            self._acceptance.append((len(rnd.verdict.accepted), rnd.draft.forwards))
        t0 = time.perf_counter()
        self._decoded_s += t0 - self._last
        # the search counts its own cost: it runs only while it stays within its share of decoding
        # time, counting the step it is about to take (one scoring costs about as much as the last)
        budget = self.config.optimize_budget
        within = budget > 0 and self._spent_s + self._search_step_s <= budget * self._decoded_s
        # the window's gamma + 1 tokens are cached (the newest output token is pending)
        new_window = not self._windowed and len(state.output) >= self.config.context_window + 2
        self._windowed |= new_window
        if self._windowed and self.optimizing and within:
            if new_window or self.best_score < 0:  # (re-)score the best set on this prompt's window
                self.best_score = self._score(state, self.best)
            self._optimization_step(state)
        self._maybe_lower_ratio()
        self._last = time.perf_counter()
        if self._last - t0 > 1e-3:  # a scoring ran: the cost of the next one
            self._search_step_s = self._last - t0
        self.optimize_s += self._last - t0
        self._spent_s += self._last - t0

    def describe(self) -> SwiftReport:
        return SwiftReport(round(self.optimize_s, 6),
                           SwiftPhase("optimization" if self.optimizing else "acceleration", self.step,
                                      round(self.best_score, 4), self.ratio))


@dataclass(frozen=True, slots=True)
class SwiftPhase(DraftReport):
    """Where SWIFT's search stands: its phase, optimization step, best matchness and skip ratio."""

    phase: str
    step: int
    best_matchness: float
    skip_ratio: float


@dataclass(frozen=True, slots=True)
class SwiftReport(DraftReport):
    """SWIFT's search in its drafter's report: the seconds it spent and where it stands."""

    optimize_s: float
    swift: SwiftPhase


class Swift(LayerSkipMethod):
    name = "swift"
    lossless = True
    description = "SWIFT: skip set optimized on the fly during decoding (random search + interval BO)"
    Config = SwiftConfig

    def skip_source(self) -> SkipSource:
        self.search = SwiftSearch(self.engine, self.config, self.weights)
        return self.search

    def draft_settings(self) -> DraftSettings:  # the paper's top-k per confidence bin, no adaptive threshold
        return self.config.settings(adaptive=False, tree=True, tree_max_nodes=self.config.tree_nodes)

    def search_history(self) -> list[SearchPoint]:
        return self.search.history

    def save_layers(self, path: str | Path) -> Path:
        """Write the best skip set found as a Self-SD artifact (``--method self-sd --layers``)."""
        search = self.search
        manifest = SkipSet(*self.skip_sets()).to_manifest(
            self.engine.model,
            objective={"name": "swift_matchness", "value": round(search.best_score, 4), "unit": "share of window tokens"},
            trials=search.step,
            search={"method": "swift", "skip_ratio": search.ratio, "context_window": self.config.context_window,
                    "bo_interval": self.config.bo_interval, "seed": self.config.seed,
                    "phase": "optimization" if search.optimizing else "acceleration"},
            environment=environment_info(self.engine.device, self.engine.dtype))
        return SKIP_SET.save(Path(path), self.engine.model, manifest)
