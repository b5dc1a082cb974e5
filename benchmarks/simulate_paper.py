"""The compute-utilization simulator against the Streaming DiLoCo paper (arXiv 2501.18512).

Prints, as Markdown tables:

* Table 4: for every model, method and target CU, the paper's bandwidth, loco's and their
  ratio (loco / paper). The paper's values lie on a grid about 21% apart (presumably the
  first grid bandwidth that reaches the target), so a ratio in about (0.83, 1] is a match at
  the paper's resolution.
* Figure 9: the bandwidth Streaming DiLoCo with overlap (16-bit) needs at 100B for several
  τ, the number of inner steps a reduction runs under (the paper reads little gain past 5).

Numpy only, a few seconds:

    python benchmarks/simulate_paper.py
    python benchmarks/simulate_paper.py --pattern sequential --taus 0,1,2,5
"""

from __future__ import annotations

import argparse

from loco.simulate.utilization import (LABELS, METHODS, PAPER_TABLE4, PRESETS, TARGETS,
                                       required_bandwidth)


def table4(pattern: str) -> str:
    """Paper / loco (ratio) for every cell of Table 4."""
    head = "| model | method | " + " | ".join(f"{100 * t:g}%" for t in TARGETS) + " |"
    lines = [head, "|---|---|" + "---|" * len(TARGETS)]
    ratios = []
    for name, spec in PRESETS.items():
        for method in METHODS:
            cells = []
            for target, paper in zip(TARGETS, PAPER_TABLE4[name][method]):
                loco = required_bandwidth(method, spec, target, pattern=pattern)
                ratios.append(loco / paper)
                cells.append(f"{paper:g} / {loco:.3g} ({loco / paper:.2f})")
            lines.append(f"| {name} | {LABELS[method]} | " + " | ".join(cells) + " |")
    ratios.sort()
    lines.append(f"\nloco / paper over all {len(ratios)} cells: min {ratios[0]:.2f}, median "
                 f"{ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}")
    return "\n".join(lines)


def figure9(taus: list[int], pattern: str) -> str:
    """Gbit/s Streaming DiLoCo with overlap τ needs at 100B, one row per τ."""
    lines = ["| τ (100B, 16-bit) | " + " | ".join(f"{100 * t:g}%" for t in TARGETS) + " |",
             "|---|" + "---|" * len(TARGETS)]
    for tau in taus:
        row = [required_bandwidth("streaming_overlap", PRESETS["100b"], t, overlap=tau,
                                  pattern=pattern) for t in TARGETS]
        lines.append(f"| {tau} | " + " | ".join(f"{v:.3g}" for v in row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pattern", choices=("strided", "sequential"), default="strided",
                        help="fragment pattern (default: strided, the paper's)")
    parser.add_argument("--taus", default="0,1,2,3,5,10,20",
                        help="overlaps τ for the Figure 9 table, integers in [0, 100) "
                        "(default: 0,1,2,3,5,10,20)")
    args = parser.parse_args()
    print("Table 4: paper / loco (loco ÷ paper), Gbit/s per worker\n")
    print(table4(args.pattern))
    print("\nFigure 9: Gbit/s needed at 100B against the overlap τ\n")
    print(figure9([int(t) for t in args.taus.split(",")], args.pattern))


if __name__ == "__main__":
    main()
