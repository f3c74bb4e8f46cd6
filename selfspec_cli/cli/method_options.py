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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import typer

from ..errors import ConfigError, FieldError
from ..methods import METHODS


@dataclass
class FlagSpec:
    name: str  # the field name (and the Python parameter)
    flag: str
    kind: Any  # the CLI type
    help: str
    defaults: dict[str, Any] = field(default_factory=dict)  # method -> its default


def _cli_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if typing.get_origin(base) is tuple:
        return str  # comma-separated layer ids, parsed by the config
    return base


def flag_specs() -> dict[str, FlagSpec]:
    specs: dict[str, FlagSpec] = {}
    for mname, cls in METHODS.items():
        hints = typing.get_type_hints(cls.Config)
        for f in dataclasses.fields(cls.Config):
            if "help" not in f.metadata:
                continue
            spec = specs.get(f.name)
            if spec is None:
                flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                spec = specs[f.name] = FlagSpec(f.name, flag, _cli_type(hints[f.name]), f.metadata["help"])
            spec.defaults[mname] = f.default
    return specs


def _help(spec: FlagSpec) -> str:
    defaults = {d for d in map(repr, spec.defaults.values())}
    if spec.kind is bool or spec.defaults == {m: None for m in spec.defaults}:
        tail = ""
    elif len(defaults) == 1:
        tail = f" (default {next(iter(spec.defaults.values()))})"
    else:
        tail = " (default " + ", ".join(f"{m} {d}" for m, d in spec.defaults.items()) + ")"
    return f"{', '.join(spec.defaults)}: {spec.help}{tail}."


def with_method_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one keyword parameter per method option to ``func``'s signature (``func``
    takes them as ``**method_options``)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    annotations = dict(typing.get_type_hints(func))
    for spec in flag_specs().values():
        kind = bool if spec.kind is bool else Optional[spec.kind]
        default = typer.Option(False if spec.kind is bool else None, spec.flag, help=_help(spec))
        params.append(inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind))
        annotations[spec.name] = kind
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    func.__annotations__ = annotations
    return func


def given_options(ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The method options the command line set (not left at their defaults)."""
    out = {}
    for name, value in values.items():
        src = ctx.get_parameter_source(name)  # typer may bundle its own click: compare by name
        if src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP"):
            out[name] = value
    return out


def flag_error(exc: FieldError) -> ConfigError:
    """A field's validation error, worded with the CLI's flags."""
    specs = flag_specs()
    flags = "/".join(specs[f].flag if f in specs else f for f in exc.field.split("/"))
    return ConfigError(f"{flags} {exc.detail}")


def method_config(method: str, given: dict[str, Any], **fixed: Any) -> Any:
    """``method``'s config from the options given; ``fixed`` fields (e.g. the run's seed)
    apply where the config has them."""
    cls = METHODS[method].Config
    names = {f.name for f in dataclasses.fields(cls)}
    specs = flag_specs()
    for name in given:
        if name not in names:
            users = " / ".join(specs[name].defaults)
            raise ConfigError(f"{specs[name].flag} is an option of --method {users}, not of '{method}'; "
                              "drop it or choose one of those methods")
    values = {**{k: v for k, v in fixed.items() if k in names}, **given}
    try:
        return cls(**values)
    except FieldError as exc:
        raise flag_error(exc) from None
