"""What one rank's run is made of (``Rank``) and the training loop's running values
(``Loop``). ``Rank``'s old name, ``Worker``, still imports for one release, with a
``DeprecationWarning``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loco import checkpoint
from loco.algorithms import Algorithm
from loco.config import TrainConfig
from loco.data import Corpus, TokenLoader
from loco.lazy import old_names
from loco.runtime import RankContext
from loco.runtime.faults import Fault
from loco.runtime.pipeline import PipelineStage
from loco.runtime.vitals import Vitals
from loco.training.emulation import Throttle
from loco.training.local_steps import LocalSteps
from loco.training.runlog import RunLog


@dataclass
class Rank:
    """What one rank's run is made of, built once by :func:`setup_worker`.

    Args:
        cfg: the run's configuration.
        ctx: this rank's place in the run and its communicators.
        corpus: the tokenized corpus.
        model: the whole model (this rank trains ``trained``, its stage's part of it).
        trained: the module this rank trains: ``model``, or its pipeline stage's part.
        pipeline: this rank's pipeline stage; None without pipeline stages.
        schedule: the inner learning-rate schedule.
        algo: the training algorithm around the inner optimizer.
        loader: the training batches; None on later pipeline stages (they receive inputs).
        autocast: the compute precision's context (bf16 autocast, or none).
        main: whether this rank logs and writes the outputs (replica 0's last stage).
        log: the run directory's metrics (on the lead rank), else None.
        bar: the progress bar (disabled except on the lead rank with ``--progress``).
        writer: this rank's background checkpoint writer.
        fault: this rank's injected fault (``LOCO_FAULT``), if any.
        resumed_from: the checkpoint's step this run resumed from; None for a fresh run.
        start: ``time.perf_counter()`` when the worker started.
        resumed_tokens: the training tokens of the steps before ``resumed_from`` (workers
            of another R trained them at another rate); default 0.
        vitals: this rank's vitals file (its step and memory, for a death's report); None
            writes nothing.
        stager: the host buffers a checkpoint of a model on a GPU is copied into, for the
            background writer; None (a model on the CPU): checkpoints are written in place
            by the training thread, with no copy of the state.
        throttle: this worker's emulated speed (``--worker-speed``); None: its own.
        local_steps: the ticks each worker trains on (``--local-steps proportional``);
            None: every worker every step.
    """

    cfg: TrainConfig
    ctx: RankContext
    corpus: Corpus
    model: torch.nn.Module
    trained: torch.nn.Module
    pipeline: PipelineStage | None
    schedule: Any
    algo: Algorithm
    loader: TokenLoader | None
    autocast: Any
    main: bool
    log: RunLog | None
    bar: Any
    writer: checkpoint.Writer
    fault: Fault | None
    resumed_from: int | None
    start: float
    resumed_tokens: int = 0
    elastic_logged: tuple[int, int] = (0, 0)  # syncs and events of an ElasticComm logged
    lead: int = 0  # the worker that evaluates and reports (elastic: the lowest live one)
    elastic_tokens: int = 0  # elastic: tokens the live workers trained, counted as they go
    vitals: Vitals | None = None
    stager: checkpoint.Stager | None = None
    throttle: Throttle | None = None
    local_steps: LocalSteps | None = None

    def tokens_at(self, step: int) -> int:
        """Training tokens of the whole run after ``step``, every rank together (elastic:
        of the live workers, counted step by step; ``step`` is the current one)."""
        if self.ctx.comm.elastic:
            return self.elastic_tokens
        if self.local_steps is not None:  # the steps every worker trained, tick by tick
            return self.local_steps.steps_until(step) * self.tokens_per_step // (
                self.ctx.workers)
        if self.resumed_from is None:
            return step * self.tokens_per_step
        return self.resumed_tokens + (step - self.resumed_from) * self.tokens_per_step

    @property
    def first(self) -> int:
        """The first step this run trains."""
        return 1 if self.resumed_from is None else self.resumed_from + 1

    @property
    def evaluates(self) -> bool:
        """Whether this rank evaluates the global model (replica 0's stages and ranks do,
        together: its global parameters are gathered over the worker's ranks; at the end
        of an elastic run, the lead's)."""
        return self.ctx.worker == self.lead

    @property
    def tokens_per_step(self) -> int:
        """Training tokens of one inner step, every rank of every replica together."""
        return (self.ctx.workers * self.ctx.worker_ranks * self.cfg.data.batch_size
                * self.cfg.data.seq_len)

    def gather_all(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (one shape on every rank), in global rank order, for the
        end-of-run report (tag ``report``): over the pipeline's Comm, which spans every rank;
        or across the workers (``ctx.comm``), then inside them (``ctx.inner``).

        Args:
            tensor: this rank's tensor, on the Comms' device.
        """
        ctx = self.ctx
        if ctx.pipe is not None or ctx.inner is None:
            return (ctx.pipe or ctx.comm).all_gather(tensor, tag="report").wait()
        across = torch.stack(ctx.comm.all_gather(tensor, tag="report").wait())  # by replica
        # (elastic on a GPU: the inner Comm is on the GPU, the elastic one on the CPU)
        inside = ctx.inner.all_gather(across.to(ctx.inner.device), tag="report").wait()
        return [inside[shard][replica] for replica in range(len(across))  # (elastic: the
                for shard in range(ctx.worker_ranks)]  # members) rank = replica x R + shard


#: The running values a checkpoint saves (under "loop"), to continue them exactly.
SAVED_LOOP = ("loss_sum", "loss_count", "eval_seconds", "diagnostic_seconds", "train_seconds",
              "metrics_bytes", "trained_steps", "throttle_seconds", "local_rounds",
              "local_admitted")


@dataclass
class Loop:
    """The training loop's running values.

    Args:
        loss_sum: sum of the training losses since the last logged record.
        loss_count: how many losses ``loss_sum`` holds.
        eval_seconds: time spent in periodic evaluations, over the whole run.
        diagnostic_seconds: time spent measuring the replicas' spread, over the whole run.
        train_seconds: training-loop time at the checkpoint this run resumed from (0: fresh).
        metrics_bytes: length of ``metrics.jsonl`` at that checkpoint.
        origin: ``time.perf_counter()`` at which the whole run's loop would have started.
        checkpoints: checkpoints this run (not one it resumed from) took.
        checkpoint_seconds: time the training thread spent on them (waiting for the previous
            write, copying the state), this run.
        trained_steps: inner steps this rank trained, over the whole run (an elastic
            joiner's from its join).
        throttle_seconds: seconds it slept to emulate its ``--worker-speed``, over the run.
        local_rounds: with ``--local-steps proportional``: every round's steps per worker,
            as agreed at the checkpoint this run resumed from (None: a fresh schedule).
    """

    loss_sum: float = 0.0
    loss_count: int = 0
    losses: list = field(default_factory=list)
    """The losses of the steps since the last ``settle_losses``, still on the device."""
    shown_loss: float | None = None
    """The latest logged training loss (the progress bar's)."""
    eval_seconds: float = 0.0
    diagnostic_seconds: float = 0.0
    train_seconds: float = 0.0
    metrics_bytes: int = 0
    origin: float = 0.0
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    trained_steps: int = 0
    throttle_seconds: float = 0.0
    local_rounds: list | None = None
    local_admitted: list | None = None
    """With ``--quorum``: every decided sync's merged workers (None: held), as at the
    checkpoint this run resumed from."""
    last_checkpoint: float | None = None
    """``time.perf_counter()`` when this run's last checkpoint was handed over (None: none
    yet; ``--checkpoint-interval`` counts from the loop's start)."""
    host_reads: dict | None = None
    """With ``LOCO_HOST_READS=count``: the most host reads one step made, by reason
    (``step``: outside the regions that may read), and ``steps_reading``: the first steps
    that read outside them (``loco.comm.hostreads``); None: not counted."""
    replica_checks: Any = None
    """This run's replica checks (``loco.training.verify.ReplicaChecks``); None: none yet."""

    def note_host_reads(self, step: int, reads) -> None:
        """Record the host reads of ``step`` (a Counter by reason)."""
        seen = self.host_reads = self.host_reads or {"step": 0, "steps_reading": []}
        for why, n in reads.items():
            seen[why] = max(seen.get(why, 0), n)
        if reads.get("step") and len(seen["steps_reading"]) < 8:
            seen["steps_reading"].append(step)

    def add_loss(self, loss: torch.Tensor | None) -> None:
        """Keep a step's loss without reading it from the device (no synchronisation);
        None (a tick this worker did not train: speed-aware local steps) is no step."""
        if loss is None:
            return
        self.losses.append(loss.detach())
        self.loss_count += 1

    def settle_losses(self) -> None:
        """Add the kept losses to ``loss_sum`` (one read from the device for all of them),
        in step order and in fp64, as a Python sum of each step's value would."""
        if self.losses:
            for value in torch.stack(self.losses).double().tolist():
                self.loss_sum += value
            self.losses.clear()

    def start(self) -> None:
        """Start the clock, counting the time of the run resumed from."""
        self.origin = (time.perf_counter() - self.train_seconds - self.eval_seconds
                       - self.diagnostic_seconds)

    def elapsed(self) -> float:
        """Training-loop seconds of the whole run so far, without evaluation and the spread
        diagnostic."""
        return time.perf_counter() - self.origin - self.eval_seconds - self.diagnostic_seconds


__getattr__ = old_names(__name__, {"Worker": "Rank"})
