"""Local training: every worker trains alone, no communication at all.

An ablation (what communication buys) and the throughput ceiling of the other methods.
"""

from __future__ import annotations

from loco.algorithms.base import Algorithm


class Local(Algorithm):
    """Local training: every worker trains alone; nothing is communicated after the start.

    Only the initial state is synchronized (``init_sync``), so all replicas start equal; then
    they drift apart (``replicas_identical`` is False) and each evaluates its own parameters.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``), used only at the start.
        max_grad_norm: clip the gradient's total norm to this before every inner step; > 0,
            default None (no clipping).
        init_sync: ``"broadcast"`` (default) or ``"verify"``, as for
            [`Algorithm`][loco.algorithms.base.Algorithm].
        on_nonfinite: ``"stop"`` (default) or ``"skip"``, as for
            [`Algorithm`][loco.algorithms.base.Algorithm].
        inner: the worker's fast-link Comm (``ctx.inner``): its ranks average their
            gradients, as for [`Algorithm`][loco.algorithms.base.Algorithm]; default None.
        aggregation: as for [`Algorithm`][loco.algorithms.base.Algorithm] (nothing is
            averaged here: it has nothing to judge); default ``"drop"``.
        guard_factor: as for [`Algorithm`][loco.algorithms.base.Algorithm]; default 4.
        inject: as for [`Algorithm`][loco.algorithms.base.Algorithm]; default None.
    """

    name = "local"
    title = "Local"
    shared = ("spread_every", "final_average")
    replicas_identical = False
    """Replicas drift apart; each worker's own parameters are what it evaluates."""

    @classmethod
    def setting(cls, config: dict) -> str:
        """Nothing to set: no communication."""
        return "no communication"

    def step(self) -> None:
        """One inner step of this worker's optimizer; no communication."""
        self.inner_update()
        self.inner_steps += 1
