"""Communication: the one interface (:class:`Comm`) through which all algorithms talk.

The public names are imported on first use, so that the torch-free modules of this package
(``loco.comm.formats``, ``loco.comm.link``) import without torch.
"""

import importlib

_EXPORTS = {"Comm": "loco.comm.comm", "CommStats": "loco.comm.counters",
            "Counter": "loco.comm.counters", "Handle": "loco.comm.handles",
            "OpRecord": "loco.comm.counters"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loco.comm' has no attribute {name!r}")


def __dir__():
    return __all__
