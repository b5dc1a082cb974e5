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
import sys

import torch

from loco.comm.chunked import DEFAULT_CHUNK, DEFAULT_CHUNK_KEEP, ChunkTopKCodec
from loco.comm.codec import F32_MAX, Codec
from loco.comm.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, DEFAULT_KEEP,
                               SPARSE_CODEC_NAMES)
from loco.comm.kernels import choose_kernel
from loco.comm.sparse import RandomDropCodec, TopKCodec, check_sparse

MAX_BLOCK = 65536
"""The largest ``block`` a scaled codec accepts."""
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

    def _encode_rows(self, x):
        rows, c = x.shape
        xb = x.reshape(rows, c // self.block, self.block)
        amax = xb.abs().amax(dim=-1)
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
        y = (xb / _pow2(scale_bytes).unsqueeze(-1)).view(rows, c)  # exact; |y| <= fmt_max
        if nonfinite:
            scale_bytes.masked_fill_(bad, NONFINITE_SCALE)
        return torch.cat([self._quantize(y), scale_bytes], dim=1)

    def _decode_rows(self, buf, c):
        rows, nv = buf.shape[0], c * self.bits // 8
        y = self._dequantize(buf[:, :nv], c).view(rows, c // self.block, self.block)
        scales = buf[:, nv:]
        out = (y * _pow2(scales).unsqueeze(-1)).clamp_(-F32_MAX, F32_MAX)
        # q * 2^e is exact, except that it can round up past fp32 max (to +-inf, clamped
        # here) and that results below 2^-126 become 0 under torch.set_flush_denormal(True).
        # A NONFINITE_SCALE block is 0 * inf = NaN; it is then written as the one quiet NaN
        # (0x7FC00000), since which NaN 0 * inf and clamp give depends on the hardware and the
        # kernel. Eager does so only when such a block exists; fused always (no branch).
        bad = (scales == NONFINITE_SCALE).unsqueeze(-1)
        nan_codes = self._nan_codes(buf[:, :nv])  # fp8's NaN codes (never encoded) likewise
        if nan_codes is not None:
            bad = bad | nan_codes.view(rows, c // self.block, self.block)
        if _branch_free(out) or bool(bad.any()):
            out = out.masked_fill_(bad, math.nan)
        return out.view(rows, c)

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
        return q.view(torch.float8_e4m3fn).to(torch.float32)

    def _nan_codes(self, q):  # E4M3FN's NaN is S.1111.111; the encoder never writes it
        return (q & 0x7F) == 0x7F


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
        g = torch.tensor(grid, dtype=torch.float32)
        self._values = torch.cat([g, -g])  # code -> value
        self._tables = {}  # per device, so CUDA does not copy the table on every call

    def _quantize(self, y):
        # k = how many midpoints lie below |y|. Midpoint i separates codes i and i + 1; when
        # |y| hits it exactly it counts only for odd i, so ties go to the even code. Seven
        # compares beat torch.bucketize plus a tie lookup by 2x on CPU.
        a = y.abs()
        # k <= 7 in any integer type: uint8 is fastest eager, int32 vectorizes when fused
        dt = torch.int32 if torch.compiler.is_compiling() else torch.uint8
        # Compares, not a bit-level rounding: some AVX2 builds miscompile that (docs/codecs.md).
        k = torch.zeros_like(a, dtype=dt)
        for i, m in enumerate(self._mid):
            k += (a >= m) if i % 2 else (a > m)
        code = (k | ((y < 0) & (k > 0)).to(dt) << 3).to(torch.uint8)  # sign, but never -0
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

    def _dequantize(self, q, c):
        rows = q.shape[0]
        if torch.compiler.is_compiling() and _LITTLE_ENDIAN:
            # Fused: nibbles spread into bytes through int16 and seven selects, which
            # vectorize; the table lookup below gathers, which a fused CPU kernel runs scalar
            # (and eager runs the selects 5x slower). Same values: the grid's, exactly.
            w = q.to(torch.int16)
            codes = ((w & 15) | ((w >> 4) << 8)).view(torch.uint8).view(rows, c).to(torch.int32)
            k = codes & 7
            y = torch.zeros(codes.shape, dtype=torch.float32, device=q.device)
            for i in range(1, 8):
                y = torch.where(k == i, self._grid[i], y)
            return torch.where(codes >= 8, -y, y)
        if q.device not in self._tables:
            self._tables[q.device] = self._values.to(q.device)
        values = self._tables[q.device]
        codes = torch.stack([q & 15, q >> 4], dim=-1).view(-1).to(torch.int32)
        return values.index_select(0, codes).view(rows, c)


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
        self._tables = {}

    def _encode_rows(self, x):
        # A block of zeros gets scale byte 0 (2^-127 is never a scale: e >= -126), which
        # decodes as 0 times the levels: exact zeros, where the levels have none.
        enc = super()._encode_rows(x)
        rows, c = x.shape
        zero = (x.reshape(rows, c // self.block, self.block) == 0).all(dim=-1)
        nv = c * self.bits // 8
        return torch.cat([enc[:, :nv], enc[:, nv:].masked_fill(zero, 0)], dim=1)

    def _quantize(self, y):
        code = (y.abs() >= 1).to(torch.uint8) | (y < 0).to(torch.uint8) << 1
        return code[:, 0::4] | code[:, 1::4] << 2 | code[:, 2::4] << 4 | code[:, 3::4] << 6

    def _dequantize(self, q, c):
        if q.device not in self._tables:
            self._tables[q.device] = self._values.to(q.device)
        codes = torch.stack([q & 3, (q >> 2) & 3, (q >> 4) & 3, q >> 6], dim=-1)
        return self._tables[q.device][codes.view(q.shape[0], c).to(torch.int64)]


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
