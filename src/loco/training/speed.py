"""Workers of unequal speed, emulated (``--worker-speed``), and the goodput they leave.

A worker of speed ``s`` in (0, 1] makes each inner step take ``1/s`` of its natural time:
after the step's forward and backward passes, timed as they run, it sleeps ``(1/s − 1)``
times that time. Sleeping rather than spinning leaves the cores to the other workers, as a
slower machine would. On a GPU the time is the device's, between two events on the
training stream (the emulation waits for the second one: it costs the step its launch-ahead).

Goodput is the share of the workers' capacity that went into committed progress: the steps
whose pseudo-gradients were applied, over the steps each worker could have trained in the
run's wall time at its own pace, never waiting (its step time without the time it was
blocked on communication).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class Throttle:
    """One worker's emulated speed.

    Args:
        speed: the factor in (0, 1]; 1 sleeps never.
        device: where the step runs (on a GPU its time is taken with events).
    """

    def __init__(self, speed: float, device: torch.device):
        self.speed = speed
        self.device = device

    @contextmanager
    def compute(self, loop: Any) -> Iterator[None]:
        """Time the step's compute inside; then sleep ``(1/speed − 1)`` times it, added to
        ``loop.throttle_seconds``."""
        if self.speed >= 1:
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            yield
            seconds = time.perf_counter() - t0
        pause = (1 / self.speed - 1) * seconds
        time.sleep(pause)
        loop.throttle_seconds += pause


def goodput(counters: list[dict], ranks_of_worker: list[list[int]]) -> dict:
    """The run's goodput, and each worker's.

    A rank's step time when it does not wait is its training time less the time it was
    blocked on communication, over the steps it trained; in the run's wall time (the
    slowest rank's training time) it could have trained ``wall / that`` steps. Goodput is
    the steps applied (trained, less those skipped or discarded) over those capacities.

    Args:
        counters: every rank's counters, with ``train_seconds``, ``blocked_seconds``,
            ``trained_steps`` and ``applied_steps``.
        ranks_of_worker: the ranks of each worker, by worker.

    Returns:
        ``total`` and ``per_worker`` (fractions; None where a rank trained nothing) and
            ``step_seconds`` (each worker's step time when not waiting, its slowest rank's).
    """
    wall = max(c["train_seconds"] for c in counters)

    def capacity(c: dict) -> float | None:
        busy = c["train_seconds"] - c["blocked_seconds"]
        return wall * c["trained_steps"] / busy if busy > 0 and c["trained_steps"] else None

    caps = [capacity(c) for c in counters]
    per_worker, step_seconds = [], []
    for ranks in ranks_of_worker:
        cap = [caps[r] for r in ranks]
        applied = sum(counters[r]["applied_steps"] for r in ranks)
        per_worker.append(None if None in cap else round(applied / sum(cap), 4))
        step_seconds.append(None if None in cap else round(wall / min(cap), 4))
    total = (None if None in caps else
             round(sum(c["applied_steps"] for c in counters) / sum(caps), 4))
    return {"total": total, "per_worker": per_worker, "step_seconds": step_seconds}


__all__ = ["Throttle", "goodput"]
