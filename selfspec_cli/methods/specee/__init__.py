"""SpecEE: speculative early exiting (Xu et al., ISCA 2025) in autoregressive decoding.
LOSSY: an exited token is emitted without running the deeper layers, so the output
can differ from plain decoding (``lossless = False``; measure it with ``evaluate``).

Per input token ``x`` at position ``p``:

1. run the layers up to the drafter layer ``k0``; the drafter is the shallowest
   trained AdaDecode head (one head evaluation, about the cost of one LM-head
   GEMV) and its top-4 are the *speculative tokens* for the next position — no
   separate draft model (the paper uses an EAGLE head, which we do not have);
2. at every *scheduled* predictor layer ``l`` (>= k0, <= L-2) build the 12 features
   of :func:`~.predictor.specee_features` from the normalised state
   at ``l`` and at ``l - 1`` (computed the same way as in training: the change is
   always against the immediately preceding layer, never against the previous
   *scheduled* layer, which is the reference code's train/inference mismatch);
3. if the layer's predictor fires (sigmoid > threshold), verify against the full
   vocabulary: the argmax of the LM head on the normalised state must be one of the
   speculative tokens; if so, exit and emit that argmax;
4. otherwise continue; at the last layer emit the final argmax.

Scheduling (paper §5.3): the offline subset (``selfspec calibrate --method specee``)
united with the online window: each of the last ``online_window`` (5) exit layers
``x`` of this prompt adds ``x-2 .. x+2``. History is per prompt (the reference keeps
one global list forever).

KV of the skipped layers (``kv_mode``):

* ``empty`` — the paper's behaviour: an exited token writes no K/V in layers > l, so
  later tokens never see it there (per-layer cache lengths diverge);
* ``deferred`` — KV-preserving: the exited token's remaining layers run later,
  batched with the next token that reaches them (AdaDecode's deferral, without
  verification), so every layer's cache ends up as full decoding of this output
  would have made it. At most ``max_pending`` tokens wait.

``evaluate`` also runs a full-depth shadow decoder teacher-forced on the emitted
tokens, and reports the share of early exits that picked the token the full model
would have picked at that step, the share of all tokens that agree, and the share
of the output identical to plain greedy decoding up to the first divergence.

The package is the whole method: this module holds the method, its drafter and its artifacts
(:data:`EXIT_MLPS`, per layer ``k`` tensors ``layer{k}.w1`` ... ``layer{k}.b2``, the manifest
naming the drafter head; :data:`SCHEDULE`, the offline layer subset); :mod:`.predictor` is the
predictor's computation, :mod:`.train` (``selfspec train-heads --kind exit-mlp``) and
:mod:`.calibrate` (``selfspec calibrate --method specee``) its offline steps.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...artifacts import ArtifactSpec, load_layers
from ...config import GenerationConfig
from ...decoding.drafts import Decided, Draft, Round
from ...decoding.driver import Taps
from ...decoding.output import DecodeResult, DraftReport, optional
from ...decoding.state import DecodeState
from ...engine import NO_TAPS, Engine, ForwardOutput, ForwardTaps
from ...engine.runner import LAST_ROW
from ...errors import ArtifactError, ConfigError, FieldError
from ...loading import EXAMPLES_DIR
from ..adadecode import LowRankHead, head_logits, load_heads
from ..base import Method, OfflinePart, option, require, training_cost
from ..offline import OfflineStep
from .predictor import NUM_SPEC_TOKENS, ExitPredictor, exit_probability, spec_local, specee_features
from ...jsonio import JsonObject

EXIT_MLPS = ArtifactSpec(kind="specee-exit-mlp", folder="specee", what="SpecEE exit-predictor artifact",
                         make="selfspec train-heads --kind exit-mlp")
SCHEDULE = ArtifactSpec(kind="specee-schedule", folder="specee", suffix=".schedule.json", what="SpecEE schedule artifact",
                        make="selfspec calibrate --method specee", args=f" --prompt-file {EXAMPLES_DIR / 'calibration.jsonl'}")


@dataclass(frozen=True)
class TrainOptions:
    """The options only ``selfspec train-heads --kind exit-mlp`` takes (None: not given, its default)."""

    heads: Path | None = option(None, "the lm-heads artifact whose shallowest head drafts (default: this model's, the one "
                                      "`selfspec train-heads --kind lm-heads` wrote under $SELFSPEC_HOME first, then the "
                                      "shipped one)")
    epochs: int | None = option(None, "training epochs (default 100)")
    lr: float | None = option(None, "Adam learning rate (default 1e-3)")
    batch_size: int | None = option(None, "rows per step (default 1024)")
    seed: int | None = option(None, "seed of initialisation and shuffling (default 0)")
    cache_dir: Path | None = option(None, "on-disk cache of the on-policy data (default <selfspec cache>/onpolicy; "
                                          "cache: $SELFSPEC_CACHE, else $SELFSPEC_HOME/cache, else ~/.cache/selfspec)")


TRAIN = OfflineStep("train-heads", "exit-mlp", EXIT_MLPS, "selfspec_cli.methods.specee.train", num_prompts=1000,
                    max_new_tokens=256, min_prompts=3, Options=TrainOptions)
CALIBRATE = OfflineStep("calibrate", "specee", SCHEDULE, "selfspec_cli.methods.specee.calibrate")


def load_exit_mlps(path: Path | None, model: Any) -> tuple[dict[int, ExitPredictor], JsonObject]:
    return load_layers(EXIT_MLPS, path, model, ExitPredictor, "predictor")


def load_schedule(path: Path | None, model: Any) -> tuple[list[int], JsonObject]:
    p, manifest, _ = SCHEDULE.load(path, model)
    layers = manifest.get("selected_layers")
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise SCHEDULE.error(p, model, "field 'selected_layers' must be a list of layer ids")
    return layers, manifest

def _check_made_together(heads: dict[str, Any], predictors: dict[str, Any], schedule: dict[str, Any]) -> None:
    """Refuse artifacts that were not made from each other: exit predictors learn the drafts of one heads
    artifact, and a schedule counts the exits of one predictor set with those heads (each manifest names the
    artifacts it was made from; each artifact is looked up on its own, the user's first, then the shipped)."""
    hid, pid = heads.get("artifact_id"), predictors.get("artifact_id")
    trained_on = (predictors.get("drafter") or {}).get("heads_artifact_id")
    if None not in (hid, trained_on) and trained_on != hid:
        raise ArtifactError(f"the exit predictors were trained on the drafts of another heads artifact ({trained_on}) "
                            f"than the heads loaded ({hid}); retrain them on these heads with `selfspec train-heads "
                            "--kind exit-mlp` (then `selfspec calibrate --method specee`), or pass --heads and "
                            "--exit-mlps that belong together")
    for key, have, what in (("exit_mlps_artifact_id", pid, "exit predictors"), ("heads_artifact_id", hid, "heads")):
        made_with = schedule.get(key)
        if None not in (have, made_with) and made_with != have:
            raise ArtifactError(f"the SpecEE schedule was made with other {what} ({made_with}) than those loaded "
                                f"({have}); remake it with `selfspec calibrate --method specee`, or pass "
                                "--specee-schedule one made with these")


KV_MODES = ("empty", "deferred")


@dataclass(frozen=True)
class SpecEEConfig:
    heads: Path | None = option(None, "trained heads artifact; specee drafts with the shallowest head (default: this "
                                      "model's, made by `selfspec train-heads --kind lm-heads`)")
    exit_mlps: Path | None = option(None, "exit-predictor artifact (default: this model's, made by `selfspec "
                                          "train-heads --kind exit-mlp`)")
    specee_schedule: Path | None = option(None, "offline schedule (default: this model's, made by `selfspec "
                                                "calibrate --method specee`)")
    specee_kv_mode: str = option("deferred", "'deferred' (skipped layers filled later, KV preserved) or 'empty' "
                                             "(the paper: deeper KV left empty)")
    specee_threshold: float | None = option(None, "one predictor decision threshold for every layer (default: the "
                                                  "artifact's per-layer thresholds; the paper uses 0.5)")
    specee_eval: bool = option(False, "also run the skipped layers (a full-depth shadow) and report early-exit "
                                      "agreement and the share identical to ar")
    online_window: int = 5  # N last exits (paper: 5)
    online_radius: int = 2  # +-2 layers (paper)
    max_pending: int = 5  # deferred mode: most tokens whose deep layers wait

    def __post_init__(self) -> None:
        if self.specee_kv_mode not in KV_MODES:
            raise FieldError("specee_kv_mode", f"must be one of {', '.join(KV_MODES)}; got '{self.specee_kv_mode}'")
        t = self.specee_threshold
        require(t is None or 0.0 <= t <= 1.0, "specee_threshold", "in [0, 1]", t)


class SpecEE(Method):
    """Has an :class:`ExitDrafter` (the decided tokens) and no draft policy: what exits is the
    predictors' and the schedule's, nothing is planned from measured costs."""

    name = "specee"
    lossless = False
    greedy_only = True
    description = "SpecEE (LOSSY): speculative early exit with per-layer predictors and two-level scheduling"
    Config = SpecEEConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: SpecEEConfig | None = None, *,
                 drafter_layer: int, drafter: LowRankHead, predictors: dict[int, ExitPredictor],
                 offline_layers: list[int], thresholds: dict[int, float] | None = None) -> None:
        """``drafter``: the head after layer ``drafter_layer`` whose top tokens are the speculative ones."""
        super().__init__(engine, tokenizer, config)
        L = engine.num_layers
        if not 0 <= drafter_layer < L - 1:
            raise ConfigError(f"drafter layer {drafter_layer} is out of range for a {L}-layer model")
        self.drafter = ExitDrafter(engine, self.config, drafter_layer, drafter, predictors, offline_layers, thresholds)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: SpecEEConfig | None = None) -> SpecEE:
        config = config or SpecEEConfig()
        loaded: list[Any] = []
        problems: list[str] = []
        for load, path in ((load_heads, config.heads), (load_exit_mlps, config.exit_mlps),
                           (load_schedule, config.specee_schedule)):
            try:
                loaded.append(load(path, engine.model))
            except ArtifactError as exc:  # report every missing or unusable artifact at once, in the order to make them
                problems.append(str(exc))
                loaded.append(None)
        if len(problems) == 1:
            raise ArtifactError(problems[0])
        if problems:
            raise ArtifactError(f"specee needs {len(problems)} artifacts that are missing or unusable (make them in this order): "
                                + " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
        (heads, hman), (predictors, pman), (schedule, sman) = loaded
        _check_made_together(hman, pman, sman)
        drafter = int(pman.get("drafter", {}).get("layer", min(heads)))
        if drafter not in heads:
            raise ArtifactError(f"the exit predictors draft with a head after layer {drafter}, which the heads artifact lacks; "
                                "retrain them with `selfspec train-heads --kind exit-mlp`")
        thresholds = {int(k): float(v) for k, v in (pman.get("thresholds") or {}).items()}
        method = cls(engine, tokenizer, config, drafter_layer=drafter, drafter=heads[drafter], predictors=predictors,
                     offline_layers=schedule, thresholds=thresholds)
        method.offline_parts += [training_cost("drafter-head training", hman), training_cost("exit-mlp training", pman),
                                 OfflinePart("specee calibration", sman.get("search_time_s"))]
        return method

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig, on_tokens: Any = None) -> DecodeResult:
        if not cfg.sampling.greedy:
            raise ConfigError("specee decodes greedily, as the paper does; use --temperature 0")
        return super().generate(prompt_ids, cfg, on_tokens)


