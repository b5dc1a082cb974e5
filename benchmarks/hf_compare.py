"""Side-by-side: the quick comparison on loco's built-in model and on a Hugging Face Llama of
the same size (``configs/llama-small``: 4 layers x d 128, SwiGLU 352, tied embeddings, 1.33M
parameters at vocab 4096, like ``--model small``).

Runs ``loco compare --preset quick`` once per model (every method, same data, seed and token
budget) and prints, per method, the final eval loss and tokens/s of both, the tokens/s ratio
(target: within 20%), and whether the methods rank the same by final eval loss.

    python benchmarks/hf_compare.py                       # about 11 minutes on 2 CPU cores
    python benchmarks/hf_compare.py --steps 100 --out /tmp/hfc
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = {"built-in small": "small", "hf llama-small": "hf:configs/llama-small"}


def run_compare(model: str, out: str, extra: list[str]) -> dict[str, dict]:
    """Final eval loss and tokens/s of each method of ``loco compare --preset quick``."""
    if not os.path.exists(os.path.join(out, "compare.json")):
        subprocess.run([sys.executable, "-m", "loco", "compare", "--preset", "quick",
                        "--model", model, "--out", out, "--no-progress", *extra], check=True)
    results = {}
    for label in sorted(os.listdir(out)):
        path = os.path.join(out, label, "summary.json")
        if os.path.exists(path):
            s = json.load(open(path))
            results[label] = {"loss": s["final_eval_loss"], "tok_s": s["tokens_per_second"]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/hf-compare", help="directory for both comparisons "
                    "(finished ones are reused)")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    args = ap.parse_args()
    extra = [] if args.steps is None else ["--steps", str(args.steps)]
    res = {name: run_compare(model, os.path.join(args.out, name.split()[0]), extra)
           for name, model in MODELS.items()}
    (a, ra), (b, rb) = res.items()
    print(f"\n| method | loss {a} | loss {b} | tok/s {a} | tok/s {b} | tok/s ratio |")
    print("|---|---|---|---|---|---|")
    for label in ra:
        x, y = ra[label], rb[label]
        print(f"| {label} | {x['loss']:.3f} | {y['loss']:.3f} | {x['tok_s']:,.0f} | "
              f"{y['tok_s']:,.0f} | {y['tok_s'] / x['tok_s']:.2f} |")
    rank = {name: sorted(r, key=lambda k: r[k]["loss"]) for name, r in res.items()}
    print(f"\nranking by final eval loss, {a}: {' < '.join(rank[a])}")
    print(f"ranking by final eval loss, {b}: {' < '.join(rank[b])}")
    print("same ranking" if rank[a] == rank[b] else "rankings differ")


if __name__ == "__main__":
    main()
