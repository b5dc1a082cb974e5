"""Local training: every worker trains alone, no communication at all.

An ablation (what communication buys) and the throughput ceiling of the other methods.
"""

from __future__ import annotations

from loco.algorithms.base import Algorithm


class Local(Algorithm):
    #: Replicas drift apart; each worker's own parameters are what it evaluates.
    replicas_identical = False

    def step(self) -> None:
        self.inner_update()
        self.inner_steps += 1
