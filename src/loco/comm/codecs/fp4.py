"""The 4-bit scaled codecs ``fp4_e3m0`` and ``fp4_e2m1``: sign-magnitude codes into an
8-entry grid, two to a byte."""

from __future__ import annotations

import torch

from loco.comm.codecs.scaled import LITTLE_ENDIAN, ScaledCodec

E3M0_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # k >= 1 is 2^(k - 3)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP FP4


class Fp4Codec(ScaledCodec):
    """4-bit sign-magnitude codes (sign << 3 | k) into an 8-entry magnitude grid."""

    def __init__(self, name: str, block: int, grid: tuple[float, ...]):
        self.fmt_max = grid[-1]
        super().__init__(name, block)
        self._grid = grid
        self._mid = [(lo + hi) / 2 for lo, hi in zip(grid, grid[1:])]  # exact in fp32

    def _thresholds(self):
        return self._mid

    def _code(self, v, negative):
        k = sum((v >= m) if i % 2 else (v > m) for i, m in enumerate(self._mid))
        return k | (8 if negative and k else 0)

    def _make_table(self, kind):
        if kind != "pairs":
            return super()._make_table(kind)
        g = torch.tensor(self._grid, dtype=torch.float32)
        values = torch.cat([g, -g])  # code -> value
        # byte -> the values of its two codes, low nibble first, as one 8-byte word
        return torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1
                           ).view(torch.int64).view(256)

    def _quantize(self, y):  # fused (and eager on a big-endian CPU)
        # k = how many midpoints lie below |y|. Midpoint i separates codes i and i + 1; when
        # |y| hits it exactly it counts only for odd i, so ties go to the even code.
        a = y.abs()
        # Compares, not a bit-level rounding: some AVX2 builds miscompile that (docs/codecs.md).
        k = torch.zeros_like(a, dtype=torch.int32)  # int32 vectorizes when fused
        for i, m in enumerate(self._mid):
            k += (a >= m) if i % 2 else (a > m)
        code = (k | ((y < 0) & (k > 0)).to(torch.int32) << 3).to(torch.uint8)  # never -0
        # element 2i goes to the low nibble of byte i, 2i + 1 to the high one
        rows, c = code.shape
        if not (torch.compiler.is_compiling() and c % 8 == 0 and c and LITTLE_ENDIAN):
            return code[:, 0::2] | code[:, 1::2] << 4
        # Fused: the same bytes from contiguous loads (strided ones keep a fused CPU kernel
        # scalar). As int64, a word holds codes b0..b7 in its bytes; t = v | v >> 4 holds
        # b0 | b1 << 4 in byte 0, b2 | b3 << 4 in byte 2, and so on; bytes 0, 2, 4, 6 make
        # an int32 (shifted into int32's range first, so the cast never overflows).
        v = code.view(torch.int64)
        t = v | (v >> 4)
        w = ((t & 0xFF) | ((t >> 8) & 0xFF00) | ((t >> 16) & 0xFF0000)
             | ((t >> 24) & 0xFF000000))
        return (w - ((w >> 31) << 32)).to(torch.int32).view(torch.uint8)

    def _quantize_into(self, y, out):
        """Eager, little-endian: codes by table (``_codes``), two to a byte: as int16 a pair
        is b0 | b1 << 8, so v | v >> 4 holds b0 | b1 << 4 in its low byte, which is what
        the uint8 ``out`` keeps."""
        if not LITTLE_ENDIAN:
            return super()._quantize_into(y, out)
        v = self._codes(y).view(torch.int16).view(y.shape[0], y.shape[1] // 2)
        torch.bitwise_or(v >> 4, v, out=out)

    def _dequantize(self, q, c):
        rows = q.shape[0]
        if torch.compiler.is_compiling() and LITTLE_ENDIAN:
            # Fused: nibbles spread into bytes through int16 and seven selects, which
            # vectorize; a table lookup gathers, which a fused CPU kernel runs scalar
            # (and eager runs the selects 5x slower). Same values: the grid's, exactly.
            w = q.to(torch.int16)
            codes = ((w & 15) | ((w >> 4) << 8)).view(torch.uint8).view(rows, c).to(torch.int32)
            k = codes & 7
            y = torch.zeros(codes.shape, dtype=torch.float32, device=q.device)
            for i in range(1, 8):
                y = torch.where(k == i, self._grid[i], y)
            return torch.where(codes >= 8, -y, y)
        # Eager: one gather per byte, of both its values (an 8-byte word)
        words = self._table("pairs", q.device).index_select(0, q.to(torch.int32).view(-1))
        return words.view(torch.float32).view(rows, c)
