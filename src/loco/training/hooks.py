"""The inner step's hooks: what a run adds to a plain training step, one concern each.

A plain step reads a batch, runs the forward and backward passes and takes the algorithm's
step and the learning-rate schedule's (``loco.training.loop.inner_step``). A run adds to
it, by its options: speed-aware local steps (which ticks this worker trains, and their
times: ``SpeedAwareTicks``), an attack's silence (``Silence``), a ``LOCO_FAULT`` drill
(``FaultDrill``), an emulated speed (``Throttling``), the settling of the steps skipped on
the device as non-finite (``NonFinite``) and an elastic run's token count
(``ElasticTokens``). Each is a ``StepHook``; ``step_hooks`` assembles a run's list once,
and the loop calls every hook's phase in that order (``StepHooks``):

    start(step)            every tick, first
    trains(step)           whether this worker trains at this tick (else an idle tick)
    before(step)           a trained tick, before its batch is read
    compute(step)          around the forward and backward passes
    after_backward(step)   after them
    after(step)            after the algorithm's step, the schedule's and ``zero_grad``
    end(step)              every tick, last (after the algorithm's flush at the run's end)

The order is part of the contract: results, bytes and a drill's timing depend on it. A hook
reads from the device only where its concern must (an emulated speed on a GPU waits for
its step's end; settling non-finite steps reads their count every ``--log-every`` steps).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from loco.runtime.faults import Fault, silence
from loco.training.counters import blocked_seconds
from loco.training.emulation import Throttle
from loco.training.local_steps import DeviceSpan, LocalSteps
from loco.training.worker import Loop, Rank


class StepHook:
    """One concern of the inner step. Every phase does nothing (``trains``: True) unless a
    hook overrides it; ``step`` is the tick (1-based inner step of the run)."""

    def start(self, step: int) -> None:
        """At every tick, trained or idle, before anything else."""

    def trains(self, step: int) -> bool:
        """Whether this worker trains at ``step`` (asked once per tick, after ``start``)."""
        return True

    def before(self, step: int) -> None:
        """A trained tick, before its batch is read."""

    def compute(self, step: int) -> AbstractContextManager:
        """A context around the trained tick's forward and backward passes."""
        return nullcontext()

    def after_backward(self, step: int) -> None:
        """A trained tick, after its forward and backward passes (and ``compute``)."""

    def after(self, step: int) -> None:
        """A trained tick, after the algorithm's step, the schedule's and ``zero_grad``."""

    def end(self, step: int) -> None:
        """At every tick, last: after the algorithm's flush on the run's last step."""


class StepHooks(StepHook):
    """A run's hooks in order: each phase calls every hook's in that order (``trains``: all
    of them must train; ``compute``: the first hook's context outermost).

    Args:
        hooks: the hooks, in order.
    """

    def __init__(self, hooks: Iterable[StepHook]):
        self.hooks = list(hooks)

    def _each(self, phase: str, step: int) -> None:
        for hook in self.hooks:
            getattr(hook, phase)(step)

    def start(self, step: int) -> None:
        """Every hook's ``start``."""
        self._each("start", step)

    def trains(self, step: int) -> bool:
        """Whether every hook trains at ``step`` (asked in order, until one does not)."""
        return all(hook.trains(step) for hook in self.hooks)

    def before(self, step: int) -> None:
        """Every hook's ``before``."""
        self._each("before", step)

    @contextmanager
    def compute(self, step: int):
        """Every hook's ``compute`` context, nested in order."""
        with ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.compute(step))
            yield

    def after_backward(self, step: int) -> None:
        """Every hook's ``after_backward``."""
        self._each("after_backward", step)

    def after(self, step: int) -> None:
        """Every hook's ``after``."""
        self._each("after", step)

    def end(self, step: int) -> None:
        """Every hook's ``end``."""
        self._each("end", step)


class SpeedAwareTicks(StepHook):
    """Speed-aware local steps (``--local-steps proportional``): which ticks this worker
    trains (``LocalSteps.trains``), each trained tick's time (on a GPU the device's, from
    before the step to the end of its backward pass, a ``DeviceSpan``; on a CPU the host's,
    the whole step, its algorithm's flush included, less the time it was blocked on
    communication), and after every tick the schedule's own (``LocalSteps.tick_done``).

    Args:
        plan: this worker's local steps.
        ctx: this rank's context (its device, its Comms' blocked time).
    """

    def __init__(self, plan: LocalSteps, ctx: Any):
        self.plan, self.ctx = plan, ctx
        self.gpu = ctx.device.type == "cuda"
        self.timing: Any = None  # the trained tick's DeviceSpan, or its start and waits

    def trains(self, step: int) -> bool:
        """The plan's ``trains``."""
        return self.plan.trains(step)

    def before(self, step: int) -> None:
        """Start timing the tick."""
        if self.gpu:  # the device's clock: the tick's forward and backward
            self.timing = DeviceSpan(self.ctx.device)
        else:
            self.timing = (time.perf_counter(), blocked_seconds(self.ctx))

    def after_backward(self, step: int) -> None:
        """On a GPU: the span's end."""
        if self.gpu:
            self.timing.stop()

    def end(self, step: int) -> None:
        """Count the trained tick's time (none on an idle tick), then the plan's
        ``tick_done``."""
        if self.gpu and self.timing is not None:
            self.plan.trained(self.timing)
        elif self.timing is not None:
            t0, waited = self.timing
            self.plan.trained(time.perf_counter() - t0 - (blocked_seconds(self.ctx) - waited))
        self.timing = None
        self.plan.tick_done(self.ctx.comm, step)


