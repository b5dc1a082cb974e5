"""The report's tables, as markdown lines: the main one, the sweep's, the downstream tasks',
the settings and the machines."""

from __future__ import annotations

from loco.report.cells import bits_cell, link_cell, pct_cell, ratio_cell, sent_cell, value_cell
from loco.report.numbers import baseline, main_metric
from loco.report.runs import Run, sweep_groups, worker_ranks
from loco.report.seeds import over_seeds


#: Options that are the same for every method of a comparison and not worth repeating per
#: method in the settings; ``out`` and ``progress`` say nothing about the run.
NOT_SETTINGS = {"out", "progress", "algorithm"}


def table(runs: list[Run], numbers: dict[str, dict],
          seeds: dict[str, list[Run]] | None = None) -> list[str]:
    """The report's main table, one row per run, as markdown lines. Where a run has workers
    of several ranks, two columns add the bytes a worker sent over the slow link and over
    the fast link inside it, its ranks together.

    Args:
        runs: the runs, in report order; with ``seeds``, one
            [`mean_run`][loco.report.seeds.mean_run] per method.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.numbers.comparison]),
            of ``runs``.
        seeds: each mean run's runs by its label (``seed_groups``): a column lists their
            seeds and the loss reads ``mean ± half-range (min–max)``; default: none.
    """
    link = any(r.summary.link for r in runs)
    unequal = any(r.summary.worker_speeds for r in runs)
    ranks = any(worker_ranks(r) > 1 for r in runs)
    head = ["method", "setting", "final eval loss", "vs DataParallel", "sent / worker (B)",
            "peak sync / worker (B)", "DataParallel ÷ sent", "wall time (s)", "tokens/s",
            "bits / parameter / step"]
    if ranks:
        head[6:6] = ["slow link / worker (B)", "fast link / worker (B)"]
    if link:
        head.append("compute utilization")
    if unequal:
        head.append("goodput")
    if seeds:
        head[2:3] = ["seeds", "final eval loss, mean ± half-range (min–max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s, rel = r.summary, numbers[r.label]["compare"]
        row = [r.name, rel["setting"], f"{s.final_eval_loss:.4f}",
               pct_cell(rel["eval_loss_vs_ddp_pct"]), sent_cell(r),
               f"{s.peak_sync_bytes_per_rank:,}",
               "∞" if rel["eval_loss_vs_ddp_pct"] is not None and not s.bytes_sent_per_rank
               else ratio_cell(rel["ddp_bytes_over_bytes"]),
               f"{s.wall_seconds:.1f}", f"{s.tokens_per_second:,.0f}",
               bits_cell(s.bits_per_parameter_per_step)]
        if ranks:
            row[6:6] = [link_cell(r, "slow"), link_cell(r, "fast")]
        if link:
            row.append(f"{s.compute_utilization:.1%}")
        if unequal:
            row.append(goodput_cell(seeds[r.label] if seeds else [r]))
        if seeds:
            row[2:3] = [", ".join(str(m.seed) for m in seeds[r.label]),
                        loss_spread(seeds[r.label])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def goodput_cell(members: list[Run]) -> str:
    """A method's goodput (``Summary.goodput``), the mean over its seeds; ``-`` where a run
    did not record it.

    Args:
        members: its runs, one per seed (or the run).
    """
    values = [(m.summary.goodput or {}).get("total") for m in members]
    if None in values:
        return "-"
    return f"{sum(values) / len(values):.1%}"


def loss_spread(members: list[Run]) -> str:
    """A method's final eval loss over its seeds: ``mean ± half-range (min–max)``.

    Args:
        members: its runs, one per seed.
    """
    numbers = over_seeds(members)
    low, high = numbers["final_eval_loss_min"], numbers["final_eval_loss_max"]
    return (f"{numbers['final_eval_loss_mean']:.4f} ± {(high - low) / 2:.4f} "
            f"({low:.4f}–{high:.4f})")


def downstream_table(runs: list[Run]) -> list[str]:
    """The downstream tasks' table (``loco eval``), one row per run, one column per task's
    headline metric (the final model's score); empty when no run was evaluated.

    Args:
        runs: the runs, in report order.
    """
    scored = [r for r in runs if r.summary.downstream]
    if not scored:
        return []
    metrics: dict[str, str] = {}
    for r in scored:
        for task, entry in r.summary.downstream.items():
            found = main_metric(entry)
            if found and task not in metrics:
                metrics[task] = found[0]
    entries = [e for r in scored for e in r.summary.downstream.values()]
    shots = {e.get("shots") for e in entries}
    head = ["method"]
    for task, metric in metrics.items():
        docs = {r.summary.downstream[task].get("samples") for r in scored
                if task in r.summary.downstream}
        head.append(f"{task} ({metric}" + (f", {docs.pop()} docs)" if len(docs) == 1
                                           and None not in docs else ")"))
    note = ("Each run's final model (the global model; for NoLoCo and Local replica 0 "
            "unless the run ends with the replicas' average) on lm-evaluation-harness tasks, "
            "scored by `loco eval`: each task's headline metric (acc_norm where it has one, "
            "else acc)"
            + (f", {shots.pop()}-shot" if len(shots) == 1 and None not in shots else
               " (shots per task: see each summary.json's downstream)") + ". –: not scored.")
    lines = ["", "## Downstream tasks", "", note, "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in runs:
        row = [r.name]
        for task, metric in metrics.items():
            value = (r.summary.downstream or {}).get(task, {}).get(metric)
            row.append("–" if value is None else f"{value:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def sweep_tables(runs: list[Run], numbers: dict[str, dict]) -> list[str]:
    """The sweep section of the report: per group of swept options, one row per grid point
    with its final eval loss and bytes, as markdown lines.

    Args:
        runs: the runs, in report order.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.numbers.comparison]).

    Returns:
        The lines; empty when no run is part of a sweep.
    """
    groups = sweep_groups(runs)
    if not groups:
        return []
    lines = ["", "## Sweep", "",
             "Final eval loss and bytes at every point of the grid; the plots draw them against "
             "the first swept option, one line per method and value of the others."]
    ddp = baseline(runs, "ddp")
    for keys, members in groups:
        head = ["method", *keys, "final eval loss", "vs DataParallel", "sent / worker (B)",
                "peak sync / worker (B)", "DataParallel ÷ sent"]
        lines += ["", f"### {' × '.join(keys)}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for r in members:
            s, rel = r.summary, numbers[r.label]["compare"]
            lines.append("| " + " | ".join(
                [r.method_name, *(value_cell(v) for v in r.sweep[1].values()),
                 f"{s.final_eval_loss:.4f}", pct_cell(rel["eval_loss_vs_ddp_pct"]), sent_cell(r),
                 f"{s.peak_sync_bytes_per_rank:,}", ratio_cell(rel["ddp_bytes_over_bytes"])])
                + " |")
        if ddp is not None:
            lines += ["", f"For reference, {ddp.name}: {ddp.summary.final_eval_loss:.4f}, "
                      f"{sent_cell(ddp)} bytes per worker."]
    return lines


def settings(runs: list[Run]) -> list[str]:
    """Options shared by every run (as YAML), then those that differ, per run, as markdown
    lines.

    Args:
        runs: the runs, in report order.
    """
    import yaml

    configs = [r.summary.config for r in runs]
    keys = [k for k in configs[0] if k not in NOT_SETTINGS]
    shared = {k: configs[0][k] for k in keys
              if all(c.get(k) == configs[0][k] for c in configs)}
    differ = [k for k in keys if k not in shared]
    lines = ["Shared by every method (`loco train` options):", "", "```yaml",
             yaml.safe_dump(shared, sort_keys=False).rstrip(), "```"]
    if differ:
        lines += ["", "Per method:", "", "| method | " + " | ".join(differ) + " |",
                  "|" + "---|" * (len(differ) + 1)]
        lines += ["| " + " | ".join([r.name] + [str(r.summary.config.get(k)) for k in differ])
                  + " |" for r in runs]
    return lines


def machine(runs: list[Run]) -> list[str]:
    """The machines the runs recorded, as markdown lines.

    Args:
        runs: the runs.
    """
    seen = []
    for r in runs:
        m = r.summary.machine
        if m and m not in seen:
            seen.append(m)
    if not seen:
        return ["Not recorded in these runs' summaries."]
    lines = []
    for m in seen:
        lines.append(f"- {m['hostname']}: {m['cpu']} ({m['cpu_count']} cores)"
                     + (f", {m['accelerator']}" if m.get("accelerator") else ", no accelerator")
                     + f"; {m['platform']}; Python {m['python']}, torch {m['torch']}")
    devices = sorted({r.summary.device or "?" for r in runs})
    launchers = sorted({r.summary.launcher or "?" for r in runs})
    lines.append(f"- device {', '.join(devices)}; launcher {', '.join(launchers)}")
    return lines
