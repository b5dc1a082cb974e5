"""A run's state across interruptions: checkpoints (when, what), resuming from the last
complete one (also written by workers of another R: resharded), and putting a worker
that joins an elastic run at the others' step."""

from __future__ import annotations

import logging
import time

import torch

from loco import checkpoint
from loco.algorithms import Algorithm
from loco.comm.handles import Aborted
from loco.config import TrainConfig, duration_seconds
from loco.data import Corpus, TokenLoader
from loco.runtime import WorkerContext
from loco.runtime.elastic import restart_count
from loco.training.errors import failure
from loco.training.worker import Loop, Worker

log = logging.getLogger("loco")


def resume_state(cfg: TrainConfig, ctx: WorkerContext, corpus: Corpus) -> dict | None:
    """This rank's state in the last complete checkpoint, if the run continues one: its
    rank file; for a checkpoint written by workers of another R, the rank files of its
    worker mapped onto this layout (:func:`reshard_rank_state`). The key ``"dcp"`` says
    where the worker's tensors are when they are not in the file."""
    if cfg.resume is None and restart_count() == 0:
        return None
    if cfg.elastic:  # a restarted worker joins from a live one; a resumed job reads the lead's
        return elastic_resume_state(cfg, ctx) if restart_count() == 0 else None
    meta = checkpoint.latest(cfg.out)
    checkpoint.discard_uncommitted(cfg.out, ctx.rank, None if meta is None else int(meta["step"]),
                                   worker=ctx.replica if ctx.checkpoint_group is not None
                                   and ctx.shard == 0 else None)
    if meta is None:
        return None
    step, ranks = int(meta["step"]), int(meta.get("worker_ranks", 1))
    if ranks == ctx.mesh.shards:
        state = checkpoint.load_rank(cfg.out, step, ctx.rank, ctx.device)
    else:  # check_layout let only a DCP checkpoint through
        old = [checkpoint.load_rank(cfg.out, step, ctx.replica * ranks + j, ctx.device)
               for j in range(ranks)]
        state = reshard_rank_state(old, ctx, cfg, corpus)
    if meta.get("dcp_workers"):
        state["dcp"] = checkpoint.worker_dir(cfg.out, step, ctx.replica)
    return state


def elastic_resume_state(cfg: TrainConfig, ctx: WorkerContext) -> dict | None:
    """The last complete checkpoint of an elastic run: the files its lead worker wrote (one
    per rank, its share), which every worker continues from: rank r of each from file r."""
    meta = checkpoint.latest(cfg.out)
    if meta is None:
        return None
    return checkpoint.load_rank(cfg.out, int(meta["step"]), ctx.shard, ctx.device)


def restore_elastic(state: dict, algo: Algorithm, schedule, loader: TokenLoader | None,
                    ctx: WorkerContext) -> None:
    """Continue an elastic run from its lead's checkpoint, as a worker that joins takes a
    live one's state (``Algorithm.load_heal_state``: the counters and the outer state; the
    replica restarts from the global copy, the inner optimizer from zero, except
    DataParallel's, which is in the state), at its own data position."""
    algo.load_heal_state(state["heal"])
    seek(schedule, loader, int(state["step"]))


def reshard_rank_state(old: list[dict], ctx: WorkerContext, cfg: TrainConfig,
                       corpus: Corpus) -> dict:
    """This rank's small state when its worker's checkpoint was written by R ranks and this
    run has R' (the tensors reshard through DCP). Rank r' takes rank (r' mod R)'s state
    (the schedule, the step counters and the random state are the same on every rank of a
    worker), with two changes:

    - its byte counters are the sums of those of old ranks j with j mod R' = r' (peaks: the
      largest), so a worker's totals carry over exactly;
    - its data loader continues at the same number of tokens read by the worker, in the
      new split of the data over M x R' readers (the batches differ from those an
      uninterrupted run would read).

    Args:
        old: the rank files of this worker's R ranks, in shard order.
        ctx: this rank's context.
        cfg: the run's configuration.
        corpus: the tokenized corpus.
    """
    ranks, shard = len(old), ctx.shard
    state = dict(old[shard % ranks])
    mine = [s for j, s in enumerate(old) if j % ctx.mesh.shards == shard]
    for key in ("comm", "inner"):
        state[key] = _fold([s[key] for s in mine], state[key])
    algorithm = state["algorithm"] = dict(state["algorithm"])
    if "fragments" in algorithm:
        algorithm["fragments"] = [{**f, "stats": _fold([s["algorithm"]["fragments"][i]["stats"]
                                                         for s in mine], f["stats"])}
                                  for i, f in enumerate(algorithm["fragments"])]
    if algorithm.get("in_flight") and algorithm["in_flight"].get("record"):
        algorithm["in_flight"] = {**algorithm["in_flight"], "record": _fold(
            [s["algorithm"]["in_flight"]["record"] for s in mine],
            algorithm["in_flight"]["record"])}
    if state.get("loader") is not None:
        state["loader"] = _reshard_loader(state["loader"], shard % ranks, ranks, ctx, cfg,
                                          corpus)
    return state


