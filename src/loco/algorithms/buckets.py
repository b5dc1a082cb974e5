"""Gradients averaged over a worker's ranks while the backward pass runs, in buckets, as
torch's DDP does: the reduction of the last layers' gradients overlaps the backward pass of
the first ones.

A worker of R ranks holding the whole model (``--worker-parallel ddp``) averages every
gradient over its ranks before each inner step. `GradientBuckets` groups the trained
parameters in reverse order (the order the backward pass produces their gradients) into
buckets of at most ``BUCKET_BYTES``; a hook on each parameter (``post_accumulate_grad``)
copies its gradient into its bucket's slice of one kept fp32 buffer, and the bucket's mean
all-reduce is issued on the fast-link Comm as soon as its last gradient is in, while the
backward pass goes on. ``finish()`` issues what is left (a parameter that got no gradient
contributes zeros), waits, and puts the means back into the gradients.
"""

from __future__ import annotations

import torch

from loco.comm import Comm, Handle

BUCKET_BYTES = 25 << 20
"""The most fp32 bytes of gradients one bucket reduces at once (DDP's default, 25 MiB)."""


class GradientBuckets:
    """The mean of every gradient over ``comm``, reduced bucket by bucket during backward.

    Every rank of ``comm`` must hold the same parameters (shapes and order) and run the same
    backward passes. A backward pass that runs again before ``finish()`` (gradient
    accumulation) reduces again the buckets it touches, after the first reduction: the
    result is always the mean of the accumulated gradients.

    Args:
        params: the trained parameters, in the model's order (not sharded).
        comm: the worker's fast-link Comm (``ctx.inner``), of R >= 2 ranks.
        bucket_bytes: the most bytes of one bucket; default ``BUCKET_BYTES``.

    Raises:
        ValueError: no parameters, or ``bucket_bytes`` < 4.
    """

    def __init__(self, params: list[torch.Tensor], comm: Comm,
                 bucket_bytes: int = BUCKET_BYTES):
        if not params:
            raise ValueError("GradientBuckets needs at least one parameter")
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be >= 4 (got {bucket_bytes})")
        self.comm, self.params = comm, params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                                device=params[0].device)
        """The kept fp32 buffer every bucket is a slice of."""
        self.buckets: list[list[int]] = []  # parameter indices, in reverse order
        self._view: dict[int, torch.Tensor] = {}  # parameter index -> its slice of flat
        self._bucket_of: dict[int, int] = {}
        self._lay_out(bucket_bytes // 4)
        self._left = [len(b) for b in self.buckets]
        self._handles: dict[int, Handle] = {}
        self._again: set[int] = set()  # buckets whose gradients grew after their issue
        self._fired: set[int] = set()  # parameters whose gradient is in (this backward)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(params)]

    def _lay_out(self, per_bucket: int) -> None:
        """Buckets of whole parameters in reverse order, each of at most ``per_bucket``
        values (a larger parameter alone), laid out in ``flat`` one after another."""
        at, current, size = 0, [], 0
        for i in reversed(range(len(self.params))):
            n = self.params[i].numel()
            if current and size + n > per_bucket:
                self.buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += n
            self._view[i] = self.flat[at:at + n].view_as(self.params[i])
            self._bucket_of[i] = len(self.buckets)
            at += n
        self.buckets.append(current)

    def _bucket_flat(self, b: int) -> torch.Tensor:
        first, last = self.buckets[b][0], self.buckets[b][-1]
        start = self._view[first].data_ptr() - self.flat.data_ptr()
        stop = self._view[last].data_ptr() - self.flat.data_ptr() + self._view[last].nbytes
        return self.flat[start // 4:stop // 4]

    def _hook(self, i: int):
        def ready(p: torch.Tensor) -> None:  # on the backward pass's thread
            b = self._bucket_of[i]
            if b in self._handles:  # accumulated again after its bucket went
                self._again.add(b)
                return
            self._view[i].copy_(p.grad)
            if i not in self._fired:
                self._fired.add(i)
                self._left[b] -= 1
                if self._left[b] == 0:
                    self._issue(b)
        return ready

    def _issue(self, b: int) -> None:
        self._handles[b] = self.comm.all_reduce_mean(self._bucket_flat(b), tag="train")

    @torch.no_grad()
    def finish(self) -> None:
        """Issue the buckets still waiting for a gradient (a parameter whose hook did not
        run gives its gradient as it is, or zeros for none), wait for every bucket, and set
        each parameter's gradient to the mean."""
        for b in range(len(self.buckets)):
            if b not in self._handles:
                for i in self.buckets[b]:
                    if i not in self._fired:
                        grad = self.params[i].grad
                        self._view[i].copy_(grad) if grad is not None else self._view[i].zero_()
                self._issue(b)
        for b in sorted(self._handles):
            self._handles[b].wait()
        for b in sorted(self._again):  # gradient accumulation: reduce the sums again
            for i in self.buckets[b]:
                if self.params[i].grad is not None:
                    self._view[i].copy_(self.params[i].grad)
            self._issue(b)
            self._handles[b].wait()
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(self._view[i])
        self._handles.clear()
        self._again.clear()
        self._fired.clear()
        self._left = [len(b) for b in self.buckets]

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["BUCKET_BYTES", "GradientBuckets"]
