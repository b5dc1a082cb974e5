"""Every rank's counters: bytes by link, blocked time, memory, gathered at the end of the
run for the summary, and each rank's ``comm/rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from loco import checkpoint
from loco.algorithms import Algorithm
from loco.runtime import RankContext
from loco.training.goodput import goodput
from loco.training.worker import Loop, Rank

#: The counters every rank reports at the end, in the order of its report tensor.
COUNTERS = ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes", "syncs",
            "comm_seconds", "comm_wait_seconds", "train_seconds", "pipeline_bytes_sent",
            "blocked_seconds", "skipped_inner_steps", "skipped_syncs", "fast_link_bytes_sent",
            "max_rss_bytes", "peak_device_bytes", "trained_steps", "applied_steps",
            "throttle_seconds", "host_reads_per_step", "host_reads_per_sync")
#: The host-read counts of ``LOCO_HOST_READS=count`` (None in the summary when not counted).
HOST_READS = ("host_reads_per_step", "host_reads_per_sync")
#: The parts of a rank's memory, after ``COUNTERS``: what ``algo.memory_bytes()`` reports
#: (``comm`` with the pipeline's Comm added), and ``staging``, the checkpoint's host buffers.
#: A summary written before ``comm`` and ``staging`` were counted lacks them.
MEMORY_PARTS = ("model", "gradients", "inner_optimizer", "outer", "comm", "staging")
#: The parts every algorithm that reports its memory gives (``comm`` is 0 where it lacks it).
ALGORITHM_PARTS = ("model", "gradients", "inner_optimizer", "outer")


def gather_counters(w: Rank, loop: Loop) -> list[dict]:
    """Every rank's counters, by name (a tiny gather outside the training traffic). The
    outer algorithm's bytes travel between replicas (ctx.comm, the slow link); the
    gradients of a worker's ranks between them (ctx.inner, the fast link); activations,
    their gradients and the tied head's gradient between stages (ctx.pipe). A rank's
    ``memory_bytes`` is None when its algorithm does not report it. On a GPU the Comms'
    times are on the device's clock, every one of them in (``Comm.update_times``)."""
    ctx, algo = w.ctx, w.algo
    train_seconds = loop.elapsed()
    settle_times(ctx)
    mine = ctx.comm.totals("train")
    piped = ctx.pipe.totals("train").sent_bytes if ctx.pipe is not None else 0
    fast = ctx.inner.totals("train").sent_bytes if ctx.inner is not None else 0
    memory = memory_bytes(algo, ctx, w.stager)
    report = torch.tensor([mine.sent_bytes, mine.recv_bytes, mine.raw_bytes,
                           ctx.comm.peak_sent_bytes("train"), mine.ops, mine.seconds, mine.waited,
                           train_seconds, piped, blocked_seconds(ctx),
                           algo.skipped["inner_steps"], algo.skipped["syncs"], fast,
                           max_rss_bytes(), peak_device_bytes(ctx.device),
                           loop.trained_steps, applied_steps(algo, loop.trained_steps),
                           loop.throttle_seconds, *host_read_counts(loop),
                           *(memory[k] if memory else -1 for k in MEMORY_PARTS)],
                          dtype=torch.float64, device=ctx.comm.device)
    return [counters_of(t.tolist()) for t in w.gather_all(report)]


def counters_of(values: list[float]) -> dict:
    """One rank's report, by name: ``COUNTERS`` (counts as integers), its
    ``compute_utilization``, and its ``memory_bytes`` by ``MEMORY_PARTS`` (None where its
    algorithm does not report them: sent as -1).

    Args:
        values: the rank's report tensor as a list, in the order of ``COUNTERS`` and then
            ``MEMORY_PARTS``.
    """
    c = dict(zip(COUNTERS, values))
    c["compute_utilization"] = 1 - c["blocked_seconds"] / c["train_seconds"]
    for k in ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes", "syncs",
              "pipeline_bytes_sent", "skipped_inner_steps", "skipped_syncs",
              "fast_link_bytes_sent", "max_rss_bytes", "peak_device_bytes", "trained_steps",
              "applied_steps", "host_reads_per_step", "host_reads_per_sync"):
        c[k] = int(c[k])
    for k in HOST_READS:
        c[k] = None if c[k] < 0 else c[k]
    held = values[len(COUNTERS):]
    c["memory_bytes"] = (None if min(held) < 0
                         else {k: int(v) for k, v in zip(MEMORY_PARTS, held)})
    return c


def host_read_counts(loop: Loop) -> tuple[int, int]:
    """The most host reads one inner step made outside the regions that may read, and the
    most one step's syncs made (``LOCO_HOST_READS=count``); -1, -1 when not counted."""
    seen = loop.host_reads
    if seen is None:
        return -1, -1
    return seen["step"], seen.get("sync", 0)


