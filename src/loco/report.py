"""Side-by-side reports of finished runs: ``report.md``, ``compare.json`` and plots.

Everything here is a function of the run directories on disk (each with ``summary.json`` and
``metrics.jsonl``), so ``loco report DIR...`` re-renders exactly what ``loco compare`` wrote,
without training. No torch import: reports render anywhere matplotlib does.

Runs of several seeds (``loco compare --seeds``, labels ending in ``seed=S]``) are reported
per method (per grid point) over their seeds: mean final eval loss ± half the seeds' range,
and the papers' claims checked seed by seed, each run against the run of the same seed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from loco.algorithms import Method, PaperClaim, methods
from loco.comm.formats import CODEC_BITS, DEFAULT_KEEP
from loco.comm.formats import SPARSE_CODEC_NAMES as SPARSE_CODECS
from loco.options import ConfigError

#: Options that are the same for every method of a comparison and not worth repeating per
#: method in the settings; ``out`` and ``progress`` say nothing about the run.
NOT_SETTINGS = {"out", "progress", "algorithm"}
#: Options that say where a run is written, not what it does: [`twin`][loco.report.twin]
#: runs may differ in them.
PLACE = frozenset({"out", "wandb_run_name"})


def codec_compression(codec: str, block: int = 32, keep: float | None = None) -> float:
    """How many times fewer bytes than fp32 a wire format sends per value, its scales
    included: ``32 / (bits + 8 / block)`` (1 for fp32, 2 for bf16, 7.53 for FP4 at block 32).

    The dropping codecs send ``keep`` of the values in fp32: ``32 / (32 keep + where)``,
    ``where`` the bits per value that say which were kept: ``topk``'s bitmap or 16-bit
    indices, whichever is smaller (rows up to 65536 values), none for ``dare`` and
    ``random_drop``, whose 8-byte seed per row is left out (6.4 for ``topk`` and 8 for the
    others at keep 1/8).

    Args:
        codec: a codec name, a key of ``CODEC_BITS``.
        block: values per scale byte of the 8- and 4-bit codecs, >= 1; default 32; ignored
            for the others.
        keep: the share of values the dropping codecs send, in (0, 1]; default None: 1/8;
            ignored for the others.

    Returns:
        The compression factor against fp32 (below 1 only for a dropping codec keeping
            nearly every value).

    Raises:
        KeyError: an unknown codec.
    """
    bits = CODEC_BITS[codec]
    if codec in SPARSE_CODECS:
        keep = DEFAULT_KEEP if keep is None else keep
        where = min(1.0, 16 * keep) if codec == "topk" else 0.0
        return 32 / (bits * keep + where)
    return 32 / (bits + 8 / block) if bits < 16 else 32 / bits


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


#: Downstream task metrics (``loco eval``) a report shows, by preference: both papers quote
#: accuracy, HellaSwag, PIQA and ARC-Easy usually length-normalized.
MAIN_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc", "word_perplexity",
                "perplexity")


def main_metric(entry: dict) -> tuple[str, float | None] | None:
    """A downstream task's headline metric: the first of ``MAIN_METRICS`` it has, else its
    first; None when it has none.

    Args:
        entry: the task's ``{metric: value}`` (``summary.json``'s ``downstream[task]``).
    """
    names = [k for k in entry if k not in ("samples", "shots")]
    for name in MAIN_METRICS:
        if name in entry:
            return name, entry[name]
    return (names[0], entry[names[0]]) if names else None


@dataclass
class Run:
    """A finished run directory.

    Args:
        label: the run's label (its directory's name unless given).
        path: the run directory.
        summary: its ``summary.json``.
        records: its ``metrics.jsonl`` records, in order.
    """

    label: str
    path: str
    summary: dict
    records: list[dict]

    @property
    def algorithm(self) -> str:
        """The run's algorithm (``ddp``, ``diloco``, ...)."""
        return self.summary["algorithm"]

    @property
    def method(self) -> type[Method]:
        """The run's method class (``Method`` itself for a method not registered here)."""
        return methods().get(self.algorithm, Method)

    @property
    def seed(self) -> int | None:
        """The seed of a run of ``loco compare --seeds``, else None (see
        [`seed_point`][loco.report.seed_point])."""
        seeded = seed_point(self.label, self.summary.get("config", {}))
        return seeded[1] if seeded else None

    @property
    def group(self) -> str:
        """The label without a seed entry: the method (or grid point) the run is a seed of;
        the label itself for a run that is not one of several seeds'."""
        seeded = seed_point(self.label, self.summary.get("config", {}))
        return seeded[0] if seeded else self.label

    @property
    def sweep(self) -> tuple[str, dict[str, Any]] | None:
        """``(base label, grid point)`` for a sweep's run, else None (see
        [`sweep_point`][loco.report.sweep_point]); a seed is not part of the point."""
        return sweep_point(self.group, self.summary.get("config", {}))

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
    return Run(label or os.path.basename(os.path.normpath(path)), path, summary, records)


