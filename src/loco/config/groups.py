"""The options by section: the groups of ``loco train --help`` and the keys of a nested
YAML file.

Each section of ``loco.config.sections`` has a ``section`` name (``model``, ``data``,
``optim``, ``run``, ``comm``, ``runtime``, ``trust``, ``method``). The ``method`` section
holds ``algorithm``, the options several methods share (H, the outer optimizer) and the
chosen method's own options (its ``Method.options`` class): which of them a method takes is
``Method.uses``, so ``--algorithm NAME --help`` shows that method's and no other's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from loco.algorithms import method, methods
from loco.config.sections import (
    CommunicationOptions,
    DataOptions,
    MethodOptions,
    ModelOptions,
    OptimOptions,
    RunOptions,
    RuntimeOptions,
)
from loco.config.trust import TrustOptions
from loco.options import ConfigError

SECTIONS = (MethodOptions, ModelOptions, DataOptions, OptimOptions, RunOptions,
            CommunicationOptions, RuntimeOptions, TrustOptions)
"""The configuration's sections, each checking its own options, in the order of ``--help``
(each has a ``section`` name: its group in ``--help`` and its key in a nested YAML file)."""

METHOD = "method"
"""The method section's name: ``algorithm``, the shared options and the method's own."""


NAMES = {("model", "name"): "model"}
"""Keys of a nested YAML file read as another option: ``model: {name: small}`` is the
``model`` option (``cfg.model.name``; ``model: small`` says the same)."""


def own_fields(algorithm: str | None = None) -> list[dataclasses.Field]:
    """The methods' own options (their ``Method.options`` classes), each once: every
    registered method's, or ``algorithm``'s alone.

    Args:
        algorithm: one method's name; default None (every method's).
    """
    found: dict[str, dataclasses.Field] = {}
    for name, cls in methods().items():
        if cls.options is not None and (algorithm is None or name == algorithm):
            found.update({f.name: f for f in dataclasses.fields(cls.options)
                          if f.name not in found})
    return list(found.values())


class Group(NamedTuple):
    """One group of ``--help``: its title, a line on what it holds, its options, and
    whether they are listed (a method's options are parsed for every method but listed for
    the one asked about)."""

    title: str
    description: str
    fields: list[dataclasses.Field]
    listed: bool


def _line(cls: type) -> str:
    """The first sentence of a section's docstring, one line."""
    return " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".")


def option_groups(algorithm: str | None = None, every_method: bool = False) -> list[Group]:
    """The options of ``loco train`` in ``--help``'s groups: one per section, the method
    section holding ``algorithm`` and the shared options, then every method's own options,
    listed for ``algorithm`` only (with None: the shared ones listed, each method's own
    left to ``--algorithm NAME --help``).

    Args:
        algorithm: the method asked about (``--algorithm NAME --help``); default None.
        every_method: with no ``algorithm``, list every method's own options too (one
            group, each option's help naming the methods it is for); default False.

    Raises:
        ConfigError: ``algorithm`` is not a registered method.
    """
    if algorithm is not None and algorithm not in methods():
        raise ConfigError("algorithm", f"must be one of {', '.join(methods())} (got "
                          f"{algorithm!r})")
    uses = set(method(algorithm).takes()) if algorithm else None
    shared = {f.name for f in dataclasses.fields(MethodOptions)}
    groups = []
    for section in SECTIONS:
        fields = list(dataclasses.fields(section))
        listed = [f for f in fields if uses is None or f.name == "algorithm" or f.name in uses
                  or f.name not in shared]
        groups.append(Group(section.section, _line(section), listed, True))
        if len(listed) < len(fields):
            groups.append(Group(section.section, "", [f for f in fields if f not in listed],
                                False))
    own = own_fields()
    if algorithm is None:
        return groups + [Group(f"{METHOD}: each method's own", own_line(), own, every_method)]
    mine = own_fields(algorithm)
    return groups + [Group(f"{METHOD}: {algorithm}'s own", method(algorithm).title, mine, True),
                     Group(METHOD, "", [f for f in own if f not in mine], False)]


def own_line() -> str:
    """The line of ``--help`` that points to each method's own options."""
    return ("each method's own options: loco train --algorithm NAME --help (NAME: "
            f"{', '.join(methods())})")