def applied_steps(algo: Algorithm, trained: int) -> int:
    """The inner steps of ``trained`` whose updates reached an applied outer step (or, for
    DataParallel, the parameters): less the non-finite steps skipped and the steps whose
    pseudo-gradients the algorithm discarded (``discarded_inner_steps``, asynchronous
    methods past their staleness bound).

    Args:
        algo: this rank's algorithm.
        trained: inner steps this rank trained.
    """
    return max(0, trained - algo.skipped["inner_steps"]
               - getattr(algo, "discarded_inner_steps", 0))


def memory_bytes(algo: Algorithm, ctx: RankContext | None = None,
                 stager: checkpoint.Stager | None = None) -> dict[str, int] | None:
    """Bytes of the tensors this rank holds, by ``MEMORY_PARTS``: ``algo.memory_bytes()``,
    its ``comm`` with the buffers of the pipeline's Comm (``ctx.pipe``) added, and
    ``staging``, the checkpoint's host buffers (``stager``; none on a CPU, written in
    place); None for an algorithm that does not report them.

    Args:
        algo: this rank's algorithm.
        ctx: this rank's context; default None (no pipeline Comm).
        stager: the checkpoint's staging buffers; default None.
    """
    report = getattr(algo, "memory_bytes", None)
    if report is None:
        return None
    parts = report()
    if not all(k in parts for k in ALGORITHM_PARTS):
        return None
    pipe = getattr(ctx, "pipe", None)
    return {**{k: int(parts[k]) for k in ALGORITHM_PARTS},
            "comm": int(parts.get("comm", 0)) + (pipe.buffer_bytes() if pipe is not None else 0),
            "staging": stager.nbytes if stager is not None else 0}


def max_rss_bytes() -> int:
    """The peak resident memory of this process, in bytes (``getrusage``; under the threads
    launcher that of all ranks together)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts kilobytes


def peak_device_bytes(device: torch.device) -> int:
    """The most memory this rank's GPU had allocated by tensors (``max_memory_allocated``);
    -1 on the CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1


def peak_over_state(counters: list[dict], ranks_per_process: int) -> dict | None:
    """The state a rank must hold (the sum of its ``memory_bytes`` parts), its peak memory
    (resident, or the GPU's) and their ratio, for the rank where the ratio is largest; None
    when a rank does not report its state.

    Args:
        counters: every rank's counters (:func:`gather_counters`).
        ranks_per_process: ranks that share one process's resident memory (the threads
            launcher: all of them; else 1).
    """
    if any(c["memory_bytes"] is None for c in counters):
        return None
    rows = []
    for c in counters:
        state = sum(c["memory_bytes"].values())
        on_gpu = c["peak_device_bytes"] >= 0
        peak = c["peak_device_bytes"] if on_gpu else c["max_rss_bytes"] / ranks_per_process
        rows.append({"state_bytes": state, "peak_bytes": int(peak),
                     "peak_of": "device" if on_gpu else "resident",
                     "ratio": round(peak / state, 3) if state else None})
    return max(rows, key=lambda r: r["ratio"] or 0)


def link_bytes(mesh, counters: list[dict]) -> dict[str, int]:
    """Training bytes sent over the slow link between workers (``bytes_sent``, ctx.comm) and
    the fast link inside them (``fast_link_bytes_sent``, ctx.inner): the busiest rank's,
    and the busiest worker's, summed over its ranks.

    Args:
        mesh: the run's layout of ranks (``ctx.mesh``).
        counters: every rank's counters, in rank order (:func:`gather_counters`).
    """
    out = {}
    for link, key in (("slow_link", "bytes_sent"), ("fast_link", "fast_link_bytes_sent")):
        per_worker = [0] * mesh.workers
        for rank, c in enumerate(counters):
            per_worker[mesh.coords(rank)[0]] += c[key]
        out[f"{link}_bytes_sent_per_rank"] = max(c[key] for c in counters)
        out[f"{link}_bytes_sent_per_worker"] = max(per_worker)
    return out


def memory_per_rank(counters: list[dict]) -> dict[str, int] | None:
    """The largest ``memory_bytes`` of any rank, part by part (``MEMORY_PARTS``); None when
    a rank has none.

    Args:
        counters: every rank's counters (:func:`gather_counters`).
    """
    if any(c["memory_bytes"] is None for c in counters):
        return None
    return {k: max(c["memory_bytes"][k] for c in counters) for k in MEMORY_PARTS}


