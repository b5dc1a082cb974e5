"""``loco train``: one training job, the same code for every launcher.

:func:`run_training` prepares the data in the calling process (so bad input fails before any
worker starts), then launches :func:`train_worker` on every rank. The lead rank (replica 0's
last pipeline stage, which holds its loss; rank 0 without pipeline stages) writes
``metrics.jsonl``, ``summary.json`` and ``loss.png`` into the run directory and returns the
summary. The ranks of replica 0 (all its stages, all its ranks with ``--worker-ranks``)
evaluate the global model together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from torch.profiler import record_function
from tqdm import tqdm

from loco import checkpoint, hf
from loco.algorithms import Algorithm
from loco.algorithms.base import NonFiniteError, flatten_fp32, unflatten_views
from loco.algorithms.fragments import split_fragments
from loco.algorithms.sharding import Share, is_sharded, local
from loco.comm.kernels import kernel_in_use
from loco.comm.comm import Comm
from loco.comm.handles import Aborted
from loco.comm.link import LinkSpec
from loco.config import (ConfigError, TrainConfig, betas, model_dims, profile_steps, resolve,
                         validate, warnings_for)
from loco.dashboard import Dashboards
from loco.data import (Corpus, CorpusError, EvalCorpusError, TokenizerError, TokenLoader,
                       eval_batches, prepare_corpus, prepare_eval_tokens)
from loco.hf import is_hf
from loco.model import Transformer, model_config
from loco.profiling import StepProfiler
from loco.runtime import Elastic, WorkerContext, launch, under_torchrun
from loco.runtime.elastic import recovery_report, restart_count
from loco.runtime.faults import Fault, InjectedFault
from loco.runtime.pipeline import PipelineStage
from loco.training.preflight import preflight


def run_training(cfg: TrainConfig) -> dict:
    """Validate, prepare data, train on every worker; return worker 0's summary."""
    cfg = prepare_config(cfg)
    for message in warnings_for(cfg):
        print(f"loco train: warning: {message}", file=sys.stderr)
    corpus = prepare_data(cfg)
    check_fits(cfg, corpus)
    return launch_training(cfg, corpus)


def prepare_config(cfg: TrainConfig) -> TrainConfig:
    """Validated, with the defaults that depend on other options (and torchrun's world size)
    filled in; raises ConfigError before anything runs."""
    if under_torchrun() and cfg.stages >= 1 and cfg.worker_ranks >= 1 and not cfg.lighthouse:
        # torchrun, not --workers, decides how many workers there are
        world = int(os.environ["WORLD_SIZE"])
        per_worker = cfg.stages * cfg.worker_ranks
        if world % per_worker:
            raise ConfigError("stages" if cfg.worker_ranks == 1 else "worker_ranks",
                              f"--workers x --worker-ranks x --stages must be "
                              f"torchrun's world size {world}, so --worker-ranks x --stages "
                              f"must divide it (got {cfg.worker_ranks} x {cfg.stages})")
        cfg = dataclasses.replace(cfg, workers=world // per_worker)
    validate(cfg)
    cfg = resolve(cfg)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=os.path.join(
            "runs", f"{cfg.algorithm}-{datetime.now():%Y%m%d-%H%M%S}"))
    preflight(cfg)
    return cfg


def prepare_data(cfg: TrainConfig) -> Corpus:
    """The tokenized corpus (trained and cached on first use)."""
    try:
        corpus = prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.val_fraction, cfg.cache_dir,
                                cfg.text_field, progress=cfg.progress, tokenizer=cfg.tokenizer)
        if cfg.eval_corpus is not None:
            corpus.eval_extra = prepare_eval_tokens(cfg.eval_corpus, corpus, cfg.text_field,
                                                    cfg.cache_dir, progress=cfg.progress)
        return corpus
    except TokenizerError as e:
        raise ConfigError("tokenizer", str(e)) from None
    except EvalCorpusError as e:
        raise ConfigError("eval_corpus", str(e)) from None
    except CorpusError as e:
        raise ConfigError("corpus", str(e)) from None


def launch_training(cfg: TrainConfig, corpus: Corpus) -> dict:
    """Train a prepared config on every rank; return the lead rank's summary."""
    results = launch(train_worker, cfg.workers * cfg.stages * cfg.worker_ranks, cfg.launcher,
                     args=(cfg, corpus), ranks_per_replica=cfg.stages, shards=cfg.worker_ranks,
                     timeout=cfg.comm_timeout, max_restarts=cfg.max_restarts,
                     link=LinkSpec.parse(cfg.link_bandwidth, cfg.link_latency),
                     fast_link=LinkSpec.parse(cfg.fast_link_bandwidth, cfg.fast_link_latency),
                     elastic=Elastic(min_workers=cfg.min_workers, restarts=cfg.max_restarts,
                                     lighthouse=cfg.lighthouse, worker=cfg.worker_index)
                     if cfg.elastic else None)
    # The lead rank's summary (under torchrun the list holds only this rank's value; in an
    # elastic run a worker lost for good has None).
    return next((r for r in results if r and "final_eval_loss" in r),
                next(r for r in results if r))


