"""loco: training language models across workers that talk rarely and little.

The public names are imported on first use, so that ``loco simulate`` and ``loco --help``
start without loading torch.
"""

from loco.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Algorithm": "loco.algorithms", "DataParallel": "loco.algorithms",
    "DiLoCo": "loco.algorithms", "Local": "loco.algorithms", "NoLoCo": "loco.algorithms",
    "StreamingDiLoCo": "loco.algorithms", "SparseLoCo": "loco.algorithms",
    "DeMo": "loco.algorithms", "Sparta": "loco.algorithms", "SpartaDiLoCo": "loco.algorithms",
    "Comm": "loco.comm", "Elastic": "loco.runtime", "Mesh": "loco.runtime",
    "RankContext": "loco.runtime", "WorkerError": "loco.runtime", "launch": "loco.runtime",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, {"WorkerContext": "RankContext"})
