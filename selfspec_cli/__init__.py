"""selfspec: lossless self-speculative decoding for Hugging Face causal LMs."""
import os as _os

# OpenMP threads that wait at a barrier sleep instead of spinning. Must be in the
# environment before torch loads its OpenMP runtime (libgomp reads it once, at load), so it
# is set here, the first selfspec module any entry point imports; an explicit
# OMP_WAIT_POLICY in the environment wins. Measurements: docs/engine.md, "Threads".
WAIT_POLICY_FROM_USER = "OMP_WAIT_POLICY" in _os.environ
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
