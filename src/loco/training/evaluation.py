"""Evaluation of the global model, of every replica and of their average: periodic, on the
validation split and ``--eval-corpus``, and at the end."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from loco.algorithms import Algorithm
from loco.algorithms.base import flatten_fp32, unflatten_views
from loco.algorithms.sharding import is_sharded, local
from loco.data import Corpus, eval_batches
from loco.runtime.pipeline import PipelineStage
from loco.training.worker import Loop, Rank


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
    try:
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
    finally:
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


def global_model(algo: Algorithm) -> AbstractContextManager[dict]:
    """The global model's parameters by name, for :func:`evaluate` inside the block: the
    algorithm's own way where it has one (``global_in_model``: an offloaded global copy is
    swapped into the model's parameters and back, so no copy of it is made on the model's
    device), else ``global_parameters()``."""
    inside = getattr(algo, "global_in_model", None)
    return inside() if inside is not None else nullcontext(algo.global_parameters())


def held_out(corpus: Corpus) -> list[tuple[str, Any]]:
    """The held-out sets a run evaluates on, by record field: the validation split, and the
    ``--eval-corpus`` if given."""
    sets = [("eval_loss", corpus.val)]
    if corpus.eval_extra is not None:
        sets.append(("eval_loss_extra", corpus.eval_extra))
    return sets


def periodic_eval(w: Rank, loop: Loop, step: int) -> dict:
    """Every --eval-every steps but the last, on replica 0's ranks: the global model's loss
    on the validation split (``eval_loss``) and on ``--eval-corpus`` (``eval_loss_extra``),
    on its last stage; empty elsewhere."""
    cfg = w.cfg
    if not (cfg.run.eval_every and step % cfg.run.eval_every == 0 and step != cfg.run.steps
            and w.evaluates):
        return {}
    t0 = time.perf_counter()
    with global_model(w.algo) as params:
        losses = {name: evaluate(w.trained, params,
                                 eval_batches(tokens, cfg.data.batch_size, cfg.data.seq_len,
                                              cfg.run.eval_batches, w.ctx.device),
                                 w.autocast, w.pipeline)
                  for name, tokens in held_out(w.corpus)}
    loop.eval_seconds += time.perf_counter() - t0
    return {k: v for k, v in losses.items() if v is not None}


def final_evaluation(w: Rank) -> tuple[float | None, dict | None]:
    """The final model's eval loss (on the lead rank; None elsewhere), and, for methods
    whose replicas differ, every replica's (see :func:`replica_report`)."""
    cfg, algo = w.cfg, w.algo
    batches = (list(eval_batches(w.corpus.val, cfg.data.batch_size, cfg.data.seq_len,
                                 cfg.run.final_eval_batches, w.ctx.device))
               if w.evaluates or not algo.replicas_identical else None)
    if not algo.replicas_identical:  # every replica is a model of its own: report them all
        replicas = replica_report(w.trained, algo, w.ctx.comm, batches, w.autocast,
                                  cfg.method.final_average, w.pipeline)
        return (replicas["final_eval_loss"] if w.main else None), replicas
    replicas = None
    if cfg.method_class.global_copy and getattr(cfg.method, "eval_replicas", False) and cfg.runtime.workers > 1:
        # The Streaming DiLoCo paper's Table 3: the first replica, the replicas' average
        # and the global parameters (the final model), all on the same batches.
        batches = batches or list(eval_batches(w.corpus.val, cfg.data.batch_size, cfg.data.seq_len,
                                               cfg.run.final_eval_batches, w.ctx.device))
        replicas = replica_report(w.trained, algo, w.ctx.comm, batches, w.autocast, False,
                                  w.pipeline)
    if w.evaluates:
        with global_model(algo) as params:
            final = evaluate(w.trained, params, batches, w.autocast, w.pipeline)
        if replicas:
            replicas.update(global_eval_loss=final, final_eval_loss=final)
        return final, replicas
    return None, replicas


def final_extra_evaluation(w: Rank) -> float | None:
    """The final model's loss on ``--eval-corpus`` (on the lead rank; None elsewhere or
    without one): the global model, or for NoLoCo and Local the lead worker's replica (the
    replicas' average with ``--final-average``), over at most --final-eval-batches."""
    cfg = w.cfg
    if w.corpus.eval_extra is None or not w.evaluates:
        return None
    batches = eval_batches(w.corpus.eval_extra, cfg.data.batch_size, cfg.data.seq_len,
                           cfg.run.final_eval_batches, w.ctx.device)
    with global_model(w.algo) as params:
        return evaluate(w.trained, params, batches, w.autocast, w.pipeline)


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
