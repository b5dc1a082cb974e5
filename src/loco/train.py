"""``loco train``: one training job, the same code for every launcher.

:func:`run_training` prepares the data in the calling process (so bad input fails before any
worker starts), then launches :func:`train_worker` on every rank. The lead rank (replica 0's
last pipeline stage, which holds its loss; rank 0 without pipeline stages) writes
``metrics.jsonl``, ``summary.json`` and ``loss.png`` into the run directory and returns the
summary. The ranks of replica 0 evaluate the global model together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import datetime

import torch
from tqdm import tqdm

from loco import checkpoint
from loco.algorithms import ALGORITHMS, Algorithm
from loco.algorithms.base import NonFiniteError, flatten_fp32, unflatten_views
from loco.algorithms.fragments import split_fragments
from loco.comm.interface import Aborted
from loco.comm.link import LinkSpec
from loco.config import ConfigError, TrainConfig, resolve, validate, warnings_for
from loco.data import Corpus, CorpusError, TokenLoader, eval_batches, prepare_corpus
from loco.model import Transformer, model_config
from loco.runtime import WorkerContext, launch, under_torchrun
from loco.runtime.faults import Fault, InjectedFault
from loco.runtime.pipeline import PipelineStage


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
    if under_torchrun():  # torchrun, not --workers, decides how many workers there are
        world = int(os.environ["WORLD_SIZE"])
        if world % cfg.stages:
            raise ConfigError("stages", f"must divide torchrun's world size {world} "
                              f"(got {cfg.stages})")
        cfg = dataclasses.replace(cfg, workers=world // cfg.stages)
    validate(cfg)
    cfg = resolve(cfg)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=os.path.join(
            "runs", f"{cfg.algorithm}-{datetime.now():%Y%m%d-%H%M%S}"))
    if cfg.resume is None and restart_count() == 0:
        try:
            held = checkpoint.latest(cfg.out)
        except checkpoint.CheckpointError:
            held = True
        if held:
            raise ConfigError("out", f"{cfg.out} holds a checkpointed run; continue it with "
                              f"--resume {cfg.out}, or choose another --out (nothing is "
                              "overwritten)")
    return cfg


def restart_count() -> int:
    """How many times torch elastic (the processes launcher, torchrun) restarted the workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def prepare_data(cfg: TrainConfig) -> Corpus:
    """The tokenized corpus (trained and cached on first use)."""
    try:
        return prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.val_fraction, cfg.cache_dir,
                              cfg.text_field, progress=cfg.progress)
    except CorpusError as e:
        raise ConfigError("corpus", str(e)) from None


def launch_training(cfg: TrainConfig, corpus: Corpus) -> dict:
    """Train a prepared config on every rank; return the lead rank's summary."""
    results = launch(train_worker, cfg.workers * cfg.stages, cfg.launcher, args=(cfg, corpus),
                     ranks_per_replica=cfg.stages, timeout=cfg.comm_timeout,
                     max_restarts=cfg.max_restarts,
                     link=LinkSpec.parse(cfg.link_bandwidth, cfg.link_latency))
    # The lead rank's summary (under torchrun the list holds only this rank's value).
    return next((r for r in results if "final_eval_loss" in r), results[0])


def check_fits(cfg: TrainConfig, corpus: Corpus) -> None:
    windows = (len(corpus.train) - 1) // cfg.seq_len
    per_worker = windows // cfg.workers
    if per_worker < cfg.batch_size:
        raise ConfigError("batch_size", f"a batch does not fit the data: each of {cfg.workers} "
                          f"workers has {per_worker} windows of {cfg.seq_len} tokens but a batch "
                          f"needs {cfg.batch_size}; lower --batch-size, --seq-len or --workers")
    if len(corpus.val) <= cfg.seq_len:
        raise ConfigError("seq_len", f"the validation split ({len(corpus.val)} tokens) is "
                          f"shorter than one sequence; lower --seq-len or raise --val-fraction")
    val_windows = (len(corpus.val) - 1) // cfg.seq_len
    if cfg.stages > 1 and val_windows < cfg.batch_size:  # stages exchange whole batches
        raise ConfigError("batch_size", f"the validation split has {val_windows} windows of "
                          f"{cfg.seq_len} tokens but a pipeline evaluates whole batches of "
                          f"{cfg.batch_size}; lower --batch-size or raise --val-fraction")


