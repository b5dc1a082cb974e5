"""A dry run of one rank: the run's own code on the meta device, over a loopback transport.

The model is built as ``loco train`` builds it (`make_model` on the meta device; sharded by
FSDP2 with ``--worker-parallel fsdp``, over torch's fake process group), then the inner
optimizer and the method (``cfg.method_class.from_config``), over Comms whose transport does
nothing ([`DryComm`][loco.plan.dryrun.DryComm]): every operation counts its bytes as a run
does, with the Comm's own formulas, and runs its arithmetic on meta tensors, so the Comm's
kept buffers take the shapes a run's take. Then the loop's inner steps (``_steps``) and the
flush: each sync is issued, waited for and applied by the method's own ``step``. Nothing is
allocated (a meta tensor has a shape and no data) and nothing is sent: a 70B model plans in
seconds.

Values a run would read on the host (``bool(t)``, ``t.item()``, a checksum) do not exist on
the meta device: [`HostReads`][loco.plan.dryrun.HostReads] answers them as a healthy run
would (finite, equal, nothing skipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from loco.comm import Comm
from loco.config import TrainConfig
from loco.runtime import Mesh, RankContext, shard_worker
from loco.training.build import make_local_steps, make_model, make_optimizer, mixed_precision
from loco.training.counters import memory_bytes
from loco.training.worker import Loop

aten = torch.ops.aten
META = torch.device("meta")


class HostReads(TorchDispatchMode):
    """Answers the host reads of meta tensors as a healthy run's would be: ``bool(t)`` and a
    bool tensor read on the host True (every value finite), a number 0 (no non-finite value, no step skipped), ``equal``
    True (the workers agree). A small host tensor copied to the meta device and back (DDP's
    rebuilt bucket order, broadcast over the process group) keeps its values. Every other
    operation runs as it is."""

    def __init__(self):
        super().__init__()
        self._kept: dict[tuple, torch.Tensor] = {}  # a meta tensor's values, where known

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 0
        if func is aten.equal.default and args[0].is_meta:
            return True
        if (func is aten._to_copy.default and args[0].is_meta
                and torch.device((kwargs or {}).get("device") or META).type != "meta"):
            return self._read(args[0], kwargs)
        if func is aten.copy_.default and args[0].is_meta != args[1].is_meta:
            return self._copy(*args)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _read(src: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """A meta tensor read on the host (``tolist``, ``cpu``): True where bool, else 0."""
        dtype = kwargs.get("dtype") or src.dtype
        fill = torch.ones if src.dtype == torch.bool else torch.zeros
        return fill(src.shape, dtype=dtype, device=kwargs["device"])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, *rest) -> torch.Tensor:
        """``dst.copy_(src)`` between the host and the meta device, the values kept."""
        if dst.is_meta:
            if src.numel() <= KEPT_VALUES:
                self._kept[_where(dst)] = src.detach().clone()
            return dst.copy_(src, *rest)
        kept = self._kept.get(_where(src))
        if kept is None or kept.shape != src.shape:
            raise NotImplementedError(f"a meta tensor of shape {tuple(src.shape)} has no "
                                      "values to copy to the host")
        return dst.copy_(kept)


#: The most values of a host tensor whose meta copy keeps them (``HostReads``).
KEPT_VALUES = 1 << 16


def _where(t: torch.Tensor) -> tuple:
    return t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride())


class _Done:
    """A finished transport operation."""

    def wait(self, *args) -> bool:
        return True


class LoopbackGroup:
    """A process group whose collectives and point-to-point operations do nothing: the dry
    run's transport (the Comm counts the bytes before it calls the group)."""

    def alltoall_base(self, *args) -> _Done:
        """All-to-all: nothing moves."""
        return _Done()

    def allreduce(self, *args) -> _Done:
        """All-reduce: nothing moves."""
        return _Done()

    def _allgather_base(self, *args) -> _Done:
        return _Done()

    def send(self, *args) -> _Done:
        """Send: nothing moves."""
        return _Done()

    def recv(self, *args) -> _Done:
        """Receive: nothing moves."""
        return _Done()


class InlineThread:
    """A Comm's issuing thread that runs each operation at once, on the caller's thread (so
    under its [`HostReads`][loco.plan.dryrun.HostReads])."""

    def attach(self) -> None:
        """One more Comm issues here (nothing to count)."""

    def release(self, join: bool = True) -> None:
        """A Comm is done (nothing to stop).

        Args:
            join: unused.
        """

    def submit(self, future, fn) -> None:
        """Run ``fn`` now; an exception it raises completes ``future``.

        Args:
            future: the operation's future.
            fn: the operation's body.
        """
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            if not future.done():
                future.set_exception(e)


@dataclass
class Sync:
    """One training operation of the dry run: its record (bytes), the inner step it was
    issued at, the step whose ``step()`` first waited for it (None: never, or at the
    ``flush``), and whether the ``flush`` after the last step issued it."""

    record: object
    issued: int
    waited: int | None = None
    at_flush: bool = False