def check_fits(cfg: TrainConfig, corpus: Corpus) -> None:
    """Raise a ConfigError naming the option when a batch does not fit the data: every rank
    of every worker reads its own share of the training windows, and the validation split
    must hold a sequence (a pipeline's, a whole batch).

    Args:
        cfg: the prepared configuration.
        corpus: the tokenized corpus.
    """
    windows = (len(corpus.train) - 1) // cfg.seq_len
    readers = cfg.workers * cfg.worker_ranks
    per_reader = windows // readers
    if per_reader < cfg.batch_size:
        who = (f"{cfg.workers} workers" if cfg.worker_ranks == 1 else
               f"{readers} ranks ({cfg.workers} workers x {cfg.worker_ranks} ranks)")
        raise ConfigError("batch_size", f"a batch does not fit the data: each of {who} has "
                          f"{per_reader} windows of {cfg.seq_len} tokens but a batch needs "
                          f"{cfg.batch_size}; lower --batch-size, --seq-len or --workers"
                          + (" or --worker-ranks" if cfg.worker_ranks > 1 else ""))
    if corpus.eval_extra is not None and len(corpus.eval_extra) <= cfg.seq_len:
        raise ConfigError("eval_corpus", f"it has {len(corpus.eval_extra)} tokens, fewer than "
                          f"one sequence of {cfg.seq_len} + 1; give more text or lower --seq-len")
    if len(corpus.val) <= cfg.seq_len:
        raise ConfigError("seq_len", f"the validation split ({len(corpus.val)} tokens) is "
                          f"shorter than one sequence; lower --seq-len or raise --val-fraction")
    if is_hf(cfg.model) and hf.has_weights(cfg.model):
        try:
            hf.check_vocab(cfg.model, hf.load_config(cfg.model), corpus.vocab_size)
        except hf.HFModelError as e:
            raise ConfigError("tokenizer" if cfg.tokenizer else "model", str(e)) from None
    val_windows = (len(corpus.val) - 1) // cfg.seq_len
    if cfg.stages > 1 and val_windows < cfg.batch_size:  # stages exchange whole batches
        raise ConfigError("batch_size", f"the validation split has {val_windows} windows of "
                          f"{cfg.seq_len} tokens but a pipeline evaluates whole batches of "
                          f"{cfg.batch_size}; lower --batch-size or raise --val-fraction")


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at the last step."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with ``--adam-betas``, weight decay on matrices only (not on norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=betas(cfg))


@torch.no_grad()
def evaluate(model, params: dict, batches, autocast,
             pipeline: PipelineStage | None = None) -> float | None:
    """Mean token loss of ``params`` (by name: the global model, a replica or an average)
    over ``batches``. With pipeline stages every stage of the replica calls this with its
    own part's ``params``; the loss is returned on the last stage, None elsewhere. A model
    sharded by FSDP2 is evaluated by every rank of its worker together, with ``params``
    loaded into its own parameters (see :func:`loaded`)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    sharded = pipeline is None and is_sharded(model.parameters())
    with loaded(model, params) if sharded else nullcontext():
        for x, y in batches:
            if pipeline is not None:
                loss = pipeline.evaluate((x, y), params)
            else:
                with autocast:
                    loss = (model(x, y) if sharded
                            else torch.func.functional_call(model, params, (x, y)))
            if loss is not None:
                total += loss.item() * y.numel()
                count += y.numel()
    model.train(was_training)
    return total / count if count else None


@contextmanager
def loaded(model: torch.nn.Module, params: dict):
    """``model`` (sharded by FSDP2) holding ``params``'s values inside the block, its own
    after it. ``torch.func.functional_call`` does not reach the parameters FSDP2 gathers,
    so the values are copied into each parameter's local shard and the originals copied
    back; FSDP2 is made to drop its gathered copies before and after, so that neither the
    evaluation nor the next training step uses stale ones.

    Args:
        model: a module whose parameters are DTensors (``fully_shard``).
        params: values by parameter name: DTensors placed as the parameters, or their local
            shards; a parameter left out, or given as itself, keeps its value.
    """
    own = dict(model.named_parameters())
    pairs = [(local(own[name]), local(value)) for name, value in params.items()
             if name in own and value is not own[name]]
    saved = [mine.clone() for mine, _ in pairs]
    with torch.no_grad():
        _reshard(model)
        for mine, value in pairs:
            mine.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            _reshard(model)
            for (mine, _), old in zip(pairs, saved):
                mine.copy_(old)


def _reshard(model: torch.nn.Module) -> None:
    """Free FSDP2's gathered parameters, so the next forward gathers the shards anew."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class Worker:
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
    """

    cfg: TrainConfig
    ctx: WorkerContext
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

    def tokens_at(self, step: int) -> int:
        """Training tokens of the whole run after ``step``, every rank together (elastic:
        of the live workers, counted step by step; ``step`` is the current one)."""
        if self.ctx.comm.elastic:
            return self.elastic_tokens
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
        return self.ctx.replica == self.lead

    @property
    def tokens_per_step(self) -> int:
        """Training tokens of one inner step, every rank of every replica together."""
        return (self.ctx.mesh.replicas * self.ctx.mesh.shards * self.cfg.batch_size
                * self.cfg.seq_len)

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
        inside = ctx.inner.all_gather(across, tag="report").wait()  # by shard
        return [inside[shard][replica] for replica in range(len(across))  # (elastic: the
                for shard in range(ctx.mesh.shards)]  # members) rank = replica x R + shard


#: The running values a checkpoint saves (under "loop"), to continue them exactly.
SAVED_LOOP = ("loss_sum", "loss_count", "eval_seconds", "diagnostic_seconds", "train_seconds",
              "metrics_bytes")


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

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keep a step's loss without reading it from the device (no synchronisation)."""
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


def train_worker(ctx: WorkerContext, cfg: TrainConfig, corpus: Corpus) -> dict:
    """Everything one rank does in ``loco train``: set up (or resume), train, evaluate,
    checkpoint, report; the lead rank returns the summary, the others ``{"rank": r}``."""
    torch.set_flush_denormal(True)  # denormals made CPU steps 8x slower
    worker, loop = setup_worker(ctx, cfg, corpus)
    try:
        train_loop(worker, loop)
        return finish_worker(worker, loop)
    except BaseException:
        if worker.log is not None:  # the dashboards mark the run failed
            worker.log.dash.close(failed=True)
        raise