def make_algorithm(cfg: TrainConfig, model, optimizer, comm,
                   pipeline: PipelineStage | None = None) -> Algorithm:
    """The algorithm of ``cfg`` on ``model`` (with pipeline stages: this stage's part)."""
    kwargs = {"max_grad_norm": cfg.grad_clip or None, "on_nonfinite": cfg.on_nonfinite}
    if cfg.algorithm in ("diloco", "streaming"):
        kwargs.update(sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, nesterov=cfg.nesterov,
                      offload=cfg.offload)
    if cfg.algorithm == "noloco":
        kwargs.update(sync_every=cfg.sync_every, group_size=cfg.group_size,
                      outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, gamma=cfg.gamma,
                      nesterov=cfg.nesterov, seed=cfg.seed, warn=False)
    if cfg.algorithm == "streaming":
        fragments = cfg.fragments
        if pipeline is not None and pipeline.stages > 1 and model.embed is not None:
            # The tied embedding's two copies (first and last stage) must be synced at the
            # same steps to stay identical: both go into fragment 0.
            names = split_fragments(model, cfg.fragments, cfg.fragment_pattern)
            fragments = [[n for n in group if n != "embed.weight"] for group in names]
            fragments[0].append("embed.weight")
        kwargs.update(fragments=fragments, pattern=cfg.fragment_pattern,
                      overlap=cfg.overlap, alpha=cfg.alpha, codec=cfg.codec,
                      codec_block=cfg.codec_block)
    algo = ALGORITHMS[cfg.algorithm](model, optimizer, comm, **kwargs)
    if pipeline is not None and pipeline.stages > 1:
        algo.grad_norm_fn = pipeline.grad_norm  # clip by the whole model's gradient norm
    return algo


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at the last step."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model, params: dict, batches, autocast,
             pipeline: PipelineStage | None = None) -> float | None:
    """Mean token loss of ``params`` (by name: the global model, a replica or an average)
    over ``batches``. With pipeline stages every stage of the replica calls this with its
    own part's ``params``; the loss is returned on the last stage, None elsewhere."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        if pipeline is None:
            with autocast:
                loss = torch.func.functional_call(model, params, (x, y))
        else:
            loss = pipeline.evaluate((x, y), params)
        if loss is not None:
            total += loss.item() * y.numel()
            count += y.numel()
    model.train(was_training)
    return total / count if count else None


def train_worker(ctx: WorkerContext, cfg: TrainConfig, corpus: Corpus) -> dict:
    torch.set_flush_denormal(True)  # denormals made CPU steps 8x slower
    start = time.perf_counter()
    device = ctx.device
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
                else nullcontext())
    mcfg = model_config(cfg.model, corpus.vocab_size, cfg.seq_len, z_loss=cfg.z_loss)
    # Every worker builds the same weights from the seed; the algorithm still broadcasts
    # worker 0's and verifies checksums.
    model = Transformer(mcfg, torch.Generator().manual_seed(cfg.seed)).to(device)
    # With pipeline stages each rank trains and syncs only its stage's part of the model.
    pipeline = (PipelineStage(model, ctx, cfg.batch_size, cfg.seq_len, routing=cfg.routing,
                              seed=cfg.seed, autocast=autocast) if ctx.stages > 1 else None)
    trained = model if pipeline is None else pipeline.module
    optimizer = adamw(trained, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    algo = make_algorithm(cfg, trained, optimizer, ctx.comm, pipeline)
    loader = (TokenLoader(corpus.train, cfg.batch_size, cfg.seq_len, rank=ctx.replica,
                          world_size=ctx.mesh.replicas, seed=cfg.seed, device=device)
              if ctx.stage == 0 else None)  # later stages receive their inputs
    tokens_per_step = ctx.mesh.replicas * cfg.batch_size * cfg.seq_len
    world = ctx.pipe or ctx.comm  # every rank: for the end-of-run report

    # The lead rank logs: replica 0's last stage, which computes its loss.
    main = ctx.rank == ctx.mesh.rank_of(0, ctx.stages - 1)
    evaluates = ctx.replica == 0  # replica 0's stages evaluate the global model together
    # Resume from the last complete checkpoint: asked for (--resume), or after torch elastic
    # restarted the workers because one of them died.
    state, loop = None, {"loss_sum": 0.0, "loss_count": 0, "eval_seconds": 0.0,
                         "train_seconds": 0.0, "metrics_bytes": 0}
    if cfg.resume is not None or restart_count() > 0:
        meta = checkpoint.latest(cfg.out)
        if meta is not None:
            state = checkpoint.load_rank(cfg.out, int(meta["step"]), ctx.rank, device)
            restore(state, algo, schedule, loader, ctx)
            loop = state["loop"]
    first = 1 if state is None else int(state["step"]) + 1
    fault = Fault.for_rank(ctx.rank) if state is None and restart_count() == 0 else None
    log = RunLog(cfg.out, resume_at=loop["metrics_bytes"] if state else None) if main else None
    bar = tqdm(total=cfg.steps, initial=first - 1,
               desc=f"{cfg.algorithm} x{ctx.mesh.replicas}"
               + (f"x{ctx.stages} stages" if ctx.stages > 1 else ""), unit="step",
               disable=not (main and cfg.progress), dynamic_ncols=True)
    eval_seconds, loss_sum, loss_count = loop["eval_seconds"], loop["loss_sum"], loop["loss_count"]
    loop_start = time.perf_counter() - loop["train_seconds"] - eval_seconds
    every = cfg.checkpoint_every * cfg.sync_every

    def save(step: int) -> None:
        """Every rank writes its state; once all have, the lead marks the checkpoint done."""
        checkpoint.save_rank(cfg.out, step, ctx.rank, {
            "step": step, "algorithm": algo.state_dict(), "schedule": schedule.state_dict(),
            "loader": loader.state_dict() if loader is not None else None,
            "rng": torch.get_rng_state(), "comm": ctx.comm.state_dict(),
            "pipe": ctx.pipe.state_dict() if ctx.pipe is not None else None,
            "loop": {"loss_sum": loss_sum, "loss_count": loss_count,
                     "eval_seconds": eval_seconds,
                     "train_seconds": time.perf_counter() - loop_start - eval_seconds,
                     "metrics_bytes": log.tell() if log is not None else 0}})
        world.barrier(tag="checkpoint")
        if main:
            checkpoint.commit(cfg.out, step, {"world_size": ctx.world_size,
                                              "algorithm": cfg.algorithm,
                                              "config": cfg.to_dict()})

    step = first
    try:
        for step in range(first, cfg.steps + 1):
            if fault is not None:
                fault.before_step(step, ctx.comm)
            batch = loader.next_batch() if loader is not None else None
            if pipeline is None:
                with autocast:
                    loss = model(*batch)
                loss.backward()
            else:  # the loss arrives on the last stage only
                loss = pipeline.forward_backward(batch, step)
            if fault is not None:
                fault.after_backward(step, algo.params)
            algo.step()
            schedule.step()
            algo.zero_grad()
            if step == cfg.steps:
                algo.flush()  # the last fragment sent must reach the evaluated global model
            syncs = _drain(algo)
            spread = None
            if not algo.replicas_identical and cfg.spread_every and step % cfg.spread_every == 0:
                spread = replica_spread(algo, ctx.comm, pipeline)
            eval_loss = None
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps and evaluates:
                t0 = time.perf_counter()
                eval_loss = evaluate(trained, algo.global_parameters(), eval_batches(
                    corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, device),
                    autocast, pipeline)
                eval_seconds += time.perf_counter() - t0
            if main:
                for sync in syncs:
                    log.metric({"event": "sync", **sync})
                loss_value = loss.item()
                loss_sum += loss_value
                loss_count += 1
                record = (None if spread is None else
                          {"step": step, "tokens": step * tokens_per_step, "spread": spread})
                if step % cfg.log_every == 0 or step == cfg.steps:
                    record = {**(record or {}), "step": step, "tokens": step * tokens_per_step,
                              "train_loss": loss_sum / loss_count,
                              "lr": schedule.get_last_lr()[0]}
                    loss_sum, loss_count = 0.0, 0
                if eval_loss is not None:
                    record = record or {"step": step, "tokens": step * tokens_per_step}
                    record["eval_loss"] = eval_loss
                sent = ctx.comm.issued_bytes("train")  # at issue: the same whatever the timing
                if record is not None:
                    record.update(bytes_sent=sent, elapsed=time.perf_counter() - start)
                    log.metric(record)
                train_seconds = time.perf_counter() - loop_start - eval_seconds
                this_run = max(train_seconds - loop["train_seconds"], 1e-9)  # since (re)start
                bar.set_postfix(loss=f"{loss_value:.3f}",
                                tok_s=f"{(step - first + 1) * tokens_per_step / this_run:,.0f}",
                                sent=human_bytes(sent),
                                cu=f"{1 - blocked_seconds(ctx) / train_seconds:.0%}",
                                refresh=False)
                bar.update(1)
            if (every and step % every == 0) or step == cfg.steps:
                save(step)
    except (Aborted, KeyboardInterrupt):
        raise
    except Exception as e:  # name the worker and the step; expected failures in one line
        where = f"worker {ctx.rank} failed at step {step}"
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TrainingError(f"{where}: a communication took longer than --comm-timeout "
                                f"{cfg.comm_timeout:g} s; a peer stopped answering or is "
                                f"far too slow ({str(e).splitlines()[0][:200]})",
                                brief=True) from e
        raise TrainingError(f"{where}: {type(e).__name__}: {e}",
                            brief=isinstance(e, (NonFiniteError, InjectedFault,
                                                 checkpoint.CheckpointError))) from e
    bar.close()
    train_seconds = time.perf_counter() - loop_start - eval_seconds

    # Every rank reports its counters (a tiny gather outside the training traffic). The
    # outer algorithm's bytes travel between replicas (ctx.comm); activations, their
    # gradients and the tied head's gradient travel between stages (ctx.pipe).
    mine = ctx.comm.totals("train")
    piped = ctx.pipe.totals("train").sent_bytes if ctx.pipe is not None else 0
    report = torch.tensor([mine.sent_bytes, mine.recv_bytes, mine.raw_bytes,
                           ctx.comm.peak_sent_bytes("train"), mine.ops, mine.seconds, mine.waited,
                           train_seconds, piped, blocked_seconds(ctx),
                           algo.skipped["inner_steps"], algo.skipped["syncs"]],
                          dtype=torch.float64, device=device)
    per_worker = [t.tolist() for t in world.all_gather(report, tag="report").wait()]
    final_batches = (list(eval_batches(corpus.val, cfg.batch_size, cfg.seq_len,
                                       cfg.final_eval_batches, device))
                     if evaluates or not algo.replicas_identical else None)
    replicas = None
    if not algo.replicas_identical:  # every replica is a model of its own: report them all
        replicas = replica_report(trained, algo, ctx.comm, final_batches, autocast,
                                  cfg.final_average, pipeline)
        final_eval = replicas["final_eval_loss"] if main else None
    elif evaluates:
        final_eval = evaluate(trained, algo.global_parameters(), final_batches, autocast,
                              pipeline)
    write_comm_totals(cfg.out, ctx)
    if not main:
        return {"rank": ctx.rank}

    log.metric({"step": cfg.steps, "tokens": cfg.steps * tokens_per_step, "eval_loss": final_eval,
                "bytes_sent": mine.sent_bytes, "elapsed": time.perf_counter() - start})
    tokens = cfg.steps * tokens_per_step
    wall = time.perf_counter() - start
    keys = ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes", "syncs",
            "comm_seconds", "comm_wait_seconds", "train_seconds", "pipeline_bytes_sent",
            "blocked_seconds", "skipped_inner_steps", "skipped_syncs")
    workers = [dict(zip(keys, w)) for w in per_worker]
    for w in workers:  # time computing / time in the training loop
        w["compute_utilization"] = 1 - w["blocked_seconds"] / w["train_seconds"]
    # The job is done when its slowest worker is: timing worker 0 alone would flatter
    # methods without a barrier, whose workers drift apart in speed.
    train_seconds = max(w["train_seconds"] for w in workers)
    for w in workers:
        for k in ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes", "syncs",
                  "pipeline_bytes_sent", "skipped_inner_steps", "skipped_syncs"):
            w[k] = int(w[k])
    summary = {
        "algorithm": cfg.algorithm,
        "workers": ctx.mesh.replicas,
        "stages": ctx.stages,
        "routing": cfg.routing if ctx.stages > 1 else None,
        "launcher": ctx.launcher,
        "inner_steps": cfg.steps,
        "tokens": tokens,
        "final_eval_loss": final_eval,
        "unigram_entropy": corpus.unigram_entropy,
        "model_parameters": model.num_parameters(),
        "bytes_sent_per_worker": max(w["bytes_sent"] for w in workers),
        "bytes_received_per_worker": max(w["bytes_received"] for w in workers),
        "raw_bytes_per_worker": max(w["raw_bytes"] for w in workers),
        "peak_sync_bytes_per_worker": max(w["peak_sync_bytes"] for w in workers),
        "pipeline_bytes_sent_per_rank": (max(w["pipeline_bytes_sent"] for w in workers)
                                         if ctx.stages > 1 else None),
        "syncs": workers[0]["syncs"],
        "comm_seconds": workers[0]["comm_seconds"],
        "comm_wait_seconds": max(w["blocked_seconds"] for w in workers),
        # Mean over ranks of 1 - (time blocked on communication / training-loop time).
        "compute_utilization": sum(w["compute_utilization"] for w in workers) / len(workers),
        # Non-finite gradients and pseudo-gradients skipped (--on-nonfinite skip), summed
        # over ranks; a sync skipped by all its workers counts once per worker.
        "nonfinite_skipped": {"inner_steps": sum(w["skipped_inner_steps"] for w in workers),
                              "syncs": sum(w["skipped_syncs"] for w in workers)},
        "resumed_from_step": None if state is None else int(state["step"]),
        "restarts": restart_count(),
        "link": (None if cfg.link_bandwidth is None and cfg.link_latency is None else
                 {"bandwidth": cfg.link_bandwidth, "latency": cfg.link_latency}),
        "wall_seconds": wall,
        "train_seconds": train_seconds,  # slowest worker's loop, evaluation excluded
        "eval_seconds": eval_seconds,
        "tokens_per_second": tokens / train_seconds,
        "per_worker": workers,
        "fragments": algo.fragment_stats() if hasattr(algo, "fragment_stats") else None,
        "replicas": replicas,
        "corpus": {"name": corpus.name, "train_tokens": len(corpus.train),
                   "val_tokens": len(corpus.val), "vocab_size": corpus.vocab_size},
        "device": str(device),
        "machine": machine_info(device),
        "config": cfg.to_dict(),
    }
    log.finish(summary)
    return summary


@torch.no_grad()
def replica_spread(algo: Algorithm, comm, pipeline: PipelineStage | None = None) -> float:
    """RMS over all parameters of each replica's distance to the replicas' mean (diagnostic
    all-reduces, tagged apart from the training traffic). With pipeline stages every stage
    measures its own parameters and the sums are combined over all ranks."""
    params = algo.params if pipeline is None else pipeline.owned_parameters()
    flat = flatten_fp32(params)
    mean = flat.clone()
    comm.all_reduce_mean(mean, tag="diagnostic").wait()
    stats = torch.tensor([(flat - mean).double().pow(2).sum().item(), flat.numel()],
                         dtype=torch.float64)
    (comm if pipeline is None else pipeline.pipe).all_reduce_mean(stats, tag="diagnostic").wait()
    return math.sqrt(stats[0].item() / stats[1].item())


@torch.no_grad()
def replica_report(model, algo: Algorithm, comm, batches, autocast, final_average: bool,
                   pipeline: PipelineStage | None = None) -> dict:
    """Every replica's eval loss, their mean, and the eval loss of the replicas' average; with
    ``final_average`` every replica becomes the average, which is then the final model. The
    average is the same everywhere, so only replica 0 evaluates it. With pipeline stages the
    losses are known on the last stages; the dict is complete there."""
    own = evaluate(model, dict(model.named_parameters()), batches, autocast, pipeline)
    losses = None
    if own is not None:  # the replicas' last stages (every worker without pipeline stages)
        losses = comm.all_gather(torch.tensor([own], dtype=torch.float64), tag="report").wait()
    flat = flatten_fp32(algo.params)
    comm.all_reduce_mean(flat, tag="report").wait()
    average = dict(zip([n for n, p in model.named_parameters() if p.requires_grad],
                       unflatten_views(flat, algo.params)))
    replica = comm.rank  # the outer Comm's rank is the replica index
    average_loss = (evaluate(model, {**dict(model.named_parameters()), **average}, batches,
                             autocast, pipeline) if replica == 0 else None)
    if final_average:
        torch._foreach_copy_(algo.params, unflatten_views(flat, algo.params))
    if losses is None:
        return {}
    losses = [t.item() for t in losses]
    return {"eval_losses": losses, "mean_eval_loss": sum(losses) / len(losses),
            "average_eval_loss": average_loss, "final_average": final_average,
            "final_eval_loss": average_loss if final_average else losses[0]}


def write_comm_totals(out: str, ctx: WorkerContext) -> None:
    """``out/comm/rank<r>.json``: this rank's byte and time totals by tag, for every Comm,
    after its last operation of the run (what a packet counter on its link should see)."""
    comms = {"outer": ctx.comm, **({"pipe": ctx.pipe} if ctx.pipe is not None else {})}
    totals = {name: c.stats.as_dict() for name, c in comms.items()}
    tags = [t for by_tag in totals.values() for t in by_tag.values()]
    totals["sent_bytes"] = sum(t["sent_bytes"] for t in tags)
    totals["recv_bytes"] = sum(t["recv_bytes"] for t in tags)
    os.makedirs(os.path.join(out, "comm"), exist_ok=True)
    path = os.path.join(out, "comm", f"rank{ctx.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": ctx.rank, "replica": ctx.replica, "stage": ctx.stage, **totals}, f,
                  indent=2)
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
    """Time this rank has spent blocked waiting for communication inside the training loop:
    its training traffic, its pipeline's, and the spread diagnostic."""
    comms = [ctx.comm] + ([ctx.pipe] if ctx.pipe is not None else [])
    return sum(c.totals(tag).waited for c in comms for tag in ("train", "diagnostic"))


