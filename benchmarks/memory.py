"""Peak memory over the training state, per method, at a large model.

Runs ``loco train`` once per method and option, with two workers as processes (each its
own resident memory), and prints from each run's ``summary.json`` the state a rank must
hold (model, gradients, inner optimizer, outer state, sync buffers and spare copies, the
Comms' kept buffers and the checkpoint's staging: ``memory_bytes_per_rank``), its peak
resident memory and their ratio (``memory_peak_over_state``; on a GPU, the device's peak
allocated memory). The target (docs/memory.md): at most 1.15. ``checkpoint`` is the
training thread's time per checkpoint (``checkpoint_seconds``), written in place on a CPU.

    python benchmarks/memory.py                          # --model 300m, 2 workers, all rows
    python benchmarks/memory.py --model small --steps 8  # a quick look
    python benchmarks/memory.py --methods noloco demo    # some rows (by their first word)
    python benchmarks/memory.py --phases                 # where one worker's memory goes

``--phases`` trains one worker in this process instead and prints, for each phase of a
step and a sync, the resident memory after it and its peak inside it (the kernel's
high-water mark, reset before each phase through ``/proc/self/clear_refs``: Linux only).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

H = ["--sync-every", "2"]
METHODS = {
    "diloco": ["--algorithm", "diloco", *H],
    "streaming (FP4)": ["--algorithm", "streaming", "--fragments", "2", "--overlap", "0", *H],
    "streaming (fp32)": ["--algorithm", "streaming", "--fragments", "2", "--overlap", "0",
                         "--codec", "fp32", *H],
    "ddp": ["--algorithm", "ddp"],
    "sparseloco": ["--algorithm", "sparseloco", *H],
    "demo": ["--algorithm", "demo"],
    "sparta": ["--algorithm", "sparta"],
    "noloco": ["--algorithm", "noloco", *H],
    "error_feedback (FP4)": ["--algorithm", "streaming", "--fragments", "2", "--overlap", "0",
                             "--error-feedback", "0.9", *H],
    "eager": ["--algorithm", "diloco", "--eager", *H],
    # the others' share is kept per fragment, Δ and θ̃ for one: at P = 4 two workers fit
    "eager (streaming)": ["--algorithm", "streaming", "--fragments", "4", "--overlap", "1",
                          "--eager", "--sync-every", "8"],
    "asynchronous": ["--algorithm", "diloco", "--local-steps", "proportional",
                     "--max-staleness", "2", "--worker-speed", "1,0.5", *H],
    "muon": ["--algorithm", "diloco", "--inner-optimizer", "muon", *H],
}


def common(args) -> list[str]:
    """The job every method runs: short, one sequence per step, no periodic evaluation."""
    return ["--model", args.model, "--steps", str(args.steps), "--batch-size", "1",
            "--seq-len", "64", "--eval-every", "0", "--final-eval-batches", "1",
            "--no-progress"]


def run_method(name: str, extra: list[str], args, root: str) -> dict:
    """One method's run; its summary's memory fields."""
    out = os.path.join(root, name.replace(" ", "_").replace("(", "").replace(")", ""))
    cmd = [sys.executable, "-m", "loco", "train", *extra, *common(args), "--workers",
           str(args.workers), "--launcher", "processes", "--out", out]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:  # e.g. killed for memory: the row says so, the others go on
        shutil.rmtree(out, ignore_errors=True)
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        why = next((line for line in reversed(lines) if "failed" in line or "Error" in line),
                   lines[-1])
        print(f"{name} failed: {why[:300]}", flush=True)
        return None
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    shutil.rmtree(out, ignore_errors=True)  # its checkpoints: 6 GB a rank at 300m
    return {"memory": s["memory_bytes_per_rank"], "peak": s["memory_peak_over_state"],
            "seconds": time.perf_counter() - t0,
            "checkpoint": s["checkpoint_seconds"] / max(1, s["checkpoints"])}


def compare(args) -> None:
    print(f"--model {args.model}, {args.workers} workers as processes, {args.steps} steps "
          "(GB = 1e9 bytes)")
    print(f"{'method':22s} {'model':>6s} {'grads':>6s} {'inner':>6s} {'outer':>6s} "
          f"{'comm':>6s} {'state':>6s} {'peak':>6s} {'peak/state':>10s} {'checkpoint':>10s} "
          f"{'time':>6s}")
    with tempfile.TemporaryDirectory() as root:
        for name, extra in METHODS.items():
            if args.methods and name.split()[0] not in args.methods:
                continue
            r = run_method(name, extra, args, root)
            if r is None:
                continue
            m, p = r["memory"], r["peak"]
            print(f"{name:22s} {m['model'] / 1e9:6.2f} {m['gradients'] / 1e9:6.2f} "
                  f"{m['inner_optimizer'] / 1e9:6.2f} {m['outer'] / 1e9:6.2f} "
                  f"{(m['comm'] + m['staging']) / 1e9:6.2f} "
                  f"{p['state_bytes'] / 1e9:6.2f} {p['peak_bytes'] / 1e9:6.2f} "
                  f"{p['ratio']:10.2f} {r['checkpoint']:9.1f}s {r['seconds']:5.0f}s",
                  flush=True)


def _resident() -> tuple[int, int]:
    """(now, peak since the last reset) resident bytes of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def phases(args) -> None:
    """One worker in this process, each phase wrapped to record its memory."""
    import loco.algorithms.streaming_diloco as streaming
    from loco.algorithms import base
    from loco.cli import main
    from loco.training import build, checkpoints, evaluation

    rows: dict = collections.OrderedDict()

    def wrap(owner, attr: str, label: str) -> None:
        f = getattr(owner, attr)

        @functools.wraps(f)
        def measured(*a, **k):
            _reset_peak()
            try:
                return f(*a, **k)
            finally:
                now, peak = _resident()
                row = rows.setdefault(label, {"peak": 0, "after": 0, "calls": 0})
                row["peak"], row["after"] = max(row["peak"], peak), now
                row["calls"] += 1
                _reset_peak()
        setattr(owner, attr, measured)

    wrap(build, "build_model", "build the model")
    wrap(base.Algorithm, "__init__", "build the algorithm")
    wrap(base.Algorithm, "inner_update", "inner step (clip, AdamW)")
    wrap(streaming.StreamingDiLoCo, "_issue", "pseudo-gradient, send")
    wrap(streaming.StreamingDiLoCo, "_apply", "wait, outer step, merge")
    wrap(checkpoints, "_checkpoint", "checkpoint")
    wrap(evaluation, "final_evaluation", "final evaluation")
    import torch

    wrap(torch.Tensor, "backward", "forward, backward")
    with tempfile.TemporaryDirectory() as root:
        argv = ["train", *METHODS["streaming (FP4)"], *common(args), "--workers", "1",
                "--launcher", "threads", "--out", os.path.join(root, "run")]
        main(argv)
        with open(os.path.join(root, "run", "summary.json")) as f:
            summary = json.load(f)
    peak = summary["memory_peak_over_state"]
    print(f"\nStreaming DiLoCo, --model {args.model}, one worker; state "
          f"{peak['state_bytes'] / 1e9:.2f} GB ({summary['memory_bytes_per_rank']})")
    print(f"{'phase':28s} {'peak GB':>8s} {'after GB':>9s} {'calls':>6s}")
    for label, row in rows.items():
        print(f"{label:28s} {row['peak'] / 1e9:8.2f} {row['after'] / 1e9:9.2f} "
              f"{row['calls']:6d}")
    print(f"the run's peak: {peak['peak_bytes'] / 1e9:.2f} GB = {peak['ratio']:.2f} x the state "
          "(the phases' resets of the high-water mark make it the last phase's)")
    print(f"checkpoints: {summary['checkpoints']}, the training thread's time on them "
          f"{summary['checkpoint_seconds']:.1f} s; training {summary['train_seconds']:.1f} s")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="300m", help="the model (default 300m)")
    p.add_argument("--steps", type=int, default=6, help="inner steps (default 6: 3 rounds)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--methods", nargs="*",
                   choices=sorted({name.split()[0] for name in METHODS}),
                   help="only these rows, by their first word (default: all)")
    p.add_argument("--phases", action="store_true",
                   help="where one worker's memory goes, phase by phase (Linux)")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse()
    (phases if arguments.phases else compare)(arguments)
