"""Elastic membership: a worker killed at a third of the run and restarted at two thirds.

M = 4 Streaming DiLoCo workers (FP4 E3M0 pseudo-gradients, the default model on
Shakespeare) as four `loco train --elastic --lighthouse ... --worker-index i` processes
around one torchft Lighthouse, the way workers on four machines would run. Worker 3 is
killed with SIGKILL once worker 0 has logged a third of the steps, and started again (the
same command) at two thirds; it joins from a live worker. The same job also runs
uninterrupted. It prints:

- the survivors' training tokens per second before the kill, while worker 3 is away, and
  after it is back (from worker 0's records: tokens of the live workers per second);
- the seconds from the kill to the survivors' next committed sync;
- the seconds from the restart to the first sync with all four again (the joiner in step);
- the final eval loss of the interrupted run next to the uninterrupted one's.

    .venv/bin/python benchmarks/elastic.py              # ~6 minutes on 2 cores
    .venv/bin/python benchmarks/elastic.py --steps 150  # a quicker look
    .venv/bin/python benchmarks/elastic.py --worker-ranks 2   # workers of 2 ranks

With ``--worker-ranks R`` every worker is a torchrun job of R processes (ddp inside), and
the kill takes the whole job (its process group: every rank of worker 3).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from loco.comm.membership import start_lighthouse


def records(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def last_step(out: str) -> int:
    return max((r["step"] for r in records(out) if "train_loss" in r), default=0)


def start(cmd: list[str], worker: int, log) -> subprocess.Popen:
    return subprocess.Popen([*cmd, "--worker-index", str(worker)], stdout=log, stderr=log,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)  # its own group: kill every rank


def wait_for_step(out: str, step: int, jobs: list) -> float:
    while last_step(out) < step:
        if all(j.poll() is not None for j in jobs):
            raise RuntimeError(f"the workers ended before step {step}; see the logs")
        time.sleep(0.1)
    return time.time()


def interrupted(cmd: list[str], out: str, steps: int, workers: int, min_workers: int) -> dict:
    lighthouse = start_lighthouse(min_workers, join_timeout=300.0)
    cmd = [*cmd, "--out", out, "--lighthouse", lighthouse.address()]
    with open(os.path.join(os.path.dirname(out), "interrupted.log"), "w") as log:
        try:
            jobs = [start(cmd, w, log) for w in range(workers)]
            killed_at = wait_for_step(out, steps // 3, jobs)
            os.killpg(jobs[-1].pid, signal.SIGKILL)
            restarted_at = wait_for_step(out, 2 * steps // 3, jobs)
            jobs[-1] = start(cmd, workers - 1, log)
            codes = [j.wait() for j in jobs]
        finally:
            lighthouse.shutdown()
    if codes != [0] * workers:
        raise RuntimeError(f"exit codes {codes}; see {log.name}")
    return {"killed_at": killed_at, "restarted_at": restarted_at}


def rate(recs: list[dict], lo: float, hi: float) -> float:
    """Tokens per second over worker 0's step records with lo <= unix time < hi."""
    inside = [r for r in recs if "train_loss" in r and lo <= r["unix"] < hi]
    if len(inside) < 2:
        return float("nan")
    return (inside[-1]["tokens"] - inside[0]["tokens"]) / (inside[-1]["unix"] - inside[0]["unix"])


def report(out: str, times: dict, workers: int) -> dict:
    recs = records(out)
    summary = json.load(open(os.path.join(out, "summary.json")))
    syncs = [r for r in recs if r.get("event") == "elastic_sync"]
    # worker 0's step records carry "elapsed" since its start; its first membership record
    # gives the offset to the wall clock
    first = next(r for r in recs if r.get("event") == "membership")
    offset = first["unix_time"] - first["time"]
    for r in recs:
        if "elapsed" in r:
            r["unix"] = offset + r["elapsed"]
    kill, back = times["killed_at"], times["restarted_at"]
    next_sync = next(s["unix_time"] for s in syncs if s["unix_time"] > kill)
    full = next((s["unix_time"] for s in syncs
                 if s["unix_time"] > back and len(s["participants"]) == workers), None)
    return {"before": rate(recs, 0, kill), "away": rate(recs, kill, back),
            "after": rate(recs, full or back, float("inf")), "to_next_sync": next_sync - kill,
            "to_in_step": None if full is None else full - back,
            "final_eval_loss": summary["final_eval_loss"], "elastic": summary["elastic"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=60, help="H (P = 2 fragments)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--min-workers", type=int, default=2)
    p.add_argument("--worker-ranks", type=int, default=1,
                   help="R ranks per worker: each worker a torchrun job of R processes")
    args = p.parse_args()
    base = ["train", "--workers", str(args.workers), "--steps", str(args.steps),
            "--sync-every", str(args.sync_every), "--fragments", "2", "--codec", "fp4_e3m0",
            "--elastic", "--min-workers", str(args.min_workers), "--checkpoint-every", "0",
            "--eval-every", "0", "--log-every", "10", "--no-progress",
            "--worker-ranks", str(args.worker_ranks)]
    loco = [sys.executable, "-m", "loco"]
    worker = loco if args.worker_ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(args.worker_ranks), "--max-restarts", "0", "-m", "loco"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*loco, *base, "--launcher", "processes", "--out", f"{tmp}/whole"],
                       check=True, capture_output=True)
        whole = json.load(open(f"{tmp}/whole/summary.json"))
        times = interrupted([*worker, *base], f"{tmp}/broken", args.steps, args.workers,
                            args.min_workers)
        r = report(f"{tmp}/broken", times, args.workers)
    print(f"Streaming DiLoCo, M = {args.workers} workers of {args.worker_ranks} rank(s), "
          f"{args.steps} steps, H = {args.sync_every}, P = 2, FP4; "
          f"worker {args.workers - 1} killed at step ~{args.steps // 3}, "
          f"restarted at step ~{2 * args.steps // 3}\n")
    print("| | value |\n|---|---|")
    print(f"| tokens/s before the kill | {r['before']:,.0f} |")
    print(f"| tokens/s with {args.workers - 1} workers | {r['away']:,.0f} |")
    print(f"| tokens/s after the rejoin | {r['after']:,.0f} |")
    print(f"| tokens/s, uninterrupted run | {whole['tokens_per_second']:,.0f} |")
    print(f"| kill → survivors' next committed sync | {r['to_next_sync']:.1f} s |")
    print(f"| restart → first sync with all {args.workers} (joiner in step) | "
          + ("never" if r["to_in_step"] is None else f"{r['to_in_step']:.1f} s") + " |")
    print(f"| final eval loss, interrupted | {r['final_eval_loss']:.4f} |")
    print(f"| final eval loss, uninterrupted | {whole['final_eval_loss']:.4f} |")
    print(f"| syncs by participants | {r['elastic']['syncs_by_participants']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
