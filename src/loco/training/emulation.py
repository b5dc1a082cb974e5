"""Workers of unequal speed, emulated (``--worker-speed``).

A worker of speed ``s`` in (0, 1] makes each inner step take ``1/s`` of its natural time:
after the step's forward and backward passes, timed as they run, it sleeps ``(1/s − 1)``
times that time. Sleeping rather than spinning leaves the cores to the other workers, as a
slower machine would. On a GPU the time is the device's, between two events on the
training stream (the emulation waits for the second one: it costs the step its launch-ahead).
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


__all__ = ["Throttle"]
