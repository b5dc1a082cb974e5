"""What ranks as threads cost in CPU, side by side: the same training steps of a small model
one rank after the other in one thread, as a ``threads`` launch on every core, and as one
with ``LOCO_THREADS_ONE_CORE=1`` (all its ranks on one core).

The ranks of a threads launch share one GIL, which torch releases and takes back around
every operation; on several cores each hand-over wakes a thread on another core. Where the
operations take microseconds (the test suite's model, small CPU experiments) that costs
more than running them side by side gains. CPU is this process's (user + system), wall the
elapsed time; each intra-op pool has one thread (``LOCO_CPU_THREADS=1``).

    python benchmarks/thread_ranks.py                  # 4 ranks x 96 steps, tiny model, ~30 s
    python benchmarks/thread_ranks.py --ranks 2 --steps 48 --dim 512
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import loco
from loco.model import Transformer, model_config

VOCAB, SEQ, BATCH = 64, 16, 4


def train(rank: int, steps: int, dim: int) -> None:
    """``steps`` AdamW steps of a 4-layer model of width ``dim`` on random tokens."""
    model = Transformer(model_config("tiny", VOCAB, SEQ, n_layers=4, d_model=dim),
                        torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def measured(fn) -> tuple[float, float]:
    """(CPU seconds of this process, every thread, wall seconds) that ``fn()`` took."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks (threads) per launch")
    p.add_argument("--steps", type=int, default=96, help="training steps per rank")
    p.add_argument("--dim", type=int, default=32, help="the model's width (32: the tests' model)")
    a = p.parse_args()
    os.environ["LOCO_CPU_THREADS"] = "1"
    torch.set_num_threads(1)
    train(0, 2, a.dim)  # warm up
    runs = {"one thread, rank after rank": lambda: [train(r, a.steps, a.dim)
                                                  for r in range(a.ranks)]}
    for label, pin in (("threads launch, any core", "0"), ("threads launch, one core", "1")):
        def launch(pin=pin):
            os.environ["LOCO_THREADS_ONE_CORE"] = pin
            loco.launch(lambda ctx: train(ctx.rank, a.steps, a.dim), a.ranks)
        runs[label] = launch
    print(f"{a.ranks} ranks x {a.steps} steps, width {a.dim}, {os.cpu_count()} cores")
    base = None
    for label, fn in runs.items():
        cpu, wall = measured(fn)
        base = base or cpu
        print(f"  {label:30s} CPU {cpu:6.2f} s ({cpu / base:4.2f}x)  wall {wall:6.2f} s")


if __name__ == "__main__":
    main()