@dataclass(frozen=True, slots=True)
class SpecEEEvaluation(DraftReport):
    """SpecEE's evaluation against the full-depth decoder (``--specee-evaluate``): early exits, the share of
    them and of all tokens that agreed (None: none counted), and the identical prefix (tokens, share)."""

    early_exits: int
    early_exit_agreement: float | None
    token_agreement: float | None
    identical_prefix_tokens: int
    identical_prefix_share: float


@dataclass(frozen=True, slots=True)
class SpecEEReport(DraftReport):
    """SpecEE's drafter's report: lossy, its KV mode, early exits per layer (only layers that exited), exit rate,
    mean layers run per token, the predictor's checks, verifications and failed ones, the drafter layer, the
    offline layers, the thresholds per layer, and its evaluation (absent without one)."""

    lossless: bool
    kv_mode: str
    early_exits: dict[str, int]
    exit_rate: float
    mean_layers_run_per_token: float
    predictor_checks: int
    verifications: int
    failed_verifications: int
    drafter_layer: int
    offline_layers: list[int]
    thresholds: dict[str, float]
    evaluation: SpecEEEvaluation | None = optional()


class ExitDrafter:
    """SpecEE's drafter: one round is the pending token's layers run segment by segment, exiting
    where a predictor fires and the full-vocabulary check agrees (see the module docstring); its
    draft is the decided token (:class:`~selfspec_cli.decoding.drafts.Decided`)."""

    taps = Taps()

    def __init__(self, engine: Engine, config: SpecEEConfig, drafter_layer: int, head: LowRankHead,
                 predictors: dict[int, ExitPredictor], offline_layers: list[int],
                 thresholds: dict[int, float] | None = None) -> None:
        L = engine.num_layers
        self.engine, self.config = engine, config
        self.lookahead = config.max_pending
        self.k0 = drafter_layer
        self.head = head.to(engine.device, engine.dtype)
        # the drafter head's LM head: the engine's, or the prepacked rows of its draft vocabulary (FR-Spec)
        self.head_lm = engine.lm_head if head.vocab is None else engine.subset_head(head.vocab)
        self.predictors = {l: p.to(engine.device, torch.float32) for l, p in predictors.items() if drafter_layer <= l <= L - 2}
        self.offline = frozenset(l for l in offline_layers if l in self.predictors)
        t = config.specee_threshold
        self.thresholds = {l: t if t is not None else (thresholds or {}).get(l, 0.5) for l in self.predictors}

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._history: deque[int] = deque(maxlen=self.config.online_window)  # per prompt (the reference keeps one forever)
        self._waiting: dict[int, torch.Tensor] = {}  # deferred mode: segment start -> rows waiting to enter it
        self._exits = {l: 0 for l in self.predictors}
        self._counts = {"rounds": 0, "predictor_checks": 0, "verifications": 0, "failed_verifications": 0, "layers_run": 0}
        self._shadow: DecodeState | None = None  # evaluation: a full-depth decoder fed the same tokens
        self._ev = {"exits": 0, "exits_agree": 0, "tokens": 0, "tokens_agree": 0, "first_divergence": None}
        if self.config.specee_eval:
            self._shadow = DecodeState(self.engine, state.committed[: state.prompt_len], max_new_tokens=64, lookahead=0,
                                       sampling=state.sampling, generator=None)
            self._shadow.prefill(logits_rows=None)

    def draft(self, state: DecodeState, budget: int) -> Draft:
        """One token: run the pending token's layers segment by segment, exit where a
        predictor fires and the full-vocabulary check agrees; the token is decided here."""
        eng, c, a = self.engine, self.config, self.engine.adapter
        L, k0, waiting, n = eng.num_layers, self.k0, self._waiting, self._counts
        ref = self._reference_token(state)
        r = c.online_radius  # scheduled: the offline subset and +-r layers around each of the last exits
        active = self.offline | {l for x in self._history for l in range(x - r, x + r + 1) if l in self.predictors}
        can_exit = sum(v.shape[0] for v in waiting.values()) < c.max_pending
        stops = {k0} | (active if can_exit else set())
        bounds = sorted({0, L} | {l + 1 for l in stops} | set(waiting))
        h = eng.embed(state.ids([state.pending]))
        prev_last: torch.Tensor | None = None  # current row after the previous segment's last layer
        exit_layer = None
        for s, e in zip(bounds[:-1], bounds[1:]):
            # 1) run a segment, joined by the rows waiting before it (deferred mode)
            if s in waiting:
                h = torch.cat([waiting.pop(s), h])
            l = e - 1
            want_prev = l in active and l - 1 >= max(k0, s)
            out = state.run(hidden=h, start=s, end=e, taps=ForwardTaps(hidden_at=(l - 1,)) if want_prev else NO_TAPS,
                            logits_rows=LAST_ROW if e == L else None)
            n["layers_run"] += e - s
            h_prev = out.hidden_at[l - 1][-1:] if want_prev else prev_last
            h = out.hidden
            prev_last = h[-1:]
            if e == L:
                break
            if l == k0:  # 2) the drafter: the shallowest head's top-4 are the speculative tokens
                spec = self.head.tokens(head_logits(prev_last, self.head, self.head_lm, a.rms_eps)[0]
                                        .topk(NUM_SPEC_TOKENS).indices)
                spec_rows = eng.head_rows(spec)  # (4, d) (also after a block target released the float table)
            if not can_exit or l not in active:
                continue
            # 3) predictor on [s, q, dq] at this layer; the change is against layer l - 1
            rows = prev_last if l == k0 else torch.cat([h_prev, prev_last])
            s_all = spec_local(rows, spec_rows, a.final_norm, a.rms_eps).float()  # (1 or 2, 4)
            feats = specee_features(s_all[-1:], None if l == k0 else s_all[:1])
            n["predictor_checks"] += 1
            if float(exit_probability(feats, self.predictors[l])) <= self.thresholds[l]:
                continue
            # 4) verification over the full vocabulary
            n["verifications"] += 1
            best = int(eng.final_logits(prev_last)[0].argmax())
            if best in spec.tolist():
                exit_layer, new_token = l, best
                break
            n["failed_verifications"] += 1
        n["rounds"] += 1
        self._history.append(L - 1 if exit_layer is None else exit_layer)
        if exit_layer is None:
            new_token = int(out.logits[0].argmax())
        else:
            self._note_exit(exit_layer, h)
        if ref is not None:
            self._score_against(ref, new_token, exit_layer, state)
        return Decided([new_token], full_depth=exit_layer is None)

    def _reference_token(self, state: DecodeState) -> int | None:
        """The full-depth decoder's token for the pending one (evaluation mode), None without evaluation."""
        if self._shadow is None:
            return None
        self._shadow.commit_decided([state.pending])
        return int(self._shadow.run(state.ids([state.pending])).logits[0].argmax())

    def _note_exit(self, exit_layer: int, h: torch.Tensor) -> None:
        """An exit after ``exit_layer`` counted; in deferred mode the token's row ``h`` waits before the next
        layer (the rest of its layers run with the next token reaching them). In empty mode layers > exit_layer
        never get this token's K/V."""
        self._exits[exit_layer] += 1
        if self.config.specee_kv_mode == "deferred":
            e, waiting = exit_layer + 1, self._waiting
            waiting[e] = torch.cat([waiting[e], h]) if e in waiting else h

    def _score_against(self, ref: int, new_token: int, exit_layer: int | None, state: DecodeState) -> None:
        """Evaluation: the round's token (and exit) counted as agreeing with the full-depth decoder's ``ref``
        or not, and the first divergence noted."""
        ev = self._ev
        for kind in ("tokens", "exits") if exit_layer is not None else ("tokens",):
            ev[kind] += 1
            ev[f"{kind}_agree"] += int(new_token == ref)
        if new_token != ref and ev["first_divergence"] is None:
            ev["first_divergence"] = len(state.output)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        pass

    def end(self) -> SpecEEReport:
        n = self._counts
        rounds = max(1, n["rounds"])
        evaluation = None
        if self._shadow is not None:
            ev = self._ev
            ev_len = ev["tokens"] + 1  # the prefill's token plus every evaluated round's
            # identical up to the first divergence (all of it when there is none)
            prefix = ev_len if ev["first_divergence"] is None else ev["first_divergence"]
            evaluation = SpecEEEvaluation(ev["exits"], ev["exits_agree"] / ev["exits"] if ev["exits"] else None,
                                          ev["tokens_agree"] / ev["tokens"] if ev["tokens"] else None,
                                          prefix, prefix / ev_len)
        return SpecEEReport(False, self.config.specee_kv_mode, {str(k): v for k, v in self._exits.items() if v},
                            sum(self._exits.values()) / rounds, n["layers_run"] / rounds,
                            n["predictor_checks"], n["verifications"], n["failed_verifications"],
                            self.k0, sorted(self.offline), {str(k): v for k, v in self.thresholds.items()}, evaluation)
