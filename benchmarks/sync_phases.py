"""Where a sync's time goes, phase by phase and thread by thread, on the overhead job.

Runs the job of ``benchmarks/overhead.py`` (two workers as threads, 2.1M parameters, one
intra-op thread each) under ``torch.profiler`` with every thread recorded, and prints, per
method, the milliseconds per sync of each ``loco/...`` range (docs/profiling.md), the thread
it ran on (training or communication), and the time of one inner step for scale. Times are
wall time inside the range, so a collective's range also holds the wait for the slower peer.

    python benchmarks/sync_phases.py                      # all methods, H = 10
    python benchmarks/sync_phases.py --only diloco --steps 100
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

import loco

sys.path.insert(0, os.path.dirname(__file__))
from overhead import KERNELS, METHODS, Net  # noqa: E402  (the same job)

from loco.comm.codecs.fused import KERNEL_ENV  # noqa: E402

SYNC_RANGES = ("loco/pseudo_gradient", "loco/all_reduce", "loco/encode", "loco/all_to_all",
               "loco/reduce", "loco/all_gather", "loco/decode", "loco/exchange", "loco/wait",
               "loco/outer_step", "loco/merge")


def worker(ctx, method: str, sync_every: int, steps: int, warmup: int):
    """Train; profile ``steps`` steps after ``warmup`` on rank 0 (every thread of the
    process, so both workers' threads are in it). Returns the profile's events on rank 0."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    model = Net(4, torch.Generator().manual_seed(0))
    algo = METHODS[method](model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx.comm,
                           sync_every)
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    prof = None
    for i in range(warmup + steps):
        if i == warmup and ctx.rank == 0:
            prof = profile(activities=[ProfilerActivity.CPU],
                           experimental_config=_ExperimentalConfig(profile_all_threads=True))
            prof.start()
        nn.functional.mse_loss(model(x), y).backward()
        algo.step()
        algo.zero_grad()
    algo.flush()
    if prof is None:
        return None
    prof.stop()
    return [(e.name, e.thread, e.cpu_time_total / 1e3) for e in prof.events()
            if e.name.startswith("loco/") or e.name.startswith("Optimizer.step#AdamW")]


def table(method: str, events, steps: int, sync_every: int, workers: int) -> None:
    syncs = steps // sync_every * workers  # over both workers' threads
    threads = {thread for name, thread, _ in events if name == "loco/inner_step"}
    per = collections.defaultdict(float)
    for name, thread, ms in events:
        if name in SYNC_RANGES:
            per[name, "training" if thread in threads else "comm"] += ms
    inner = sum(ms for name, _, ms in events if name == "loco/inner_step") / (steps * workers)
    print(f"\n{method}: ms per sync (per worker), {syncs // workers} syncs each; one inner "
          f"step's optimizer + check: {inner:.2f} ms")
    print("| phase | thread | ms per sync |\n|---|---|---|")
    for (name, where), ms in sorted(per.items(), key=lambda kv: SYNC_RANGES.index(kv[0][0])):
        print(f"| {name} | {where} | {ms / syncs:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="profiled steps")
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--only", default=",".join(METHODS), help="methods, comma-separated")
    args = ap.parse_args()
    default = os.environ.get(KERNEL_ENV) or "auto"
    for method in args.only.split(","):
        os.environ[KERNEL_ENV] = KERNELS.get(method, default)  # as overhead.py runs it
        out = loco.launch(worker, 2, launcher="threads",
                          args=(method, args.sync_every, args.steps, 20))
        table(method, out[0], args.steps, args.sync_every, 2)


if __name__ == "__main__":
    main()
