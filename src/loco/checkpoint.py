"""Checkpoints: every rank saves everything it needs to continue, and a run resumes exactly.

Layout in the run directory::

    checkpoints/step00000100/rank0000.pt   one file per rank (torch.save of plain data)
    checkpoints/step00000100/worker0000/   workers of several ranks: the worker's tensors,
                                           through torch.distributed.checkpoint (DCP)
    checkpoints/latest.json                {"step": 100, "world_size": 4, ...}: the last
                                           checkpoint that every rank finished writing

Every file appears whole, by rename; ``latest.json`` moves only once every rank's file exists
(:func:`wait_for_ranks` looks at the files: no collective), and only then are older
checkpoints removed. :class:`Writer` writes on a background thread. docs/reliability.md,
"Checkpoints", describes the design.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

DIRNAME = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, truncated or from another run."""


def step_dir(out: str, step: int) -> str:
    return os.path.join(out, DIRNAME, f"step{step:08d}")


def rank_file(out: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(out, step), f"rank{rank:04d}.pt")


def worker_dir(out: str, step: int, worker: int) -> str:
    """Where a worker of several ranks saves its tensors of a checkpoint (DCP's files).

    Args:
        out: the run directory.
        step: the checkpoint's step.
        worker: the worker's index (its replica), in [0, M).
    """
    return os.path.join(step_dir(out, step), f"worker{worker:04d}")


def save_worker(path: str, tensors: dict, group: ProcessGroup | None = None) -> None:
    """Save a worker's tensors with ``torch.distributed.checkpoint``: collective over the
    worker's ranks; ``.metadata`` appears last, by rename, once every rank's file is whole.

    Args:
        path: the worker's directory (:func:`worker_dir`).
        tensors: the worker's state, each rank's own view of it (DTensors for shards); it
            must not change meanwhile (pass a :func:`snapshot`).
        group: a process group over the worker's ranks (``ctx.checkpoint_group``); None:
            a worker of one rank, no process group.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path), process_group=group,
             no_dist=group is None)


def load_worker(path: str, tensors: dict, group: ProcessGroup | None = None) -> None:
    """Load a worker's tensors saved by :func:`save_worker` into ``tensors`` in place (each
    rank reads its part, whatever R wrote them); collective over the worker's ranks.

    Args:
        path: the worker's directory.
        tensors: a dict of the same keys, shaped as this layout holds them; a key the
            checkpoint lacks is an error.
        group: as for :func:`save_worker`.

    Raises:
        CheckpointError: the files are missing, unreadable, or do not fit ``tensors``.
    """
    import torch.distributed.checkpoint as dcp

    if group is None:  # one rank per worker: no process group, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized, assuming the intent is to load in a single")
    try:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(path), process_group=group,
                 no_dist=group is None)
    except Exception as e:  # noqa: BLE001 - DCP wraps a rank's failure in its own error
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path} cannot be loaded ({type(e).__name__}: "
                              f"{first[0][:300] if first else ''})") from None


def read_worker(path: str) -> dict:
    """All of a worker's tensors saved by :func:`save_worker`, as whole tensors, in this
    process (to inspect or export a checkpoint; no process group needed).

    Args:
        path: the worker's directory (:func:`worker_dir`).

    Returns:
        The nested dict the worker saved (``model``, ``inner_optimizer``, ``outer``), with
        every tensor whole: a sharded tensor assembled from the ranks' files.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=True)


