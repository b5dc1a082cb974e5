"""Shared test fixtures: a tiny deterministic model, its data, worker functions for
``loco.launch`` (importable, so the processes launcher can pickle them) and plain
single-process references of the algorithms' maths."""

from __future__ import annotations

import copy

import torch

import loco
from loco.model import Transformer, model_config

VOCAB, SEQ, BATCH = 64, 16, 4


def make_model(seed: int = 0) -> Transformer:
    return Transformer(model_config("tiny", VOCAB, SEQ), torch.Generator().manual_seed(seed))


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(worker: int, step: int, size: int = BATCH):
    """The batch worker ``worker`` sees at inner step ``step`` (same in every test)."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train_steps(model, opt, worker: int, steps, step_fn=None, clip: float | None = None):
    for t in steps:
        x, y = batch(worker, t)
        model(x, y).backward()
        if step_fn is not None:
            step_fn()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()


def params_of(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named.items()}


# --------------------------------------------------------------------------- worker fns
def diloco_worker(ctx, steps, sync_every, outer_lr, outer_momentum, nesterov=True,
                  init_seed=None, init_sync="broadcast"):
    model = make_model(ctx.rank if init_seed == "rank" else 0)
    opt = make_optimizer(model)
    algo = loco.DiLoCo(model, opt, ctx.comm, sync_every=sync_every, outer_lr=outer_lr,
                       outer_momentum=outer_momentum, nesterov=nesterov, init_sync=init_sync)
    train_steps(model, opt, ctx.rank, range(steps), lambda: (algo.step(), algo.zero_grad()))
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes}


def ddp_worker(ctx, steps, clip=None):
    model = make_model()
    opt = make_optimizer(model)
    algo = loco.DataParallel(model, opt, ctx.comm, max_grad_norm=clip)
    train_steps(model, opt, ctx.rank, range(steps), lambda: (algo.step(), algo.zero_grad()))
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes}


def resume_worker(ctx, steps, split, sync_every, algo_name):
    """Train ``split`` steps, snapshot state_dict, finish; then rebuild from the snapshot and
    finish again. Returns both final parameter sets."""
    def build():
        model = make_model()
        opt = make_optimizer(model)
        cls = loco.algorithms.ALGORITHMS[algo_name]
        kw = {"sync_every": sync_every} if algo_name == "diloco" else {}
        return model, opt, cls(model, opt, ctx.comm, **kw)

    model, opt, algo = build()
    step = lambda: (algo.step(), algo.zero_grad())  # noqa: E731
    train_steps(model, opt, ctx.rank, range(split), step)
    snapshot = copy.deepcopy(algo.state_dict())  # optimizer state is live tensors
    train_steps(model, opt, ctx.rank, range(split, steps), step)
    straight = params_of(algo.global_parameters())

    model, opt, algo = build()
    algo.load_state_dict(snapshot)
    step = lambda: (algo.step(), algo.zero_grad())  # noqa: E731
    train_steps(model, opt, ctx.rank, range(split, steps), step)
    return straight, params_of(algo.global_parameters())


# --------------------------------------------------------------------------- references
def reference_diloco(workers, steps, sync_every, outer_lr, outer_momentum, nesterov=True):
    """DiLoCo as the paper's algorithm box, in one process, with the outer update by hand."""
    models = [make_model() for _ in range(workers)]
    opts = [make_optimizer(m) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    glob = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(g) for g in glob]
    for t in range(steps):
        for m in range(workers):
            train_steps(models[m], opts[m], m, [t])
        if (t + 1) % sync_every:
            continue
        with torch.no_grad():
            for i, g in enumerate(glob):
                locals_ = [list(models[m].parameters())[i] for m in range(workers)]
                delta = torch.stack([g - p for p in locals_]).mean(0)  # old global - new local
                momentum[i] = outer_momentum * momentum[i] + delta
                update = delta + outer_momentum * momentum[i] if nesterov else momentum[i]
                g -= outer_lr * update
            for model in models:
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
    return dict(zip(names, glob))


def reference_big_batch(workers, steps, clip=None):
    """One process training on every worker's batch at once (batch workers x BATCH)."""
    model = make_model()
    opt = make_optimizer(model)
    for t in range(steps):
        xs, ys = zip(*(batch(m, t) for m in range(workers)))
        model(torch.cat(xs), torch.cat(ys)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return params_of(dict(model.named_parameters()))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
