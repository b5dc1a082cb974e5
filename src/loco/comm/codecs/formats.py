"""The wire formats' names and sizes, without torch: what the command line, the configuration
and the reports need to know of the codecs (``loco.comm.codecs``); importing this module
does not import torch."""

import math
from fractions import Fraction

CAST_CODEC_NAMES = ("fp32", "bf16")
"""The plain casts: the values' own bytes in fp32 or bf16, no scales."""
SCALED_CODEC_NAMES = ("fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1", "int2")
"""The scaled formats: 8, 4 or 2 bits per value plus one scale byte per ``block`` values."""
SPARSE_CODEC_NAMES = ("topk", "dare", "random_drop")
"""The value-dropping baselines of the Streaming DiLoCo paper's comparison: they send a fixed
share ``keep`` of each row's values in fp32 and drop the rest (see
[`SparseCodec`][loco.comm.codecs.dropping.SparseCodec])."""
CHUNK_TOPK_CODEC_NAMES = ("topk_2bit", "topk_2bit_packed")
"""SparseLoCo's format: the top-k of each chunk in 2 bits, positions Elias-Fano coded or
packed in ``ceil(log2 chunk)`` bits (see
[`ChunkTopKCodec`][loco.comm.codecs.chunk_topk.ChunkTopKCodec]); all-gathered, not reduced
on the way."""
CODEC_NAMES = CAST_CODEC_NAMES + SCALED_CODEC_NAMES + SPARSE_CODEC_NAMES + CHUNK_TOPK_CODEC_NAMES
"""The wire formats: two casts (32 and 16 bits per value), five scaled formats (8, 4 and 2
bits per value plus one scale byte per block), the three dropping baselines
(``SPARSE_CODEC_NAMES``) and SparseLoCo's chunked top-k (``CHUNK_TOPK_CODEC_NAMES``)."""
FUSED_CODEC_NAMES = CAST_CODEC_NAMES + SCALED_CODEC_NAMES
"""The codecs that have a fused kernel; the dropping codecs always run eager."""
CODEC_BITS = {"fp32": 32, "bf16": 16, "fp8_e4m3": 8, "int8": 8, "fp4_e3m0": 4, "fp4_e2m1": 4,
              "int2": 2, "topk": 32, "dare": 32, "random_drop": 32, "topk_2bit": 2,
              "topk_2bit_packed": 2}
"""Bits per value on the wire of each codec, scales excluded: the scaled codecs add one scale
byte per ``block`` values; the dropping and chunked top-k codecs send this per *kept*
value, plus where it goes."""
DEFAULT_KEEP = 0.125
"""The share of values the dropping codecs keep by default: 1/8, the same cut of the fp32
payload as 4-bit values (32 / 4), so they send about FP4's bytes (see ``docs/codecs.md``)."""


def packed_bytes(n: int, width: int) -> int:
    """Bytes of ``n`` values of ``width`` bits packed back to back: ``ceil(n · width / 8)``.

    Args:
        n: values, >= 0.
        width: bits per value, >= 0.
    """
    return -(-n * width // 8)


def index_bits(n: int) -> int:
    """Bits of a position below ``n`` as a plain integer: ``ceil(log2 n)`` (12 for 4096)."""
    return max(1, (n - 1).bit_length())


def ef_low_bits(n: int, k: int) -> int:
    """Elias-Fano's low bits per index for ``k`` indices below ``n``: ``floor(log2(n / k))``
    (0 when ``k >= n``)."""
    return max(0, math.floor(math.log2(n / k))) if 0 < k < n else 0


def ef_bytes(n: int, k: int) -> int:
    """Bytes of one Elias-Fano code of ``k`` distinct indices below ``n``: ``k · l`` low
    bits, then a bitmap of ``k + ((n - 1) >> l)`` bits where the i-th smallest index ``x_i``
    sets bit ``(x_i >> l) + i``, with ``l = ef_low_bits(n, k)``; each part rounded up to a
    byte. About ``k · (2 + log2(n / k))`` bits: for k = 64 of n = 4096, 64 bytes (8 bits an
    index), against 96 for 12-bit packing and the limit ``log2 C(4096, 64) / 8`` ≈ 59.3.

    Args:
        n: the range of the indices, >= 1.
        k: indices, in [0, n].
    """
    if k == 0:
        return 0
    low = ef_low_bits(n, k)
    return packed_bytes(k, low) + packed_bytes(k + ((n - 1) >> low), 1)


SPARSE_LAYOUTS = ("runs", "tiles")
"""Where a chunked top-k's chunks lie: runs of ``block`` values of the flat fragment (loco's
first way, across parameters), or 2-D tiles of each tensor (the reference code's,
[`TiledTopK`][loco.comm.codecs.tiles.TiledTopK])."""
SPARSE_VALUES = ("split", "stat")
"""How a chunked top-k codes its kept values in 2 bits: per chunk, the sign and which half
of the magnitudes (loco's), or per tensor, 4 bins of 1.5σ (the reference's,
[`StatTopK`][loco.comm.codecs.tiles.StatTopK]; tiles only)."""
SPARSE_MEANS = ("all", "senders")
"""How the gathered top-k messages are averaged: over all M workers (the paper's box), or
each position over the workers that sent it (the reference code's)."""
DEFAULT_CHUNK = 4096
"""Values per chunk of the chunked top-k codecs (SparseLoCo's and Templar's 4096)."""
DEFAULT_CHUNK_KEEP = 1 / 64
"""Share kept per chunk: 64 of every 4096 values (SparseLoCo's 1.56%)."""


def chunk_kept(chunk: int, keep: float) -> int:
    """Values a chunked top-k codec keeps of a chunk: ``ceil(keep · chunk)``, at least 1,
    computed exactly from ``keep``'s shortest decimal form."""
    return max(1, math.ceil(Fraction(repr(float(keep))) * chunk))


def chunk_topk_bytes(name: str, chunk: int, k: int) -> int:
    """Bytes of one chunk of a chunked top-k codec: ``k`` 2-bit codes, two bf16 magnitudes,
    and the ``k`` positions (Elias-Fano for ``topk_2bit``, ``index_bits(chunk)`` each for
    ``topk_2bit_packed``; none when every value is kept, ``k = chunk``).

    Args:
        name: one of ``CHUNK_TOPK_CODEC_NAMES``.
        chunk: values per chunk, >= 1.
        k: values kept per chunk, in [1, chunk].
    """
    if k == chunk:
        where = 0
    elif name == "topk_2bit":
        where = ef_bytes(chunk, k)
    else:
        where = packed_bytes(k, index_bits(chunk))
    return packed_bytes(k, 2) + 4 + where
