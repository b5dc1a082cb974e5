"""The scaled codecs' common part (one power-of-two scale byte, E8M0, per ``block`` values,
rounding to nearest, ties to even), and the two whose values take a byte each: ``fp8_e4m3``
and ``int8``. The formats of fewer bits a value are in ``fp4.py`` and ``int2.py``."""

from __future__ import annotations

import math
import struct
import sys

import torch

from loco.comm.codecs import cpp_kernel
from loco.comm.codecs.contract import F32_MAX, Codec
from loco.comm.hostreads import allowed

MAX_BLOCK = 65536
"""The largest ``block`` a scaled codec accepts."""
EAGER_PIECE = 1 << 16
"""Values (all rows together) per piece of the scaled codecs' eager path on the CPU, so that
a piece's temporaries stay in the cache ("The eager path" in ``docs/codecs.md``)."""
LITTLE_ENDIAN = sys.byteorder == "little"
NONFINITE_SCALE = 255
"""The scale byte of a block that held a NaN or an infinity (E8M0's NaN); it decodes as NaN."""


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
        if cpp_kernel.encode_into(self, x, out):  # FP4, int2 on the CPU: the same bytes
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
        return self.kernel != "fused" and cpp_kernel.decode_mean_into(self, buf, c, out,
                                                                       divisor)

    def _decode_rows_into(self, buf, c, out):
        if _branch_free(out):  # one kernel, whose last store is into ``out``
            return out.copy_(self._decode_rows(buf, c))
        if cpp_kernel.decode_into(self, buf, c, out):  # FP4, int2: the same bits
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
