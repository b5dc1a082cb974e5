"""Side-by-side: what DiLoCo's communication costs in throughput, and what it saves in bytes.

Runs Local, DiLoCo and DataParallel on the same job (same model, data, seed, workers, steps)
and prints tokens/s and bytes sent per worker with the ratios the issue targets:

* tokens/s of DiLoCo over Local (target >= 0.97: syncing every H steps is nearly free);
* bytes of DataParallel over DiLoCo (= H: one model-sized reduction per step vs per H steps).

    python benchmarks/throughput.py                  # the default job's settings, 120 steps
    python benchmarks/throughput.py --steps 400 --workers 2 --model tiny
"""

from __future__ import annotations

import argparse
import os
import tempfile

from loco.config import TrainConfig
from loco.training import run_training


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="inner steps per worker per run")
    ap.add_argument("--workers", type=int, default=4, help="workers M")
    ap.add_argument("--sync-every", type=int, default=30, help="H for DiLoCo")
    ap.add_argument("--model", default="small", help="model size")
    ap.add_argument("--launcher", default="threads", help="threads or processes")
    ap.add_argument("--repeats", type=int, default=1, help="runs per method (best tokens/s kept)")
    args = ap.parse_args()

    base = TrainConfig(steps=args.steps, workers=args.workers, sync_every=args.sync_every,
                       model=args.model, launcher=args.launcher, eval_every=0,
                       final_eval_batches=1, progress=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for algo in ("local", "diloco", "ddp"):  # interleaved, so drift hits all alike
                cfg = base.replace(algorithm=algo, out=os.path.join(tmp, f"{algo}{rep}"))
                s = run_training(cfg)
                best = results.get(algo)
                if best is None or s["tokens_per_second"] > best["tokens_per_second"]:
                    results[algo] = s
    print(f"\nmodel {args.model}, {args.workers} workers ({args.launcher}), {args.steps} steps, "
          f"H = {args.sync_every}, batch {base.data.batch_size} x {base.data.seq_len}")
    print(f"{'method':8} {'tokens/s':>10} {'bytes sent/worker':>18} {'syncs':>6} {'comm wait s':>12}")
    for algo, s in results.items():
        print(f"{algo:8} {s['tokens_per_second']:10,.0f} {s['bytes_sent_per_rank']:18,} "
              f"{s['syncs']:6} {s['comm_wait_seconds']:12.2f}")
    tps = results["diloco"]["tokens_per_second"] / results["local"]["tokens_per_second"]
    ratio = results["ddp"]["bytes_sent_per_rank"] / results["diloco"]["bytes_sent_per_rank"]
    print(f"\ntokens/s DiLoCo / Local: {tps:.3f}   (target >= 0.97)")
    print(f"bytes DataParallel / DiLoCo: {ratio:.2f}   (expected H = {args.sync_every})")


if __name__ == "__main__":
    main()
