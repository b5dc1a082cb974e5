"""Data-parallel training: the reference for quality and for bytes on the wire.

Every inner step the workers' gradients are averaged (mean-all-reduces in fp32, or with bf16
on the wire) before the inner optimizer steps, so M workers with batch b train like one
worker with batch M·b (exactly so in fp32). Two paths, one class: DDP's buckets reduced
during the backward pass (the common case), or one explicit mean-all-reduce in ``step()``
(see [`DataParallel`][loco.algorithms.data_parallel.DataParallel]).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.healing import ReplicaHealing
from loco.algorithms.sharding import Share, flatten_fp32, local, unflatten_views
from loco.comm import Comm
from loco.comm.codecs import get_codec
from loco.model import StagePart
from loco.options import opt

GRAD_CODECS = ("fp32", "bf16")


@dataclass
class DataParallelOptions:
    """DataParallel's own option: the gradients' wire format."""

    grad_codec: str = opt("fp32", "wire format of DataParallel's (ddp) gradients: fp32, or "
                          "bf16 as the Streaming DiLoCo paper's data-parallel baseline; the "
                          "reduction itself is fp32", GRAD_CODECS)


class DataParallel(Algorithm):
    """Data-parallel training: the gradients are averaged over the M workers every step.

    The averaged gradient is then clipped and the inner optimizer steps, the same on every
    worker. The reference for quality and for bytes on the wire.

    **Which path runs.** On a fixed Comm, with a worker of one rank, a model that is neither
    FSDP2-sharded nor a pipeline stage and fp32 parameters, the model is wrapped in
    ``torch.nn.parallel.DistributedDataParallel`` (``self.ddp``), whose buckets are averaged
    by ``comm.all_reduce_mean`` during the backward pass; the loop still calls ``model``
    (never ``self.ddp``), and DDP's rules apply: the gradient is averaged *during*
    ``backward()``, every backward pass is averaged (accumulate inside
    ``with algo.no_sync():``), and every trainable parameter must get a gradient. With FSDP2
    inside the worker (a fixed Comm, no pipeline stage), FSDP2's all-reduce hook averages
    each unit's reduce-scattered gradient shard across the workers during the backward pass
    (hybrid sharding). With workers of several ranks holding the whole model, the gradients
    are averaged inside the worker in buckets during the backward pass
    ([`GradientBuckets`][loco.algorithms.buckets.GradientBuckets]) and ``step()`` averages
    each rank's 1/R across the workers. Otherwise (pipeline stages, elastic membership, or a
    backward pass that bypassed the model's forward hooks), ``step()`` averages all
    gradients in one mean-all-reduce (a parameter without a gradient contributes zeros).

    With ``codec="bf16"`` the gradients travel as bf16 (half the bytes, as the Streaming
    DiLoCo paper's data-parallel baseline); the mean is still summed in fp32 by the chunk's
    owner and sent back in bf16, so every worker applies the same rounded mean.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the optimizer over ``model``'s parameters, stepped on the averaged
            gradient.
        comm: the communication among the M workers (``ctx.comm``).
        codec: the gradients' wire format, ``"fp32"`` (default) or ``"bf16"``.
        bucket_cap_mb: the DDP path's bucket size in MiB; default None: DDP's (25 MiB,
            and 1 MiB for the first bucket).
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks, ``ctx.inner``: its gradients are averaged inside it first, then
            each rank reduces its 1/R shard across the workers and the worker gathers them).

    Raises:
        ValueError: another ``codec``.
    """

    name = "ddp"
    title = "DataParallel"
    options = DataParallelOptions

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """The gradients' wire format."""
        return {"codec": cfg.method.grad_codec}

    @classmethod
    def setting(cls, config: dict) -> str:
        """Every step, and the gradients' wire format."""
        return f"gradients averaged every step, sent in {cls.wire(config)}"

    @classmethod
    def wire(cls, config: dict) -> str | None:
        """The gradients' wire format (fp32 for runs saved before ``grad_codec``)."""
        return config.get("grad_codec") or "fp32"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 codec: str = "fp32", bucket_cap_mb: float | None = None, **kwargs: Any):
        if codec not in GRAD_CODECS:
            raise ValueError(f"codec must be fp32 or bf16 for DataParallel (got {codec!r})")
        self.codec = None if codec == "fp32" else get_codec(codec)
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.healing = ReplicaHealing(self.healing.init_sync)  # the replica is the model
        self.ranks.average_before_step = False  # step() averages inside the worker, first
        self._wire: torch.Tensor | None = None  # the explicit path's buffer, made on first use
        self._pending: list = []  # the DDP path's buckets in flight: (handle, future, bucket)
        self._averaged: list = []  # their handles once the backward pass is over
        self._reduced = False  # whether DDP averaged the gradients of the last backward pass
        self._shards_reduced = False  # whether FSDP2's hooks averaged them across workers
        self.ddp: DistributedDataParallel | None = None
        """The DDP path's ``DistributedDataParallel`` around ``model`` (None on the explicit
        path). Its forward is not to be called: ``model``'s forward hooks drive it."""
        if self._uses_ddp():
            self._wrap(bucket_cap_mb)
        elif self._uses_fsdp_hooks():
            self._hook_fsdp()

    # ------------------------------------------------------------------------ the DDP path
    def _uses_ddp(self) -> bool:
        stage = isinstance(self.model, StagePart)
        return (not self.comm.elastic and self.inner is None and not self.ranks.sharded
                and not stage and all(p.dtype == torch.float32 for p in self.params))

    def _wrap(self, bucket_cap_mb: float | None) -> None:
        # The initial state is already broadcast and verified (Algorithm); DDP's own
        # collectives (the one re-bucketing after the first step) go through the Comm too.
        self.ddp = DistributedDataParallel(
            self.model, process_group=_CommGroup(self.comm), init_sync=False,
            gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb, **_no_buffer_sync())
        algo = weakref.ref(self)  # the hooks must not keep the algorithm alive

        def hook(_, bucket):  # (DDP checks the annotations: none under __future__'s)
            return algo()._reduce_bucket(bucket)

        def pre_forward(module, args, kwargs):
            a = algo()
            if a is None or module is not a.model:  # (a deep copy of the model: not DDP's)
                return None
            DistributedDataParallel._active_ddp_module = a.ddp  # as replicate() does
            return a.ddp._pre_forward(*args, **kwargs)

        def post_forward(module, args, output):
            a = algo()
            if a is None or module is not a.model:
                return None
            DistributedDataParallel._active_ddp_module = None
            return a.ddp._post_forward(output)

        self.ddp.register_comm_hook(None, hook)
        self._hooks = [self.model.register_forward_pre_hook(pre_forward, with_kwargs=True),
                       self.model.register_forward_hook(post_forward)]

    # ----------------------------------------------------------------- the FSDP2 path
    def _uses_fsdp_hooks(self) -> bool:
        return (self.ranks.sharded and not self.comm.elastic
                and not isinstance(self.model, StagePart) and self.comm.size > 1)

    def _hook_fsdp(self) -> None:
        """Every FSDP2 unit's reduce-scattered gradient shard is averaged across the workers
        by FSDP2's all-reduce hook, during the backward pass, as soon as the unit's
        reduce-scatter is done (hybrid sharding: FSDP2 inside the worker, DataParallel
        across)."""
        from torch.distributed.fsdp import FSDPModule

        algo = weakref.ref(self)

        def hook(shard: torch.Tensor) -> None:  # FSDP2's all-reduce stream is current
            algo()._reduce_shard(shard)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(hook)

    def _reduce_shard(self, shard: torch.Tensor) -> None:
        """One unit's gradient shard averaged across the workers, in place; FSDP2 uses it
        only after this returns (on CUDA: its stream waits for the reduction's event)."""
        handle = self.comm.all_reduce_mean(shard, tag="train", codec=self.codec)
        with record_function("loco/wait"):
            handle.wait()
        self._shards_reduced = True

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """DDP's communication hook, on the backward pass's thread: issue the bucket's
        mean-all-reduce and return at once; the backward pass goes on."""
        if not self._pending:  # the first bucket of this backward pass
            self._reduced = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        buffer = bucket.buffer()
        handle = self.comm.all_reduce_mean(buffer, tag="train", codec=self.codec)
        # (CUDA: the future orders DDP's stream after the stream that completes it)
        future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self._pending.append((handle, future, buffer))
        return future

    def _end_of_backward(self) -> None:
        """At the end of the backward pass (before DDP's own callback, which waits for the
        futures): wait for every bucket, counted as blocked time, and complete the futures."""
        pending, self._pending = self._pending, []
        error = None
        with record_function("loco/wait"):
            for handle, future, buffer in pending:
                if error is None:
                    try:
                        handle.wait()
                    except BaseException as e:  # noqa: BLE001 - raised below, after the rest
                        error = e
                if error is None:
                    future.set_result(buffer)
                else:
                    future.set_exception(error)
        if error is not None:
            raise error
        self._averaged = [handle for handle, _, _ in pending]
        self._reduced = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not average (DDP's ``no_sync``): the gradients
        accumulate on the worker, and the next backward pass outside averages the sum. Does
        nothing on the explicit path, which averages once per ``step()`` anyway."""
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    # ------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Take the inner step on the averaged gradient: averaged during the backward pass
        (DDP path), or now, blocking (explicit path)."""
        if self._shards_reduced:  # FSDP2's hooks averaged every shard during backward
            self._shards_reduced = False
            self.inner_update()
            self.inner_steps += 1
            return
        if self._reduced:
            self._reduced = False
            for handle in self._averaged:  # done: on CUDA, order this stream after them
                handle.wait()
            self._averaged = []
            self.inner_update()  # the averaged gradient: every worker decides the same
            self.inner_steps += 1
            return
        for p in self.params:  # a parameter that got no gradient contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # elastic: a worker that was behind takes a peer's state and goes on from there
        if self.healing.begin(self.comm, ("step", self.inner_steps)):
            return self._resume()
        self._average()

    def _average(self) -> None:
        if self._wire is None:  # one shard per rank of the worker; under FSDP2 its shards
            n = sum(local(p).numel() for p in self.params)
            self._wire = (self.ranks.buffer(n, self.params[0].device) if not self.ranks.sharded
                          else torch.zeros(n, device=local(self.params[0]).device))
        wire = self._wire
        buffer = wire[:sum(local(p).numel() for p in self.params)]
        if self.inner is not None and not self.ranks.sharded:  # reduced during backward
            self.ranks.average_gradients()
        grads = [local(p.grad) for p in self.params]
        flatten_fp32(grads, out=buffer)
        # The profiler's ranges (docs/profiling.md): encode, all_to_all, reduce, all_gather,
        # decode on the communication thread, wait here, then inner_step.
        if self.inner is None or self.ranks.sharded:  # (FSDP2 has averaged inside the worker)
            handle = self.comm.all_reduce_mean(buffer, tag="train", codec=self.codec)
            with record_function("loco/wait"):
                healed = self.comm.settle(handle) is None
            if healed:  # elastic: healed during a retry
                return self._resume()
        else:  # averaged inside the worker (fast), then shard r across workers (slow)
            handle = self.comm.all_reduce_mean(self.ranks.own(wire), tag="train",
                                               codec=self.codec)
            with record_function("loco/wait"):
                healed = self.comm.settle(handle) is None
            if healed:  # elastic: healed during a retry
                return self._resume()
            self.ranks.gather(wire)
        torch._foreach_copy_(grads, unflatten_views(buffer, grads))
        self.inner_update()  # the averaged gradient: every worker decides the same
        self.inner_steps += 1

    def outer_tensors(self) -> list[torch.Tensor]:
        """The explicit path's buffer of the gradients it averages, once made."""
        return [] if self._wire is None else [self._wire]

    def replicated_tensors(self) -> list[torch.Tensor]:
        """This rank's share of the parameters: the replicas are the global model."""
        return Share(self.params, self.inner).views

    # ------------------------------------------------------------------ elastic membership
    def _resume(self) -> None:
        """Take part in the step the live worker was at, with a zero gradient."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self._average()


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's argument that turns off its buffer broadcast before each forward pass:
    ``forward_sync_buffers`` where this torch has it (2.12 on; ``broadcast_buffers`` warns
    there), ``broadcast_buffers`` before (torch 2.11 has no ``forward_sync_buffers``: passing
    it is a TypeError). With ``init_sync=False`` neither syncs at construction."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return ({"forward_sync_buffers": False} if "forward_sync_buffers" in names
            else {"broadcast_buffers": False})


class _Done(dist._Work):
    """A finished operation, for DDP."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = torch.futures.Future()
        self._result.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._result


class _CommGroup(dist.ProcessGroup):
    """The ``ProcessGroup`` DDP is built on: its collectives go through the Comm (counted,
    in order with the Comm's other operations, on either launcher's transport). DDP issues
    only one kind here: the broadcast of the rebuilt buckets' layout after the first step
    (tag ``"setup"``); the gradients go through the communication hook instead."""

    def __init__(self, comm: Comm):
        super().__init__(comm.rank, comm.size)
        self._comm = comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "loco"

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        for t in tensors:
            self._comm.broadcast(t, src=opts.rootRank, tag="setup").wait()
        return _Done(tensors)
