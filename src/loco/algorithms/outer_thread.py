"""The outer step of a fragment on a thread of its own, while the inner steps go on.

With overlap (τ ≥ 1), [`OuterThread`][loco.algorithms.outer_thread.OuterThread] computes the
outer step as soon as Δ̄_p arrives, on a helper thread, into a *shadow* of the global copy
and its outer momentum; the training thread swaps the shadow in (no copy) at the step where
the sync is applied. The committed global copy and momentum are never written before then,
so checkpoints, evaluations and skipped syncs see what they see without the thread, and the
results are bit for bit the same. When it pays, and what it costs, is in
docs/algorithms/streaming.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.sgd import sgd
from torch.profiler import record_function

from loco.algorithms.fragments import momentum_of
from loco.algorithms.nonfinite import all_finite
from loco.algorithms.sharding import unflatten_views
from loco.comm import Handle


@dataclass
class Stepped:
    """What the helper thread computed for one sync."""

    finite: bool  # whether Δ̄_p (this rank's share) is finite; nothing stepped if not
    global_flat: torch.Tensor | None = None  # the stepped shadow of θ^g_p
    momentum: torch.Tensor | None = None  # the stepped shadow of the outer momentum
    ready: Any = None  # CUDA: an event after the helper's last kernel


class OuterThread:
    """Outer steps computed on a helper thread, committed on the training thread.

    On a GPU the helper has a CUDA stream of its own on the model's device, also when the
    global copies are offloaded to the CPU: the all-reduce's hand-over and the copy of Δ̄ to
    the host wait on that stream, never on the training stream, and the host waits for that
    copy alone (an event). Two buffers are shared with the training stream and ordered by
    events: Δ̄'s device buffer, which the merge reuses after the helper copied from it (the
    training stream waits for the helper's last event at ``commit``), and the spare shadows,
    which an earlier merge may still be copying to the device (the helper waits, on the
    host, for the training stream's event recorded when the shadow was swapped out).

    Args:
        device: the device of the global copies (CPU when offloaded).
        compute: the model's device, where Δ̄ lives; default ``device``.
    """

    def __init__(self, device: torch.device, compute: torch.device | None = None):
        self.device, self.compute = device, compute or device
        self._spares: dict[int, tuple[torch.Tensor, torch.Tensor | None, Any]] = {}
        self._stream = (torch.cuda.Stream(self.compute) if self.compute.type == "cuda"
                        else None)

    def start(self, fragment: Any, handle: Handle) -> Future:
        """Start the outer step of ``fragment`` once ``handle`` (its all-reduce) is done.

        Args:
            fragment: a Streaming DiLoCo `Fragment` whose
                ``delta`` the all-reduce is averaging.
            handle: the all-reduce's handle.

        Returns:
            A future of the helper's result (a `Stepped`).
        """
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self._step(fragment, handle))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)

        # A daemon: a transport stuck in a failed run must not keep the process alive.
        threading.Thread(target=run, name="loco-outer-step", daemon=True).start()
        return future

    @staticmethod
    def wait(future: Future, handle: Handle) -> Stepped:
        """On the training thread: the helper's result; the time spent waiting for it is
        counted as the sync's wait.

        Args:
            future: what ``start`` returned.
            handle: the sync's all-reduce.
        """
        t0 = time.perf_counter()
        with record_function("loco/wait"):
            stepped = future.result()
        handle.count_wait(time.perf_counter() - t0)
        return stepped

    @torch.no_grad()
    def _step(self, f: Any, handle: Handle) -> Stepped:
        with self._on_stream():
            handle.wait(count=False)  # the training thread counts its own wait
            with record_function("loco/outer_step"):
                if f.grad is not f.delta:  # offloaded: Δ̄ comes over in one copy
                    f.grad.copy_(f.delta, non_blocking=True)
                    self._host_waits_for(self._record())  # that copy alone, not the device
                if not all_finite(f.grad):
                    return Stepped(False)
                global_flat, momentum = self._shadows(f)
                group = f.outer_optimizer.param_groups[0]
                buffers = [momentum]
                sgd([global_flat], [f.grad], buffers, foreach=group["foreach"],
                    fused=group["fused"], weight_decay=group["weight_decay"],
                    momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                    nesterov=group["nesterov"], maximize=group["maximize"])
                return Stepped(True, global_flat, buffers[0], self._record())

    def _shadows(self, f: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Spare buffers holding copies of ``f``'s global copy and momentum (None before
        the first outer step: the step creates it, as the optimizer's own does)."""
        spare_global, spare_momentum, free = self._spares.pop(f.global_flat.numel(),
                                                              (None, None, None))
        self._host_waits_for(free)  # a merge's copy to the device may still read it
        if spare_global is None:
            spare_global = _like(f.global_flat)
        spare_global.copy_(f.global_flat)
        momentum = momentum_of(f)
        if momentum is None:
            return spare_global, None
        if spare_momentum is None:
            spare_momentum = _like(momentum)
        spare_momentum.copy_(momentum)
        return spare_global, spare_momentum

    def commit(self, f: Any, stepped: Stepped) -> None:
        """On the training thread: make the stepped shadows ``f``'s global copy and
        momentum (a swap of storage, no copy); the old ones become the spares.

        Args:
            f: the fragment.
            stepped: the helper's finite result for it.
        """
        if stepped.ready is not None:  # CUDA: the merge reads what the helper wrote
            torch.cuda.current_stream(self.compute).wait_event(stepped.ready)
        old_global, old_momentum = f.global_flat.detach(), momentum_of(f)
        free = None
        if self._stream is not None:  # after every use the training stream made of the old
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.compute))
        f.global_flat.set_(stepped.global_flat)  # same tensor object: the optimizer's key
        f.global_params = unflatten_views(f.global_flat, f.share.views)
        if stepped.momentum is not None:
            f.outer_optimizer.state[f.global_flat]["momentum_buffer"] = stepped.momentum
        self._spares[f.global_flat.numel()] = (old_global, old_momentum, free)

    def tensors(self) -> list[torch.Tensor]:
        """The spare shadows it keeps (one global copy and momentum per fragment size, from
        the first commit of that size on), for the memory report."""
        return [t for spare in list(self._spares.values()) for t in spare[:2] if t is not None]

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """CUDA: the helper's own stream (and device) for its copies and kernels."""
        if self._stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.compute))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _record(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    @staticmethod
    def _host_waits_for(event: Any) -> None:
        """Block this (helper) thread until ``event`` (None: nothing to wait for)."""
        if event is not None:
            event.synchronize()


def _like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t``, page-locked like it."""
    out = torch.empty_like(t)
    return out.pin_memory() if t.is_pinned() else out
