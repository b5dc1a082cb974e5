"""What the outer step costs the training thread, inline and on the helper thread.

Emulates an accelerator: each inner step's forward and backward are a ``time.sleep`` (the
CPU is free while a GPU computes), the inner optimizer's step is nothing, and the outer
state is in CPU memory (``offload=True``). So the training thread's time inside
``algo.step()`` is what the sync itself costs it: with ``outer_thread=False`` the outer step
(fused SGD over the fragment) runs there, with ``outer_thread=True`` it runs on the helper
during the τ overlapped steps, and the training thread only swaps the result in and merges.

Two workers as threads, Streaming DiLoCo with P fragments in fp32. Prints the training
thread's milliseconds per sync in ``algo.step()`` (median over repeats and workers) and the
ratio helper / inline.

    python benchmarks/outer_thread.py                       # 32M parameters, P = 4
    python benchmarks/outer_thread.py --params 16 --step-ms 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import loco


def worker(ctx, params_m: int, fragments: int, step_ms: float, rounds: int,
           outer_thread: bool) -> float:
    """Training-thread ms per sync spent in ``algo.step()``."""
    torch.set_num_threads(1)
    width = 2048
    blocks = max(fragments, round(params_m * 2**20 / width**2))
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(blocks))
    # No gradients: the inner step is left to the "accelerator" and costs the CPU nothing.
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    sync_every = 4 * fragments
    algo = loco.StreamingDiLoCo(model, inner, ctx.comm, sync_every=sync_every,
                                fragments=fragments, overlap=2, codec="fp32", offload=True,
                                outer_thread=outer_thread)
    in_step = []
    for _ in range(rounds * sync_every):
        time.sleep(step_ms / 1e3)  # forward and backward on the device
        t0 = time.perf_counter()
        algo.step()
        in_step.append(time.perf_counter() - t0)
    algo.flush()
    syncs = len(algo.sync_log)
    return 1e3 * sum(in_step[sync_every:]) / max(1, syncs - fragments)  # after round one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=32, help="parameters, in millions (2^20)")
    ap.add_argument("--fragments", type=int, default=4, help="P")
    ap.add_argument("--step-ms", type=float, default=50.0, help="one emulated device step")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of H = 4P steps")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    args = ap.parse_args()
    print(f"{args.params}M parameters, P = {args.fragments}, tau = 2, device step "
          f"{args.step_ms:g} ms; training-thread ms per sync in algo.step()")
    result = {}
    for helper in (False, True):
        runs = [ms for _ in range(args.repeats)
                for ms in loco.launch(worker, 2, args=(
                    args.params, args.fragments, args.step_ms, args.rounds, helper))]
        result[helper] = statistics.median(runs)
        print(f"  outer_thread={helper!s:5}  {result[helper]:8.1f} ms")
    print(f"  helper / inline: {result[True] / result[False]:.3f}")


if __name__ == "__main__":
    main()
