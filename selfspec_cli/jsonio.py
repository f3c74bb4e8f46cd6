"""Strict JSON out: every record, manifest and summary selfspec writes goes through :func:`dumps`.

Invariant: the text is standard JSON (RFC 8259). A non-finite float (NaN, +-inf: an
empty mean, a KL with no rows) is written as ``null``, never as the bare ``NaN`` or
``Infinity`` that Python's ``json`` emits by default and that ``jq`` and most
parsers refuse.

:data:`JsonObject` names, once, a JSON object whose keys are free-form, and is for documents written to or read
from JSON files and streams only: a manifest or store read from disk, a document written as it is built
(results.json, run.json, the profile's costs.json), Optuna's params and user attributes, config overrides from
the command line. A report with fixed keys that one module builds and another reads by key is a frozen
dataclass, serialized once where it is written: records, results and statistics (decoding/output.py,
bench/metrics.py, bench/report.py), a drafter's, policy's or skip source's report (``DraftReport``,
decoding/output.py), the store of engine costs (``CostRecord``, decoding/cost_store.py).
tests/test_layout.py refuses any other ``dict[str, Any]`` in the signature of a public function of decoding/,
methods/ or bench/, and ``JsonObject`` there outside a serializer (``to_json``, ``from_json``, ``to_dict``,
``from_dict``, ``as_dict``) and a short list of documented exceptions.
"""
from __future__ import annotations

import json
import math
from typing import Any

# a JSON object with free-form keys (see the module docstring): the one name such a value has in a signature
JsonObject = dict[str, Any]


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
