"""The models a run ends with, rebuilt from its checkpoint: the global copy, each replica's,
their average."""

from __future__ import annotations

import copy

import torch

from loco import checkpoint
from loco.harness.rundir import EvalError, RunCheckpoint


def _layout(run: RunCheckpoint) -> tuple[int, int, int]:
    """(M workers, S stages, R ranks per worker) of the run's checkpoint."""
    cfg = run.cfg
    workers = int(run.summary.workers or cfg.runtime.workers)
    stages = int(run.summary.stages or cfg.runtime.stages)
    ranks = int(run.meta.get("worker_ranks", cfg.runtime.worker_ranks))
    if ranks > 1 and stages > 1:
        raise EvalError("a checkpoint of pipeline stages with workers of several ranks is "
                        "not supported yet")
    return workers, stages, ranks


def _rank(replica: int, stage: int, stages: int, ranks: int, shard: int = 0) -> int:
    return (replica * stages + stage) * ranks + shard


def _load_rank(run: RunCheckpoint, rank: int) -> dict:
    try:
        return checkpoint.load_rank(run.out, run.step, rank)["algorithm"]
    except checkpoint.CheckpointError as e:
        raise EvalError(str(e)) from None


def stage_tensors(run: RunCheckpoint, replica: int) -> list[tuple[dict, dict]]:
    """One replica's tensors in the checkpoint, per pipeline stage: (its model's
    ``state_dict``, the outer algorithm's global copies by name: ``fragment{i}.global`` as
    one fp32 vector of the fragment's parameters in order, or ``fragment{i}.global.{j}``
    per parameter; empty for methods without one).

    Args:
        run: the run.
        replica: the worker, in [0, M).
    """
    _, stages, ranks = _layout(run)
    if run.meta.get("dcp_workers"):  # a worker of R ranks saved its tensors through DCP
        path = checkpoint.worker_dir(run.out, run.step, replica)
        try:
            tensors = checkpoint.read_worker(path)
        except Exception as e:  # noqa: BLE001 - DCP's errors are many; report the first line
            first = str(e).strip().splitlines()
            raise EvalError(f"{path} cannot be read ({type(e).__name__}: "
                            f"{first[0][:200] if first else ''})") from None
        outer = {k: v for k, v in tensors.get("outer", {}).items() if ".global" in k}
        return [(tensors["model"], outer)]
    out = []
    for stage in range(stages):
        states = [_load_rank(run, _rank(replica, stage, stages, ranks, shard))
                  for shard in range(ranks)]
        outer = {}
        for i, _ in enumerate(states[0].get("fragments") or []):
            # R ranks of one worker each hold a contiguous 1/R of the fragment, in order.
            outer[f"fragment{i}.global"] = torch.cat(
                [s["fragments"][i]["global_params"].reshape(-1) for s in states])
        out.append((states[0]["model"], outer))
    return out


def _fragment_names(cfg, module, pipeline: bool) -> list[list[str]]:
    """The parameter names of each fragment, as the method builds them
    (``Method.fragment_names``)."""
    tied = pipeline and getattr(module, "tied", None) is not None
    return cfg.method_class.fragment_names(cfg, module, tied)


@torch.no_grad()
def replica_model(run: RunCheckpoint, replica: int, vocab_size: int,
                  global_copy: bool = False) -> torch.nn.Module:
    """A replica's model (fp32, CPU, eval mode) from the checkpoint; with ``global_copy``
    (DiLoCo, Streaming DiLoCo) the outer algorithm's global parameters instead of the
    replica's own.

    Args:
        run: the run.
        replica: the worker whose checkpoint to read, in [0, M).
        vocab_size: the tokenizer's vocabulary size.
        global_copy: load the global copy; default False.

    Raises:
        EvalError: the checkpoint does not fit the run's model.
    """
    from loco.training import make_model

    cfg = run.cfg
    _, stages, _ = _layout(run)
    model = make_model(cfg, vocab_size)
    if stages > 1:
        from loco.runtime.pipeline import split_stages

        parts = split_stages(model, stages)
    else:
        parts = [model]
    for stage, (part, (state, outer)) in enumerate(zip(parts, stage_tensors(run, replica))):
        if "tied" in state and "tied" not in part.state_dict():
            state = {k: v for k, v in state.items() if k != "tied"}  # an older stage's alias
        try:
            part.load_state_dict(state)
        except (RuntimeError, KeyError) as e:
            raise EvalError(f"the checkpoint of step {run.step} (replica {replica}, stage "
                            f"{stage}) does not fit the run's model: "
                            f"{str(e).splitlines()[0][:200]}") from None
        if not global_copy:
            continue
        if not outer:
            raise EvalError(f"the checkpoint of step {run.step} holds no global copy")
        named = dict(part.named_parameters())
        for i, names in enumerate(_fragment_names(cfg, part, stages > 1)):
            params = [named[n] for n in names]
            if f"fragment{i}.global" in outer:
                flat = outer[f"fragment{i}.global"].reshape(-1)
                if flat.numel() < sum(p.numel() for p in params):
                    raise EvalError(f"the global copy of fragment {i} in the checkpoint is "
                                    "smaller than its parameters")
                values, offset = [], 0
                for p in params:
                    values.append(flat[offset:offset + p.numel()])
                    offset += p.numel()
            else:
                values = [outer[f"fragment{i}.global.{j}"] for j in range(len(params))]
            for p, v in zip(params, values):
                p.copy_(v.reshape(p.shape))
    return model.eval()


def run_models(run: RunCheckpoint, vocab_size: int, replicas: bool = False):
    """The models to evaluate, one at a time, as (keys, description, model). The keys say
    what the model is: ``final`` (the run's final model: the global copy, worker 0's model,
    or for NoLoCo and Local replica 0 or, with ``--final-average``, the replicas' average);
    with ``replicas`` also ``replica{m}`` for every worker and, for NoLoCo and Local,
    ``average`` (the mean of the replicas' trainable parameters, as
    ``loco.training.replica_report`` forms it). A model with several keys comes once.

    Args:
        run: the run.
        vocab_size: the tokenizer's vocabulary size.
        replicas: also every replica (and their average); default False.
    """
    workers = _layout(run)[0]
    if run.cfg.method_class.global_copy:
        yield ("final",), "the global model", replica_model(run, 0, vocab_size, True)
    elif not run.replicas_differ:  # DataParallel: every worker holds the final model
        yield ("final",), "worker 0's model", replica_model(run, 0, vocab_size)
        return
    average_final = run.replicas_differ and run.cfg.method.final_average
    if not (replicas or average_final):
        if run.replicas_differ:
            yield ("final",), "replica 0 (the run's final model)", \
                replica_model(run, 0, vocab_size)
        return
    total = None
    for m in range(workers):
        model = replica_model(run, m, vocab_size)
        if run.replicas_differ:  # the average's sum, before the model moves to a device
            total = copy.deepcopy(model) if total is None else _add(total, model)
        keys = ((f"replica{m}",) if replicas else ()) + (
            ("final",) if run.replicas_differ and m == 0 and not average_final else ())
        if keys:
            yield keys, f"replica {m}", model
        del model
    if total is not None:
        with torch.no_grad():
            for p in total.parameters():
                if p.requires_grad:
                    p.div_(workers)
        keys = (("average",) if replicas else ()) + (("final",) if average_final else ())
        yield keys, "the replicas' average", total


@torch.no_grad()
def _add(total: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``total`` with ``model``'s trainable parameters added to its own."""
    others = dict(model.named_parameters())
    for name, p in total.named_parameters():
        if p.requires_grad:
            p.add_(others[name])
    return total
