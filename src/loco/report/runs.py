"""Finished run directories: reading them, their labels' sweep points and seeds, their order."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from loco.algorithms import Method, methods
from loco.options import ConfigError
from loco.training.summary import Summary


#: A sweep run's label, as ``loco compare --sweep`` names it: ``BASE[OPTION=VALUE,...]``
#: (a value holding commas in parentheses). The values are read from the run's configuration.
SWEEP_LABEL = re.compile(r"^(?P<base>[a-z][a-z0-9_-]{0,31})\[(?P<point>.+)\]$")


def sweep_point(label: str, config: dict) -> tuple[str, dict[str, Any]] | None:
    """A sweep run's method and grid point, from its label and its configuration.

    Args:
        label: the run's label, ``BASE[OPTION=VALUE,...]`` for a sweep's run
            (``SWEEP_LABEL``).
        config: the run's configuration (``summary.json``'s ``config``).

    Returns:
        ``(base label, {option: value})`` with the values as the configuration holds them,
        in the label's order; None for a run that is not part of a sweep.
    """
    match = SWEEP_LABEL.match(label)
    if not match:
        return None
    keys = re.findall(r"(?:^|,)([a-z][a-z0-9_]*)=", match["point"])
    if not keys or any(k not in config for k in keys):
        return None
    return match["base"], {k: config[k] for k in keys}


#: A seeded run's label, as ``loco compare --seeds`` names it: the seed is the last entry of
#: the grid point, ``diloco[seed=1]``, ``streaming[mixing=0.5,seed=2]``.
SEED_ENTRY = re.compile(r"(?P<sep>[\[,])seed=(?P<seed>[0-9]+)\]$")


def seed_point(label: str, config: dict) -> tuple[str, int] | None:
    """A seeded run's label without its seed, and the seed.

    Args:
        label: the run's label; a seeded run's ends in ``seed=S]`` (``SEED_ENTRY``).
        config: the run's configuration, whose ``seed`` must be ``S``.

    Returns:
        ``(label without the seed entry, S)``: ``diloco[seed=1]`` gives ``("diloco", 1)``,
        ``streaming[mixing=0.5,seed=2]`` gives ``("streaming[mixing=0.5]", 2)``; None for a
        run that is not one of several seeds'.
    """
    match = SEED_ENTRY.search(label)
    if not match or not SWEEP_LABEL.match(label) or config.get("seed") != int(match["seed"]):
        return None
    rest = label[:match.start()] + ("]" if match["sep"] == "," else "")
    return rest, int(match["seed"])


@dataclass
class Run:
    """A finished run directory.

    Args:
        label: the run's label (its directory's name unless given).
        path: the run directory.
        summary: its ``summary.json``: the record, or the file's content (read into the
            record).
        records: its ``metrics.jsonl`` records, in order.
    """

    label: str
    path: str
    summary: Summary
    records: list[dict]

    def __post_init__(self):
        if isinstance(self.summary, dict):
            self.summary = Summary.from_dict(self.summary)

    @property
    def algorithm(self) -> str:
        """The run's algorithm (``ddp``, ``diloco``, ...)."""
        return self.summary.algorithm

    @property
    def method(self) -> type[Method]:
        """The run's method class (``Method`` itself for a method not registered here)."""
        return methods().get(self.algorithm, Method)

    @property
    def seed(self) -> int | None:
        """The seed of a run of ``loco compare --seeds``, else None (see
        [`seed_point`][loco.report.runs.seed_point])."""
        seeded = seed_point(self.label, self.summary.config or {})
        return seeded[1] if seeded else None

    @property
    def group(self) -> str:
        """The label without a seed entry: the method (or grid point) the run is a seed of;
        the label itself for a run that is not one of several seeds'."""
        seeded = seed_point(self.label, self.summary.config or {})
        return seeded[0] if seeded else self.label

    @property
    def sweep(self) -> tuple[str, dict[str, Any]] | None:
        """``(base label, grid point)`` for a sweep's run, else None (see
        [`sweep_point`][loco.report.runs.sweep_point]); a seed is not part of the point."""
        return sweep_point(self.group, self.summary.config or {})

    @property
    def base(self) -> str:
        """The method's label without a sweep's grid point (or a seed)."""
        sweep = self.sweep
        return sweep[0] if sweep else self.group

    @property
    def method_name(self) -> str:
        """The method's display name without a sweep's grid point: the paper's name when
        the label is the algorithm's own."""
        algorithm = self.method.title or self.algorithm
        return algorithm if self.base == self.algorithm else f"{self.base} ({algorithm})"

    @property
    def name(self) -> str:
        """The run's display name: the method's, then a sweep's grid point (and a seed) as
        in its label (``Streaming DiLoCo [overlap=1,mixing=0.5]``, ``DiLoCo [seed=1]``)."""
        if self.sweep or self.seed is not None:
            return f"{self.method_name} [{SWEEP_LABEL.match(self.label)['point']}]"
        return self.method_name

    @property
    def group_name(self) -> str:
        """The display name without a seed: the method's (or grid point's) over its seeds;
        the same as ``name`` for a run that is not one of several seeds'."""
        if self.sweep:
            return f"{self.method_name} [{SWEEP_LABEL.match(self.group)['point']}]"
        return self.method_name


