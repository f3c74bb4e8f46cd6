"""CLI options made from the methods' config dataclasses.

Every config field with ``help`` metadata (see :func:`selfspec_cli.methods.base.option`)
becomes one ``--flag`` of ``selfspec generate``; fields of the same name in several
methods share the flag. :func:`method_config` builds the chosen method's config from
the flags given, refuses flags of other methods, and turns a field's validation error
into a message that names the flag.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import typer

from ..config import GenerationConfig, SamplingConfig, check_choice, check_sampling_options, check_seed
from ..errors import ConfigError, FieldError
from ..methods import METHODS


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_fields() -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """field name -> (CLI type, help, {method: default}) over every method's config."""
    out: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for mname, cls in METHODS.items():
        hints = typing.get_type_hints(cls.Config)
        for f in (f for f in dataclasses.fields(cls.Config) if "help" in f.metadata):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            kind = str if typing.get_origin(args[0]) is tuple else args[0]  # layer lists are text: 1,3,5
            out.setdefault(f.name, (kind, f.metadata["help"], {}))[2][mname] = f.default
    return out


def _help(help: str, defaults: dict[str, Any]) -> str:
    values = set(map(repr, defaults.values()))
    if values == {"None"} or values <= {"False"}:
        tail = ""
    elif len(values) == 1:
        tail = f" (default {next(iter(defaults.values()))})"
    else:
        tail = " (default " + ", ".join(f"{m} {d}" for m, d in defaults.items()) + ")"
    return f"{', '.join(defaults)}: {help}{tail}."


def with_method_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one keyword parameter per method option to ``func`` (which takes ``**method_options``)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    annotations = dict(typing.get_type_hints(func))
    for name, (kind, help, defaults) in option_fields().items():
        annotations[name] = bool if kind is bool else Optional[kind]
        names = flag(name)
        if kind is bool and True in defaults.values():  # a switch some method has on: offer --no-x too
            names += "/--no-" + name.replace("_", "-")
        # the default is per method (in the help text): no single "[default: ...]" for the flag
        default = typer.Option(False if kind is bool else None, names, help=_help(help, defaults), show_default=False)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[name]))
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    func.__annotations__ = annotations
    return func


def given_options(ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The method options the command line set (not left at their defaults)."""
    # typer may bundle its own click: compare parameter sources by name
    return {n: v for n, v in values.items()
            if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


def flag_error(exc: FieldError) -> ConfigError:
    """A field's validation error, worded with the CLI's flags."""
    return ConfigError(f"{'/'.join(map(flag, exc.field.split('/')))} {exc.detail}")


def method_config(method: str, given: dict[str, Any], **fixed: Any) -> Any:
    """``method``'s config from the options given; ``fixed`` fields (e.g. the run's seed)
    apply where the config has them."""
    cls = METHODS[method].Config
    names = {f.name for f in dataclasses.fields(cls)}
    for name in given.keys() - names:
        raise ConfigError(f"{flag(name)} is an option of --method {' / '.join(option_fields()[name][2])}, not of '{method}'; "
                          "drop it or choose one of those methods")
    try:
        return cls(**{k: v for k, v in fixed.items() if k in names}, **given)
    except FieldError as exc:
        raise flag_error(exc) from None


def check_layer_ids(config: Any, num_layers: int | None) -> None:
    """Refuse inline skip-set layer ids (``--skip-attn``, ``--skip-mlp``) out of range for a
    ``num_layers``-layer model, before the model loads (the method checks them again when built)."""
    if num_layers is None:
        return
    ids = {i for name in ("skip_attn", "skip_mlp") for i in (getattr(config, name, None) or ())}
    if bad := sorted(i for i in ids if not 0 <= i < num_layers):
        raise flag_error(FieldError("skip_attn/skip_mlp", f"layer ids {bad} are out of range for a {num_layers}-layer "
                                                          f"model (valid: 0..{num_layers - 1})"))


@dataclass(frozen=True)
class MethodChoice:
    """The method a command decodes with, as its flags chose it: the name, its config (None: the method's
    defaults), the method options the command line set, and the generation config."""

    name: str
    config: Any
    generation: GenerationConfig
    lossless: bool
    given: dict[str, Any] = field(default_factory=dict)


def choose_method(method: str, seed: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  rule: str, stop: Sequence[str] = (), given: dict[str, Any] | None = None) -> MethodChoice:
    """``--method`` and the flags that configure it, checked in the commands' order before any loading: the
    name, ``--seed``'s range, the method's options (``given``: those the command line set; None: the method's
    defaults, no config made) and the generation config."""
    check_choice(method, METHODS, "--method")
    check_seed(seed)  # before the methods' configs take it
    config = None if given is None else method_config(method, given, seed=seed)  # validates before any loading
    cfg = generation_config(method, max_new_tokens, temperature, top_k, top_p, seed, rule, stop)
    return MethodChoice(method, config, cfg, METHODS[method].lossless, given or {})


def generation_config(method: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                       rule: str, stop: Sequence[str] = ()) -> GenerationConfig:
    """The flags' generation config, checked (a greedy-only method refuses sampling) before any loading
    (generate, chat)."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, rule=rule)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=tuple(stop))  # validates now
    check_sampling_options(sampling)
    if not sampling.greedy and METHODS[method].greedy_only:
        raise ConfigError(f"--method {method} decodes greedily only; pass --temperature 0 or choose another method")
    return cfg
