"""Building one rank's run: the model, its optimizer and schedule, the algorithm, the
loader, and the ``Rank`` that holds them, fresh or resumed."""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from loco import hf
from loco.checkpoint.policy import make_stager, make_writer
from loco.checkpoint.state import restore, restore_elastic, resume_state, seek
from loco.comm.auth import JobKey, admit, job_key
from loco.config import TrainConfig, betas, model_dims, worker_speeds
from loco.data import Corpus, TokenLoader
from loco.hf import is_hf
from loco.model import Transformer, materialise, model_config
from loco.runtime import RankContext
from loco.runtime.elastic import restart_count
from loco.runtime.faults import Fault
from loco.runtime.pipeline import PipelineStage
from loco.runtime.vitals import LARGE_MODEL_BYTES, Vitals, return_freed_memory
from loco.training.emulation import Throttle
from loco.training.local_steps import LocalSteps
from loco.training.optimizers import inner_optimizer
from loco.training.quorum import QuorumSteps, quorum_kwargs
from loco.training.runlog import RunLog
from loco.training.worker import SAVED_LOOP, Loop, Rank


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at the last step."""
    def f(step: int) -> float:
        if step < cfg.optim.warmup:
            return (step + 1) / cfg.optim.warmup
        progress = min(1.0, (step - cfg.optim.warmup) / max(1, cfg.run.steps - cfg.optim.warmup))
        return cfg.optim.min_lr_ratio + (1 - cfg.optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with ``--adam-betas``, weight decay on matrices only (not on norms' gains)."""
    return inner_optimizer(model, "adamw", lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                           betas=betas(cfg))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The inner optimizer of ``--inner-optimizer`` over ``model``'s parameters: AdamW
    (`adamw`), or MuLoCo's Muon on the hidden matrices and AdamW
    on the rest (see `inner_optimizer`), with
    ``--lr``, ``--weight-decay`` and ``--adam-betas`` (and ``--muon-lr``, ``--muon-scale``).

    Args:
        model: the module to train (a whole model or a pipeline stage's part).
        cfg: the run's configuration.
    """
    return inner_optimizer(model, cfg.optim.inner_optimizer, lr=cfg.optim.lr,
                           weight_decay=cfg.optim.weight_decay, betas=betas(cfg),
                           muon_lr=cfg.optim.muon_lr, muon_scale=cfg.optim.muon_scale)


def make_model(cfg: TrainConfig, vocab_size: int,
               device: torch.device | str = "cpu") -> torch.nn.Module:
    """The run's model in fp32 on ``device``: the built-in ``Transformer`` of ``--model``
    (with ``--layers``, ``--dim``, ``--heads``), or a Hugging Face model (``hf:PATH``, see
    [`loco.hf`][loco.hf]).

    It is built on the meta device (nothing allocated), then materialised on ``device``
    (``loco.model.materialise``): every parameter drawn from ``--seed`` by the
    sharding-invariant init (per-parameter seeded blocks of rows), the same in every
    process and on every device. A ``hf:PATH`` model with weights is loaded on the CPU
    instead, then moved to ``device``.

    Args:
        cfg: the run's configuration.
        vocab_size: the tokenizer's vocabulary size.
        device: where to materialise it; default the CPU; ``"meta"``: not materialised (to
            shard it first, as `build_model` does; a model with loaded weights stays on the
            CPU).
    """
    if is_hf(cfg.model.name):
        model = hf.build(cfg.model.name, vocab_size, cfg.run.seed, cfg.model.z_loss, device="meta")
    else:
        mcfg = model_config(cfg.model.name, vocab_size, cfg.data.seq_len, z_loss=cfg.model.z_loss,
                            **model_dims(cfg))
        with torch.device("meta"):
            model = Transformer(mcfg, torch.Generator().manual_seed(cfg.run.seed))
    return model if str(device) == "meta" else materialise(model, device)


def build_model(cfg: TrainConfig, ctx: RankContext, vocab_size: int) -> torch.nn.Module:
    """The model (`make_model`) on this rank's device. With ``--worker-parallel fsdp`` it is
    built on the meta device, sharded over the worker's ranks by FSDP2 (before any optimizer
    sees its parameters; in bf16 with ``--dtype bf16``, `mixed_precision`), and only then
    materialised: each rank allocates and draws its own shard alone, bit for bit the rows
    of the unsharded model, so no rank ever holds the whole model. Otherwise (one rank per
    worker, or ``ddp``) it is materialised whole on the device.
    Every rank builds the same weights from the seed; the algorithm still broadcasts worker
    0's and verifies checksums.

    Args:
        cfg: the run's configuration.
        ctx: this rank's context.
        vocab_size: the corpus's vocabulary size.

    Raises:
        ValueError: ``--worker-parallel fsdp`` without a device mesh (the threads launcher).
    """
    if cfg.runtime.worker_parallel != "fsdp":
        return make_model(cfg, vocab_size, ctx.device)
    from loco.runtime.fsdp import shard_worker

    model = shard_worker(make_model(cfg, vocab_size, "meta"), ctx, mixed_precision(cfg))
    return materialise(model, ctx.device)


def mixed_precision(cfg: TrainConfig):
    """FSDP2's ``MixedPrecisionPolicy`` for ``--dtype``: with bf16 the parameters are
    gathered and computed in bf16 (half the worker's fast-link bytes of fp32) and the
    gradients reduced in fp32, the sharded master weights and optimizer staying fp32; None
    (FSDP2's default: everything in fp32) with fp32."""
    if cfg.model.dtype != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def setup_worker(ctx: RankContext, cfg: TrainConfig, corpus: Corpus) -> tuple[Rank, Loop]:
    """Build the model, pipeline stage, optimizer, algorithm and loader; resume from the
    last complete checkpoint when asked (--resume) or after torch elastic restarted the
    workers.

    Args:
        ctx: this rank's place in the run and its communicators.
        cfg: the run's prepared configuration.
        corpus: the tokenized corpus.
    """
    start = time.perf_counter()
    vitals = Vitals(None if cfg.run.out is None else os.path.join(cfg.run.out, "vitals"), ctx.rank)
    if not ctx.comm.elastic:  # (the elastic supervisor decides on its own workers)
        vitals.check_restart(restart_count())
    vitals.note(0)
    admit_worker(ctx, cfg)  # before any state moves: only the job's members take part
    autocast = (torch.autocast(ctx.device.type, dtype=torch.bfloat16) if cfg.model.dtype == "bf16"
                else nullcontext())
    model = build_model(cfg, ctx, corpus.vocab_size)
    if sum(p.numel() * p.element_size() for p in model.parameters()) >= LARGE_MODEL_BYTES:
        return_freed_memory()  # before the gradients and the optimizers' state exist
    # With pipeline stages each rank trains and syncs only its stage's part of the model.
    pipeline = (PipelineStage(model, ctx, cfg.data.batch_size, cfg.data.seq_len, routing=cfg.runtime.routing,
                              seed=cfg.run.seed, autocast=autocast) if ctx.stages > 1 else None)
    trained = model if pipeline is None else pipeline.module
    optimizer = make_optimizer(trained, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if cfg.runtime.worker_parallel == "fsdp" and ctx.device.type == "cuda":
        for comm in (ctx.comm, ctx.inner):  # FSDP2 issues NCCL calls of its own meanwhile
            comm.issue_in_order = True
    algo = cfg.method_class.from_config(cfg, trained, optimizer, ctx.comm, pipeline, ctx.inner)
    loader = make_loader(cfg, ctx, corpus)
    main = ctx.rank == ctx.mesh.rank_of(0, ctx.stages - 1)  # replica 0's last stage, shard 0
    state, loop = resume_state(cfg, ctx, corpus), Loop()
    if state is not None:
        (restore_elastic if state.get("elastic") else restore)(state, algo, schedule, loader,
                                                               ctx)
        loop = Loop(**{k: state["loop"][k] for k in SAVED_LOOP
                       if state["loop"].get(k) is not None})
    plan = make_local_steps(cfg, ctx, algo, loop, resumed=state is not None)
    joined = ctx.comm.elastic and algo.join()  # a restarted worker takes a live one's state
    if joined:
        seek(schedule, loader, algo.inner_steps)
        if plan is not None:  # the round end it joined at, as the others saw it
            plan.heard(algo.inner_steps)
    resumed_from = algo.inner_steps if joined else None if state is None else int(state["step"])
    bar = progress_bar(cfg, ctx, main, resumed_from)
    writer = make_writer(cfg, ctx, main)
    worker = Rank(
        cfg, ctx, corpus, model, trained, pipeline, schedule, algo, loader, autocast, main,
        log=open_log(cfg, state, joined, loop) if main else None, bar=bar, writer=writer,
        fault=(Fault.for_rank(ctx.rank, cfg.runtime.fault) if state is None and restart_count() == 0
               else None),
        resumed_from=resumed_from, start=start, vitals=vitals,
        stager=make_stager(ctx), throttle=make_throttle(cfg, ctx),
        local_steps=plan)
    if resumed_from is not None:  # a checkpoint counts its tokens; a joiner estimates them
        nominal = resumed_from * ctx.workers * ctx.worker_ranks * cfg.data.batch_size * cfg.data.seq_len
        worker.resumed_tokens = int(state["loop"].get("tokens", nominal)) if state else nominal
    worker.elastic_tokens = worker.resumed_tokens
    return worker, loop


def admit_worker(ctx: RankContext, cfg: TrainConfig) -> None:
    """With a job key (``--job-key-file``, else ``$LOCO_JOB_KEY_FILE``), the replicas prove
    it to each other before any state moves ([`admit`][loco.comm.auth.admit]; an elastic
    Comm does it at every new quorum, ``ElasticComm.use_key``), and ``ctx.comm.job_key`` is
    the key bound to the admitted session; with ``--encrypt`` it encrypts what it
    protects. Nothing without a key.

    Args:
        ctx: this rank's context (its ``comm`` is the slow link's).
        cfg: the run's configuration.

    Raises:
        AdmissionError: some replica could not prove the key (named).
    """
    secret = job_key(cfg.trust.job_key_file)
    if secret is None:
        return
    key = JobKey(secret, encrypt=cfg.trust.encrypt)
    if ctx.comm.elastic:
        ctx.comm.use_key(key)
    else:
        ctx.comm.job_key = admit(ctx.comm, key)


def make_throttle(cfg: TrainConfig, ctx: RankContext) -> Throttle | None:
    """This worker's emulated speed (``--worker-speed``, its factor); None without one."""
    speeds = worker_speeds(cfg)
    return Throttle(speeds[ctx.worker], ctx.device) if speeds is not None else None


def make_local_steps(cfg: TrainConfig, ctx: RankContext, algo, loop: Loop,
                     resumed: bool = False) -> LocalSteps | None:
    """Speed-aware local steps (``--local-steps proportional``; the rounds a checkpoint
    agreed), the algorithm's pseudo-gradients weighed by them; with ``--max-staleness``,
    asynchronous outer steps (the algorithm keeps its blocks' starts); None: every worker
    trains every step. Elastic: the plan hears the quorums, a worker that joins takes it
    from a live one, and an elastic run resumed (every replica restarting from the global
    copy) starts every worker's block anew."""
    if cfg.runtime.local_steps != "proportional":
        return None
    kind, extra = LocalSteps, {"quorum": ctx.comm if ctx.comm.elastic else None}
    if cfg.runtime.quorum is not None:  # Decoupled DiLoCo's quorum decides the syncs (not elastic)
        kind, extra = QuorumSteps, quorum_kwargs(cfg, ctx.comm, loop.local_admitted)
    plan = kind(cfg.method.sync_every, ctx.workers, ctx.worker, rounds=loop.local_rounds,
                max_staleness=cfg.runtime.max_staleness, last_round=cfg.run.steps // cfg.method.sync_every - 1,
                ahead=1 if cfg.method_class.checkpoint_delay(cfg) == 0 else 2, **extra)
    if ctx.comm.elastic:
        ctx.comm.register_state("local_steps", plan.heal_state, plan.load_heal_state)
        if resumed:
            plan.restarts = dict.fromkeys(range(ctx.workers),
                                          algo.inner_steps // cfg.method.sync_every)
    algo.pacing.weight_of = plan.weight
    if cfg.runtime.quorum is not None:
        algo.pacing.sync_held = plan.holds
    if cfg.runtime.max_staleness:
        algo.keep_block_starts()
    return plan


def make_loader(cfg: TrainConfig, ctx: RankContext, corpus: Corpus) -> TokenLoader | None:
    """This rank's training batches: every rank of every worker reads its own, M x R
    readers; None on later pipeline stages (they receive their inputs).

    Args:
        cfg: the run's configuration.
        ctx: this rank's context.
        corpus: the tokenized corpus.
    """
    if ctx.stage != 0:
        return None
    return TokenLoader(corpus.train, cfg.data.batch_size, cfg.data.seq_len,
                       rank=ctx.worker * ctx.worker_ranks + ctx.worker_rank,
                       world_size=ctx.workers * ctx.worker_ranks, seed=cfg.run.seed,
                       device=ctx.device)


def progress_bar(cfg: TrainConfig, ctx: RankContext, main: bool,
                 resumed_from: int | None) -> tqdm:
    """The run's progress bar, shown on the lead rank with ``--progress`` only.

    Args:
        cfg: the run's configuration.
        ctx: this rank's context.
        main: whether this rank is the lead rank.
        resumed_from: the step the run continues after; None for a fresh run.
    """
    return tqdm(total=cfg.run.steps, initial=resumed_from or 0,
                desc=f"{cfg.method.algorithm} x{ctx.workers}"
                + (f"x{ctx.stages} stages" if ctx.stages > 1 else "")
                + (f"x{ctx.worker_ranks} ranks" if ctx.worker_ranks > 1 else ""),
                unit="step",
                disable=not (main and cfg.run.progress), dynamic_ncols=True)


def open_log(cfg: TrainConfig, state: dict | None, joined: bool, loop: Loop) -> RunLog:
    """The lead rank's ``RunLog``. A resumed lead cuts metrics.jsonl where its checkpoint
    was; a rejoined lead, or one resumed from a checkpoint another worker led, appends.

    Args:
        cfg: the run's configuration.
        state: the checkpoint's state this rank resumed from; None for a fresh run.
        joined: whether this worker joined a running elastic run.
        loop: the loop's running values (``metrics_bytes``: the length at the checkpoint).
    """
    metrics = os.path.join(cfg.run.out, "metrics.jsonl")
    appends = os.path.exists(metrics) and (joined or state is not None
                                           and state["loop"].get("metrics_bytes") is None)
    keep = os.path.getsize(metrics) if appends else loop.metrics_bytes if state else None
    return RunLog(cfg.run.out, resume_at=keep, cfg=cfg,
                  resumed_from=None if appends or state is None else int(state["step"]))
