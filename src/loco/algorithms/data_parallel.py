"""Data-parallel training: the reference for quality and for bytes on the wire.

Every inner step the workers' gradients are averaged (one mean-all-reduce of all gradients,
in fp32 or with bf16 on the wire) before the inner optimizer steps, so M workers with batch b
train exactly like one worker with batch M·b (exactly so in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.sharding import flatten_fp32, local, unflatten_views
from loco.comm import Comm
from loco.comm.codecs import get_codec


class DataParallel(Algorithm):
    """Data-parallel training: the gradients are averaged over the M workers every step.

    One mean-all-reduce of all gradients per inner step (a parameter without a gradient
    contributes zeros), then clipping and the inner optimizer on the averaged gradient, the
    same on every worker. The reference for quality and for bytes on the wire.

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
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks, ``ctx.inner``: its gradients are averaged inside it first, then
            each rank reduces its 1/R shard across the workers and the worker gathers them).

    Raises:
        ValueError: another ``codec``.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 codec: str = "fp32", **kwargs: Any):
        if codec not in ("fp32", "bf16"):
            raise ValueError(f"codec must be fp32 or bf16 for DataParallel (got {codec!r})")
        self.codec = None if codec == "fp32" else get_codec(codec)
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.average_inner = False  # step() averages inside the worker itself, first
        n = sum(local(p).numel() for p in self.params)
        # One shard per rank of the worker; under FSDP2 each rank's gradients are its shards.
        self._wire = (self.shard_buffer(n, self.params[0].device) if not self.sharded
                      else torch.zeros(n, device=local(self.params[0]).device))
        self._grads = self._wire[:n]

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients over the workers (blocking), then take the inner step."""
        for p in self.params:  # a parameter that got no gradient contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._syncing = ("step", self.inner_steps)
        if self.comm.begin():  # elastic: this worker was behind and took a peer's state
            return self._resume()
        self._average()

    def _average(self) -> None:
        grads = [local(p.grad) for p in self.params]
        flatten_fp32(grads, out=self._grads)
        # The profiler's ranges (docs/profiling.md): encode, all_to_all, reduce, all_gather,
        # decode on the communication thread, wait here, then inner_step.
        if self.inner is None or self.sharded:  # (FSDP2 has averaged inside the worker)
            handle = self.comm.all_reduce_mean(self._grads, tag="train", codec=self.codec)
            with record_function("loco/wait"):
                healed = self.comm.settle(handle) is None
            if healed:  # elastic: healed during a retry
                return self._resume()
        else:  # inside the worker (fast), then shard r across workers (slow), gathered
            self.inner.all_reduce_mean(self._grads, tag="train").wait()
            handle = self.comm.all_reduce_mean(self.own_shard(self._wire), tag="train",
                                               codec=self.codec)
            with record_function("loco/wait"):
                healed = self.comm.settle(handle) is None
            if healed:  # elastic: healed during a retry
                return self._resume()
            self.gather_shards(self._wire)
        torch._foreach_copy_(grads, unflatten_views(self._grads, grads))
        self.inner_update()  # the averaged gradient: every worker decides the same
        self.inner_steps += 1

    # ------------------------------------------------------------------ elastic membership
    def heal_state(self) -> dict:
        """The replica is the global model here: a worker that is behind receives the
        parameters and the inner optimizer's state, with the counters."""
        full = self.state_dict(tensors=True)
        return {**full, "syncing": self._syncing}

    @torch.no_grad()
    def load_heal_state(self, state: dict) -> None:
        """Take a live worker's model, inner optimizer and counters (see ``heal_state``).

        Args:
            state: a dict from ``heal_state()`` of a worker of the same job.
        """
        self.load_state_dict({k: v for k, v in state.items() if k != "syncing"})
        self._syncing = state["syncing"]

    def _resume(self) -> None:
        """Take part in the step the live worker was at, with a zero gradient."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self._average()