def section_of() -> dict[str, str]:
    """Each option's section name by field name (a method's own options: ``method``)."""
    found = {f.name: s.section for s in SECTIONS for f in dataclasses.fields(s)}
    return {**found, **{f.name: METHOD for f in own_fields()}}


def nest(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat option values by field name as a nested mapping, section: {option: value}, in
    the sections' order (what a nested YAML file holds).

    Args:
        values: option values by field name.
    """
    where = section_of()
    out: dict[str, dict[str, Any]] = {name: {} for name in dict.fromkeys(where.values())}
    for key, value in values.items():
        out[where[key]][key] = value
    return {name: options for name, options in out.items() if options}


def flatten(data: dict[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """A YAML file's mapping by field name: a section's mapping (``optim: {lr: 0.001}``)
    gives its options (``NAMES``: ``model: {name: small}``; ``model: small`` too), a key
    outside any section is read as it is (a flat file of older releases), dashes in keys
    read as underscores.

    Args:
        data: the file's top-level mapping.
        path: the file, for errors.

    Returns:
        The values by key, and the keys that were given flat (outside their section).

    Raises:
        ConfigError: a section's key that is not its option, or an option given twice.
    """
    where = section_of()
    sections = set(where.values())
    out: dict[str, Any] = {}
    flat: list[str] = []
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key == "model" and isinstance(value, str):
            items = [("model", value)]  # the model section's shorthand: its name
        elif key in sections and isinstance(value, dict):
            items = [(NAMES.get((key, str(k)), str(k).replace("-", "_")), v)
                     for k, v in value.items()]
            wrong = [k for k, _ in items if where.get(k, key) != key]
            if wrong:
                raise ConfigError("config", f"{path}: {', '.join(wrong)} not in section "
                                  f"{key!r} (they are in: {', '.join(where[k] for k in wrong)})")
        else:
            items = [(key, value)]
            flat += [key] if key in where else []
        for k, v in items:
            if k in out:
                raise ConfigError(k, f"given twice in {path}")
            out[k] = v
    return out, flat


def nesting_hint(path: str, flat: list[str]) -> str:
    """The one line that says how to nest a flat file's keys (empty when none is flat).

    Args:
        path: the file.
        flat: the keys given outside their section.
    """
    if not flat:
        return ""
    where = section_of()
    example = ", ".join(f"{where[k]}: {{{k}: ...}}" for k in flat[:2])
    return (f"{path}: flat keys are read as before; nest them under their sections (e.g. "
            f"{example}): see docs/cli.md#yaml")


def takers(option: str) -> tuple[str, ...]:
    """The methods an option means something to where it is some methods' only (their
    ``Method.uses``: their own options and the shared ones they read); empty for an option
    of every method (the model, the data, the inner optimizer, ...).

    Args:
        option: an option's field name.
    """
    return tuple(name for name, cls in methods().items() if option in cls.uses())


def applies(option: str, algorithm: str) -> bool:
    """Whether a run of ``algorithm`` may set ``option``: an option of every method, or
    one of the method section that the method takes (``Method.takes``).

    Args:
        option: an option's field name.
        algorithm: a registered method's name.
    """
    section = {f.name for f in dataclasses.fields(MethodOptions)} | {f.name for f in own_fields()}
    return option not in section - {"algorithm"} or option in method(algorithm).takes()


def check_applies(cfg: Any) -> None:
    """Refuse a shared option of the method section set for a method it means nothing to: a
    value other than the option's default and the method's own default
    (``Method.defaults``: a resolved configuration passes) for an option the method does not
    take (``Method.takes``). (Another method's own options are refused where the
    configuration is built: ``TrainConfig`` has no place for them.)

    Args:
        cfg: the configuration (``cfg.method``: the method section).

    Raises:
        ConfigError: naming the option and the methods it applies to.
    """
    cls = method(cfg.method.algorithm)
    uses = set(cls.takes())
    for f in dataclasses.fields(MethodOptions):
        value = getattr(cfg.method, f.name)
        if f.name in uses | {"algorithm"} or value in (f.default, cls.defaults.get(f.name, f.default)):
            continue
        raise ConfigError(f.name, f"applies to {', '.join(takers(f.name))} only, not to "
                          f"--algorithm {cfg.method.algorithm} (got {value!r})")
