"""Soak test: does a long Streaming DiLoCo run hold its memory?

16 workers as threads of one process, the tiny model, 200 outer rounds of Streaming DiLoCo
(H inner steps each, P fragments synced on the staggered schedule, FP4 on the wire, τ = 1).
The process's resident memory (RSS, from /proc) is sampled after every round. It prints RSS
at start, after warm-up and at the end, and the growth after warm-up in % and in MB per 100
rounds. Target: at most 5% growth after warm-up. Exit code 1 when the target is missed.

    .venv/bin/python benchmarks/soak.py                  # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/soak.py --rounds 50 --workers 4   # a quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from loco import StreamingDiLoCo, launch
from loco.model import Transformer, model_config


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def worker(ctx, args, samples: list):
    torch.set_flush_denormal(True)
    cfg = model_config("tiny", args.vocab, args.seq_len)
    model = Transformer(cfg, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algo = StreamingDiLoCo(model, opt, ctx.comm, sync_every=args.sync_every,
                           fragments=args.fragments, overlap=1, alpha=0.5, codec="fp4_e3m0",
                           max_grad_norm=1.0)
    data = torch.Generator().manual_seed(ctx.rank)
    for round_ in range(args.rounds):
        for _ in range(args.sync_every):
            x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=data)
            model(x[:, :-1], x[:, 1:]).backward()
            algo.step()
            algo.zero_grad()
        if ctx.rank == 0:
            samples.append((round_ + 1, time.perf_counter(), rss_mb()))
    algo.flush()
    return ctx.comm.totals("train").sent_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=200, help="outer rounds of H inner steps")
    p.add_argument("--sync-every", type=int, default=4, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--warmup", type=int, default=20, help="rounds before the baseline RSS")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--target", type=float, default=5.0, help="max growth after warm-up, %%")
    args = p.parse_args()
    if args.warmup >= args.rounds:
        p.error(f"--warmup must be below --rounds ({args.rounds})")

    start = rss_mb()
    samples: list = []
    t0 = time.perf_counter()
    sent = launch(worker, args.workers, launcher="threads", args=(args, samples))
    wall = time.perf_counter() - t0
    base = samples[args.warmup - 1][2]
    end = samples[-1][2]
    peak = max(s[2] for s in samples)
    growth = 100 * (end - base) / base
    rate = (end - base) / (len(samples) - args.warmup) * 100
    print(f"{args.workers} workers (threads), tiny model, {args.rounds} rounds of H = "
          f"{args.sync_every} (P = {args.fragments}, FP4, tau = 1): {wall:.0f} s, "
          f"{sent[0]:,} bytes sent per worker")
    print("| RSS before launch | after round 1 | after warm-up (round "
          f"{args.warmup}) | end | peak | growth after warm-up | rate |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {start:.0f} MB | {samples[0][2]:.0f} MB | {base:.0f} MB | {end:.0f} MB | "
          f"{peak:.0f} MB | {growth:+.2f}% | {rate:+.2f} MB / 100 rounds |")
    ok = growth <= args.target
    print(f"target: growth after warm-up <= {args.target:g}%: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