class DryComm(Comm):
    """A [`Comm`][loco.comm.comm.Comm] on the meta device over a
    [`LoopbackGroup`][loco.plan.dryrun.LoopbackGroup], issuing inline: the Comm's own byte
    counts and buffers, no transport. It logs every operation with the inner step it was
    issued and waited at (``step``, set by the dry run), and skips the initial checksums
    (meta tensors have no bytes to hash; the workers agree by construction).

    Args:
        rank: this rank's place in the group, in [0, size).
        size: the ranks of the group, >= 1.
        name: the Comm's name; default ``"replicas"``.
    """

    def __init__(self, rank: int, size: int, name: str = "replicas"):
        super().__init__(LoopbackGroup(), rank, size, META, name=name, thread=InlineThread())
        self.step = 0
        """The inner step being run (0: building)."""
        self.flushing = False
        """Whether the flush after the last step is running."""
        self.log: list[Sync] = []
        """Every operation of tag ``train``, in issue order."""

    def _submit(self, op, tag, raw, sent, recv, fn, tensors, participants=None, phases=1):
        handle = super()._submit(op, tag, raw, sent, recv, fn, tensors, participants, phases)
        if tag != "train":
            return handle
        sync = Sync(handle.record, self.step, at_flush=self.flushing)
        self.log.append(sync)
        wait = handle.wait

        def waited(*args, **kwargs):
            if sync.waited is None and not self.flushing:
                sync.waited = self.step
            return wait(*args, **kwargs)
        handle.wait = waited
        return handle

    def verify_identical(self, tensors, what: str = "parameters") -> None:
        """Nothing to compare (see the class).

        Args:
            tensors: unused.
            what: unused.
        """


@dataclass
class RankRun:
    """What one rank's dry run found.

    Args:
        memory: the bytes of the tensors it holds, by part, at the end (what a run's
            ``memory_bytes`` reports; ``memory_bytes_per_rank`` in its summary).
        steps: the inner steps run (then the ``flush``).
        slow: the training operations on the slow link (``ctx.comm``), in issue order.
        fast: those on the fast link inside the worker (``ctx.inner``; empty for R = 1).
        fsdp_step_bytes: FSDP2's all-gathers and reduce-scatters of one training step on the
            fast link (0 without FSDP2).
        parameters: the whole model's parameters.
    """

    memory: dict[str, int]
    steps: int
    slow: list[Sync]
    fast: list[Sync]
    fsdp_step_bytes: int
    parameters: int


def dry_run(cfg: TrainConfig, vocab_size: int, steps: int, shard: int = 0) -> RankRun:
    """Build rank ``shard`` of worker 0 as ``loco train`` builds it, on the meta device, and
    run ``steps`` inner steps, then the flush, as a run of that many steps ends.

    Args:
        cfg: a valid, resolved configuration (``stages`` 1).
        vocab_size: the tokenizer's vocabulary.
        steps: the inner steps to run, >= 1.
        shard: the rank's index inside its worker, in [0, ``worker_ranks``).
    """
    M, R = cfg.runtime.workers, cfg.runtime.worker_ranks
    comm = DryComm(0, M)
    inner = DryComm(shard, R, name="inner") if R > 1 else None
    with _fsdp_mesh(cfg, shard) as device_mesh:
        ctx = RankContext(shard, M * R, Mesh(M, 1, R), comm, META, cfg.runtime.launcher, inner=inner,
                          device_mesh=device_mesh)
        model = make_model(cfg, vocab_size, "meta")
        parameters = model.num_parameters()
        if device_mesh is not None:
            model = shard_worker(model, ctx, mixed_precision(cfg))
        with HostReads():
            optimizer = make_optimizer(model, cfg)
            algo = cfg.method_class.from_config(cfg, model, optimizer, comm, None, inner)
            plan = make_local_steps(cfg, ctx, algo, Loop())
            _steps(cfg, algo, steps, [c for c in (comm, inner) if c is not None], plan)
            memory = memory_bytes(algo, ctx)
        fsdp = fsdp_step_bytes(model, R, cfg) if device_mesh is not None else 0
    return RankRun(memory, steps, comm.log, inner.log if inner else [], fsdp, parameters)


def _steps(cfg: TrainConfig, algo, steps: int, comms: list[DryComm], plan=None) -> None:
    """``steps`` inner steps of ``algo``, then ``flush``. Each step is the loop's: a forward
    and backward pass (`Passes`), ``step()``, ``zero_grad()``; with speed-aware local steps
    (``plan``), the plan's bookkeeping and its gathers of the step times, every worker as
    fast as the others. Clipping keeps no state: its arithmetic is skipped (the norm is
    0); after the first step the inner optimizer's state exists and later inner updates
    change no size, so the optimizer's step is skipped too."""
    passes = Passes(cfg, algo, comms)
    algo.clip_gradients = _zero_norm
    for t in range(1, steps + 1):
        for c in comms:
            c.step = t
        if plan is not None and not plan.trains(t):
            algo.idle_step()
        else:
            passes.run(t)
            algo.step()
            if not algo.ranks.sharded:
                algo.zero_grad()
            if plan is not None:
                plan.trained(STEP_SECONDS)
        if t == 1:
            algo.inner_optimizer.step = _no_step
        if plan is not None:
            plan.tick_done(comms[0], t)
    for c in comms:
        c.flushing = True
    algo.flush()


