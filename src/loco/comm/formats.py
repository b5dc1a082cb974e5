"""The wire formats' names and sizes, without torch: what the command line, the configuration
and the reports need to know of the codecs (``loco.comm.codecs``); importing this module
does not import torch."""

CAST_CODEC_NAMES = ("fp32", "bf16")
"""The plain casts: the values' own bytes in fp32 or bf16, no scales."""
SCALED_CODEC_NAMES = ("fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1")
"""The scaled formats: 8 or 4 bits per value plus one scale byte per ``block`` values."""
SPARSE_CODEC_NAMES = ("topk", "dare", "random_drop")
"""The value-dropping baselines of the Streaming DiLoCo paper's comparison: they send a fixed
share ``keep`` of each row's values in fp32 and drop the rest (see
[`SparseCodec`][loco.comm.sparse.SparseCodec])."""
CODEC_NAMES = CAST_CODEC_NAMES + SCALED_CODEC_NAMES + SPARSE_CODEC_NAMES
"""The wire formats: two casts (32 and 16 bits per value), four scaled formats (8 and 4
bits per value plus one scale byte per block) and the three dropping baselines
(``SPARSE_CODEC_NAMES``)."""
FUSED_CODEC_NAMES = CAST_CODEC_NAMES + SCALED_CODEC_NAMES
"""The codecs that have a fused kernel; the dropping codecs always run eager."""
CODEC_BITS = {"fp32": 32, "bf16": 16, "fp8_e4m3": 8, "int8": 8, "fp4_e3m0": 4, "fp4_e2m1": 4,
              "topk": 32, "dare": 32, "random_drop": 32}
"""Bits per value on the wire of each codec, scales excluded: the scaled codecs add one scale
byte per ``block`` values; the dropping codecs send this per *kept* value."""
DEFAULT_KEEP = 0.125
"""The share of values the dropping codecs keep by default: 1/8, the same cut of the fp32
payload as 4-bit values (32 / 4), so they send about FP4's bytes (see ``docs/codecs.md``)."""
