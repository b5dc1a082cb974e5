"""Workers of unequal speed: emulated (``--worker-speed``), given a share of each round by
their speed (``--local-steps proportional``), and the goodput they leave.

A worker of speed ``s`` in (0, 1] makes each inner step take ``1/s`` of its natural time:
after the step's forward and backward passes, timed as they run, it sleeps ``(1/s − 1)``
times that time. Sleeping rather than spinning leaves the cores to the other workers, as a
slower machine would. On a GPU the time is the device's, between two events on the
training stream (the emulation waits for the second one: it costs the step its launch-ahead).

With speed-aware local steps (Async Local-SGD's "dynamic local updates", Liu et al. 2024,
arXiv 2401.09135) every round of H inner steps is H *ticks* for every worker, and worker i
trains on ``n_i`` of them, spread evenly and always on the round's last: ``n_i`` is H times
its speed over the fastest worker's, so that all reach the round's end together. Skipped
ticks cost nothing; syncs, evaluations and checkpoints stay at the same ticks everywhere. At
each round's end the workers gather their measured step times (one small all-gather) and
every worker derives every ``n_i`` of the next round from the same numbers: the schedule is
agreed, whatever the speeds do meanwhile. A worker's pseudo-gradient then weighs by the
steps (tokens) behind it.

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


class LocalSteps:
    """Speed-aware local steps: which ticks each worker trains on, round by round.

    Args:
        sync_every: H, the ticks of a round.
        workers: M.
        replica: this worker's index.
        rounds: the steps per round of every worker so far (one list of M per round, from a
            checkpoint); default: none yet (the first round: H each).
    """

    def __init__(self, sync_every: int, workers: int, replica: int,
                 rounds: list[list[int]] | None = None):
        self.sync_every, self.workers, self.replica = sync_every, workers, replica
        self.rounds = [list(r) for r in rounds or [[sync_every] * workers] * 2]
        """Every round's steps per worker, agreed so far: the first two rounds H each; the
        times of round r fix round r + 2 (so that the gather is never waited for)."""
        self.busy = 0.0  # this round's seconds of trained ticks, waits left out
        self.steps = 0  # this round's trained ticks
        self._pending: Any = None  # the gather of the last round's times, in flight

    def counts(self, tick: int) -> list[int]:
        """Every worker's steps in the round of ``tick`` (1-based)."""
        r = (tick - 1) // self.sync_every
        return self.rounds[r] if r < len(self.rounds) else [self.sync_every] * self.workers

    def trains(self, tick: int, worker: int | None = None) -> bool:
        """Whether ``worker`` (default this one) trains at ``tick``: tick k (0-based in its
        round) of a worker of n steps when ``floor((k+1)·n/H) > floor(k·n/H)``: n ticks,
        spread evenly, the round's last among them."""
        n, h = self.counts(tick)[self.replica if worker is None else worker], self.sync_every
        k = (tick - 1) % h
        return (k + 1) * n // h > k * n // h

    def steps_between(self, first: int, last: int, worker: int) -> int:
        """How many of the ticks ``first``..``last`` (inclusive) ``worker`` trains on."""
        return sum(self.trains(t, worker) for t in range(max(first, 1), last + 1))

    def weight(self, tick: int, span: int) -> float:
        """This worker's weight in the average of a sync sent at ``tick`` that covers the
        ``span`` ticks before it: M times its share of the steps all workers trained then,
        so that the mean of the weighted pseudo-gradients weighs each by its tokens."""
        steps = [self.steps_between(tick - span + 1, tick, m) for m in range(self.workers)]
        total = sum(steps)
        return self.workers * steps[self.replica] / total if total else 1.0

    def trained(self, seconds: float) -> None:
        """Count a trained tick of ``seconds`` (its time blocked on communication left out)."""
        self.busy += seconds
        self.steps += 1

    def agree(self, comm: Any) -> None:
        """At a round's end: start gathering every worker's mean step time of the round
        (one float each over ``comm``, counted as training bytes: the method sends it), and
        fix the round after next from the previous round's gather, which has long arrived:
        ``n_i = max(1, round(H · fastest / time_i))``. Collective: every worker calls it at
        the same ticks."""
        self.settle()
        mine = self.busy / self.steps if self.steps else 0.0
        self._pending = comm.all_gather(
            torch.tensor([mine], dtype=torch.float64, device=comm.device), tag="train")
        self.busy, self.steps = 0.0, 0

    def settle(self) -> None:
        """Fix the round the gather in flight decides (waiting for it): before the next
        gather, and before a checkpoint saves ``rounds``."""
        if self._pending is None:
            return
        times = [float(t) for t in self._pending.wait()]
        self._pending = None
        known = [t for t in times if t > 0]
        fastest = min(known) if known else 0.0
        self.rounds.append([max(1, round(self.sync_every * fastest / t)) if t > 0
                            else self.sync_every for t in times])

    def steps_until(self, tick: int) -> int:
        """Steps every worker together trained in ticks 1..``tick``."""
        h = self.sync_every
        done = tick // h
        whole = sum(sum(self.counts(r * h + 1)) for r in range(done))
        return whole + sum(self.steps_between(done * h + 1, tick, m) for m in range(self.workers))


__all__ = ["LocalSteps", "Throttle", "goodput"]
