"""Side-by-side: DiLoCo (an all-reduce every H steps) against NoLoCo (pairwise gossip, no
collective) on the same job, for several worker counts.

Prints each run's final eval loss: for NoLoCo, both the mean of the replicas' losses and the
loss of their average. It also prints bytes sent per worker and the ratio NoLoCo / DiLoCo
(target: within 3%), and plots the replicas' spread over training to ``--plot``.

    python benchmarks/noloco.py                        # the default job's model, M = 4 and 8
    python benchmarks/noloco.py --steps 40 --sync-every 20 --model tiny --workers 4
    python benchmarks/noloco.py --workers 4 --routing-stages 2   # adds NoLoCo over 2 stages
                                                                  # with random routing
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from loco.config import TrainConfig
from loco.training import run_training


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="inner steps per worker per run")
    ap.add_argument("--workers", default="4,8", help="comma-separated worker counts M")
    ap.add_argument("--sync-every", type=int, default=50, help="H for both methods")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step "
                    "(the token budget grows with M, the same for both methods)")
    ap.add_argument("--model", default="small", help="model size")
    ap.add_argument("--eval-batches", type=int, default=100, help="batches in the final eval")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="write a PNG of the spread curves to PATH (default: no file)")
    ap.add_argument("--routing-stages", type=int, default=1, help="if > 1, also run NoLoCo "
                    "with this many pipeline stages per replica and random routing")
    args = ap.parse_args()

    rows, spreads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in (int(w) for w in args.workers.split(",")):
            base = TrainConfig(steps=args.steps, workers=m, sync_every=args.sync_every,
                               batch_size=args.batch_size, model=args.model, eval_every=0,
                               final_eval_batches=args.eval_batches, progress=False,
                               spread_every=10)
            runs = [("diloco", {}), ("noloco", {})]
            if args.routing_stages > 1:
                runs.append(("noloco+routing", dict(stages=args.routing_stages,
                                                    routing="random")))
            for name, extra in runs:
                out = os.path.join(tmp, f"{name}{m}")
                print(f"running {name} with {m} workers ...", flush=True)
                s = run_training(base.replace(algorithm=name.split("+")[0],
                                                     out=out, **extra))
                rows.append((m, name, s))
                if name.startswith("noloco"):
                    with open(os.path.join(out, "metrics.jsonl")) as f:
                        records = [json.loads(line) for line in f]
                    label = f"NoLoCo, M = {m}" + (f", {s['stages']} stages, random routing"
                                                  if s["stages"] > 1 else "")
                    spreads[label] = [(r["step"], r["spread"]) for r in records
                                      if "spread" in r]

    print(f"\nmodel {args.model}, {args.steps} steps, H = {args.sync_every}, batch "
          f"{args.batch_size} x 128 per worker")
    print(f"{'M':>3} {'method':14} {'eval loss':>10} {'replicas mean':>14} {'average':>8} "
          f"{'vs DiLoCo':>10} {'bytes sent/worker':>18} {'collectives':>12}")
    diloco = {}
    for m, algo, s in rows:
        r = s.get("replicas") or {}
        loss = r.get("mean_eval_loss", s["final_eval_loss"])
        if algo == "diloco":
            diloco[m] = loss
        collectives = "all-reduce" if algo == "diloco" else "none"
        print(f"{m:3} {algo:14} {s['final_eval_loss']:10.4f} "
              f"{r.get('mean_eval_loss', float('nan')):14.4f} "
              f"{r.get('average_eval_loss', float('nan')):8.4f} {loss / diloco[m]:10.3f} "
              f"{s['bytes_sent_per_rank']:18,} {collectives:>12}")
    for m, algo, s in rows:
        if algo.startswith("noloco"):
            ratio = s["replicas"]["mean_eval_loss"] / diloco[m]
            print(f"M = {m}: {algo} (mean of replicas) / DiLoCo eval loss = {ratio:.3f}  "
                  f"{'PASS' if ratio <= 1.03 else 'MISS'} (target <= 1.03)")
    if not args.plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in spreads.items():
        ax.plot(*zip(*points), label=label)
    ax.set_xlabel("inner step")
    ax.set_ylabel("RMS distance of replicas to their mean")
    ax.set_title("replica spread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