def find_runs(dirs: list[str]) -> list[Run]:
    """Runs in ``dirs``, in report order (see [`order_key`][loco.report.order_key]).

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
            tuple(_sortable(v) for v in sweep[1].values()) if sweep else (),
            -1 if run.seed is None else run.seed)


def _sortable(value: Any) -> tuple:
    """Numbers (and numeric strings) in numeric order, before other values."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


# ------------------------------------------------------------------------------ numbers
def method_setting(run: Run) -> str:
    """The method's own knobs in one short phrase (``Method.setting``), and its pipeline
    stages.

    Args:
        run: a run.
    """
    text = run.method.setting(run.summary["config"])
    if run.summary.get("stages", 1) > 1:
        text += f", {run.summary['stages']} stages ({run.summary['routing']} routing)"
    return text


def comparison(runs: list[Run], out: str = ".") -> dict[str, dict]:
    """``compare.json``: per run label, its summary plus a ``compare`` entry with the numbers
    relative to DataParallel (and DiLoCo for the peak).

    Args:
        runs: the runs, in report order.
        out: the directory the report goes to; ``run_dir`` is relative to it.

    Returns:
        By label: every field of the run's ``summary.json`` and ``compare``: ``label``,
            ``method``, ``setting``, ``run_dir``, ``eval_loss_vs_ddp_pct``,
            ``ddp_bytes_over_bytes``, ``diloco_peak_over_peak`` (None where there is no such
            baseline), ``grad_codec`` (DataParallel's runs; None for others) and ``sweep`` (a
            sweep run's grid point; None for others) and ``downstream`` (``loco eval``'s
            headline metric of each task, ``{task: {"metric", "value"}}``; None for a run
            not evaluated). With several seeds, the baselines are the runs of the same seed,
            and ``compare`` adds ``seed`` and ``over_seeds``: its method's (grid point's)
            numbers over the seeds (see [`over_seeds`][loco.report.over_seeds]).
    """
    groups = dict(seed_groups(runs))
    numbers = {}
    for r in runs:
        peers = [p for p in runs if p.seed == r.seed]
        ddp, diloco = baseline(peers, "ddp"), baseline(peers, "diloco")
        s = r.summary
        sweep = r.sweep
        rel = {"label": r.label, "method": r.name, "setting": method_setting(r),
               "run_dir": os.path.relpath(r.path, out), "eval_loss_vs_ddp_pct": None,
               "ddp_bytes_over_bytes": None, "diloco_peak_over_peak": None,
               "grad_codec": r.method.wire(s["config"]),
               "sweep": sweep[1] if sweep else None,
               "downstream": {task: dict(zip(("metric", "value"), main_metric(entry)))
                              for task, entry in (s.get("downstream") or {}).items()
                              if main_metric(entry)} or None}
        if groups:
            rel.update(seed=r.seed, over_seeds=over_seeds(groups[r.group]))
        if ddp is not None:
            base = ddp.summary["final_eval_loss"]
            rel["eval_loss_vs_ddp_pct"] = 100 * (s["final_eval_loss"] - base) / base
            if s["bytes_sent_per_worker"]:
                rel["ddp_bytes_over_bytes"] = (ddp.summary["bytes_sent_per_worker"]
                                               / s["bytes_sent_per_worker"])
        if diloco is not None and s["peak_sync_bytes_per_worker"]:
            rel["diloco_peak_over_peak"] = (diloco.summary["peak_sync_bytes_per_worker"]
                                            / s["peak_sync_bytes_per_worker"])
        numbers[r.label] = {**s, "compare": rel}
    return numbers


