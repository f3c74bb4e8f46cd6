"""The setup every command shares: threads, the model and its tokenizer, the end-of-sequence
tokens, the context checks, the engine on a target precision (docs/design.md, "Layers").

``selfspec generate``, ``bench``, ``calibrate``, ``train-heads`` and ``profile`` (and any
program using selfspec as a library) open a model the same way::

    threads = apply_threads(args.threads)              # before anything loads
    check_device(dtype, device)                        # a bad --dtype or --device before anything is read
    s = Session.open(model, dtype=dtype, device=device, chat_template=True)
    cfg = s.generation(GenerationConfig(max_new_tokens=64))   # with the model's eos ids
    s.check_fits(prompts, cfg)                         # one line per prompt too long for the context
    engine = s.engine("auto")                          # Engine(model, target_precision)

A shared top-level module: it imports the engine and the loaders, never cli/, bench/ or methods/.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import GenerationConfig
from .engine import Engine
from .errors import ConfigError
from .loading import load_model, model_fingerprint, resolve_device, resolve_dtype
from .prompts import Prompt, encode_turn
from .runtime import check_prompt_fits, context_length, eos_token_ids

def default_threads() -> int:
    """``--threads``' default: the physical cores this process may use (affinity mask, cgroup quota;
    engine/cores.py), as llama.cpp's ``-t``. Token ids do not depend on it (docs/engine.md, "Threads")."""
    from .engine.cores import usable_cores

    return usable_cores()


def apply_threads(threads: str | int | None) -> int:
    """Set the thread count of the kernel pool and of torch's intra-op threads (``None``:
    :func:`default_threads`; ``auto``: the usable cores under the thread governor of
    engine/threads.py, for engines made after this call); returns it. A bad value is one line
    naming ``--threads``; more threads than usable cores run, and say so once on stderr."""
    import torch

    from .engine import kernels
    from .engine import threads as governor
    from .engine.cores import cores as machine_cores

    usable = machine_cores().usable
    governor.AUTO.clear()
    if str(threads).strip().lower() == "auto":
        governor.AUTO["threads"] = usable
        torch.set_num_threads(usable)
        kernels.set_threads(usable)
        return usable
    try:
        n = usable if threads is None else int(str(threads).strip())
    except ValueError:
        raise ConfigError(f"--threads must be a whole number or auto, got '{threads}'") from None
    if n < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if n > usable:  # more threads than cores only make them wait on each other
        print(f"selfspec: note: --threads {n} oversubscribes the {usable} physical "
              f"{'core' if usable == 1 else 'cores'} this process may use; threads will wait on each other",
              file=sys.stderr)
    torch.set_num_threads(n)
    kernels.set_threads(n)
    return n


def check_device(dtype: str, device: str) -> None:
    """Refuse a bad ``--dtype`` or ``--device`` before anything is read."""
    resolve_dtype(dtype, resolve_device(device))


# README, "Precision on CPU" bullet (new-user finding 11): 16-bit arithmetic on CPU is not transformers' own
CPU_HALF_NOTE = ("selfspec: note: --dtype {dtype} on CPU computes in 16 bits, which rounds differently from "
                 "transformers' CPU kernels: greedy tokens can differ from its generate at near-ties; the default "
                 "(float32 weights as loaded, --target-precision auto) streams a bf16 or fp16 checkpoint's own "
                 "values with float32 arithmetic, exact to it")


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def process_age_s() -> float:
    """Seconds since this process started (its clock tick count, from /proc; 0 where that is not readable)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class Session:
    """A loaded model and its tokenizer, with what every command derives from them."""

    model: Any
    tokenizer: Any
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    spec: str | None = None  # the model as the user named it (None: the default), for a process of its own
    dtype: str = "auto"
    device: str = "auto"
    parameters: int = 0  # counted at load: a block target may release the float tensors later
    load_s: float = 0.0  # seconds the model and tokenizer took to load (a first GGUF's preparation included)
    ready_s: float = 0.0  # seconds from the process's start to the loaded model (imports included)

    @classmethod
    def open(cls, model: str | None, *, dtype: str = "auto", device: str = "auto", chat_template: bool = True,
             lite: bool = False) -> Session:
        """Load ``model`` (a name, directory, hub id or .gguf; None: the default) on ``device`` in ``dtype``;
        ``lite``: without transformers where the directory allows (selfspec_cli/lite.py: for commands that
        decode with selfspec's engine only)."""
        dev = resolve_device(device)
        if dev.type == "cpu" and resolve_dtype(dtype, dev) != torch.float32:
            print(CPU_HALF_NOTE.format(dtype=dtype), file=sys.stderr)
        t0 = time.perf_counter()
        mdl, tok = load_model(model, dtype=dtype, device=device, lite=lite)
        return cls(mdl, tok, chat_template, model, dtype, device, sum(p.numel() for p in mdl.parameters()),
                   time.perf_counter() - t0, process_age_s())

    def startup(self) -> dict[str, float]:
        """Start-up and memory as every run reports them: the model's load, the seconds from the process's start
        to the loaded model (the interpreter's imports included), and the process's peak resident memory so far."""
        return {"model_load_s": round(self.load_s, 2), "model_ready_s": round(self.ready_s, 2),
                "peak_rss_mb": round(peak_rss_mb(), 1)}

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.model, self.tokenizer)

    @property
    def context_length(self) -> int:
        return context_length(self.model)

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    def generation(self, cfg: GenerationConfig) -> GenerationConfig:
        """``cfg`` with the model's end-of-sequence tokens."""
        return dataclasses.replace(cfg, eos_token_ids=self.eos_token_ids)

    def check_fits(self, prompts: Iterable[Prompt], cfg: GenerationConfig) -> None:
        """Refuse, in one line, a prompt whose turns and new tokens do not fit the model's context."""
        ctx = self.context_length
        for p in prompts:
            check_prompt_fits(p, self.tokenizer, cfg, ctx, self.chat_template)

    def encode_first_turns(self, prompts: Iterable[Prompt]) -> list[list[int]]:
        """The token ids of each prompt's first turn as a user message (the offline steps' and
        the profile's inputs)."""
        return [encode_turn(self.tokenizer, [{"role": "user", "content": p.turns[0]}], self.chat_template)
                for p in prompts]

    def engine(self, target_precision: str = "auto") -> Engine:
        """A new engine on ``target_precision`` (engine/target.py) over the model's weights."""
        return Engine(self.model, target_precision=target_precision)
