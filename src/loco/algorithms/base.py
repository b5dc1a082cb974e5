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
part in an elastic job) and ``pacing`` (among workers of unequal speed).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from loco.algorithms.healing import Healing, start_identical
from loco.algorithms.method import Method
from loco.algorithms.nonfinite import NonFinite, NonFiniteError, all_finite
from loco.algorithms.pacing import Pacing
from loco.algorithms.sharding import (Share, WorkerRanks, flatten_fp32, from_logical,
                                      full_norm, load_local, local, local_tree, logical_state,
                                      unflatten_views)
from loco.comm import Comm
from loco.comm.guard import DEFAULT_AGGREGATION, DEFAULT_FACTOR, Shield
from loco.comm.hostreads import device_path

__all__ = ["Algorithm", "NonFiniteError", "all_finite", "flatten_fp32", "unflatten_views"]


class Algorithm(Method):
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

    # ------------------------------------------------------------------ elastic membership
    def join(self) -> bool:
        """Take part in the first quorum of an elastic job, once, before the first step;
        returns whether this worker joined a running job
        ([`Healing.join`][loco.algorithms.healing.Healing.join])."""
        return self.healing.join(self)

    def heal_state(self) -> dict:
        """What a worker that is behind receives from this one at the quorum of a sync
        ([`Healing.state`][loco.algorithms.healing.Healing.state])."""
        return self.healing.state(self)

    def load_heal_state(self, state: dict) -> None:
        """Take a live worker's ``heal_state()``
        ([`Healing.load`][loco.algorithms.healing.Healing.load]).

        Args:
            state: a dict from ``heal_state()`` of a worker of the same job.
        """
        self.healing.load(self, state)

    def restart_from_global(self) -> None:
        """Set the replica's parameters to the global copy (outer algorithms)."""

    def _resume(self) -> None:
        """Go on with the sync of ``healing.syncing`` after a heal (subclasses)."""

    # -------------------------------------------------------------------------- reporting
    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters to evaluate, by name (usable with ``torch.func.functional_call``).

        Here the model's own parameters; outer algorithms return their global copy.
        """
        return dict(self.model.named_parameters())

    def replicated_tensors(self) -> list[torch.Tensor]:
        """This rank's share of the state that must be bit-identical on every worker, which
        the replica check compares and heals (``loco.algorithms.replicas``); none here:
        nothing is checked (the replicas differ by design, or hold no common state)."""
        return []

    def outer_tensors(self) -> list[torch.Tensor]:
        """The tensors of the outer algorithm this rank holds between steps: its state,
        its sync buffers and any spare copies (for ``memory_bytes``); none here."""
        return []

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by part: ``model`` (parameters and
        buffers, its shards under FSDP2), ``gradients`` (one per trained parameter, held
        from the backward pass to the inner step), ``inner_optimizer`` (its state),
        ``outer`` (the outer algorithm's state, sync buffers and spare copies,
        ``outer_tensors``: each storage once, whole, as views of one buffer share it) and
        ``comm`` (the buffers the algorithm's Comms keep between operations,
        ``Comm.buffer_bytes``, and ``WorkerRanks.buffer_bytes`` for a worker of several
        ranks)."""
        def size(tensors) -> int:
            return sum(local(t).numel() * t.element_size() for t in tensors)
        model = size(t for t in self.model.state_dict().values() if isinstance(t, torch.Tensor))
        inner = size(v for s in self.inner_optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        grads = size(p for p in self.model.parameters() if p.requires_grad)
        storages = {}
        for t in self.outer_tensors():
            storage = local(t).untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # (meta tensors' data_ptr is 0)
        comm = self.comm.buffer_bytes() if hasattr(self.comm, "buffer_bytes") else 0
        return {"model": model, "gradients": grads, "inner_optimizer": inner,
                "outer": sum(storages.values()), "comm": comm + self.ranks.buffer_bytes()}

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self, tensors: bool = True) -> dict:
        """Everything needed to continue: model, inner optimizer, counters, outer state.

        Args:
            tensors: include the tensors of the model, the optimizers and the outer state
                (default True); False: only the rest (counters, the schedule's position),
                for a checkpoint that saves the tensors through
                [`checkpoint_tensors`][loco.algorithms.base.Algorithm.checkpoint_tensors].

        Returns:
            A dict of tensors and numbers for ``torch.save``; each rank saves its own (under
            FSDP2 its local shards, with R ranks per worker its share of the outer state).
        """
        self.settle_nonfinite()
        state = {"inner_steps": self.inner_steps, "skipped": dict(self.skipped)}
        if tensors:
            state.update(model=local_tree(self.model.state_dict()),
                         inner_optimizer=local_tree(self.inner_optimizer.state_dict()))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.base.Algorithm.state_dict] saved, so
        training continues exactly (without tensors: load them next with
        [`load_checkpoint_tensors`][loco.algorithms.base.Algorithm.load_checkpoint_tensors]).

        Args:
            state: a dict from ``state_dict()`` of an algorithm built the same way.
        """
        if "model" in state:
            load_local(self.model, self.inner_optimizer, state["model"],
                       state["inner_optimizer"], self.ranks.sharded)
        self.inner_steps = int(state["inner_steps"])
        self.nonfinite.skipped = {k: int(v) for k, v in state.get("skipped",
                                                                  self.skipped).items()}

    def outer_state(self) -> dict[str, tuple[Share, torch.Tensor]]:
        """The outer algorithm's tensors by name, each as (the
        [`Share`][loco.algorithms.sharding.Share] it holds values of, this rank's values as
        one fp32 vector); none here. A vector may be a copy:
        [`load_outer_state`][loco.algorithms.base.Algorithm.load_outer_state] puts values
        back."""
        return {}

    def load_outer_state(self, values: dict[str, torch.Tensor]) -> None:
        """Set the outer state from vectors shaped like those of
        [`outer_state`][loco.algorithms.base.Algorithm.outer_state].

        Args:
            values: a vector for every name of ``outer_state()``.
        """
        for name, (_, flat) in self.outer_state().items():
            flat.copy_(values[name])

    def checkpoint_tensors(self, mesh: DeviceMesh | None = None) -> dict:
        """Every tensor of this rank's state as the worker's whole tensors, for
        ``torch.distributed.checkpoint`` (DCP): the model and inner optimizer from
        ``torch.distributed.checkpoint.state_dict`` (FSDP2's DTensors as they are), the outer
        state as [`Share.logical`][loco.algorithms.sharding.Share.logical] gives it. DCP
        saves each rank's part once and loads any layout of R ranks from it. No message.

        Args:
            mesh: the worker's ``DeviceMesh`` of its R ranks (``ctx.device_mesh["shard"]``);
                None for a worker of one rank.

        Returns:
            ``{"model": ..., "inner_optimizer": ..., "outer": {name: tensor}}``; the model's
            tensors alias its parameters, so ``dcp.load`` into a fresh algorithm's dict
            fills them (then call ``load_checkpoint_tensors``).
        """
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)

        return {"model": get_model_state_dict(self.model),
                "inner_optimizer": get_optimizer_state_dict(self.model, self.inner_optimizer),
                "outer": logical_state(self.outer_state(), mesh)}

    def load_checkpoint_tensors(self, tensors: dict, mesh: DeviceMesh | None = None) -> None:
        """Take the state from a ``checkpoint_tensors()`` dict that ``dcp.load`` filled.

        Args:
            tensors: the dict, loaded.
            mesh: as for ``checkpoint_tensors``.
        """
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(self.model, tensors["model"])
        set_optimizer_state_dict(self.model, self.inner_optimizer, tensors["inner_optimizer"])
        self.load_outer_state(from_logical(self.outer_state(), tensors["outer"], mesh))
