"""When a run checkpoints, and how each rank writes its checkpoints: the steps at which one
is due (``--checkpoint-every``, ``--checkpoint-interval``, the last step), and each rank's
writer (who commits, how many are kept: ``--keep-checkpoints``; DCP for workers of several
ranks) and staging buffers."""

from __future__ import annotations

import time
from collections.abc import Callable

from loco.checkpoint.staging import Stager
from loco.checkpoint.writer import Writer
from loco.config import TrainConfig, duration_seconds
from loco.runtime import RankContext


def due(cfg: TrainConfig, step: int, time_is_up: Callable[[], bool]) -> bool:
    """Whether a checkpoint is due after ``step``, at the same step on every rank: every
    --checkpoint-every rounds of H steps, the first step after the round's end at which no
    worker has a sync in flight (Streaming DiLoCo: worker m applies the fragment sent at the
    round's end τ_m steps later, and sends the next one floor(H/P) > max τ steps after it,
    so max τ steps later, ``Method.checkpoint_delay``); the first such step of any round once
    --checkpoint-interval has passed since the last checkpoint; and the last step.

    Args:
        cfg: the run's configuration.
        step: the inner step just trained, in [1, ``cfg.run.steps``].
        time_is_up: whether --checkpoint-interval has passed, the same answer on every rank
            (it may be collective); called, on every rank alike, only at such a round's
            step when --checkpoint-interval is set and no other rule made one due.

    Returns:
        True when the rank checkpoints after ``step``.
    """
    every = cfg.runtime.checkpoint_every * cfg.method.sync_every
    delay = cfg.method_class.checkpoint_delay(cfg)
    round_end = step > delay and (step - delay) % cfg.method.sync_every == 0
    if step == cfg.run.steps or (every and round_end and (step - delay) % every == 0):
        return True
    return round_end and cfg.runtime.checkpoint_interval is not None and bool(time_is_up())


def interval_passed(cfg: TrainConfig, since: float) -> bool:
    """Whether --checkpoint-interval has passed since ``since``, a ``time.perf_counter()``
    (the last checkpoint's hand-over, or the loop's start)."""
    return time.perf_counter() - since >= duration_seconds(cfg.runtime.checkpoint_interval)


def make_stager(ctx: RankContext) -> Stager | None:
    """Host buffers for a checkpoint of a model on a GPU (written in the background); None
    for a model on the CPU, whose checkpoints are written in place (a copy would double the
    process's memory: docs/memory.md)."""
    return Stager() if ctx.device.type != "cpu" else None


def make_writer(cfg: TrainConfig, ctx: RankContext, main: bool) -> Writer:
    """This rank's background checkpoint writer. An elastic run's checkpoint is the lead's
    (whichever worker leads then): one file per rank of that worker, each with its share;
    otherwise a worker of R ranks saves its tensors through DCP.

    Args:
        cfg: the run's configuration.
        ctx: this rank's context.
        main: whether this rank is the lead rank (it commits the checkpoint's metadata).
    """
    elastic = ctx.comm.elastic
    dcp = ctx.checkpoint_group is not None and not elastic
    world = ctx.worker_ranks if elastic else ctx.world_size
    meta = {"world_size": world, "algorithm": cfg.method.algorithm, "worker_ranks": cfg.runtime.worker_ranks,
            "worker_parallel": cfg.runtime.worker_parallel, "dcp_workers": cfg.runtime.workers if dcp else 0,
            "elastic": elastic, "config": cfg.to_dict()}
    return Writer(cfg.run.out, ctx.worker_rank if elastic else ctx.rank, world,
                  timeout=cfg.comm.comm_timeout,
                  commit_meta=meta if main or elastic and ctx.worker_rank == 0 else None,
                  worker=ctx.worker if dcp else None,
                  group=ctx.checkpoint_group if dcp else None, keep=cfg.runtime.keep_checkpoints)
