"""The training loop: every step (a plain step: a batch, forward, backward, the algorithm's
step and the schedule's; what the run's options add to it are hooks, ``loco.training.hooks``),
the logging, the periodic evaluation, the replicas' spread diagnostic and the checkpoints
when due."""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager

import torch
from torch.profiler import record_function
from tqdm import tqdm

from loco.algorithms import Algorithm
from loco.algorithms.sharding import Share, flatten_fp32
from loco.comm.comm import Comm
from loco.comm import hostreads
from loco.comm.handles import Aborted
from loco.comm.hostreads import allowed
from loco.config import profile_steps
from loco.profiling import StepProfiler
from loco.runtime.pipeline import PipelineStage
from loco.training.counters import blocked_seconds, issued_link_bytes
from loco.training.errors import failure
from loco.training.evaluation import periodic_eval
from loco.training.checkpoints import checkpoint_if_due
from loco.training.hooks import StepHooks, step_hooks
from loco.training.summary import human_bytes
from loco.training.verify import verify_if_due
from loco.training.worker import Loop, Rank


def train_loop(w: Rank, loop: Loop) -> None:
    """Every step of the run; a failure becomes a TrainingError naming the rank and step."""
    step = w.first
    profiler = step_profiler(w)
    hooks = step_hooks(w, loop)
    loop.start()
    try:
        with host_read_check(w.ctx.device) as counter:
            for step in range(w.first, w.cfg.run.steps + 1):
                if w.vitals is not None:
                    w.vitals.note(step)
                with profiler.step(step):
                    loss = train_step(w, step, loop, hooks)
                    syncs = _drain(w.algo)
                    with allowed("diagnostic"):
                        spread = spread_diagnostic(w, loop, step)
                    with allowed("eval"):
                        evals = periodic_eval(w, loop, step)
                    if w.main:
                        log_step(w, loop, step, loss, syncs, spread, evals)
                    verify_if_due(w, loop, step)  # before a checkpoint: it holds the healed state
                    with allowed("checkpoint"):
                        checkpoint_if_due(w, loop, step)
                if counter is not None:
                    loop.note_host_reads(step, counter.take())
    except (Aborted, KeyboardInterrupt):
        w.writer.close(abandon=True)
        raise
    except Exception as e:  # name the worker and the step; expected failures in one line
        w.writer.close(abandon=True)
        raise failure(e, w.ctx.rank, step, w.cfg.comm.comm_timeout) from e
    finally:
        profiler.close()
    w.bar.close()


@contextmanager
def host_read_check(device):
    """The host-read instruments ``LOCO_HOST_READS`` asks for, around the loop (see
    [`loco.comm.hostreads`][loco.comm.hostreads]): yields a ``HostReadCounter`` (``count``)
    or None; with ``warn`` or ``error`` on a GPU, CUDA's sync-debug mode is on outside the
    regions that may read (syncs, logging, evaluations, checkpoints)."""
    level = hostreads.mode()
    if level == "count":
        with hostreads.HostReadCounter() as counter:
            yield counter
    elif level is not None and torch.device(device).type == "cuda":
        with hostreads.Guard(level):
            yield None
    else:
        yield None


def step_profiler(w: Rank) -> StepProfiler:
    """This rank's profiler of the ``--profile`` steps: every rank's under the processes
    launcher and torchrun, rank 0's alone under the threads launcher (one process: its
    profiler sees every rank's threads)."""
    window = profile_steps(w.cfg)
    if window is not None and window[1] < w.first and w.main:
        tqdm.write(f"loco: --profile {w.cfg.run.profile}: those steps were trained before the "
                   f"step this run resumes from ({w.first - 1}); nothing is profiled",
                   file=sys.stderr)
    threads = w.ctx.launcher == "threads"
    return StepProfiler(window, w.cfg.run.out, w.ctx.rank, w.ctx.device,
                        enabled=not threads or w.ctx.rank == 0,
                        announce=None if w.ctx.rank else "" if threads
                        else " and every other rank's next to it")


