"""Codec speed: encode and decode GB/s per codec, eager and fused, against clone().

For every codec, size and thread count it times, on one row of ``n`` standard normal fp32
values (``encode_rows`` of shape (1, n), ``decode_rows`` of the result):

* clone: ``x.clone()`` of the same tensor, the yardstick (reads 4n bytes and writes 4n into
  a new tensor, as the codecs write theirs); and copy: ``out.copy_(x)`` into a tensor made
  once. A new tensor of 64 MB or more comes from mmap and is page-faulted in on every call,
  so from 16M values on clone (and every codec) measures page faults as much as bandwidth,
  and copy shows the bandwidth alone;
* encode and decode with the eager reference and with the fused kernel (``torch.compile`` of
  the same code; compiled before timing by ``codec.prepare(n)``, once per shape).

Every GB/s counts the fp32 values' bytes, 4n (in for encode, out for decode), whatever the
codec writes or reads on the wire, and each is also given divided by clone's GB/s on the same
tensor and thread count. A time is the best of ``--repeat`` runs (the least disturbed by
other jobs on a shared machine), after one warm-up call. The dropping codecs
(topk, dare, random_drop) have no fused kernel and are left out unless named.

With ``--compile-times N``, it instead times ``codec.prepare(N, parts)`` (compiling every
fused kernel an all-reduce of N values over ``--parts`` workers runs) per codec, in fresh
processes: "cold" with an empty Inductor cache (a new ``TORCHINDUCTOR_CACHE_DIR``) and "warm",
a second process on the same cache. The first codec of a process also pays the one-time cost
of loading Inductor and its C++ toolchain, reported on its own row.

    python benchmarks/codec_speed.py                                  # 1M..64M, 1 and all threads
    python benchmarks/codec_speed.py --sizes 1M,4M,16M --threads 1,2 --codecs fp4_e3m0,int8
    python benchmarks/codec_speed.py --compile-times 4M --parts 2     # prepare's compile time
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from loco.comm.codecs import get_codec
from loco.comm.codecs.formats import FUSED_CODEC_NAMES
from loco.comm.codecs.fused import kernel_in_use


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def best_seconds(fn, repeat: int) -> float:
    fn()  # warm: first touch of the output pages, a compile if one is due
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


_CHILD = """
import json, sys, time
t = time.perf_counter()
import torch._inductor.compile_fx  # the one-time cost: loading Inductor
from loco.comm.codecs import get_codec
from loco.comm.codecs.fused import compile_count
out = {"import": time.perf_counter() - t}
numel, parts, block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for name in sys.argv[4].split(","):
    codec, before, t = get_codec(name, block, kernel="fused"), compile_count(), time.perf_counter()
    codec.prepare(numel, parts)
    out[name] = (time.perf_counter() - t, compile_count() - before)
t = time.perf_counter()
for name in sys.argv[4].split(","):  # a second call: nothing to compile
    get_codec(name, block, kernel="fused").prepare(numel, parts)
out["again"] = time.perf_counter() - t
print(json.dumps(out))
"""


def compile_times(numel: int, parts: int, block: int, names: list[str]) -> None:
    """Print prepare()'s seconds per codec, cold and warm (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        runs = {}
        for run in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", _CHILD, str(numel), str(parts),
                                   str(block), ",".join(names)], env=env, check=True,
                                  capture_output=True, text=True)
            runs[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"prepare({numel}, {parts}): seconds (kernels compiled), in this order in one "
          f"process; load average {os.getloadavg()[0]:.2f}\n")
    print("| codec | cold | warm |\n|---|---|---|")
    print(f"| (loading Inductor) | {runs['cold']['import']:.2f} | {runs['warm']['import']:.2f} |")
    for name in names:
        cells = [f"{runs[r][name][0]:.2f} ({runs[r][name][1]})" for r in ("cold", "warm")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"| all again (cached) | {runs['cold']['again']:.4f} | {runs['warm']['again']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="values per tensor (K/M suffixes)")
    ap.add_argument("--threads", default="1,all", help="intra-op thread counts; all = every core")
    ap.add_argument("--codecs", default=",".join(n for n in FUSED_CODEC_NAMES if n != "fp32"))
    ap.add_argument("--kernels", default="eager,fused")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--compile-times", metavar="N", default=None,
                    help="time prepare(N, --parts) per codec, cold and warm, instead")
    ap.add_argument("--parts", type=int, default=2, help="workers, for --compile-times")
    args = ap.parse_args()
    if args.compile_times:
        compile_times(parse_size(args.compile_times), args.parts, args.block,
                      args.codecs.split(","))
        return

    cores = os.cpu_count() or 1
    threads = [cores if t.strip() == "all" else int(t) for t in args.threads.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    kernels = args.kernels.split(",")
    codecs = {(n, k): get_codec(n, args.block, kernel=k)
              for n in args.codecs.split(",") for k in kernels}
    print(f"torch {torch.__version__}, {cores} cores, block {args.block}, best of "
          f"{args.repeat}; load average {os.getloadavg()[0]:.2f} at start")
    print("GB/s on the 4n fp32 bytes; in brackets: divided by clone GB/s\n")
    head = ["codec", "values", "threads", "clone GB/s", "copy GB/s"]
    head += [f"{op} {k}" for op in ("encode", "decode") for k in kernels]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in sizes:
        x = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
        for t in threads:
            torch.set_num_threads(t)
            clone = 4 * n / best_seconds(x.clone, args.repeat) / 1e9
            out = torch.empty_like(x)
            copy = 4 * n / best_seconds(lambda: out.copy_(x), args.repeat) / 1e9
            for name in args.codecs.split(","):
                cells = {}
                for k in kernels:
                    codec = codecs[name, k]
                    codec.prepare(n)  # fused: compile (1, n) now, not while timing
                    buf = codec.encode_rows(x)
                    enc = 4 * n / best_seconds(lambda: codec.encode_rows(x), args.repeat) / 1e9
                    dec = 4 * n / best_seconds(lambda: codec.decode_rows(buf, n),
                                                 args.repeat) / 1e9
                    used = kernel_in_use(codec)
                    mark = "" if used == k else f" (ran {used})"
                    cells["encode", k] = f"{enc:.2f} ({enc / clone:.0%}){mark}"
                    cells["decode", k] = f"{dec:.2f} ({dec / clone:.0%}){mark}"
                row = [name, f"{n / (1 << 20):g}M", str(t), f"{clone:.1f}", f"{copy:.1f}"]
                row += [cells[op, k] for op in ("encode", "decode") for k in kernels]
                print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
