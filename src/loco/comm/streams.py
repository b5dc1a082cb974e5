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
  used there. Neither blocks the CPU, and nothing synchronises the device.

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
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
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
            done = torch.cuda.Event()
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


def streams_for(device: torch.device) -> HostSync:
    """The hand-over for a Comm on ``device``: CUDA streams and events on a CUDA device,
    nothing to do elsewhere.

    Args:
        device: the Comm's device.
    """
    return CudaStreams(device) if device.type == "cuda" else HostSync()