def baseline(runs: list[Run], algorithm: str) -> Run | None:
    """The run that stands for ``algorithm`` in the comparisons: the one labelled with the
    algorithm's own name (a seed aside), else the first not part of a sweep, else the first.

    Args:
        runs: the runs, in report order.
        algorithm: an algorithm name.

    Returns:
        The run, or None when no run is of that algorithm.
    """
    cls = methods().get(algorithm)
    mine = [r for r in runs if r.method is cls]
    return next((r for r in mine if r.group == algorithm),
                next((r for r in mine if not r.sweep), mine[0] if mine else None))


# ------------------------------------------------------------------------------ seeds
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
    losses = [m.summary["final_eval_loss"] for m in members]
    return {"label": members[0].group, "seeds": [m.seed for m in members],
            "labels": [m.label for m in members], "final_eval_loss_per_seed": losses,
            "final_eval_loss_mean": sum(losses) / len(losses),
            "final_eval_loss_min": min(losses), "final_eval_loss_max": max(losses)}


#: Summary numbers a method's row over its seeds averages (bytes rounded to whole bytes).
MEAN_FIELDS = ("final_eval_loss", "bytes_sent_per_worker", "peak_sync_bytes_per_worker",
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
    summary = dict(members[0].summary)
    for key in MEAN_FIELDS:
        values = [m.summary.get(key) for m in members]
        if all(isinstance(v, (int, float)) for v in values):
            mean = sum(values) / len(values)
            summary[key] = round(mean) if all(isinstance(v, int) for v in values) else mean
    return Run(label, members[0].path, summary, [])


def seed_means(runs: list[Run]) -> list[Run]:
    """The runs a report's tables and sweep plots show: with several seeds, one
    [`mean_run`][loco.report.mean_run] per method (grid point); else the runs themselves.

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


def verdict(met: list[bool]) -> bool | None:
    """A claim's verdict over seeds: True if it holds on every seed, False if on none, None
    (mixed) otherwise.

    Args:
        met: whether it holds, per seed.
    """
    return True if all(met) else False if not any(met) else None


@dataclass
class Claim:
    """One of the papers' claims, checked on the runs of one seed.

    Args:
        text: the claim, naming the methods without a seed.
        measured: what was measured, as the report shows it.
        met: whether it holds.
        pair: a comparison's two values, the method's and its reference's (final eval
            losses, or replicas' spreads), whose gap in % of the reference's is the margin;
            None for other claims.
    """

    text: str
    measured: str
    met: bool
    pair: tuple[float, float] | None = None


def targets(runs: list[Run]) -> list[tuple[str, str, bool | None]]:
    """The papers' claims checked on these runs, seed by seed where there are several.

    Each seed's claims are checked on its own runs ([`claims`][loco.report.claims]), so a
    method is held against the run of the same seed. A loss claim over several seeds reads
    ``+1.20% (seeds: +0.8% to +1.6%; seed spread ±0.9% / ±1.1%)``: the margin's mean over
    the seeds, its range, and the half-range of each method's loss over the seeds in % of
    its mean; another claim gives its measure once where the seeds agree, else per seed.

    Args:
        runs: the runs, in report order.

    Returns:
        (claim, measured, met) per claim that these runs can check; with several seeds, met
            is a [`verdict`][loco.report.verdict]: None where the claim holds on some seeds
            only (mixed).
    """
    by_seed: dict[int | None, list[Run]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, []).append(r)
    if len(by_seed) == 1:
        return [(c.text, c.measured, c.met) for c in claims(runs)]
    merged: dict[str, dict[int | None, Claim]] = {}
    for seed, mine in by_seed.items():
        for c in claims(mine):
            merged.setdefault(c.text, {})[seed] = c
    return [(text, _measured_over_seeds(per_seed), verdict([c.met for c in per_seed.values()]))
            for text, per_seed in merged.items()]


def _measured_over_seeds(per_seed: dict[int | None, Claim]) -> str:
    """A claim's measured cell over seeds (see [`targets`][loco.report.targets])."""
    found = list(per_seed.values())
    if found[0].pair is None:
        texts = {c.measured for c in found}
        return (found[0].measured if len(texts) == 1 else
                "; ".join(f"seed {seed}: {c.measured}" for seed, c in per_seed.items()))
    gaps = [100 * (a - b) / b for a, b in (c.pair for c in found)]
    spreads = [half_range_pct([c.pair[i] for c in found]) for i in (0, 1)]
    return (f"{sum(gaps) / len(gaps):+.2f}% (seeds: {min(gaps):+.1f}% to {max(gaps):+.1f}%; "
            f"seed spread ±{spreads[0]:.1f}% / ±{spreads[1]:.1f}%)")


def twin(runs: list[Run], run: Run, also_free: tuple[str, ...] = (), **want: Any
         ) -> Run | None:
    """Another run of ``run``'s algorithm that holds ``want`` and is otherwise configured as
    ``run`` is, but for where it is written (``PLACE``) and the options ``also_free``: the
    reference a claim holds ``run`` against.

    Args:
        runs: the runs of one seed.
        run: the run.
        also_free: more options the two may differ in.
        **want: option values the twin must have (and ``run`` may not).
    """
    free = PLACE | set(want) | set(also_free)

    def rest(r: Run) -> dict:
        return {k: v for k, v in r.summary["config"].items() if k not in free}

    return next((r for r in runs if r is not run and r.method is run.method
                 and all(r.summary["config"].get(k) == v for k, v in want.items())
                 and rest(r) == rest(run)), None)


def reference(runs: list[Run], run: Run, claim: PaperClaim, by: dict[str, Run]
              ) -> Run | None:
    """The run a claim about ``run`` holds it against; None without one.

    A twin ([`twin`][loco.report.twin]) holding the claim's ``want`` where ``run`` holds
    none of it (``FP4 ≈ fp32``: a Streaming run in fp32); or the named method's run holding
    ``want`` (NoLoCo against a DiLoCo run with heavy-ball momentum, the NoLoCo paper's),
    else that method's baseline run.

    Args:
        runs: the runs of one seed.
        run: the run the claim is about.
        claim: the claim.
        by: each method's [`baseline`][loco.report.baseline] run, by name.
    """
    config = run.summary["config"]
    if claim.against == "twin":
        if any(config.get(k) == v for k, v in claim.want.items()):
            return None
        return twin(runs, run, claim.free, **claim.want)
    cls = methods().get(claim.against)
    preferred = (next((r for r in runs if r.method is cls and not r.sweep and all(
        r.summary["config"].get(k) == v for k, v in claim.want.items())), None)
        if claim.want else None)
    return preferred or by.get(claim.against)


def mean_spread(run: Run) -> float | None:
    """The mean of the replicas' RMS spread over a run's logged measures (``--spread-every``);
    None where none was logged.

    Args:
        run: a run.
    """
    spreads = [rec["spread"] for rec in run.records if rec.get("spread") is not None]
    return sum(spreads) / len(spreads) if spreads else None


def routing_claim(runs: list[Run]) -> list[Claim]:
    """NoLoCo's claim that random pipeline routing lowers the replicas' spread (the paper:
    by 10-15%): each run with random routing against its [`twin`][loco.report.twin] with
    fixed routing (labelled runs, or a ``--sweep routing=fixed,random``), by their mean spread
    over the run ([`mean_spread`][loco.report.mean_spread]).

    Args:
        runs: the runs of one seed.

    Returns:
        One Claim per such pair (none without one).
    """
    rows = []
    for routed in runs:
        fixed = (twin(runs, routed, routing="fixed")
                 if routed.summary["config"].get("routing") == "random" else None)
        if fixed is None:
            continue
        a, b = mean_spread(routed), mean_spread(fixed)
        if a is None or b is None or not b:
            continue
        change = 100 * (a - b) / b
        rows.append(Claim(f"random routing lowers the replicas' spread: {routed.group_name} "
                          f"below {fixed.group_name}", f"{change:+.2f}%", change < 0, (a, b)))
    return rows


def claims(runs: list[Run]) -> list[Claim]:
    """The papers' claims checked on the runs of one seed (or of no seed): every method's
    declared claims (``Method.claims``) on its [`baseline`][loco.report.baseline] run, each
    against its [`reference`][loco.report.reference], then random routing against fixed
    ([`routing_claim`][loco.report.routing_claim]).

    Args:
        runs: the runs, in report order, of one seed.

    Returns:
        One Claim per claim that these runs can check.
    """
    by = {a: r for a in methods() if (r := baseline(runs, a)) is not None}
    rows = []
    for run in by.values():
        for claim in run.method.claims:
            ref = reference(runs, run, claim, by)
            if ref is not None:
                rows.append(CHECKS[claim.kind](run, ref, claim))
    return rows + routing_claim(runs)


def loss_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``run``'s final eval loss at most ``claim.limit`` % above ``ref``'s."""
    la, lb = run.summary["final_eval_loss"], ref.summary["final_eval_loss"]
    gap = 100 * (la - lb) / lb
    text = (claim.text or "within {limit:g}% of {ref}'s").format(limit=claim.limit,
                                                                   ref=ref.group_name)
    return Claim(f"{run.group_name} eval loss {text}", f"{gap:+.2f}%", gap <= claim.limit,
                 (la, lb))


def bytes_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``ref`` sends at least ``claim.limit`` times ``run``'s bytes per worker."""
    sent = run.summary["bytes_sent_per_worker"]
    ratio = ref.summary["bytes_sent_per_worker"] / sent if sent else float("inf")
    wire = ref.method.wire(ref.summary["config"])
    note = f" ({ref.group_name}'s gradients in {wire})" if wire else ""
    return Claim(f"{ref.group_name} sends at least {claim.limit:g}× the bytes of "
                 f"{run.group_name}", f"{_ratio(ratio)}{note}", ratio >= claim.limit)


def peak_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``run``'s peak sync about P times below ``ref``'s from the fragments alone: a
    narrower codec alone makes the peak smaller (``ref`` sends fp32), so its share is
    factored out, and what is left must be at least 0.9 P."""
    config = run.summary["config"]
    p = config["fragments"]
    peak = run.summary["peak_sync_bytes_per_worker"]
    ratio = ref.summary["peak_sync_bytes_per_worker"] / peak if peak else float("inf")
    codec = config.get("codec", "fp32")
    squeeze = codec_compression(codec, config.get("codec_block", 32), config.get("codec_keep"))
    frag = ratio / squeeze
    # What the split allows at best: the whole model against the largest fragment.
    largest = max((f["elements"] for f in run.summary.get("fragments") or []), default=0)
    cap = (f"; the largest fragment allows {_ratio(run.summary['model_parameters'] / largest)}"
           if largest else "")
    return Claim(f"{run.group_name}'s peak sync about P={p}× below {ref.group_name}'s, from "
                 f"the fragments alone", f"{_ratio(frag)} ({_ratio(ratio)} in all, "
                 f"{_ratio(squeeze)} of it from {codec}{cap})", frag >= 0.9 * p)


#: How each kind of declared claim (``loco.algorithms.PaperClaim.kind``) is checked.
CHECKS = {"loss": loss_claim, "bytes": bytes_claim, "peak": peak_claim}


# ------------------------------------------------------------------------------ markdown
def _ratio(x: float | None) -> str:
    if x is None:
        return "–"
    if x == float("inf"):
        return "∞"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}%"


def _sent(run: Run) -> str:
    """Bytes sent per worker; DataParallel's with its gradients' wire format."""
    sent = f"{run.summary['bytes_sent_per_worker']:,}"
    wire = run.method.wire(run.summary["config"])
    return f"{sent} ({wire})" if wire else sent


def worker_ranks(run: Run) -> int:
    """R, the ranks of each of the run's workers (1 for runs saved before
    ``--worker-ranks``).

    Args:
        run: a run.
    """
    return run.summary.get("worker_ranks") or 1


def _link_bytes(run: Run, link: str) -> str:
    """Bytes a worker sent over the ``slow`` or ``fast`` link, its ranks together."""
    value = run.summary.get(f"{link}_link_bytes_sent_per_worker")
    return "–" if value is None else f"{value:,}"


def table(runs: list[Run], numbers: dict[str, dict],
          seeds: dict[str, list[Run]] | None = None) -> list[str]:
    """The report's main table, one row per run, as markdown lines. Where a run has workers
    of several ranks, two columns add the bytes a worker sent over the slow link and over
    the fast link inside it, its ranks together.

    Args:
        runs: the runs, in report order; with ``seeds``, one
            [`mean_run`][loco.report.mean_run] per method.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.comparison]),
            of ``runs``.
        seeds: each mean run's runs by its label (``seed_groups``): a column lists their
            seeds and the loss reads ``mean ± half-range (min–max)``; default: none.
    """
    link = any(r.summary.get("link") for r in runs)
    ranks = any(worker_ranks(r) > 1 for r in runs)
    head = ["method", "setting", "final eval loss", "vs DataParallel", "sent / worker (B)",
            "peak sync / worker (B)", "DataParallel ÷ sent", "wall time (s)", "tokens/s"]
    if ranks:
        head[6:6] = ["slow link / worker (B)", "fast link / worker (B)"]
    if link:
        head.append("compute utilization")
    if seeds:
        head[2:3] = ["seeds", "final eval loss, mean ± half-range (min–max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s, rel = r.summary, numbers[r.label]["compare"]
        row = [r.name, rel["setting"], f"{s['final_eval_loss']:.4f}",
               _pct(rel["eval_loss_vs_ddp_pct"]), _sent(r),
               f"{s['peak_sync_bytes_per_worker']:,}",
               "∞" if rel["eval_loss_vs_ddp_pct"] is not None and not s["bytes_sent_per_worker"]
               else _ratio(rel["ddp_bytes_over_bytes"]),
               f"{s['wall_seconds']:.1f}", f"{s['tokens_per_second']:,.0f}"]
        if ranks:
            row[6:6] = [_link_bytes(r, "slow"), _link_bytes(r, "fast")]
        if link:
            row.append(f"{s['compute_utilization']:.1%}")
        if seeds:
            row[2:3] = [", ".join(str(m.seed) for m in seeds[r.label]),
                        loss_spread(seeds[r.label])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


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
    scored = [r for r in runs if r.summary.get("downstream")]
    if not scored:
        return []
    metrics: dict[str, str] = {}
    for r in scored:
        for task, entry in r.summary["downstream"].items():
            found = main_metric(entry)
            if found and task not in metrics:
                metrics[task] = found[0]
    entries = [e for r in scored for e in r.summary["downstream"].values()]
    shots = {e.get("shots") for e in entries}
    head = ["method"]
    for task, metric in metrics.items():
        docs = {r.summary["downstream"][task].get("samples") for r in scored
                if task in r.summary["downstream"]}
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
            value = (r.summary.get("downstream") or {}).get(task, {}).get(metric)
            row.append("–" if value is None else f"{value:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


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


def _value(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def sweep_tables(runs: list[Run], numbers: dict[str, dict]) -> list[str]:
    """The sweep section of the report: per group of swept options, one row per grid point
    with its final eval loss and bytes, as markdown lines.

    Args:
        runs: the runs, in report order.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.comparison]).

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
                [r.method_name, *(_value(v) for v in r.sweep[1].values()),
                 f"{s['final_eval_loss']:.4f}", _pct(rel["eval_loss_vs_ddp_pct"]), _sent(r),
                 f"{s['peak_sync_bytes_per_worker']:,}", _ratio(rel["ddp_bytes_over_bytes"])])
                + " |")
        if ddp is not None:
            lines += ["", f"For reference, {ddp.name}: {ddp.summary['final_eval_loss']:.4f}, "
                      f"{_sent(ddp)} bytes per worker."]
    return lines


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
        xs = sorted({_value(r.sweep[1][x]) for r in members}, key=_sortable)
        numeric = all(_sortable(v)[0] == 0 for v in xs)
        lines: dict[str, list[tuple[float, float, int]]] = {}
        for r in members:
            point = r.sweep[1]
            name = ", ".join([r.method_name] + [f"{k}={_value(point[k])}" for k in others])
            pos = float(_value(point[x])) if numeric else xs.index(_value(point[x]))
            lines.setdefault(name, []).append(
                (pos, r.summary["final_eval_loss"], r.summary["bytes_sent_per_worker"]))
        ticks = [(float(v) if numeric else i, v) for i, v in enumerate(xs)]
        references = [(r.name, r.summary["final_eval_loss"], r.summary["bytes_sent_per_worker"])
                      for r in bases if r not in members]
        name = "sweep_" + "_".join(keys) + ".png"
        sent = {r.summary["bytes_sent_per_worker"] for r in members}
        plot_sweep(os.path.join(out, name), x, ticks, list(lines.items()), references,
                   show_bytes=len(sent) > 1 and max(sent) > 0)
        written.append(name)
    return written


