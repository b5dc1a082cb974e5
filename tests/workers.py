"""Shared test fixtures: a tiny deterministic model, its data, worker functions for
``loco.launch`` (importable, so the processes launcher can pickle them) and plain
single-process references of the algorithms' maths."""

from __future__ import annotations

import copy
import math
import os
import time

import quantise
import torch

import loco
from loco.model import Transformer, model_config

VOCAB, SEQ, BATCH = 64, 16, 4


def make_model(seed: int = 0, layers: int = 2) -> Transformer:
    return Transformer(model_config("tiny", VOCAB, SEQ, n_layers=layers),
                       torch.Generator().manual_seed(seed))


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def smooth_optimizer(model) -> torch.optim.Optimizer:
    """AdamW with eps = 1e-3, for comparing two summation orders of the same gradient (R
    ranks' means averaged, against one mean over their samples). With the default eps, an
    entry whose gradient is within ulps of zero steps by about ±lr either way (Adam's step is
    lr · m / (√v + eps), near lr · sign(g) early on), so ulps can become 2 lr; with eps above
    such gradients the step is continuous in the gradient and ulps stay ulps."""
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-3)


def batch(worker: int, step: int, size: int = BATCH):
    """The batch worker ``worker`` sees at inner step ``step`` (same in every test)."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train_steps(model, opt, worker: int, steps, step_fn=None, clip: float | None = None,
                data=batch):
    for t in steps:
        x, y = data(worker, t)
        model(x, y).backward()
        if step_fn is not None:
            step_fn()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()


def slow_reduce(comm, delay: float) -> None:
    """Make every mean-all-reduce of ``comm`` sleep ``delay`` seconds on its communication
    thread before it runs: a slow link, to see what overlaps it."""
    reduce = comm._reduce_mean

    def slow(*args):
        time.sleep(delay)
        return reduce(*args)
    comm._reduce_mean = slow


def params_of(named) -> dict[str, torch.Tensor]:
    """Copies of the tensors, whole (an FSDP2 DTensor is gathered: collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in named.items()}


# --------------------------------------------------------------------------- worker fns
def diloco_worker(ctx, steps, sync_every, outer_lr, outer_momentum, nesterov=True,
                  init_seed=None, init_sync="broadcast"):
    model = make_model(ctx.rank if init_seed == "rank" else 0)
    opt = make_optimizer(model)
    algo = loco.DiLoCo(model, opt, ctx.comm, sync_every=sync_every, outer_lr=outer_lr,
                       outer_momentum=outer_momentum, nesterov=nesterov, init_sync=init_sync)
    train_steps(model, opt, ctx.rank, range(steps), lambda: (algo.step(), algo.zero_grad()))
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes}


def ddp_worker(ctx, steps, clip=None, optimizer=make_optimizer, codec="fp32"):
    """DataParallel; also returns the gradient every step applied (averaged and clipped)
    and this worker's own gradient before the reduction (``raw``)."""
    model = make_model()
    opt = optimizer(model)
    algo = loco.DataParallel(model, opt, ctx.comm, max_grad_norm=clip, codec=codec)
    grads, raw, own = [], [], {}
    for n, p in model.named_parameters():  # in the backward pass, before any averaging
        p.register_hook(lambda g, n=n: own.__setitem__(n, g.clone()))

    def step():
        raw.append(dict(own))
        algo.step()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        algo.zero_grad()
    train_steps(model, opt, ctx.rank, range(steps), step)
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes,
            "grads": grads, "raw": raw}


def streaming_worker(ctx, steps, layers=4, step_hook=None, **kw):
    """Streaming DiLoCo on the test model; flushes the last sync like the CLI does."""
    model = make_model(layers=layers)
    opt = make_optimizer(model)
    if isinstance(kw.get("overlap"), (list, tuple)):  # one τ per worker
        kw = {**kw, "overlap": kw["overlap"][ctx.rank]}
    algo = loco.StreamingDiLoCo(model, opt, ctx.comm, **kw)

    def step():
        algo.step()
        algo.zero_grad()
        if step_hook:
            step_hook(algo)
    train_steps(model, opt, ctx.rank, range(steps), step)
    algo.flush()
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes,
            "fragments": algo.fragments(), "syncs": list(algo.sync_log),
            "peak": ctx.comm.peak_sent_bytes(), "stats": algo.fragment_stats()}


