"""DataParallel, DiLoCo and Streaming DiLoCo on the same job under the same emulated slow link.

Every worker gets a link of ``--bandwidth`` and ``--latency`` (``loco train --link-bandwidth
--link-latency``, see ``loco.comm.link``): each operation completes no earlier than latency +
bytes x 8 / bandwidth after it starts, transfers queue, and compute goes on meanwhile. The
script prints, side by side, the final eval loss, the bytes sent per worker, the wall time of
the training loop, the time the slowest worker was blocked on communication and the compute
utilization (time computing / training-loop time), first without a link and then with it.

    python benchmarks/link.py                               # 100 Mbit/s, 50 ms, small model
    python benchmarks/link.py --steps 20 --model tiny       # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from loco.config import TrainConfig
from loco.training import run_training

#: name -> TrainConfig overrides.
RUNS = {
    "DataParallel": dict(algorithm="ddp"),
    "DiLoCo": dict(algorithm="diloco"),
    "Streaming DiLoCo (FP4, tau = 1)": dict(algorithm="streaming", codec="fp4_e3m0", overlap=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="100Mbit", help="emulated link rate per worker")
    ap.add_argument("--latency", default="50ms",
                    help="emulated latency, per dependent phase of an operation")
    ap.add_argument("--steps", type=int, default=200, help="inner steps per worker per run")
    ap.add_argument("--workers", type=int, default=4, help="workers M")
    ap.add_argument("--sync-every", type=int, default=50, help="H (DiLoCo, Streaming DiLoCo)")
    ap.add_argument("--model", default="small", help="model size")
    ap.add_argument("--eval-batches", type=int, default=20, help="batches in the final eval")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs without a link")
    args = ap.parse_args()

    links = ([] if args.no_baseline else [(None, None)]) + [(args.bandwidth, args.latency)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bandwidth, latency in links:
            for name, overrides in RUNS.items():
                label = "no link" if bandwidth is None else f"{bandwidth}, {latency}"
                print(f"running {name} ({label}) ...", flush=True)
                cfg = TrainConfig(steps=args.steps, workers=args.workers,
                                  sync_every=args.sync_every, model=args.model, eval_every=0,
                                  final_eval_batches=args.eval_batches, progress=False,
                                  link_bandwidth=bandwidth, link_latency=latency,
                                  out=f"{tmp}/{len(rows)}", **overrides)
                rows.append((label, name, run_training(cfg)))

    print(f"\nmodel {args.model}, {args.workers} workers, {args.steps} steps, H = "
          f"{args.sync_every}, batch 8 x 128 per worker")
    print(f"{'link':>16} {'method':34} {'eval loss':>9} {'sent/worker':>14} {'train s':>8} "
          f"{'blocked s':>9} {'compute util.':>13}")
    for label, name, s in rows:
        print(f"{label:>16} {name:34} {s['final_eval_loss']:9.4f} "
              f"{s['bytes_sent_per_rank']:14,} {s['train_seconds']:8.1f} "
              f"{s['comm_wait_seconds']:9.1f} {s['compute_utilization']:13.1%}")


if __name__ == "__main__":
    main()
