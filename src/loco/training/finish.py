"""The end of a run: the final evaluation, the last checkpoint, every rank's counters and
the lead rank's summary."""

from __future__ import annotations

import os
import time

import torch

from loco.algorithms import Algorithm
from loco.comm.codecs.fused import kernel_in_use
from loco.config import worker_speeds
from loco.runtime.elastic import recovery_report, restart_count
from loco.training.counters import (gather_counters, issued_link_bytes, summarize_counters,
                                    write_comm_totals)
from loco.training.evaluation import final_evaluation, final_extra_evaluation
from loco.training.quorum import QuorumSteps
from loco.training.runlog import RunLog
from loco.training.checkpoints import last_checkpoint, local_rounds
from loco.training.summary import Summary
from loco.training.guard_report import guard_summary
from loco.training.verify import replicas_verified
from loco.training.worker import Loop, Rank


def finish_worker(w: Rank, loop: Loop) -> dict:
    """The end of the run: gather every rank's counters, evaluate the final model(s), wait
    for the last checkpoint, write this rank's comm totals; the lead writes the summary."""
    if w.ctx.comm.elastic:
        take_lead(w)
    per_worker = gather_counters(w, loop)
    guard = guard_summary(w)
    final_eval, replicas = final_evaluation(w)
    extra = final_extra_evaluation(w)
    last_checkpoint(w)
    write_comm_totals(w.cfg.run.out, w.ctx)
    if not w.main:
        return {"rank": w.ctx.rank}
    return write_summary(w, loop, per_worker, final_eval, replicas, extra, guard)


def take_lead(w: Rank) -> None:
    """At the end of an elastic run the lowest live worker reports (worker 0 if alive); one
    that takes over from a lost worker 0 appends to its metrics.jsonl."""
    w.lead = min(w.ctx.comm.members)
    lead = w.ctx.worker == w.lead and w.ctx.worker_rank == 0
    if lead and not w.main:
        path = os.path.join(w.cfg.run.out, "metrics.jsonl")
        w.log = RunLog(w.cfg.run.out, resume_at=os.path.getsize(path) if os.path.exists(path)
                       else None, cfg=w.cfg)
    w.main = lead


def write_summary(w: Rank, loop: Loop, workers: list[dict], final_eval: float | None,
                  replicas: dict | None, extra: float | None = None,
                  guard: dict | None = None) -> dict:
    """The lead rank's last metrics record, ``summary.json`` and ``loss.png``; returns the
    summary's content (``Summary.to_dict()``).

    Args:
        w: the lead rank's worker.
        loop: the loop's running values.
        workers: every rank's counters (:func:`gather_counters`).
        final_eval: the final model's loss on the validation split.
        replicas: the replicas' report (:func:`final_evaluation`), or None.
        extra: the final model's loss on ``--eval-corpus``, or None.
        guard: what the guard saw (``loco.training.guard_report.guard_summary``), or None.
    """
    ctx = w.ctx
    w.log.metric({"step": w.cfg.run.steps, "tokens": w.tokens_at(w.cfg.run.steps),
                  "eval_loss": final_eval, **({} if extra is None else {"eval_loss_extra": extra}),
                  "bytes_sent": ctx.comm.totals("train").sent_bytes,
                  **issued_link_bytes(ctx), "elapsed": time.perf_counter() - w.start})
    summary = make_summary(w, loop, workers, final_eval, replicas, extra, guard)
    w.log.finish(summary)
    return summary.to_dict()


