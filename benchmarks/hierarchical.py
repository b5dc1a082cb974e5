"""A worker as a group of ranks: 4 workers of 1 rank against 2 workers of 2 ranks.

Trains the same job (model, data, seed, global batch and tokens) for DiLoCo and for Streaming
DiLoCo with FP4 pseudo-gradients (its default codec), in three layouts, after DataParallel
over the same 4 ranks (the loss that fewer, larger replicas should come closer to):

* ``4x1``       4 workers of one rank each: every rank is a replica on the slow link;
* ``2x2-ddp``   2 workers of 2 ranks, each rank holding the whole model, the gradients
                averaged over the worker's fast link (``--worker-parallel ddp``);
* ``2x2-fsdp``  the same, the model, gradients and AdamW state sharded over the worker's
                ranks by FSDP2 (``--worker-parallel fsdp``).

Every rank reads a batch of ``--batch-size`` sequences per step in every layout, so a step
trains on the same 4 x batch sequences. Each run is ``loco train --launcher processes`` in a
subprocess of its own; the table comes from the runs' summary.json: final eval loss,
slow-link and fast-link bytes sent per worker (the fast link's include FSDP2's all-gathers
and reduce-scatters), the memory each rank holds for the model, inner optimizer and outer
state, the largest resident set of a rank, and tokens/s.

    python benchmarks/hierarchical.py             # small model, 300 steps: ~12 min, 2 cores
    python benchmarks/hierarchical.py --quick     # tiny model, 40 steps: ~2 min
    python benchmarks/hierarchical.py --steps 100 --markdown hierarchical.md
    python benchmarks/hierarchical.py --only dataparallel:4x1,diloco:2x2-fsdp   # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

#: name -> the ``loco train`` flags of the method.
METHODS = {
    "dataparallel": ["--algorithm", "ddp"],
    "diloco": ["--algorithm", "diloco"],
    "streaming-fp4": ["--algorithm", "streaming", "--codec", "fp4_e3m0"],
}
#: name -> (workers M, ranks per worker R, --worker-parallel); the order of the rows.
LAYOUTS = {"4x1": (4, 1, None), "2x2-ddp": (2, 2, "ddp"), "2x2-fsdp": (2, 2, "fsdp")}
#: The baseline's row first: DataParallel over the 4 ranks, the loss the others approach.
BASELINE = ("dataparallel", "4x1")
#: the job's settings by default and with --quick; a flag given overrides either.
PRESETS = {
    "full": dict(model="small", steps=300, sync_every=50, eval_batches=50),
    "quick": dict(model="tiny", steps=40, sync_every=20, eval_batches=10),
}
#: summary.json fields the table reads.
FIELDS = ("final_eval_loss", "tokens", "slow_link_bytes_sent_per_worker",
          "fast_link_bytes_sent_per_worker", "memory_bytes_per_rank", "max_rss_bytes",
          "tokens_per_second")
HEADER = ("method", "layout", "eval loss", "tokens", "slow link B/worker",
          "fast link B/worker", "state MiB/rank", "max RSS MiB", "tokens/s")
MIB = 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the preset's value for each one not given."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quick check: "
                    + ", ".join(f"{k} {v}" for k, v in PRESETS["quick"].items()))
    ap.add_argument("--steps", type=int, help="inner steps of every run (default: "
                    f"{PRESETS['full']['steps']}, with --quick {PRESETS['quick']['steps']})")
    ap.add_argument("--model", help="model size (default: small, with --quick tiny)")
    ap.add_argument("--sync-every", type=int, help="H: inner steps between two syncs of the "
                    "same parameters (default: 50, with --quick 20)")
    ap.add_argument("--eval-batches", type=int, help="batches in the final evaluation "
                    "(default: 50, with --quick 10)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step, "
                    "in every layout (default: 4)")
    ap.add_argument("--fragments", type=int, default=2, help="P of the streaming runs")
    ap.add_argument("--seed", type=int, default=0, help="seed of every run")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as markdown here")
    ap.add_argument("--only", metavar="RUNS", help="a comma-separated subset of the runs, "
                    "each METHOD:LAYOUT (e.g. dataparallel:4x1,diloco:2x2-fsdp); default all")
    args = ap.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def train_argv(args: argparse.Namespace, method: str, layout: str, out: str) -> list[str]:
    """The ``loco train`` command line of one run."""
    workers, ranks, parallel = LAYOUTS[layout]
    argv = [sys.executable, "-m", "loco", "train", *METHODS[method],
            "--workers", str(workers), "--launcher", "processes", "--model", args.model,
            "--steps", str(args.steps), "--sync-every", str(args.sync_every),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--final-eval-batches", str(args.eval_batches), "--eval-every", "0",
            "--checkpoint-every", "0", "--max-restarts", "0", "--no-progress", "--out", out]
    if method.startswith("streaming"):
        argv += ["--fragments", str(args.fragments)]
    if ranks > 1:
        argv += ["--worker-ranks", str(ranks), "--worker-parallel", parallel]
    return argv


def run_one(args: argparse.Namespace, method: str, layout: str, tmp: str) -> dict:
    """Train one run; its summary, or ``{"error": ...}`` with the last line it printed."""
    out = os.path.join(tmp, f"{method}-{layout}")
    print(f"running {method} {layout} ...", flush=True)
    done = subprocess.run(train_argv(args, method, layout, out), capture_output=True, text=True)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        print(f"  failed (exit code {done.returncode}): {lines[-1]}", flush=True)
        return {"error": lines[-1]}
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def num(value, spec: str, scale: float = 1.0) -> str:
    """A number formatted with ``spec`` after dividing by ``scale``; "-" when missing."""
    if value is None:
        return "-"
    return f"{value if scale == 1 else value / scale:{spec}}"


def state_bytes(memory: dict | None) -> int | None:
    """Bytes a rank holds for model, inner optimizer and outer state, summed."""
    return None if not memory else sum(memory.values())


def cells(method: str, layout: str, s: dict) -> tuple[str, ...]:
    """One table row from a run's summary."""
    if "error" in s:
        return (method, layout, "failed", *["-"] * (len(HEADER) - 3))
    return (method, layout, num(s.get("final_eval_loss"), ".4f"), num(s.get("tokens"), ","),
            num(s.get("slow_link_bytes_sent_per_worker"), ","),
            num(s.get("fast_link_bytes_sent_per_worker"), ","),
            num(state_bytes(s.get("memory_bytes_per_rank")), ".2f", MIB),
            num(s.get("max_rss_bytes"), ".0f", MIB), num(s.get("tokens_per_second"), ",.0f"))


