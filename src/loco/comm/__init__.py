"""Communication: the one interface (:class:`Comm`) through which all algorithms talk, and
(``loco.comm.codecs``) the wire formats it carries.

The public names are imported on first use, so that the torch-free modules of this package
(``loco.comm.codecs.formats``, ``loco.comm.link``) import without torch. The modules that
moved (the codecs into ``loco.comm.codecs``; ``counters`` and ``elastic``, now
``accounting`` and ``membership``) are still importable by their old paths, with a
``DeprecationWarning``, for one release.
"""

from loco.lazy import lazy_exports, moved_modules

_EXPORTS = {"Comm": "loco.comm.comm", "CommStats": "loco.comm.accounting",
            "Counter": "loco.comm.accounting", "Handle": "loco.comm.handles",
            "OpRecord": "loco.comm.accounting"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

moved_modules({
    "loco.comm.codec": "loco.comm.codecs.contract",
    "loco.comm.formats": "loco.comm.codecs.formats",
    "loco.comm.sparse": "loco.comm.codecs.dropping",
    "loco.comm.chunked": "loco.comm.codecs.chunk_topk",
    "loco.comm.tiles": "loco.comm.codecs.tiles",
    "loco.comm.bits": "loco.comm.codecs.bitpack",
    "loco.comm.kernels": "loco.comm.codecs.fused",
    "loco.comm.cpu_kernels": "loco.comm.codecs.cpp_kernel",
    "loco.comm.counters": "loco.comm.accounting",
    "loco.comm.elastic": "loco.comm.membership",
})
