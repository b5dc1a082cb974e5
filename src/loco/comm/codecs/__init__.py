"""Wire formats for pseudo-gradients: fp32 values in, self-contained bytes out.

A codec encodes every row of a 2-D ``(rows, c)`` fp32 tensor on its own into exactly
``row_bytes(c)`` bytes, ``[value bytes][scale bytes]`` (or, for the dropping codecs,
``[kept fp32 values][where they go]``), so the quantized all-reduce can cut a vector into rows
and send each to a different worker. The casts (``fp32``, ``bf16``) send the values' own
bytes; the scaled codecs (``fp8_e4m3``, ``int8``, ``fp4_e3m0``, ``fp4_e2m1``) one power-of-two
scale byte (E8M0) per ``block`` values, rounding to nearest, ties to even, and never clipping;
the dropping codecs (``topk``, ``dare``, ``random_drop``) exactly ``ceil(keep · c)`` values of a
row in fp32. A NaN or an infinity always reaches the decoded result (a scaled block holding one
is sent under ``NONFINITE_SCALE`` and decodes as NaN), so every worker of an all-reduce sees
it. Every codec but the dropping ones also runs as a fused kernel
([`loco.comm.codecs.fused`][loco.comm.codecs.fused]), bit for bit the same as eager. Formats,
choices and measurements: ``docs/codecs.md``.

The modules, each by its job: ``contract`` (the [`Codec`][loco.comm.codecs.contract.Codec]
base class), ``catalog`` ([`get_codec`][loco.comm.codecs.catalog.get_codec]: every codec by
its name), ``formats`` (the formats' names and sizes, torch-free), ``casts``, ``scaled``
(the scaled codecs' common part, ``fp8_e4m3`` and ``int8``), ``fp4``, ``int2``,
``dropping`` (``topk``, ``dare``, ``random_drop``), ``chunk_topk`` and ``tiles``
(SparseLoCo's formats), ``bitpack`` (bit packing and Elias-Fano), ``fused`` (the
``torch.compile`` kernels and the choice of kernel) and ``cpp_kernel`` (the eager path's C++
kernel on the CPU).

The public names are imported on first use, so that ``loco.comm.codecs.formats`` imports
without torch.
"""

from loco.lazy import lazy_exports

_HOMES = {
    "loco.comm.codecs.catalog": ("get_codec",),
    "loco.comm.codecs.contract": ("Codec", "F32_MAX"),
    "loco.comm.codecs.casts": ("CastCodec",),
    "loco.comm.codecs.scaled": ("ScaledCodec", "Fp8Codec", "Int8Codec", "MAX_BLOCK",
                                "EAGER_PIECE", "NONFINITE_SCALE"),
    "loco.comm.codecs.fp4": ("Fp4Codec", "E3M0_GRID", "E2M1_GRID"),
    "loco.comm.codecs.int2": ("Int2Codec",),
    "loco.comm.codecs.dropping": ("SparseCodec", "TopKCodec", "RandomDropCodec"),
    "loco.comm.codecs.chunk_topk": ("ChunkTopKCodec",),
    "loco.comm.codecs.tiles": ("TiledTopK", "StatTopK", "tiled_codec"),
    "loco.comm.codecs.formats": ("CODEC_NAMES", "CAST_CODEC_NAMES", "SCALED_CODEC_NAMES",
                                 "SPARSE_CODEC_NAMES", "CHUNK_TOPK_CODEC_NAMES",
                                 "FUSED_CODEC_NAMES", "CODEC_BITS", "DEFAULT_KEEP",
                                 "DEFAULT_CHUNK", "DEFAULT_CHUNK_KEEP"),
    "loco.comm.codecs.fused": ("KERNELS", "KERNEL_ENV", "FUSED_MIN_NUMEL", "kernel_in_use",
                               "compile_count", "fused_supported"),
}
_EXPORTS = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
