"""The methods by name: the one place that maps ``--algorithm`` to a class."""

from __future__ import annotations

from loco.options import ConfigError

_METHODS: dict[str, type] = {}


def register(cls: type) -> type:
    """Make a method available by its ``name`` to the command line, comparisons, reports
    and ``loco eval``; returns ``cls`` (usable as a class decorator).

    Args:
        cls: an [`Algorithm`][loco.algorithms.base.Algorithm] subclass with a ``name`` of
            lower-case letters, digits and ``_``, not registered yet to another class. A
            method with options of its own must be registered before the configuration is
            first imported, since its options become configuration fields.

    Raises:
        ValueError: no ``name``, or a name another class holds.
    """
    name = getattr(cls, "name", "")
    if not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ValueError(f"a method needs a lower-case name of letters, digits and _ "
                         f"(got {name!r} for {cls.__name__})")
    if _METHODS.get(name, cls) is not cls:
        raise ValueError(f"method name {name!r} is taken by {_METHODS[name].__name__}")
    _METHODS[name] = cls
    return cls


def methods() -> dict[str, type]:
    """Every registered method by name, in registration order (the report's order)."""
    return dict(_METHODS)


def method(name: str, option: str = "algorithm") -> type:
    """The method registered as ``name``.

    Args:
        name: a registered method's name.
        option: the option that named it, for the error; default ``algorithm``.

    Raises:
        ConfigError: no method of that name.
    """
    if name not in _METHODS:
        raise ConfigError(option, f"must be one of {', '.join(_METHODS)} (got {name!r})")
    return _METHODS[name]