def text_table(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell, the first two left-aligned."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join(line(r) for r in [HEADER, *rows])


def markdown_table(rows: list[tuple[str, ...]], notes: list[str]) -> str:
    """The same table in markdown, numbers right-aligned, the notes below it."""
    line = lambda r: "| " + " | ".join(r) + " |"  # noqa: E731
    rule = "|" + "|".join(":---" if i < 2 else "---:" for i in range(len(HEADER))) + "|"
    return "\n".join([line(HEADER), rule, *map(line, rows), "", *notes]) + "\n"


def notes(summaries: list[dict]) -> list[str]:
    """The fields of ``FIELDS`` that no successful run reported, as a line to print."""
    ok = [s for s in summaries if "error" not in s]
    missing = [f for f in FIELDS if ok and all(f not in s for s in ok)]
    return [f"summary.json has no {', '.join(missing)}: shown as -"] if missing else []


def selected_runs(only: str | None) -> list[tuple[str, str]]:
    """The runs, in the table's order: the DataParallel baseline, then every method in every
    layout; or the subset ``only`` names (``METHOD:LAYOUT,...``)."""
    runs = [BASELINE] + [(m, layout) for m in METHODS if m != BASELINE[0] for layout in LAYOUTS]
    if only is None:
        return runs
    wanted = [tuple(item.split(":", 1)) for item in only.split(",")]
    unknown = [":".join(w) for w in wanted if w not in runs]
    if unknown:
        raise SystemExit(f"--only: unknown run(s) {', '.join(unknown)}; choose from "
                         + ", ".join(":".join(r) for r in runs))
    return [r for r in runs if r in wanted]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = selected_runs(args.only)
    with tempfile.TemporaryDirectory() as tmp:
        summaries = [run_one(args, m, layout, tmp) for m, layout in runs]
    rows = [cells(m, layout, s) for (m, layout), s in zip(runs, summaries)]
    print(f"\nmodel {args.model}, {args.steps} steps, H = {args.sync_every}, "
          f"{args.batch_size} sequences per rank per step, 4 ranks in every layout; "
          "state = model + inner optimizer + outer state")
    print(text_table(rows))
    remarks = notes(summaries)
    for line in remarks:
        print(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(rows, remarks))
        print(f"wrote {args.markdown}")
    return 1 if any("error" in s for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
