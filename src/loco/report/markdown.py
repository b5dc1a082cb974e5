"""``report.md``: the opening paragraphs, the claims' section and the tables, in order."""

from __future__ import annotations

from loco.report.adversarial import attacks_section
from loco.report.numbers import comparison
from loco.report.papers import regime, targets
from loco.report.runs import Run, worker_ranks
from loco.report.seeds import seed_groups, seed_means, seeds_of
from loco.report.tables import downstream_table, machine, settings, sweep_tables, table


def render_markdown(runs: list[Run], numbers: dict[str, dict], plots: list[str]) -> str:
    """``report.md``. With several seeds, the main table and the sweep's give each method
    (grid point) over its seeds, and an **Every run** table lists the runs themselves.

    Args:
        runs: the runs, in report order.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.numbers.comparison]).
        plots: the plots' file names, relative to the report.
    """
    groups = seed_groups(runs)
    shown = seed_means(runs)
    shown_numbers = comparison(shown) if groups else numbers
    lines = ["# loco compare", ""] + intro(runs)
    lines += table(shown, shown_numbers, dict(groups) or None)
    lines += claims_table(runs)
    lines += attacks_section(runs)
    if groups:
        lines += ["", "## Every run", "", "Each seed's run; the other tables and the sweep "
                  "plots give their means. A gap to DataParallel is to its run of the same "
                  "seed.", ""] + table(runs, numbers)
    lines += sweep_tables(shown, shown_numbers)
    lines += downstream_table(runs)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Settings", ""] + settings(runs)
    lines += ["", "## Machine", ""] + machine(runs)
    lines += ["", "Run directories (metrics.jsonl, summary.json, loss.png): "
              + ", ".join(f"`{numbers[r.label]['compare']['run_dir']}/`" for r in runs) + "."]
    return "\n".join(lines) + "\n"


def intro(runs: list[Run]) -> list[str]:
    """The report's opening paragraphs, as markdown lines: the job, its regime (see
    [`regime`][loco.report.papers.regime]), then how to read the numbers (and, with several seeds,
    the table's means).

    Args:
        runs: the runs, in report order.
    """
    first = runs[0].summary
    link = next((r.summary.link for r in runs if r.summary.link), None)
    kind = "runs" if any(r.sweep for r in runs) else "methods"
    ranks = worker_ranks(runs[0])
    groups = seed_groups(runs)
    seeds = seeds_of(runs) if groups else []
    count = (f"{len(groups)} {kind}, each with {len(seeds)} seeds," if groups
             else f"{len(runs)} {kind}")
    seed = (f"seeds {', '.join(map(str, seeds))}" if seeds
            else f"seed {first.config['seed']}")
    lines = [f"{count} on the same job: {first.config['model']} model "
             f"({first.model_parameters:,} parameters), {first.workers} workers"
             + (f" of {ranks} ranks ({first.worker_parallel or 'ddp'})" if ranks > 1
                else "") + ", "
             f"{first.inner_steps} inner steps, {first.tokens:,} training tokens each, "
             f"{seed}"
             + (f"; emulated link {link['bandwidth'] or 'unlimited'}, "
                f"{link['latency'] or '0 ms'} per worker" if link else "") + ".", "",
             regime(runs), "",
             "Eval loss: nats/token on held-out text (the global model; for NoLoCo and Local, "
             "replica 0 unless the run ends with the replicas' average). Bytes: sent by the "
             "busiest worker over the run, training traffic only (DataParallel's with its "
             "gradients' wire format, --grad-codec); peak: the largest single sync. Wall "
             "time: the whole run, evaluation included."
             + (" With workers of several ranks, sent and peak are the busiest rank's; the "
                "slow-link and fast-link columns are the busiest worker's, its ranks "
                "together." if any(worker_ranks(r) > 1 for r in runs) else ""), ""]
    if seeds:
        lines[-1:-1] = ["", "Each method ran once per seed. Its row gives the mean final eval "
                        "loss over the seeds ± half their range, and the range (min–max); "
                        "its gap to DataParallel, bytes, wall time and tokens/s are means "
                        "over the seeds too. Every run, below, lists the runs one by one."]
    return lines


def claims_table(runs: list[Run]) -> list[str]:
    """The section of the papers' claims ([`targets`][loco.report.papers.targets]), as markdown
    lines; empty when these runs can check none. A claim met on some seeds only reads
    ``mixed``, and a sentence under the table warns that a margin smaller than the seeds'
    spread is not a result.

    Args:
        runs: the runs, in report order.
    """
    rows = targets(runs)
    if not rows:
        return []
    met = {True: "yes", False: "**no**", None: "mixed"}
    lines = ["", "## The papers' claims on this run", "", "| claim | measured | met |",
             "|---|---|---|"]
    lines += [f"| {claim} | {value} | {met[ok]} |" for claim, value, ok in rows]
    if seed_groups(runs):
        lines += ["", f"Each claim is checked on each of the {len(seeds_of(runs))} seeds, a "
                  "method against the run of the same seed: yes if it holds on every seed, "
                  "no if on none, mixed otherwise. A margin smaller than the seeds' spread "
                  "is not a result."]
    return lines
