"""Writing checkpoints: each rank's files on a background thread (``Writer``), and the lead
rank's commit once every rank's file of a step exists (``wait_for_ranks``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import ProcessGroup

from loco.checkpoint import files
from loco.checkpoint.files import CheckpointError


def wait_for_ranks(out: str, step: int, world_size: int, timeout: float,
                   stop: threading.Event | None = None, poll: float = 0.01) -> bool:
    """Wait until every rank's file of ``step`` exists (each appears whole, by rename).

    Args:
        out: the run directory.
        step: the checkpoint's step, >= 0.
        world_size: the ranks that write a file, >= 1.
        timeout: seconds to wait at most, > 0 (``loco train`` passes ``--comm-timeout``).
        stop: when set, look once more and give up; default None (never).
        poll: seconds between looks, > 0; default 0.01.

    Returns:
        True once all files exist; False if ``stop`` was set first and a file is missing.

    Raises:
        CheckpointError: a file still missing after ``timeout`` seconds, named.
    """
    deadline = time.monotonic() + timeout
    while True:
        stopping = stop is not None and stop.is_set()
        missing = [r for r in range(world_size) if not os.path.exists(files.rank_file(out, step, r))]
        if not missing:
            return True
        if stopping:
            return False
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint of step {step}: {files.rank_file(out, step, missing[0])} (rank "
                f"{missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}) "
                f"was not written within {timeout:g} s (--comm-timeout); a rank stopped or "
                "is far behind")
        if stop is not None:
            stop.wait(poll)
        else:
            time.sleep(poll)


class Writer:
    """One rank's checkpoint writes, on a background thread, one at a time.

    [`save`][loco.checkpoint.writer.Writer.save] returns at once; the file is written atomically
    (``files.save_rank``) while training goes on. The lead rank's writer then waits for every
    rank's file of that step (:func:`wait_for_ranks`) and commits it (``files.commit``). A
    further ``save`` first waits for the write before it.

    Args:
        out: the run directory.
        rank: this rank, in [0, world_size).
        world_size: the ranks that write a file for each checkpoint, >= 1.
        commit_meta: on the lead rank, what ``latest.json`` records besides the step (it
            commits); None (default) on the other ranks.
        timeout: seconds the lead waits for the other ranks' files, and a drill for the
            commit, > 0; default 300.
        worker: for a worker of several ranks, its index: its ranks save the tensors they
            are given through DCP into ``files.worker_dir`` before their rank files; default
            None.
        group: the process group over the worker's ranks for DCP (``ctx.checkpoint_group``),
            used on the writer's thread only; default None.
        keep: how many of the newest committed checkpoints the lead keeps, >= 1; default 1.
    """

    def __init__(self, out: str, rank: int, world_size: int, commit_meta: dict | None = None,
                 timeout: float = 300.0, worker: int | None = None,
                 group: ProcessGroup | None = None, keep: int = 1):
        self.out, self.rank, self.world_size, self.keep = out, rank, world_size, keep
        self.commit_meta, self.timeout = commit_meta, timeout
        self.worker, self.group = worker, group
        self.last_step: int | None = None
        """The step of the last checkpoint handed over."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()

    def save(self, step: int, state: dict, check: Callable[[], None] | None = None,
             tensors: dict | None = None, in_place: bool = False, ready: Any = None) -> None:
        """Write ``state`` as this rank's checkpoint of ``step``, once the previous write is
        done: in the background, or (``in_place``) on the calling thread, only the commit
        left to the background.

        Args:
            step: the checkpoint's step, >= 0.
            state: what to save; in the background, it must not change afterwards (pass a
                ``snapshot`` or ``Stager.stage``'s copy); in place, the live state.
            check: called while waiting for the previous write (it may raise to stop
                waiting, e.g. ``Comm.check_aborted``); default None.
            tensors: the worker's tensors to save through DCP first (a writer built with
                ``worker``; every rank of the worker passes its view), copied as ``state``
                is; default None.
            in_place: write the files before returning (no copy of the state is needed:
                the caller's memory stays the training state's); default False.
            ready: an event (``Stager.ready``) the writer waits for before it reads
                ``state``; default None.

        Raises:
            CheckpointError: the previous write failed (or its commit timed out).
            OSError: the previous write failed, or (in place) this one.
        """
        self.wait(check)
        self.last_step = step
        if in_place:
            self._write_files(step, state, tensors)
            state = tensors = None
        self._thread = threading.Thread(target=self._write,
                                        args=(step, state, tensors, not in_place, ready),
                                        daemon=True, name=f"loco-checkpoint-{self.rank}")
        self._thread.start()

    def _write_files(self, step: int, state: dict, tensors: dict | None) -> None:
        if tensors is not None:  # the rank file, written after, says that it is whole
            files.save_worker(files.worker_dir(self.out, step, self.worker), tensors,
                              self.group)
        files.save_rank(self.out, step, self.rank, state)

    def _write(self, step: int, state: dict | None, tensors: dict | None, write: bool,
               ready: Any = None) -> None:
        try:
            if ready is not None:  # the staged copies have landed
                ready.synchronize()
            if write:
                self._write_files(step, state, tensors)
            if self.commit_meta is not None and wait_for_ranks(
                    self.out, step, self.world_size, self.timeout, self._stop):
                files.commit(self.out, step, self.commit_meta, self.keep)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread
            self._error = e

    def wait(self, check: Callable[[], None] | None = None) -> None:
        """Block until the write in flight (and, on the lead, its commit) is done.

        Args:
            check: called every 50 ms while waiting (it may raise); default None.

        Raises:
            CheckpointError: the write failed or its commit timed out.
            OSError: the write failed.
        """
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.05)
            if check is not None and self._thread.is_alive():
                check()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait_committed(self, check: Callable[[], None] | None = None) -> None:
        """Block until the last checkpoint handed over is written and committed (by the
        lead rank, seen in ``latest.json``): fault drills strike only then, so that their
        outcome does not depend on the speed of the disk.

        Args:
            check: called every 10 ms while waiting (it may raise); default None.

        Raises:
            CheckpointError: the write failed, or no commit within ``timeout`` seconds.
        """
        self.wait(check)
        deadline = time.monotonic() + self.timeout
        while self.last_step is not None:
            meta = files.latest(self.out)
            if meta is not None and int(meta["step"]) >= self.last_step:
                return
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint of step {self.last_step} was not "
                                      f"committed within {self.timeout:g} s (--comm-timeout)")
            if check is not None:
                check()
            time.sleep(0.01)

    def close(self, abandon: bool = False, check: Callable[[], None] | None = None) -> None:
        """Finish: wait for the last write (and commit).

        Args:
            abandon: the run failed: the lead commits only if every rank's file already
                exists, instead of waiting for them, and errors are not raised (the run's
                own failure is reported); default False.
            check: as for [`wait`][loco.checkpoint.writer.Writer.wait]; default None.

        Raises:
            CheckpointError: (not abandoning) the write failed or its commit timed out.
            OSError: (not abandoning) the write failed.
        """
        if not abandon:
            self.wait(check)
            return
        self._stop.set()
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the run's own failure is what gets reported
            pass
