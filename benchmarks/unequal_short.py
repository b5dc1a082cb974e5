"""Speed-aware and asynchronous steps on a short run, against the equal-speed twin.

The short run of docs/unequal.md, where the first round is a third of the run: 2 workers
at speeds 1 and 0.33 (``--worker-speed``), 60 steps, H = 20, the ``tiny`` model, with
speed-aware local steps (``--local-steps proportional``) and with asynchronous outer steps
(``--max-staleness 2`` on top), each run back to back with its twin of equal speed (the
same run without ``--worker-speed`` and ``--local-steps``), so that both meet the same load
on the machine. It prints every pair's goodputs and their ratio, then per kind the median
of the ratios and their range: the figure docs/unequal.md tabulates, whose target is 0.95.

    .venv/bin/python benchmarks/unequal_short.py              # 8 pairs each, ~3 minutes
    .venv/bin/python benchmarks/unequal_short.py --pairs 3    # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = ["--algorithm", "diloco", "--model", "tiny", "--workers", "2", "--steps", "60",
       "--batch-size", "4", "--seq-len", "128", "--sync-every", "20", "--warmup", "20",
       "--eval-every", "0", "--outer-lr", "1", "--outer-momentum", "0", "--no-progress"]
"""The short run both twins share."""
KINDS = {"speed-aware": ["--worker-speed", "1,0.33", "--local-steps", "proportional"],
         "asynchronous": ["--worker-speed", "1,0.33", "--local-steps", "proportional",
                          "--max-staleness", "2"]}
"""Each kind's options on top of ``RUN`` (its twin has none)."""


def goodput(extra: list[str], seed: int, root: str) -> float:
    """One run's total goodput (``loco train`` in a process of its own)."""
    out = tempfile.mkdtemp(dir=root)
    subprocess.run([sys.executable, "-m", "loco", "train", *RUN, "--seed", str(seed),
                    "--out", out, *extra], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["goodput"]["total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="pairs per kind (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for kind, extra in KINDS.items():
            ratios = []
            for seed in range(args.pairs):
                unequal, equal = goodput(extra, seed, root), goodput([], seed, root)
                ratios.append(unequal / equal)
                print(f"{kind} seed {seed}: goodput {unequal:.3f}, equal twin {equal:.3f}, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
            print(f"{kind}: median ratio {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f} to {max(ratios):.3f}, {len(ratios)} pairs)", flush=True)


if __name__ == "__main__":
    main()