def _fold(states: list, like, key: str = ""):
    """Sum counters: nested dicts of numbers, those under a key starting with ``peak``
    combined by the largest; with no states, ``like`` with every number 0."""
    if isinstance(like, dict):
        keys = dict.fromkeys([*like, *(k for s in states for k in s)])
        return {k: _fold([s[k] for s in states if k in s],
                         like[k] if k in like else next(s[k] for s in states if k in s), k)
                for k in keys}
    if isinstance(like, (int, float)) and not isinstance(like, bool):
        return type(like)((max if key.startswith("peak") else sum)(states) if states else 0)
    return like


def _reshard_loader(loader: dict, old_shard: int, ranks: int, ctx: WorkerContext,
                    cfg: TrainConfig, corpus: Corpus) -> dict:
    """The position of this rank's loader after as many tokens per worker as the old
    layout's rank ``old_shard`` of R = ``ranks`` had read (see ``reshard_rank_state``)."""
    def batches_per_epoch(rank: int, readers: int) -> int:
        return TokenLoader(corpus.train, cfg.batch_size, cfg.seq_len, rank=rank,
                           world_size=readers, seed=cfg.seed).batches_per_epoch
    workers = ctx.mesh.replicas
    before = batches_per_epoch(ctx.replica * ranks + old_shard, workers * ranks)
    read = int(loader["epoch"]) * before + int(loader["position"])  # batches, each rank
    now = batches_per_epoch(ctx.replica * ctx.mesh.shards + ctx.shard,
                            workers * ctx.mesh.shards)
    epoch, position = divmod(read * ranks // ctx.mesh.shards, now)
    return {"epoch": epoch, "position": position}


def restore(state: dict, algo: Algorithm, schedule, loader: TokenLoader | None,
            ctx: WorkerContext) -> None:
    """Put a worker back where its checkpoint left it (the algorithm's tensors from its
    rank file, or through DCP from its worker's directory)."""
    algo.load_state_dict(state["algorithm"])
    if state.get("dcp"):
        tensors = algo.checkpoint_tensors(shard_mesh(ctx))
        checkpoint.load_worker(state["dcp"], tensors, ctx.checkpoint_group)
        algo.load_checkpoint_tensors(tensors, shard_mesh(ctx))
    schedule.load_state_dict(state["schedule"])
    if loader is not None:
        loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"].cpu())
    ctx.comm.load_state_dict(state["comm"])
    if ctx.pipe is not None:
        ctx.pipe.load_state_dict(state["pipe"])
    if ctx.inner is not None:
        ctx.inner.load_state_dict(state["inner"])


def seek(schedule, loader: TokenLoader | None, step: int) -> None:
    """Put the learning-rate schedule and the loader where a worker is after ``step`` inner
    steps (a worker that joined an elastic run at that step: its batches are its own
    shard's, as if it had never stopped).

    Args:
        schedule: the worker's ``LambdaLR``, as built (not yet stepped).
        loader: the worker's loader; None on later pipeline stages.
        step: the inner steps the worker is taken past (>= 0).
    """
    # A schedule built at ``step`` sets the learning rates (base x lambda(step)) as the
    # schedule stepped that far would; its state then becomes the worker's schedule's.
    at_step = torch.optim.lr_scheduler.LambdaLR(schedule.optimizer, schedule.lr_lambdas,
                                                last_epoch=step - 1)
    schedule.load_state_dict(at_step.state_dict())
    if loader is not None:
        per_epoch = loader.batches_per_epoch
        loader.load_state_dict({"epoch": step // per_epoch, "position": step % per_epoch})


def checkpoint_if_due(w: Worker, loop: Loop, step: int) -> None:
    """Checkpoint every --checkpoint-every rounds of H steps, at the same step on every
    rank: the first one after the round's end at which no worker has a sync in flight
    (Streaming DiLoCo: worker m applies the fragment sent at the round's end τ_m steps
    later, and sends the next one floor(H/P) > max τ steps after it, so max τ steps later),
    at the first such step of any round once --checkpoint-interval has passed since the
    last one, and at the last step. A model on a GPU: the state is copied into host buffers
    allocated once (``Worker.stager``) and the writer saves it in the background; on the
    CPU, where a copy would double the memory, the training thread writes it in place (the
    commit is left to the background). The previous checkpoint is written before the next begins, so
    that one copy of the state at most is held besides the training state (a warning says
    when that wait took long)."""
    cfg = w.cfg
    every = cfg.checkpoint_every * cfg.sync_every
    delay = cfg.method.checkpoint_delay(cfg)
    round_end = step > delay and (step - delay) % cfg.sync_every == 0
    due = step == cfg.steps or (every and round_end and (step - delay) % every == 0)
    if not due and round_end and cfg.checkpoint_interval is not None:
        due = _time_is_up(w, loop)
    if due:
        t0 = time.perf_counter()
        _checkpoint(w, loop, step)
        loop.checkpoints += 1
        loop.checkpoint_seconds += time.perf_counter() - t0
        loop.last_checkpoint = time.perf_counter()


def _time_is_up(w: Worker, loop: Loop) -> bool:
    """Whether --checkpoint-interval has passed since the last checkpoint (or the start):
    on any rank (a one-number gather over every rank, outside the training bytes), or, in
    an elastic run, where only the lead writes, on this one."""
    up = time.perf_counter() - (loop.last_checkpoint or loop.origin) \
        >= duration_seconds(w.cfg.checkpoint_interval)
    if w.ctx.comm.elastic:
        return up
    flags = w.gather_all(torch.tensor([float(up)], device=w.ctx.comm.device))
    return any(bool(f.item()) for f in flags)


def _checkpoint(w: Worker, loop: Loop, step: int) -> None:
    """Wait for the previous write, then hand the state to the writer: copied into the
    stager's buffers (a model on a GPU) for the background writer, or written in place."""
    cfg = w.cfg
    assert step == cfg.steps or not w.algo.sync_in_flight, "a sync is in flight"
    t0 = time.perf_counter()
    w.writer.wait(w.ctx.comm.check_aborted)
    if time.perf_counter() - t0 > 1 and w.main:
        log.warning("checkpoint at step %d waited %.1f s for the previous one to be "
                    "written: they are due faster than the disk takes them (raise "
                    "--checkpoint-every)", step, time.perf_counter() - t0)
    if w.ctx.comm.elastic:
        if w.ctx.replica == min(w.ctx.comm.members):  # the lead writes the one file
            _hand_over(w, step, elastic_checkpoint_state(w, loop, step))
        return
    dcp = w.ctx.checkpoint_group is not None  # the tensors go through DCP
    _hand_over(w, step, checkpoint_state(w, loop, step, tensors=not dcp),
               w.algo.checkpoint_tensors(shard_mesh(w.ctx)) if dcp else None)


def _hand_over(w: Worker, step: int, state: dict, tensors: dict | None = None) -> None:
    """Give the writer ``state`` (and DCP's ``tensors``), live: staged, or written in place."""
    if w.stager is None:
        w.writer.save(step, checkpoint.compact(state), w.ctx.comm.check_aborted,
                      tensors=None if tensors is None else checkpoint.compact(tensors),
                      in_place=True)
        return
    staged = w.stager.stage({"state": state, "dcp": tensors})
    w.writer.save(step, staged["state"], w.ctx.comm.check_aborted, tensors=staged["dcp"],
                  ready=w.stager.ready)


def shard_mesh(ctx: WorkerContext):
    """The ``DeviceMesh`` of this worker's R ranks; None without one (threads, R = 1)."""
    return ctx.device_mesh["shard"] if ctx.device_mesh is not None and ctx.mesh.shards > 1 \
        else None


def checkpoint_state(w: Worker, loop: Loop, step: int, tensors: bool = True) -> dict:
    """Everything this rank needs to continue after ``step``, live (the caller copies it or
    writes it at once), without the algorithm's tensors when ``tensors`` is False (DCP
    saves them)."""
    ctx = w.ctx
    return {
        "step": step, "algorithm": w.algo.state_dict(tensors),
        "schedule": w.schedule.state_dict(),
        "loader": w.loader.state_dict() if w.loader is not None else None,
        "rng": torch.get_rng_state(), "comm": ctx.comm.state_dict(),
        "pipe": ctx.pipe.state_dict() if ctx.pipe is not None else None,
        "inner": ctx.inner.state_dict() if ctx.inner is not None else None,
        "loop": loop_state(w, loop, step)}


def local_rounds(w: Worker) -> list | None:
    """The speed-aware schedule's rounds so far (the gather in flight settled), or None."""
    if w.local_steps is None:
        return None
    w.local_steps.settle()
    return [list(r) for r in w.local_steps.rounds]


def loop_state(w: Worker, loop: Loop, step: int) -> dict:
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


def elastic_checkpoint_state(w: Worker, loop: Loop, step: int) -> dict:
    """What an elastic run's lead saves after ``step``: the state a joining worker receives
    (``Algorithm.heal_state``), with its tensors, and the loop's running values (the
    length of metrics.jsonl only when the lead writes it)."""
    return {"step": step, "elastic": True, "heal": w.algo.heal_state(),
            "loop": loop_state(w, loop, step)}


def last_checkpoint(w: Worker) -> None:
    """Wait for the last checkpoint's write (on the lead rank: and its commit)."""
    try:
        w.writer.close(check=w.ctx.comm.check_aborted)
    except Aborted:
        w.writer.close(abandon=True)
        raise
    except (checkpoint.CheckpointError, OSError) as e:
        raise failure(e, w.ctx.rank, w.cfg.steps, w.cfg.comm_timeout) from e
