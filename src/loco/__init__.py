"""loco: training language models across workers that talk rarely and little.

The public names are imported on first use, so that ``loco simulate`` and ``loco --help``
start without loading torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Algorithm": "loco.algorithms", "DataParallel": "loco.algorithms",
    "DiLoCo": "loco.algorithms", "Local": "loco.algorithms", "NoLoCo": "loco.algorithms",
    "StreamingDiLoCo": "loco.algorithms", "Comm": "loco.comm", "Elastic": "loco.runtime", "Mesh": "loco.runtime",
    "WorkerContext": "loco.runtime", "WorkerError": "loco.runtime", "launch": "loco.runtime",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loco' has no attribute {name!r}")


def __dir__():
    return __all__
