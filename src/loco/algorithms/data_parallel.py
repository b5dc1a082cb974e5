"""Data-parallel training: the reference for quality and for bytes on the wire.

Every inner step the workers' gradients are averaged (one fp32 mean-all-reduce of all
gradients) before the inner optimizer steps, so M workers with batch b train exactly like one
worker with batch M·b.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loco.algorithms.base import Algorithm, flatten_fp32, unflatten_views
from loco.comm import Comm


class DataParallel(Algorithm):
    """Data-parallel training: the gradients are averaged over the M workers every step.

    One fp32 mean-all-reduce of all gradients per inner step (a parameter without a gradient
    contributes zeros), then clipping and the inner optimizer on the averaged gradient, the
    same on every worker. The reference for quality and for bytes on the wire.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the optimizer over ``model``'s parameters, stepped on the averaged
            gradient.
        comm: the communication among the M workers (``ctx.comm``).
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 **kwargs: Any):
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self._grads = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32,
                                  device=self.params[0].device)

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients over the workers (blocking), then take the inner step."""
        for p in self.params:  # a parameter that got no gradient contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flatten_fp32([p.grad for p in self.params], out=self._grads)
        self.comm.all_reduce_mean(self._grads, tag="train").wait()
        for p, g in zip(self.params, unflatten_views(self._grads, self.params)):
            p.grad.copy_(g)
        self.inner_update()  # the averaged gradient: every worker decides the same
        self.inner_steps += 1
