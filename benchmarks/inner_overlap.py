"""Gradient reduction inside a worker, overlapped with the backward pass or after it.

One worker of R ranks holding the whole model (``--worker-parallel ddp``), as processes (each
rank its own process and gloo group, or NCCL on GPUs under torchrun): every step a forward and
backward pass of the built-in model, then the gradients' mean over the R ranks, three ways:

* ``backward alone``: no reduction (the floor);
* ``after backward``: every gradient flattened into one fp32 buffer after the backward pass,
  one mean all-reduce, waited for (loco before ``GradientBuckets``);
* ``buckets during backward``: ``GradientBuckets``, loco's way now: 25 MiB buckets, each
  reduced as soon as its last gradient is in, while the backward pass goes on; waited for at
  the end.

It prints each one's median step time over ``--steps`` steps (after 3 untimed ones) and its
ratio to ``backward alone``, side by side. On a CPU the ranks' compute and gloo's reductions
share the same cores, which caps what overlap can win; on GPUs NCCL runs on its own stream.

    python benchmarks/inner_overlap.py                       # --model medium, R = 2
    python benchmarks/inner_overlap.py --model large --ranks 2 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import loco
from loco.algorithms.buckets import GradientBuckets
from loco.algorithms.sharding import flatten_fp32, unflatten_views
from loco.model import Transformer, model_config

WAYS = ("backward alone", "after backward", "buckets during backward")


def bench_worker(ctx, model_name: str, steps: int, batch: int, seq: int) -> dict:
    """Every way's step times on this rank."""
    torch.manual_seed(ctx.rank)
    model = Transformer(model_config(model_name, 4096, seq), torch.Generator().manual_seed(0))
    params = list(model.parameters())
    tokens = torch.randint(4096, (batch, seq + 1))
    times = {}
    for way in WAYS:
        buckets = GradientBuckets(params, ctx.inner) if way == WAYS[2] else None
        seconds = []
        for t in range(steps + 3):
            ctx.inner.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            if way == WAYS[1]:
                flat = flatten_fp32([p.grad for p in params])
                ctx.inner.all_reduce_mean(flat, tag="train").wait()
                torch._foreach_copy_([p.grad for p in params], unflatten_views(flat, params))
            elif way == WAYS[2]:
                buckets.finish()
            if t >= 3:
                seconds.append(time.perf_counter() - t0)
            for p in params:
                p.grad = None
        if buckets is not None:
            buckets.close()
        times[way] = statistics.median(seconds)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="medium")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    out = loco.launch(bench_worker, launcher="processes", mesh=loco.Mesh(1, 1, args.ranks),
                      args=(args.model, args.steps, args.batch_size, args.seq_len))
    slowest = {way: max(o[way] for o in out) for way in WAYS}
    base = slowest[WAYS[0]]
    print(f"--model {args.model}, one worker of {args.ranks} ranks, batch {args.batch_size} x "
          f"{args.seq_len}, median of {args.steps} steps (the slowest rank's)")
    print(f"{'way':<26} {'step':>10} {'/ backward alone':>17}")
    for way in WAYS:
        print(f"{way:<26} {slowest[way] * 1e3:>8.1f}ms {slowest[way] / base:>17.3f}")


if __name__ == "__main__":
    main()
