"""Writing a report: ``report.md``, ``compare.json`` and the plots, a sweep's too."""

from __future__ import annotations

import json
import os

from loco.report.adversarial import add_attacks
from loco.report.cells import value_cell
from loco.report.markdown import render_markdown
from loco.report.numbers import baseline, comparison
from loco.report.runs import Run, sortable, sweep_groups
from loco.report.seeds import seed_means


def write_report(runs: list[Run], out: str) -> dict[str, dict]:
    """Write ``report.md``, ``compare.json`` and the plots (a sweep's too) into ``out``.
    Files are written whole (temporary file, then rename).

    Args:
        runs: the runs, in report order (see [`find_runs`][loco.report.runs.find_runs]).
        out: the directory to write into (created if missing).

    Returns:
        ``compare.json``'s contents.
    """
    from loco.plot import plot_comparison

    os.makedirs(out, exist_ok=True)
    numbers = comparison(runs, out)
    add_attacks(numbers, runs)  # attacked runs: compare.attack
    plots = (frontier_plot(runs, out) + plot_comparison(runs, out)
             + sweep_plots(seed_means(runs), out))
    _write(os.path.join(out, "compare.json"), json.dumps(numbers, indent=2) + "\n")
    _write(os.path.join(out, "report.md"), render_markdown(runs, numbers, plots))
    return numbers


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def frontier_plot(runs: list[Run], out: str) -> list[str]:
    """``frontier.png``: final eval loss against bits per parameter per step, one point per
    method (its seeds' mean and range), with the Pareto frontier; written when at least three
    methods have both numbers.

    Args:
        runs: the runs, in report order.
        out: the directory to write into.

    Returns:
        ``["frontier.png"]``, or ``[]`` when not written.
    """
    from loco.plot import plot_frontier

    groups: dict[str, list[Run]] = {}
    for r in runs:
        s = r.summary
        if s.final_eval_loss is not None and s.bits_per_parameter_per_step is not None:
            groups.setdefault(r.group_name, []).append(r)
    if len(groups) < 3:
        return []
    methods = [(name, members[0].summary.bits_per_parameter_per_step,
                [m.summary.final_eval_loss for m in members]) for name, members in groups.items()]
    plot_frontier(os.path.join(out, "frontier.png"), methods)
    return ["frontier.png"]


def sweep_plots(runs: list[Run], out: str) -> list[str]:
    """One plot per group of swept options: final eval loss (and, where the swept options
    change them, bytes sent per worker) against the first swept option, one line per method
    and value of the other options, DataParallel dashed and Local dotted for reference.

    Args:
        runs: the runs, in report order.
        out: the directory to write into.

    Returns:
        The files written (``sweep_<options>.png``), in group order.
    """
    from loco.plot import plot_sweep

    written = []
    bases = [r for a in ("ddp", "local") if (r := baseline(runs, a)) is not None]
    for keys, members in sweep_groups(runs):
        x, others = keys[0], keys[1:]
        xs = sorted({value_cell(r.sweep[1][x]) for r in members}, key=sortable)
        numeric = all(sortable(v)[0] == 0 for v in xs)
        lines: dict[str, list[tuple[float, float, int]]] = {}
        for r in members:
            point = r.sweep[1]
            name = ", ".join([r.method_name] + [f"{k}={value_cell(point[k])}" for k in others])
            pos = float(value_cell(point[x])) if numeric else xs.index(value_cell(point[x]))
            lines.setdefault(name, []).append(
                (pos, r.summary.final_eval_loss, r.summary.bytes_sent_per_rank))
        ticks = [(float(v) if numeric else i, v) for i, v in enumerate(xs)]
        references = [(r.name, r.summary.final_eval_loss, r.summary.bytes_sent_per_rank)
                      for r in bases if r not in members]
        name = "sweep_" + "_".join(keys) + ".png"
        sent = {r.summary.bytes_sent_per_rank for r in members}
        plot_sweep(os.path.join(out, name), x, ticks, list(lines.items()), references,
                   show_bytes=len(sent) > 1 and max(sent) > 0)
        written.append(name)
    return written
