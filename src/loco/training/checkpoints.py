"""A worker's checkpoints: at the steps ``loco.checkpoint.policy`` names, the worker's state
(``loco.checkpoint.state``, with the loop's running values) handed to its writer; at the
end, the last one waited for."""

from __future__ import annotations

import logging
import time

import torch

from loco import checkpoint
from loco.checkpoint import policy
from loco.checkpoint.state import elastic_state, rank_state, shard_mesh
from loco.comm.handles import Aborted
from loco.training.errors import failure
from loco.training.worker import Loop, Rank

log = logging.getLogger("loco")


def checkpoint_if_due(w: Rank, loop: Loop, step: int) -> None:
    """Checkpoint after ``step`` if ``policy.due`` says so (at the same step on every rank).
    A model on a GPU: the state is copied into host buffers allocated once (``Rank.stager``)
    and the writer saves it in the background; on the CPU, where a copy would double the
    memory, the training thread writes it in place (the commit is left to the background).
    The previous checkpoint is written before the next begins, so that one copy of the state
    at most is held besides the training state (a warning says when that wait took long)."""
    if policy.due(w.cfg, step, lambda: _time_is_up(w, loop)):
        t0 = time.perf_counter()
        _checkpoint(w, loop, step)
        loop.checkpoints += 1
        loop.checkpoint_seconds += time.perf_counter() - t0
        loop.last_checkpoint = time.perf_counter()


def _time_is_up(w: Rank, loop: Loop) -> bool:
    """Whether --checkpoint-interval has passed since the last checkpoint (or the start):
    on any rank (a one-number gather over every rank, outside the training bytes), or, in
    an elastic run, where only the lead writes, on this one."""
    up = policy.interval_passed(w.cfg, loop.last_checkpoint or loop.origin)
    if w.ctx.comm.elastic:
        return up
    flags = w.gather_all(torch.tensor([float(up)], device=w.ctx.comm.device))
    return any(bool(f.item()) for f in flags)


def _checkpoint(w: Rank, loop: Loop, step: int) -> None:
    """Wait for the previous write, then hand the state to the writer: copied into the
    stager's buffers (a model on a GPU) for the background writer, or written in place."""
    cfg = w.cfg
    assert step == cfg.run.steps or not w.algo.sync_in_flight, "a sync is in flight"
    t0 = time.perf_counter()
    w.writer.wait(w.ctx.comm.check_aborted)
    if time.perf_counter() - t0 > 1 and w.main:
        log.warning("checkpoint at step %d waited %.1f s for the previous one to be "
                    "written: they are due faster than the disk takes them (raise "
                    "--checkpoint-every)", step, time.perf_counter() - t0)
    if w.ctx.comm.elastic:
        if w.ctx.worker == min(w.ctx.comm.members):  # the lead writes the one file
            _hand_over(w, step, elastic_checkpoint_state(w, loop, step))
        return
    dcp = w.ctx.checkpoint_group is not None  # the tensors go through DCP
    _hand_over(w, step, checkpoint_state(w, loop, step, tensors=not dcp),
               w.algo.checkpoint_tensors(shard_mesh(w.ctx)) if dcp else None)


def _hand_over(w: Rank, step: int, state: dict, tensors: dict | None = None) -> None:
    """Give the writer ``state`` (and DCP's ``tensors``), live: staged, or written in place."""
    if w.stager is None:
        w.writer.save(step, checkpoint.compact(state), w.ctx.comm.check_aborted,
                      tensors=None if tensors is None else checkpoint.compact(tensors),
                      in_place=True)
        return
    staged = w.stager.stage({"state": state, "dcp": tensors})
    w.writer.save(step, staged["state"], w.ctx.comm.check_aborted, tensors=staged["dcp"],
                  ready=w.stager.ready)


def checkpoint_state(w: Rank, loop: Loop, step: int, tensors: bool = True) -> dict:
    """Everything this rank needs to continue after ``step``, live (the caller copies it or
    writes it at once): ``rank_state``, and the loop's running values under ``"loop"``;
    without the algorithm's tensors when ``tensors`` is False (DCP saves them)."""
    state = rank_state(step, w.algo, w.schedule, w.loader, w.ctx, tensors)
    state["loop"] = loop_state(w, loop, step)
    return state


def elastic_checkpoint_state(w: Rank, loop: Loop, step: int) -> dict:
    """What an elastic run's lead saves after ``step``: ``elastic_state`` and the loop's
    running values (the length of metrics.jsonl only when the lead writes it)."""
    state = elastic_state(step, w.algo)
    state["loop"] = loop_state(w, loop, step)
    return state


def local_rounds(w: Rank) -> list | None:
    """The speed-aware schedule's rounds so far (the gather in flight settled), or None."""
    if w.local_steps is None:
        return None
    w.local_steps.settle()
    return [list(r) for r in w.local_steps.rounds]


def loop_state(w: Rank, loop: Loop, step: int) -> dict:
    """The loop's running values after ``step``, for a checkpoint (``metrics_bytes``: the
    length of metrics.jsonl; None on a rank that does not write it in an elastic run)."""
    loop.settle_losses()
    return {"loss_sum": loop.loss_sum, "loss_count": loop.loss_count,
            "eval_seconds": loop.eval_seconds, "diagnostic_seconds": loop.diagnostic_seconds,
            "train_seconds": loop.elapsed(), "trained_steps": loop.trained_steps,
            "throttle_seconds": loop.throttle_seconds, "local_rounds": local_rounds(w),
            "local_admitted": getattr(w.local_steps, "admitted", None),
            "metrics_bytes": w.log.tell() if w.log is not None else
            None if w.ctx.comm.elastic else 0,
            "tokens": w.tokens_at(step)}


def last_checkpoint(w: Rank) -> None:
    """Wait for the last checkpoint's write (on the lead rank: and its commit)."""
    try:
        w.writer.close(check=w.ctx.comm.check_aborted)
    except Aborted:
        w.writer.close(abandon=True)
        raise
    except (checkpoint.CheckpointError, OSError) as e:
        raise failure(e, w.ctx.rank, w.cfg.run.steps, w.cfg.comm.comm_timeout) from e