def train_step(w: Rank, step: int, loop: Loop, hooks: StepHooks) -> torch.Tensor | None:
    """One tick: an inner step where this worker trains at ``step``, else an idle tick
    (speed-aware local steps leave it out: the algorithm's schedule moves on); the run's
    hooks around it (``loco.training.hooks``). Returns the loss (None on an idle tick and on
    pipeline stages but the last)."""
    hooks.start(step)
    if hooks.trains(step):
        loss = inner_step(w, step, loop, hooks)
    else:
        w.algo.idle_step()
        w.schedule.step()
        loss = None
    if step == w.cfg.run.steps:
        w.algo.flush()  # the last fragment sent must reach the evaluated global model
    hooks.end(step)
    return loss


def inner_step(w: Rank, step: int, loop: Loop, hooks: StepHooks) -> torch.Tensor | None:
    """One inner step: a batch, the forward and backward passes, the algorithm's step
    (which syncs when due) and the schedule's, with the hooks' phases between them;
    returns the loss (None on pipeline stages but the last)."""
    hooks.before(step)
    batch = w.loader.next_batch() if w.loader is not None else None
    with record_function("loco/forward_backward"), hooks.compute(step):
        loss = forward_backward(w, batch, step)
    hooks.after_backward(step)
    w.algo.step()
    w.schedule.step()
    w.algo.zero_grad()
    loop.trained_steps += 1
    hooks.after(step)
    return loss


def forward_backward(w: Rank, batch, step: int) -> torch.Tensor | None:
    """The forward and backward passes of ``batch`` (None on later pipeline stages: they
    receive their inputs); with pipeline stages, this stage's, its activations and
    gradients routed between the stages' replicas. Returns the loss (on the last stage
    only)."""
    if w.pipeline is not None:
        return w.pipeline.forward_backward(batch, step)
    with w.autocast:
        loss = w.model(*batch)
    loss.backward()
    return loss


def spread_diagnostic(w: Rank, loop: Loop, step: int) -> float | None:
    """Every --spread-every steps (methods whose replicas differ): the replicas' RMS distance
    to their mean. A diagnostic, not part of the algorithm: its all-worker reductions and
    their time are kept out of the training bytes, blocked time and loop time."""
    cfg = w.cfg
    if (w.algo.replicas_identical or not cfg.method.spread_every or step % cfg.method.spread_every
            or w.ctx.comm.elastic):  # not between the syncs of an elastic run
        return None
    t0 = time.perf_counter()
    spread = replica_spread(w.algo, w.ctx.comm, w.pipeline, w.ctx.inner)
    loop.diagnostic_seconds += time.perf_counter() - t0
    return spread


SPREAD_BUCKET = 1 << 24
"""Values (fp32, 64 MiB) the spread diagnostic reduces at a time: its buffers, and the
Comm's it reduces through, stay this size whatever the model's (a whole 1B model's would
be 4 GB of each, kept by the Comm for the rest of the run)."""


@torch.no_grad()
def replica_spread(algo: Algorithm, comm: Comm, pipeline: PipelineStage | None = None,
                   inner: Comm | None = None) -> float:
    """RMS over all parameters of each replica's distance to the replicas' mean.

    A diagnostic, not part of any algorithm: all-worker all-reduces of the model (of each
    stage's part, with pipeline stages), ``SPREAD_BUCKET`` values at a time, and one of two
    numbers, tagged ``diagnostic``, outside the training bytes and blocked time. With
    pipeline stages every stage measures its own parameters and the sums are combined over
    all ranks. With workers of R ranks every rank measures its share (a ``Share``: its FSDP2
    shards, or its 1/R range) with the same rank of the other workers, and the sums are
    combined over the worker's ranks (``inner``)."""
    params = algo.params if pipeline is None else pipeline.owned_parameters()
    share = Share(params, inner)
    size = max(1, min(share.numel, SPREAD_BUCKET))
    mine, mean = (torch.empty(size, device=comm.device) for _ in range(2))
    squares = torch.zeros((), dtype=torch.float64, device=comm.device)
    for bucket in buckets(share.views, size):
        n = sum(t.numel() for t in bucket)
        flatten_fp32(bucket, out=mine[:n])
        mean[:n].copy_(mine[:n])
        comm.all_reduce_mean(mean[:n], tag="diagnostic").wait()
        squares += (mine[:n] - mean[:n]).double().pow(2).sum()
    stats = torch.stack([squares, torch.tensor(float(share.numel), dtype=torch.float64,
                                               device=comm.device)])
    sums = [pipeline.pipe] if pipeline is not None else [comm, inner]
    for c in sums:  # means over ranks: the ratio of the two is that of the sums
        if c is not None:
            c.all_reduce_mean(stats, tag="diagnostic").wait()
    return math.sqrt(stats[0].item() / stats[1].item())