class Passes:
    """The forward and backward passes of a dry run's steps. The first two run the model on
    a batch of meta tokens (the second as every later one: DDP rebuilds its buckets after
    the first), and the second records the order in which the gradients arrive. Later ones
    cost less: where the method reduced nothing during the backward pass, there is none
    (the gradients are set); where it did (DDP's buckets, a worker's gradient buckets), a
    stand-in forward whose backward produces every gradient in the recorded order, so the
    same reductions are issued in the same order. FSDP2 refuses to run a model left on the
    meta device: a sharded model gets its gradients set every step.

    Args:
        cfg: the run's configuration (``batch_size``, ``seq_len``).
        algo: the method, over the model.
        comms: its dry Comms.
    """

    def __init__(self, cfg: TrainConfig, algo, comms: list[DryComm]):
        self.cfg, self.algo, self.comms = cfg, algo, comms
        self.mode = "set" if algo.ranks.sharded else "model"
        self.order: list[torch.Tensor] = []

    def run(self, t: int) -> None:
        """The passes of inner step ``t`` (1, 2, ...)."""
        model = self.algo.model
        if self.mode == "set":
            for p in self.algo.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        if self.mode == "replay":
            model.forward, stand_in = self._stand_in, model.forward
            try:
                model().backward()
            finally:
                model.forward = stand_in
            return
        issued = sum(len(c.log) for c in self.comms)
        hooks = ([p.register_post_accumulate_grad_hook(self.order.append)
                  for p in self.algo.params] if t == 2 else [])
        tokens = torch.zeros(self.cfg.data.batch_size, self.cfg.data.seq_len, dtype=torch.long,
                             device=META)
        model(tokens, tokens).backward()
        for h in hooks:
            h.remove()
        if t == 2:
            reduced = sum(len(c.log) for c in self.comms) > issued
            self.mode = "replay" if reduced and self.order else "set"

    def _stand_in(self, *args, **kwargs) -> torch.Tensor:
        # The term made last is differentiated first: the recorded order, first to last.
        terms = [(p * 0).sum() for p in reversed(self.order)]
        return torch.stack(terms).sum()


#: The nominal time of an inner step that speed-aware local steps record in a dry run (the
#: same for every worker: they train alike).
STEP_SECONDS = 1.0


def _no_step(*args, **kwargs) -> None:
    return None


def _zero_norm() -> torch.Tensor:
    return torch.zeros((), device=META)


@contextmanager
def _fsdp_mesh(cfg: TrainConfig, shard: int) -> Iterator[object]:
    """With ``--worker-parallel fsdp`` and R > 1: a ``DeviceMesh`` of the worker's R ranks
    named ``shard``, over torch's fake process group as rank ``shard`` (its collectives do
    nothing), for FSDP2 to shard the model over; None otherwise.

    Raises:
        RuntimeError: a process group is already initialized in this process.
    """
    if cfg.runtime.worker_parallel != "fsdp" or cfg.runtime.worker_ranks == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("loco plan builds FSDP2 over a fake process group of its own; "
                           "this process already has a process group")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=shard, world_size=cfg.runtime.worker_ranks)
    try:
        yield init_device_mesh("cpu", (cfg.runtime.worker_ranks,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def fsdp_step_bytes(model: torch.nn.Module, R: int, cfg: TrainConfig) -> int:
    """The bytes a rank sends over the fast link for FSDP2 in one training step, as loco
    counts them (``loco.runtime.fsdp``: a collective of R ranks sends R − 1 shards): each
    FSDP2 unit all-gathers its parameters' padded shards (ceil(rows / R) rows each, in
    ``--dtype``'s gather dtype) before its forward and again before its backward (the root
    unit once: it is not resharded after the forward), and reduce-scatters its gradients
    (fp32) once.

    Args:
        model: the model as ``shard_worker`` left it (its units are ``FSDPModule``s).
        R: the ranks of the worker, >= 2.
        cfg: the run's configuration (``dtype``).
    """
    from torch.distributed.fsdp import FSDPModule

    policy = mixed_precision(cfg)
    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        params = _unit_params(module, FSDPModule)
        padded = sum(math.ceil(p.shape[0] / R) * math.prod(p.shape[1:]) for p in params)
        gather = policy.param_dtype.itemsize if policy else params[0].dtype.itemsize
        scatter = policy.reduce_dtype.itemsize if policy else params[0].dtype.itemsize
        gathers = 1 if module is model else 2
        total += (R - 1) * padded * (gathers * gather + scatter)
    return total


def _unit_params(unit: torch.nn.Module, kind: type) -> list[torch.Tensor]:
    """The parameters an FSDP2 unit manages: its own, less those of units inside it."""
    inside = {id(p) for m in unit.modules() if m is not unit and isinstance(m, kind)
              for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in inside]


__all__ = ["DryComm", "HostReads", "InlineThread", "LoopbackGroup", "RankRun", "Sync",
           "dry_run", "fsdp_step_bytes"]
