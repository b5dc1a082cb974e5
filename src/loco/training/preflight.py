"""The preflight step: what a configuration cannot say about itself, checked before any
worker starts: the launcher's environment, the files the run reads, the extras it needs and
the checkpoints it would resume or overwrite.

Each problem is a [`ConfigError`][loco.config.ConfigError] naming the option, as the
configuration's own checks are.
"""

from __future__ import annotations

import glob
import os

from loco import checkpoint
from loco.checkpoint import check_layout
from loco.config import ConfigError, TrainConfig
from loco.dashboard import missing_extras
from loco.runtime import under_torchrun
from loco.runtime.elastic import restart_count


def preflight(cfg: TrainConfig) -> None:
    """Check what lies outside the configuration: the environment (``check_environment``),
    the corpus, held-out corpus and tokenizer paths, the dashboards' extras, and the
    checkpoints (``check_checkpoints``).

    Args:
        cfg: a valid, resolved configuration with its ``out`` set.

    Raises:
        ConfigError: the first problem, naming the option.
    """
    check_environment(cfg)
    for name in ("corpus", "eval_corpus"):
        check_corpus_path(cfg, name)
    for option, message in missing_extras(cfg)[:1]:
        raise ConfigError(option, message)
    if cfg.data.tokenizer is not None and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError("tokenizer", "path does not exist; give a tokenizer.json or a "
                          f"Hugging Face tokenizer directory (got {cfg.data.tokenizer!r})")
    check_checkpoints(cfg)


def check_environment(cfg: TrainConfig) -> None:
    """The launcher fits the process: torchrun only in a process torchrun started; fsdp
    workers under a launcher that builds a DeviceMesh; an elastic run's workers started by
    loco under the processes launcher, or given a Lighthouse and an index.

    Args:
        cfg: a valid configuration.

    Raises:
        ConfigError: naming ``launcher``, ``worker_parallel`` or ``elastic``.
    """
    torchrun = under_torchrun()
    if cfg.runtime.launcher == "torchrun" and not torchrun:
        raise ConfigError("launcher", "torchrun is only valid when started by torchrun: "
                          "torchrun --nproc-per-node N -m loco train ... (got 'torchrun')")
    if cfg.runtime.worker_parallel == "fsdp" and cfg.runtime.launcher == "threads" and not torchrun:
        raise ConfigError("worker_parallel", "fsdp needs the DeviceMesh that --launcher "
                          "processes and torchrun build, which the threads launcher does not; "
                          "add --launcher processes, or start the run with torchrun "
                          "(got fsdp with --launcher threads)")
    if cfg.runtime.elastic and cfg.runtime.lighthouse is None and (cfg.runtime.launcher != "processes" or torchrun):
        raise ConfigError("elastic", "loco starts the workers of an elastic run under "
                          "--launcher processes; under torchrun (one job per worker) give "
                          "--lighthouse and --worker-index (got --launcher "
                          f"{'torchrun' if torchrun else cfg.runtime.launcher})")


def check_checkpoints(cfg: TrainConfig) -> None:
    """A resumed run's worker layout can load its checkpoint; a new run does not overwrite
    a checkpointed one in ``out``.

    Args:
        cfg: a valid, resolved configuration with its ``out`` set.

    Raises:
        ConfigError: naming ``worker_ranks``, ``worker_parallel``, ``launcher`` or ``out``.
    """
    if cfg.runtime.resume is not None:  # rank files do not reshard; DCP does
        meta = checkpoint.latest(cfg.runtime.resume)
        if meta is not None:
            check_layout(meta, cfg.runtime.worker_ranks, cfg.runtime.worker_parallel,
                         "torchrun" if under_torchrun() else cfg.runtime.launcher)
    # (a worker of an external Lighthouse's job may start after the lead checkpointed)
    if cfg.runtime.resume is None and restart_count() == 0 and cfg.runtime.lighthouse is None:
        try:
            held = checkpoint.latest(cfg.run.out)
        except checkpoint.CheckpointError:
            held = True
        if held:
            raise ConfigError("out", f"{cfg.run.out} holds a checkpointed run; continue it with "
                              f"--resume {cfg.run.out}, or choose another --out (nothing is "
                              "overwritten)")


def check_corpus_path(cfg, name: str) -> None:
    """``corpus`` (or ``eval_corpus``, when given) is ``shakespeare``, an existing non-empty
    path, or a glob that matches files.

    Args:
        cfg: the configuration.
        name: ``"corpus"`` or ``"eval_corpus"``.
    """
    path = cfg.option(name)
    if path is None or path == "shakespeare":
        return
    if any(c in path for c in "*?["):
        if not glob.glob(os.path.expanduser(path), recursive=True):
            raise ConfigError(name, f"no files match the pattern (got {path!r})")
        return
    if not os.path.exists(path):
        raise ConfigError(name, "path does not exist; give a text, .jsonl, .parquet or "
                          ".arrow file, a glob or a directory of them, a Hugging Face datasets "
                          f"directory, or 'shakespeare' (got {path!r})")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ConfigError(name, f"file is empty (got {path!r})")