def settings(runs: list[Run]) -> list[str]:
    """Options shared by every run (as YAML), then those that differ, per run, as markdown
    lines.

    Args:
        runs: the runs, in report order.
    """
    import yaml

    configs = [r.summary["config"] for r in runs]
    keys = [k for k in configs[0] if k not in NOT_SETTINGS]
    shared = {k: configs[0][k] for k in keys
              if all(c.get(k) == configs[0][k] for c in configs)}
    differ = [k for k in keys if k not in shared]
    lines = ["Shared by every method (`loco train` options):", "", "```yaml",
             yaml.safe_dump(shared, sort_keys=False).rstrip(), "```"]
    if differ:
        lines += ["", "Per method:", "", "| method | " + " | ".join(differ) + " |",
                  "|" + "---|" * (len(differ) + 1)]
        lines += ["| " + " | ".join([r.name] + [str(r.summary["config"].get(k)) for k in differ])
                  + " |" for r in runs]
    return lines


def machine(runs: list[Run]) -> list[str]:
    """The machines the runs recorded, as markdown lines.

    Args:
        runs: the runs.
    """
    seen = []
    for r in runs:
        m = r.summary.get("machine")
        if m and m not in seen:
            seen.append(m)
    if not seen:
        return ["Not recorded in these runs' summaries."]
    lines = []
    for m in seen:
        lines.append(f"- {m['hostname']}: {m['cpu']} ({m['cpu_count']} cores)"
                     + (f", {m['accelerator']}" if m.get("accelerator") else ", no accelerator")
                     + f"; {m['platform']}; Python {m['python']}, torch {m['torch']}")
    devices = sorted({r.summary.get("device", "?") for r in runs})
    launchers = sorted({r.summary.get("launcher", "?") for r in runs})
    lines.append(f"- device {', '.join(devices)}; launcher {', '.join(launchers)}")
    return lines


