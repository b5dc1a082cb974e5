"""Communication: the one interface (:class:`Comm`) through which all algorithms talk.

The public names are imported on first use, so that the torch-free modules of this package
(``loco.comm.formats``, ``loco.comm.link``) import without torch.
"""

from loco.lazy import lazy_exports

_EXPORTS = {"Comm": "loco.comm.comm", "CommStats": "loco.comm.counters",
            "Counter": "loco.comm.counters", "Handle": "loco.comm.handles",
            "OpRecord": "loco.comm.counters"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
