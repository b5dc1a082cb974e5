"""A worker's pace among workers of unequal speed (docs/unequal.md): how much its
pseudo-gradient weighs in a sync, and whether a sync is held back.

Every algorithm holds a [`Pacing`][loco.algorithms.pacing.Pacing] (``algo.pacing``); the
training loop sets it for speed-aware local steps (``--local-steps proportional``: a worker
that trains fewer steps of a round weighs less), asynchronous outer steps
(``--max-staleness``: a worker whose block goes on sends zeros, weight 0) and a quorum
(``--quorum``: a sync whose quorum is not met is held back). Left as built, every worker
weighs the same and no sync is held. Only the methods with rounds of H steps and a global
copy read it (their ``idle_step`` and ``keep_block_starts`` go with it).
"""

from __future__ import annotations

from collections.abc import Callable


class Pacing:
    """This worker's weights in the syncs and the syncs held back.

    Attributes:
        weight_of: this worker's weight in the average of a sync sent at inner step t that
            covers the ``span`` steps before it, ``weight_of(t, span)`` (M times its share
            of the steps trained then: speed-aware local steps; 0: it sends nothing then,
            asynchronous outer steps); None (default): equal weights.
        sync_held: whether the sync due at inner step t is held back, every worker
            agreeing (``sync_held(t)``, collective: a quorum not met,
            ``loco.training.quorum``): nothing is sent and no outer step taken; None
            (default): no sync is held.
    """

    def __init__(self):
        self.weight_of: Callable[[int, int], float] | None = None
        self.sync_held: Callable[[int], bool] | None = None

    @property
    def weighed(self) -> bool:
        """Whether the workers' weights may differ (``weight_of`` is set)."""
        return self.weight_of is not None

    def weight(self, t: int, span: int) -> float:
        """This worker's weight in the sync sent at inner step ``t`` (1 where unweighed).

        Args:
            t: the inner step the sync is sent at.
            span: the inner steps the sync covers (H).
        """
        return 1.0 if self.weight_of is None else self.weight_of(t, span)

    def held(self, t: int) -> bool:
        """Whether the sync due at inner step ``t`` is held back (collective where a quorum
        decides).

        Args:
            t: the inner step the sync is due at.
        """
        return self.sync_held is not None and self.sync_held(t)


__all__ = ["Pacing"]
