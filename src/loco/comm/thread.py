"""The thread that issues a worker's communication operations, in issue order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class CommThread:
    """The thread that issues communication operations, one after another in issue order.

    Every [`Comm`][loco.comm.comm.Comm] issues through one. Comms that share one issue
    all their operations in a single order: NCCL needs that when one process drives several
    communicators (operations on different communicators, issued in different orders on
    different ranks, can hang), so the launcher gives all Comms of a CUDA rank one thread;
    the CUDA thread never blocks on the network (NCCL work is only queued on streams). Over
    gloo, whose groups do not constrain one another and whose collectives block the thread
    that runs them, every Comm keeps its own thread, so that one group's slow collective
    does not hold back another group's traffic.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._users = 0
        self._lock = threading.Lock()
        # A daemon: a thread stuck in the transport must not keep a failed run alive.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                    if not future.done():
                        future.set_exception(e)
            # Not kept until the next operation arrives: the operation's closure holds its
            # tensors (a NoLoCo exchange's four message buffers, between syncs).
            del item, future, fn

    def submit(self, future: Future, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (which completes ``future`` itself); an exception it raises
        completes ``future`` instead.

        Args:
            future: the operation's future.
            fn: the callable to run on the thread.
        """
        self._queue.put((future, fn))

    def attach(self) -> None:
        """Count one more Comm that issues through this thread."""
        with self._lock:
            self._users += 1

    def release(self, join: bool = True) -> None:
        """One Comm is done with the thread; the last one stops it, after what was queued.

        Args:
            join: wait for the thread to finish (not when the run was aborted: it may be
                stuck in the transport); default True.
        """
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._queue.put(None)
            if join:
                self._thread.join()

