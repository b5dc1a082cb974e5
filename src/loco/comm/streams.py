"""How a Comm hands tensors between the caller and its communication thread.

On CPU there is nothing to hand over: gloo reads and writes the tensors themselves, and an
operation is complete when gloo says so ([`HostSync`][loco.comm.streams.HostSync]).

On CUDA, kernels only *queue* on a stream. A tensor the training stream is still writing
must not be sent before those kernels ran, and a result must not be read before the
transfer wrote it; synchronising the whole device for that would stall training on every
operation and defeat the overlap. [`CudaStreams`][loco.comm.streams.CudaStreams] follows
the CUDA semantics that PyTorch documents for streams and NCCL instead:

* each Comm owns a CUDA stream, and its communication thread issues everything on it
  (NCCL runs its kernels on an internal stream and orders them after the *current* stream,
  which is then this one; ``work.wait()`` makes it wait for them, without blocking the CPU);
* at issue, an event recorded on the caller's stream is waited on by the communication
  stream (``wait_event``), and the inputs are marked as used by it (``record_stream``), so
  the caching allocator does not reuse their memory while the transfer still reads it;
* at the end of an operation an event is recorded on the communication stream; ``done()``
  queries it, and ``wait()`` makes the caller's stream wait on it and marks the results as
  used there. Neither blocks the CPU, and nothing synchronises the device;
* the events are timed: an operation's time in flight runs from the caller's event at issue
  to the completion event, and a wait's from an event on the caller's stream where the wait
  began to one after it, on the device's clock (the host returns long before), read once
  they have happened (``loco.comm.accounting.DeviceTimes``).

This module is the only place with CUDA-specific code in the communication layer; what has
run on a GPU: docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """The tensors of an operation's result: a tensor, or a list of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [t for t in items if hasattr(t, "record_stream")]


