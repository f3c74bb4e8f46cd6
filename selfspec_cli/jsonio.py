"""Strict JSON out: every record, manifest and summary selfspec writes goes through :func:`dumps`.

Invariant: the text is standard JSON (RFC 8259). A non-finite float (NaN, +-inf: an
empty mean, a KL with no rows) is written as ``null``, never as the bare ``NaN`` or
``Infinity`` that Python's ``json`` emits by default and that ``jq`` and most
parsers refuse.
"""
from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kw)
