"""What an operation of a [`Comm`][loco.comm.comm.Comm] returns: a handle to wait on, and
the error a worker gets when its peers gave up."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from loco.comm.accounting import OpRecord


class Aborted(RuntimeError):
    """Raised in a worker whose peers gave up (another worker failed).

    [`launch`][loco.runtime.launch.launch] reports the worker that failed first, not the
    ones it stopped.
    """


class Handle:
    """An operation in flight. ``wait()`` blocks until it is done and returns its result.

    Made by the [`Comm`][loco.comm.comm.Comm] methods, not by the caller.

    Args:
        future: completes with ``(result, completion mark)`` (or the operation's exception).
        record: the operation's record, filled in as it completes.
        comm: the Comm that issued it (for aborts, the ``waited`` counter and the hand-over
            of CUDA results).
    """

    def __init__(self, future: Future, record: OpRecord, comm: Any):
        self._future = future
        self.record = record
        """The operation's [`OpRecord`][loco.comm.accounting.OpRecord]: its bytes at once,
        its times once it is done."""
        self._comm = comm
        self._then: Any = None  # what wait() makes of the result (a staged operation's)
        self._final: tuple | None = None

    def done(self) -> bool:
        """Whether the operation has completed (successfully or not), without blocking."""
        if not self._future.done():
            return False
        return (self._future.exception() is not None
                or self._comm._streams.finished(self._future.result()[1]))

    def wait(self, count: bool = True) -> torch.Tensor | list[torch.Tensor]:
        """Block until the operation is done and return its result; the time spent waiting
        is added to the record and to the tag's ``waited`` total. On CUDA the caller's
        stream is ordered after the transfer (an event; the CPU does not wait for the GPU),
        and the time counted is the device's: how long the caller's stream is held, between
        events recorded on it before and after the wait (filled in once they have happened,
        [`Comm.update_times`][loco.comm.comm.Comm.update_times]).

        Args:
            count: count the time spent waiting (default True); False for a helper thread
                that waits on the training thread's behalf, which counts its own wait
                with [`count_wait`][loco.comm.handles.Handle.count_wait].

        Returns:
            What the operation returns: the reduced tensor (``all_reduce_mean``,
                ``broadcast``), a list of tensors (``all_gather``, ``exchange``, ``recv``,
                ``sendrecv``: the receive buffers), or an empty list (``send``).

        Raises:
            Aborted: another worker failed while this one was waiting.
            Exception: whatever the operation raised (e.g. a transport timeout).
        """
        t0 = time.perf_counter()
        streams = self._comm._streams
        began = streams.mark() if count else None  # CUDA: the caller's stream, here
        while True:
            try:
                result, done = self._future.result(timeout=0.05)
                break
            except FutureTimeout:
                self._comm.check_aborted()
        streams.hand_over(done, result)
        if self._then is not None:  # once: later waits return the same
            self._final = self._final or (self._then(result),)
            result = self._final[0]
        if began is not None:  # how long the caller's stream is held, on the device's clock
            with self._comm._lock:
                self._comm._times.add(self.record, "waited", began, streams.mark())
        elif count:
            self.count_wait(time.perf_counter() - t0)
        return result

    def then(self, fn: Any) -> Handle:
        """Make ``wait()`` return ``fn(result)``, computed once, on the waiting thread, after
        the hand-over (a staged operation's copies back to the caller's device). A
        ``reissue`` (an elastic retry) carries ``fn`` over to the new handle.

        Args:
            fn: takes the operation's result, returns what ``wait()`` returns.

        Returns:
            This handle.
        """
        self._then = fn
        reissue = getattr(self, "reissue", None)
        if reissue is not None:
            self.reissue = lambda: reissue().then(fn)
        return self

    def count_wait(self, seconds: float) -> None:
        """Add ``seconds`` of waiting for this operation to its record and to its tag's
        ``waited`` total.

        Args:
            seconds: the time the training thread spent waiting.
        """
        self.record.waited += seconds
        with self._comm._lock:
            self._comm.stats[self.record.tag].waited += seconds

