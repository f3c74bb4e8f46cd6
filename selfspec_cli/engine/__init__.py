"""The layer-execution engine shared by every decoding method.

It knows nothing about methods or the CLI: it runs a model's decoder layers over a
rollback-able KV cache with chosen skip sets, explicit positions and tree masks.
"""
from .adapter import SUPPORTED_MODEL_TYPES, ModelAdapter
from .cache import KVCache
from .runner import Engine, ForwardOutput
from .tree import tree_mask_from_parents

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelAdapter", "KVCache", "Engine", "ForwardOutput", "tree_mask_from_parents"]
