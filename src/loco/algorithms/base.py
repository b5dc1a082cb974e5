"""What every algorithm shares: it wraps the user's model and inner optimizer and replaces
``optimizer.step()`` with ``algo.step()`` in an otherwise plain PyTorch loop::

    algo = loco.DiLoCo(model, torch.optim.AdamW(model.parameters()), ctx.comm, sync_every=50)
    for x, y in batches:
        model(x, y).backward()
        algo.step()          # was: optimizer.step()
        algo.zero_grad()     # was: optimizer.zero_grad()

Gradient clipping belongs to the algorithm (``max_grad_norm``) rather than the loop, so that
data-parallel training clips the averaged gradient, as DDP does.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from loco.algorithms.buckets import GradientBuckets
from loco.algorithms.method import Method
from loco.algorithms.sharding import Share, flatten_fp32, is_sharded, local, unflatten_views
from loco.comm import Comm
from loco.comm.guard import DEFAULT_AGGREGATION, DEFAULT_FACTOR, Shield
from loco.comm.hostreads import allowed, device_path

__all__ = ["Algorithm", "NonFiniteError", "flatten_fp32", "unflatten_views"]

INIT_SYNC_MODES = ("broadcast", "verify")
"""How the workers' initial state is made identical (``init_sync`` of ``Algorithm``)."""
#: What to do with a non-finite gradient or pseudo-gradient: raise NonFiniteError, or skip
#: that inner step or sync (and count it).
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(ArithmeticError):
    """A non-finite gradient or pseudo-gradient, caught before it reached any parameter.

    Raised by an [`Algorithm`][loco.algorithms.base.Algorithm] built with
    ``on_nonfinite="stop"`` (the default); the parameters still hold the last finite state.
    """


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
        init_sync: how the workers start identical: ``"broadcast"`` (default) copies the
            parameters and buffers of worker 0 to every worker, then compares checksums;
            ``"verify"`` only compares them (the workers must have built identical models,
            e.g. from one seed).
        inner: the fast-link Comm over the ranks of this worker (``ctx.inner`` of
            ``launch(..., shards=R)``): their gradients are averaged (fp32) before every
            inner step, so the R ranks train one replica with R times the batch; default
            None (a worker of one rank). Algorithms that do not support it yet refuse it.
        on_nonfinite: what a non-finite gradient or pseudo-gradient does: ``"stop"``
            (default) raises [`NonFiniteError`][loco.algorithms.base.NonFiniteError] before
            it reaches a parameter; ``"skip"`` skips that inner step or sync and counts it in
            ``skipped``.
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

    sync_held: Callable[[int], bool] | None = None
    """Whether the sync due at inner step t is held back, every worker agreeing
    (``sync_held(t)``, collective: a quorum not met, ``loco.training.quorum``): nothing is
    sent and no outer step taken; None (default): no sync is held."""

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
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES} "
                             f"(got {on_nonfinite!r})")
        if init_sync not in INIT_SYNC_MODES:
            raise ValueError(f"init_sync must be one of {INIT_SYNC_MODES} (got {init_sync!r})")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (got {max_grad_norm})")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.comm = comm
        self._guard(comm, aggregation, guard_factor, inject)
        self.inner = inner if inner is not None and inner.size > 1 else None
        """The worker's fast-link Comm (None for a worker of one rank)."""
        self.average_inner = True
        """Whether ``inner_update`` averages the gradients over ``inner`` (a subclass that
        reduces them itself turns it off)."""
        self.inner_buckets: GradientBuckets | None = None
        """The gradients' buckets reduced over ``inner`` during the backward pass (a worker
        of several ranks holding the whole model), made at the first average."""
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sharded = is_sharded(self.params)
        """Whether the model is FSDP2-sharded over the worker's ranks (its parameters are
        DTensors): the algorithm then works on each rank's local shards, and FSDP2 averages
        the gradients inside the worker."""
        self.inner_steps = 0
        """Inner steps taken so far (t), the counter every sync is scheduled by."""
        self.grad_norm_fn = None
        """How the gradient norm for clipping is measured: None for the norm of this
        worker's parameters; a pipeline stage sets it to the norm over all its stages
        ([`PipelineStage.grad_norm`][loco.runtime.pipeline.PipelineStage.grad_norm])."""
        self.on_nonfinite = on_nonfinite
        self.skip_on_device = (device_path(self.params[0].device) and
                               getattr(inner_optimizer, "_step_supports_amp_scaling", False))
        """Whether a non-finite gradient's inner step is skipped on the device rather than
        decided on the host, so that no step waits for the device: on CUDA (``device_path``)
        with an optimizer that takes ``found_inf`` (``fused=True`` Adam, AdamW, SGD;
        ``MuonAdamW``). The skips are then read at the next sync (``settle_nonfinite``)."""
        self._pending_skips: torch.Tensor | None = None
        self._pending_since = 0
        self.skipped = {"inner_steps": 0, "syncs": 0}
        """Inner steps and syncs skipped because of non-finite values
        (``on_nonfinite="skip"``)."""
        self.weight_of: Callable[[int, int], float] | None = None
        """This worker's weight in the average of a sync sent at inner step t that covers
        the ``span`` steps before it, ``weight_of(t, span)`` (M times its share of the
        steps trained then: speed-aware local steps; 0: it sends nothing then,
        asynchronous outer steps); None: equal weights."""
        self._init_sync = init_sync
        self._syncing = None  # (what, when) of the sync whose quorum this worker is in
        if comm.elastic:  # the first quorum comes with join()
            comm.register_state("algorithm", self.heal_state, self.load_heal_state)
        else:
            self._sync_initial_state(init_sync)

    def _guard(self, comm: Comm, aggregation: str, factor: float, inject: str | None) -> None:
        """Give ``comm`` this worker's shield: the guard over its averages and the attacks
        it plays (``loco.comm.guard.Shield``), which read this algorithm's step and whether
        every worker contributes (not where workers send zeros as they wait or join)."""
        me = weakref.ref(self)  # (the Comm must not keep the algorithm alive)
        comm.shield = Shield.build(aggregation, factor, inject,
                                   getattr(comm, "worker", comm.rank), comm.workers,
                                   comm.device, lambda: me().inner_steps if me() else 0)
        comm.shield.all_contribute = lambda: (me() is None or me().weight_of is None) and (
            comm.contributors == comm.size)
        comm.shield.guard.compare_past = not comm.elastic  # (a retried sync resends its rows)

    # ----------------------------------------------------------------------- initial state
    def _sync_initial_state(self, mode: str) -> None:
        """Broadcast parameters and buffers from worker 0 (``mode`` ``"broadcast"``), then
        verify their checksums on every worker (and every rank of a worker).

        Raises:
            RuntimeError: the workers' state differs.
        """
        state = [local(t) for t in self.model.state_dict(keep_vars=True).values()
                 if isinstance(t, torch.Tensor)]
        if mode == "broadcast":
            with torch.no_grad():
                for dtype in sorted({t.dtype for t in state}, key=str):
                    same = [t for t in state if t.dtype == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    self.comm.broadcast(flat, src=0, tag="setup").wait()
                    offset = 0
                    for t in same:
                        t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
        self.comm.verify_identical(state, what="initial weights")
        if self.inner is not None and not self.sharded:  # R ranks hold one replica
            self.inner.verify_identical(state, what="initial weights inside a worker")

    # ------------------------------------------------------------------ elastic membership
    def join(self) -> bool:
        """Take part in the first quorum of an elastic job
        ([`ElasticComm`][loco.comm.membership.ElasticComm]); call it once, before the first
        step (it does nothing on a fixed Comm). In a fresh job the workers wait for each
        other (all M; after the timeout, those that came, at least ``min_workers``) and
        start from the same state. A worker that joins a running job receives the state of
        a live worker at its next sync: its ``inner_steps`` jump to that worker's.

        Returns:
            Whether this worker joined a running job.
        """
        if not self.comm.elastic:
            return False
        self.comm.joining = True
        try:
            deadline = time.monotonic() + self.comm.timeout
            while True:
                if self.comm.begin():
                    self._resume()
                    return True
                if self._enough_came(time.monotonic() > deadline):
                    break  # all M, or as many as came within the timeout (>= min_workers)
                time.sleep(0.5)  # the others are still starting
            self._sync_initial_state(self._init_sync)
            self.comm.commit(True, record=False)
            return False
        finally:
            self.comm.joining = False

    def _enough_came(self, my_wait_over: bool) -> bool:
        """Whether the members of this start-up quorum stop waiting for the others: all M
        are here, or any rank's wait is over. Agreed by every rank of every member (one
        integer each, tag ``setup``, inside the worker first): their clocks started apart,
        and a rank that went on waiting alone would ask for a quorum the others never join
        while they broadcast the start."""
        if len(self.comm.members) == self.comm.workers:
            return True
        over = torch.tensor([int(my_wait_over)], dtype=torch.int64)
        for comm in (self.inner, self.comm):  # (on a GPU: the inner Comm's device differs)
            if comm is not None:
                over = max(comm.all_gather(over.to(comm.device), tag="setup").wait())
        return bool(over)

    def heal_state(self) -> dict:
        """What a worker that is behind receives from this one, at the quorum of a sync:
        the counters and the outer state (copies), and which sync it is."""
        state = self.state_dict(tensors=False)
        state["outer"] = {name: flat.clone() for name, (_, flat) in self.outer_state().items()}
        state["syncing"] = self._syncing
        return state

    @torch.no_grad()
    def load_heal_state(self, state: dict) -> None:
        """Take a live worker's ``heal_state()``: its counters and outer state; the
        replica restarts from the global copy, the inner optimizer from zero.

        Args:
            state: a dict from ``heal_state()`` of a worker of the same job.
        """
        self.load_state_dict({k: v for k, v in state.items() if k not in ("outer", "syncing")})
        self.load_outer_state(state["outer"])
        self._syncing = state["syncing"]
        self.inner_optimizer.state.clear()
        self.restart_from_global()

    def restart_from_global(self) -> None:
        """Set the replica's parameters to the global copy (outer algorithms)."""

    def _resume(self) -> None:
        """Go on with the sync of ``_syncing`` after ``load_heal_state`` (subclasses)."""

    # ----------------------------------------------------------------------------- the loop
    def idle_step(self) -> None:
        """Advance the schedule by one inner step without training (a worker that trains
        fewer steps per round: speed-aware local steps): what is due at that step (a sync)
        happens as at any step. Only the methods with a round of H steps and a global copy
        have it.

        Raises:
            NotImplementedError: this method has none.
        """
        raise NotImplementedError(f"{self.name} trains every step of its schedule")

    def keep_block_starts(self) -> None:
        """Asynchronous outer steps: a sync this worker's weight is 0 in (``weight_of``)
        gets zeros from it and leaves its replica training; the pseudo-gradient it sends at
        the end of such a block is taken from the global copy the block started from (see
        ``loco.algorithms.asynchronous``). Only the methods with a global copy have it.

        Raises:
            NotImplementedError: this method has none.
        """
        raise NotImplementedError(f"{self.name} has no global copy to step asynchronously")

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
            return _full(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.max_grad_norm is not None and grads:  # as clip_grad_norm_ does
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return _full(norm)

    def inner_update(self) -> bool:
        """Clip and apply the inner optimizer, unless the gradient is non-finite (then raise
        or, with ``on_nonfinite="skip"``, leave the parameters as they are). Every worker
        that sees the same gradient (data-parallel, pipeline stages) decides the same.

        With ``skip_on_device`` the step is skipped on the device, and the skips are read
        at the next sync or ``settle_nonfinite()``.

        Returns:
            True if the optimizer stepped (or the decision was left to the device), False
                if the step was skipped.

        Raises:
            NonFiniteError: the gradient is not finite and ``on_nonfinite`` is ``"stop"``.
        """
        if self.inner is not None and self.average_inner and not self.sharded:
            self.average_inside_worker()  # (FSDP2 has averaged them itself)
        with record_function("loco/inner_step"):
            norm = self.clip_gradients()
            if self.skip_on_device:
                self._step_unless_nonfinite(norm)
                return True
            if not bool(torch.isfinite(norm)):  # a host read: free on a CPU
                self.nonfinite("gradient", "inner_steps", self.inner_steps + 1)
                return False
            self.inner_optimizer.step()
        return True

    def _step_unless_nonfinite(self, norm: torch.Tensor) -> None:
        """The optimizer's step, skipped on the device when ``norm`` is not finite; the
        skip is counted on the device, read by ``settle_nonfinite``."""
        found = (~torch.isfinite(norm)).to(torch.float32)
        self.inner_optimizer.found_inf = found
        try:
            self.inner_optimizer.step()
        finally:
            del self.inner_optimizer.found_inf
        self.skipped_on_device(found, "inner_steps")

    def skipped_on_device(self, found: torch.Tensor, counter: str) -> None:
        """Count an inner step or a sync that was skipped on the device where ``found`` (a
        0-d float tensor, 1 or 0) is 1, without reading it: ``settle_nonfinite`` reads the
        counts later.

        Args:
            found: 1 where the step or sync was skipped, 0 where it was applied.
            counter: the key of ``skipped``: ``"inner_steps"`` or ``"syncs"``.
        """
        add = torch.stack([found, torch.zeros_like(found)])
        add = add if counter == "inner_steps" else add.flip(0)
        self._pending_skips = add if self._pending_skips is None else self._pending_skips + add
        self._pending_since = self._pending_since or self.inner_steps + 1

    def settle_nonfinite(self) -> None:
        """Read the inner steps and syncs skipped on the device since the last call
        (``skip_on_device``, ``skipped_on_device``): count them in ``skipped``, or raise.
        Called at every sync, logging step and checkpoint; nothing to do when every step
        was checked on the host.

        Raises:
            NonFiniteError: a step or sync was skipped and ``on_nonfinite`` is ``"stop"``
                (the parameters hold the state without the non-finite steps).
        """
        if self._pending_skips is None:
            return
        with allowed("sync"):
            steps, syncs = (int(n) for n in self._pending_skips.tolist())
        since = self._pending_since
        self._pending_skips, self._pending_since = None, 0
        if (steps or syncs) and self.on_nonfinite == "stop":
            what = ("a non-finite gradient in {} inner step(s)".format(steps) if steps
                    else "a non-finite update in {} step(s)".format(syncs))
            raise NonFiniteError(f"{what} between steps {since} and {self.inner_steps}, "
                                 "skipped on the device (--on-nonfinite stop)")
        self.skipped["inner_steps"] += steps
        self.skipped["syncs"] += syncs

    @torch.no_grad()
    def average_inside_worker(self) -> None:
        """Average the gradients over the ranks of this worker (``inner``, the fast link), in
        fp32, as data-parallel training does; every rank of the worker then steps alike.
        From the second backward pass on, the buckets are reduced while it runs
        ([`GradientBuckets`][loco.algorithms.buckets.GradientBuckets], hooks registered at
        the first call); this waits for them (a parameter that got no gradient contributes
        zeros)."""
        if self.inner_buckets is None:
            self.inner_buckets = GradientBuckets(self.params, self.inner)
        self.inner_buckets.finish()

    def shard_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """A zeroed fp32 buffer for ``n`` values, padded to R equal shards (R = the ranks of
        this worker; no padding for one rank). Its first ``n`` values are the data.

        Args:
            n: the values, >= 0.
            device: where it lives.
        """
        r = self.inner.size if self.inner is not None else 1
        return torch.zeros(-(-n // r) * r, dtype=torch.float32, device=device)

    def own_shard(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's 1/R of a ``shard_buffer`` (all of it for one rank): what it sends over
        the slow link, with the same shard of every other worker.

        Args:
            buffer: a buffer from ``shard_buffer``.
        """
        if self.inner is None:
            return buffer
        size = buffer.numel() // self.inner.size
        return buffer[self.inner.rank * size:(self.inner.rank + 1) * size]

    def gather_shards(self, buffer: torch.Tensor) -> None:
        """Fill ``buffer`` with every rank's shard, over the worker's fast link (nothing to
        do for one rank).

        Args:
            buffer: a buffer from ``shard_buffer``, this rank's shard up to date.
        """
        if self.inner is not None:
            torch.cat(self.inner.all_gather(self.own_shard(buffer), tag="train").wait(),
                      out=buffer)

    def finite(self, tensor: torch.Tensor, what: str, verdict: bool | None = None) -> bool:
        """Whether a reduced pseudo-gradient is finite; if not, raise or count a skipped
        sync. Every worker of the sync decides the same: a non-finite value on one worker
        makes the reduced value non-finite on all (the scaled codecs mark such a block with
        ``loco.comm.codecs.NONFINITE_SCALE``).

        Args:
            tensor: the reduced value to check (every element).
            what: what it is, for the error message (e.g. ``"pseudo-gradient"``).
            verdict: whether this rank's ``tensor`` is finite, when it was checked already
                (on a helper thread); default None: check it now.

        Returns:
            True if every element is finite; False if not and the sync is skipped.

        Raises:
            NonFiniteError: an element is not finite and ``on_nonfinite`` is ``"stop"``.
        """
        self.settle_nonfinite()
        with allowed("sync"):
            finite = self.agree(all_finite(tensor) if verdict is None else verdict)
        if finite:
            return True
        self.nonfinite(what, "syncs", self.inner_steps)
        return False

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of this worker: each rank of a worker of R
        ranks checks only its own shard, so they combine their verdicts (one value over the
        fast link) and decide alike.

        Args:
            flag: this rank's verdict.
        """
        if self.inner is None:
            return flag
        bad = torch.tensor([0.0 if flag else 1.0], device=self.inner.device)
        self.inner.all_reduce_mean(bad, tag="train").wait()
        return float(bad) == 0.0

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by part: ``model`` (parameters and
        buffers, its shards under FSDP2), ``gradients`` (one per trained parameter, held
        from the backward pass to the inner step), ``inner_optimizer`` (its state),
        ``outer`` (the outer algorithm's state, sync buffers and spare copies,
        ``outer_tensors``: each storage once, whole, as views of one buffer share it) and
        ``comm`` (the buffers the algorithm's Comms keep between operations,
        ``Comm.buffer_bytes``: ``comm`` and, for a worker of several ranks, ``inner``; and
        the buffer its gradients are averaged in over those ranks, ``inner_buckets``)."""
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
        comm = sum(c.buffer_bytes() for c in (self.comm, self.inner)
                   if c is not None and hasattr(c, "buffer_bytes"))
        buckets = getattr(self, "inner_buckets", None)
        if buckets is not None:
            comm += buckets.flat.numel() * buckets.flat.element_size()
        return {"model": model, "gradients": grads, "inner_optimizer": inner,
                "outer": sum(storages.values()), "comm": comm}

    def outer_tensors(self) -> list[torch.Tensor]:
        """The tensors of the outer algorithm this rank holds between steps: its state,
        its sync buffers and any spare copies (for ``memory_bytes``); none here."""
        return []

    def nonfinite(self, what: str, counter: str, step: int) -> None:
        """Handle a non-finite value by the ``on_nonfinite`` policy: raise, or count a skip.

        Args:
            what: what was not finite, for the error message.
            counter: the key of ``skipped`` to increment: ``"inner_steps"`` or ``"syncs"``.
            step: the inner step it happened at, for the error message.

        Raises:
            NonFiniteError: ``on_nonfinite`` is ``"stop"``.
        """
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite {what} at step {step}, caught before it reached "
                                 "the parameters (--on-nonfinite stop)")
        self.skipped[counter] += 1

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
            state.update(model=_local_tree(self.model.state_dict()),
                         inner_optimizer=_local_tree(self.inner_optimizer.state_dict()))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.base.Algorithm.state_dict] saved, so
        training continues exactly (without tensors: load them next with
        [`load_checkpoint_tensors`][loco.algorithms.base.Algorithm.load_checkpoint_tensors]).

        Args:
            state: a dict from ``state_dict()`` of an algorithm built the same way.
        """
        if "model" not in state:
            pass
        elif self.sharded:  # this rank's shards: into the DTensors' local tensors
            with torch.no_grad():
                for name, t in self.model.state_dict().items():
                    local(t).copy_(state["model"][name])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
            _redistribute_state(self.inner_optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.skipped = {k: int(v) for k, v in state.get("skipped", self.skipped).items()}

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
                "outer": {_join(name, key): t for name, (share, flat) in
                          self.outer_state().items()
                          for key, t in share.logical(flat, mesh).items()}}

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
        values = {}
        for name, (share, flat) in self.outer_state().items():
            keys = share.logical(flat, mesh)
            values[name] = flatten_fp32([local(tensors["outer"][_join(name, k)]) for k in keys],
                                        out=torch.empty_like(flat))
        self.load_outer_state(values)


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if key else name


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor (a DTensor's over all its shards)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite: one sum in the common case (a finite
    sum proves it); only a non-finite sum is checked element by element.

    Args:
        tensor: a floating-point tensor.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _local_tree(state):
    """``state`` with every DTensor replaced by its local shard (what this rank saves)."""
    if isinstance(state, dict):
        return {k: _local_tree(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local_tree(v) for v in state]
    return local(state) if isinstance(state, torch.Tensor) else state


def _redistribute_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading local shards into an optimizer over DTensors: make each state tensor a
    DTensor again, with its parameter's placements."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if (isinstance(p, DTensor) and isinstance(v, torch.Tensor)
                        and not isinstance(v, DTensor) and v.shape == local(p).shape):
                    optimizer.state[p][k] = DTensor.from_local(
                        v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                        run_check=False)
