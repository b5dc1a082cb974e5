"""Fault injection, for tests and drills: make one rank fail at one step.

Set ``LOCO_FAULT=RANK:STEP[:KIND]`` in the environment of ``loco train`` (rank processes
inherit it). Rank RANK then fails at inner step STEP of a fresh run; a run that resumed
from a checkpoint, or that torch elastic restarted, is left alone, so that recovery can be
watched. Kinds:

- ``raise`` (default): an exception in the worker.
- ``exit``: the worker process exits with code 1 (processes launcher, torchrun).
- ``kill``: the worker process is killed with SIGKILL (processes launcher, torchrun).
- ``hang``: the worker stops answering, as a peer whose machine froze; under the threads
  launcher it gives up once the others have failed.
- ``nan``: the worker's gradient becomes NaN at that step (for ``--on-nonfinite``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("raise", "exit", "kill", "hang", "nan")
ENV = "LOCO_FAULT"


class InjectedFault(RuntimeError):
    """The failure LOCO_FAULT asked for."""


@dataclass
class Fault:
    rank: int
    step: int
    kind: str = "raise"
    _poison: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> "Fault":
        parts = text.split(":")
        try:
            rank, step = int(parts[0]), int(parts[1])
            kind = parts[2] if len(parts) > 2 else "raise"
        except (ValueError, IndexError):
            raise ValueError(f"{ENV} must look like RANK:STEP[:KIND] (got {text!r})") from None
        if kind not in KINDS or len(parts) > 3:
            raise ValueError(f"{ENV}: KIND must be one of {', '.join(KINDS)} (got {text!r})")
        return cls(rank, step, kind)

    @classmethod
    def for_rank(cls, rank: int, text: str | None = None) -> "Fault | None":
        """This rank's fault from ``text`` (``--fault``), else the environment, or None."""
        text = text or os.environ.get(ENV)
        if not text:
            return None
        fault = cls.parse(text)
        return fault if fault.rank == rank else None

    def before_step(self, step: int, comm, params=()) -> None:
        """Called by the worker before inner step ``step`` (``params``: the trained ones)."""
        if step == self.step and self.kind == "nan":
            # The NaN arises in the backward pass, as an overflow would: data-parallel
            # training averages each gradient while the backward pass runs (DDP).
            first = next(p for p in params if p.requires_grad)
            self._poison = first.register_hook(lambda g: torch.full_like(g, float("nan")))
        if step != self.step or self.kind == "nan":
            return
        if self.kind == "exit":
            os._exit(1)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:  # until the run is aborted (threads); processes are killed
                comm.check_aborted()
                time.sleep(0.05)
        raise InjectedFault(f"injected fault ({self.rank}:{self.step}:{self.kind})")

    def after_backward(self, step: int, params) -> None:
        """Called after the backward pass of inner step ``step``."""
        if self._poison is not None:
            self._poison.remove()
            self._poison = None


def silence(injector: Any, step: int) -> None:
    """``--inject WORKER:silent[@STEP]`` (``loco.comm.attacks``): from inner step STEP on
    this worker never sends again; its process ends at once without a word. An elastic run
    (which ``silent`` needs) restarts it up to ``--max-restarts`` times, each restart falls
    silent again as it rejoins, and the worker is then counted lost while the others train
    on (the summary's ``elastic`` section names it).

    Args:
        injector: this worker's attacks (``comm.shield.injector``), or None.
        step: the inner step about to be taken.
    """
    if injector is None:
        return
    injector.step = step
    if injector.silent:
        os._exit(0)

