"""The [`Codec`][loco.comm.codecs.contract.Codec] base class: the row-wise contract every wire
format of [`get_codec`][loco.comm.codecs.catalog.get_codec] meets, and its flat-tensor
``encode``/``decode``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from loco.comm.codecs.formats import CODEC_BITS
from loco.comm.codecs.fused import is_canonical, prepare, run_kernel

F32_MAX = torch.finfo(torch.float32).max


class Codec:
    """Base class: flat-tensor encode/decode on top of the row-wise ``encode_rows``.

    Get one with [`get_codec`][loco.comm.codecs.catalog.get_codec]; a subclass implements
    ``_encode_rows`` and ``_decode_rows``, the one definition that ``encode_rows`` and
    ``decode_rows`` run eager or compiled into a fused kernel (see ``kernel``), or overrides
    ``encode_rows`` and ``decode_rows`` themselves (the dropping codecs: always eager). A row
    of ``c`` values (a multiple of ``align``) is encoded into exactly ``row_bytes(c)`` bytes,
    ``[value bytes][scale bytes]``, on its own, so rows can be cut apart and sent to
    different workers.

    Args:
        name: the codec's name, one of [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES].
        block: values per scale, for the scaled codecs; default None (no scales: the
            casts).
    """

    name: str
    bits: int
    gathers: bool = False
    """Whether every worker's encoded tensor is all-gathered whole
    ([`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean]) rather than reduced
    chunk by chunk on the way: the formats whose kept positions differ between workers."""
    blockwise: bool = False
    """Whether each block of ``align`` values is encoded on its own, whatever else the row
    holds (the casts and the scaled codecs, not the dropping ones): a row cut at block
    boundaries then encodes into the same values and bytes, so a large all-reduce can go
    in pieces ([`reduce_mean`][loco.comm.reduce.reduce_mean])."""
    PROBE: tuple = (1.0, -2.0, 0.5, 0.0)
    """Values for ``get_codec``'s device check: they decode as ``PROBE_DECODED``, or as
    themselves where that is None (values the format carries exactly)."""
    PROBE_DECODED: tuple | None = None
    """Bits per value on the wire, scales excluded (``CODEC_BITS[name]``)."""
    kernel: str = "eager"
    """How ``encode_rows`` and ``decode_rows`` run: ``"fused"`` (``torch.compile`` of the
    eager code, one kernel per shape) or ``"eager"`` (the reference). With the default
    ``"auto"`` it is ``"eager"`` until [`prepare`][loco.comm.codecs.contract.Codec.prepare] compiles
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
        self.name, self.block, self.bits = name, block, CODEC_BITS[name]
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
        ``size``), ``device`` the Comm's device; ``parts=1`` also covers
        [`encode`][loco.comm.codecs.contract.Codec.encode] and
        [`decode`][loco.comm.codecs.contract.Codec.decode] of a tensor of ``numel`` values
        (NoLoCo's exchange). It compiles exactly the kernels
        that all-reduce will call, by running its codec calls
        ([`reduce_mean`][loco.comm.reduce.reduce_mean]) on zeros. Kernels are shared by every
        codec of the same name and block in the process, so a second call, by this codec or
        another worker's, compiles and runs nothing.

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
        return prepare(self, numel, parts, device)

    def row_bytes(self, c: int) -> int:
        """Bytes of one encoded row of ``c`` values, a fixed function of ``c``: ``c · bits /
        8`` plus one scale byte per block (the dropping codecs: ``4 · kept(c)`` plus where
        the kept values go, see [`SparseCodec`][loco.comm.codecs.dropping.SparseCodec]).

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
        """Bytes of [`encode`][loco.comm.codecs.contract.Codec.encode] of ``numel`` values
        (padded to whole blocks, scales included).

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
            return run_kernel(self, "encode", self._encode_rows, x.detach())
        check_out(self, out, (x.shape[0], self.row_bytes(x.shape[1])), torch.uint8)
        if not is_canonical(out):
            return out.copy_(self.encode_rows(x))
        return run_kernel(self, "encode_into", self._encode_rows_into, x.detach(), out)

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
        fused kernel; a cast, which is one copy either way; a scaled codec's eager path,
        whose last pass stores there) rather than compute a new tensor and copy it in (the
        dropping codecs: an extra pass, which a caller that keeps buffers only to save
        allocations should not pay)."""
        return self.kernel == "fused" or (type(self)._encode_rows_into
                                           is not Codec._encode_rows_into)

    def _decode_rows_into(self, buf: torch.Tensor, c: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self._decode_rows(buf, c))

    def decode_mean_rows(self, buf: torch.Tensor, c: int, out: torch.Tensor,
                         divisor: int) -> bool:
        """``out`` (1, c) = the mean of the rows ``buf`` encodes, in one pass where a kernel
        can (the scaled codecs' C++ kernel on the CPU): the bits of decoding every row, adding
        them in rank order and dividing by ``divisor``. False, nothing written, elsewhere:
        the caller does those three steps itself.

        Args:
            buf: a uint8 tensor of shape ``(rows, row_bytes(c))``, rows >= 2.
            c: values per row.
            out: a contiguous fp32 tensor of shape ``(1, c)``, not overlapping ``buf``.
            divisor: what the sum is divided by.
        """
        return False

    def decode_rows(self, buf: torch.Tensor, c: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows that [`encode_rows`][loco.comm.codecs.contract.Codec.encode_rows] made.

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
            return run_kernel(self, "decode", self._decode_rows, buf.detach(), c)
        check_out(self, out, (buf.shape[0], c), torch.float32)
        if not is_canonical(out):
            return out.copy_(self.decode_rows(buf, c))
        return run_kernel(self, "decode_into", self._decode_rows_into, buf.detach(), c, out)

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
        """Decode what [`encode`][loco.comm.codecs.contract.Codec.encode] made of a tensor of
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


def check_out(codec: Codec, out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{codec}: out must be {dtype} {tuple(shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")


def zeroed_rows(codec: Codec, buf: torch.Tensor, c: int, out: torch.Tensor | None
                ) -> torch.Tensor:
    """Check ``buf`` for rows of ``c`` values; the fp32 ``(rows, c)`` tensor a dropping codec
    decodes into: ``out`` (checked) zeroed, or new zeros."""
    codec._check_buf(buf, c)
    if out is None:
        return torch.zeros((buf.shape[0], c), dtype=torch.float32, device=buf.device)
    check_out(codec, out, (buf.shape[0], c), torch.float32)
    return out.zero_()