def buckets(tensors: list[torch.Tensor], size: int):
    """The tensors' values in order, as lists of 1-D views of at most ``size`` values in
    all (a tensor may be cut between two lists); every list but the last holds ``size``."""
    batch, room = [], size
    for t in tensors:
        flat, at = t.detach().reshape(-1), 0
        while at < flat.numel():
            take = min(room, flat.numel() - at)
            batch.append(flat[at:at + take])
            at, room = at + take, room - take
            if room == 0:
                yield batch
                batch, room = [], size
    if batch:
        yield batch


def log_step(w: Rank, loop: Loop, step: int, loss: torch.Tensor, syncs: list[dict],
             spread: float | None, evals: dict) -> None:
    """The lead rank's records of a step: its sync events, and a metrics record when there
    is something to log (every --log-every steps, a spread or an evaluation); then the
    progress bar."""
    cfg, tokens = w.cfg, w.tokens_at(step)
    for sync in syncs:
        w.log.metric({"event": "sync", **sync})
    if w.ctx.comm.elastic:
        log_membership(w, step)
    loop.add_loss(loss)  # read every --log-every steps: no device synchronisation per step
    record = None if spread is None else {"step": step, "tokens": tokens, "spread": spread}
    if step % cfg.run.log_every == 0 or step == cfg.run.steps:
        with allowed("log"):
            loop.settle_losses()
        if loop.loss_count:  # (none where this worker trained no tick since the last)
            loop.shown_loss = loop.loss_sum / loop.loss_count
        record = {**(record or {}), "step": step, "tokens": tokens,  # lr: the last group's,
                  "train_loss": loop.shown_loss, "lr": w.schedule.get_last_lr()[-1]}  # --lr
        loop.loss_sum, loop.loss_count = 0.0, 0
    if evals:
        record = {**(record or {"step": step, "tokens": tokens}), **evals}
    sent = w.ctx.comm.issued_bytes("train")  # at issue: the same whatever the timing
    if record is not None:
        record.update(bytes_sent=sent, **issued_link_bytes(w.ctx),
                      elapsed=time.perf_counter() - w.start, train_seconds=loop.elapsed())
        w.log.metric(record)
    train_seconds = loop.elapsed()
    this_run = max(train_seconds - loop.train_seconds, 1e-9)  # since (re)start
    w.bar.set_postfix(loss="-" if loop.shown_loss is None else f"{loop.shown_loss:.3f}",
                      tok_s=f"{(step - w.first + 1) * w.tokens_per_step / this_run:,.0f}",
                      sent=human_bytes(sent),
                      cu=f"{1 - blocked_seconds(w.ctx) / train_seconds:.0%}", refresh=False)
    w.bar.update(1)


def log_membership(w: Rank, step: int) -> None:
    """An elastic run's records (lead rank): every committed sync's participants and every
    change of membership or dropped sync since the last call; changes also on the console."""
    comm = w.ctx.comm
    for rec in comm.syncs[w.elastic_logged[0]:]:
        w.log.metric({"event": "elastic_sync", "step": step, **rec})
    for ev in comm.events[w.elastic_logged[1]:]:
        w.log.metric({**ev, "step": step, "event": "membership", "elastic": ev["event"]})
        if ev["event"] != "membership" or ev["joined"] != sorted(ev["members"]):
            tqdm.write(f"loco: step {step}: {describe_event(ev)}", file=sys.stderr)
    w.elastic_logged = (len(comm.syncs), len(comm.events))


def describe_event(ev: dict) -> str:
    """One line for a membership event of an ElasticComm."""
    if ev["event"] == "membership":
        change = ", ".join(f"worker {w} {what}" for what in ("left", "joined")
                           for w in ev[what])
        return f"{change or 'membership'}; members {ev['members']}"
    return f"{ev['event'].replace('_', ' ')} ({ev.get('error') or 'no error text'})"


def _drain(algo: Algorithm) -> list[dict]:
    """The syncs the algorithm applied since the last call."""
    log = getattr(algo, "sync_log", None)
    if not log:
        return []
    out = list(log)
    log.clear()
    return out
