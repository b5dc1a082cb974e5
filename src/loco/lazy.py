"""Packages whose public names are imported on first use, so that importing the package (or
a torch-free module of it) does not load what those names need; and what was renamed, kept for
one release with a ``DeprecationWarning``: the old dotted paths of modules that moved, old
names of classes ([`old_names`][loco.lazy.old_names]) and of arguments
([`renamed_arguments`][loco.lazy.renamed_arguments])."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now ``new`` and that the old name goes in the next release
    (``DeprecationWarning``).

    Args:
        old: the old name, as the user wrote it (``"launch(workers=...)"``).
        new: what to write instead.
        stacklevel: the frame the warning points at: 3 (default) is the caller of the
            function that calls this one.
    """
    warnings.warn(f"{old} is now {new}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def old_names(package: str, names: dict[str, str],
              fallback: Callable[[str], object] | None = None) -> Callable:
    """A module-level ``__getattr__`` (PEP 562) that still gives names renamed in the module,
    for one release: each old name gives the new name's value and warns
    (``DeprecationWarning``) on every use.

    Args:
        package: the module's ``__name__``.
        names: each old name and the module's new name for it.
        fallback: the ``__getattr__`` for any other name; default None: AttributeError.
    """
    def __getattr__(name: str):
        if name in names:
            renamed(f"{package}.{name}", f"{package}.{names[name]}")
            return getattr(sys.modules[package], names[name])
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def old_attribute(old: str, new: str, attr: str) -> property:
    """A read-only property under an attribute's old name, for one release: it reads ``attr``
    with a ``DeprecationWarning`` (see ``renamed``).

    Args:
        old: the old name as the user writes it (``"ctx.replica"``).
        new: the new one (``"ctx.worker"``).
        attr: the attribute it reads.
    """
    def get(self):
        renamed(old, new)
        return getattr(self, attr)
    return property(get, doc=f"The old name of ``{attr}``, for one release.")


def renamed_arguments(where: str, names: dict[str, str]) -> Callable:
    """A decorator that still takes a function's renamed keyword arguments, for one release:
    each old keyword is passed as the new one, with a ``DeprecationWarning``.

    Args:
        where: the function as the warning names it (``"launch"``).
        names: each old keyword and its new name, which means the same.

    The decorated function raises TypeError for an argument given by both names.
    """
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"give {new} or {old} (its old name), not both")
                    renamed(f"{where}({old}=...)", f"{where}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap


def lazy_exports(package: str, exports: dict[str, str],
                 renamed_names: dict[str, str] | None = None) -> tuple[Callable, Callable]:
    """A package's module-level ``__getattr__`` and ``__dir__`` for names imported on first
    use (PEP 562): ``__getattr__, __dir__ = lazy_exports(__name__, {...})``.

    Args:
        package: the package's ``__name__``.
        exports: each public name and the module that defines it (a dotted path).
        renamed_names: old public names and their new names (in ``exports``), given for one
            release with a ``DeprecationWarning`` on every use; default none.

    Returns:
        ``(__getattr__, __dir__)``; a name, once imported, is kept in the package.
    """
    def exported(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    __getattr__ = old_names(package, renamed_names or {}, exported)

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
