"""Checkpoints: every rank saves everything it needs to continue, and a run resumes exactly.

Layout in the run directory::

    checkpoints/step00000100/rank0000.pt   one file per rank (torch.save of plain data)
    checkpoints/latest.json                {"step": 100, "world_size": 4, ...}: the last
                                           checkpoint that every rank finished writing

A rank writes its file to a temporary name and renames it (never a half file). Only when
every rank has written does the lead rank move ``latest.json`` to the new step (again by
rename), and only then are older checkpoints removed: a crash at any moment leaves the last
complete checkpoint usable. Files are read with ``torch.load(weights_only=True)``, which
refuses to unpickle anything but tensors and plain containers.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

DIRNAME = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, truncated or from another run."""


def step_dir(out: str, step: int) -> str:
    return os.path.join(out, DIRNAME, f"step{step:08d}")


def rank_file(out: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(out, step), f"rank{rank:04d}.pt")


def save_rank(out: str, step: int, rank: int, state: dict) -> str:
    """Write this rank's state for ``step`` atomically; return the file's path."""
    path = rank_file(out, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


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
    whole archive (its checksums are verified, nothing is unpickled). A bad file is named."""
    import zipfile

    step = int(meta["step"])
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
