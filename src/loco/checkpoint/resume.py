"""Resuming a run, before any rank starts: which worker layouts can load a checkpoint, and
the saved configuration with the options a resumed run may change (``RESUMABLE``,
``LAYOUT``)."""

from __future__ import annotations

import os
from typing import Any

from loco.checkpoint import files
from loco.config.train_config import TrainConfig, canonical, coerce
from loco.config.sections import LAYOUT, RESUMABLE, resumable_flags
from loco.options import ConfigError


def check_layout(meta: dict, worker_ranks: int, worker_parallel: str,
                 launcher: str = "processes") -> None:
    """Check that a run of this worker layout can resume a checkpoint: a DCP checkpoint
    (workers of several ranks, processes launcher or torchrun) with any R of the same
    ``worker_parallel`` (R = 1 too from ``ddp``), but not under the threads launcher with
    R > 1; rank files (workers of one rank, or the threads launcher) with the same R only.

    Args:
        meta: the checkpoint's ``latest.json`` (a checkpoint that records no layout was
            written by workers of one rank, ddp).
        worker_ranks: R of the resumed run.
        worker_parallel: ``worker_parallel`` of the resumed run.
        launcher: the resumed run's launcher; default ``"processes"``.

    Raises:
        ConfigError: a layout that cannot load the checkpoint, naming the option and the
            values to resume with.
    """
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    ranks = int(meta.get("worker_ranks", saved.get("worker_ranks", 1)))
    parallel = meta.get("worker_parallel", saved.get("worker_parallel", "ddp"))
    dcp = bool(meta.get("dcp_workers"))
    same = f"--worker-ranks {ranks}" + (f" --worker-parallel {parallel}"
                                        if parallel != "ddp" else "")
    if dcp and worker_ranks > 1 and launcher == "threads":
        raise ConfigError("launcher", f"the checkpoint's tensors were saved through "
                          f"torch.distributed.checkpoint by workers of {ranks} ranks; the "
                          "threads launcher has no process groups to load them into workers "
                          "of several ranks: resume with --launcher processes (or torchrun)")
    if (worker_ranks, worker_parallel) == (ranks, parallel):
        return
    if worker_parallel != parallel:
        raise ConfigError("worker_parallel", f"the checkpoint was written by workers of "
                          f"{ranks} rank(s) ({parallel}), this run has {worker_ranks} "
                          f"({worker_parallel}); the outer state is laid out differently "
                          f"(flat ranges under ddp, parameter shards under fsdp): resume "
                          f"with --worker-parallel {parallel}")
    if not dcp:
        files = "the threads launcher" if ranks > 1 else "one rank per worker"
        raise ConfigError("worker_ranks", f"the checkpoint was written by workers of {ranks} "
                          f"rank(s) in per-rank files ({files}), "
                          f"which do not reshard; resume with {same} (checkpoints of workers "
                          "of several ranks under --launcher processes or torchrun reshard)")


def resume_config(directory: str, given: dict[str, Any]) -> TrainConfig:
    """The configuration of the run being resumed from ``directory``, with ``given`` options
    (flags or a YAML file) allowed to change only how it runs (RESUMABLE).

    Args:
        directory: the run directory, with a checkpoint.
        given: options given for the resumed run, by field name; only those of
            ``RESUMABLE`` may differ from the saved ones.

    Returns:
        The saved configuration with the given changes, ``resume`` and ``out`` set to
            ``directory``.

    Raises:
        ConfigError: no such directory, no usable checkpoint, or a changed option that is
            not resumable.
    """
    if not os.path.isdir(directory):
        raise ConfigError("resume", f"no such directory: {directory}")
    try:
        meta = files.latest(directory)
    except files.CheckpointError as e:
        raise ConfigError("resume", str(e)) from None
    if meta is None:
        raise ConfigError("resume", f"{directory} has no checkpoint "
                          f"({os.path.join(directory, files.DIRNAME, 'latest.json')} is "
                          "missing); nothing to resume")
    saved = meta.get("config")
    if isinstance(saved, dict):
        saved = canonical(saved)
    by_name = {f.name: f for f in TrainConfig.fields()}
    if not isinstance(saved, dict) or set(saved) - set(by_name):
        raise ConfigError("resume", f"{directory}'s checkpoint does not record a configuration "
                          "of this version of loco")
    values = {k: coerce(by_name[k], v) for k, v in saved.items()}
    for name, value in given.items():
        value = coerce(by_name[name], value)
        if name not in RESUMABLE + LAYOUT and value != values.get(name):
            raise ConfigError(name, f"differs from the run being resumed ({values.get(name)!r}); "
                              f"a resumed run keeps its options except {resumable_flags()}")
        values[name] = value
    check_layout(meta, *(values.get(k, by_name[k].default)
                         for k in (*LAYOUT, "launcher")))
    try:
        files.check_files(directory, meta)
    except files.CheckpointError as e:
        raise ConfigError("resume", str(e)) from None
    return TrainConfig.from_saved({**values, "resume": directory, "out": directory})
