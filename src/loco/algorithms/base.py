"""The step contract: an algorithm wraps the user's model and inner optimizer and replaces
``optimizer.step()`` with ``algo.step()`` in an otherwise plain PyTorch loop::

    algo = loco.DiLoCo(model, torch.optim.AdamW(model.parameters()), ctx.comm, sync_every=50)
    for x, y in batches:
        model(x, y).backward()
        algo.step()          # was: optimizer.step()
        algo.zero_grad()     # was: optimizer.zero_grad()

Gradient clipping belongs to the algorithm (``max_grad_norm``) rather than the loop, so that
data-parallel training clips the averaged gradient, as DDP does. What is not the step an
algorithm composes: ``nonfinite``, ``ranks`` (its worker's other ranks), ``healing`` (its
part in an elastic job) and ``pacing`` (among workers of unequal speed). The methods the
rest of loco calls besides the step it inherits, each set from the module of its job:
checkpoints (``checkpointable.Checkpointable``), an elastic job's (``healing.Elastic``) and
the report's (``reporting.Reporting``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.checkpointable import Checkpointable
from loco.algorithms.healing import Elastic, Healing, start_identical
from loco.algorithms.method import Method
from loco.algorithms.nonfinite import NonFinite, NonFiniteError, all_finite
from loco.algorithms.pacing import Pacing
from loco.algorithms.reporting import Reporting
from loco.algorithms.sharding import WorkerRanks, flatten_fp32, full_norm, unflatten_views
from loco.comm import Comm
from loco.comm.guard import DEFAULT_AGGREGATION, DEFAULT_FACTOR, Shield
from loco.comm.hostreads import device_path

__all__ = ["Algorithm", "NonFiniteError", "all_finite", "flatten_fp32", "unflatten_views"]


class Algorithm(Checkpointable, Elastic, Reporting, Method):
    """Base class: the model, its inner optimizer, the communication and the step counter.

    A subclass implements [`step`][loco.algorithms.base.Algorithm.step] (and
    [`flush`][loco.algorithms.base.Algorithm.flush] if it leaves communication in flight);
    the loop calls ``algo.step()`` and ``algo.zero_grad()`` where it would call the
    optimizer's. Building one is collective: every worker of ``comm`` must build its own at
    the same point, since the initial state is synchronized then.

    Args:
        model: the worker's replica of the model; its parameters with ``requires_grad`` are
            the ones trained and synchronized. Every worker must build the same
            architecture.
        inner_optimizer: the optimizer over ``model``'s parameters (e.g. AdamW), stepped
            once per inner step; its state stays local to the worker.
        comm: the communication among the M workers that share the outer algorithm,
            ``ctx.comm`` of [`launch`][loco.runtime.launch.launch].
        max_grad_norm: clip the gradient's total norm to this before every inner step
            (data-parallel: the averaged gradient); must be > 0. Default None: no clipping.
        init_sync: how the workers start identical: ``"broadcast"`` (default) or
            ``"verify"`` (see [`start_identical`][loco.algorithms.healing.start_identical]).
        inner: the fast-link Comm over the ranks of this worker (``ctx.inner`` of
            ``launch(..., shards=R)``): their gradients are averaged (fp32) before every
            inner step, so the R ranks train one replica with R times the batch; default
            None (a worker of one rank). Algorithms that do not support it yet refuse it.
        on_nonfinite: what a non-finite gradient or pseudo-gradient does: ``"stop"``
            (default) or ``"skip"`` (see [`NonFinite`][loco.algorithms.nonfinite.NonFinite]).
        aggregation: how each average over ``comm`` treats the workers' contributions
            (see [`Guard`][loco.comm.guard.Guard] and docs/security.md): ``"drop"``
            (default), ``"clip"``, ``"trimmed"``, ``"median"`` or ``"mean"`` (no guard).
        guard_factor: the factor of the median norm beyond which ``drop`` and ``clip``
            act, >= 1; default 4.
        inject: faults or attacks to play, ``--inject``'s text (e.g.
            ``"1:scale=-50,2:nan@40"``, see [`Injector`][loco.comm.attacks.Injector]): this
            worker plays the entries that name it; default None.

    Raises:
        ValueError: ``max_grad_norm`` <= 0, or ``init_sync``, ``on_nonfinite``,
            ``aggregation``, ``guard_factor`` or ``inject`` not one of the values above.
        RuntimeError: the workers' initial state differs (checksums disagree).
    """

    @property
    def sync_in_flight(self) -> bool:
        """Whether a sync was sent and is not applied yet (Streaming DiLoCo's fragment, for
        τ steps after it was sent); the other algorithms finish theirs within the step. A
        checkpoint taken now would have to wait for it."""
        return False

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm, *,
                 max_grad_norm: float | None = None, init_sync: str = "broadcast",
                 on_nonfinite: str = "stop", inner: Comm | None = None,
                 aggregation: str = DEFAULT_AGGREGATION, guard_factor: float = DEFAULT_FACTOR,
                 inject: str | None = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ranks = WorkerRanks(self.params, inner)
        """The other ranks of this worker (``loco.algorithms.sharding.WorkerRanks``)."""
        self.nonfinite = NonFinite(on_nonfinite, device_path(self.params[0].device) and getattr(
            inner_optimizer, "_step_supports_amp_scaling", False), self.ranks.agree)
        """The non-finite policy and counts (``loco.algorithms.nonfinite.NonFinite``)."""
        self.healing = Healing(init_sync)
        """Its part in an elastic job (``loco.algorithms.healing.Healing``)."""
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (got {max_grad_norm})")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.comm = comm
        self.pacing = Pacing()
        """Its weights in the syncs and the syncs held (``loco.algorithms.pacing.Pacing``)."""
        self._guard(comm, aggregation, guard_factor, inject)
        self.inner = self.ranks.inner
        """The worker's fast-link Comm (None for a worker of one rank)."""
        self.max_grad_norm = max_grad_norm
        self.inner_steps = 0
        """Inner steps taken so far (t), the counter every sync is scheduled by."""
        self.grad_norm_fn = None
        """How the gradient norm for clipping is measured: None for the norm of this
        worker's parameters; a pipeline stage sets it to the norm over all its stages
        ([`PipelineStage.grad_norm`][loco.runtime.pipeline.PipelineStage.grad_norm])."""
        if comm.elastic:  # the first quorum comes with join()
            comm.register_state("algorithm", self.heal_state, self.load_heal_state)
        else:
            start_identical(model, comm, self.ranks, init_sync)

    def _guard(self, comm: Comm, aggregation: str, factor: float, inject: str | None) -> None:
        """Give ``comm`` this worker's shield: the guard over its averages and the attacks
        it plays (``loco.comm.guard.Shield``), which read this algorithm's step and whether
        every worker contributes (not where workers send zeros as they wait or join)."""
        me = weakref.ref(self)  # (the Comm must not keep the algorithm alive)
        comm.shield = Shield.build(aggregation, factor, inject,
                                   getattr(comm, "worker", comm.rank), comm.workers,
                                   comm.device, lambda: me().inner_steps if me() else 0)
        comm.shield.all_contribute = lambda: (me() is None or not me().pacing.weighed) and (
            comm.contributors == comm.size)
        comm.shield.guard.compare_past = not comm.elastic  # (a retried sync resends its rows)

    # ----------------------------------------------------------------------------- the loop
    def step(self) -> None:
        """One inner step (replaces ``optimizer.step()``); communicates when its turn comes.

        Call it on every worker after ``backward()``, the same number of times: the syncs are
        scheduled by the step counter, so the workers meet without a word.
        """
        raise NotImplementedError

    def flush(self) -> None:
        """Finish communication still in flight; call it after the last step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients (replaces ``optimizer.zero_grad()``).

        Args:
            set_to_none: set the gradients to None instead of zeroing them (default True),
                as ``torch.optim.Optimizer.zero_grad``.
        """
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def inner_update(self) -> bool:
        """Average the gradients inside the worker, clip them and apply the inner optimizer
        unless the gradient is non-finite; returns whether it stepped
        ([`NonFinite.optimizer_step`][loco.algorithms.nonfinite.NonFinite.optimizer_step]).
        Every worker that sees the same gradient (data-parallel, pipeline stages) decides
        the same."""
        self.ranks.before_step()
        with record_function("loco/inner_step"):
            return self.nonfinite.optimizer_step(self.inner_optimizer, self.clip_gradients(),
                                                 self.inner_steps + 1)

    def clip_gradients(self) -> torch.Tensor:
        """Clip the gradient to ``max_grad_norm`` (if set); return its norm before clipping.

        The norm is that of this worker's trainable parameters, or ``grad_norm_fn``'s (the
        whole model's, for a pipeline stage). Parameters without a gradient are left out.
        Nothing is read back to the host: the norm stays a tensor on the device.

        Returns:
            The total gradient norm before clipping, a 0-d tensor (inf or nan if the
                gradient is not finite).
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_norm_fn is not None:  # the norm over all pipeline stages
            norm = self.grad_norm_fn(self.params)
        elif self.max_grad_norm is not None:
            return full_norm(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.max_grad_norm is not None and grads:  # as clip_grad_norm_ does
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return full_norm(norm)

    def settle_nonfinite(self) -> None:
        """Read the inner steps and syncs skipped on the device since the last call, at every
        logging step ([`NonFinite.settle`][loco.algorithms.nonfinite.NonFinite.settle])."""
        self.nonfinite.settle(self.inner_steps)

    @property
    def skipped(self) -> dict[str, int]:
        """Inner steps and syncs skipped because of non-finite values
        (``on_nonfinite="skip"``), by ``"inner_steps"`` and ``"syncs"``."""
        return self.nonfinite.skipped