class HostSync:
    """Tensors in host memory (gloo): issued work is complete when the transport says so.

    ``blocking_completion`` is True: gloo tells that a point-to-point operation finished
    only through a blocking ``wait()`` (see docs/gpu.md), so a Comm waits for them on a
    helper thread.
    """

    blocking_completion = True

    def issue(self, tensors: Iterable[torch.Tensor]) -> Any:
        """On the caller's thread, when an operation is issued; returns what ``run`` needs.

        Args:
            tensors: the operation's input and output tensors.
        """
        return None

    def run(self, ready: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """On the communication thread: run ``fn``; return its result and a completion mark.

        Args:
            ready: what ``issue`` returned.
            fn: the operation's body.
        """
        return fn(), None

    def finished(self, done: Any) -> bool:
        """Whether the device finished the operation marked ``done`` (never blocks).

        Args:
            done: the completion mark ``run`` returned.
        """
        return True

    def synchronize(self, done: Any) -> None:
        """Block the calling thread (only it) until the operation marked ``done`` finished.

        Args:
            done: the completion mark ``run`` returned.
        """

    def hand_over(self, done: Any, result: Any) -> None:
        """On the thread that waits: make its work come after the operation's.

        Args:
            done: the completion mark ``run`` returned.
            result: the operation's result (its tensors are now used by the caller).
        """

    def mark(self) -> Any:
        """A mark of the calling thread's work so far on the device's clock, or None where
        the host's clock tells the time (here: the operations run on the host)."""
        return None

    def span(self, ready: Any, done: Any) -> tuple | None:
        """An operation's issue and completion marks on the device's clock (for its
        ``seconds``), or None: timed on the host.

        Args:
            ready: what ``issue`` returned.
            done: the completion mark ``run`` returned.
        """
        return None


class CudaStreams(HostSync):
    """One CUDA stream for a Comm's operations; events, never a device-wide synchronise.

    ``blocking_completion`` is False: a NCCL ``work.wait()`` only orders the communication
    stream after the transfer, and completion is known by querying an event.

    Args:
        device: the CUDA device of the Comm (with its index).
    """

    blocking_completion = False

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def issue(self, tensors: Iterable[torch.Tensor]) -> torch.cuda.Event:
        """Record an event on the caller's current stream; mark the tensors as used by the
        communication stream.

        Args:
            tensors: the operation's input and output tensors.
        """
        ready = self.mark()  # timed: it is also the operation's start (``span``)
        for t in tensors:
            t.record_stream(self.stream)
        return ready

    def run(self, ready: torch.cuda.Event, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``fn`` with this device current and the communication stream current, after
        the caller's work up to the issue; record the completion event.

        Args:
            ready: the caller's event from ``issue``.
            fn: the operation's body.
        """
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            result = fn()
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return result, done

    def finished(self, done: torch.cuda.Event) -> bool:
        """Query the completion event (never blocks).

        Args:
            done: the event ``run`` recorded.
        """
        return done.query()

    def synchronize(self, done: torch.cuda.Event) -> None:
        """Block the calling thread until the completion event has happened.

        Args:
            done: the event ``run`` recorded.
        """
        done.synchronize()

    def hand_over(self, done: torch.cuda.Event, result: Any) -> None:
        """Order the caller's current stream after the operation; mark the result's
        tensors as used by it.

        Args:
            done: the event ``run`` recorded.
            result: the operation's result.
        """
        caller = torch.cuda.current_stream(self.device)
        caller.wait_event(done)
        for t in _tensors(result):
            t.record_stream(caller)

    def mark(self) -> torch.cuda.Event:
        """A timing event recorded on the calling thread's current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def span(self, ready: torch.cuda.Event, done: torch.cuda.Event) -> tuple:
        """The caller's event at issue and the communication stream's at the end: the
        operation's time in flight is ``ready.elapsed_time(done)`` once ``done`` happened.

        Args:
            ready: the caller's event from ``issue``.
            done: the event ``run`` recorded.
        """
        return ready, done


STAGED = "_loco_staged"
"""The attribute that marks a host copy made by [`HostStaging`][loco.comm.streams.HostStaging]
(it is not staged again)."""


class HostStaging:
    """Tensors of a model on ``device`` handed to a Comm on the CPU (a gloo group): copied
    through host memory, so that the transport never sees a device tensor.

    An elastic worker that trains on a GPU syncs over torchft's reconfigurable gloo group:
    its Comm lives on the CPU and stages (``Comm(stage_from=device)``). At issue, on the
    caller's thread, each tensor on ``device`` is copied into a new host buffer, page-locked
    for a GPU, by a non-blocking copy queued on the caller's current stream, and an event is
    recorded after it; the Comm's thread waits for that event (only that thread, only that
    event) before the transport reads the buffers. When the operation is waited for, what it
    wrote is copied back into the caller's tensors by non-blocking copies on the caller's
    stream, so later kernels on it see the result and the CPU does not wait. Page-locked
    buffers come from PyTorch's caching host allocator, which does not hand a freed buffer
    out again before the copies queued on it have run.

    Args:
        device: where the callers' tensors live (the model's device).
    """

    def __init__(self, device: torch.device):
        self.device = device

    def wants(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        """Whether any of ``tensors`` lives on ``device`` (and is not a staged copy)."""
        return any(t is not None and t.device == self.device and not hasattr(t, STAGED)
                   for t in tensors)

    def to_host(self, tensors: Iterable[torch.Tensor | None]) -> tuple[list, Any]:
        """On the caller's thread, at issue: a host copy of each tensor on ``device`` (the
        others as they are), queued on the caller's stream.

        Args:
            tensors: the operation's tensors (None for an absent one).

        Returns:
            The host tensors, in order, and the event the transport must wait for (None
                off CUDA, where the copies are done when this returns).

        Raises:
            ValueError: a tensor to stage is not contiguous.
        """
        hosts = []
        for t in tensors:
            if t is None or t.device != self.device or hasattr(t, STAGED):
                hosts.append(t)
                continue
            if not t.is_contiguous():
                raise ValueError("a tensor the Comm stages through host memory must be "
                                 "contiguous")
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            setattr(host, STAGED, True)
            hosts.append(host)
        if self.device.type != "cuda":
            return hosts, None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return hosts, ready

    @staticmethod
    def back(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """On the waiting thread: copy each host result into its caller's tensor, queued on
        the caller's stream (from page-locked memory: without blocking the CPU).

        Args:
            pairs: ``(caller's tensor, host tensor)`` items.
        """
        for t, host in pairs:
            t.copy_(host, non_blocking=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A new tensor on ``device`` holding ``host`` (an operation's new result).

        Args:
            host: a host tensor the transport wrote.
        """
        return host.to(self.device, non_blocking=True)


def streams_for(device: torch.device) -> HostSync:
    """The hand-over for a Comm on ``device``: CUDA streams and events on a CUDA device,
    nothing to do elsewhere.

    Args:
        device: the Comm's device.
    """
    return CudaStreams(device) if device.type == "cuda" else HostSync()
