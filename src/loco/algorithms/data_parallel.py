"""Data-parallel training: the reference for quality and for bytes on the wire.

Every inner step the workers' gradients are averaged (one fp32 mean-all-reduce of all
gradients) before the inner optimizer steps, so M workers with batch b train exactly like one
worker with batch M·b.
"""

from __future__ import annotations

import torch

from loco.algorithms.base import Algorithm, flatten_fp32, unflatten_views


class DataParallel(Algorithm):
    def __init__(self, model, inner_optimizer, comm, **kwargs):
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self._grads = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32,
                                  device=self.params[0].device)

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:  # a parameter that got no gradient contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flatten_fp32([p.grad for p in self.params], out=self._grads)
        self.comm.all_reduce_mean(self._grads, tag="train").wait()
        for p, g in zip(self.params, unflatten_views(self._grads, self.params)):
            p.grad.copy_(g)
        self.inner_update()  # the averaged gradient: every worker decides the same
        self.inner_steps += 1
