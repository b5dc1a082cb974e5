"""``loco compare``: several methods on the same job, one after another, then a report.

Every method trains the same model on the same data with the same seed and token budget;
only the method and its own knobs differ. Each run keeps its own directory under ``--out``
(``metrics.jsonl``, ``summary.json``, ``loss.png``, ``comm/``), and :mod:`loco.report` writes
``report.md``, ``compare.json`` and the plots from those directories, as ``loco report`` does
later without training.

Option precedence, lowest first: ``loco train``'s defaults, the ``--preset``, the YAML
``--config``, the flags; per method, then, the preset's and the YAML's ``methods:`` entries,
``--set LABEL.OPTION=VALUE`` and, last, the ``--sweep`` values of each grid point.

A sweep (``--sweep OPTION=VALUES``, repeatable) runs every method that a swept option applies
to once per point of the grid (the cartesian product of the options' values), under labels
such as ``streaming[overlap=1,mixing=0.5]``; the report then adds the papers' ablation view:
final eval loss (and bytes) against the swept value, one line per value of the other options.

Several seeds (``--seeds 0,1,2``) run every method (every grid point) once per seed, under
labels such as ``diloco[seed=1]`` or ``streaming[mixing=0.5,seed=2]``: the seed is one more
swept option, the last, that applies to every method. The report then gives each method's
mean over its seeds with their spread, and checks the papers' claims seed by seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import yaml

from loco.algorithms import methods as registered
from loco.config import RENAMED, ConfigError, TrainConfig, algorithm_names, coerce, load_yaml

#: Options every method must share: the same model, data, seed and token budget (and the
#: same machine and network), so that only the methods differ. ``stages`` and ``routing`` (a
#: replica's pipeline layout: the same model and tokens) may differ, to compare routings.
SHARED = ("model", "layers", "dim", "heads", "steps", "tokens", "workers",
          "worker_ranks", "worker_parallel", "batch_size", "seq_len", "seed", "corpus",
          "text_field", "vocab_size", "val_fraction", "cache_dir", "dtype", "eval_every",
          "eval_batches", "final_eval_batches", "log_every", "launcher", "link_bandwidth",
          "link_latency", "fast_link_bandwidth", "fast_link_latency", "out", "progress",
          "resume", "tokenizer", "eval_corpus", "tensorboard", "wandb", "wandb_project",
          "wandb_mode")


def only_for(option: str) -> tuple[str, ...]:
    """The methods an option means something to, where it is some methods' only (their
    ``Method.uses``); every method's name otherwise (the inner optimizer's lr, adam_betas,
    weight_decay, z_loss, ...). --set (or a preset's, a YAML file's per-method entry, a
    --sweep) of an option elsewhere is an error.

    Args:
        option: an option's field name.
    """
    users = tuple(name for name, cls in registered().items() if option in cls.uses())
    return users or algorithm_names()


#: The outer optimizer for tens of outer steps, chosen by the sweeps of docs/claims.md: for
#: DiLoCo (outer lr 0.3-3 x momentum 0 / Nesterov 0.9 x H 10 / 30, tiny and small models, 300
#: and 900 steps) the papers' Nesterov 0.9 overshoots there, and no momentum at lr 1 (the
#: workers' average) was best or within 1.5% of best at every H, model and budget; for
#: NoLoCo (beta 0.7 / 1 x alpha 0 / 0.5, tiny model) beta 1 without momentum was best too.
FEW_OUTER_STEPS = {"outer_lr": 1.0, "outer_momentum": 0.0}

#: Named settings. ``shared`` options apply to every method; ``methods`` maps an algorithm
#: or a label to its own options (an algorithm's entry applies to every method of that
#: algorithm, a label's to that method only, in the order listed, so a label's entry after its
#: algorithm's wins); ``algorithms``, where given, is the preset's own ``--algorithms``;
#: ``seeds``, where given, its ``--seeds`` (a ``--seed`` replaces them with one run).
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "about": "the small model (1.3M parameters) on Shakespeare, 4 workers of 4 x 128 "
                 "tokens, 300 steps, H = 30 (10 outer steps), the outer optimizer the "
                 "sweeps chose for so few outer steps (lr 1, no momentum: docs/claims.md): "
                 "all five methods in about 8 minutes on a 2-core CPU",
        "shared": {"model": "small", "workers": 4, "steps": 300, "batch_size": 4,
                   "seq_len": 128, "warmup": 30, "eval_every": 50, "eval_batches": 8,
                   "final_eval_batches": 50, "log_every": 10},
        "methods": {"diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "noloco": {"sync_every": 30, "spread_every": 10, **FEW_OUTER_STEPS},
                    "streaming": {"sync_every": 30, "fragments": 2, "overlap": "1",
                                  "codec": "fp4_e3m0", **FEW_OUTER_STEPS},
                    "local": {"spread_every": 10}},
    },
    "evidence": {
        "about": "the papers' headline claims tested over 3 seeds in about 30 minutes on a "
                 "2-core CPU: the tiny model (0.16M parameters) on Shakespeare, 4 workers of "
                 "4 x 128 tokens, 900 steps (12 tokens per parameter), H = 30 (30 outer "
                 "steps) with the outer optimizer the sweeps chose (lr 1, no momentum) for "
                 "DiLoCo, Streaming DiLoCo (FP4, and its fp32 twin) and NoLoCo (also in 2 "
                 "pipeline stages with fixed and with random routing), Local and "
                 "DataParallel",
        "algorithms": "ddp,diloco,streaming,streaming-fp32=streaming,noloco,noloco-pp=noloco,"
                      "noloco-routed=noloco,local",
        "seeds": [0, 1, 2],
        "shared": {"model": "tiny", "workers": 4, "steps": 900, "batch_size": 4,
                   "seq_len": 128, "warmup": 30, "eval_every": 100, "eval_batches": 8,
                   "final_eval_batches": 50, "log_every": 20},
        "methods": {"diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "streaming": {"sync_every": 30, "fragments": 2, "overlap": "1",
                                  "mixing": 0.5, "codec": "fp4_e3m0", **FEW_OUTER_STEPS},
                    "streaming-fp32": {"codec": "fp32"},
                    "noloco": {"sync_every": 30, "spread_every": 10, **FEW_OUTER_STEPS},
                    "noloco-pp": {"stages": 2},
                    "noloco-routed": {"stages": 2, "routing": "random"},
                    "local": {"spread_every": 10}},
    },
    "paper": {
        "about": "the papers' settings at the size of their smaller runs, for one GPU machine "
                 "(bring a large --corpus): the large model (12 layers, d=768, ~88M "
                 "parameters at vocab 4096), M = 4 workers, seq 1024, bf16, z-loss 1e-4; "
                 "DataParallel with bf16 gradients; inner AdamW (0.9, 0.95), wd 0.1, except "
                 "NoLoCo's Adam (0.9, 0.999), wd 0; H = 100 (Streaming: 4 fragments of 3 "
                 "layers, τ = 1, α = 0.5, FP4), NoLoCo H = 50, n = 2; and diloco-hb, the "
                 "NoLoCo paper's DiLoCo baseline (H = 100, heavy-ball momentum 0.3, NoLoCo's "
                 "inner optimizer)",
        "algorithms": "ddp,diloco,diloco-hb=diloco,streaming,noloco,local",
        "shared": {"model": "large", "workers": 4, "steps": 8800, "batch_size": 16,
                   "seq_len": 1024, "dtype": "bf16", "lr": 4e-4, "warmup": 1000,
                   "weight_decay": 0.1, "adam_betas": "0.9,0.95", "z_loss": 1e-4,
                   "eval_every": 500, "eval_batches": 32, "final_eval_batches": 200,
                   "log_every": 50, "comm_timeout": 1800.0},
        "methods": {"ddp": {"grad_codec": "bf16"},
                    "diloco": {"sync_every": 100},
                    # The NoLoCo paper's DiLoCo baseline: its code's heavy-ball outer
                    # momentum 0.3 at H = 100, with NoLoCo's inner optimizer.
                    "diloco-hb": {"sync_every": 100, "nesterov": False, "outer_momentum": 0.3,
                                  "adam_betas": "0.9,0.999", "weight_decay": 0.0},
                    "streaming": {"sync_every": 100, "fragments": 4, "overlap": "1",
                                  "mixing": 0.5, "codec": "fp4_e3m0"},
                    "noloco": {"sync_every": 50, "group_size": 2, "spread_every": 100,
                               "adam_betas": "0.9,0.999", "weight_decay": 0.0},
                    "local": {"spread_every": 100}},
    },
}

LABEL = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


@dataclass
class Method:
    """One run of a comparison.

    Args:
        label: its run directory and its key in ``compare.json``; a sweep's runs are
            ``BASE[OPTION=VALUE,...]``.
        algorithm: a registered method's name.
        options: its own options by field name, on top of the shared ones.
        point: for a sweep's run, the swept options' values at its grid point (by field
            name, in ``--sweep`` order, ``seed`` last with ``--seeds``); empty otherwise.
    """

    label: str
    algorithm: str
    options: dict[str, Any] = field(default_factory=dict)
    point: dict[str, Any] = field(default_factory=dict)


def parse_methods(text: str | list) -> list[Method]:
    """The methods of ``--algorithms``.

    Args:
        text: ``ddp,diloco,s8=streaming`` (or a list of its items): algorithm names, or
            ``label=algorithm`` for a second run of an algorithm with other options.

    Returns:
        The methods, in the order given, without options.

    Raises:
        ConfigError: an unknown algorithm, a bad or repeated label, or no method at all.
    """
    items = text if isinstance(text, list) else str(text).split(",")
    methods = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        label, _, algorithm = item.partition("=") if "=" in item else (item, "", item)
        label, algorithm = label.strip(), algorithm.strip()
        if algorithm not in algorithm_names():
            raise ConfigError("algorithms", f"unknown method {algorithm!r}; choose from "
                              f"{', '.join(algorithm_names())} (or LABEL=METHOD)")
        if not LABEL.match(label):
            raise ConfigError("algorithms", f"label {label!r} must be lower-case letters, "
                              "digits, '-' or '_', starting with a letter")
        if any(m.label == label for m in methods):
            raise ConfigError("algorithms", f"{label!r} is listed twice; name a second run "
                              f"LABEL={algorithm}")
        methods.append(Method(label, algorithm))
    if not methods:
        raise ConfigError("algorithms", "name at least one method")
    return methods


def method_option(method: Method, option: str, value: Any, source: str) -> None:
    """Set one per-method option, refusing what would make the comparison unfair or means
    nothing to that method.

    Args:
        method: the method; its ``options`` get the converted value.
        option: the option's name (dashes or underscores).
        value: the value (as YAML reads it); converted to the option's type.
        source: where it was given, for the error message (``--set``, a file, a preset).

    Raises:
        ConfigError: an unknown option, one that must be shared (``SHARED``), one that does
            not apply to the method's algorithm (``only_for``), or a value of the wrong type.
    """
    by_name = {f.name: f for f in TrainConfig.fields()}
    name = option.replace("-", "_")
    where = f"{source} {method.label}.{option}"
    if name not in by_name or name == "algorithm":
        raise ConfigError("set", f"{where}: unknown option {option!r} (see loco train --help)")
    if name in SHARED:
        raise ConfigError("set", f"{where}: --{option.replace('_', '-')} must be the same for "
                          "every method (same model, data, seed and token budget); give it "
                          "once, without a method")
    allowed = only_for(name)
    if method.algorithm not in allowed:
        raise ConfigError("set", f"{where}: --{name.replace('_', '-')} does not apply to "
                          f"{method.algorithm} (only to {', '.join(allowed)})")
    try:
        method.options[name] = coerce(by_name[name], value)
    except ConfigError as e:
        raise ConfigError("set", f"{where}: {e}") from None


def parse_sets(items: list[str], methods: list[Method]) -> None:
    """Apply ``--set LABEL.OPTION=VALUE`` items (VALUE is read as YAML: 4, 0.5, true, fp32).

    Args:
        items: the ``--set`` values.
        methods: the methods; the labelled one's ``options`` are set.

    Raises:
        ConfigError: a malformed item, an unknown label, or what
            [`method_option`][loco.compare.method_option] refuses.
    """
    by_label = {m.label: m for m in methods}
    for item in items:
        key, eq, raw = item.partition("=")
        label, dot, option = key.strip().partition(".")
        if not (eq and dot and option):
            raise ConfigError("set", f"{item!r} must look like LABEL.OPTION=VALUE, e.g. "
                              "streaming.fragments=4")
        if label not in by_label:
            raise ConfigError("set", f"{item!r}: no method {label!r} in --algorithms "
                              f"({', '.join(by_label)})")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        option = RENAMED.get(option.replace("-", "_"), option)
        method_option(by_label[label], option, value, "--set")


# ------------------------------------------------------------------------------ sweeps
#: Options whose one value may itself be a comma list: Streaming's τ per worker (``1,1,2,5``)
#: and the inner AdamW betas (``0.9,0.95``). Their ``--sweep`` values are separated by ``;``.
LIST_OPTIONS = ("overlap", "adam_betas")
#: Options no sweep may vary, besides ``SHARED``: they say nothing about the training.
NOT_SWEPT = ("algorithm", "out", "progress", "resume")
#: A swept value as written: it becomes part of a run directory's name.
SWEEP_VALUE = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$")


@dataclass
class Sweep:
    """One swept option of ``--sweep OPTION=VALUES``.

    Args:
        option: the option's field name (``overlap``, ``sync_every``).
        values: its values, converted to the option's type, in the order given.
        texts: the same values as written, for the runs' labels.
    """

    option: str
    values: list[Any]
    texts: list[str]

    def applies_to(self, algorithm: str) -> bool:
        """Whether this option means something to ``algorithm`` (``only_for``).

        Args:
            algorithm: an algorithm name.
        """
        return algorithm in only_for(self.option)


def split_sweep_values(option: str, text: str) -> list[str]:
    """The values of one ``--sweep OPTION=VALUES``, as written.

    Values are separated by ``,``, or by ``;`` when ``text`` holds one: a value of
    ``overlap`` or ``adam_betas`` (``LIST_OPTIONS``) may itself be a comma list, so theirs
    must be separated by ``;`` as soon as one holds a comma (``overlap=1;1,1,2,5``); a comma
    list alone is refused as ambiguous.

    Args:
        option: the option's field name.
        text: what follows ``OPTION=``.

    Returns:
        The values, stripped, at least one.

    Raises:
        ConfigError: no value, an empty value, or an ambiguous comma list.
    """
    if ";" in text:
        items = text.split(";")
    elif option in LIST_OPTIONS and "," in text:
        raise ConfigError("sweep", f"{option}={text} is ambiguous: a value of {option} may "
                          "itself be a comma list; separate the values with ';' (quoted): "
                          f"'{option}=" + ";".join(text.split(",")) + "' for one run per "
                          f"value, or '{option}=1;{text}' to set it against a single "
                          "value (give one list alone with --" + option.replace("_", "-") + ")")
    else:
        items = text.split(",")
    values = [v.strip() for v in items]
    if not text.strip() or any(not v for v in values):
        raise ConfigError("sweep", f"{option}={text}: empty value; give VALUES separated "
                          "by ',' (or by ';' when a value holds a comma), e.g. overlap=0;1;2 "
                          "or mixing=0,0.5")
    return values


def parse_sweeps(items: list[str] | None, methods: list[Method],
                 given: dict[str, Any] | None = None) -> list[Sweep]:
    """The grid of ``--sweep OPTION=VALUES`` items (and a YAML file's ``sweep:``), checked
    against the methods before anything runs.

    Args:
        items: the ``--sweep`` values, each ``OPTION=VALUES`` (see
            [`split_sweep_values`][loco.compare.split_sweep_values]); VALUES are read as
            YAML, as ``--set``'s.
        methods: the methods of ``--algorithms``.
        given: a YAML file's ``sweep:`` mapping, option: a list of values (or a string read
            as a flag's VALUES); a flag for the same option replaces it.

    Returns:
        One Sweep per option, in the order given (the YAML file's first); the first is the
        x axis of the report's sweep plots.

    Raises:
        ConfigError: naming ``--sweep``: a malformed item, an unknown option, an option that
            must be shared by every method or applies to none of ``methods``, an option given
            twice, an empty or repeated value, a value of the wrong type or with characters a
            directory name should not hold.
    """
    raw = _sweep_texts(items, given)
    algorithms = sorted({m.algorithm for m in methods}, key=algorithm_names().index)
    return [_sweep(name, texts, algorithms, methods) for name, texts in raw.items()]


def _sweep_texts(items: list[str] | None, given: dict[str, Any] | None
                 ) -> dict[str, list[str]]:
    """The values' texts by option: the YAML file's ``sweep:``, then the flags (a flag for
    the same option replaces the file's)."""
    raw: dict[str, list[str]] = {}
    if given is not None:
        if not isinstance(given, dict):
            raise ConfigError("sweep", "a YAML file's 'sweep' must map an option to a list "
                              "of values")
        for option, values in given.items():
            name = RENAMED.get(str(option).replace("-", "_"), str(option).replace("-", "_"))
            if isinstance(values, list):
                if not values:
                    raise ConfigError("sweep", f"{option}: empty list of values")
                raw[name] = [_as_text(v) for v in values]
            else:
                raw[name] = split_sweep_values(name, _as_text(values))
    from_flags: set[str] = set()
    for item in items or []:
        key, eq, text = str(item).partition("=")
        name = key.strip().replace("-", "_")
        name = RENAMED.get(name, name)
        if not (eq and name):
            raise ConfigError("sweep", f"{item!r} must look like OPTION=VALUES, e.g. "
                              "mixing=0,0.5 or 'overlap=0;1;1,1,2,5'")
        if name in from_flags:
            raise ConfigError("sweep", f"{name} is given twice; list all its values in one "
                              "--sweep")
        from_flags.add(name)
        raw.pop(name, None)
        raw[name] = split_sweep_values(name, text)
    return raw


def _sweep(name: str, texts: list[str], algorithms: list[str], methods: list[Method]
           ) -> Sweep:
    """One option's sweep, its values converted and checked."""
    by_name = {f.name: f for f in TrainConfig.fields()}
    flag = "--" + name.replace("_", "-")
    if name not in by_name or name in NOT_SWEPT:
        raise ConfigError("sweep", f"unknown option {name!r} (see loco train --help)")
    if name in SHARED:
        instead = ("give --seeds" if name == "seed" else
                   "run one loco compare per value")
        raise ConfigError("sweep", f"{flag} must be the same for every method (same model, "
                          "data, seed and token budget); a sweep varies the methods' own "
                          f"options: {instead} instead")
    sweep = Sweep(name, [], [])
    if not any(sweep.applies_to(a) for a in algorithms):
        raise ConfigError("sweep", f"{flag} applies to none of the methods "
                          f"({', '.join(m.label for m in methods)}); only to "
                          f"{', '.join(only_for(name))}")
    for text in texts:
        if not SWEEP_VALUE.match(text):
            raise ConfigError("sweep", f"{name}={text!r}: a value may hold only letters, "
                              "digits and . _ + - (and commas inside a list value); it "
                              "names the run's directory")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        try:
            value = coerce(by_name[name], value)
        except ConfigError as e:
            raise ConfigError("sweep", f"{name}={text}: {e}") from None
        if value in sweep.values:
            raise ConfigError("sweep", f"{name}: the value {text} is listed twice")
        sweep.values.append(value)
        sweep.texts.append(text)
    return sweep


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).strip()


def sweep_label(base: str, point: list[tuple[str, str]]) -> str:
    """A sweep run's label: ``base[option=value,...]``, a value holding commas in
    parentheses (``streaming[overlap=(1,1,2,5),mixing=0.5]``).

    Args:
        base: the method's label in ``--algorithms``.
        point: (option, value as written) of every swept option that applies to it.
    """
    return base + "[" + ",".join(f"{k}=({v})" if "," in v else f"{k}={v}"
                                 for k, v in point) + "]"


def expand(methods: list[Method], sweeps: list[Sweep]) -> list[Method]:
    """Every run of a sweep: each method once per point of the grid of the swept options
    that apply to it (the others run once, as given).

    Args:
        methods: the methods, with their own options set.
        sweeps: the swept options (``parse_sweeps``).

    Returns:
        The runs in order: per method, the grid with the last option varying fastest; a
        grid point's values win over the method's own options.
    """
    runs = []
    for m in methods:
        mine = [s for s in sweeps if s.applies_to(m.algorithm)]
        if not mine:
            runs.append(m)
            continue
        for index in itertools.product(*(range(len(s.values)) for s in mine)):
            point = {s.option: s.values[i] for s, i in zip(mine, index)}
            label = sweep_label(m.label, [(s.option, s.texts[i]) for s, i in zip(mine, index)])
            runs.append(Method(label, m.algorithm, {**m.options, **point}, point))
    return runs


#: At most this many seeds: each one runs every method once more.
MAX_SEEDS = 16


def parse_seeds(text: str | int | list) -> list[int]:
    """The seeds of ``--seeds`` (or a YAML file's ``seeds:``).

    Args:
        text: ``0,1,2`` (or a list of its items, or one integer).

    Returns:
        The seeds, in the order given.

    Raises:
        ConfigError: naming ``--seeds``: no seed, more than ``MAX_SEEDS``, a value that is
            not an integer >= 0, or a seed listed twice.
    """
    items = text if isinstance(text, list) else str(text).split(",")
    allowed = f"give 1 to {MAX_SEEDS} distinct integers >= 0 separated by ',', e.g. 0,1,2"
    seeds: list[int] = []
    if not items:
        raise ConfigError("seeds", f"no seed; {allowed}")
    for item in (str(i).strip() for i in items):
        if not re.fullmatch(r"[0-9]+", item):
            raise ConfigError("seeds", f"{item!r} is not a seed; {allowed}")
        if int(item) in seeds:
            raise ConfigError("seeds", f"the seed {int(item)} is listed twice; {allowed}")
        seeds.append(int(item))
    if len(seeds) > MAX_SEEDS:
        raise ConfigError("seeds", f"{len(seeds)} seeds are too many; {allowed}")
    return seeds


def seed_sweep(seeds: list[int]) -> Sweep:
    """``--seeds`` as one more swept option, ``seed``, that applies to every method: given
    last to [`expand`][loco.compare.expand], it runs every run once per seed, labelled
    ``BASE[...,seed=S]``.

    Args:
        seeds: the seeds ([`parse_seeds`][loco.compare.parse_seeds]).

    Returns:
        The sweep of ``seed`` over them.
    """
    return Sweep("seed", list(seeds), [str(s) for s in seeds])


@dataclass
class Plan:
    """What ``loco compare`` will run, every configuration checked.

    Args:
        out: the comparison's directory.
        methods: the runs, a sweep expanded (one per grid point).
        configs: their configurations, validated and resolved, one per run.
        preset: the preset's name, or None.
        warnings: legal settings that are probably not what was meant, by run.
        sweeps: the swept options, empty without ``--sweep``.
        seeds: the seeds of ``--seeds``, empty without it.
    """

    out: str
    methods: list[Method]
    configs: list[TrainConfig]
    preset: str | None
    warnings: list[str]
    sweeps: list[Sweep] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)


def plan(shared: dict[str, Any], algorithms: str | list | None = None,
         sets: list[str] | None = None, preset: str | None = None,
         config_file: str | None = None, sweeps: list[str] | None = None,
         seeds: str | list | None = None) -> Plan:
    """Every run's configuration, checked before anything trains.

    Args:
        shared: options given as flags, for every method, by field name.
        algorithms: ``--algorithms`` (see [`parse_methods`][loco.compare.parse_methods]);
            default: the YAML file's, else the preset's, else every registered method.
        sets: ``--set LABEL.OPTION=VALUE`` items.
        preset: a name of ``PRESETS``, or None.
        config_file: a YAML file of shared options, plus optional ``algorithms``,
            ``methods``, ``sweep`` and ``seeds``.
        sweeps: ``--sweep OPTION=VALUES`` items (see
            [`parse_sweeps`][loco.compare.parse_sweeps]).
        seeds: ``--seeds`` (see [`parse_seeds`][loco.compare.parse_seeds]): every run once
            per seed; default: the YAML file's, else one run with ``seed``.

    Returns:
        The plan; nothing is written.

    Raises:
        ConfigError: the first bad option, naming the method (or ``--sweep``, ``--seeds``)
            and what is allowed; ``--seeds`` with a ``seed`` (flag, file or preset).
    """
    values: dict[str, Any] = {}
    per_method: list[tuple[str, dict, str]] = []  # (algorithm or label, options, source)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)} (got {preset!r})")
        values.update(PRESETS[preset]["shared"])
        per_method += [(k, v, f"preset {preset}:") for k, v in PRESETS[preset]["methods"].items()]
    swept = None
    if config_file:
        data = load_yaml(config_file, extra=("algorithms", "methods", "sweep", "seeds"))
        own = {key: data.pop(key, None) for key in ("algorithms", "sweep", "seeds")}
        algorithms = own["algorithms"] if algorithms is None else algorithms
        seeds = own["seeds"] if seeds is None else seeds
        swept = own["sweep"]
        extra = data.pop("methods", None) or {}
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise ConfigError("config", f"{config_file}: 'methods' must map a method label to "
                              "a mapping of option: value")
        values.update(data)
        per_method += [(k, v, f"{config_file}:") for k, v in extra.items()]
    if "algorithm" in shared:
        raise ConfigError("algorithm", "loco compare takes --algorithms (a list)")
    values.update(shared)
    if algorithms is None and preset is not None:
        algorithms = PRESETS[preset].get("algorithms")
    methods = parse_methods(algorithms if algorithms is not None
                            else ",".join(algorithm_names()))
    for key, options, source in per_method:
        # a preset's entries are by method: they apply to every run of it
        targets = [m for m in methods if key in ((m.label, m.algorithm)
                                                 if source.startswith("preset") else (m.label,))]
        if not targets and not source.startswith("preset"):
            raise ConfigError("config", f"{source} 'methods' names {key!r}, which is not in "
                              f"--algorithms ({', '.join(m.label for m in methods)})")
        for m in targets:
            for option, value in options.items():
                method_option(m, option, value, source)
    parse_sets(sets or [], methods)
    grid = parse_sweeps(sweeps, methods, swept)
    if seeds is None and preset is not None and "seed" not in values:
        seeds = PRESETS[preset].get("seeds")  # a --seed (flag or file) replaces the preset's
    seed_list = _seeds(seeds, values, "the flag" if "seed" in shared else str(config_file))
    methods = expand(methods, grid + ([seed_sweep(seed_list)] if seed_list else []))

    by_name = {f.name: f for f in TrainConfig.fields()}
    values = {k: coerce(by_name[k], v) for k, v in values.items()}
    if values.get("resume"):
        raise ConfigError("resume", "loco compare starts fresh runs; continue one method's "
                          "run with loco train --resume OUT/LABEL, then loco report OUT")
    from loco.runtime import under_torchrun

    if values.get("launcher") == "torchrun" or under_torchrun():
        raise ConfigError("launcher", "loco compare runs its methods one after another in "
                          "this process (threads or processes); under torchrun, run loco "
                          "train once per method and then loco report on their directories")
    out = values.pop("out", None) or os.path.join(
        "runs", f"compare-{datetime.now():%Y%m%d-%H%M%S}")
    configs, warnings = _method_configs(methods, values, out)
    if preset == "paper":
        import torch

        if not torch.cuda.is_available():
            warnings.append("--preset paper is sized for a GPU machine; on this CPU it "
                            "would take days")
    return Plan(out, methods, configs, preset, warnings, grid, seed_list)


def _seeds(seeds: str | list | None, values: dict[str, Any], source: str) -> list[int]:
    """The seeds of ``--seeds`` (none without it), refused next to a ``seed`` (given by
    ``source``)."""
    if seeds is None:
        return []
    if "seed" in values:
        raise ConfigError("seeds", "runs every method once per seed; give --seeds or --seed, "
                          f"not both (seed {values['seed']} is given by {source})")
    return parse_seeds(seeds)


def _method_configs(methods: list[Method], values: dict[str, Any], out: str
                    ) -> tuple[list[TrainConfig], list[str]]:
    """Every method's prepared TrainConfig (the shared values, then its own), and the
    warnings they give; a bad one fails naming its label."""
    from loco.config import warnings_for
    from loco.training import prepare_config

    configs, warnings = [], []
    for m in methods:
        cfg = TrainConfig(**{**values, **m.options, "algorithm": m.algorithm,
                             "out": os.path.join(out, m.label), "progress": False})
        if values.get("wandb_run_name") and "wandb_run_name" not in m.options:
            # one W&B run per method: a shared name gets the label (default: the label)
            cfg = dataclasses.replace(cfg, wandb_run_name=f"{values['wandb_run_name']}-{m.label}")
        try:
            cfg = prepare_config(cfg)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
        warnings += [f"{m.label}: {w}" for w in warnings_for(cfg)]
        if os.path.exists(os.path.join(cfg.out, "summary.json")):
            raise ConfigError("out", f"{out} already holds a finished run {m.label!r}; choose "
                              "another --out (nothing is overwritten)")
        configs.append(cfg)
    return configs, warnings


class MethodError(ConfigError):
    """A method's configuration is bad: the message names the method and the option.

    Args:
        label: the method's label.
        error: the error of its configuration.
    """

    def __init__(self, label: str, error: ConfigError):
        ValueError.__init__(self, f"method {label!r}: {error}")
        self.option = error.option


def run(p: Plan, progress: bool = True) -> dict[str, dict]:
    """Train every run of the plan, one after another, then write the report.

    Args:
        p: the plan (see [`plan`][loco.compare.plan]).
        progress: show the overall progress bar.

    Returns:
        ``compare.json``'s contents.
    """
    from tqdm import tqdm

    from loco.report import load_run, order_key, write_report
    from loco.training import check_fits, human_bytes, launch_training, prepare_data

    for w in p.warnings:
        print(f"loco compare: warning: {w}", file=sys.stderr)
    first = p.configs[0]
    corpus = prepare_data(dataclasses.replace(first, progress=progress))
    for m, cfg in zip(p.methods, p.configs):
        try:
            check_fits(cfg, corpus)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
    os.makedirs(p.out, exist_ok=True)
    steps = first.steps
    bar = tqdm(total=steps * len(p.configs), unit="step", disable=not progress,
               dynamic_ncols=True)
    runs = []
    for i, (m, cfg) in enumerate(zip(p.methods, p.configs)):
        bar.set_description(f"[{i + 1}/{len(p.configs)}] {m.label}")
        done = i * steps
        with FollowMetrics(os.path.join(cfg.out, "metrics.jsonl"),
                           lambda rec: _advance(bar, done + rec["step"], rec)), \
                wandb_group(p.out):
            summary = launch_training(cfg, corpus)
        _advance(bar, done + steps, {})
        bar.write(f"{m.label}: eval loss {summary['final_eval_loss']:.4f}, sent per worker "
                  f"{human_bytes(summary['bytes_sent_per_worker'])}, "
                  f"{summary['wall_seconds']:.0f} s")
        runs.append(load_run(cfg.out, m.label))
    bar.close()
    return write_report(sorted(runs, key=order_key), p.out)


@contextlib.contextmanager
def wandb_group(out: str):
    """While the methods train: ``$LOCO_WANDB_GROUP`` set to the comparison directory's name
    (unless already set), so that ``--wandb`` puts every method's run in one W&B group (the
    processes launcher's workers inherit it)."""
    from loco.dashboard import GROUP_ENV

    if os.environ.get(GROUP_ENV):
        yield
        return
    os.environ[GROUP_ENV] = os.path.basename(os.path.normpath(os.path.abspath(out)))
    try:
        yield
    finally:
        os.environ.pop(GROUP_ENV, None)


def _advance(bar, n: int, record: dict) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if "train_loss" in record:
        bar.set_postfix(loss=f"{record['train_loss']:.3f}", refresh=False)


class FollowMetrics:
    """Follows a run's ``metrics.jsonl`` from a thread while it trains and calls ``on_record``
    with each new record: the overall progress bar works the same for every launcher,
    whichever process the lead rank lives in.

    Args:
        path: the ``metrics.jsonl`` to follow (it may not exist yet).
        on_record: called with each new record that has a ``step``.
        interval: seconds between two reads.
    """

    def __init__(self, path: str, on_record, interval: float = 0.5):
        self.path, self.on_record, self.interval = path, on_record, interval
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="follow-metrics")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._poll()

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in record:
                self.on_record(record)
