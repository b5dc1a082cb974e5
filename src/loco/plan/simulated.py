"""The compute utilization a plan's link allows, from ``loco simulate utilization``'s
simulator (`loco.simulate.utilization`), fed with the schedule and the bytes the dry run
measured rather than with a method's name.

The simulator knows two shapes of traffic: a reduction of every layer after every step
(data-parallel) and rounds of H steps in which P fragments of strided layers are each sent
once, at loco's send steps, and merged τ steps later (DiLoCo: P = 1, τ = 0; Streaming
DiLoCo). The dry run's operations of one round are matched to one of them: their steps give
P and the schedule, the step of the wait τ, and their bytes an equivalent width on the wire
(bits per value), chosen so that the link carries exactly the bytes the rank sends. Traffic of
another shape is not simulated (the plan says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loco.simulate.utilization import (PRESETS, ModelSpec, Plan, data_parallel_plan,
                                       outer_plan, send_offsets, simulate)


@dataclass(frozen=True)
class Op:
    """One slow-link operation of a round: the inner step it was sent after (1 to H), the
    step whose update waited for it, and the bytes the rank sent."""

    issued: int
    waited: int | None
    sent: int


def default_step_time(params: float) -> float:
    """Seconds of compute per inner step for a model of ``params`` parameters: the Streaming
    DiLoCo paper's step times (its 1B, 10B and 100B models, `PRESETS`) interpolated on
    log-log axes, and extended along the nearest segment beyond them.

    Args:
        params: the model's parameters, > 0.
    """
    points = sorted((s.params, s.step_time) for s in PRESETS.values())
    x = math.log(params)
    i = next((i for i in range(1, len(points) - 1) if x <= math.log(points[i][0])),
             len(points) - 1)
    (p0, t0), (p1, t1) = points[i - 1], points[i]
    slope = (math.log(t1) - math.log(t0)) / (math.log(p1) - math.log(p0))
    return math.exp(math.log(t0) + slope * (x - math.log(p0)))


def schedule(ops: list[Op], H: int, workers: int, layers: int, params: int,
             step_time: float) -> tuple[Plan | None, str]:
    """The simulator's program for the measured round, and in words what it is (or, with
    no program, why none fits).

    Args:
        ops: the busiest rank's slow-link operations of one round of H steps.
        H: inner steps per round, >= 1.
        workers: M, >= 2.
        layers: the model's blocks, >= 1.
        params: the model's parameters, > 0.
        step_time: seconds of compute per inner step, > 0.
    """
    spec = ModelSpec("plan", layers, step_time, params)
    ring = 2 * (workers - 1) / workers  # the simulator's all-reduce moves ring · B per worker

    def bits(sent: float) -> float:
        return 8 * sent / ring / params

    steps = sorted({op.issued for op in ops})
    if steps == list(range(1, H + 1)):
        per_step = sum(op.sent for op in ops) / H
        return (data_parallel_plan(spec, bits(per_step)),
                f"every layer reduced every step, {bits(per_step):.3g} bits per value")
    offsets = {t % H for t in steps}
    P = len(steps)
    taus = {(op.waited if op.waited is not None else op.issued) - op.issued for op in ops}
    if sorted(offsets) != sorted(send_offsets(H, P)) or len(taus) != 1 or P > layers:
        return None, ("its syncs do not follow the simulator's schedules (every step, or P "
                      "fragments sent once per round of H steps)")
    tau = taus.pop()
    fragments = [list(range(p, layers, P)) for p in range(P)]
    sent = sum(op.sent for op in ops)
    return (outer_plan(spec, H, fragments, tau, bits(sent)),
            f"{P} fragment{'s' if P > 1 else ''} of strided layers per round of H = {H}, "
            f"τ = {tau}, {bits(sent):.3g} bits per value")


def utilization(ops: list[Op], H: int, workers: int, layers: int, params: int,
                bandwidth: float, latency: float, step_time: float) -> dict:
    """The simulated compute utilization of a worker whose rank sends ``ops`` every round,
    over a link of ``bandwidth`` bits/s and ``latency`` s.

    Args:
        ops: the busiest rank's slow-link operations of one round of H steps.
        H: inner steps per round, >= 1.
        workers: M, >= 1.
        layers: the model's blocks, >= 1.
        params: the model's parameters, > 0.
        bandwidth: the rank's slow link, bits per second, > 0 (``math.inf``: unlimited).
        latency: its one-way latency, seconds, >= 0.
        step_time: seconds of compute per inner step, > 0.

    Returns:
        ``compute_utilization`` (a fraction, or None where no program fits) and
            ``simulated_as`` (the program in words, or why none fits).
    """
    if workers == 1 or not ops:
        return {"compute_utilization": 1.0, "simulated_as": "nothing sent between workers"}
    plan, words = schedule(ops, H, workers, layers, params, step_time)
    if plan is None:
        return {"compute_utilization": None, "simulated_as": words}
    cu = simulate(plan, bandwidth / 1e9, workers, latency)
    return {"compute_utilization": cu, "simulated_as": words}


__all__ = ["Op", "default_step_time", "schedule", "utilization"]
