"""Packages whose public names are imported on first use, so that importing the package (or
a torch-free module of it) does not load what those names need; and the old dotted paths of
modules that moved, importable for one release."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
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


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import of an old dotted path: a module that hands out the new module's names."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec):
        return None  # a plain new module, filled by exec_module

    def exec_module(self, module) -> None:
        new = self.moved[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        module.__getattr__ = functools.partial(getattr, target)
        module.__dir__ = lambda: dir(target)


def moved_modules(moved: dict[str, str]) -> None:
    """Keep the old dotted paths of moved modules importable, for one release: importing one
    warns (``DeprecationWarning``, naming the new path) and gives a module whose every name is
    the new module's (``from loco.comm.codec import Codec`` is
    ``loco.comm.codecs.contract.Codec``).

    Args:
        moved: each old dotted path and the module now there (a dotted path).
    """
    if not any(isinstance(f, _Moved) and f.moved == moved for f in sys.meta_path):
        sys.meta_path.append(_Moved(moved))
