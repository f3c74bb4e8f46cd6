"""The registry of decoding methods: name -> method class (a frozen ``Config`` dataclass, and a
drafter with its policy built from it), and of their offline steps: (command, name) -> :class:`OfflineStep`.
Adding a method is one new file (or, with an offline step, one folder: docs/design.md, "A
method is one package") plus one entry here.

:func:`build` makes a method from its config, loading the typed artifacts the config
names (a layer-skip method's stack comes from the one assembly,
:func:`~selfspec_cli.decoding.stack.assemble`, its n-gram branch composed in there); :func:`config_for` makes a config from field values, refusing fields the
method does not have.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..engine import Engine
from ..errors import ConfigError
from ..jsonio import JsonObject
from . import adadecode, fr_spec, self_sd, specee
from .adadecode import AdaDecode
from .ar import AR
from .asd import ASD
from .auto import Auto
from .base import Method
from .offline import OfflineStep
from .pld import PromptLookup
from .self_sd import SelfSD
from .specee import SpecEE
from .specqd import SpecQD
from .swift import Swift

METHODS: dict[str, type[Method]] = {m.name: m for m in (AR, SelfSD, ASD, Swift, SpecQD, AdaDecode, SpecEE, PromptLookup,
                                                         Auto)}
OFFLINE: dict[tuple[str, str], OfflineStep] = {(s.command, s.name): s for s in (
    self_sd.CALIBRATE, specee.CALIBRATE, fr_spec.CALIBRATE, adadecode.TRAIN, specee.TRAIN)}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def config_for(name: str, values: JsonObject | None = None) -> Any:
    """``name``'s config with ``values`` for some of its fields (the rest default)."""
    cls = method_class(name).Config
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values or {}) - known):
        raise ConfigError(f"method '{name}' has no option {', '.join(unknown)}; its options: {', '.join(sorted(known)) or 'none'}")
    return cls(**(values or {}))


def build(name: str, engine: Engine, tokenizer: Any = None, config: Any = None, **values: Any) -> Method:
    """Method ``name`` on ``engine``: from ``config``, or from field ``values``."""
    if config is not None and values:
        raise ConfigError("pass a config or field values, not both")
    config = config if config is not None else config_for(name, values)
    return method_class(name).build(engine, tokenizer, config)


__all__ = ["METHODS", "OFFLINE", "Method", "AR", "SelfSD", "ASD", "Swift", "AdaDecode", "SpecEE", "PromptLookup", "SpecQD", "Auto", "build", "config_for", "method_class"]
