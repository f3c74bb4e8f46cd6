"""What every decoding method provides: a name, a frozen config, typed artifacts, a drafter and its policy.

A method *has* a :class:`~selfspec_cli.decoding.driver.Drafter` (``drafter``: the four verbs the
driver calls) and that drafter's :class:`~selfspec_cli.decoding.driver.DraftPolicy` (``policy``:
how long to draft, fed by the cost model); ``generate`` runs the shared driver on them. A method
is never a drafter itself. :meth:`Method.build` makes both from the method's ``Config``
dataclass and the artifacts that config names. A layer-skip method (:class:`LayerSkipMethod`)
declares its parts as typed fields (:class:`~selfspec_cli.decoding.stack.DraftParts`: a skip
source, draft settings, and the :class:`DraftInputs` its config resolves, weights, vocabulary
and the composed n-gram branch), and :func:`~selfspec_cli.decoding.stack.assemble` builds its
stack. Config fields carry ``help`` metadata, from which the CLI makes its options; validation
errors name fields (:class:`FieldError`). Invariant: building a method measures what its policy
plans with before any decode (docs/design.md, "Drafters and policies").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from collections.abc import Callable, Mapping

from ..config import GenerationConfig
from ..decoding.driver import UNPLANNED, Drafter, DraftPolicy, Plain, decode
from ..decoding.layer_skip import FixedSkips, LayerSkipDrafter, SkipPair, SkipSource, DraftSettings
from ..decoding.ngram import NgramLookup
from ..decoding.output import DecodeResult, DraftReport
from ..decoding.stack import DraftParts, NgramSource, assemble
from ..engine import Engine
from ..engine.quant import PRECISIONS, GGUFDraftError
from ..engine.target import QUANT_TARGETS
from ..errors import ConfigError, FieldError
from ..jsonio import JsonObject

DRAFT_PRECISIONS = ("auto", "target", *PRECISIONS)
# what --draft-precision auto picks (resolve_precision), said once for every method's help
AUTO_PRECISION_HELP = ("auto (on a GGUF model's block target, the default there: its own codes times int8 activations, "
                       "w4a8; on a float target converted from a GGUF: its blocks, gguf; else int8)")
# --draft-window N: StreamingLLM's four attention sinks plus the newest N keys. Off by default: on SmolLM2 a
# 256-key window cut the GGUF-block draft's one-token agreement from 1.00 to 0.65 (summarization, 364-token
# prompt) and 0.81 (rag, 779) while saving 0.13 of a step at 1500 tokens (docs/engine.md, "Long contexts")
DRAFT_SINKS, DRAFT_WINDOW = 4, 0


def resolve_precision(engine: Engine, precision: str, *, strict: bool = True) -> str | None:
    """The draft weights ``precision`` names (None: the target's own). ``auto``: on a block target,
    its blocks with int8 activations (``w4a8``); else the GGUF's
    own blocks when the fp32 target was dequantized from them (the draft then computes with
    the target's very weights), else int8 per channel; the target's weights when the CPU
    kernel is unavailable (a quantized draft without it would be slower than the target).
    An explicit precision that cannot be had is refused (``strict``) or resolved as ``auto``
    (a precision read from an artifact, which the user did not ask for)."""
    if precision == "target" or precision == engine.target_precision:  # a copy at the target's own precision is it
        return None
    if precision == "auto" or (not strict and engine.kernel_info["backend"] != "small_gemm"):
        if engine.kernel_info["backend"] != "small_gemm":
            return None
        if engine.target_precision in QUANT_TARGETS:  # the file's own blocks with int8 activations (W4A8)
            return "w4a8"
        try:
            engine.quantized("gguf")
            return "gguf"
        except GGUFDraftError:
            return "int8"
    try:
        engine.quantized(precision)
    except GGUFDraftError as exc:
        if not strict:
            return resolve_precision(engine, "auto")
        raise ConfigError(f"--draft-precision {precision} needs the model's GGUF blocks, and {exc}; "
                          "use --draft-precision int8 or auto") from None
    return precision


def method_precision(engine: Engine, asked: str, calibrated: str | None) -> str | None:
    """The draft weights of a layer-skip method: what ``--draft-precision`` asked for, except
    that ``auto`` follows the precision its skip set was calibrated with (``calibrated``) when
    this engine can have it (else ``auto``'s own choice)."""
    if asked == "auto" and calibrated:
        got = resolve_precision(engine, calibrated, strict=False)
        # a set calibrated on a quantized copy that is this engine's target: auto's draft weights instead
        return resolve_precision(engine, "auto") if got is None and calibrated != "target" else got
    return resolve_precision(engine, asked)


def option(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A config field that the CLI exposes as ``--flag`` (default: the field name)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True, slots=True)
class NoConfig:
    """A method without options."""


@dataclass(frozen=True, slots=True)
class SearchPoint:
    """One candidate an online skip-set search evaluated (SWIFT, methods/swift.py): its optimization step, the
    skipped (attention, MLP) layers, its matchness, whether Bayesian optimization proposed it, whether it became
    the best set, and the skip ratio then."""

    step: int
    skip: tuple[list[int], list[int]]
    score: float
    bo: bool
    best: bool
    ratio: float


class Method:
    """A decoding method bound to one engine: its config, its artifacts' offline cost, and the
    drafter the driver runs with its policy (``drafter``, ``policy``; by default the drafter that
    never drafts, plain decoding). ``lossless`` methods return exactly what plain decoding returns
    (greedy) or sample exactly the target's processed distribution (sampling)."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    lossless: ClassVar[bool] = True
    greedy_only: ClassVar[bool] = False  # refuses --temperature > 0 (the CLI says so before loading the model)

    def __init__(self, engine: Engine, tokenizer: Any = None, config: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or self.Config()
        self.offline_parts: list[OfflinePart] = []  # what the method's artifacts cost offline
        self.drafter: Drafter = Plain()
        self.policy: DraftPolicy = UNPLANNED

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig,
                 on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
        return decode(self.engine, self.tokenizer, self.drafter, prompt_ids, cfg, on_tokens, policy=self.policy)

    def describe(self) -> DraftReport:
        """What the drafter reports (its :meth:`~selfspec_cli.decoding.driver.Drafter.end`), also between decodes."""
        return self.drafter.end()

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: Any = None) -> Method:
        """The method from its config, loading the artifacts the config names (or the
        model's defaults). Methods with artifacts override this."""
        return cls(engine, tokenizer, config or cls.Config())

    def search_history(self) -> list[SearchPoint] | None:
        """Candidates an online search evaluated (SWIFT), for plots; None for other methods."""
        return None

    def offline_info(self) -> OfflineInfo | None:
        """Offline time behind this method's artifacts (``selfspec bench`` reports it), or None."""
        parts = tuple(p for p in self.offline_parts if p.seconds is not None)
        return OfflineInfo(parts) if parts else None


@dataclass(frozen=True, slots=True)
class OfflinePart:
    """What one of a method's artifacts cost offline, from its manifest: ``kind`` says which fields its JSON holds
    (``calibration``: what, seconds, trials, created; ``training``: what, seconds, created; ``search``: what,
    seconds), as results.json has always written them."""

    what: str
    seconds: float | None
    kind: Literal["calibration", "training", "search"] = "search"
    trials: int | None = None
    created: str | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"what": self.what, "seconds": self.seconds}
        if self.kind == "calibration":
            out["trials"] = self.trials
        if self.kind != "search":
            out["created"] = self.created
        return out


@dataclass(frozen=True, slots=True)
class OfflineInfo:
    """A method's offline time: its parts, their names joined and their seconds summed."""

    parts: tuple[OfflinePart, ...]

    @property
    def seconds(self) -> float:
        return round(sum(p.seconds or 0.0 for p in self.parts), 1)

    def to_json(self) -> JsonObject:
        return {"what": " + ".join(p.what for p in self.parts), "seconds": self.seconds,
                "parts": [p.to_json() for p in self.parts]}


def training_cost(what: str, manifest: Mapping[str, object]) -> OfflinePart:
    """Seconds a trained artifact cost (data collection + training), from its manifest (a JSON document)."""
    tr = manifest.get("training")
    tr = tr if isinstance(tr, dict) else {}
    secs = [float(x) for x in (tr.get("collect_seconds"), tr.get("train_seconds")) if x is not None]
    created = manifest.get("created")
    return OfflinePart(what, round(sum(secs), 1) if secs else None, "training",
                       created=None if created is None else str(created))


def require(ok: bool, name: str, rule: str, value: Any) -> None:
    """Refuse config field ``name``'s ``value`` unless ``ok``: "<name> must be <rule>, got <value>"."""
    if not ok:
        raise FieldError(name, f"must be {rule}, got {value}")


def layer_list(text: str | tuple[int, ...] | None, name: str) -> tuple[int, ...] | None:
    """'1,3,5' -> (1, 3, 5); '' -> (); None -> None (for tuple-of-layer fields given as text)."""
    if text is None or isinstance(text, tuple):
        return text
    try:
        return tuple(int(x) for x in str(text).replace(" ", "").split(",") if x != "")
    except ValueError:
        raise FieldError(name, f"must be comma-separated layer ids such as 1,3,5; got '{text}'") from None


@dataclass(frozen=True)
class LayerSkipOptions:
    """Options every layer-skipping method shares."""

    max_draft: int = option(12, "most draft tokens per round")
    draft_threshold: float = option(0.6, "draft-exit confidence threshold (initial value when adaptive)")
    paper_drafting: bool = option(False, "draft as the paper does, without planning each round's draft length "
                                         "from measured costs and acceptance (can be slower than ar)")
    hybrid: bool = option(False, "hybrid drafts: merge the n-gram continuation of the context (prompt lookup) "
                                 "into each draft as a second branch of one tree, verified in one forward")
    draft_vocab: str = option("auto", "FR-Spec draft vocabulary: auto (this model's calibrated one when there is one, "
                                      "else the full vocabulary), full, or an artifact path (selfspec calibrate "
                                      "--method fr-spec)")
    draft_vocab_size: int | None = option(None, "draft over this many most frequent tokens (default: the size the "
                                                "calibration chose)")
    draft_window: int = option(DRAFT_WINDOW, f"drafts attend to the first {DRAFT_SINKS} tokens (attention sinks) and "
                                             "the newest this many only, as StreamingLLM and MagicDec drafts do (0, "
                                             "the default: the whole context; ignored with --paper-drafting); "
                                             "verification always attends to everything")
    draft_precision: str = option("auto", f"the draft's weights: {AUTO_PRECISION_HELP}, int8 (per channel), int8-g32, "
                                          "gguf, w4a8, or target (the target's own weights); verification always uses "
                                          "the target's")

    def __post_init__(self) -> None:
        require(self.max_draft >= 1, "max_draft", ">= 1", self.max_draft)
        require(0 <= self.draft_threshold <= 1, "draft_threshold", "in [0, 1]", self.draft_threshold)
        require(self.draft_window >= 0, "draft_window", ">= 0", self.draft_window)
        require(self.draft_precision in DRAFT_PRECISIONS, "draft_precision", f"one of {', '.join(DRAFT_PRECISIONS)}",
                self.draft_precision)

    def settings(self, **kw: Any) -> DraftSettings:
        """How this method's drafts are made and verified (``kw``: the method's own, e.g. SWIFT's tree)."""
        window = None if self.paper_drafting or not self.draft_window else (DRAFT_SINKS, self.draft_window)
        return DraftSettings(max_draft=self.max_draft, threshold=self.draft_threshold, cost_aware=not self.paper_drafting,
                             kv_window=window, **kw)


@dataclass(frozen=True, eq=False)
class DraftInputs:
    """What a layer-skip method's config resolves on an engine (:meth:`LayerSkipMethod.draft_inputs`):
    the draft weights (None: the target's own), the draft vocabulary's token ids (None: all) and
    the n-gram branch of hybrid drafts (None: no branch)."""

    weights: str | None = None
    vocab: Any = None  # torch.Tensor | None
    ngram: NgramSource | None = None


def hybrid_branch() -> NgramLookup:
    """The n-gram branch that a layer-skip method merges into its hybrid drafts: prompt lookup's lookup
    with its defaults (decoding/ngram.py), composed in."""
    return NgramLookup()


class LayerSkipMethod(Method):
    """A method that drafts with the target's own layers: it declares a skip source
    (:meth:`skip_source`) and draft settings (:meth:`draft_settings`); its weights, vocabulary
    and n-gram branch (:class:`DraftInputs`) come from :meth:`build` (the config's
    ``draft_precision``, ``draft_vocab`` and ``hybrid``) or are given; the typed
    :class:`~selfspec_cli.decoding.stack.DraftParts` are ``parts``, and
    :func:`~selfspec_cli.decoding.stack.assemble` builds the stack: ``drafter``, ``policy``, and
    ``configuration`` (the drafter of the declared skip set). ``draft`` overrides the config's
    draft settings (e.g. tree verification)."""

    Config: ClassVar[type] = LayerSkipOptions

    def __init__(self, engine: Engine, tokenizer: Any = None, config: Any = None, draft: DraftSettings | None = None, *,
                 inputs: DraftInputs = DraftInputs(), weigh_full_depth: bool = True) -> None:
        super().__init__(engine, tokenizer, config)
        self.weights = inputs.weights
        self.skips = self.skip_source()
        self.parts = DraftParts(draft or self.draft_settings(), self.skips, inputs.weights, inputs.vocab, inputs.ngram,
                                weigh_full_depth)
        stack = assemble(engine, tokenizer, self.parts)
        self.drafter, self.policy = stack.drafter, stack.policy
        self.configuration: LayerSkipDrafter = stack.configuration

    def skip_source(self) -> SkipSource:
        """What chooses this method's skip set (none: all layers)."""
        return FixedSkips()

    def draft_settings(self) -> DraftSettings:
        return self.config.settings()

    def skip_sets(self) -> SkipPair:
        return self.skips.sets()

    @classmethod
    def draft_inputs(cls, engine: Engine, tokenizer: Any, config: Any, calibrated: str | None = None) -> DraftInputs:
        """The config's draft weights (``calibrated``: the precision a skip set was calibrated with),
        vocabulary and n-gram branch."""
        from . import fr_spec

        weights = method_precision(engine, config.draft_precision, calibrated)
        vocab = fr_spec.draft_vocab(engine, weights, config.draft_vocab, config.draft_vocab_size)
        return DraftInputs(weights, vocab, hybrid_branch() if config.hybrid else None)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: Any = None) -> Method:
        config = config or cls.Config()
        return cls(engine, tokenizer, config, inputs=cls.draft_inputs(engine, tokenizer, config))
