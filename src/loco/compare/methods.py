"""The runs of ``--algorithms`` and their own options (``--set``, a preset's or a YAML file's
``methods:`` entries)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from loco.compare.presets import SHARED, only_for
from loco.config import RENAMED, ConfigError, TrainConfig, algorithm_names, coerce


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
            [`method_option`][loco.compare.methods.method_option] refuses.
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


class MethodError(ConfigError):
    """A method's configuration is bad: the message names the method and the option.

    Args:
        label: the method's label.
        error: the error of its configuration.
    """

    def __init__(self, label: str, error: ConfigError):
        ValueError.__init__(self, f"method {label!r}: {error}")
        self.option = error.option