class TrainingError(RuntimeError):
    """A worker's failure, with its rank and step. ``brief``: an expected failure (bad
    numbers, an injected fault, a bad checkpoint) that needs no traceback."""

    def __init__(self, message: str, brief: bool = False):
        super().__init__(message)
        self.brief = brief


def restore(state: dict, algo: Algorithm, schedule, loader: TokenLoader | None,
            ctx: WorkerContext) -> None:
    """Put a worker back where its checkpoint left it."""
    algo.load_state_dict(state["algorithm"])
    schedule.load_state_dict(state["schedule"])
    if loader is not None:
        loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"].cpu())
    ctx.comm.load_state_dict(state["comm"])
    if ctx.pipe is not None:
        ctx.pipe.load_state_dict(state["pipe"])


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

    def __init__(self, out: str, resume_at: int | None = None):
        """``resume_at``: continue a resumed run's metrics.jsonl, cut at that many bytes (its
        size at the checkpoint), so that no record is lost or repeated."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.records: list[dict] = []
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
        self.records.append(record)
        self._metrics.write(json.dumps(record) + "\n")

    def finish(self, summary: dict) -> None:
        from loco.plot import plot_losses

        self._metrics.close()
        tmp = os.path.join(self.out, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "summary.json"))
        plot_losses(self.records, os.path.join(self.out, "loss.png"),
                    title=f"{summary['algorithm']}, {summary['workers']} workers",
                    reference=summary["unigram_entropy"])
