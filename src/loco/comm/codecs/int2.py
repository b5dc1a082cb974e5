"""The 2-bit scaled codec ``int2``: four levels, four codes to a byte."""

from __future__ import annotations

import torch

from loco.comm.codecs.scaled import LITTLE_ENDIAN, ScaledCodec


class Int2Codec(ScaledCodec):
    """``int2``: 2-bit codes (sign << 1 | big) for the four levels ±0.5 and ±1.5 of the
    scaled value (a uniform mid-rise quantizer: no zero, so no value is dropped); |y| < 1
    rounds to 0.5, the rest to 1.5. Four codes to a byte, element 4i + j in bits 2j.

    Unlike the other scaled codecs it clips: the scale is the smallest power of two with
    the block's largest magnitude at most ``3 · 2^e``, so values above ``1.5 · 2^e`` decode
    as ``1.5 · 2^e``. With two magnitudes, resolution matters more than the few largest
    values: a Gaussian block loses 13% of its energy (relative squared error) this way,
    against 47% scaled to fit (``docs/codecs.md``). A block of zeros decodes as zeros (scale
    byte 0); a zero among non-zeros decodes as ±0.5 · 2^e, the nearest level."""

    fmt_max = 3.0
    PROBE = (0.25, -1.5, 1.5, -0.25)
    PROBE_DECODED = (0.25, -0.75, 0.75, -0.25)  # scale 2^-1: 1.5 clips to 1.5 · 2^-1

    def __init__(self, name: str, block: int):
        super().__init__(name, block)
        self._values = torch.tensor([0.5, 1.5, -0.5, -1.5], dtype=torch.float32)

    def _zero_blocks(self, scale_bytes, absmax):
        # A block of zeros gets scale byte 0 (2^-127 is never a scale: e >= -126), which
        # decodes as 0 times the levels: exact zeros, where the levels have none. (absmax is
        # 0 exactly where every value == 0: -0 too, and denormals where they count as 0.)
        return scale_bytes.masked_fill(absmax == 0, 0)

    def _thresholds(self):
        return [1.0]

    def _code(self, v, negative):
        return int(v >= 1) | (2 if negative and v > 0 else 0)  # -0 has no sign

    def _make_table(self, kind):
        values = self._values  # code -> value
        if kind == "values":
            return values
        if kind != "quads":
            return super()._make_table(kind)
        b = torch.arange(256)  # byte -> its four values, as one 16-byte word
        return torch.stack([values[b >> s & 3] for s in (0, 2, 4, 6)], dim=-1
                           ).view(torch.complex128).view(256)

    def _quantize(self, y):  # fused (and eager on a big-endian CPU)
        code = (y.abs() >= 1).to(torch.uint8) | (y < 0).to(torch.uint8) << 1
        return code[:, 0::4] | code[:, 1::4] << 2 | code[:, 2::4] << 4 | code[:, 3::4] << 6

    def _quantize_into(self, y, out):
        """Eager, little-endian: codes by table, four to a byte: as int32 a quad is b0 |
        b1 << 8 | b2 << 16 | b3 << 24; t = w | w >> 6 puts b1 at bit 2 and b3 at bit 18, and
        t | t >> 12 brings b2 and b3 to bits 4 and 6 of the low byte, which is what the
        uint8 ``out`` keeps."""
        if not LITTLE_ENDIAN:
            return super()._quantize_into(y, out)
        w = self._codes(y).view(torch.int32).view(y.shape[0], y.shape[1] // 4)
        t = w >> 6
        t |= w
        torch.bitwise_or(t >> 12, t, out=out)

    def _dequantize(self, q, c):
        if torch.compiler.is_compiling():
            codes = torch.stack([q & 3, (q >> 2) & 3, (q >> 4) & 3, q >> 6], dim=-1)
            return self._table("values", q.device)[codes.view(q.shape[0], c).to(torch.int64)]
        quads = self._table("quads", q.device).index_select(0, q.to(torch.int32).view(-1))
        return quads.view(torch.float32).view(q.shape[0], c)
