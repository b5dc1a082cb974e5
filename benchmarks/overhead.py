"""What an algorithm's communication costs the training loop, against no communication at all.

The job (issue 19's): M workers as threads of this process, each a stack of ``--blocks``
blocks of Linear(256 -> 1024), GELU, Linear(1024 -> 256) (4 blocks: 2.1M parameters), AdamW,
a batch of 64 random vectors per step, mean-squared error against a fixed random target.
Every worker uses one intra-op thread. For each method and H the loop runs ``--steps`` steps
after H + 5 untimed ones (so one-time costs of the first sync are not counted)
and its steps/s is divided by that of the same loop with the plain optimizer and no algorithm
(``none``) run just before and just after it (their mean: the machine's speed drifts between
runs); the median over ``--repeats`` is printed. A second table measures inside each run
(``within_run``): the slowest worker's step count times its median step over its actual time,
over the same for the plain runs, which is free of that drift but misses a cost spread
evenly over all steps (the per-step gradient check, for one: measure such costs alone).

Methods: DiLoCo (fp32), Streaming DiLoCo (P = 2, tau = 1, alpha = 0.5) with fp32 and with FP4
E3M0 pseudo-gradients (eager, the default at this size, and ``streaming-fp4-fused`` with the fused
kernels forced), and NoLoCo (groups of 2); on request (``--only``) DataParallel, as
``ddp`` (its DDP path: buckets reduced during the backward pass) and ``ddp-explicit`` (one
reduction after the backward pass). The issue's targets: at least 0.95 at
H = 10 and 0.98 at H = 50, fp32 and FP4 alike.

    python benchmarks/overhead.py                        # H = 10 and 50, 7 repeats
    python benchmarks/overhead.py --steps 100 --repeats 1 --sync-every 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

import loco
from loco.comm.codecs.fused import KERNEL_ENV

METHODS = {
    "diloco": lambda m, o, c, h: loco.DiLoCo(m, o, c, sync_every=h),
    "streaming-fp32": lambda m, o, c, h: loco.StreamingDiLoCo(
        m, o, c, sync_every=h, fragments=2, overlap=1, alpha=0.5, codec="fp32"),
    "streaming-fp4": lambda m, o, c, h: loco.StreamingDiLoCo(
        m, o, c, sync_every=h, fragments=2, overlap=1, alpha=0.5, codec="fp4_e3m0"),
    "noloco": lambda m, o, c, h: loco.NoLoCo(m, o, c, sync_every=h, group_size=2),
}
# FP4 again with the fused kernels forced: its fragments (1M values) are below the size at
# which the default (auto) compiles them; compiled before the timed steps (Codec.prepare).
METHODS["streaming-fp4-fused"] = METHODS["streaming-fp4"]
KERNELS = {"streaming-fp4-fused": "fused"}
TARGETS = {10: 0.95, 50: 0.98}
# DataParallel, for reference (H does not apply; not run unless named in --only): its DDP path,
# and its explicit path (the loop calls model.forward, so DDP's forward hooks do not run).
BASELINES = {
    "ddp": lambda m, o, c, h: loco.DataParallel(m, o, c),
    "ddp-explicit": lambda m, o, c, h: loco.DataParallel(m, o, c),
}


class Net(nn.Module):
    """``blocks`` MLP blocks of width 256 (hidden 1024) in an ``nn.ModuleList``."""

    def __init__(self, blocks: int, generator: torch.Generator):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
            for _ in range(blocks))
        with torch.no_grad():  # a generator of its own: threads must not share torch's
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def worker(ctx, method: str, sync_every: int, steps: int, blocks: int) -> list[float]:
    """Train ``steps`` steps after H + 5 warm-up steps (one sync and its one-time costs:
    buffers, the outer momentum, the first large transfer); return each timed step's
    seconds."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    model = Net(blocks, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algo = (None if method == "none"
            else {**METHODS, **BASELINES}[method](model, opt, ctx.comm, sync_every))
    forward = model.forward if method == "ddp-explicit" else model
    step_fn = opt.step if algo is None else algo.step
    zero_fn = opt.zero_grad if algo is None else algo.zero_grad
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    marks, warmup = [], sync_every + 5
    for i in range(steps + warmup):
        if i >= warmup - 1:
            marks.append(time.perf_counter())
        nn.functional.mse_loss(forward(x), y).backward()
        step_fn()
        zero_fn()
    if algo is not None:
        algo.flush()
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks[1:], marks[2:])] if len(marks) > 2 else []


def steps_per_second(method: str, sync_every: int, args) -> tuple[float, list[list[float]]]:
    """The slowest worker's steps/s (the job is done when it is), and every worker's step
    times."""
    previous = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = KERNELS.get(method, previous or "auto")
    try:
        times = loco.launch(worker, args.workers, launcher="threads",
                            args=(method, sync_every, args.steps, args.blocks))
    finally:
        if previous is None:
            del os.environ[KERNEL_ENV]
        else:
            os.environ[KERNEL_ENV] = previous
    return args.steps / max(sum(t) for t in times), times


def within_run(times: list[list[float]]) -> float:
    """The slowest worker's steps at its own typical speed over its actual time: its
    step count times its median step, divided by its total. Measured inside one run, so
    free of the drift between runs; it leaves out a cost spread evenly over every step."""
    slowest = max(times, key=sum)
    return len(slowest) * statistics.median(slowest) / sum(slowest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="workers M (threads)")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per run")
    ap.add_argument("--blocks", type=int, default=4, help="MLP blocks (4: 2.1M parameters)")
    ap.add_argument("--repeats", type=int, default=7, help="repeats; the median is shown")
    ap.add_argument("--sync-every", type=int, nargs="+", default=[10, 50], help="H values")
    ap.add_argument("--only", default=",".join(METHODS), help="methods, comma-separated")
    args = ap.parse_args()
    methods = args.only.split(",")
    ratios = {(m, h): [] for m in methods for h in args.sync_every}
    within = {(m, h): [] for m in methods for h in args.sync_every}
    for _ in range(args.repeats):
        for h in args.sync_every:
            # Each method between two runs without communication, its ratio to their mean:
            # this machine's speed drifts by up to 20% between runs seconds apart.
            before, plain = steps_per_second("none", h, args)
            for m in methods:
                rate, times = steps_per_second(m, h, args)
                after, plain_after = steps_per_second("none", h, args)
                ratios[m, h].append(rate / ((before + after) / 2))
                within[m, h].append(within_run(times) / statistics.mean(
                    [within_run(plain), within_run(plain_after)]))
                before, plain = after, plain_after
    print(f"\nsteps/s over the loop without communication, median of {args.repeats}; "
          f"{args.workers} workers as threads, {args.blocks} blocks, {args.steps} steps")
    for title, table in (("between runs (steps/s over the runs without communication "
                          "just before and after)", ratios),
                         ("within a run (typical step over actual time, over the same "
                          "for the runs without communication)", within)):
        print(f"\n{title}\n| method | " + " | ".join(f"H = {h}" for h in args.sync_every)
              + " |\n|---|" + "---|" * len(args.sync_every))
        for m in methods:
            cells = []
            for h in args.sync_every:
                r = statistics.median(table[m, h])
                target = TARGETS.get(h) if m in METHODS else None
                cells.append(f"{r:.3f}" + ("" if target is None else
                                           f" ({'met' if r >= target else 'below'} {target})"))
            print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
