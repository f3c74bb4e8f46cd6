"""The layer-execution engine shared by every decoding method.

It knows nothing about methods or the CLI: it runs a model's decoder layers over a
rollback-able KV cache with explicit positions and tree masks, computing what a :class:`Route` names
(skip sets, a draft weights copy, a KV window, a subset head) and reporting what :class:`ForwardTaps` asks.
"""
from .adapter import SUPPORTED_MODEL_TYPES, ModelAdapter
from .cache import KVCache
from .route import NO_TAPS, TARGET, ForwardTaps, Route
from .runner import Engine, ForwardOutput
from .tree import tree_mask_from_parents

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelAdapter", "KVCache", "Engine", "ForwardOutput", "Route", "TARGET",
           "ForwardTaps", "NO_TAPS", "tree_mask_from_parents"]
