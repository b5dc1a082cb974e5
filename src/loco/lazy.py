"""Packages whose public names are imported on first use, so that importing the package (or
a torch-free module of it) does not load what those names need."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """A package's module-level ``__getattr__`` and ``__dir__`` for names imported on first
    use (PEP 562): ``__getattr__, __dir__ = lazy_exports(__name__, {...})``.

    Args:
        package: the package's ``__name__``.
        exports: each public name and the module that defines it (a dotted path).

    Returns:
        ``(__getattr__, __dir__)``; a name, once imported, is kept in the package.
    """
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