def save_rank(out: str, step: int, rank: int, state: dict) -> str:
    """Write this rank's state for ``step`` atomically; return the file's path.

    Raises:
        CheckpointError: the write failed (the partial file is removed), naming the file,
            the error and the space left on its disk.
    """
    path = rank_file(out, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise CheckpointError(f"writing {path} failed ({str(e).strip().splitlines()[0][:200]}"
                              f"); {free / 1e9:.1f} GB left on its disk: is it full? (a "
                              "checkpoint of this rank takes about "
                              f"{_nbytes(state) / 1e9:.1f} GB)") from None
    os.replace(tmp, path)
    return path


def _nbytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (nested dicts, lists and tuples)."""
    sizes: list[int] = []
    map_tensors(state, lambda t, path: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


def commit(out: str, step: int, meta: dict, keep: int = 1) -> None:
    """Mark ``step`` as the latest complete checkpoint (after every rank wrote its file) and
    remove all but the ``keep`` newest."""
    path = os.path.join(out, DIRNAME, "latest.json")
    _write_json(path, {"step": step, **meta})
    steps = sorted(int(d[4:]) for d in os.listdir(os.path.join(out, DIRNAME))
                   if d.startswith("step") and d[4:].isdigit())
    for old in steps[:-keep] if keep else []:
        if old != step:
            shutil.rmtree(step_dir(out, old), ignore_errors=True)


def latest(out: str) -> dict | None:
    """``latest.json`` of the run in ``out``, or None if it has no complete checkpoint."""
    path = os.path.join(out, DIRNAME, "latest.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); remove it to start over") from None
    return meta


def discard_uncommitted(out: str, rank: int, committed: int | None,
                        worker: int | None = None) -> None:
    """Remove this rank's files of checkpoints later than ``committed``: left by an attempt
    that failed before they were committed. A resumed attempt writes those steps again, and
    the lead must not take an old file for a new one while it waits for every rank's.

    Args:
        out: the run directory.
        rank: this rank.
        committed: the step of the last committed checkpoint; None: every step is later.
        worker: also remove this worker's DCP directories of those steps (the first rank of
            a worker of several ranks passes its worker); default None.
    """
    root = os.path.join(out, DIRNAME)
    if not os.path.isdir(root):
        return
    for d in os.listdir(root):
        if d.startswith("step") and d[4:].isdigit() and (committed is None
                                                         or int(d[4:]) > committed):
            try:
                os.remove(rank_file(out, int(d[4:]), rank))
            except FileNotFoundError:
                pass
            if worker is not None:
                shutil.rmtree(worker_dir(out, int(d[4:]), worker), ignore_errors=True)


def load_rank(out: str, step: int, rank: int, device: torch.device | str = "cpu") -> dict:
    path = rank_file(out, step, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint of step {step} is incomplete")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be loaded "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or state.get("step") != step:
        raise CheckpointError(f"{path} does not hold the state of step {step}")
    return state


def check_files(out: str, meta: dict) -> None:
    """Before any worker starts: every rank's file of the latest checkpoint exists and is a
    whole archive (its checksums are verified, nothing is unpickled), and so does every
    worker's DCP ``.metadata`` and the data files next to it. A bad file is named."""
    import zipfile

    step = int(meta["step"])
    for worker in range(int(meta.get("dcp_workers", 0))):
        path = worker_dir(out, step, worker)
        names = os.listdir(path) if os.path.isdir(path) else []
        if ".metadata" not in names or not any(n.endswith(".distcp") for n in names):
            raise CheckpointError(f"{path} is missing or incomplete (no .metadata or no "
                                  f"data file): the checkpoint of step {step} is incomplete")
    for rank in range(int(meta["world_size"])):
        path = rank_file(out, step, rank)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint of step {step} is "
                                  "incomplete")
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError) as e:
            bad = str(e)
        if bad is not None:
            raise CheckpointError(f"{path} is corrupt or truncated ({bad})")


def snapshot(state: Any) -> Any:
    """A copy of ``state`` that later training cannot change: every tensor copied to CPU
    memory, every dict, list and tuple rebuilt (numbers and strings are immutable).

    Args:
        state: tensors, numbers, strings, None, and dicts, lists and tuples of them.

    Returns:
        The copy, with the same structure (an ``OrderedDict`` keeps its ``_metadata``).
    """
    return map_tensors(state, lambda t, path: t.detach().to("cpu", copy=True))