def planned_worker(ctx, steps, plan, max_staleness=0, resume_at=None, **kw):
    """Streaming DiLoCo whose workers train only on the ticks of a fixed speed-aware plan
    (``plan``: every round's steps per worker), their pseudo-gradients weighed by it; with
    ``max_staleness``, asynchronous outer steps. Returns the global copy (``params``) and
    the bytes sent (``sent``); with ``resume_at``: also rebuilt from its state after that
    many ticks and finished again, both global copies."""
    from loco.training.local_steps import LocalSteps

    layers = kw.pop("layers", 4)

    def build():
        model = make_model(layers=layers)
        opt = make_optimizer(model)
        algo = loco.StreamingDiLoCo(model, opt, ctx.comm, **kw)
        ticks = LocalSteps(kw["sync_every"], ctx.comm.size, ctx.rank, rounds=plan,
                           max_staleness=max_staleness,
                           last_round=steps // kw["sync_every"] - 1)
        algo.pacing.weight_of = ticks.weight
        if max_staleness:
            algo.keep_block_starts()
        return model, opt, algo, ticks

    def run(model, opt, algo, ticks, first, last):
        for t in range(first, last):
            if ticks.trains(t + 1):
                train_steps(model, opt, ctx.rank, [t], lambda: (algo.step(), algo.zero_grad()))
            else:
                algo.idle_step()

    parts = build()
    run(*parts, 0, resume_at or steps)
    if resume_at is None:
        parts[2].flush()
        return {"params": params_of(parts[2].global_parameters()),
                "sent": ctx.comm.totals().sent_bytes}
    snapshot = copy.deepcopy(parts[2].state_dict())
    run(*parts, resume_at, steps)
    parts[2].flush()
    straight = params_of(parts[2].global_parameters())
    parts = build()
    parts[2].load_state_dict(snapshot)
    run(*parts, resume_at, steps)
    parts[2].flush()
    return straight, params_of(parts[2].global_parameters())


def resume_worker(ctx, steps, split, sync_every, algo_name, layers=2, parallel="ddp", **extra):
    """Train ``split`` steps, checkpoint, finish; then rebuild from the checkpoint and
    finish again. Returns both final parameter sets (whole). With R ranks per worker
    (``ctx.inner``) the model is whole on every rank or FSDP2-sharded (``parallel``). Under
    the processes launcher (``ctx.checkpoint_group``) the tensors go through
    ``torch.distributed.checkpoint`` into a temporary directory, as ``loco train`` saves
    them; otherwise the whole ``state_dict`` is kept in memory. ``split`` a list of steps
    (ascending): the one straight run checkpoints at each, and each checkpoint is resumed
    and finished on its own; returns the straight run's parameters and the list of the
    resumed runs' (the same runs as one call per split, without repeating the straight one)."""
    import tempfile

    from loco.training import shard_mesh

    splits = list(split) if isinstance(split, (list, tuple)) else [split]
    dcp, mesh = ctx.checkpoint_group is not None, shard_mesh(ctx)
    data_id = ctx.worker * ctx.worker_ranks + ctx.worker_rank
    build = lambda: _resume_build(ctx, sync_every, algo_name, layers, parallel, extra)  # noqa: E731

    def finish(parts, first, last):
        model, opt, algo = parts
        train_steps(model, opt, data_id, range(first, last),
                    lambda: (algo.step(), algo.zero_grad()))

    parts, done, saved = build(), 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for k, at in enumerate(splits):
            finish(parts, done, at)
            done = at
            saved.append(_resume_save(ctx, parts[2], dcp, mesh,
                                      os.path.join(tmp, f"worker{ctx.worker}-{k}")))
        finish(parts, done, steps)
        straight = params_of(parts[2].global_parameters())
        resumed = []
        for at, (snapshot, path) in zip(splits, saved):
            parts = build()
            _resume_load(ctx, parts[2], snapshot, path, mesh)
            finish(parts, at, steps)
            resumed.append(params_of(parts[2].global_parameters()))
        if dcp:
            torch.distributed.barrier(ctx.checkpoint_group)  # before the first rank cleans up
    return straight, (resumed if isinstance(split, (list, tuple)) else resumed[0])


def _resume_build(ctx, sync_every, algo_name, layers, parallel, extra):
    """resume_worker's model, inner optimizer and algorithm, built anew."""
    from loco.algorithms import method
    from loco.runtime.fsdp import shard_worker

    model = make_model(layers=layers)
    if parallel == "fsdp":
        shard_worker(model, ctx)
    opt = make_optimizer(model)
    kw = ({"sync_every": sync_every, **extra}
          if algo_name in ("diloco", "streaming", "noloco", "sparseloco") else {})
    return model, opt, method(algo_name)(model, opt, ctx.comm, inner=ctx.inner, **kw)


def _resume_save(ctx, algo, dcp, mesh, path):
    """resume_worker's checkpoint of ``algo``: its state (a deep copy; with ``dcp`` without
    the tensors, which every rank of the worker writes into the first rank's ``path``) and
    that path (None without ``dcp``)."""
    from loco import checkpoint

    snapshot = copy.deepcopy(algo.state_dict(tensors=not dcp))  # optimizer: live tensors
    if not dcp:
        return snapshot, None
    path = _broadcast_path(ctx, path if ctx.worker_rank == 0 else None)
    checkpoint.save_worker(path, checkpoint.snapshot(algo.checkpoint_tensors(mesh)),
                           ctx.checkpoint_group)
    return snapshot, path


def _resume_load(ctx, algo, snapshot, path, mesh):
    """Load what ``_resume_save`` kept into the freshly built ``algo``."""
    from loco import checkpoint

    algo.load_state_dict(snapshot)
    if path is not None:
        tensors = algo.checkpoint_tensors(mesh)
        checkpoint.load_worker(path, tensors, ctx.checkpoint_group)
        algo.load_checkpoint_tensors(tensors, mesh)


def _broadcast_path(ctx, path):
    """The worker's first rank's ``path`` on every rank of the worker."""
    box = [path]
    torch.distributed.broadcast_object_list(
        box, src=torch.distributed.get_global_rank(ctx.checkpoint_group, 0),
        group=ctx.checkpoint_group)
    return box[0]


# --------------------------------------------------------------------------- references
def reference_diloco(workers, steps, sync_every, outer_lr, outer_momentum, nesterov=True,
                     data=batch, optimizer=make_optimizer):
    """DiLoCo as the paper's algorithm box, in one process, with the outer update by hand;
    ``data(m, t)``: worker m's batch at step t."""
    models = [make_model() for _ in range(workers)]
    opts = [optimizer(m) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    glob = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(g) for g in glob]
    for t in range(steps):
        for m in range(workers):
            train_steps(models[m], opts[m], m, [t], data=data)
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


def unflatten_named(flats, names, like) -> dict[str, torch.Tensor]:
    """Each fragment's flat vector (``flats[p]``) as copies of the named parameters of
    ``names[p]``, shaped like ``like[name]``."""
    out = {}
    for flat, frag in zip(flats, names):
        offset = 0
        for n in frag:
            numel = like[n].numel()
            out[n] = flat[offset:offset + numel].view_as(like[n]).clone()
            offset += numel
    return out


# Streaming DiLoCo's fragments of the test model (``make_model(layers=L)``), as literal tables
# by name prefix, not from split_fragments: the blocks dealt out strided (block i to fragment
# i mod P) or sequential (runs), then the parameters outside them largest first to the fragment
# with the fewest values so far, the lower index on a tie (a block holds 13,408 values, the
# embedding 2,048, the final norm 32). (L, P, pattern) -> each fragment's prefixes.
FRAGMENTS = {
    (4, 2, "strided"): [("embed.", "blocks.0.", "blocks.2."), ("blocks.1.", "blocks.3.", "norm.")],
    (4, 3, "strided"): [("blocks.0.", "blocks.3."), ("embed.", "blocks.1."),
                        ("blocks.2.", "norm.")],
    (4, 4, "strided"): [("embed.", "blocks.0."), ("blocks.1.", "norm."), ("blocks.2.",),
                        ("blocks.3.",)],
    (4, 2, "sequential"): [("embed.", "blocks.0.", "blocks.1."),
                           ("blocks.2.", "blocks.3.", "norm.")],
    (2, 2, "strided"): [("embed.", "blocks.0."), ("blocks.1.", "norm.")],
}
# When fragment p is sent: after the inner steps t with t % H == SEND_OFFSETS[H, P][p], the
# paper's floor((p + 1) H / P) mod H (the last fragment at the round's end), worked out by hand
# (not from send_offsets); (1, 1) for one fragment at any H.
SEND_OFFSETS = {
    (1, 1): [0], (4, 2): [2, 0], (6, 2): [3, 0], (7, 2): [3, 0], (8, 2): [4, 0],
    (10, 3): [3, 6, 0], (10, 4): [2, 5, 7, 0], (12, 2): [6, 0], (12, 3): [4, 8, 0],
    (12, 4): [3, 6, 9, 0], (50, 2): [25, 0], (7, 3): [2, 4, 0],
    (12, 12): [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0],
    (30, 8): [3, 7, 11, 15, 18, 22, 26, 0], (100, 8): [12, 25, 37, 50, 62, 75, 87, 0],
    (100, 36): [2, 5, 8, 11, 13, 16, 19, 22, 25, 27, 30, 33, 36, 38, 41, 44, 47, 50, 52, 55,
                58, 61, 63, 66, 69, 72, 75, 77, 80, 83, 86, 88, 91, 94, 97, 0],
}


def fragment_names(model, layers: int, fragments: int, pattern: str = "strided"
                   ) -> list[list[str]]:
    """Each fragment's parameter names in the model's order, from ``FRAGMENTS`` (one
    fragment: the whole model)."""
    prefixes = [("",)] if fragments == 1 else FRAGMENTS[layers, fragments, pattern]
    return [[n for n, _ in model.named_parameters() if n.startswith(p)] for p in prefixes]


def codec_roundtrip(codec: str, block, keep, rows: int):
    """D(C(x)) of ``codec`` on ``rows`` rows (the all-reduce's M; 1: the whole vector as one
    row) from the test-side quantiser (tests/quantise.py); ``dare`` and ``random_drop``,
    whose positions are a keyed hash of the row, from the library's codec."""
    if codec in quantise.NAMES:
        return lambda x: quantise.roundtrip(codec, x, block, keep, rows)
    from loco.comm.codecs import get_codec

    qdq = get_codec(codec, block, keep=keep)

    def library(x):
        chunk = qdq.padded(math.ceil(x.numel() / rows))
        padded = torch.nn.functional.pad(x, (0, chunk * rows - x.numel())).view(rows, chunk)
        return qdq.decode_rows(qdq.encode_rows(padded), chunk).view(-1)[:x.numel()]
    return library


def reference_streaming(workers, steps, sync_every, fragments, overlap, alpha, codec="fp32",
                        outer_lr=0.4, outer_momentum=0.9, nesterov=True, layers=4,
                        pattern="strided", block=None, data=batch, shards=1, parallel="ddp",
                        optimizer=make_optimizer, lost=None, rejoin=None, error_feedback=0.0,
                        keep=None, plan=None, max_staleness=0, trained=None, block_ends=None):
    """Streaming DiLoCo as the paper's algorithm box, in one process: per-fragment
    pseudo-gradients, quantized (and the mean re-quantized) with the codec, an outer Nesterov
    step by hand, and the α-merge into each worker's moved-on parameters at t + τ_m (``overlap``
    an int, or one τ per worker). Fragment p is sent at t % H == floor((p + 1) H / P) % H
    (``SEND_OFFSETS``), its parameters those of ``FRAGMENTS``; the codec's round trip is the
    test-side quantiser's (tests/quantise.py): literal tables and an independent quantiser,
    so that the library cannot agree with a reference made of its own functions.

    Elastic membership: ``lost={m: s}``: worker m's contributions are dropped from the sync
    sent at step s on (the mean is over the others); ``rejoin={m: (s, start)}``: it joins again
    at the sync sent at s, taking the global copy as it was before that sync's outer step at
    step ``start`` (s, or s + τ when it joined during a retry), with a fresh inner optimizer;
    it contributes to the syncs after that one and trains from step start + 1.

    Error feedback (``error_feedback`` β > 0): worker m keeps e_{m,p}; at a send
    e ← β·e + Δ, it contributes D(C(e)), and keeps e − D(C(e)). A codec that ``gathers``
    (SparseLoCo's) is applied to the whole fragment and the mean is not encoded again;
    another one to the M rows of the all-reduce (chunk ``padded(ceil(n / M))``) and to the
    mean's rows.

    Speed-aware local steps (``plan``: every round's steps per worker): worker m trains at
    tick k of a round of n steps when floor((k+1) n / H) > floor(k n / H) (the run's first
    round: its first n ticks), or at the ticks of ``trained`` (a literal table: worker m's
    ticks, ``trained[m]``), and its pseudo-gradient is scaled by M n_m / N (its share of the
    steps of the H ticks before the send) before it is averaged.

    Asynchronous outer steps (``max_staleness`` S > 0, one fragment, τ = 0): worker m's
    block gathers its rounds' steps until it holds H, or spans S + 1 rounds, or the last
    full round ends; at that round's sync it sends θ^g(block start) − θ_m scaled by
    M n_m / N (N: the steps of every block ending there), and merges and starts a new block
    from the new θ^g; at the other syncs it sends zeros and trains on. With workers lost or
    rejoining, M and N count the workers that contribute to the sync; a joiner takes the
    new θ^g at its sync and starts its blocks with the next round. ``block_ends``: the
    blocks as a literal table instead (worker m's ``{round: steps}``)."""
    lost, rejoin = lost or {}, rejoin or {}
    H = sync_every

    def ticks(m, t):  # the tick of a worker of fewer steps per round (plan)
        if trained is not None:
            return t in trained[m]
        if plan is None:
            return True
        n = plan[(t - 1) // H][m] if (t - 1) // H < len(plan) else H
        k, h = (t - 1) % H, H
        return k < n if t <= H else (k + 1) * n // h > k * n // h

    def ends(m):  # asynchronous: {round: steps} of every block of worker m
        out, held, age = {}, 0, 0
        for r in range(steps // H):
            if m in rejoin and r == rejoin[m][0] // H:  # it joined: its blocks start anew
                held, age = 0, 0
            held += sum(ticks(m, u) for u in range(r * H + 1, r * H + H + 1))
            if held >= H or age >= max_staleness or r == steps // H - 1:
                out[r], held, age = held, 0, 0
            else:
                age += 1
        return out
    blocks = (block_ends if block_ends is not None else
              [ends(m) for m in range(workers)] if max_staleness else None)

    def weight(m, t):  # over the workers that contribute to the sync sent at t
        live = [w for w in range(workers) if contributes(w, t)]
        if blocks is not None:
            sent = {w: blocks[w].get(t // H - 1, 0) for w in live}
        else:
            sent = {w: sum(ticks(w, u) for u in range(max(1, t - H + 1), t + 1)) for w in live}
        return len(live) * sent[m] / sum(sent.values())

    def contributes(m, s):
        return m not in lost or s < lost[m] or (m in rejoin and s > rejoin[m][0])

    def trains(m, t):
        return m not in lost or t < lost[m] or (m in rejoin and t > rejoin[m][1])
    gathers = codec in quantise.CHUNKED
    roundtrip = codec_roundtrip(codec, block, keep, 1 if gathers or shards > 1 else workers)
    models = [make_model(layers=layers) for _ in range(workers)]
    opts = [optimizer(m) for m in models]
    names = fragment_names(models[0], layers, fragments, pattern)
    P = len(names)
    sends = SEND_OFFSETS[1 if P == 1 else H, P]
    local = [dict(m.named_parameters()) for m in models]
    glob = [torch.cat([local[0][n].detach().reshape(-1) for n in frag]) for frag in names]
    starts = [[g.clone() for g in glob] for _ in range(workers)]  # asynchronous blocks
    # R ranks per worker encode their own shards (shards=1: the whole fragment at once)
    per_shard = [shard_roundtrip(roundtrip, shards, parallel, [local[0][n].shape for n in frag])
                 for frag in names]
    momentum = [torch.zeros_like(g) for g in glob]
    errors = [[torch.zeros_like(g) for g in glob] for _ in range(workers)]
    taus = overlap if isinstance(overlap, (list, tuple)) else [overlap] * workers
    in_flight = None  # [fragment, step sent, mean pseudo-gradient, workers not merged yet]

    def outer_step(p, mean):
        with torch.no_grad():
            momentum[p].mul_(outer_momentum).add_(mean)
            update = mean.add(momentum[p], alpha=outer_momentum) if nesterov else momentum[p]
            glob[p].add_(update, alpha=-outer_lr)

    def merge(p, worker_ids):
        with torch.no_grad():
            for m in worker_ids:
                offset = 0
                for n in names[p]:
                    w = local[m][n]
                    g = glob[p][offset:offset + w.numel()].view_as(w)
                    w.copy_(g if alpha == 0 else w.lerp(g, 1 - alpha))
                    offset += w.numel()

    before = None  # the global copy before the outer step of a rejoin's sync
    for t in range(1, steps + 1):
        for m in range(workers):
            if trains(m, t) and ticks(m, t):
                train_steps(models[m], opts[m], m, [t - 1], data=data)
        for p in range(P):
            if t % H == sends[p]:
                live = [m for m in range(workers) if contributes(m, t)]
                if any(r[0] == t for r in rejoin.values()):
                    before = [g.clone() for g in glob]
                with torch.no_grad():
                    deltas = []
                    for m in live:
                        w = 1.0 if plan is None else weight(m, t)
                        d = (starts[m][p] if blocks else glob[p]) - torch.cat(
                            [local[m][n].reshape(-1) for n in names[p]])
                        if w == 0:  # asynchronous: m's block goes on; it sends zeros
                            deltas.append(per_shard[p](torch.zeros_like(d)))
                            continue
                        d.mul_(w)
                        if error_feedback:
                            d = errors[m][p].mul_(error_feedback).add_(d).clone()
                        deltas.append(per_shard[p](d))
                        if error_feedback:
                            errors[m][p].sub_(deltas[-1])
                    mean = torch.stack(deltas).sum(0) / len(live)
                in_flight = [p, t, mean if gathers else per_shard[p](mean)]
                outer_step(p, in_flight[2])  # the same on every worker, whenever it applies
                in_flight.append({m for m in range(workers)  # (a joiner takes it too)
                                  if blocks is None or t // H - 1 in blocks[m]
                                  or rejoin.get(m, (None,))[0] == t})
                for m in in_flight[3] if blocks else ():  # a new block from the new θ^g
                    starts[m][p] = glob[p].clone()
        for m, (_, start) in rejoin.items():
            if t == start:  # the joiner takes the global copy, its optimizer starts anew
                with torch.no_grad():
                    for frag, g in zip(names, before):
                        offset = 0
                        for n in frag:
                            w = local[m][n]
                            w.copy_(g[offset:offset + w.numel()].view_as(w))
                            offset += w.numel()
                opts[m] = optimizer(models[m])
        if in_flight is not None:
            due = {m for m in in_flight[3] if in_flight[1] + taus[m] == t}
            merge(in_flight[0], sorted(due))
            in_flight[3] -= due
            if not in_flight[3]:
                in_flight = None
    if in_flight is not None:
        merge(in_flight[0], sorted(in_flight[3]))
    return unflatten_named(glob, names, local[0])


def reference_big_batch(workers, steps, clip=None, optimizer=make_optimizer, lost=None):
    """One process training on every worker's batch at once (batch workers x BATCH); returns
    the parameters and the gradient every step applied. ``lost={m: k}``: worker m's batches
    are left out from inner step k (1-based) on."""
    model = make_model()
    opt = optimizer(model)
    grads = []
    lost = lost or {}
    for t in range(steps):
        xs, ys = zip(*(batch(m, t) for m in range(workers) if t + 1 < lost.get(m, steps + 1)))
        model(torch.cat(xs), torch.cat(ys)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return params_of(dict(model.named_parameters())), grads


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


_ONCE: dict = {}


def forked(target, *args):
    """A process running ``target(*args)``, started: forked from loco's rank server (torch
    already imported there, as a rank process of the launchers starts), not a fresh Python
    that imports it again (seconds of CPU each)."""
    from loco.runtime.starter import context

    proc = context().Process(target=target, args=args)
    proc.start()
    return proc


def join_all(procs: list, timeout: float) -> list:
    """Each process's exit code once it ends, all within ``timeout`` seconds; one still
    running then (hung) is killed, not left behind, and its code is the kill's."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.01))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def once(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, computed once per test session for the same function and
    arguments (told apart by their ``repr``): a reference or a run that several tests
    compare against, deterministic, whose result the tests only read."""
    key = (fn, repr(args), repr(sorted(kwargs.items())))
    if key not in _ONCE:
        _ONCE[key] = fn(*args, **kwargs)
    return _ONCE[key]


# --------------------------------------------------------------------------- tolerances
# A result and its single-process reference, computed on the same CPU, agree bit for bit
# when both run the same operations in the same order; the tests then assert equality, on
# every instruction set. Where the reference is written another way (by hand, or grouping a
# sum differently), rounding may differ: a multiply-add fused into one rounding (FMA) by the
# AVX2/AVX-512 kernels and rounded twice by the generic ones, or a sum added up in another
# order. Such a tolerance counts the rounding errors that can differ, in units of
# EPS * max|value|, which is at least one unit in the last place (ulp) of every value.
EPS = torch.finfo(torch.float32).eps  # 2^-23, the ulp of values in [1, 2)


def ulps(values: dict, n: float) -> float:
    """n ulps of the largest magnitude among ``values`` (name -> tensor)."""
    return n * EPS * max(v.abs().max().item() for v in values.values())


# --------------------------------------------------------------------------- NoLoCo
def noloco_worker(ctx, steps, **kw):
    """NoLoCo; with ``launch(..., worker_ranks=R)`` a worker of R ranks, rank (m, r) training on
    batch(m * R + r, t)."""
    model = make_model()
    opt = make_optimizer(model)
    algo = loco.NoLoCo(model, opt, ctx.comm, inner=ctx.inner, **kw)
    data_id = ctx.worker * ctx.worker_ranks + ctx.worker_rank
    train_steps(model, opt, data_id, range(steps), lambda: (algo.step(), algo.zero_grad()))
    outer = [r for r in ctx.comm.records if r.tag == "train"]
    return {"params": params_of(dict(model.named_parameters())), "records": outer,
            "groups": [algo.groups(k) for k in range(algo.outer_steps + 2)]}


# NoLoCo's groups at outer steps k = 0, 1, 2, 3 for (seed, M, n): a permutation drawn from
# (seed, k), cut into groups of n (the library's gossip_groups; tests/test_noloco.py pins it to
# this table). Literals, so that the reference does not share the library's draw.
GOSSIP = {
    (0, 2, 2): [[[0, 1]]] * 4,
    (0, 4, 4): [[[0, 1, 2, 3]]] * 4,
    (0, 4, 2): [[[0, 1], [2, 3]], [[1, 3], [0, 2]], [[0, 1], [2, 3]], [[2, 3], [0, 1]]],
    (0, 8, 2): [[[0, 4], [3, 7], [2, 5], [1, 6]], [[4, 5], [2, 6], [3, 7], [0, 1]],
                [[0, 4], [2, 7], [5, 6], [1, 3]], [[2, 4], [3, 5], [0, 1], [6, 7]]],
    (0, 8, 4): [[[0, 3, 4, 7], [1, 2, 5, 6]], [[2, 4, 5, 6], [0, 1, 3, 7]],
                [[0, 2, 4, 7], [1, 3, 5, 6]], [[2, 3, 4, 5], [0, 1, 6, 7]]],
}


def reference_noloco(workers, steps, sync_every, group_size, beta, alpha, gamma,
                     nesterov=False, seed=0, data=batch, optimizer=make_optimizer):
    """NoLoCo's outer step by hand, in one process, for every worker, with the groups of
    ``GOSSIP`` (a literal table, not the library's draw); ``data(m, t)``: worker m's batch at
    step t."""
    models = [make_model() for _ in range(workers)]
    opts = [optimizer(m) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    slow = [flat(m) for m in models]
    mom = [torch.zeros_like(s) for s in slow]
    for t in range(steps):
        for m in range(workers):
            train_steps(models[m], opts[m], m, [t], data=data)
        if (t + 1) % sync_every:
            continue
        k = (t + 1) // sync_every - 1
        deltas = [flat(models[i]) - slow[i] for i in range(workers)]  # new minus old
        new_slow = list(slow)
        for group in GOSSIP[seed, workers, group_size][k]:
            mean_delta = torch.stack([deltas[j] for j in group]).mean(0)
            mean_slow = torch.stack([slow[j] for j in group]).mean(0)
            for i in group:
                g = beta * mean_delta - gamma * (slow[i] - mean_slow)
                mom[i] = alpha * mom[i] + g
                new_slow[i] = slow[i] + (alpha * mom[i] + g if nesterov else mom[i])
        slow = new_slow
        for i, model in enumerate(models):
            with torch.no_grad():
                offset = 0
                for p in model.parameters():
                    p.copy_(slow[i][offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    return [params_of(dict(m.named_parameters())) for m in models]


def sharded_worker(ctx, steps, algo_name="diloco", parallel="ddp", optimizer=make_optimizer,
                   **kw):
    """An algorithm with R ranks per worker (``ctx.inner``), the model whole on every rank
    (``parallel="ddp"``) or FSDP2-sharded over them (``"fsdp"``): rank (m, r) trains on
    batch(m * R + r, t); the worker's gradient is their mean. Returns the global (or, for
    NoLoCo and DataParallel, the model's) parameters, whole, and the bytes of each link."""
    from loco.runtime.fsdp import shard_worker

    model = make_model(layers=kw.pop("layers", 2))
    if parallel == "fsdp":
        shard_worker(model, ctx)
    opt = optimizer(model)
    cls = {"diloco": loco.DiLoCo, "streaming": loco.StreamingDiLoCo, "noloco": loco.NoLoCo,
           "ddp": loco.DataParallel}[algo_name]
    algo = cls(model, opt, ctx.comm, inner=ctx.inner, **kw)
    data_id = ctx.worker * ctx.worker_ranks + ctx.worker_rank
    train_steps(model, opt, data_id, range(steps), lambda: (algo.step(), algo.zero_grad()))
    algo.flush()
    named = (dict(model.named_parameters()) if algo_name in ("noloco", "ddp")
             else algo.global_parameters())
    return {"params": params_of(named),
            "slow": ctx.comm.totals().sent_bytes,
            "fast": ctx.inner.totals().sent_bytes if ctx.inner is not None else 0,
            "outer_bytes": algo.memory_bytes()["outer"],
            "records": [r for r in ctx.comm.records if r.tag == "train"]}


def sharded_cases(ctx, cases: dict):
    """Several runs in one launch (processes are slow to start): ``cases`` maps a name to
    ``(fn, args, kwargs)`` of a worker function; the byte counts a result reports (``slow``,
    ``fast``) are made its own."""
    out = {}
    for name, (fn, args, kw) in cases.items():
        slow = ctx.comm.totals().sent_bytes
        fast = ctx.inner.totals().sent_bytes if ctx.inner is not None else 0
        res = fn(ctx, *args, **kw)
        out[name] = (dict(res, slow=res["slow"] - slow, fast=res["fast"] - fast)
                     if isinstance(res, dict) and "slow" in res else res)
    return out


def shard_roundtrip(roundtrip, shards: int, parallel: str, shapes):
    """The codec's round trip applied shard by shard, as R ranks of a worker apply it: to R
    equal ranges of the flat vector (``"ddp"``), or to each rank's dim-0 chunks of every
    tensor (``"fsdp"``, as FSDP2 shards with ``torch.chunk``). ``shapes``: the tensors' shapes,
    in the vector's order."""
    def apply(x):
        if shards == 1:
            return roundtrip(x)
        if parallel == "ddp":
            width = -(-x.numel() // shards)
            return torch.cat([roundtrip(x[r * width:(r + 1) * width]) for r in range(shards)])
        out, views, offset = x.clone(), [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            views.append(out[offset:offset + n].view(shape))
            offset += n
        for r in range(shards):
            parts = [c[r] for c in (torch.chunk(v, shards, dim=0) for v in views) if len(c) > r]
            flat = roundtrip(torch.cat([p.reshape(-1) for p in parts]))
            offset = 0
            for p in parts:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return out
    return apply


def worker_batches(shards: int):
    """``data(m, t)`` for a reference worker m that stands for ``shards`` ranks: their
    batches at step t, concatenated."""
    def data(worker, t):
        parts = [batch(worker * shards + r, t) for r in range(shards)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    return data


def resumed_tensors(ctx, cfg, corpus):
    """Set a rank of ``loco train`` up as a resumed run of ``cfg`` does; return its worker's
    tensors whole (collective over the worker's ranks), its loader's position and its byte
    counters of both links."""
    from torch.distributed.tensor import DTensor

    from loco.training import setup_worker, shard_mesh

    w, _ = setup_worker(ctx, cfg, corpus)
    w.bar.close()

    def whole(t):
        if isinstance(t, dict):
            return {k: whole(v) for k, v in t.items()}
        if isinstance(t, DTensor):
            return t.full_tensor()
        return t.detach().clone() if isinstance(t, torch.Tensor) else t
    return {"tensors": whole(w.algo.checkpoint_tensors(shard_mesh(ctx))),
            "loader": w.loader.state_dict(), "comm": ctx.comm.state_dict(),
            "inner": ctx.inner.state_dict() if ctx.inner is not None else None,
            "tokens": w.resumed_tokens}


def resumed_tensors_of_each(ctx, jobs):
    """``resumed_tensors`` of each ``(cfg, corpus)`` in ``jobs`` in turn, in one launch."""
    return [resumed_tensors(ctx, cfg, corpus) for cfg, corpus in jobs]


def elastic_worker(ctx, steps, kill=None, **kw):
    """Streaming DiLoCo under elastic membership: joins, trains until ``steps`` inner steps
    from wherever it joined (rank (m, r) reads batch(m * R + r, t) at each step), flushes.
    ``kill=(worker, step, where[, shard])`` kills that worker's first process (of rank
    ``shard``, default 0) with SIGKILL: before inner step ``step`` (``where="step"``), or in
    the middle of the reduction of the sync sent at ``step`` (``"reduction"``: after its
    reduce-scatter, before its all-gather). ``parallel="fsdp"`` shards the model over the
    worker's ranks. ``plan`` (every round's steps per worker, fixed): speed-aware local steps
    under the quorum, with ``max_staleness``, asynchronous outer steps. ``step_seconds``: a
    pause after each step taken while a worker of the job is missing from the quorum."""
    import signal
    import time

    from loco.runtime.elastic import RESTART_ENV
    from loco.runtime.fsdp import shard_worker

    from loco.training.local_steps import LocalSteps

    # slower steps while a worker is missing from the quorum: a restarted one can catch up
    # (the margin is the steps left times the pause); at full speed before and after
    pause = kw.pop("step_seconds", 0.0)
    plan, staleness = kw.pop("plan", None), kw.pop("max_staleness", 0)
    kw_stage = kw.pop("stage", False)
    name = kw.pop("algo_name", "streaming")
    model = make_model(layers=kw.pop("layers", 4 if name == "streaming" else 2))
    if kw.pop("parallel", "ddp") == "fsdp":
        shard_worker(model, ctx)
    opt = (smooth_optimizer if kw.pop("smooth", False) else make_optimizer)(model)
    algo = {"streaming": loco.StreamingDiLoCo, "dp": loco.DataParallel,
            "noloco": loco.NoLoCo}[name](model, opt, ctx.comm, inner=ctx.inner, **kw)
    if kw_stage:  # the CPU stands in for the model's GPU
        ctx.comm.stage_from = torch.device("cpu")
    handed = watch_transport(ctx.comm)
    groups = {}  # NoLoCo: outer step -> its groups, in workers' indexes
    data_id = ctx.worker * ctx.worker_ranks + ctx.worker_rank
    victim = (kill is not None and kill[0] == ctx.worker and os.environ[RESTART_ENV] == "0"
              and ctx.worker_rank == (kill[3] if len(kill) > 3 else 0))
    if victim and kill[2] == "reduction":
        gather = ctx.comm._gather

        def dying_gather(out, tensor):
            if tensor.dtype != torch.int64 and algo.inner_steps >= kill[1]:  # not membership
                os.kill(os.getpid(), signal.SIGKILL)
            gather(out, tensor)
        ctx.comm._gather = dying_gather
    ticks = None
    if plan is not None:
        ticks = LocalSteps(kw["sync_every"], ctx.comm.workers, ctx.worker, rounds=plan,
                           max_staleness=staleness, last_round=steps // kw["sync_every"] - 1,
                           quorum=ctx.comm)
        ctx.comm.register_state("local_steps", ticks.heal_state, ticks.load_heal_state)
        algo.pacing.weight_of = ticks.weight
        if staleness:
            algo.keep_block_starts()
    joined = algo.join()
    if joined and ticks is not None and algo.inner_steps % algo.sync_every == 0:
        ticks.rejoined(algo.inner_steps // algo.sync_every - 1)
    start, sent = algo.inner_steps, {}
    join_sync = algo.healing.syncing[1] if joined else None
    after_join = params_of(dict(model.named_parameters())) if joined else None
    while algo.inner_steps < steps:
        if victim and kill[2] == "step" and algo.inner_steps + 1 == kill[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        if ticks is None or ticks.trains(algo.inner_steps + 1):
            x, y = batch(data_id, algo.inner_steps)
            model(x, y).backward()
            algo.step()
            algo.zero_grad()
        else:
            algo.idle_step()
        if ticks is not None and algo.inner_steps % algo.sync_every == 0:
            ticks.rejoined(algo.inner_steps // algo.sync_every - 1)
        if algo.sync_in_flight and algo._in_flight.sent_at == algo.inner_steps:
            sent[algo.inner_steps] = params_of(algo.global_parameters())  # before its step
        if name == "noloco" and algo.inner_steps % algo.sync_every == 0:
            k, members = algo.outer_steps - 1, ctx.comm.members
            groups[k] = sorted(sorted(members[r] for r in g) for g in algo.groups(k))
        if len(ctx.comm.members) < ctx.comm.workers:
            time.sleep(pause)
    algo.flush()
    return {"params": params_of(algo.global_parameters()), "joined": joined, "start": start,
            "after_join": after_join, "join_sync": join_sync,
            "sent": sent, "groups": groups, "syncs": list(ctx.comm.syncs), "handed": handed,
            "events": list(ctx.comm.events), "sync_log": list(getattr(algo, "sync_log", []))}


def watch_transport(comm) -> list[str]:
    """The operations of ``comm`` that handed the transport (checked at issue) storage of a
    tensor its caller handed to the Comm, filled in as the run goes. With the CPU standing in
    for the model's GPU (``stage_from="cpu"``) the caller's tensors are the "GPU" tensors:
    none may reach gloo, only the host copies the Comm makes of them."""
    from loco.comm.streams import STAGED

    handed, callers = [], []  # callers: a stack of storage sets, one per operation called

    def tensors(value):
        if isinstance(value, torch.Tensor):
            return [] if hasattr(value, STAGED) else [value]  # (the Comm's own host copy)
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in tensors(v)]
        return []

    def watched(op):
        def call(*args, **kwargs):
            callers.append({t.untyped_storage().data_ptr()
                            for t in tensors([*args, *kwargs.values()])})
            try:
                return op(*args, **kwargs)
            finally:
                callers.pop()
        return call
    for name in ("all_reduce_mean", "all_gather_mean", "broadcast", "all_gather", "exchange",
                 "sendrecv"):
        setattr(comm, name, watched(getattr(comm, name)))
    check = comm._check_devices

    def spy(op, ts):
        mine = set().union(*callers)
        handed.extend(op for t in ts if t.untyped_storage().data_ptr() in mine)
        check(op, ts)
    comm._check_devices = spy
    return handed


def heal_roundtrip_worker(ctx, algo_name, steps, **kw):
    """Train ``steps`` steps, pass ``heal_state()`` through torch.save/load into a fresh
    algorithm's ``load_heal_state``; return both global models, the fresh replica and the
    counters."""
    import io

    cls = {"streaming": loco.StreamingDiLoCo, "dp": loco.DataParallel, "noloco": loco.NoLoCo}
    model = make_model()
    algo = cls[algo_name](model, make_optimizer(model), ctx.comm, **kw)
    train_steps(model, None, ctx.rank, range(steps), lambda: (algo.step(), algo.zero_grad()))
    buf = io.BytesIO()
    torch.save(algo.heal_state(), buf)
    fresh_model = make_model(seed=1)  # other weights: everything must come from the state
    fresh = cls[algo_name](fresh_model, make_optimizer(fresh_model), ctx.comm, **kw)
    buf.seek(0)
    fresh.load_heal_state(torch.load(buf, weights_only=True))
    return {"global": params_of(algo.global_parameters()),
            "fresh_global": params_of(fresh.global_parameters()),
            "fresh_replica": params_of(dict(fresh_model.named_parameters())),
            "steps": (algo.inner_steps, fresh.inner_steps),
            "optimizer_state": len(fresh.inner_optimizer.state)}
