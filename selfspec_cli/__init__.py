"""selfspec: lossless self-speculative decoding for Hugging Face causal LMs.

Importing the package changes nothing in the process: the command line's entry point
(cli/entry.py) sets ``OMP_WAIT_POLICY`` before torch loads; a program that uses selfspec as a
library sets its own (docs/engine.md, "Threads")."""

__version__ = "0.1.0"
