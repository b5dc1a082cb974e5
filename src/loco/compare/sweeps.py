"""``--sweep OPTION=VALUES`` and ``--seeds``: the grid of runs, one per point (and seed)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import yaml

from loco.compare.methods import Method
from loco.compare.presets import SHARED, only_for
from loco.config import RENAMED, ConfigError, TrainConfig, algorithm_names, coerce


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
            [`split_sweep_values`][loco.compare.sweeps.split_sweep_values]); VALUES are read as
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
    last to [`expand`][loco.compare.sweeps.expand], it runs every run once per seed, labelled
    ``BASE[...,seed=S]``.

    Args:
        seeds: the seeds ([`parse_seeds`][loco.compare.sweeps.parse_seeds]).

    Returns:
        The sweep of ``seed`` over them.
    """
    return Sweep("seed", list(seeds), [str(s) for s in seeds])
