"""What the guard costs one sync: the time of an average of a pseudo-gradient of N values
among M workers (threads of this process, gloo) with each ``--aggregation``, side by side
with the plain mean, and its bytes.

The plain mean of fp32 values is the transport's own all-reduce; the guard's goes through
loco's reduce-scatter (every chunk's reducer sees every worker's rows, judges them, then the
all-gather), with the same bytes counted (a ring all-reduce's 2 (M - 1) / M of the tensor);
with a codec both take the reduce-scatter, and the guard adds the rows' norms and digests.
With a job key every row also carries a 32-byte tag (with ``--encrypt``, AES-GCM's nonce and
tag in the same 32 bytes, the row itself encrypted). Median of ``--repeats`` timed averages
after one untimed one, the slowest worker's time.

    python benchmarks/guard_cost.py                   # 4 workers, 4M values: about a minute
    python benchmarks/guard_cost.py --values 16777216 --codecs fp4_e3m0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import loco
from loco.comm.auth import JobKey
from loco.comm.codecs import get_codec
from loco.comm.guard import Guard, Shield


def average(ctx, n: int, codec: str, aggregation: str, key: str, repeats: int,
            rank_order: bool = False) -> dict:
    """Time ``repeats`` averages of ``n`` values (after one untimed); ``rank_order``: the
    plain mean through loco's reduce-scatter (the guard's transport, without the guard);
    ``key``: "no", "mac" (a job key's MACs) or "encrypted" (``--encrypt``: AES-GCM)."""
    torch.set_num_threads(1)
    ctx.comm.rank_order = rank_order
    ctx.comm.shield = Shield(Guard(aggregation, 4.0, ctx.comm.size), None, lambda: 1)
    ctx.comm.job_key = None if key == "no" else JobKey(b"k" * 32, encrypt=key == "encrypted")
    x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank))
    wire = None if codec == "fp32" else get_codec(codec)
    times, sent = [], 0
    for i in range(repeats + 1):
        y = x.clone()
        ctx.comm.barrier()
        t = time.perf_counter()
        handle = ctx.comm.all_reduce_mean(y, tag="train", codec=wire)
        handle.wait()
        if i:
            times.append(time.perf_counter() - t)
            sent = handle.record.sent_bytes
    return {"seconds": statistics.median(times), "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--values", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codecs", default="fp32,fp4_e3m0")
    args = parser.parse_args()
    print(f"{args.workers} workers (threads, gloo), {args.values:,} values, median of "
          f"{args.repeats}; ms of the slowest worker, ratio to the plain mean\n")
    print("| codec | aggregation | job key | ms | vs mean | bytes sent |")
    print("|---|---|---|---|---|---|")
    for codec in args.codecs.split(","):
        base = None
        for aggregation, key, order in (
                ("mean", "no", False), ("mean", "no", True), ("drop", "no", False),
                ("clip", "no", False), ("trimmed", "no", False), ("median", "no", False),
                ("drop", "mac", False), ("drop", "encrypted", False)):
            if order and codec != "fp32":  # (a codec's mean takes the reduce-scatter anyway)
                continue
            out = loco.launch(average, args.workers, args=(
                args.values, codec, aggregation, key, args.repeats, order))
            ms = max(o["seconds"] for o in out) * 1e3
            base = base or ms
            name = "mean, reduce-scatter" if order else aggregation
            print(f"| {codec} | {name} | {key} | {ms:.1f} | "
                  f"{ms / base:.2f} | {out[0]['sent']:,} |")


if __name__ == "__main__":
    main()
