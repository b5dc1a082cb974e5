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
([`loco.comm.kernels`][loco.comm.kernels]), bit for bit the same as eager. Formats, choices and
measurements: ``docs/codecs.md``.
"""
from __future__ import annotations

import math
import struct
import sys

import torch

from loco.comm import cpu_kernels
from loco.comm.chunked import DEFAULT_CHUNK, DEFAULT_CHUNK_KEEP, ChunkTopKCodec
from loco.comm.codec import F32_MAX, Codec
from loco.comm.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, DEFAULT_KEEP,
                               SPARSE_CODEC_NAMES)
from loco.comm.hostreads import allowed
from loco.comm.kernels import choose_kernel
from loco.comm.sparse import RandomDropCodec, TopKCodec, check_sparse

MAX_BLOCK = 65536
"""The largest ``block`` a scaled codec accepts."""
EAGER_PIECE = 1 << 16
"""Values (all rows together) per piece of the scaled codecs' eager path on the CPU, so that
a piece's temporaries stay in the cache ("The eager path" in ``docs/codecs.md``)."""
_LITTLE_ENDIAN = sys.byteorder == "little"
NONFINITE_SCALE = 255
"""The scale byte of a block that held a NaN or an infinity (E8M0's NaN); it decodes as NaN."""

class CastCodec(Codec):
    """fp32 / bf16: the values' own bytes, no scales."""

    blockwise = True

    def __init__(self, name: str, dtype: torch.dtype):
        super().__init__(name)
        self.dtype = dtype

    def _encode_rows(self, x):
        # copy=True: the wire buffer must never alias the caller's tensor
        return x.to(self.dtype, copy=True).contiguous().view(torch.uint8)

    def _check_buf(self, buf, c):
        buf = super()._check_buf(buf, c)
        if not buf.is_contiguous() or buf.storage_offset() % (self.bits // 8):
            buf = buf.clone(memory_format=torch.contiguous_format)  # a slice of a message
        return buf

    def _decode_rows(self, buf, c):
        values = buf.view(-1).view(self.dtype)  # 1-D view: also fine when empty
        return values.to(torch.float32, copy=True).view(buf.shape[0], c)

    def _encode_rows_into(self, x, out):  # one pass, eager too: the cast is the copy
        out.view(-1).view(self.dtype).view(x.shape).copy_(x)
        return out

    def _decode_rows_into(self, buf, c, out):
        return out.copy_(buf.view(-1).view(self.dtype).view(buf.shape[0], c))


def _branch_free(t: torch.Tensor) -> bool:
    """Whether to mask non-finite blocks unconditionally rather than after reading on the
    host whether there are any: in a fused kernel (no data-dependent branch) and off the CPU
    (where the read is a device synchronisation)."""
    return torch.compiler.is_compiling() or t.device.type != "cpu"


def _bits(v: float) -> int:
    """The bits of fp32 ``v`` as an unsigned int."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _pow2(byte: torch.Tensor) -> torch.Tensor:
    # an E8M0 byte shifted into the fp32 exponent field is exactly 2^(byte - 127), with no
    # exp2 rounding and no denormal to flush (bytes are in [1, 254]; NONFINITE_SCALE gives inf)
    return (byte.to(torch.int32) << 23).view(torch.float32)


class ScaledCodec(Codec):
    """Blocks of values scaled by 2^e (one E8M0 byte each), then rounded to a small format."""

    fmt_max: float
    blockwise = True

    def __init__(self, name: str, block: int):
        super().__init__(name, block)
        self._f, self._F = math.frexp(self.fmt_max)  # fmt_max = f * 2^F, f in [0.5, 1)
        self._M = int((2 * self._f - 1) * 2**23)  # f's mantissa field (exact: f has few bits)
        self._tables = {}  # (kind, device) -> the eager path's lookup table there

    def _scales(self, x):
        """(x as (rows, blocks, block), the bytes of the scales it is divided by, the scale
        bytes sent): a block that held a NaN or an infinity is divided as zeros and sent
        under NONFINITE_SCALE."""
        rows, c = x.shape
        xb = x.reshape(rows, c // self.block, self.block)
        # max |x| as the larger of |max x| and |min x|: two reads of x, no |x| written. Where
        # the two could differ (a block of zeros and denormals, which flushing counts as 0)
        # both give e = -126, and both are 0 exactly where every value == 0.
        amax = absmax = torch.maximum(xb.amax(dim=-1).abs(), xb.amin(dim=-1).abs())
        bad = ~torch.isfinite(amax)  # NaN propagates through amax: one check per block
        # Eager on the CPU skips the masking when no block is bad (rare: such blocks are sent
        # as zeros under the NaN scale byte); a fused kernel, and any accelerator, always
        # masks, which changes no bit when nothing is bad, and has no data-dependent branch
        # (a host read of ``bad`` would stall the communication thread every encode).
        nonfinite = _branch_free(x) or bool(bad.any())
        if nonfinite:
            xb = xb.masked_fill(bad.unsqueeze(-1), 0.0)
            amax = amax.masked_fill(bad, 0.0)
        # With amax = m * 2^E, amax <= fmt_max * 2^e  <=>  m * 2^(E - F - e) <= f. Because
        # 2m >= 1 > f, e = E - F - 1 never works: the smallest e is E - F, or E - F + 1 if m > f.
        # m and E are read off amax's bits (it is >= 0 and finite here), as frexp would give
        # them: a normal amax with exponent field Eb and mantissa field M is m * 2^E with
        # E = Eb - 126 and m = (1 + M / 2^23) / 2, so m > f <=> M > (2f - 1) * 2^23. A zero
        # or subnormal amax (Eb = 0) gives e <= -126 - F + 1 < -126: clamped to -126, as it
        # should be. Integer ops only: no frexp call, which a fused CPU kernel runs scalar.
        bits = amax.view(torch.int32)
        e = (bits >> 23) - (126 + self._F) + ((bits & 0x7FFFFF) > self._M).to(torch.int32)
        e = e.clamp_(-126, 127)
        scale_bytes = (e + 127).to(torch.uint8)
        sent = scale_bytes.masked_fill(bad, NONFINITE_SCALE) if nonfinite else scale_bytes
        return xb, scale_bytes, self._zero_blocks(sent, absmax)

    def _encode_rows(self, x):
        rows, c = x.shape
        if not torch.compiler.is_compiling():  # eager: in pieces, into a new tensor
            out = torch.empty((rows, self.row_bytes(c)), dtype=torch.uint8, device=x.device)
            return self._encode_rows_into(x, out)
        xb, divisor, scale_bytes = self._scales(x)
        y = (xb / _pow2(divisor).unsqueeze(-1)).view(rows, c)  # exact; |y| <= fmt_max
        return torch.cat([self._quantize(y), scale_bytes], dim=1)

    def _encode_rows_into(self, x, out):
        if torch.compiler.is_compiling():  # one kernel, whose last store is into ``out``
            return out.copy_(self._encode_rows(x))
        if cpu_kernels.encode_into(self, x, out):  # FP4, int2 on the CPU: the same bytes
            return out
        # Eager: the scales of the whole rows, then the values in pieces of whole blocks
        # (blocks are encoded on their own), whose temporaries stay in the CPU's cache; the
        # value bytes go straight into ``out``.
        xb, divisor, scale_bytes = self._scales(x)
        divisor = _pow2(divisor).unsqueeze(-1)
        nv = out.shape[1] - scale_bytes.shape[1]
        out[:, nv:].copy_(scale_bytes)
        per_block = self.block * self.bits // 8
        for j, k in self._pieces(x):
            y = (xb[:, j:k] / divisor[:, j:k]).view(x.shape[0], -1)  # exact; |y| <= fmt_max
            self._quantize_into(y, out[:, j * per_block:k * per_block])
        return out

    def _pieces(self, t: torch.Tensor):
        """Block ranges [j, k) of the eager path's pieces of ``t`` (rows, c): about
        EAGER_PIECE values of all rows together on the CPU, the whole rows elsewhere."""
        rows, c = t.shape
        blocks = c // self.block
        step = max(1, blocks)
        if t.device.type == "cpu":
            step = max(1, EAGER_PIECE // max(1, rows * self.block))
        return [(j, min(j + step, blocks)) for j in range(0, blocks, step)]

    def _quantize_into(self, y: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self._quantize(y))  # eager; a codec that can writes its last pass there

    def _zero_blocks(self, scale_bytes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        return scale_bytes  # the scale bytes of blocks whose absmax is 0 (int2: byte 0)

    def _table(self, kind: str, device: torch.device) -> torch.Tensor:
        """The eager path's lookup table ``kind`` on ``device``, made once per device: made
        on the CPU (its host reads are of CPU tensors) and, for a GPU, copied from
        page-locked memory without blocking, so that the first operation using it (on the
        communication thread, mid-step) does not wait for the device."""
        if (kind, device) not in self._tables:
            with allowed("host"):
                table = self._make_table(kind)
            if torch.device(device).type == "cuda":
                table = table.pin_memory().to(device, non_blocking=True)
            self._tables[kind, device] = table.to(device)
        return self._tables[kind, device]

    def _make_table(self, kind: str) -> torch.Tensor:
        if kind != "codes":
            raise KeyError(kind)
        # key = 2q + (r > 0) for the magnitude's bits q * 2^21 + r, 2048 more if positive
        # (see _codes); every midpoint is a multiple of 2^21 in bits, so all of a key's
        # values lie on the same side of each one, and its code is that of its smallest.
        assert all(not _bits(m) & 0x1FFFFF for m in self._thresholds())
        keys = torch.arange(2048, dtype=torch.int64)
        values = ((keys >> 1 << 21) + (keys & 1)).to(torch.int32).view(torch.float32)
        return torch.tensor([self._code(v, negative) for negative in (True, False)
                             for v in values.tolist()], dtype=torch.uint8)

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        """Eager: the code of each value of ``y`` (uint8, flattened; ``y`` is overwritten),
        by one table lookup on its bits, the same as the compares of ``_quantize`` (tested
        on every key). With u = y's bits as int32, the key (u >> 21) + ((u + 2^21 - 1) >> 21),
        floor plus ceiling of u / 2^21, tells a tie (u a multiple of 2^21) from the values
        just above it; for |y| <= fmt_max (no NaN) it lies in [-2048, 2048), negative where
        y's sign bit is set."""
        u = y.view(torch.int32)
        key = u >> 21
        u += 0x1FFFFF  # in place: y is this encode's own, and not needed after this
        u >>= 21
        key += u
        key += 2048
        return self._table("codes", y.device).index_select(0, key.view(-1))  # flat

    def _thresholds(self) -> list[float]:  # the magnitudes at which the code changes
        raise NotImplementedError

    def _code(self, v: float, negative: bool) -> int:  # the code of -v (negative) or v
        raise NotImplementedError

    def _decode_rows(self, buf, c):
        rows, nv = buf.shape[0], c * self.bits // 8
        if not _branch_free(buf):  # eager on the CPU: into a new tensor
            out = torch.empty((rows, c), dtype=torch.float32, device=buf.device)
            return self._decode_rows_into(buf, c, out)
        y = self._dequantize(buf[:, :nv], c).view(rows, c // self.block, self.block)
        out = y * _pow2(buf[:, nv:]).unsqueeze(-1)
        return self._finish(out, buf[:, :nv], buf[:, nv:]).view(rows, c)

    def decode_mean_rows(self, buf, c, out, divisor):
        """The C++ kernel's one pass on the CPU, eager kernels only (see the base class)."""
        return self.kernel != "fused" and cpu_kernels.decode_mean_into(self, buf, c, out,
                                                                       divisor)

    def _decode_rows_into(self, buf, c, out):
        if _branch_free(out):  # one kernel, whose last store is into ``out``
            return out.copy_(self._decode_rows(buf, c))
        if cpu_kernels.decode_into(self, buf, c, out):  # FP4, int2: the same bits
            return out
        # Eager on the CPU: in pieces of whole blocks, each straight into ``out``
        rows, nv = buf.shape[0], c * self.bits // 8
        blocks = out.view(rows, c // self.block, self.block)  # out is contiguous here
        scales = _pow2(buf[:, nv:]).unsqueeze(-1)
        per_block = self.block * self.bits // 8
        for j, k in self._pieces(out):
            q = buf[:, j * per_block:k * per_block]
            y = self._dequantize(q, (k - j) * self.block).view(rows, k - j, self.block)
            torch.mul(y, scales[:, j:k], out=blocks[:, j:k])
        self._finish(blocks, buf[:, :nv], buf[:, nv:])
        return out

    def _finish(self, out, q, scales):
        """``out`` (rows, blocks, block) = q * 2^e, finished in place: clamped to fp32's range
        and NaN throughout a non-finite block."""
        # q * 2^e is exact, except that it can round up past fp32 max (to +-inf, clamped
        # here) and that results below 2^-126 become 0 under torch.set_flush_denormal(True).
        # A NONFINITE_SCALE block is 0 * inf = NaN; it is then written as the one quiet NaN
        # (0x7FC00000), since which NaN 0 * inf and clamp give depends on the hardware and the
        # kernel; fp8's NaN codes (never encoded) likewise. Fused, both always run (no
        # branch). Eager on the CPU reads the largest scale byte first: |q| <= 2^F, so a byte
        # of at most 254 - F cannot overflow and is not NONFINITE_SCALE, and clamping and
        # masking would change no bit (the common case: both are skipped).
        branch_free = _branch_free(out)
        if branch_free or (scales.numel() and int(scales.amax()) > 254 - self._F):
            out.clamp_(-F32_MAX, F32_MAX)
            bad = (scales == NONFINITE_SCALE).unsqueeze(-1)
            if (nan_codes := self._nan_codes(q)) is not None:
                bad = bad | nan_codes.view(out.shape)
            if branch_free or bool(bad.any()):
                out.masked_fill_(bad, math.nan)
        elif self._any_nan_code(q):
            out.masked_fill_(self._nan_codes(q).view(out.shape), math.nan)
        return out

    def _any_nan_code(self, q: torch.Tensor) -> bool:  # eager: one host read, if any
        return False

    def _nan_codes(self, q: torch.Tensor) -> torch.Tensor | None:  # value bytes -> NaN where
        return None

    def _quantize(self, y: torch.Tensor) -> torch.Tensor:  # fp32 (rows, c) -> value bytes
        raise NotImplementedError

    def _dequantize(self, q: torch.Tensor, c: int) -> torch.Tensor:
        raise NotImplementedError


class Fp8Codec(ScaledCodec):
    fmt_max = 448.0

    def _quantize(self, y):
        return y.to(torch.float8_e4m3fn).view(torch.uint8)

    def _dequantize(self, q, c):
        if torch.compiler.is_compiling():
            return q.view(torch.float8_e4m3fn).to(torch.float32)
        # Eager: a gather from the 256 codes' values, several times faster than the cast
        values = self._table("values", q.device).index_select(0, q.to(torch.int32).view(-1))
        return values.view(q.shape)

    def _make_table(self, kind):
        if kind != "values":
            return super()._make_table(kind)
        return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)

    def _nan_codes(self, q):  # E4M3FN's NaN is S.1111.111; the encoder never writes it
        return (q & 0x7F) == 0x7F

    def _any_nan_code(self, q):
        return q.numel() > 0 and int((q & 0x7F).amax()) == 0x7F


class Int8Codec(ScaledCodec):
    fmt_max = 127.0

    def _quantize(self, y):
        return torch.round(y).to(torch.int8).view(torch.uint8)

    def _dequantize(self, q, c):
        return q.view(torch.int8).to(torch.float32)


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
        if not (torch.compiler.is_compiling() and c % 8 == 0 and c and _LITTLE_ENDIAN):
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
        if not _LITTLE_ENDIAN:
            return super()._quantize_into(y, out)
        v = self._codes(y).view(torch.int16).view(y.shape[0], y.shape[1] // 2)
        torch.bitwise_or(v >> 4, v, out=out)

    def _dequantize(self, q, c):
        rows = q.shape[0]
        if torch.compiler.is_compiling() and _LITTLE_ENDIAN:
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
        if not _LITTLE_ENDIAN:
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


E3M0_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # k >= 1 is 2^(k - 3)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP FP4


def _make(name: str, block: int | None, keep: float | None = None, seed: int = 0) -> Codec:
    if name in SPARSE_CODEC_NAMES:
        keep = DEFAULT_KEEP if keep is None else keep
        check_sparse(name, keep, seed)
        return TopKCodec(keep) if name == "topk" else RandomDropCodec(name, keep, seed)
    if name == "fp32":
        return CastCodec(name, torch.float32)
    if name == "bf16":
        return CastCodec(name, torch.bfloat16)
    chunked = name in CHUNK_TOPK_CODEC_NAMES
    block = (DEFAULT_CHUNK if chunked else 32) if block is None else block
    per_byte = {"fp4_e3m0": 2, "fp4_e2m1": 2, "int2": 4}.get(name, 1)
    if (not isinstance(block, int) or isinstance(block, bool) or not 2 <= block <= MAX_BLOCK
            or block % per_byte):
        raise ValueError(f"codec {name}: block must be an int in [2, {MAX_BLOCK}]"
                         + (f" and a multiple of {per_byte} ({per_byte} values share a byte)"
                            if per_byte > 1 else "") + f", got {block!r}")
    if chunked:
        keep = DEFAULT_CHUNK_KEEP if keep is None else keep
        check_sparse(name, keep, 0)
        return ChunkTopKCodec(name, block, keep)
    if name == "fp8_e4m3":
        return Fp8Codec(name, block)
    if name == "int8":
        return Int8Codec(name, block)
    if name == "int2":
        return Int2Codec(name, block)
    return Fp4Codec(name, block, E3M0_GRID if name == "fp4_e3m0" else E2M1_GRID)


def get_codec(name: str, block: int | None = None, device: torch.device | str | None = None, *,
              keep: float | None = None, seed: int = 0, kernel: str | None = None) -> Codec:
    """The codec ``name`` (one of CODEC_NAMES).

    With ``device``, a round trip of exactly representable values runs there first, so a
    device that cannot run the format (e.g. no float8) fails now, not mid-training. For the
    dropping codecs the exact round trip is checked with every value kept, and the codec
    itself is run once.

    Args:
        name: one of [`CODEC_NAMES`][loco.comm.formats.CODEC_NAMES]: ``"fp32"``, ``"bf16"``,
            ``"fp8_e4m3"``, ``"int8"``, ``"fp4_e3m0"``, ``"fp4_e2m1"``, ``"topk"``,
            ``"dare"`` or ``"random_drop"``.
        block: values per power-of-two scale of the scaled codecs, an integer in
            [2, 65536], even for the 4-bit ones (two values share a byte), a multiple of 4
            for ``int2``; values per chunk of the chunked top-k codecs; default None: 32
            (scaled) or ``DEFAULT_CHUNK`` (4096, chunked); ignored by the casts and the
            dropping codecs.
        device: a device to try the codec on first; default None (no check).
        keep: the share of each row's values the dropping codecs send, and of each chunk's
            the chunked top-k codecs send, a number in (0, 1]; default None:
            ``DEFAULT_KEEP`` (1/8), or ``DEFAULT_CHUNK_KEEP`` (1/64, chunked); ignored by
            the other codecs.
        seed: keys the random draws of ``dare`` and ``random_drop``, an integer in
            [0, 2^64); default 0; ignored by the other codecs.
        kernel: ``"fused"`` (``torch.compile`` of the codec's code, compiled once per input
            shape, by [`prepare`][loco.comm.codec.Codec.prepare] or else at the shape's
            first call), ``"eager"`` (the reference) or ``"auto"`` (eager until ``prepare``
            is told of an all-reduce of at least ``FUSED_MIN_NUMEL`` values on a device
            where torch.compile can run, whose kernels it then compiles and runs fused;
            never compiles during training; eager for the casts ``fp32`` and ``bf16``, one
            kernel already); default None: the environment variable
            ``LOCO_CODEC_KERNEL``, else ``"auto"``. The dropping codecs always run
            eager. The codec's ``kernel`` attribute says which runs (``"fused"``: for
            every prepared all-reduce); a fused codec whose
            compilation fails warns once and runs eager from then on (``kernel`` becomes
            ``"eager"``, ``kernel_reason`` says why). Fused and eager give the same bits.

    Returns:
        The codec.

    Raises:
        ValueError: an unknown ``name``, a ``block`` out of range, a ``kernel`` not in
            `KERNELS`, or (dropping codecs) a ``keep`` or
            ``seed`` out of range.
        RuntimeError: the codec cannot run on ``device``.
    """
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    sparse = name in SPARSE_CODEC_NAMES + CHUNK_TOPK_CODEC_NAMES
    codec = _make(name, block, keep, seed) if sparse else _make(name, block)
    choose_kernel(codec, kernel, device)
    if device is not None:
        try:
            x = torch.tensor(codec.PROBE, device=device).repeat(codec.align)
            # the probe runs the eager reference: compiling a shape no run uses costs seconds
            exact = _make(name, block, 1.0, seed) if sparse else _make(name, block)
            want = torch.tensor(codec.PROBE_DECODED or codec.PROBE, device=device).repeat(
                codec.align)
            if not torch.equal(exact.decode(exact.encode(x), x.shape), want):
                raise ValueError("round trip of exactly representable values changed them")
            if sparse and codec.decode(codec.encode(x), x.shape).shape != x.shape:
                raise ValueError("decoding gave the wrong shape")
        except Exception as err:
            raise RuntimeError(f"codec {name} cannot run on {device}: {err}") from err
    return codec