def render_markdown(runs: list[Run], numbers: dict[str, dict], plots: list[str]) -> str:
    """``report.md``. With several seeds, the main table and the sweep's give each method
    (grid point) over its seeds, and an **Every run** table lists the runs themselves.

    Args:
        runs: the runs, in report order.
        numbers: ``compare.json``'s contents (see [`comparison`][loco.report.comparison]).
        plots: the plots' file names, relative to the report.
    """
    groups = seed_groups(runs)
    shown = seed_means(runs)
    shown_numbers = comparison(shown) if groups else numbers
    lines = ["# loco compare", ""] + intro(runs)
    lines += table(shown, shown_numbers, dict(groups) or None)
    lines += claims_table(runs)
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


#: The smallest tokens per parameter of the papers' runs (Streaming DiLoCo's 1B model on 25B
#: tokens); the regime sentence holds a comparison's against it.
PAPER_TOKENS_PER_PARAMETER = 25


def regime(runs: list[Run]) -> str:
    """One sentence saying what regime the runs are in against the papers': training tokens
    per model parameter and outer steps (per H the runs use).

    Args:
        runs: the runs, in report order.
    """
    first = runs[0].summary
    ratio = first["tokens"] / first["model_parameters"]
    hs = sorted({r.summary["config"]["sync_every"] for r in runs
                 if "sync_every" in r.method.uses()})
    outer = " and".join(f" {first['inner_steps'] // h} outer steps at H = {h}" for h in hs)
    early = ratio < PAPER_TOKENS_PER_PARAMETER
    return (f"Regime: {ratio:.2g} training tokens per model parameter"
            + (f",{outer}" if hs else "") + "; the papers train on "
            f"{PAPER_TOKENS_PER_PARAMETER} or more tokens per parameter (Streaming DiLoCo's "
            "1B model: 25B and 250B tokens) with H = 30 to 500"
            + (", so these runs compare the methods early in training, while the loss still "
               "falls fast." if early else "."))