def load_run(path: str, label: str | None = None) -> Run:
    """Read a finished run directory.

    Args:
        path: the run directory, with ``summary.json`` (and ``metrics.jsonl``).
        label: its label; default: the directory's name.

    Raises:
        ConfigError: the summary is missing, unreadable, or not a loco run's.
    """
    summary_path = os.path.join(path, "summary.json")
    try:
        with open(summary_path) as f:
            summary = json.load(f)
        records = []
        metrics = os.path.join(path, "metrics.jsonl")
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("dirs", f"cannot read the run in {path}: {e}") from None
    if "final_eval_loss" not in summary or "config" not in summary:
        raise ConfigError("dirs", f"{summary_path} is not a loco run summary")
    return Run(label or os.path.basename(os.path.normpath(path)), path,
               Summary.from_dict(summary), records)


def find_runs(dirs: list[str]) -> list[Run]:
    """Runs in ``dirs``, in report order (see [`order_key`][loco.report.runs.order_key]).

    Args:
        dirs: each a run directory or a directory of run directories (a ``loco compare``
            output).

    Raises:
        ConfigError: a missing directory, one without a finished run, or two runs of the same
            name.
    """
    runs = []
    for d in dirs:
        if os.path.isfile(os.path.join(d, "summary.json")):
            runs.append(load_run(d))
            continue
        if not os.path.isdir(d):
            raise ConfigError("dirs", f"no such directory: {d}")
        found = sorted(e for e in os.listdir(d)
                       if os.path.isfile(os.path.join(d, e, "summary.json")))
        if not found:
            raise ConfigError("dirs", f"{d} holds no finished run (no summary.json in it or "
                              "in its subdirectories)")
        runs += [load_run(os.path.join(d, e)) for e in found]
    labels = [r.label for r in runs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError("dirs", f"two runs are named {', '.join(twice)}; give run "
                          "directories with different names")
    return sorted(runs, key=order_key)


def order_key(run: Run) -> tuple:
    """The report's order: the registered methods first, in their order, each one's own
    label before others, then labels; a sweep's runs by their grid point (numbers in
    numeric order, before other values); the seeds of one method (or point) by seed.

    Args:
        run: a run.
    """
    rank = {name: i for i, name in enumerate(methods())}
    sweep = run.sweep
    return (rank.get(run.algorithm, len(rank)),
            run.base != run.algorithm, run.base, sweep is not None,
            tuple(sortable(v) for v in sweep[1].values()) if sweep else (),
            -1 if run.seed is None else run.seed)


def sortable(value: Any) -> tuple:
    """A sort key: numbers (and numeric strings) in numeric order, before other values.

    Args:
        value: a grid point's value.
    """
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def sweep_groups(runs: list[Run]) -> list[tuple[tuple[str, ...], list[Run]]]:
    """A sweep's runs, grouped by the options swept over them.

    Args:
        runs: the runs, in report order.

    Returns:
        (swept options in ``--sweep`` order, their runs in report order) per group, in the
            order of their first run; empty when no run is part of a sweep.
    """
    groups: dict[tuple[str, ...], list[Run]] = {}
    for r in runs:
        sweep = r.sweep
        if sweep:
            groups.setdefault(tuple(sweep[1]), []).append(r)
    return list(groups.items())


def worker_ranks(run: Run) -> int:
    """R, the ranks of each of the run's workers (1 for runs saved before
    ``--worker-ranks``).

    Args:
        run: a run.
    """
    return run.summary.worker_ranks or 1
