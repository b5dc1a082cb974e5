"""Decoupled DiLoCo's quorum and grace window (arXiv 2604.21428) on loco's asynchronous
outer steps (``--quorum Q``, ``--grace SECONDS``): at every sync the workers tell each other
when their blocks arrived (one float each), and every worker derives from the same numbers
which blocks the sync merges, or that it is held (``loco.algorithms.asynchronous.admit``).

A worker measures its own arrival: the moment its block reached H steps, from the moment it
reached the sync, on its own clock; a block not ready yet arrives at its missing steps times
the worker's step time (its smoothed measure). The decisions are saved with the rounds, so a
resumed run continues from the same syncs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from loco.algorithms.asynchronous import admit
from loco.comm.hostreads import allowed
from loco.training.local_steps import LocalSteps


class QuorumSteps(LocalSteps):
    """Speed-aware local steps whose asynchronous syncs merge the blocks a quorum and a
    grace window admit (see the module).

    Args:
        sync_every: H.
        workers: M.
        replica: this worker's index.
        comm: the Comm the arrivals are gathered over (collective: every worker asks at
            the same syncs).
        quorum_size: Q, the fewest ready blocks a sync merges, in [1, M].
        grace: seconds after the Q-th ready arrival within which a block not ready yet is
            merged too (with the steps it has), >= 0; default 0.
        max_staleness: S >= 1; default 1.
        admitted: every decided sync's merged workers so far (None: held), from a
            checkpoint; default none yet.
        measure: this worker's arrival at round r's sync (``measure(r)``, seconds); default
            measured (``arrival``); tests give literal ones.
        clock: the clock a block's completion is read on; default ``time.perf_counter``.
        **kwargs: as for [`LocalSteps`][loco.training.local_steps.LocalSteps] (``rounds``,
            ``last_round``, ``ahead``; not ``quorum``: not elastic).
    """

    def __init__(self, sync_every: int, workers: int, replica: int, comm: Any,
                 quorum_size: int, grace: float = 0.0, max_staleness: int = 1,
                 admitted: list | None = None, measure: Callable[[int], float] | None = None,
                 clock: Callable[[], float] = time.perf_counter, **kwargs: Any):
        super().__init__(sync_every, workers, replica, max_staleness=max_staleness, **kwargs)
        self.comm, self.least, self.grace = comm, quorum_size, grace
        self.measure = measure or self.arrival
        self.clock = clock
        self.admitted: list[list[int] | None] = [None if a is None else list(a)
                                                 for a in admitted or []]
        """Every decided sync's merged workers, by round (None: held)."""
        self._done: dict[int, float] = {}  # this worker's block (by its first round): done at

    def _start(self, r: int, m: int) -> int:
        """The round at which the block of worker ``m`` that holds round ``r`` began."""
        start = 0
        for q, merged in enumerate(self.admitted[:r]):
            if merged is not None and m in merged:
                start = q + 1
        return start

    def held(self, r: int, m: int) -> int:
        """Steps of worker ``m``'s block through round ``r``."""
        return sum(self.round_counts(q)[m] for q in range(self._start(r, m), r + 1))

    def stale(self, r: int, m: int) -> int:
        """Outer steps taken between the start of worker ``m``'s block and round ``r``'s
        sync (the syncs not held)."""
        return sum(a is not None for a in self.admitted[self._start(r, m):r])

    def block_steps(self, r: int, worker: int) -> int:
        """The steps ``worker`` sends at round ``r``'s sync: its whole block where the sync
        merges it, else 0 (its block goes on)."""
        merged = self.admitted[r] if r < len(self.admitted) else None
        return self.held(r, worker) if merged is not None and worker in merged else 0

    def holds(self, tick: int) -> bool:
        """Whether the sync at ``tick`` (a round's end) is held; the first call for a round
        decides it (collective: the arrivals' all-gather)."""
        r = tick // self.sync_every - 1
        if r == len(self.admitted):
            self.decide(r)
        return self.admitted[r] is None

    def decide(self, r: int) -> None:
        """Gather every worker's arrival at round ``r``'s sync and record whom it merges."""
        mine = torch.tensor([self.measure(r)], dtype=torch.float64, device=self.comm.device)
        with allowed("sync"):
            arrivals = [float(a) for a in self.comm.all_gather(mine, tag="train").wait()]
        ms = range(self.workers)
        last = self.last_round is not None and r >= self.last_round
        self.admitted.append(admit([self.held(r, m) for m in ms], [self.stale(r, m) for m in ms],
                                   arrivals, self.least, self.grace, self.sync_every,
                                   self.max_staleness, last))

    def arrival(self, r: int) -> float:
        """This worker's arrival at round ``r``'s sync, measured: when its block reached H
        steps, from now (<= 0; 0 where unknown: a resumed run's); not ready, its missing
        steps times its step time (``inf`` before any is measured)."""
        held = self.held(r, self.replica)
        if held >= self.sync_every:
            done = self._done.get(self._start(r, self.replica))
            return 0.0 if done is None else min(0.0, done - self.clock())
        step = self._smoothed()
        return (self.sync_every - held) * step if step > 0 else math.inf

    def tick_done(self, comm: Any, tick: int) -> None:
        """After every tick, as ``LocalSteps``; and the moment this worker's block reaches
        H steps is noted."""
        super().tick_done(comm, tick)
        if not self.trains(tick):
            return
        r, h = (tick - 1) // self.sync_every, self.sync_every
        start = self._start(r, self.replica)
        through = (sum(self.round_counts(q)[self.replica] for q in range(start, r))
                   + self.steps_between(r * h + 1, tick, self.replica))
        if through == h:
            self._done = {start: self.clock()}

    def staleness(self, rounds: int) -> dict[int, int]:
        """How many blocks, of all workers, were merged in the first ``rounds`` rounds at
        each staleness (outer steps taken since the block began)."""
        counts: dict[int, int] = {}
        for r, merged in enumerate(self.admitted[:rounds]):
            for m in merged or ():
                s = self.stale(r, m)
                counts[s] = counts.get(s, 0) + 1
        return dict(sorted(counts.items()))

    def held_syncs(self) -> int:
        """Syncs held so far (a quorum not met)."""
        return sum(a is None for a in self.admitted)

    def summary(self) -> dict:
        """The summary's words on the syncs: ``quorum``, ``grace``, ``held_syncs`` and
        ``merged`` (every decided sync's merged workers, None where held)."""
        return {"quorum": self.least, "grace": self.grace, "held_syncs": self.held_syncs(),
                "merged": [None if a is None else list(a) for a in self.admitted]}


def quorum_kwargs(cfg: Any, comm: Any, admitted: list | None) -> dict[str, Any]:
    """``QuorumSteps``' own arguments for a run of ``cfg`` (``--quorum``, ``--grace``),
    the decisions a checkpoint saved (``admitted``) and the Comm to gather over."""
    return {"comm": comm, "quorum_size": cfg.runtime.quorum, "grace": cfg.runtime.grace or 0.0,
            "admitted": admitted}


__all__ = ["QuorumSteps", "quorum_kwargs"]