def map_tensors(state: Any, leaf: Callable[[torch.Tensor, str], Any], path: str = "") -> Any:
    """``state`` rebuilt with ``leaf(tensor, path)`` in place of each tensor: every dict,
    list and tuple rebuilt (an ``OrderedDict`` keeps a module state_dict's ``_metadata``, its
    version information), other values kept. ``path`` names a tensor's place, e.g.
    ``/model/weight``.

    Args:
        state: tensors, numbers, strings, None, and dicts, lists and tuples of them.
        leaf: what a tensor becomes.
        path: the place of ``state`` itself; default "".
    """
    if isinstance(state, torch.Tensor):
        return leaf(state, path)
    if isinstance(state, OrderedDict):
        out = OrderedDict((k, map_tensors(v, leaf, f"{path}/{k}")) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = map_tensors(state._metadata, leaf)
        return out
    if isinstance(state, dict):
        return {k: map_tensors(v, leaf, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map_tensors(v, leaf, f"{path}/{i}") for i, v in enumerate(state))
    return state


class Stager:
    """Copies of a state's tensors in host buffers allocated once and reused by every
    checkpoint, so the background writer reads a fixed copy while training goes on. A
    tensor on a GPU gets a page-locked buffer, and its copy is queued on a side stream of
    the Stager's own: the side stream waits for an event on the caller's stream (the work
    that wrote the tensors), the copies are queued on it without blocking the host, and the
    caller's stream waits for the event after them (``ready``, which the writer waits for
    too) before it runs anything that could change them. A ``DTensor`` (FSDP2's shards) is
    staged the same way, its local shard into a buffer of its own, wrapped as a DTensor
    with the same placements (what DCP saves). A tensor whose shape or dtype changed gets a
    new buffer.

    Args:
        pinned: page-lock the buffers of tensors that are on a GPU (default True).
    """

    def __init__(self, pinned: bool = True):
        self.pinned = pinned
        self._buffers: dict[str, torch.Tensor] = {}
        self._wrapped: dict[str, torch.Tensor] = {}  # a DTensor's staged copy, by path
        self._streams: dict[torch.device, Any] = {}
        self.ready: Any = None
        """The CUDA event after the last ``stage``'s copies (None: nothing to wait for)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffers held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """``state`` with every tensor copied into its buffer (see :func:`snapshot` for the
        structures kept). Copies from a GPU are queued on the side stream, behind the work
        that wrote the tensors and ahead of any that changes them, so the caller goes on at
        once; ``ready`` is then the event the reader of the buffers waits for (pass it to
        ``Writer.save``), else None."""
        queued: list = []
        out = map_tensors(state, lambda t, path: self._copy(t, path, queued))
        self.ready = self._queue(queued) if queued else None
        return out

    def _copy(self, tensor: torch.Tensor, path: str, queued: list) -> torch.Tensor:
        """``tensor``'s staged copy: its buffer (a DTensor: its local shard's, wrapped),
        filled now from the CPU, or queued in ``queued`` (source, buffer) from a GPU."""
        t = tensor.detach()
        source = t.to_local() if type(t) is not torch.Tensor else t
        buf = self._buffers.get(path)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = self._buffers[path] = _host_buffer(source, self.pinned and _on_gpu(source))
            self._wrapped.pop(path, None)
        if _on_gpu(source):
            queued.append((source, buf))
        else:
            buf.copy_(source)
        if type(t) is torch.Tensor:
            return buf
        if path not in self._wrapped:  # the placements of the live DTensor, a host shard
            self._wrapped[path] = type(t)(buf, t._spec, requires_grad=False)
        return self._wrapped[path]

    def _queue(self, queued: list) -> Any:
        """Queue the copies from a GPU on the side stream, ordered after the caller's
        stream; the caller's stream waits for their event, which is returned."""
        device = queued[0][0].device
        current = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        written = torch.cuda.Event()
        written.record(current)
        side.wait_event(written)
        with torch.cuda.stream(side):
            for source, buf in queued:
                buf.copy_(source, non_blocking=True)
                source.record_stream(side)  # the allocator keeps it until the copy is done
        ready = torch.cuda.Event()
        ready.record(side)
        current.wait_event(ready)  # nothing the caller queues next changes them before
        return ready


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a GPU (its copy is then queued, into page-locked memory)."""
    return t.is_cuda


def _host_buffer(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty CPU tensor shaped like ``like``, page-locked if ``pin``."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)


def compact(state: Any) -> Any:
    """``state`` (as for :func:`snapshot`) with the live tensors themselves, except those
    that view part of a larger storage (saved alone they would carry all of it) or are not
    on the CPU: copied. What an in-place write saves."""
    def leaf(tensor: torch.Tensor, path: str) -> torch.Tensor:
        t = tensor.detach()
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
        return t if t.device.type == "cpu" and (whole or type(t) is not torch.Tensor) \
            else t.to("cpu", copy=True)
    return map_tensors(state, leaf)


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
        missing = [r for r in range(world_size) if not os.path.exists(rank_file(out, step, r))]
        if not missing:
            return True
        if stopping:
            return False
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint of step {step}: {rank_file(out, step, missing[0])} (rank "
                f"{missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}) "
                f"was not written within {timeout:g} s (--comm-timeout); a rank stopped or "
                "is far behind")
        if stop is not None:
            stop.wait(poll)
        else:
            time.sleep(poll)


class Writer:
    """One rank's checkpoint writes, on a background thread, one at a time.

    [`save`][loco.checkpoint.Writer.save] returns at once; the file is written atomically
    (:func:`save_rank`) while training goes on. The lead rank's writer then waits for every
    rank's file of that step (:func:`wait_for_ranks`) and commits it (:func:`commit`). A
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
            are given through DCP into :func:`worker_dir` before their rank files; default
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
                :func:`snapshot` or :meth:`Stager.stage`'s copy); in place, the live state.
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
            save_worker(worker_dir(self.out, step, self.worker), tensors, self.group)
        save_rank(self.out, step, self.rank, state)

    def _write(self, step: int, state: dict | None, tensors: dict | None, files: bool,
               ready: Any = None) -> None:
        try:
            if ready is not None:  # the staged copies have landed
                ready.synchronize()
            if files:
                self._write_files(step, state, tensors)
            if self.commit_meta is not None and wait_for_ranks(
                    self.out, step, self.world_size, self.timeout, self._stop):
                commit(self.out, step, self.commit_meta, self.keep)
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
            meta = latest(self.out)
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
            check: as for [`wait`][loco.checkpoint.Writer.wait]; default None.

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


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
