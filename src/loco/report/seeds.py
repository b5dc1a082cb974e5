"""Runs of several seeds (``loco compare --seeds``): grouped per method, and their means."""

from __future__ import annotations

import dataclasses
from typing import Any

from loco.report.runs import Run


def seeds_of(runs: list[Run]) -> list[int]:
    """The seeds of runs of ``loco compare --seeds``, in order; empty for other runs.

    Args:
        runs: the runs.
    """
    return sorted({r.seed for r in runs if r.seed is not None})


def seed_groups(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """The runs by method (or grid point), each with its seeds, when there are several seeds.

    Args:
        runs: the runs, in report order.

    Returns:
        (label without the seed, its runs in report order) per method, in the order of
            their first run; empty unless the runs hold at least two seeds.
    """
    if len(seeds_of(runs)) < 2:
        return []
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return list(groups.items())


def over_seeds(members: list[Run]) -> dict[str, Any]:
    """A method's (grid point's) final eval loss over its seeds, for ``compare.json``.

    Args:
        members: its runs, one per seed.

    Returns:
        ``label`` (without the seed), ``seeds``, ``labels`` and ``final_eval_loss_per_seed``
            (in the order of ``seeds``), ``final_eval_loss_mean``, ``final_eval_loss_min``,
            ``final_eval_loss_max``.
    """
    losses = [m.summary.final_eval_loss for m in members]
    return {"label": members[0].group, "seeds": [m.seed for m in members],
            "labels": [m.label for m in members], "final_eval_loss_per_seed": losses,
            "final_eval_loss_mean": sum(losses) / len(losses),
            "final_eval_loss_min": min(losses), "final_eval_loss_max": max(losses)}


#: Summary numbers a method's row over its seeds averages (bytes rounded to whole bytes).
MEAN_FIELDS = ("final_eval_loss", "bytes_sent_per_rank", "peak_sync_bytes_per_rank",
               "slow_link_bytes_sent_per_worker", "fast_link_bytes_sent_per_worker",
               "wall_seconds", "tokens_per_second", "compute_utilization")


def mean_run(label: str, members: list[Run]) -> Run:
    """A run that stands for a method (grid point) over its seeds: the first seed's summary
    with the mean of each of ``MEAN_FIELDS`` the runs all have; no metrics records.

    Args:
        label: the label without the seed (``Run.group``).
        members: its runs, one per seed.

    Returns:
        The run, labelled ``label``, in the first seed's directory.
    """
    means = {}
    for key in MEAN_FIELDS:
        values = [getattr(m.summary, key) for m in members]
        if all(isinstance(v, (int, float)) for v in values):
            mean = sum(values) / len(values)
            means[key] = round(mean) if all(isinstance(v, int) for v in values) else mean
    return Run(label, members[0].path, dataclasses.replace(members[0].summary, **means), [])


def seed_means(runs: list[Run]) -> list[Run]:
    """The runs a report's tables and sweep plots show: with several seeds, one
    [`mean_run`][loco.report.seeds.mean_run] per method (grid point); else the runs themselves.

    Args:
        runs: the runs, in report order.
    """
    groups = seed_groups(runs)
    return [mean_run(label, members) for label, members in groups] if groups else runs


def half_range_pct(values: list[float]) -> float:
    """Half the range of ``values`` in % of their mean: the seeds' spread of a loss.

    Args:
        values: one loss per seed, positive.
    """
    return 50 * (max(values) - min(values)) / (sum(values) / len(values))
