"""A rank's state in a checkpoint, both ways: what it saves after a step (``rank_state``;
an elastic run's lead, ``elastic_state``), and, when a run resumes, reading it back
(``resume_state``; a checkpoint written by workers of another R is resharded) and putting
the worker where it was (``restore``, ``restore_elastic``, ``seek``)."""

from __future__ import annotations

import torch

from loco.algorithms import Algorithm
from loco.checkpoint import files
from loco.config import TrainConfig
from loco.data import Corpus, TokenLoader
from loco.runtime import RankContext
from loco.runtime.elastic import restart_count


def rank_state(step: int, algo: Algorithm, schedule, loader: TokenLoader | None,
               ctx: RankContext, tensors: bool = True) -> dict:
    """Everything this rank's algorithm, schedule, loader, random state and Comms need to
    continue after ``step``, live (the caller copies it or writes it at once); the caller
    adds its loop's running values under ``"loop"``. ``restore`` puts it back.

    Args:
        step: the inner step just trained.
        algo: the rank's algorithm.
        schedule: its learning-rate schedule.
        loader: its loader; None on later pipeline stages.
        ctx: this rank's context.
        tensors: include the algorithm's tensors; False when DCP saves them. Default True.
    """
    return {
        "step": step, "algorithm": algo.state_dict(tensors),
        "schedule": schedule.state_dict(),
        "loader": loader.state_dict() if loader is not None else None,
        "rng": torch.get_rng_state(), "comm": ctx.comm.state_dict(),
        "pipe": ctx.pipe.state_dict() if ctx.pipe is not None else None,
        "inner": ctx.inner.state_dict() if ctx.inner is not None else None}


def elastic_state(step: int, algo: Algorithm) -> dict:
    """What an elastic run's lead saves after ``step``: the state a joining worker receives
    (``Algorithm.heal_state``), with its tensors; the caller adds its loop's running values
    under ``"loop"``. ``restore_elastic`` puts it back."""
    return {"step": step, "elastic": True, "heal": algo.heal_state()}


def shard_mesh(ctx: RankContext):
    """The ``DeviceMesh`` of this worker's R ranks; None without one (threads, R = 1)."""
    return ctx.device_mesh["shard"] if ctx.device_mesh is not None and ctx.worker_ranks > 1 \
        else None


def resume_state(cfg: TrainConfig, ctx: RankContext, corpus: Corpus) -> dict | None:
    """This rank's state in the last complete checkpoint, if the run continues one: its
    rank file; for a checkpoint written by workers of another R, the rank files of its
    worker mapped onto this layout (:func:`reshard_rank_state`). The key ``"dcp"`` says
    where the worker's tensors are when they are not in the file."""
    if cfg.runtime.resume is None and restart_count() == 0:
        return None
    if cfg.runtime.elastic:  # a restarted worker joins from a live one; a resumed job reads the lead's
        return elastic_resume_state(cfg, ctx) if restart_count() == 0 else None
    meta = files.latest(cfg.run.out)
    files.discard_uncommitted(cfg.run.out, ctx.rank, None if meta is None else int(meta["step"]),
                              worker=ctx.worker if ctx.checkpoint_group is not None
                              and ctx.worker_rank == 0 else None)
    if meta is None:
        return None
    step, ranks = int(meta["step"]), int(meta.get("worker_ranks", 1))
    if ranks == ctx.worker_ranks:
        state = files.load_rank(cfg.run.out, step, ctx.rank, ctx.device)
    else:  # check_layout let only a DCP checkpoint through
        old = [files.load_rank(cfg.run.out, step, ctx.worker * ranks + j, ctx.device)
               for j in range(ranks)]
        state = reshard_rank_state(old, ctx, cfg, corpus)
    if meta.get("dcp_workers"):
        state["dcp"] = files.worker_dir(cfg.run.out, step, ctx.worker)
    return state


def elastic_resume_state(cfg: TrainConfig, ctx: RankContext) -> dict | None:
    """The last complete checkpoint of an elastic run: the files its lead worker wrote (one
    per rank, its share), which every worker continues from: rank r of each from file r."""
    meta = files.latest(cfg.run.out)
    if meta is None:
        return None
    return files.load_rank(cfg.run.out, int(meta["step"]), ctx.worker_rank, ctx.device)


def reshard_rank_state(old: list[dict], ctx: RankContext, cfg: TrainConfig,
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
    ranks, shard = len(old), ctx.worker_rank
    state = dict(old[shard % ranks])
    mine = [s for j, s in enumerate(old) if j % ctx.worker_ranks == shard]
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


def _reshard_loader(loader: dict, old_shard: int, ranks: int, ctx: RankContext,
                    cfg: TrainConfig, corpus: Corpus) -> dict:
    """The position of this rank's loader after as many tokens per worker as the old
    layout's rank ``old_shard`` of R = ``ranks`` had read (see ``reshard_rank_state``)."""
    def batches_per_epoch(rank: int, readers: int) -> int:
        return TokenLoader(corpus.train, cfg.data.batch_size, cfg.data.seq_len, rank=rank,
                           world_size=readers, seed=cfg.run.seed).batches_per_epoch
    workers = ctx.workers
    before = batches_per_epoch(ctx.worker * ranks + old_shard, workers * ranks)
    read = int(loader["epoch"]) * before + int(loader["position"])  # batches, each rank
    now = batches_per_epoch(ctx.worker * ctx.worker_ranks + ctx.worker_rank,
                            workers * ctx.worker_ranks)
    epoch, position = divmod(read * ranks // ctx.worker_ranks, now)
    return {"epoch": epoch, "position": position}


def restore(state: dict, algo: Algorithm, schedule, loader: TokenLoader | None,
            ctx: RankContext) -> None:
    """Put a worker back where its checkpoint left it (the algorithm's tensors from its
    rank file, or through DCP from its worker's directory)."""
    algo.load_state_dict(state["algorithm"])
    if state.get("dcp"):
        tensors = algo.checkpoint_tensors(shard_mesh(ctx))
        files.load_worker(state["dcp"], tensors, ctx.checkpoint_group)
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


def restore_elastic(state: dict, algo: Algorithm, schedule, loader: TokenLoader | None,
                    ctx: RankContext) -> None:
    """Continue an elastic run from its lead's checkpoint, as a worker that joins takes a
    live one's state (``Algorithm.load_heal_state``: the counters and the outer state; the
    replica restarts from the global copy, the inner optimizer from zero, except
    DataParallel's, which is in the state), at its own data position."""
    algo.load_heal_state(state["heal"])
    seek(schedule, loader, int(state["step"]))


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
