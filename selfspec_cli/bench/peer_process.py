"""A contender that decodes in a process of its own: plain decoding on another target of the same weights.

``ar-fp32`` (the model's float32 tensors, beside ``ar`` on the checkpoint's own storage) needs the
float32 copy of every matrix, five to six times the bytes of a GGUF's blocks. Held in the bench's
process it would be every other row's memory too (a 135M model's bench peaked at 2.4 GB that way),
and the block target could never free its float weights. So the row runs here, in a child process
that loads the model itself: each row's ``peak_rss_mb`` is then the memory of the process that
decoded it, and the bench's own process holds the blocks only (docs/benchmarks.md, "Memory").

The timing is the bench's: the parent's :func:`selfspec_cli.runtime.run_prompt` times the call, which
sends the prompt's ids and the generation config down a pipe and waits while the child decodes (one
pickled list each way, well under a millisecond against seconds of decoding); the child's own
``DecodeResult`` (its prefill and decode timings included) comes back as it is.

Invariants:

* the child decodes with the parent's thread count and thread governor, and the environment the
  command line set before torch loaded (the wait policy), so the row runs as it would in-process;
* the child builds a fresh plain-decoding method for every :meth:`ProcessPeer.make` (every timed pass);
* an error in the child is raised in the parent with its message, and the child never outlives the
  parent's bench (:meth:`ProcessPeer.close`, and a daemon process besides).
"""
from __future__ import annotations

import multiprocessing as mp
import weakref
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..decoding.output import DecodeResult


@dataclass(frozen=True)
class PeerSpec:
    """What the child needs to open the same model on another target."""

    model: str | None  # as the user named it (None: the default model)
    dtype: str
    device: str
    target_precision: str
    threads: int
    governor: dict[str, int]  # engine/threads.py's AUTO (``--threads auto``)


class PeerProcessError(RuntimeError):
    """The child failed: its message, raised in the parent."""


def _serve(conn: Any, spec: PeerSpec) -> None:
    import signal

    from ..heap import bound_heap

    # a Ctrl-C reaches the whole process group: the parent handles it (keeps its records, stops this
    # process), so the child neither prints a traceback nor dies between a call and its answer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bound_heap()  # as the command line does (selfspec_cli/heap.py)
    import torch

    from ..engine import threads as governor
    from ..engine.runner import Engine
    from ..loading import load_model
    from ..methods import build

    try:
        torch.set_num_threads(spec.threads)
        governor.AUTO.clear()
        governor.AUTO.update(spec.governor)
        mdl, tok = load_model(spec.model, dtype=spec.dtype, device=spec.device, log=None, lite=True)  # our engine only
        engine = Engine(mdl, target_precision=spec.target_precision)
        method = build("ar", engine, tok)
        engine.release_float_weights(panels=True)  # plain decoding reads the packed panels only
        conn.send(("ready", engine.target_precision))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            if msg[0] == "fresh":
                method = build("ar", engine, tok)
                conn.send(("ok", None))
            elif msg[0] == "generate":
                conn.send(("ok", method.generate(msg[1], msg[2])))
            else:  # "stop"
                return
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessPeer:
    """Plain decoding of the model on ``spec.target_precision``, in a child process (see the module docstring).

    The child starts loading the model when this object is made (while the parent builds its methods);
    :meth:`wait_ready` waits for it, before the first timed call."""

    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")  # never fork a process whose OpenMP team has run
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, spec), daemon=True, name="selfspec-peer")
        self._proc.start()
        child.close()
        self.target_precision: str | None = None
        self._closer = weakref.finalize(self, _stop, self._proc, self._conn)  # an error path never leaves it running

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _answer(self, *msg: Any) -> Any:
        """Send ``msg`` (none: only wait for the ready message) and return the child's answer; a failure there
        is raised here, with its message."""
        try:
            if msg:
                self._conn.send(msg)
            kind, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(timeout=5)
            raise PeerProcessError(f"the {self.spec.target_precision} peer's process ended "
                                   f"(exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise PeerProcessError(f"the {self.spec.target_precision} peer's process failed: {value}")
        return value

    def wait_ready(self) -> str:
        """The target the child runs, once it has loaded the model."""
        if self.target_precision is None:
            self.target_precision = self._answer()
        return self.target_precision

    def generate(self, ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        return self._answer("generate", ids, cfg)

    def make(self) -> Any:
        """A fresh plain-decoding method in the child (one per timed pass); its ``generate``."""
        self.wait_ready()
        self._answer("fresh")
        return self.generate

    def close(self) -> None:
        self._closer()


def _stop(proc: Any, conn: Any) -> None:
    if proc.is_alive():
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    conn.close()
