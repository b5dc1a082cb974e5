"""What a scaled codec costs a small job: FP4 against fp32 and against no communication.

The job (issue 42's): 2 workers as threads of this process, each the 2.1M-parameter MLP stack
of ``benchmarks/overhead.py`` (4 blocks of Linear(256 -> 1024), GELU, Linear(1024 -> 256),
AdamW, a batch of 64, one intra-op thread each), trained ``--steps`` steps after H + 5
untimed ones, three ways: the plain optimizer with no communication (``none``), and Streaming
DiLoCo (P = 2 fragments of about 1M values, tau = 1, H = 10, alpha = 0.5) with fp32 and with
FP4 E3M0 pseudo-gradients. Each repeat runs the three one after another (so the machine's
drift between runs falls on all three alike); the table shows each one's median steps/s (the
slowest worker's), the median of the per-repeat ratios FP4/fp32 and each/none, the CPU time
of the whole process per step (both workers' training and communication threads: other jobs
on the machine change it far less than steps/s, but it leaves out waiting), and the seconds
each worker spent building its algorithm (where a codec compiles, if it does; FP4's eager
path loads its C++ kernel there, ``loco.comm.codecs.cpp_kernel``). The target: FP4 at least 0.97
of fp32.

    python benchmarks/small_codecs.py                       # 7 repeats, about 3 minutes
    LOCO_CODEC_KERNEL=eager python benchmarks/small_codecs.py --repeats 3
    LOCO_CPU_KERNEL=0 python benchmarks/small_codecs.py --repeats 3   # eager without C++
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

import loco
from loco.comm.codecs import cpp_kernel

sys.path.insert(0, os.path.dirname(__file__))
from overhead import Net  # noqa: E402  (the same model)

TARGET = 0.97  # FP4's steps/s over fp32's


def build(model, opt, comm, codec: str | None, sync_every: int):
    """The plain optimizer (``codec`` None), or Streaming DiLoCo with ``codec``."""
    if codec is None:
        return None
    return loco.StreamingDiLoCo(model, opt, comm, sync_every=sync_every, fragments=2,
                                overlap=1, alpha=0.5, codec=codec)


def worker(ctx, codec: str | None, sync_every: int, steps: int) -> tuple[float, float, float]:
    """Train ``steps`` timed steps after H + 5 untimed ones; return (seconds to build the
    algorithm, seconds of the timed steps, the in-flight sync flushed, and the process's CPU
    seconds meanwhile)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    model = Net(4, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    algo = build(model, opt, ctx.comm, codec, sync_every)
    setup = time.perf_counter() - t0
    step_fn = opt.step if algo is None else algo.step
    zero_fn = opt.zero_grad if algo is None else algo.zero_grad
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    for i in range(steps + sync_every + 5):
        if i == sync_every + 5:
            start, cpu = time.perf_counter(), time.process_time()
        nn.functional.mse_loss(model(x), y).backward()
        step_fn()
        zero_fn()
    if algo is not None:
        algo.flush()
    return setup, time.perf_counter() - start, time.process_time() - cpu


def run(codec: str | None, args) -> tuple[float, float, float]:
    """(steps/s of the slowest worker, the slowest worker's seconds to build, the process's
    CPU milliseconds per step)."""
    out = loco.launch(worker, 2, launcher="threads",
                      args=(codec, args.sync_every, args.steps))
    return (args.steps / max(t for _, t, _ in out), max(s for s, _, _ in out),
            1e3 * max(c for _, _, c in out) / args.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run")
    ap.add_argument("--repeats", type=int, default=7, help="repeats; medians are shown")
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--codec", default="fp4_e3m0", help="the codec compared with fp32")
    args = ap.parse_args()
    runs = {"none": None, "fp32": "fp32", args.codec: args.codec}
    rate, setup, cpu = ({name: [] for name in runs} for _ in range(3))
    for _ in range(args.repeats):
        for name, codec in runs.items():
            for table, value in zip((rate, setup, cpu), run(codec, args)):
                table[name].append(value)
    med = statistics.median
    kernel = os.environ.get("LOCO_CODEC_KERNEL") or "auto"
    cxx = "on" if cpp_kernel.enabled() and cpp_kernel._library(wait=True) else "off"
    print(f"\n2 workers as threads, 2.1M parameters, Streaming DiLoCo P = 2, tau = 1, "
          f"H = {args.sync_every}, {args.steps} steps, median of {args.repeats}; "
          f"LOCO_CODEC_KERNEL={kernel}; C++ eager kernel {cxx}; torch {torch.__version__}")
    print("| run | steps/s | / none | CPU ms per step | build s |\n|---|---|---|---|---|")
    for name in runs:
        ratio = med([a / b for a, b in zip(rate[name], rate["none"])])
        print(f"| {name} | {med(rate[name]):.1f} | {ratio:.3f} | {med(cpu[name]):.1f} | "
              f"{med(setup[name]):.2f} |")
    ratio = med([a / b for a, b in zip(rate[args.codec], rate["fp32"])])
    print(f"\n{args.codec} / fp32: {ratio:.3f} ({'met' if ratio >= TARGET else 'below'} "
          f"{TARGET}); per repeat: "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(rate[args.codec], rate["fp32"])))


if __name__ == "__main__":
    main()
