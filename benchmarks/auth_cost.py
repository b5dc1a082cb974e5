"""What the job key costs: HMAC-SHA256 tags (the standard library's) and AES-256-GCM sealing
(``cryptography``), in GB/s of payload on this CPU, one core, beside the rates of the links
they protect.

Each payload size is processed ``--repeats`` times (the best time counts): one tag of the
whole message (``JobKey.tag``), the tags of its rows (``JobKey.tag_rows``, 1 MiB rows, as
an all-gather's rows), AES-GCM sealing and opening. A cost is hidden when the rate is above
the link's: a 1 Gbit/s link carries 0.125 GB/s, a 10 Gbit/s one 1.25 GB/s.

    python benchmarks/auth_cost.py                 # 1, 16 and 64 MiB, under a minute
    python benchmarks/auth_cost.py --sizes 1 4     # other sizes (MiB)
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from loco.comm.auth import JobKey, context

LINKS = {"1 Gbit/s": 0.125, "10 Gbit/s": 1.25, "100 Gbit/s": 12.5}
"""Link rates in GB/s (10^9 bytes per second)."""

ROW = 1 << 20  # bytes per row for tag_rows


def rate(fn: Callable[[], object], nbytes: int, repeats: int) -> float:
    """The best of ``repeats`` runs of ``fn``, in GB/s of ``nbytes``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure(size: int, repeats: int) -> dict[str, float]:
    """GB/s of each operation on a random payload of ``size`` bytes."""
    key = JobKey(os.urandom(32))
    data = os.urandom(size)
    rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, min(ROW, size))
    ctx = context("bench", 1, 0)
    out = {"HMAC-SHA256 (one tag)": rate(lambda: key.tag(data, ctx), size, repeats),
           "HMAC-SHA256 (tag_rows)": rate(lambda: key.tag_rows(rows, ctx), size, repeats)}
    try:
        sealed = key.seal(data, ctx)
    except RuntimeError as e:  # no cryptography
        print(f"(AES-GCM skipped: {e})")
        return out
    out["AES-256-GCM seal"] = rate(lambda: key.seal(data, ctx), size, repeats)
    out["AES-256-GCM open"] = rate(lambda: key.open(sealed, ctx), size, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64],
                    help="payload sizes in MiB")
    ap.add_argument("--repeats", type=int, default=5, help="runs per measurement (best)")
    args = ap.parse_args()
    results = {mib: measure(mib << 20, args.repeats) for mib in args.sizes}
    names = list(next(iter(results.values())))
    print(f"{'GB/s on this CPU (one core)':<28}" + "".join(f"{m:>9} MiB" for m in results))
    for name in names:
        print(f"{name:<28}" + "".join(f"{results[m][name]:>13.2f}" for m in results))
    print()
    for link, gbs in LINKS.items():
        print(f"{'link ' + link:<28}{gbs:>13.3f}")


if __name__ == "__main__":
    main()