def intro(runs: list[Run]) -> list[str]:
    """The report's opening paragraphs, as markdown lines: the job, its regime (see
    [`regime`][loco.report.regime]), then how to read the numbers (and, with several seeds,
    the table's means).

    Args:
        runs: the runs, in report order.
    """
    first = runs[0].summary
    link = next((r.summary["link"] for r in runs if r.summary.get("link")), None)
    kind = "runs" if any(r.sweep for r in runs) else "methods"
    ranks = worker_ranks(runs[0])
    groups = seed_groups(runs)
    seeds = seeds_of(runs) if groups else []
    count = (f"{len(groups)} {kind}, each with {len(seeds)} seeds," if groups
             else f"{len(runs)} {kind}")
    seed = (f"seeds {', '.join(map(str, seeds))}" if seeds
            else f"seed {first['config']['seed']}")
    lines = [f"{count} on the same job: {first['config']['model']} model "
             f"({first['model_parameters']:,} parameters), {first['workers']} workers"
             + (f" of {ranks} ranks ({first.get('worker_parallel', 'ddp')})" if ranks > 1
                else "") + ", "
             f"{first['inner_steps']} inner steps, {first['tokens']:,} training tokens each, "
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
    """The section of the papers' claims ([`targets`][loco.report.targets]), as markdown
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


def write_report(runs: list[Run], out: str) -> dict[str, dict]:
    """Write ``report.md``, ``compare.json`` and the plots (a sweep's too) into ``out``.
    Files are written whole (temporary file, then rename).

    Args:
        runs: the runs, in report order (see [`find_runs`][loco.report.find_runs]).
        out: the directory to write into (created if missing).

    Returns:
        ``compare.json``'s contents.
    """
    from loco.plot import plot_comparison

    os.makedirs(out, exist_ok=True)
    numbers = comparison(runs, out)
    plots = plot_comparison(runs, out) + sweep_plots(seed_means(runs), out)
    _write(os.path.join(out, "compare.json"), json.dumps(numbers, indent=2) + "\n")
    _write(os.path.join(out, "report.md"), render_markdown(runs, numbers, plots))
    return numbers


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
