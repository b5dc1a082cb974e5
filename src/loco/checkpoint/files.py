"""The on-disk format of checkpoints: where each file lies, how it is written (whole, by
rename) and read back, and which checkpoint is complete.

Layout in the run directory::

    checkpoints/step00000100/rank0000.pt   one file per rank (torch.save of plain data)
    checkpoints/step00000100/worker0000/   workers of several ranks: the worker's tensors,
                                           through torch.distributed.checkpoint (DCP)
    checkpoints/latest.json                {"step": 100, "world_size": 4, ...}: the last
                                           checkpoint that every rank finished writing

Every file appears whole, by rename; ``latest.json`` moves only once every rank's file exists
(``loco.checkpoint.writer.wait_for_ranks`` looks at the files: no collective), and only then
are older checkpoints removed. docs/reliability.md, "Checkpoints", describes the design.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from typing import Any

import torch
from torch.distributed import ProcessGroup

from loco.checkpoint.staging import map_tensors

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


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
