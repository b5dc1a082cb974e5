"""``loco compare``'s plan: every run's configuration, checked before anything trains."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from loco.compare.methods import Method, MethodError, method_option, parse_methods, parse_sets
from loco.compare.presets import PRESETS
from loco.compare.sweeps import Sweep, expand, parse_seeds, parse_sweeps, seed_sweep
from loco.config import ConfigError, TrainConfig, algorithm_names, coerce, load_yaml
from loco.config.groups import applies


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
        algorithms: ``--algorithms`` (see [`parse_methods`][loco.compare.methods.parse_methods]);
            default: the YAML file's, else the preset's, else every registered method.
        sets: ``--set LABEL.OPTION=VALUE`` items.
        preset: a name of ``PRESETS``, or None.
        config_file: a YAML file of shared options, plus optional ``algorithms``,
            ``methods``, ``sweep`` and ``seeds``.
        sweeps: ``--sweep OPTION=VALUES`` items (see
            [`parse_sweeps`][loco.compare.sweeps.parse_sweeps]).
        seeds: ``--seeds`` (see [`parse_seeds`][loco.compare.sweeps.parse_seeds]): every run once
            per seed; default: the YAML file's, else one run with ``seed``.

    Returns:
        The plan; nothing is written.

    Raises:
        ConfigError: the first bad option, naming the method (or ``--sweep``, ``--seeds``)
            and what is allowed; ``--seeds`` with a ``seed`` (flag, file or preset).
    """
    values, per_method = _preset_options(preset)
    swept = None
    if config_file:
        data, entries, own = _file_options(config_file)
        algorithms = own["algorithms"] if algorithms is None else algorithms
        seeds = own["seeds"] if seeds is None else seeds
        swept = own["sweep"]
        values.update(data)
        per_method += entries
    if "algorithm" in shared:
        raise ConfigError("algorithm", "loco compare takes --algorithms (a list)")
    values.update(shared)
    if algorithms is None and preset is not None:
        algorithms = PRESETS[preset].get("algorithms")
    methods = parse_methods(algorithms if algorithms is not None
                            else ",".join(algorithm_names()))
    _apply_entries(per_method, methods)
    parse_sets(sets or [], methods)
    grid = parse_sweeps(sweeps, methods, swept)
    if seeds is None and preset is not None and "seed" not in values:
        seeds = PRESETS[preset].get("seeds")  # a --seed (flag or file) replaces the preset's
    seed_list = _seeds(seeds, values, "the flag" if "seed" in shared else str(config_file))
    methods = expand(methods, grid + ([seed_sweep(seed_list)] if seed_list else []))
    values = _shared_values(values)
    out = values.pop("out", None) or os.path.join(
        "runs", f"compare-{datetime.now():%Y%m%d-%H%M%S}")
    configs, warnings = _method_configs(methods, values, out)
    if preset == "paper":
        import torch

        if not torch.cuda.is_available():
            warnings.append("--preset paper is sized for a GPU machine; on this CPU it "
                            "would take days")
    return Plan(out, methods, configs, preset, warnings, grid, seed_list)


#: A per-method entry: (algorithm or label, its options, where it was given).
Entry = tuple[str, dict, str]


def _preset_options(preset: str | None) -> tuple[dict[str, Any], list[Entry]]:
    """A preset's shared options and its per-method entries (none without a preset)."""
    if preset is None:
        return {}, []
    if preset not in PRESETS:
        raise ConfigError("preset", f"must be one of {', '.join(PRESETS)} (got {preset!r})")
    return (dict(PRESETS[preset]["shared"]),
            [(k, v, f"preset {preset}:") for k, v in PRESETS[preset]["methods"].items()])


def _file_options(config_file: str) -> tuple[dict[str, Any], list[Entry], dict[str, Any]]:
    """A YAML file's shared options, its per-method entries (``methods:``) and its own
    ``algorithms``, ``sweep`` and ``seeds`` (None where not given)."""
    data = load_yaml(config_file, extra=("algorithms", "methods", "sweep", "seeds"))
    own = {key: data.pop(key, None) for key in ("algorithms", "sweep", "seeds")}
    extra = data.pop("methods", None) or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ConfigError("config", f"{config_file}: 'methods' must map a method label to "
                          "a mapping of option: value")
    return data, [(k, v, f"{config_file}:") for k, v in extra.items()], own


def _apply_entries(entries: list[Entry], methods: list[Method]) -> None:
    """Set the per-method entries' options: a preset's apply to every run of the algorithm
    they name (or to the labelled run), a file's to the labelled run, which must exist."""
    for key, options, source in entries:
        preset = source.startswith("preset")
        targets = [m for m in methods if key in ((m.label, m.algorithm) if preset
                                                 else (m.label,))]
        if not targets and not preset:
            raise ConfigError("config", f"{source} 'methods' names {key!r}, which is not in "
                              f"--algorithms ({', '.join(m.label for m in methods)})")
        for m in targets:
            for option, value in options.items():
                method_option(m, option, value, source)


def _shared_values(values: dict[str, Any]) -> dict[str, Any]:
    """The shared options converted to their types, refusing ``resume`` and torchrun."""
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
    return values


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
    """Every method's prepared TrainConfig (the shared values that apply to its method,
    then its own), and the warnings they give; a bad one fails naming its label."""
    from loco.config import warnings_for
    from loco.training import prepare_config

    configs, warnings = [], []
    for m in methods:
        mine = {k: v for k, v in values.items() if applies(k, m.algorithm)}
        cfg = TrainConfig(**{**mine, **m.options, "algorithm": m.algorithm,
                             "out": os.path.join(out, m.label), "progress": False})
        if values.get("wandb_run_name") and "wandb_run_name" not in m.options:
            # one W&B run per method: a shared name gets the label (default: the label)
            cfg = cfg.replace(wandb_run_name=f"{values['wandb_run_name']}-{m.label}")
        try:
            cfg = prepare_config(cfg)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
        warnings += [f"{m.label}: {w}" for w in warnings_for(cfg)]
        if os.path.exists(os.path.join(cfg.run.out, "summary.json")):
            raise ConfigError("out", f"{out} already holds a finished run {m.label!r}; choose "
                              "another --out (nothing is overwritten)")
        configs.append(cfg)
    return configs, warnings