class Silence(StepHook):
    """``--inject WORKER:silent[@STEP]``: this worker's process ends at once from its step
    on (``loco.runtime.faults.silence``), checked before every trained tick.

    Args:
        comm: the slow link's Comm (its ``shield.injector``, read at every tick).
    """

    def __init__(self, comm: Any):
        self.comm = comm

    def before(self, step: int) -> None:
        """Fall silent, if due."""
        silence(self.comm.shield.injector, step)


class FaultDrill(StepHook):
    """A ``LOCO_FAULT`` drill (``loco.runtime.faults.Fault``): it strikes before its step
    (once the last checkpoint is committed, so that recovery can be watched from it); a NaN
    drill poisons that step's backward pass only.

    Args:
        fault: this rank's fault.
        comm: the slow link's Comm (its aborts, for a hang).
        writer: this rank's checkpoint writer.
        algo: the algorithm (its trained ``params``).
    """

    def __init__(self, fault: Fault, comm: Any, writer: Any, algo: Any):
        self.fault, self.comm, self.writer, self.algo = fault, comm, writer, algo

    def before(self, step: int) -> None:
        """Strike, if due (after the last checkpoint is committed)."""
        if step == self.fault.step:  # a drill strikes once the last checkpoint is committed
            self.writer.wait_committed(self.comm.check_aborted)
        self.fault.before_step(step, self.comm, self.algo.params)

    def after_backward(self, step: int) -> None:
        """Remove a NaN drill's poison."""
        self.fault.after_backward(step, self.algo.params)


class Throttling(StepHook):
    """``--worker-speed``: this worker's forward and backward passes, then a pause of
    ``(1/speed − 1)`` times their time (``Throttle.compute``).

    Args:
        throttle: this worker's emulated speed.
        loop: the loop's running values (its ``throttle_seconds``).
    """

    def __init__(self, throttle: Throttle, loop: Loop):
        self.throttle, self.loop = throttle, loop

    def compute(self, step: int) -> AbstractContextManager:
        """The throttle's timed context."""
        return self.throttle.compute(self.loop)


class NonFinite(StepHook):
    """Every ``--log-every`` steps: the inner steps the algorithm skipped on the device as
    non-finite, read now (``Algorithm.settle_nonfinite``: counted, or raised).

    Args:
        algo: the algorithm.
        every: ``--log-every``.
    """

    def __init__(self, algo: Any, every: int):
        self.algo, self.every = algo, every

    def after(self, step: int) -> None:
        """Settle, if due."""
        if step % self.every == 0:  # inner steps skipped on the device, if any, read now
            self.algo.settle_nonfinite()


class ElasticTokens(StepHook):
    """An elastic run's training tokens (``Rank.elastic_tokens``), counted as the live
    workers train: with speed-aware local steps at the start of every tick, the steps the
    members of the latest sync train at it; else after every step, the quorum of the
    latest sync (its members, after this step's sync if any) times every rank's batch.

    Args:
        w: the rank's worker.
    """

    def __init__(self, w: Rank):
        self.w = w

    def start(self, step: int) -> None:
        """With speed-aware local steps: count the tick's."""
        w, plan = self.w, self.w.local_steps
        if plan is not None:  # the steps the members of the latest sync train at this tick
            w.elastic_tokens += (sum(plan.trains(step, m) for m in w.ctx.comm.members)
                                 * w.cfg.data.batch_size * w.cfg.data.seq_len)

    def after(self, step: int) -> None:
        """Without them: count the step's."""
        w = self.w
        if w.local_steps is None:  # the quorum of the latest sync trained
            w.elastic_tokens += (len(w.ctx.comm.members) * w.ctx.worker_ranks
                                 * w.cfg.data.batch_size * w.cfg.data.seq_len)


def step_hooks(w: Rank, loop: Loop) -> StepHooks:
    """A run's hooks of the inner step, in their order (see the module), once per run.

    Args:
        w: the rank's worker (its options, its fault, throttle and local steps).
        loop: the loop's running values.
    """
    hooks: list[StepHook] = []
    if w.local_steps is not None:
        hooks.append(SpeedAwareTicks(w.local_steps, w.ctx))
    hooks.append(Silence(w.ctx.comm))
    if w.fault is not None:
        hooks.append(FaultDrill(w.fault, w.ctx.comm, w.writer, w.algo))
    if w.throttle is not None:
        hooks.append(Throttling(w.throttle, loop))
    hooks.append(NonFinite(w.algo, w.cfg.run.log_every))
    if w.ctx.comm.elastic:
        hooks.append(ElasticTokens(w))
    return StepHooks(hooks)


__all__ = ["ElasticTokens", "FaultDrill", "NonFinite", "Silence", "SpeedAwareTicks",
           "StepHook", "StepHooks", "Throttling", "step_hooks"]
