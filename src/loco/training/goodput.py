"""Goodput: the share of the workers' capacity that went into committed progress.

The steps whose pseudo-gradients were applied, over the steps each worker could have
trained in the run's wall time at its own pace, never waiting (its step time without the
time it was blocked on communication). Workers of unequal speed (``--worker-speed``,
``loco.training.emulation``) leave less of it under a synchronous barrier; speed-aware
local steps (``loco.training.local_steps``) give some back.
"""

from __future__ import annotations


def goodput(counters: list[dict], ranks_of_worker: list[list[int]], held: float = 0.0
            ) -> dict:
    """The run's goodput, and each worker's.

    A rank's step time when it does not wait is its training time less the time it was
    blocked on communication, over the steps it trained; in the run's wall time (the
    slowest rank's training time, less ``held``, and never less than any rank's busy time)
    it could have trained ``wall / that`` steps. Goodput is the steps applied (trained,
    less those skipped or discarded) over those capacities: at most 1, since a rank
    applies no more steps than it trains and is busy no longer than the wall time.

    ``held`` is taken out because the other workers wait it out at their next sync; a
    worker that reaches that sync late (slower, or on a loaded machine) waits less than
    ``held``, and without the floor its busy time would exceed the wall time (goodput
    above 1).

    Args:
        counters: every rank's counters, with ``train_seconds``, ``blocked_seconds``,
            ``trained_steps`` and ``applied_steps``.
        ranks_of_worker: the ranks of each worker, by worker.
        held: seconds the lead rank spent evaluating (and on the spread diagnostic), left
            out of its training time, which the other workers wait out at their next
            sync: left out of the wall time too (default 0).

    Returns:
        ``total`` and ``per_worker`` (fractions; None where a rank trained nothing) and
            ``step_seconds`` (each worker's step time when not waiting, its slowest rank's).
    """
    busy = [c["train_seconds"] - c["blocked_seconds"] for c in counters]
    wall = max(max(c["train_seconds"] for c in counters) - held, *busy)

    def capacity(c: dict, busy: float) -> float | None:
        return wall * c["trained_steps"] / busy if busy > 0 and c["trained_steps"] else None

    caps = [capacity(c, b) for c, b in zip(counters, busy)]
    per_worker, step_seconds = [], []
    for ranks in ranks_of_worker:
        cap = [caps[r] for r in ranks]
        applied = sum(counters[r]["applied_steps"] for r in ranks)
        per_worker.append(None if None in cap else round(applied / sum(cap), 4))
        step_seconds.append(None if None in cap else round(wall / min(cap), 4))
    total = (None if None in caps else
             round(sum(c["applied_steps"] for c in counters) / sum(caps), 4))
    return {"total": total, "per_worker": per_worker, "step_seconds": step_seconds}


__all__ = ["goodput"]