def make_summary(w: Rank, loop: Loop, workers: list[dict], final_eval: float | None,
                 replicas: dict | None, extra: float | None, guard: dict | None = None
                 ) -> Summary:
    """The run's summary, now (its ``wall_seconds`` end here); the arguments are
    :func:`write_summary`'s."""
    cfg, ctx, algo, corpus = w.cfg, w.ctx, w.algo, w.corpus
    tokens = w.tokens_at(cfg.run.steps)
    wall = time.perf_counter() - w.start
    # The job is done when its slowest worker is: timing worker 0 alone would flatter
    # methods without a barrier, whose workers drift apart in speed.
    train_seconds = max(c["train_seconds"] for c in workers)
    return Summary(
        algorithm=cfg.method.algorithm, workers=ctx.workers, stages=ctx.stages,
        routing=cfg.runtime.routing if ctx.stages > 1 else None, launcher=ctx.launcher,
        worker_ranks=ctx.worker_ranks, worker_parallel=cfg.runtime.worker_parallel,
        inner_steps=cfg.run.steps, tokens=tokens, final_eval_loss=final_eval,
        final_model=final_model(cfg),
        final_eval_loss_extra=extra, unigram_entropy=corpus.unigram_entropy,
        model_parameters=w.model.num_parameters(), **summarize_counters(
            ctx, workers, loop.eval_seconds + loop.diagnostic_seconds),
        resumed_from_step=w.resumed_from, restarts=restart_count(),
        worker_speeds=None if cfg.runtime.worker_speed is None else list(worker_speeds(cfg)),
        local_steps=None if w.local_steps is None else {
            "rounds": local_rounds(w), "max_staleness": cfg.runtime.max_staleness,
            "staleness": (w.local_steps.staleness(cfg.run.steps // cfg.method.sync_every)
                          if cfg.runtime.max_staleness else None),
            **(w.local_steps.summary() if isinstance(w.local_steps, QuorumSteps) else {})},
        elastic=(None if not ctx.comm.elastic else {
            "min_workers": ctx.comm.min_workers,
            **recovery_report(ctx.comm.events, ctx.comm.syncs, ctx.comm.workers)}),
        link=link_options(cfg.comm.link_bandwidth, cfg.comm.link_latency),
        fast_link=link_options(cfg.comm.fast_link_bandwidth, cfg.comm.fast_link_latency),
        wall_seconds=wall, train_seconds=train_seconds, eval_seconds=loop.eval_seconds,
        diagnostic_seconds=loop.diagnostic_seconds, checkpoints=loop.checkpoints,
        checkpoint_seconds=loop.checkpoint_seconds, tokens_per_second=tokens / train_seconds,
        per_worker=workers,
        fragments=algo.fragment_stats() if hasattr(algo, "fragment_stats") else None,
        codec_kernel=codec_kernel(algo), replicas=replicas,
        replicas_verified=replicas_verified(w, loop), guard=guard,
        corpus={"name": corpus.name, "train_tokens": len(corpus.train),
                "val_tokens": len(corpus.val), "vocab_size": corpus.vocab_size,
                "eval_corpus_tokens": (None if corpus.eval_extra is None
                                       else len(corpus.eval_extra))},
        device=str(ctx.device), machine=machine_info(ctx.device), config=cfg.to_dict())


def link_options(bandwidth: str | None, latency: str | None) -> dict | None:
    """An emulated link's options as given, for the summary; None without one.

    Args:
        bandwidth: ``--link-bandwidth`` (or ``--fast-link-bandwidth``), or None.
        latency: ``--link-latency`` (or ``--fast-link-latency``), or None.
    """
    if bandwidth is None and latency is None:
        return None
    return {"bandwidth": bandwidth, "latency": latency}


def codec_kernel(algo: Algorithm) -> dict | None:
    """The wire codec and the kernel that ran it (``fused``: compiled by torch.compile;
    ``eager``: the reference ops, and why), for the summary; None without a codec."""
    codec = getattr(algo, "codec", None)
    if codec is None:
        return None
    return {"codec": codec.name, "kernel": kernel_in_use(codec),
            "reason": getattr(codec, "kernel_reason", None)}


def machine_info(device: torch.device) -> dict:
    """What the run ran on, for reports: host, CPU, accelerator and library versions."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "accelerator": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else None),
            "python": platform.python_version(), "torch": torch.__version__}


def final_model(cfg) -> str:
    """Which model the final eval loss is of (``Summary.final_model``)."""
    method = cfg.method_class
    if method.global_copy:
        return "the global model"
    if method.replicas_identical:
        return "the model"
    return "the replicas' average" if cfg.method.final_average else "worker 0's replica"