def summarize_counters(ctx: RankContext, counters: list[dict], held: float = 0.0) -> dict:
    """The summary's fields made of every rank's counters: bytes (the busiest rank's or
    worker's), memory, syncs, communication time, compute utilization (the mean over ranks),
    the non-finite skips (summed over ranks) and the goodput.

    Args:
        ctx: the lead rank's context.
        counters: every rank's counters, in rank order (:func:`gather_counters`).
        held: the lead rank's seconds of evaluation and spread diagnostic, which the others
            wait out (see ``loco.training.goodput.goodput``).
    """
    most = {k: max(c[k] for c in counters) for k in COUNTERS if k not in HOST_READS}
    per_worker = ctx.stages * ctx.worker_ranks  # rank order: worker-major
    return {
        "bytes_sent_per_rank": most["bytes_sent"],
        "bytes_received_per_rank": most["bytes_received"],
        "raw_bytes_per_rank": most["raw_bytes"],
        "peak_sync_bytes_per_rank": most["peak_sync_bytes"],
        "pipeline_bytes_sent_per_rank": most["pipeline_bytes_sent"] if ctx.stages > 1 else None,
        **link_bytes(ctx.mesh, counters),
        "memory_bytes_per_rank": memory_per_rank(counters),
        "max_rss_bytes": most["max_rss_bytes"],
        "memory_peak_over_state": peak_over_state(
            counters, len(counters) if ctx.launcher == "threads" else 1),
        "syncs": counters[0]["syncs"],
        "comm_seconds": counters[0]["comm_seconds"],
        "comm_wait_seconds": most["blocked_seconds"],
        "compute_utilization": sum(c["compute_utilization"] for c in counters) / len(counters),
        "nonfinite_skipped": {"inner_steps": sum(c["skipped_inner_steps"] for c in counters),
                              "syncs": sum(c["skipped_syncs"] for c in counters)},
        "goodput": goodput(counters, [list(range(i, i + per_worker)) for i in
                                      range(0, len(counters), per_worker)], held)}


def settle_times(ctx: RankContext) -> None:
    """Fill in every time of this rank's Comms still waiting for its device events (on a
    GPU, ``Comm.update_times(wait=True)``: the run is over, the host may wait for them;
    nothing to do on the CPU).

    Args:
        ctx: this rank's context.
    """
    for c in (ctx.comm, ctx.pipe, ctx.inner):
        if c is not None:
            c.update_times(wait=True)


def blocked_seconds(ctx: RankContext) -> float:
    """Time this rank has spent blocked waiting for its training traffic (tag ``train``):
    the slow link's, its pipeline's and its worker's fast link's; not for the spread
    diagnostic, the checkpoints or the report, which are no part of the algorithm."""
    comms = [c for c in (ctx.comm, ctx.pipe, ctx.inner) if c is not None]
    return sum(c.totals("train").waited for c in comms)


def issued_link_bytes(ctx: RankContext) -> dict[str, int]:
    """This rank's training bytes so far on the slow and the fast link, counted as each
    operation is issued (the same at a step whatever their timing), for a metrics record;
    empty for a worker of one rank (``bytes_sent`` says it all).

    Args:
        ctx: this rank's context.
    """
    if ctx.inner is None:
        return {}
    return {"slow_link_bytes_sent": ctx.comm.issued_bytes("train"),
            "fast_link_bytes_sent": ctx.inner.issued_bytes("train")}


def write_comm_totals(out: str, ctx: RankContext) -> None:
    """``out/comm/rank<r>.json``: this rank's place (``worker``, ``stage``, ``worker_rank``)
    and its byte and time totals by tag, for every Comm, after its last operation of the run
    (what a packet counter on its link should see). The place's old keys, ``replica`` and
    ``shard``, are written too, for one release."""
    comms = {"outer": ctx.comm, **({"pipe": ctx.pipe} if ctx.pipe is not None else {}),
             **({"inner": ctx.inner} if ctx.inner is not None else {})}
    settle_times(ctx)
    totals = {name: c.stats.as_dict() for name, c in comms.items()}
    tags = [t for by_tag in totals.values() for t in by_tag.values()]
    totals["sent_bytes"] = sum(t["sent_bytes"] for t in tags)
    totals["recv_bytes"] = sum(t["recv_bytes"] for t in tags)
    os.makedirs(os.path.join(out, "comm"), exist_ok=True)
    path = os.path.join(out, "comm", f"rank{ctx.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": ctx.rank, "worker": ctx.worker, "stage": ctx.stage,
                   "worker_rank": ctx.worker_rank, "replica": ctx.worker,  # old keys, for
                   "shard": ctx.worker_rank, **totals}, f, indent=2)  # one release
    os.replace(path + ".tmp", path)
