"""Wire formats for pseudo-gradients: fp32 vectors in, self-contained bytes out.

The quantized all-reduce cuts a vector into rows of ``c`` values and ships each row to a
different worker, so a codec encodes every row of a 2-D ``(rows, c)`` fp32 tensor on its own
into exactly ``row_bytes(c)`` bytes, laid out as ``[value bytes][scale bytes]``.

``fp32`` and ``bf16`` are plain casts (bf16 rounds to nearest even). They carry NaN and
+-Inf through unchanged, as the uncompressed all-reduce would; bf16 also turns the finite
values beyond its range (|x| > 3.39e38, the top sliver of fp32's) into +-Inf.

The scaled codecs (``fp8_e4m3``, ``int8``, ``fp4_e3m0``, ``fp4_e2m1``) give every block of
``block`` consecutive values of a row one power-of-two scale 2^e, stored in one byte as
``e + 127`` (E8M0, as in the OCP Microscaling "MX" formats). One byte per block keeps the
overhead small: a 4-bit value costs 4 + 8/block bits, 4.25 bits at block 32, i.e. 32/4.25 =
7.5x fewer bytes than fp32. Dividing by a power of two is exact, so all the error comes from
rounding to the format's grid, and for E3M0 (the Streaming DiLoCo format, whose values are
themselves powers of two) a finer scale would buy nothing. Unlike MX, which floors e and
clips the largest values, we take the smallest e with ``absmax / 2^e <= fmt_max``
(``e = ceil(log2(absmax / fmt_max))``, computed exactly from absmax's bits), so
absmax / 2^e lies in (fmt_max / 2, fmt_max] and nothing ever clips. e is clamped to
[-126, 127] so 2^e is always a normal float (denormals get flushed to zero in training); an
all-zero block stores e = -126. Decoding q * 2^e may round past the fp32 maximum; such
values become +-fp32 max.

Every scaled codec rounds to the nearest grid value, ties to the code whose last bit is 0:
the IEEE round-half-to-even that torch already applies to fp8 and to int8 (torch.round).
For fp4 that means e.g. 12 (between 8 and 16) goes to 8 in E3M0, 5 (between 4 and 6) to 4
in E2M1. Re-encoding decoded values is lossless.

A block holding a NaN or an infinity cannot be scaled. It is sent as the E8M0 NaN scale byte
0xFF (``NONFINITE_SCALE``, the NaN of the OCP MX formats; finite blocks use bytes 1 to 254)
with all its values zero, and decodes as NaN throughout (0 * 2^128 = 0 * inf = NaN, by IEEE).
So "this block is not finite" travels with the payload, at no extra byte and no extra round
trip: the owner of a chunk in the quantized all-reduce decodes a NaN block, its mean is NaN
and is sent back the same way, and every worker decodes the same non-finite mean. A sum or a
mean of values one of which is not finite is never finite, so a non-finite value on any
worker always reaches the reduced result that every worker checks, and the algorithms skip
(or stop at) that sync on all of them alike. Before, the encoder raised on the one worker
that held the value, on its communication thread, while its peers waited in the collective.

The dropping codecs (``topk``, ``dare``, ``random_drop``; the baselines the Streaming DiLoCo
paper compares FP4 with) keep exactly ``k = ceil(keep · c)`` values of a row of ``c`` and send
them in fp32, so every row has the same size, known before the data exist, as the all-reduce
needs. ``topk`` keeps the k largest magnitudes and sends where they are (a bitmap of c bits or
k indices, whichever is smaller). ``random_drop`` keeps k positions drawn at random, and
``dare`` also scales the kept values by c / k on decoding; both send, instead of positions,
the 8-byte seed the positions are drawn from. The seed is a hash of the row's bytes keyed by
the codec's ``seed``: encoding is a pure function of the row (no state, no step counter, the
same bytes for the same row on any worker, thread or call), and the decoder needs nothing but
the row's bytes. Non-finite values reach the result here too: ``topk`` ranks NaN and ±Inf
above every finite value, so they are kept; the random codecs send a row that holds one
with all k values NaN.

Every codec but the dropping ones also runs as a fused kernel: ``torch.compile`` of the same
code, compiled once per input shape, before training by ``codec.prepare(numel, parts)``, bit
for bit the same as eager (``get_codec(kernel=...)``, ``LOCO_CODEC_KERNEL``; by default fused
for all-reduces of at least ``FUSED_MIN_NUMEL`` values; ``codec.kernel`` says which runs; see
"Fused kernels" in ``docs/codecs.md``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import types
import warnings
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F

from loco.comm.formats import (CODEC_BITS, CODEC_NAMES, DEFAULT_KEEP, FUSED_CODEC_NAMES,
                               SPARSE_CODEC_NAMES)

F32_MAX = torch.finfo(torch.float32).max
MAX_BLOCK = 65536
"""The largest ``block`` a scaled codec accepts."""
_LITTLE_ENDIAN = sys.byteorder == "little"
NONFINITE_SCALE = 255
"""The scale byte of a block that held a NaN or an infinity (E8M0's NaN); it decodes as NaN."""
KERNELS = ("auto", "eager", "fused")
"""The choices of ``get_codec(kernel=...)``: ``"fused"`` compiles each codec's encode and decode
(``torch.compile`` of the eager code: C++ on CPU, Triton on GPU) for every input shape, at
[`prepare`][loco.comm.codecs.Codec.prepare] or else at its first call; ``"eager"`` runs the
reference; ``"auto"`` (the default) is fused for the all-reduces that ``prepare`` is told of
with at least ``FUSED_MIN_NUMEL`` values, where ``torch.compile`` can run, and eager for all
else (the casts, smaller all-reduces, a codec never prepared): it never compiles during
training."""
KERNEL_ENV = "LOCO_CODEC_KERNEL"
"""The environment variable that gives the default of ``get_codec(kernel=...)``; unset: auto."""
FUSED_MIN_NUMEL = 1 << 22
"""``"auto"``: the fewest values (4,194,304) of an all-reduce that
[`prepare`][loco.comm.codecs.Codec.prepare] compiles fused kernels for. A run's first fused
size costs about 5 s of compiling with Inductor's disk cache warm (25 s cold, once per
machine), each further size about 0.5 s; at this size fused FP4 saves about 0.12 s per worker
and sync (two workers), paying that back in about 45 syncs warm, and more the bigger the
tensor. Smaller all-reduces (``make demo``'s fragments hold a few hundred thousand values)
stay eager and start at once. See "Fused kernels" in ``docs/codecs.md``."""


class Codec:
    """Base class: flat-tensor encode/decode on top of the row-wise ``encode_rows``.

    Get one with [`get_codec`][loco.comm.codecs.get_codec]; a subclass implements
    ``_encode_rows`` and ``_decode_rows``, the one definition that ``encode_rows`` and
    ``decode_rows`` run eager or compiled into a fused kernel (see ``kernel``), or overrides
    ``encode_rows`` and ``decode_rows`` themselves (the dropping codecs: always eager). A row
    of ``c`` values (a multiple of ``align``) is encoded into exactly ``row_bytes(c)`` bytes,
    ``[value bytes][scale bytes]``, on its own, so rows can be cut apart and sent to
    different workers.

    Args:
        name: the codec's name, one of [`CODEC_NAMES`][loco.comm.codecs.CODEC_NAMES].
        block: values per scale, for the scaled codecs; default None (no scales: the
            casts).
    """

    name: str
    bits: int  # bits per value on the wire, scales excluded
    kernel: str = "eager"
    """How ``encode_rows`` and ``decode_rows`` run: ``"fused"`` (``torch.compile`` of the
    eager code, one kernel per shape) or ``"eager"`` (the reference). With the default
    ``"auto"`` it is ``"eager"`` until [`prepare`][loco.comm.codecs.Codec.prepare] compiles
    kernels for an all-reduce big enough, then ``"fused"`` (all-reduces prepared below the
    threshold still run eager: ``kernel_reason`` lists them). See ``docs/codecs.md`` and
    `kernel_in_use`."""
    kernel_reason: str = ""
    """Why ``kernel`` is what it is, e.g. ``"LOCO_CODEC_KERNEL=eager"`` or the compile
    error that made a fused codec fall back to eager."""
    _mode: str = "eager"  # the kernel asked for: "eager", "fused", or "auto" (see prepare)
    _source: str = ""  # where that came from, for kernel_reason
    _small: Sequence = ()  # auto: (numel, parts) of the all-reduces prepare left eager

    def __init__(self, name: str, block: int | None = None):
        self.name, self.block = name, block
        self.align = block or 1  # rows hold whole blocks so each row carries its own scales

    def padded(self, numel: int) -> int:
        """``numel`` rounded up to a multiple of ``align`` (whole blocks).

        Args:
            numel: a number of values, >= 0.
        """
        return -(-numel // self.align) * self.align

    def prepare(self, numel: int, parts: int = 1,
                device: torch.device | str | None = None) -> str:
        """Compile, now, every fused kernel that an all-reduce of ``numel`` values over
        ``parts`` workers will run, so that training compiles nothing.

        Call it once per distinct tensor size before the first step, with what
        [`all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean] will be given:
        ``numel`` the flat tensor's values, ``parts`` the workers of the Comm (its
        ``size``), ``device`` the Comm's device. It compiles exactly the kernels (op, shape,
        dtype, stride) that all-reduce will call: with ``parts`` M > 1 and chunk =
        ``padded(ceil(numel / M))``, encoding (M, chunk) and (1, chunk), and decoding
        (M, ``row_bytes(chunk)``), each into a kept buffer (``out``); with M = 1, encoding (1, chunk) and decoding (1,
        ``row_bytes(chunk)``), which is also what [`encode`][loco.comm.codecs.Codec.encode]
        and [`decode`][loco.comm.codecs.Codec.decode] of a tensor of ``numel`` values run
        (NoLoCo's exchange: pass ``parts=1``). Kernels are shared by every codec of the same
        name and block in the process, so a second call, by this codec or another worker's,
        compiles nothing and costs microseconds.

        What it does depends on the kernel asked for (``get_codec(kernel=...)``):
        ``"eager"``, the dropping codecs, and a codec whose compilation failed: nothing.
        ``"fused"``: compiles the kernels (a shape never prepared still compiles at its
        first call). ``"auto"`` (the default): compiles them when ``numel >=
        FUSED_MIN_NUMEL`` and ``torch.compile`` can run on ``device``, and turns ``kernel``
        to ``"fused"``; an all-reduce below that runs eager (``kernel_reason`` says so);
        the casts ``fp32`` and ``bf16`` stay eager. A compile that fails warns once and
        leaves the codec eager, as at a first call.

        Args:
            numel: values of the tensor to be all-reduced, an int >= 0 (0: nothing to do).
            parts: workers the all-reduce splits it over (the Comm's ``size``), an int >= 1;
                default 1 (also: whole-tensor ``encode``/``decode``).
            device: where the all-reduce runs (the Comm's device); default None: the CPU.

        Returns:
            ``"fused"`` if that all-reduce will run fused kernels, else ``"eager"`` (also
                for ``numel`` 0, which encodes nothing).

        Raises:
            ValueError: ``numel`` or ``parts`` is not an int in range.
        """
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"{self}: prepare: numel must be an int >= 0, got {numel!r}")
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
            raise ValueError(f"{self}: prepare: parts must be an int >= 1, got {parts!r}")
        dev = torch.device("cpu" if device is None else device)
        if self._mode == "eager" or numel == 0:
            return "eager"
        if self._mode == "auto":
            ok, why = fused_supported(dev)
            if not ok:
                self._mode, self.kernel = "eager", "eager"
                self.kernel_reason = f"{self._source}: {why}"
                return "eager"
            if numel < FUSED_MIN_NUMEL:
                if (numel, parts) not in self._small:
                    self._small = [*self._small, (numel, parts)]
                    self._say_auto()
                return "eager"
        for op, args in self._reduce_calls(numel, parts, dev):
            key = _spec(self) + (op,) + tuple(_key(a) for a in args)
            if key in _KERNELS:
                continue
            args = tuple(a.zero_() if isinstance(a, torch.Tensor) else a for a in args)
            fn = {"encode": self._encode_rows, "decode": self._decode_rows,
                  "encode_into": self._encode_rows_into,
                  "decode_into": self._decode_rows_into}[op]
            self.kernel = "fused"  # what _compile_and_run turns back on failure
            _compile_and_run(self, key, fn, args)
            if self._mode == "eager":  # compiling failed (warned)
                return "eager"
        if self._mode == "auto":
            self.kernel = "fused"
            self._say_auto()
        return "fused"

    def _say_auto(self) -> None:
        small = ", ".join(f"{n} over {p}" for n, p in self._small)
        if self.kernel == "fused":
            self.kernel_reason = (f"{self._source}: fused kernels compiled by prepare() for "
                                  f"all-reduces of at least {FUSED_MIN_NUMEL} values"
                                  + (f"; eager for the smaller ones ({small})" if small
                                     else ""))
        else:
            self.kernel_reason = (f"{self._source}: eager, all-reduces below "
                                  f"{FUSED_MIN_NUMEL} values ({small}) do not pay back "
                                  f"compiling")

    def _reduce_calls(self, numel: int, parts: int, device: torch.device) -> list:
        """The (op, args) of every encode_rows/decode_rows call that all_reduce_mean of
        ``numel`` values over ``parts`` workers makes, as Comm._reduce_mean makes them
        (contiguous, fresh tensors; the contents are left unset)."""
        chunk = self.padded(-(-numel // parts))
        rb = self.row_bytes(chunk)

        def f32(rows):
            return torch.empty((rows, chunk), dtype=torch.float32, device=device)

        def u8(rows):
            return torch.empty((rows, rb), dtype=torch.uint8, device=device)

        if parts == 1:
            return [("encode", (f32(1),)), ("decode", (u8(1), chunk))]
        # Over M > 1 workers every result lands in a buffer the Comm keeps (``out``).
        return [("encode_into", (f32(parts), u8(parts))),
                ("decode_into", (u8(parts), chunk, f32(parts))),
                ("encode_into", (f32(1), u8(1)))]

    def row_bytes(self, c: int) -> int:
        """Bytes of one encoded row of ``c`` values, a fixed function of ``c``: ``c · bits /
        8`` plus one scale byte per block (the dropping codecs: ``4 · kept(c)`` plus where
        the kept values go, see [`SparseCodec`][loco.comm.codecs.SparseCodec]).

        Args:
            c: values in the row, a multiple of ``align``.

        Raises:
            ValueError: ``c`` is not a multiple of ``align``.
        """
        if c % self.align:
            raise ValueError(f"{self}: row length {c} is not a multiple of {self.align}")
        return self._row_bytes(c)

    def _row_bytes(self, c: int) -> int:
        return c * self.bits // 8 + (c // self.block if self.block else 0)

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of [`encode`][loco.comm.codecs.Codec.encode] of ``numel`` values (padded to
        whole blocks, scales included).

        Args:
            numel: a number of values, >= 0.
        """
        return self.row_bytes(self.padded(numel))

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode every row on its own.

        Args:
            x: an fp32 tensor of shape ``(rows, c)``, ``c`` a multiple of ``align``.
            out: where to write the bytes, a uint8 tensor of shape ``(rows,
                row_bytes(c))`` not overlapping ``x``; default None: a new tensor. A fused
                kernel writes straight into a contiguous, 16-byte aligned ``out`` (no
                temporary of that size); otherwise the result is copied into it.

        Returns:
            A uint8 tensor of shape ``(rows, row_bytes(c))`` (``out`` when given), never
                aliasing ``x``.

        Raises:
            ValueError: a wrong dtype or shape (of ``x`` or ``out``).
        """
        self._check_rows(x)
        if out is None:
            return _run(self, "encode", self._encode_rows, x.detach())
        _check_out(self, out, (x.shape[0], self.row_bytes(x.shape[1])), torch.uint8)
        if not _is_canonical(out):
            return out.copy_(self.encode_rows(x))
        return _run(self, "encode_into", self._encode_rows_into, x.detach(), out)

    def _encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        # The one definition of encoding: run as it is (eager) or through torch.compile
        # (fused). Code that must differ between the two asks torch.compiler.is_compiling().
        raise NotImplementedError

    def _decode_rows(self, buf: torch.Tensor, c: int) -> torch.Tensor:  # likewise
        raise NotImplementedError

    def _encode_rows_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Compiled, the copy is the last kernel's store into ``out``: no temporary.
        return out.copy_(self._encode_rows(x))

    @property
    def writes_into(self) -> bool:
        """Whether ``encode_rows``/``decode_rows`` with ``out`` write straight into it (a
        fused kernel, or a cast, which is one copy either way) rather than compute a new
        tensor and copy it in (eager scaled codecs: an extra pass, which a caller that
        keeps buffers only to save allocations should not pay)."""
        return self.kernel == "fused" or (type(self)._encode_rows_into
                                           is not Codec._encode_rows_into)

    def _decode_rows_into(self, buf: torch.Tensor, c: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self._decode_rows(buf, c))

    def decode_rows(self, buf: torch.Tensor, c: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows that [`encode_rows`][loco.comm.codecs.Codec.encode_rows] made.

        Args:
            buf: a uint8 tensor of shape ``(rows, row_bytes(c))``.
            c: values per row.
            out: where to write the values, an fp32 tensor of shape ``(rows, c)`` not
                overlapping ``buf``; default None: a new tensor. As for ``encode_rows``, a
                fused kernel writes straight into a contiguous, aligned ``out``.

        Returns:
            An fp32 tensor of shape ``(rows, c)`` (``out`` when given): NaN throughout a
                block whose values were not all finite (scaled codecs), NaN at the k kept
                positions of a row that held a non-finite value (``dare``, ``random_drop``),
                the values themselves for the casts and ``topk``.

        Raises:
            ValueError: a wrong dtype or shape (of ``buf`` or ``out``).
        """
        buf = self._check_buf(buf, c)
        if out is None:
            return _run(self, "decode", self._decode_rows, buf.detach(), c)
        _check_out(self, out, (buf.shape[0], c), torch.float32)
        if not _is_canonical(out):
            return out.copy_(self.decode_rows(buf, c))
        return _run(self, "decode_into", self._decode_rows_into, buf.detach(), c, out)

    def _check_buf(self, buf: torch.Tensor, c: int) -> torch.Tensor:
        if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.shape[1] != self.row_bytes(c):
            raise ValueError(f"{self}: rows of {c} values take {self.row_bytes(c)} bytes, "
                             f"got {buf.dtype} {tuple(buf.shape)}")
        return buf

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode a tensor of any shape and dtype as one row (zero-padded to whole blocks).

        Args:
            x: the values; converted to fp32 first.

        Returns:
            A 1-D uint8 tensor of ``encoded_nbytes(x.numel())`` bytes. A NaN or an infinity
                is carried through (the casts) or marks its block as not finite (the scaled
                codecs, see ``NONFINITE_SCALE``); it never raises.
        """
        flat = x.detach().reshape(-1).to(torch.float32)
        flat = F.pad(flat, (0, self.padded(flat.numel()) - flat.numel()))
        return self.encode_rows(flat.view(1, flat.numel())).view(-1)

    def decode(self, buf: torch.Tensor, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode what [`encode`][loco.comm.codecs.Codec.encode] made of a tensor of
        ``shape``.

        Args:
            buf: the encoded bytes, a uint8 tensor of ``encoded_nbytes(numel)`` elements.
            shape: the shape of the original tensor.
            dtype: the dtype of the result; default fp32.

        Returns:
            A new tensor of ``shape`` and ``dtype``.

        Raises:
            ValueError: ``buf`` is not uint8 or has the wrong number of bytes.
        """
        shape = torch.Size(shape)
        numel = shape.numel()
        if buf.dtype != torch.uint8 or buf.numel() != self.encoded_nbytes(numel):
            raise ValueError(f"{self}: expected {self.encoded_nbytes(numel)} uint8 bytes for "
                             f"shape {tuple(shape)}, got {buf.numel()} {buf.dtype}")
        out = self.decode_rows(buf.reshape(1, buf.numel()), self.padded(numel))
        return out[0, :numel].reshape(shape).to(dtype)

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % self.align:
            raise ValueError(f"{self}: encode_rows needs float32 (rows, c) with c a multiple "
                             f"of {self.align}, got {x.dtype} {tuple(x.shape)}")

    def __repr__(self) -> str:
        return f"Codec({self.name}" + (f", block={self.block})" if self.block else ")")


class CastCodec(Codec):
    """fp32 / bf16: the values' own bytes, no scales."""

    def __init__(self, name: str, dtype: torch.dtype):
        super().__init__(name)
        self.dtype, self.bits = dtype, torch.finfo(dtype).bits

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


def _pow2(byte: torch.Tensor) -> torch.Tensor:
    # an E8M0 byte shifted into the fp32 exponent field is exactly 2^(byte - 127), with no
    # exp2 rounding and no denormal to flush (bytes are in [1, 254]; NONFINITE_SCALE gives inf)
    return (byte.to(torch.int32) << 23).view(torch.float32)


class ScaledCodec(Codec):
    """Blocks of values scaled by 2^e (one E8M0 byte each), then rounded to a small format."""

    fmt_max: float

    def __init__(self, name: str, block: int):
        super().__init__(name, block)
        self._f, self._F = math.frexp(self.fmt_max)  # fmt_max = f * 2^F, f in [0.5, 1)
        self._M = int((2 * self._f - 1) * 2**23)  # f's mantissa field (exact: f has few bits)

    def _encode_rows(self, x):
        rows, c = x.shape
        xb = x.reshape(rows, c // self.block, self.block)
        amax = xb.abs().amax(dim=-1)
        bad = ~torch.isfinite(amax)  # NaN propagates through amax: one check per block
        # Eager skips the masking when no block is bad (rare: such blocks are sent as zeros
        # under the NaN scale byte); a fused kernel always masks, which changes no bit when
        # nothing is bad, and has no data-dependent branch.
        nonfinite = torch.compiler.is_compiling() or bool(bad.any())
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
        if torch.compiler.is_compiling() or bool(bad.any()):
            out = out.masked_fill_(bad, math.nan)
        return out.view(rows, c)

    def _nan_codes(self, q: torch.Tensor) -> torch.Tensor | None:  # value bytes -> NaN where
        return None

    def _quantize(self, y: torch.Tensor) -> torch.Tensor:  # fp32 (rows, c) -> value bytes
        raise NotImplementedError

    def _dequantize(self, q: torch.Tensor, c: int) -> torch.Tensor:
        raise NotImplementedError


class Fp8Codec(ScaledCodec):
    bits, fmt_max = 8, 448.0

    def _quantize(self, y):
        return y.to(torch.float8_e4m3fn).view(torch.uint8)

    def _dequantize(self, q, c):
        return q.view(torch.float8_e4m3fn).to(torch.float32)

    def _nan_codes(self, q):  # E4M3FN's NaN is S.1111.111; the encoder never writes it
        return (q & 0x7F) == 0x7F


class Int8Codec(ScaledCodec):
    bits, fmt_max = 8, 127.0

    def _quantize(self, y):
        return torch.round(y).to(torch.int8).view(torch.uint8)

    def _dequantize(self, q, c):
        return q.view(torch.int8).to(torch.float32)


class Fp4Codec(ScaledCodec):
    """4-bit sign-magnitude codes (sign << 3 | k) into an 8-entry magnitude grid."""

    bits = 4

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
        # (A bit-level E3M0 rounding, faster fused, was miscompiled by torch 2.13's AVX2
        # CPU kernels: wrong codes under ATEN_CPU_CAPABILITY=avx2. Compares are right on all.)
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


# --------------------------------------------------------------------------- fused kernels
# Compiled kernels are shared by every codec of the same class, name and block (the threads
# launcher makes one codec per worker: they compile once between them) and cached per input
# key (shape, strides, dtype, device, grad mode, c). Each key gets a torch.compile of a fresh
# copy of the method's code object, so Dynamo's per-code recompile limit never applies and no
# new shape has to fail the guards of an older kernel first. TorchDynamo must not compile
# from several threads at once: the first call of a key (the one that compiles) runs under
# _COMPILE_LOCK; later calls of that key take no lock.
_COMPILE_LOCK = threading.Lock()
_KERNELS: dict = {}  # (class, name, block, op, input key) -> compiled callable
_FAILED: dict = {}  # (class, name, block) -> why compiling failed (warned once)
_COMPILES = [0]  # kernels compiled in this process


def compile_count() -> int:
    """How many fused kernels this process has compiled (one per codec, operation and input
    shape): a second call with the same shape must not change it."""
    return _COMPILES[0]


def kernel_in_use(codec: Codec) -> str:
    """``"fused"`` or ``"eager"``: how ``codec`` encodes and decodes now (it can turn from fused
    to eager, once, when compiling fails; ``codec.kernel_reason`` says why), for the run to
    print and record.

    Args:
        codec: a codec from [`get_codec`][loco.comm.codecs.get_codec].
    """
    return codec.kernel


def fused_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``torch.compile`` can be expected to build fused kernels for ``device``
    (default: the CPU), and if not, why. It checks the prerequisites (Dynamo supports this
    Python, a C++ compiler for the CPU, Triton for GPUs); a compile that still fails falls
    back to eager with a warning.

    Args:
        device: the device the codec will run on; default None (the CPU).
    """
    dev = torch.device("cpu" if device is None else device)
    if dev.type not in _SUPPORTED:  # once per device type: finding a compiler runs it
        _SUPPORTED[dev.type] = _fused_supported(dev)
    return _SUPPORTED[dev.type]


_SUPPORTED: dict = {}  # device type -> fused_supported's answer


def _fused_supported(dev: torch.device) -> tuple[bool, str]:
    try:
        from torch import _dynamo

        if not _dynamo.is_dynamo_supported():
            return False, "torch.compile does not support this Python"
        if dev.type == "cpu":
            from torch._inductor import cpp_builder

            cxx = cpp_builder.get_cpp_compiler()
            if not cxx:
                return False, "no C++ compiler for the CPU"
        elif dev.type in ("cuda", "xpu"):
            from torch.utils._triton import has_triton

            if not has_triton():
                return False, f"no Triton for {dev.type}"
        else:
            return False, f"no fused kernels for device type {dev.type}"
    except Exception as err:  # no compiler found, inductor import failed, ...
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def _set_kernel(codec: Codec, kernel: str | None, device) -> Codec:
    if kernel is None and not os.environ.get(KERNEL_ENV, "").strip():
        kernel, source = "auto", f"{KERNEL_ENV} unset: auto"
    elif kernel is None:
        kernel = os.environ[KERNEL_ENV].strip().lower()
        source = f"{KERNEL_ENV}={kernel}"
    else:
        source = f"kernel={kernel!r}"
    if kernel not in KERNELS:
        raise ValueError(f"codec {codec.name}: {source} is not one of {', '.join(KERNELS)}")
    codec._mode, codec._source, codec._small = kernel, source, []
    if codec.name not in FUSED_CODEC_NAMES:
        codec._mode = "eager"
        codec.kernel, codec.kernel_reason = "eager", "the dropping codecs have no fused kernel"
    elif kernel == "eager":
        codec.kernel, codec.kernel_reason = "eager", source
    elif (failed := _FAILED.get(_spec(codec))) is not None:
        codec._mode = "eager"
        codec.kernel, codec.kernel_reason = "eager", failed
    elif kernel == "fused":
        codec.kernel, codec.kernel_reason = "fused", source
    elif isinstance(codec, CastCodec):  # auto: a cast is one ATen kernel already
        codec._mode = "eager"
        codec.kernel = "eager"
        codec.kernel_reason = f"{source}: a cast is one kernel eager (fused is not faster)"
    else:
        ok, why = fused_supported(device)
        if not ok:
            codec._mode = "eager"
        codec.kernel = "eager"
        codec.kernel_reason = f"{source}: " + (
            f"eager until prepare() compiles fused kernels (all-reduces of at least "
            f"{FUSED_MIN_NUMEL} values)" if ok else why)
    return codec


def _spec(codec: Codec) -> tuple:
    return type(codec), codec.name, codec.block


def _key(a) -> tuple:
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.stride(), a.dtype, a.device
    return a


def _canonical(a):
    # What a fused kernel is compiled for and called with: contiguous tensors whose data
    # start 16-byte aligned (a slice of a bigger message, e.g. NoLoCo's payloads, is copied
    # first), so that a kernel's key is its shapes, dtypes and device alone and no alignment
    # or stride variant ever needs a compile of its own inside training.
    if isinstance(a, torch.Tensor) and (not a.is_contiguous()
                                        or a.storage_offset() * a.element_size() % 16):
        return a.clone(memory_format=torch.contiguous_format)
    return a


def _is_canonical(t: torch.Tensor) -> bool:
    """Whether a fused kernel can take ``t`` as it is (see ``_canonical``)."""
    return t.is_contiguous() and t.storage_offset() * t.element_size() % 16 == 0


def _check_out(codec: Codec, out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{codec}: out must be {dtype} {tuple(shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")


def _compiled(method):
    """torch.compile of a fresh copy of a bound method's code (its own Dynamo cache)."""
    f = method.__func__
    fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__,
                               f.__defaults__, f.__closure__)
    return torch.compile(types.MethodType(fresh, method.__self__), fullgraph=True,
                         dynamic=False)


def _first_lines(err: Exception, limit: int = 240) -> str:
    """The start of an error's message on one line (Dynamo's run to pages)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _run(codec: Codec, op: str, fn, *args):
    """Run ``fn(*args)`` (the codec's one definition of ``op``) eagerly or as its fused kernel.
    A forced fused codec compiles a new input key once, under the lock; an ``auto`` one never
    compiles here (only [`prepare`][loco.comm.codecs.Codec.prepare] does) and runs eager for
    a key it did not prepare. A failed compile falls back to eager, with one warning."""
    if codec.kernel != "fused":
        return fn(*args)
    args = tuple(_canonical(a) for a in args)
    key = _spec(codec) + (op,) + tuple(_key(a) for a in args)
    kernel = _KERNELS.get(key)
    if kernel is not None:  # the steady state: no lock
        with torch.no_grad():  # grad mode is thread-local, and a compiled kernel guards on it
            return kernel(*args)
    if codec._mode == "auto":  # not prepared (an all-reduce below FUSED_MIN_NUMEL): eager
        return fn(*args)
    return _compile_and_run(codec, key, fn, args, stacklevel=4)


def _compile_and_run(codec: Codec, key: tuple, fn, args: tuple, stacklevel: int = 3):
    """Compile ``fn`` for ``key`` (unless a kernel or a failure is there already), under the
    lock, and run it on ``args``; on failure warn once, turn ``codec`` eager and run eager."""
    spec = key[:3]
    with _COMPILE_LOCK, torch.no_grad():
        kernel = _KERNELS.get(key)
        if kernel is not None:  # another thread compiled it meanwhile
            return kernel(*args)
        if spec in _FAILED:  # another codec of this kind failed meanwhile
            codec.kernel, codec.kernel_reason, codec._mode = "eager", _FAILED[spec], "eager"
            return fn(*args)
        try:
            kernel = _compiled(fn)
            out = kernel(*args)  # compiles now
        except Exception as err:
            why = f"compiling failed: {type(err).__name__}: {_first_lines(err)}"
            _FAILED[spec] = why
            codec.kernel, codec.kernel_reason, codec._mode = "eager", why, "eager"
            warnings.warn(f"codec {codec!r}: fused kernel unavailable, running eager ({why})",
                          RuntimeWarning, stacklevel=stacklevel)
            return fn(*args)
        _KERNELS[key] = kernel
        _COMPILES[0] += 1
        return out


E3M0_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # k >= 1 is 2^(k - 3)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP FP4


def _view_as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``part`` (rows, n) as ``dtype`` (rows, n / itemsize), copying when they are
    not contiguous or not aligned (a slice of a bigger message)."""
    flat = part.contiguous().view(-1)  # 1-D: a one-row slice keeps its parent's stride
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).view(part.shape[0], -1)


class SparseCodec(Codec):
    """Base of the dropping codecs: of a row of ``c`` values exactly ``k = ceil(keep · c)``
    are sent, as fp32, and the others decode as 0.

    ``k`` is computed exactly from ``keep``'s shortest decimal form (so ``keep=0.1`` keeps 3
    of 30 values, not 4 as ``ceil(0.1 * 30)`` in floating point would), and every row of c
    values costs the same bytes, whatever its values. A row is laid out as
    ``[k fp32 values][where they go]``.

    Args:
        name: one of [`SPARSE_CODEC_NAMES`][loco.comm.codecs.SPARSE_CODEC_NAMES].
        keep: the share of values kept, in (0, 1].
        align: values per row must be a multiple of this; default 1.
    """

    bits = 32  # bits per kept value

    def __init__(self, name: str, keep: float, align: int = 1):
        super().__init__(name)
        self.keep, self.align = keep, align
        self._keep = Fraction(repr(float(keep)))

    def kept(self, c: int) -> int:
        """How many values of a row of ``c`` are sent: ``ceil(keep · c)``, at least 1 when
        ``c >= 1``.

        Args:
            c: values in the row, >= 0.
        """
        return math.ceil(self._keep * c)

    def _row_bytes(self, c: int) -> int:  # 4 · kept(c) + where they go; 0 for c = 0
        return 4 * self.kept(c) + self._where_bytes(c) if c else 0

    def _where_bytes(self, c: int) -> int:
        raise NotImplementedError

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode every row on its own: the kept values and where they were.

        Args:
            x: an fp32 tensor of shape ``(rows, c)``.
            out: where to copy the bytes, uint8 ``(rows, row_bytes(c))``; default None.

        Returns:
            A uint8 tensor of shape ``(rows, row_bytes(c))`` (``out`` when given).
        """
        self._check_rows(x)
        rows, c = x.shape
        if out is not None:
            _check_out(self, out, (rows, self.row_bytes(c)), torch.uint8)
            return out.copy_(self.encode_rows(x))
        if c == 0:
            return torch.empty((rows, 0), dtype=torch.uint8, device=x.device)
        k = self.kept(c)
        return self._encode(x, k)

    def decode_rows(self, buf: torch.Tensor, c: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows that ``encode_rows`` made: dense fp32 rows, zero where dropped.

        Args:
            buf: a uint8 tensor of shape ``(rows, row_bytes(c))``.
            c: values per row.
            out: where to write them, fp32 ``(rows, c)``, contiguous; default None.

        Returns:
            An fp32 tensor of shape ``(rows, c)`` (``out`` when given).
        """
        self._check_buf(buf, c)
        rows = buf.shape[0]
        if out is None:
            out = torch.zeros((rows, c), dtype=torch.float32, device=buf.device)
        else:
            _check_out(self, out, (rows, c), torch.float32)
            if not out.is_contiguous():
                return out.copy_(self.decode_rows(buf, c))
            out.zero_()
        if c == 0:
            return out
        k = self.kept(c)
        values = _view_as(buf[:, :4 * k], torch.float32)
        return self._decode(buf, c, k, values, out)

    def _check_buf(self, buf: torch.Tensor, c: int) -> None:
        if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.shape[1] != self.row_bytes(c):
            raise ValueError(f"{self}: rows of {c} values take {self.row_bytes(c)} bytes, "
                             f"got {buf.dtype} {tuple(buf.shape)}")
        return buf

    def __repr__(self) -> str:
        return f"Codec({self.name}, keep={self.keep})"


class TopKCodec(SparseCodec):
    """``topk``: the k largest magnitudes of each row, in fp32, and where they are.

    The positions go as a bitmap of c bits (``c / 8`` bytes) or as k little-endian indices
    of 2 bytes (rows up to 65536 values) or 4 bytes, whichever is smaller (the bitmap on a
    tie), so a row costs ``4k + min(c / 8, k · w)`` bytes. Values are sent in ascending
    position order. Rows hold whole bytes of bitmap: ``align`` is 8. NaN and ±Inf rank above
    every finite value, so a row that holds any sends at least one of them as it is.

    Args:
        keep: the share of values kept, in (0, 1].
    """

    def __init__(self, keep: float):
        super().__init__("topk", keep, align=8)

    @staticmethod
    def index_width(c: int) -> int:
        """Bytes per index in a row of ``c`` values: 2 up to 65536 values, else 4.

        Args:
            c: values in the row.
        """
        return 2 if c <= 1 << 16 else 4

    def uses_bitmap(self, c: int) -> bool:
        """Whether a row of ``c`` values sends a bitmap (True) or indices (False).

        Args:
            c: values in the row, a multiple of 8.
        """
        return c // 8 <= self.kept(c) * self.index_width(c)

    def _where_bytes(self, c):
        return c // 8 if self.uses_bitmap(c) else self.kept(c) * self.index_width(c)

    def _encode(self, x: torch.Tensor, k: int) -> torch.Tensor:
        rows, c = x.shape
        key = torch.where(torch.isnan(x), math.inf, x.abs())  # non-finite first
        idx = key.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        values = x.gather(1, idx).view(torch.uint8)  # a new tensor: never aliases x
        if self.uses_bitmap(c):
            mask = torch.zeros((rows, c), dtype=torch.bool, device=x.device)
            where = _pack_bits(mask.scatter_(1, idx, True))
        else:
            where = _index_bytes(idx, self.index_width(c))
        return torch.cat([values, where], dim=1)

    def _decode(self, buf: torch.Tensor, c: int, k: int, values: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
        if self.uses_bitmap(c):
            mask = _unpack_bits(buf[:, 4 * k:], c)
            if not bool((mask.sum(dim=1) == k).all()):
                raise ValueError(f"{self}: a bitmap does not mark exactly {k} of {c} values")
            out[mask] = values.reshape(-1)  # row by row, ascending positions
        else:
            idx = _index_from_bytes(buf[:, 4 * k:], self.index_width(c))
            if not bool((idx < c).all()):
                raise ValueError(f"{self}: an index is beyond the row's {c} values")
            out.scatter_(1, idx, values)
        return out


class RandomDropCodec(SparseCodec):
    """``random_drop`` (FedDropout-style) and ``dare``: k positions of each row drawn at
    random, the values there in fp32, and the 8-byte seed they were drawn from.

    A row costs ``4k + 8`` bytes (0 for an empty row). The seed is a BLAKE2b hash (8 bytes)
    of the row's fp32 bytes, keyed by the codec's ``seed``; the positions are the first k of
    ``torch.randperm(c)`` under a CPU generator seeded with it, on encoding and decoding
    alike. So encoding is a pure function of the row: the same row gives the same bytes on
    every worker, thread and call, and different rows (the workers' chunks, the owner's mean)
    get independent draws. ``dare`` multiplies the kept values by ``c / k`` on decoding
    (DARE's 1 / (1 − p), exact in expectation), the result clamped to ±fp32 max;
    ``random_drop`` sends them unscaled. A row that holds a NaN or an infinity is sent with
    all k values NaN, so it cannot be dropped silently.

    Args:
        name: ``"random_drop"`` or ``"dare"``.
        keep: the share of values kept, in (0, 1].
        seed: keys the hash of the rows, an integer in [0, 2^64); default 0.
    """

    SEED_BYTES = 8

    def __init__(self, name: str, keep: float, seed: int = 0):
        super().__init__(name, keep)
        self.seed, self.rescale = seed, name == "dare"
        self._key = seed.to_bytes(8, "little")

    def _where_bytes(self, c):
        return self.SEED_BYTES

    def row_seed(self, row: torch.Tensor) -> bytes:
        """The 8 seed bytes of one row: BLAKE2b of its fp32 bytes, keyed by ``seed``.

        Args:
            row: a 1-D fp32 tensor.
        """
        data = row.detach().to("cpu", torch.float32).contiguous().numpy()
        return hashlib.blake2b(data, digest_size=self.SEED_BYTES, key=self._key).digest()

    @staticmethod
    def positions(seed: bytes, c: int, k: int) -> torch.Tensor:
        """The k positions (int64, CPU) a row of ``c`` values keeps under ``seed``.

        Args:
            seed: the row's 8 seed bytes.
            c: values in the row.
            k: values kept.
        """
        g = torch.Generator().manual_seed(int.from_bytes(seed, "little"))
        return torch.randperm(c, generator=g)[:k]

    def _encode(self, x: torch.Tensor, k: int) -> torch.Tensor:
        rows, c = x.shape
        seeds = [self.row_seed(x[r]) for r in range(rows)]
        idx = torch.stack([self.positions(s, c, k) for s in seeds]).to(x.device)
        values = x.gather(1, idx)  # a new tensor: never aliases x
        bad = ~torch.isfinite(x).all(dim=1)
        if bool(bad.any()):  # rare: such rows send NaN throughout
            values.masked_fill_(bad.unsqueeze(1), math.nan)
        seed_bytes = torch.tensor([list(s) for s in seeds], dtype=torch.uint8)
        return torch.cat([values.view(torch.uint8), seed_bytes.to(x.device)], dim=1)

    def _decode(self, buf: torch.Tensor, c: int, k: int, values: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
        seeds = buf[:, 4 * k:].cpu().tolist()
        idx = torch.stack([self.positions(bytes(s), c, k) for s in seeds]).to(buf.device)
        if self.rescale:
            values = (values * (c / k)).clamp_(-F32_MAX, F32_MAX)  # clamp keeps NaN
        return out.scatter_(1, idx, values)

    def __repr__(self) -> str:
        return f"Codec({self.name}, keep={self.keep}, seed={self.seed})"


_BIT = {}  # per device: 1 << arange(8), as uint8


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT:
        _BIT[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8,
                                    device=device)
    return _BIT[device]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:  # bool (rows, c) -> uint8 (rows, c / 8)
    # value 8j + i is bit i (least significant first) of byte j
    rows, c = mask.shape
    bits = mask.view(rows, c // 8, 8).to(torch.uint8) * _bit_weights(mask.device)
    return bits.sum(dim=-1, dtype=torch.uint8)


def _unpack_bits(buf: torch.Tensor, c: int) -> torch.Tensor:  # uint8 (rows, c / 8) -> bool
    return (buf.unsqueeze(-1) & _bit_weights(buf.device)).ne(0).view(buf.shape[0], c)


def _index_bytes(idx: torch.Tensor, width: int) -> torch.Tensor:  # little-endian
    rows, k = idx.shape
    shifts = torch.arange(0, 8 * width, 8, device=idx.device)
    return ((idx.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).view(rows, k * width)


def _index_from_bytes(buf: torch.Tensor, width: int) -> torch.Tensor:
    rows = buf.shape[0]
    shifts = torch.arange(0, 8 * width, 8, device=buf.device)
    b = buf.reshape(rows, -1, width).to(torch.int64) << shifts
    return b.sum(dim=-1)


def _check_sparse(name: str, keep, seed) -> None:
    if (not isinstance(keep, (int, float)) or isinstance(keep, bool)
            or not (math.isfinite(keep) and 0 < keep <= 1)):
        raise ValueError(f"codec {name}: keep must be a number in (0, 1], got {keep!r}")
    if (not isinstance(seed, int) or isinstance(seed, bool)) or not 0 <= seed < 1 << 64:
        raise ValueError(f"codec {name}: seed must be an int in [0, 2**64), got {seed!r}")


def _make(name: str, block: int, keep: float = DEFAULT_KEEP, seed: int = 0) -> Codec:
    if name in SPARSE_CODEC_NAMES:
        _check_sparse(name, keep, seed)
        return TopKCodec(keep) if name == "topk" else RandomDropCodec(name, keep, seed)
    if name == "fp32":
        return CastCodec(name, torch.float32)
    if name == "bf16":
        return CastCodec(name, torch.bfloat16)
    four_bit = name.startswith("fp4")
    if (not isinstance(block, int) or isinstance(block, bool) or not 2 <= block <= MAX_BLOCK
            or (four_bit and block % 2)):
        raise ValueError(f"codec {name}: block must be an int in [2, {MAX_BLOCK}]"
                         + (" and even (two 4-bit values share a byte)" if four_bit else "")
                         + f", got {block!r}")
    if name == "fp8_e4m3":
        return Fp8Codec(name, block)
    if name == "int8":
        return Int8Codec(name, block)
    return Fp4Codec(name, block, E3M0_GRID if name == "fp4_e3m0" else E2M1_GRID)


def get_codec(name: str, block: int = 32, device: torch.device | str | None = None, *,
              keep: float | None = None, seed: int = 0, kernel: str | None = None) -> Codec:
    """The codec ``name`` (one of CODEC_NAMES).

    With ``device``, a round trip of exactly representable values runs there first, so a
    device that cannot run the format (e.g. no float8) fails now, not mid-training. For the
    dropping codecs the exact round trip is checked with every value kept, and the codec
    itself is run once.

    Args:
        name: one of [`CODEC_NAMES`][loco.comm.codecs.CODEC_NAMES]: ``"fp32"``, ``"bf16"``,
            ``"fp8_e4m3"``, ``"int8"``, ``"fp4_e3m0"``, ``"fp4_e2m1"``, ``"topk"``,
            ``"dare"`` or ``"random_drop"``.
        block: values per power-of-two scale of the scaled codecs, an integer in
            [2, 65536], even for the 4-bit ones (two values share a byte); default 32;
            ignored by the casts and the dropping codecs.
        device: a device to try the codec on first; default None (no check).
        keep: the share of each row's values the dropping codecs send, a number in (0, 1];
            default None: ``DEFAULT_KEEP`` (1/8); ignored by
            the other codecs.
        seed: keys the random draws of ``dare`` and ``random_drop``, an integer in
            [0, 2^64); default 0; ignored by the other codecs.
        kernel: ``"fused"`` (``torch.compile`` of the codec's code, compiled once per input
            shape, by [`prepare`][loco.comm.codecs.Codec.prepare] or else at the shape's
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
    keep = DEFAULT_KEEP if keep is None else keep
    sparse = name in SPARSE_CODEC_NAMES
    codec = _make(name, block, keep, seed) if sparse else _make(name, block)
    _set_kernel(codec, kernel, device)
    if device is not None:
        try:
            x = torch.tensor([1.0, -2.0, 0.5, 0.0], device=device).repeat(codec.align)
            # the probe runs the eager reference: compiling a shape no run uses costs seconds
            exact = _make(name, block, 1.0, seed) if sparse else _make(name, block)
            if not torch.equal(exact.decode(exact.encode(x), x.shape), x):
                raise ValueError("round trip of exactly representable values changed them")
            if sparse and codec.decode(codec.encode(x), x.shape).shape != x.shape:
                raise ValueError("decoding gave the wrong shape")
        except Exception as err:
            raise RuntimeError(f"codec {name} cannot run on {device}: {err}") from err
    return codec