def setup_worker(ctx: WorkerContext, cfg: TrainConfig, corpus: Corpus) -> tuple[Worker, Loop]:
    """Build the model, pipeline stage, optimizer, algorithm and loader; resume from the
    last complete checkpoint when asked (--resume) or after torch elastic restarted the
    workers."""
    start = time.perf_counter()
    device = ctx.device
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
                else nullcontext())
    model = build_model(cfg, ctx, corpus.vocab_size)
    # With pipeline stages each rank trains and syncs only its stage's part of the model.
    pipeline = (PipelineStage(model, ctx, cfg.batch_size, cfg.seq_len, routing=cfg.routing,
                              seed=cfg.seed, autocast=autocast) if ctx.stages > 1 else None)
    trained = model if pipeline is None else pipeline.module
    optimizer = adamw(trained, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    algo = cfg.method.from_config(cfg, trained, optimizer, ctx.comm, pipeline, ctx.inner)
    # Every rank of every worker reads its own batches: M x R readers.
    loader = (TokenLoader(corpus.train, cfg.batch_size, cfg.seq_len,
                          rank=ctx.replica * ctx.mesh.shards + ctx.shard,
                          world_size=ctx.mesh.replicas * ctx.mesh.shards, seed=cfg.seed,
                          device=device)
              if ctx.stage == 0 else None)  # later stages receive their inputs
    main = ctx.rank == ctx.mesh.rank_of(0, ctx.stages - 1)  # replica 0's last stage, shard 0
    state, loop = resume_state(cfg, ctx, corpus), Loop()
    if state is not None:
        (restore_elastic if state.get("elastic") else restore)(state, algo, schedule, loader,
                                                               ctx)
        loop = Loop(**{k: state["loop"][k] for k in SAVED_LOOP
                       if state["loop"].get(k) is not None})
    joined = ctx.comm.elastic and algo.join()  # a restarted worker takes a live one's state
    if joined:
        seek(schedule, loader, algo.inner_steps)
    resumed_from = algo.inner_steps if joined else None if state is None else int(state["step"])
    first = 1 if resumed_from is None else resumed_from + 1
    bar = tqdm(total=cfg.steps, initial=first - 1,
               desc=f"{cfg.algorithm} x{ctx.mesh.replicas}"
               + (f"x{ctx.stages} stages" if ctx.stages > 1 else "")
               + (f"x{ctx.mesh.shards} ranks" if ctx.mesh.shards > 1 else ""), unit="step",
               disable=not (main and cfg.progress), dynamic_ncols=True)
    # An elastic run's checkpoint is the lead's (whichever worker leads then): one file per
    # rank of that worker, each with its share; otherwise a worker of R ranks saves its
    # tensors through DCP.
    elastic = ctx.comm.elastic
    dcp = ctx.checkpoint_group is not None and not elastic
    writer = checkpoint.Writer(cfg.out, ctx.shard if elastic else ctx.rank,
                               ctx.mesh.shards if elastic else ctx.world_size,
                               timeout=cfg.comm_timeout,
                               commit_meta={"world_size": ctx.mesh.shards if elastic
                                            else ctx.world_size,
                                            "algorithm": cfg.algorithm,
                                            "worker_ranks": cfg.worker_ranks,
                                            "worker_parallel": cfg.worker_parallel,
                                            "dcp_workers": cfg.workers if dcp else 0,
                                            "elastic": elastic,
                                            "config": cfg.to_dict()}
                               if main or elastic and ctx.shard == 0 else None,
                               worker=ctx.replica if dcp else None,
                               group=ctx.checkpoint_group if dcp else None)
    metrics = os.path.join(cfg.out, "metrics.jsonl")
    appends = os.path.exists(metrics) and (joined or state is not None
                                           and state["loop"].get("metrics_bytes") is None)
    # a resumed lead cuts metrics.jsonl where its checkpoint was; a rejoined lead, or one
    # resumed from a checkpoint another worker led, appends
    keep = os.path.getsize(metrics) if appends else loop.metrics_bytes if state else None
    worker = Worker(
        cfg, ctx, corpus, model, trained, pipeline, schedule, algo, loader, autocast, main,
        log=RunLog(cfg.out, resume_at=keep, cfg=cfg,
                   resumed_from=None if appends or state is None else int(state["step"]))
        if main else None, bar=bar, writer=writer,
        fault=Fault.for_rank(ctx.rank) if state is None and restart_count() == 0 else None,
        resumed_from=resumed_from, start=start)
    if resumed_from is not None:  # a checkpoint counts its tokens; a joiner estimates them
        nominal = resumed_from * ctx.mesh.replicas * ctx.mesh.shards * cfg.batch_size * cfg.seq_len
        worker.resumed_tokens = int(state["loop"].get("tokens", nominal)) if state else nominal
    worker.elastic_tokens = worker.resumed_tokens
    return worker, loop


def seek(schedule, loader: TokenLoader | None, step: int) -> None:
    """Put the learning-rate schedule and the loader where a worker is after ``step`` inner
    steps (a worker that joined an elastic run at that step: its batches are its own
    shard's, as if it had never stopped)."""
    for group, base, f in zip(schedule.optimizer.param_groups, schedule.base_lrs,
                              schedule.lr_lambdas):
        group["lr"] = base * f(step)
    schedule.last_epoch = step
    schedule._last_lr = [g["lr"] for g in schedule.optimizer.param_groups]
    if loader is not None:
        per_epoch = loader.batches_per_epoch
        loader.load_state_dict({"epoch": step // per_epoch, "position": step % per_epoch})


def make_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The run's model in fp32 on the CPU, before any sharding: the built-in ``Transformer``
    of ``--model`` (with ``--layers``, ``--dim``, ``--heads``), or a Hugging Face model
    (``hf:PATH``, see [`loco.hf`][loco.hf]). Its weights are drawn from ``--seed`` (or loaded),
    the same in every process.

    Args:
        cfg: the run's configuration.
        vocab_size: the tokenizer's vocabulary size.
    """
    if is_hf(cfg.model):
        return hf.build(cfg.model, vocab_size, cfg.seed, cfg.z_loss)
    mcfg = model_config(cfg.model, vocab_size, cfg.seq_len, z_loss=cfg.z_loss,
                        **model_dims(cfg))
    return Transformer(mcfg, torch.Generator().manual_seed(cfg.seed))


def build_model(cfg: TrainConfig, ctx: WorkerContext, vocab_size: int) -> torch.nn.Module:
    """The model (:func:`make_model`) on this rank's device; with ``--worker-parallel fsdp``,
    sharded over the worker's ranks by FSDP2 (before any optimizer sees its parameters).
    Every rank builds the same weights from the seed; the algorithm still broadcasts worker
    0's and verifies checksums.

    Args:
        cfg: the run's configuration.
        ctx: this rank's context.
        vocab_size: the corpus's vocabulary size.
    """
    model = make_model(cfg, vocab_size).to(ctx.device)
    if cfg.worker_parallel == "fsdp":
        from loco.runtime.fsdp import shard_worker

        model = shard_worker(model, ctx)
    return model


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


def train_loop(w: Worker, loop: Loop) -> None:
    """Every step of the run; a failure becomes a TrainingError naming the rank and step."""
    step = w.first
    profiler = step_profiler(w)
    loop.start()
    try:
        for step in range(w.first, w.cfg.steps + 1):
            with profiler.step(step):
                loss = train_step(w, step)
                syncs = _drain(w.algo)
                spread = spread_diagnostic(w, loop, step)
                evals = periodic_eval(w, loop, step)
                if w.main:
                    log_step(w, loop, step, loss, syncs, spread, evals)
                checkpoint_if_due(w, loop, step)
    except (Aborted, KeyboardInterrupt):
        w.writer.close(abandon=True)
        raise
    except Exception as e:  # name the worker and the step; expected failures in one line
        w.writer.close(abandon=True)
        raise failure(e, w.ctx.rank, step, w.cfg.comm_timeout) from e
    finally:
        profiler.close()
    w.bar.close()


def step_profiler(w: Worker) -> StepProfiler:
    """This rank's profiler of the ``--profile`` steps: every rank's under the processes
    launcher and torchrun, rank 0's alone under the threads launcher (one process: its
    profiler sees every rank's threads)."""
    window = profile_steps(w.cfg)
    if window is not None and window[1] < w.first and w.main:
        tqdm.write(f"loco: --profile {w.cfg.profile}: those steps were trained before the "
                   f"step this run resumes from ({w.first - 1}); nothing is profiled",
                   file=sys.stderr)
    threads = w.ctx.launcher == "threads"
    return StepProfiler(window, w.cfg.out, w.ctx.rank, w.ctx.device,
                        enabled=not threads or w.ctx.rank == 0,
                        announce=None if w.ctx.rank else "" if threads
                        else " and every other rank's next to it")


def failure(e: Exception, rank: int, step: int, comm_timeout: float) -> TrainingError:
    """The TrainingError reporting ``e``, raised by worker ``rank`` at ``step``."""
    where = f"worker {rank} failed at step {step}"
    expected = isinstance(e, (NonFiniteError, InjectedFault, checkpoint.CheckpointError))
    if not expected and ("timed out" in str(e).lower() or "timeout" in str(e).lower()):
        return TrainingError(f"{where}: a communication took longer than --comm-timeout "
                             f"{comm_timeout:g} s; a peer stopped answering or is far too "
                             f"slow ({str(e).splitlines()[0][:200]})", brief=True)
    return TrainingError(f"{where}: {type(e).__name__}: {e}", brief=expected)


def train_step(w: Worker, step: int) -> torch.Tensor | None:
    """One inner step: forward, backward, the algorithm's step (which syncs when due) and
    the schedule's; returns the loss (None on pipeline stages but the last)."""
    if w.fault is not None:
        if step == w.fault.step:  # a drill strikes once the last checkpoint is committed
            w.writer.wait_committed(w.ctx.comm.check_aborted)
        w.fault.before_step(step, w.ctx.comm, w.algo.params)
    batch = w.loader.next_batch() if w.loader is not None else None
    with record_function("loco/forward_backward"):
        if w.pipeline is None:
            with w.autocast:
                loss = w.model(*batch)
            loss.backward()
        else:  # the loss arrives on the last stage only
            loss = w.pipeline.forward_backward(batch, step)
    if w.fault is not None:
        w.fault.after_backward(step, w.algo.params)
    w.algo.step()
    w.schedule.step()
    w.algo.zero_grad()
    if step % w.cfg.log_every == 0:  # inner steps skipped on the device, if any, read now
        w.algo.settle_nonfinite()
    if w.ctx.comm.elastic:  # the workers in the quorum of the latest sync trained this step
        w.elastic_tokens += (len(w.ctx.comm.members) * w.ctx.mesh.shards * w.cfg.batch_size
                             * w.cfg.seq_len)
    if step == w.cfg.steps:
        w.algo.flush()  # the last fragment sent must reach the evaluated global model
    return loss


def spread_diagnostic(w: Worker, loop: Loop, step: int) -> float | None:
    """Every --spread-every steps (methods whose replicas differ): the replicas' RMS distance
    to their mean. A diagnostic, not part of the algorithm: its all-worker reductions and
    their time are kept out of the training bytes, blocked time and loop time."""
    cfg = w.cfg
    if (w.algo.replicas_identical or not cfg.spread_every or step % cfg.spread_every
            or w.ctx.comm.elastic):  # not between the syncs of an elastic run
        return None
    t0 = time.perf_counter()
    spread = replica_spread(w.algo, w.ctx.comm, w.pipeline, w.ctx.inner)
    loop.diagnostic_seconds += time.perf_counter() - t0
    return spread


def periodic_eval(w: Worker, loop: Loop, step: int) -> dict:
    """Every --eval-every steps but the last, on replica 0's ranks: the global model's loss
    on the validation split (``eval_loss``) and on ``--eval-corpus`` (``eval_loss_extra``),
    on its last stage; empty elsewhere."""
    cfg = w.cfg
    if not (cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
            and w.evaluates):
        return {}
    t0 = time.perf_counter()
    losses = {name: evaluate(w.trained, w.algo.global_parameters(),
                             eval_batches(tokens, cfg.batch_size, cfg.seq_len, cfg.eval_batches,
                                          w.ctx.device), w.autocast, w.pipeline)
              for name, tokens in held_out(w.corpus)}
    loop.eval_seconds += time.perf_counter() - t0
    return {k: v for k, v in losses.items() if v is not None}


def held_out(corpus: Corpus) -> list[tuple[str, Any]]:
    """The held-out sets a run evaluates on, by record field: the validation split, and the
    ``--eval-corpus`` if given."""
    sets = [("eval_loss", corpus.val)]
    if corpus.eval_extra is not None:
        sets.append(("eval_loss_extra", corpus.eval_extra))
    return sets


def log_step(w: Worker, loop: Loop, step: int, loss: torch.Tensor, syncs: list[dict],
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
    if step % cfg.log_every == 0 or step == cfg.steps:
        loop.settle_losses()
        loop.shown_loss = loop.loss_sum / loop.loss_count
        record = {**(record or {}), "step": step, "tokens": tokens,
                  "train_loss": loop.shown_loss, "lr": w.schedule.get_last_lr()[0]}
        loop.loss_sum, loop.loss_count = 0.0, 0
    if evals:
        record = {**(record or {"step": step, "tokens": tokens}), **evals}
    sent = w.ctx.comm.issued_bytes("train")  # at issue: the same whatever the timing
    if record is not None:
        record.update(bytes_sent=sent, **issued_link_bytes(w.ctx),
                      elapsed=time.perf_counter() - w.start)
        w.log.metric(record)
    train_seconds = loop.elapsed()
    this_run = max(train_seconds - loop.train_seconds, 1e-9)  # since (re)start
    w.bar.set_postfix(loss="-" if loop.shown_loss is None else f"{loop.shown_loss:.3f}",
                      tok_s=f"{(step - w.first + 1) * w.tokens_per_step / this_run:,.0f}",
                      sent=human_bytes(sent),
                      cu=f"{1 - blocked_seconds(w.ctx) / train_seconds:.0%}", refresh=False)
    w.bar.update(1)


def log_membership(w: Worker, step: int) -> None:
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


def issued_link_bytes(ctx: WorkerContext) -> dict[str, int]:
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


def checkpoint_if_due(w: Worker, loop: Loop, step: int) -> None:
    """Checkpoint every --checkpoint-every rounds of H steps, at the same step on every
    rank: the first one after the round's end at which no worker has a sync in flight
    (Streaming DiLoCo: worker m applies the fragment sent at the round's end τ_m steps
    later, and sends the next one floor(H/P) > max τ steps after it, so max τ steps later),
    and at the last step. The state is copied on this thread; the writer saves it in the
    background."""
    cfg = w.cfg
    every = cfg.checkpoint_every * cfg.sync_every
    delay = cfg.method.checkpoint_delay(cfg)
    if step == cfg.steps or (every and step > delay and (step - delay) % every == 0):
        assert step == cfg.steps or not w.algo.sync_in_flight, "a sync is in flight"
        if w.ctx.comm.elastic:
            if w.ctx.replica == min(w.ctx.comm.members):  # the lead writes the one file
                w.writer.save(step, elastic_checkpoint_state(w, loop, step),
                              w.ctx.comm.check_aborted)
            return
        dcp = w.ctx.checkpoint_group is not None  # the tensors go through DCP
        w.writer.save(step, checkpoint_state(w, loop, step, tensors=not dcp),
                      w.ctx.comm.check_aborted,
                      tensors=checkpoint.snapshot(w.algo.checkpoint_tensors(shard_mesh(w.ctx)))
                      if dcp else None)


def shard_mesh(ctx: WorkerContext):
    """The ``DeviceMesh`` of this worker's R ranks; None without one (threads, R = 1)."""
    return ctx.device_mesh["shard"] if ctx.device_mesh is not None and ctx.mesh.shards > 1 \
        else None


def checkpoint_state(w: Worker, loop: Loop, step: int, tensors: bool = True) -> dict:
    """Everything this rank needs to continue after ``step``, copied to CPU memory (without
    the algorithm's tensors when ``tensors`` is False: DCP saves them)."""
    ctx = w.ctx
    return checkpoint.snapshot({
        "step": step, "algorithm": w.algo.state_dict(tensors),
        "schedule": w.schedule.state_dict(),
        "loader": w.loader.state_dict() if w.loader is not None else None,
        "rng": torch.get_rng_state(), "comm": ctx.comm.state_dict(),
        "pipe": ctx.pipe.state_dict() if ctx.pipe is not None else None,
        "inner": ctx.inner.state_dict() if ctx.inner is not None else None,
        "loop": loop_state(w, loop, step)})


def loop_state(w: Worker, loop: Loop, step: int) -> dict:
    """The loop's running values after ``step``, for a checkpoint (``metrics_bytes``: the
    length of metrics.jsonl; None on a rank that does not write it in an elastic run)."""
    loop.settle_losses()
    return {"loss_sum": loop.loss_sum, "loss_count": loop.loss_count,
            "eval_seconds": loop.eval_seconds, "diagnostic_seconds": loop.diagnostic_seconds,
            "train_seconds": loop.elapsed(),
            "metrics_bytes": w.log.tell() if w.log is not None else
            None if w.ctx.comm.elastic else 0,
            "tokens": w.tokens_at(step)}


def elastic_checkpoint_state(w: Worker, loop: Loop, step: int) -> dict:
    """What an elastic run's lead saves after ``step``: the state a joining worker receives
    (``Algorithm.heal_state``), with its tensors, and the loop's running values (the
    length of metrics.jsonl only when the lead writes it)."""
    return checkpoint.snapshot({"step": step, "elastic": True, "heal": w.algo.heal_state(),
                                "loop": loop_state(w, loop, step)})


def finish_worker(w: Worker, loop: Loop) -> dict:
    """The end of the run: gather every rank's counters, evaluate the final model(s), wait
    for the last checkpoint, write this rank's comm totals; the lead writes the summary."""
    train_seconds = loop.elapsed()
    if w.ctx.comm.elastic:
        take_lead(w)
    per_worker = gather_counters(w, train_seconds)
    final_eval, replicas = final_evaluation(w)
    extra = final_extra_evaluation(w)
    last_checkpoint(w)
    write_comm_totals(w.cfg.out, w.ctx)
    if not w.main:
        return {"rank": w.ctx.rank}
    return write_summary(w, loop, per_worker, final_eval, replicas, extra)


def final_extra_evaluation(w: Worker) -> float | None:
    """The final model's loss on ``--eval-corpus`` (on the lead rank; None elsewhere or
    without one): the global model, or for NoLoCo and Local the lead worker's replica (the
    replicas' average with ``--final-average``), over at most --final-eval-batches."""
    cfg = w.cfg
    if w.corpus.eval_extra is None or not w.evaluates:
        return None
    batches = eval_batches(w.corpus.eval_extra, cfg.batch_size, cfg.seq_len,
                           cfg.final_eval_batches, w.ctx.device)
    return evaluate(w.trained, w.algo.global_parameters(), batches, w.autocast, w.pipeline)


def take_lead(w: Worker) -> None:
    """At the end of an elastic run the lowest live worker reports (worker 0 if alive); one
    that takes over from a lost worker 0 appends to its metrics.jsonl."""
    w.lead = min(w.ctx.comm.members)
    lead = w.ctx.replica == w.lead and w.ctx.shard == 0
    if lead and not w.main:
        path = os.path.join(w.cfg.out, "metrics.jsonl")
        w.log = RunLog(w.cfg.out, resume_at=os.path.getsize(path) if os.path.exists(path)
                       else None, cfg=w.cfg)
    w.main = lead


def last_checkpoint(w: Worker) -> None:
    """Wait for the last checkpoint's write (on the lead rank: and its commit)."""
    try:
        w.writer.close(check=w.ctx.comm.check_aborted)
    except Aborted:
        w.writer.close(abandon=True)
        raise
    except (checkpoint.CheckpointError, OSError) as e:
        raise failure(e, w.ctx.rank, w.cfg.steps, w.cfg.comm_timeout) from e


#: The counters every rank reports at the end, in the order of its report tensor.
COUNTERS = ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes", "syncs",
            "comm_seconds", "comm_wait_seconds", "train_seconds", "pipeline_bytes_sent",
            "blocked_seconds", "skipped_inner_steps", "skipped_syncs", "fast_link_bytes_sent",
            "max_rss_bytes")
#: The parts of a rank's memory that ``algo.memory_bytes()`` reports, after ``COUNTERS``.
MEMORY_PARTS = ("model", "inner_optimizer", "outer")


def gather_counters(w: Worker, train_seconds: float) -> list[dict]:
    """Every rank's counters, by name (a tiny gather outside the training traffic). The
    outer algorithm's bytes travel between replicas (ctx.comm, the slow link); the
    gradients of a worker's ranks between them (ctx.inner, the fast link); activations,
    their gradients and the tied head's gradient between stages (ctx.pipe). A rank's
    ``memory_bytes`` is None when its algorithm does not report it."""
    ctx, algo = w.ctx, w.algo
    mine = ctx.comm.totals("train")
    piped = ctx.pipe.totals("train").sent_bytes if ctx.pipe is not None else 0
    fast = ctx.inner.totals("train").sent_bytes if ctx.inner is not None else 0
    memory = memory_bytes(algo)
    report = torch.tensor([mine.sent_bytes, mine.recv_bytes, mine.raw_bytes,
                           ctx.comm.peak_sent_bytes("train"), mine.ops, mine.seconds, mine.waited,
                           train_seconds, piped, blocked_seconds(ctx),
                           algo.skipped["inner_steps"], algo.skipped["syncs"], fast,
                           max_rss_bytes(),
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
              "fast_link_bytes_sent", "max_rss_bytes"):
        c[k] = int(c[k])
    held = values[len(COUNTERS):]
    c["memory_bytes"] = (None if min(held) < 0
                         else {k: int(v) for k, v in zip(MEMORY_PARTS, held)})
    return c


def memory_bytes(algo: Algorithm) -> dict[str, int] | None:
    """Bytes of the tensors this rank holds, by ``MEMORY_PARTS`` (``algo.memory_bytes()``);
    None for an algorithm that does not report them.

    Args:
        algo: this rank's algorithm.
    """
    report = getattr(algo, "memory_bytes", None)
    if report is None:
        return None
    parts = report()
    if not all(k in parts for k in MEMORY_PARTS):
        return None
    return {k: int(parts[k]) for k in MEMORY_PARTS}


def max_rss_bytes() -> int:
    """The peak resident memory of this process, in bytes (``getrusage``; under the threads
    launcher that of all ranks together)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts kilobytes


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
        per_worker = [0] * mesh.replicas
        for rank, c in enumerate(counters):
            per_worker[mesh.coords(rank)[0]] += c[key]
        out[f"{link}_bytes_sent_per_rank"] = max(c[key] for c in counters)
        out[f"{link}_bytes_sent_per_worker"] = max(per_worker)
    return out


def memory_per_rank(counters: list[dict]) -> dict[str, int] | None:
    """The largest ``memory_bytes`` of any rank, part by part; None when a rank has none.

    Args:
        counters: every rank's counters (:func:`gather_counters`).
    """
    if any(c["memory_bytes"] is None for c in counters):
        return None
    return {k: max(c["memory_bytes"][k] for c in counters) for k in MEMORY_PARTS}


def final_evaluation(w: Worker) -> tuple[float | None, dict | None]:
    """The final model's eval loss (on the lead rank; None elsewhere), and, for methods
    whose replicas differ, every replica's (see :func:`replica_report`)."""
    cfg, algo = w.cfg, w.algo
    batches = (list(eval_batches(w.corpus.val, cfg.batch_size, cfg.seq_len,
                                 cfg.final_eval_batches, w.ctx.device))
               if w.evaluates or not algo.replicas_identical else None)
    if not algo.replicas_identical:  # every replica is a model of its own: report them all
        replicas = replica_report(w.trained, algo, w.ctx.comm, batches, w.autocast,
                                  cfg.final_average, w.pipeline)
        return (replicas["final_eval_loss"] if w.main else None), replicas
    replicas = None
    if cfg.method.global_copy and cfg.eval_replicas and cfg.workers > 1:
        # The Streaming DiLoCo paper's Table 3: the first replica, the replicas' average
        # and the global parameters (the final model), all on the same batches.
        batches = batches or list(eval_batches(w.corpus.val, cfg.batch_size, cfg.seq_len,
                                               cfg.final_eval_batches, w.ctx.device))
        replicas = replica_report(w.trained, algo, w.ctx.comm, batches, w.autocast, False,
                                  w.pipeline)
    if w.evaluates:
        final = evaluate(w.trained, algo.global_parameters(), batches, w.autocast, w.pipeline)
        if replicas:
            replicas.update(global_eval_loss=final, final_eval_loss=final)
        return final, replicas
    return None, replicas


def write_summary(w: Worker, loop: Loop, workers: list[dict], final_eval: float | None,
                  replicas: dict | None, extra: float | None = None) -> dict:
    """The lead rank's last metrics record, ``summary.json`` and ``loss.png``; returns the
    summary."""
    cfg, ctx, algo = w.cfg, w.ctx, w.algo
    tokens = w.tokens_at(cfg.steps)
    w.log.metric({"step": cfg.steps, "tokens": tokens, "eval_loss": final_eval,
                  **({} if extra is None else {"eval_loss_extra": extra}),
                  "bytes_sent": ctx.comm.totals("train").sent_bytes,
                  **issued_link_bytes(ctx), "elapsed": time.perf_counter() - w.start})
    wall = time.perf_counter() - w.start
    # The job is done when its slowest worker is: timing worker 0 alone would flatter
    # methods without a barrier, whose workers drift apart in speed.
    train_seconds = max(c["train_seconds"] for c in workers)
    most = {k: max(c[k] for c in workers) for k in COUNTERS}
    summary = {
        "algorithm": cfg.algorithm, "workers": ctx.mesh.replicas, "stages": ctx.stages,
        "routing": cfg.routing if ctx.stages > 1 else None, "launcher": ctx.launcher,
        "worker_ranks": ctx.mesh.shards, "worker_parallel": cfg.worker_parallel,
        "inner_steps": cfg.steps, "tokens": tokens, "final_eval_loss": final_eval,
        "final_eval_loss_extra": extra,
        "unigram_entropy": w.corpus.unigram_entropy,
        "model_parameters": w.model.num_parameters(),
        "bytes_sent_per_worker": most["bytes_sent"],
        "bytes_received_per_worker": most["bytes_received"],
        "raw_bytes_per_worker": most["raw_bytes"],
        "peak_sync_bytes_per_worker": most["peak_sync_bytes"],
        "pipeline_bytes_sent_per_rank": most["pipeline_bytes_sent"] if ctx.stages > 1 else None,
        **link_bytes(ctx.mesh, workers),
        "memory_bytes_per_rank": memory_per_rank(workers),
        "max_rss_bytes": most["max_rss_bytes"],
        "syncs": workers[0]["syncs"],
        "comm_seconds": workers[0]["comm_seconds"],
        "comm_wait_seconds": most["blocked_seconds"],
        # Mean over ranks of 1 - (time blocked on communication / training-loop time).
        "compute_utilization": sum(c["compute_utilization"] for c in workers) / len(workers),
        # Non-finite gradients and pseudo-gradients skipped (--on-nonfinite skip), summed
        # over ranks; a sync skipped by all its workers counts once per worker.
        "nonfinite_skipped": {"inner_steps": sum(c["skipped_inner_steps"] for c in workers),
                              "syncs": sum(c["skipped_syncs"] for c in workers)},
        "resumed_from_step": w.resumed_from, "restarts": restart_count(),
        "elastic": (None if not ctx.comm.elastic else {
            "min_workers": ctx.comm.min_workers,
            **recovery_report(ctx.comm.events, ctx.comm.syncs, ctx.comm.workers)}),
        "link": (None if cfg.link_bandwidth is None and cfg.link_latency is None else
                 {"bandwidth": cfg.link_bandwidth, "latency": cfg.link_latency}),
        "fast_link": (None if cfg.fast_link_bandwidth is None and cfg.fast_link_latency is None
                      else {"bandwidth": cfg.fast_link_bandwidth,
                            "latency": cfg.fast_link_latency}),
        "wall_seconds": wall,
        "train_seconds": train_seconds,  # slowest worker's loop, evaluation excluded
        "eval_seconds": loop.eval_seconds,
        "diagnostic_seconds": loop.diagnostic_seconds,
        "tokens_per_second": tokens / train_seconds,
        "per_worker": workers,
        "fragments": algo.fragment_stats() if hasattr(algo, "fragment_stats") else None,
        "codec_kernel": codec_kernel(algo),
        "replicas": replicas,
        "corpus": {"name": w.corpus.name, "train_tokens": len(w.corpus.train),
                   "val_tokens": len(w.corpus.val), "vocab_size": w.corpus.vocab_size,
                   "eval_corpus_tokens": (None if w.corpus.eval_extra is None
                                          else len(w.corpus.eval_extra))},
        "device": str(ctx.device), "machine": machine_info(ctx.device), "config": cfg.to_dict(),
    }
    w.log.finish(summary)
    return summary


def codec_kernel(algo: Algorithm) -> dict | None:
    """The wire codec and the kernel that ran it (``fused``: compiled by torch.compile;
    ``eager``: the reference ops, and why), for the summary; None without a codec."""
    codec = getattr(algo, "codec", None)
    if codec is None:
        return None
    return {"codec": codec.name, "kernel": kernel_in_use(codec),
            "reason": getattr(codec, "kernel_reason", None)}


@torch.no_grad()
def replica_spread(algo: Algorithm, comm: Comm, pipeline: PipelineStage | None = None,
                   inner: Comm | None = None) -> float:
    """RMS over all parameters of each replica's distance to the replicas' mean.

    A diagnostic, not part of any algorithm: an all-worker all-reduce of the full model (of
    each stage's part, with pipeline stages) and one of two numbers, tagged ``diagnostic``,
    outside the training bytes and blocked time. With pipeline stages every stage measures
    its own parameters and the sums are combined over all ranks. With workers of R ranks
    every rank measures its share (a ``Share``: its FSDP2 shards, or its 1/R range) with
    the same rank of the other workers, and the sums are combined over the worker's ranks
    (``inner``)."""
    params = algo.params if pipeline is None else pipeline.owned_parameters()
    flat = Share(params, inner).read()
    mean = flat.clone()
    comm.all_reduce_mean(mean, tag="diagnostic").wait()
    stats = torch.tensor([(flat - mean).double().pow(2).sum().item(), flat.numel()],
                         dtype=torch.float64, device=comm.device)
    sums = [pipeline.pipe] if pipeline is not None else [comm, inner]
    for c in sums:  # means over ranks: the ratio of the two is that of the sums
        if c is not None:
            c.all_reduce_mean(stats, tag="diagnostic").wait()
    return math.sqrt(stats[0].item() / stats[1].item())


@torch.no_grad()
def replica_report(model, algo: Algorithm, comm, batches, autocast, final_average: bool,
                   pipeline: PipelineStage | None = None) -> dict:
    """Every replica's eval loss, their mean, and the eval loss of the replicas' average; with
    ``final_average`` every replica becomes the average, which is then the final model. The
    average is the same everywhere, so only replica 0 evaluates it. With pipeline stages the
    losses are known on the last stages; the dict is complete there. With workers of R
    ranks every rank takes part: each averages what it holds (the whole model, or its FSDP2
    shards) with the same rank of the other workers."""
    own = evaluate(model, dict(model.named_parameters()), batches, autocast, pipeline)
    losses = None
    if own is not None:  # the replicas' last stages (every worker without pipeline stages)
        losses = comm.all_gather(torch.tensor([own], dtype=torch.float64, device=comm.device),
                                 tag="report").wait()
    held = [local(p) for p in algo.params]
    flat = flatten_fp32(held)
    comm.all_reduce_mean(flat, tag="report").wait()
    average = dict(zip([n for n, p in model.named_parameters() if p.requires_grad],
                       unflatten_views(flat, held)))
    replica = comm.rank  # the outer Comm's rank is the replica index
    average_loss = (evaluate(model, {**dict(model.named_parameters()), **average}, batches,
                             autocast, pipeline) if replica == 0 else None)
    if final_average:
        torch._foreach_copy_(held, unflatten_views(flat, held))
    if losses is None:
        return {}
    losses = [t.item() for t in losses]
    return {"eval_losses": losses, "mean_eval_loss": sum(losses) / len(losses),
            "average_eval_loss": average_loss, "final_average": final_average,
            "final_eval_loss": average_loss if final_average else losses[0]}


def write_comm_totals(out: str, ctx: WorkerContext) -> None:
    """``out/comm/rank<r>.json``: this rank's byte and time totals by tag, for every Comm,
    after its last operation of the run (what a packet counter on its link should see)."""
    comms = {"outer": ctx.comm, **({"pipe": ctx.pipe} if ctx.pipe is not None else {}),
             **({"inner": ctx.inner} if ctx.inner is not None else {})}
    totals = {name: c.stats.as_dict() for name, c in comms.items()}
    tags = [t for by_tag in totals.values() for t in by_tag.values()]
    totals["sent_bytes"] = sum(t["sent_bytes"] for t in tags)
    totals["recv_bytes"] = sum(t["recv_bytes"] for t in tags)
    os.makedirs(os.path.join(out, "comm"), exist_ok=True)
    path = os.path.join(out, "comm", f"rank{ctx.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": ctx.rank, "replica": ctx.replica, "stage": ctx.stage,
                   "shard": ctx.shard, **totals}, f, indent=2)
    os.replace(path + ".tmp", path)


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


def blocked_seconds(ctx: WorkerContext) -> float:
    """Time this rank has spent blocked waiting for its training traffic (tag ``train``):
    the slow link's, its pipeline's and its worker's fast link's; not for the spread
    diagnostic, the checkpoints or the report, which are no part of the algorithm."""
    comms = [c for c in (ctx.comm, ctx.pipe, ctx.inner) if c is not None]
    return sum(c.totals("train").waited for c in comms)


class TrainingError(RuntimeError):
    """A worker's failure, with its rank and step. ``brief``: an expected failure (bad
    numbers, an injected fault, a bad checkpoint) that needs no traceback."""

    def __init__(self, message: str, brief: bool = False):
        super().__init__(message)
        self.brief = brief


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


def _drain(algo: Algorithm) -> list[dict]:
    """The syncs the algorithm applied since the last call."""
    log = getattr(algo, "sync_log", None)
    if not log:
        return []
    out = list(log)
    log.clear()
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


class RunLog:
    """The run directory: metrics.jsonl as training goes, summary.json and loss.png at the end."""

    def __init__(self, out: str, resume_at: int | None = None, cfg: TrainConfig | None = None,
                 resumed_from: int | None = None):
        """``resume_at``: continue a resumed run's metrics.jsonl, cut at that many bytes (its
        size at the checkpoint), so that no record is lost or repeated. ``cfg``: also log to
        the dashboards it asks for (--tensorboard, --wandb); ``resumed_from``: the step
        metrics.jsonl was cut back to, so a dashboard hides what came after it."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.records: list[dict] = []
        self.dash = Dashboards.open(cfg, resumed_from=resumed_from) if cfg else Dashboards()
        path = os.path.join(out, "metrics.jsonl")
        if resume_at is None:
            self._metrics = open(path, "w", buffering=1)
            return
        with open(path, "r+b") as f:
            f.truncate(resume_at)
        with open(path) as f:
            self.records = [json.loads(line) for line in f if line.strip()]
        self._metrics = open(path, "a", buffering=1)

    def tell(self) -> int:
        """Bytes written so far."""
        self._metrics.flush()
        return self._metrics.tell()

    def metric(self, record: dict) -> None:
        """Append a record to metrics.jsonl (and the dashboards)."""
        self.records.append(record)
        self._metrics.write(json.dumps(record) + "\n")
        self.dash.metric(record)

    def finish(self, summary: dict) -> None:
        from loco.plot import plot_losses

        self._metrics.close()
        tmp = os.path.join(self.out, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "summary.json"))
        self.dash.finish(summary)
        plot_losses(self.records, os.path.join(self.out, "loss.png"),
                    title=f"{summary['algorithm']}, {summary['workers']} workers",
                    reference=summary["unigram_entropy"])
