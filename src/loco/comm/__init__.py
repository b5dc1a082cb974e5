"""Communication: the one interface (:class:`Comm`) through which all algorithms talk, and
(``loco.comm.codecs``) the wire formats it carries.

The public names are imported on first use, so that the torch-free modules of this package
(``loco.comm.codecs.formats``, ``loco.comm.link``) import without torch.
"""

from loco.lazy import lazy_exports

_EXPORTS = {"Comm": "loco.comm.comm", "CommStats": "loco.comm.accounting",
            "Counter": "loco.comm.accounting", "Handle": "loco.comm.handles",
            "OpRecord": "loco.comm.accounting"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
