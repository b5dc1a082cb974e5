"""The dropping codecs (``topk``, ``dare``, ``random_drop``): of a row of ``c`` values exactly
``ceil(keep · c)`` are sent, in fp32, with where they go; the others decode as 0."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from loco.comm.codecs.contract import F32_MAX, Codec, check_out, zeroed_rows


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
        name: one of [`SPARSE_CODEC_NAMES`][loco.comm.codecs.formats.SPARSE_CODEC_NAMES].
        keep: the share of values kept, in (0, 1].
        align: values per row must be a multiple of this; default 1.
    """

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
            check_out(self, out, (rows, self.row_bytes(c)), torch.uint8)
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
        if out is not None and not out.is_contiguous():
            check_out(self, out, (buf.shape[0], c), torch.float32)
            return out.copy_(self.decode_rows(buf, c))
        out = zeroed_rows(self, buf, c, out)
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
        # Corrupt input is refused by torch._assert_async: no read of the device on the host.
        if self.uses_bitmap(c):
            mask = _unpack_bits(buf[:, 4 * k:], c)
            # The j-th value goes to the j-th marked position: the first where the running
            # count of marks reaches j (a binary search per value).
            count = mask.cumsum(dim=1, dtype=torch.int32 if c < 2**31 else torch.int64)
            torch._assert_async((count[:, -1] == k).all(),
                                f"{self}: a bitmap does not mark exactly {k} of {c} values")
            nth = torch.arange(1, k + 1, dtype=count.dtype, device=buf.device)
            out.scatter_(1, torch.searchsorted(count, nth.expand(len(buf), k).contiguous()),
                         values)
        else:
            idx = _index_from_bytes(buf[:, 4 * k:], self.index_width(c))
            torch._assert_async((idx < c).all(),
                                f"{self}: an index is beyond the row's {c} values")
            out.scatter_(1, idx, values)
        return out


#: The prime the random codecs hash modulo (2^31 − 1): every product of two residues fits
#: in int64, so the arithmetic is exact on any device, with no overflow.
_P = 2**31 - 1


def _mix(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """A round of mixing of residues mod ``_P`` (int64 in [0, _P)): affine mod _P, then the
    high bits folded into the low ones, then affine again."""
    x = (x * a + b) % _P
    x = x ^ (x >> 13)
    return (x * 1_103_515_245 + 12_345) % _P


class RandomDropCodec(SparseCodec):
    """``random_drop`` (FedDropout-style) and ``dare``: k positions of each row drawn at
    random, the values there in fp32, and the 8-byte seed they were drawn from.

    A row costs ``4k + 8`` bytes (0 for an empty row). The seed is a hash of the row's fp32
    bits keyed by the codec's ``seed`` (two independent 31-bit sums, mod 2^31 − 1, of a mix
    of each value's bits with its position); the positions are the k smallest of a keyed
    hash of every position (`positions`). Everything is integer arithmetic without overflow
    on the row's own device, so a GPU's encoding and decoding read nothing back to the host,
    and every device gives the same bits. So encoding is a pure function of the row: the
    same row gives the same bytes on every worker, thread, device and call, and different
    rows (the workers' chunks, the owner's mean) get independent draws. ``dare`` multiplies
    the kept values by ``c / k`` on decoding (DARE's 1 / (1 − p), exact in expectation), the
    result clamped to ±fp32 max; ``random_drop`` sends them unscaled. A row that holds a NaN
    or an infinity is sent with all k values NaN, so it cannot be dropped silently.

    Args:
        name: ``"random_drop"`` or ``"dare"``.
        keep: the share of values kept, in (0, 1].
        seed: keys the hash of the rows, an integer in [0, 2^64); default 0.
    """

    SEED_BYTES = 8

    def __init__(self, name: str, keep: float, seed: int = 0):
        super().__init__(name, keep)
        self.seed, self.rescale = seed, name == "dare"
        self._keys = (seed % _P, (seed >> 31) % _P, (seed >> 62) + 7)

    def _where_bytes(self, c):
        return self.SEED_BYTES

    def row_seeds(self, x: torch.Tensor) -> torch.Tensor:
        """The seed of each row of ``x`` (rows, c), int64 in [0, 2^62), on ``x``'s device.

        Args:
            x: an fp32 tensor of shape ``(rows, c)``.
        """
        bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        at = torch.arange(x.shape[1], device=x.device, dtype=torch.int64)
        halves = []
        for lane, key in enumerate(self._keys[:2]):
            t = _mix(at + key, 48_271 + lane, self._keys[2])  # the position, keyed
            t = _mix((t * 65_536 + (bits & 0xFFFF)) % _P, 69_621 + lane, lane)
            t = _mix((t * 65_536 + (bits >> 16)) % _P, 16_807 + lane, lane)
            halves.append(_mix(t.sum(dim=1) % _P, 39_373 + lane, lane))  # sum < c · 2^31
        return halves[0] * 2**31 + halves[1]

    @staticmethod
    def positions(seeds: torch.Tensor, c: int, k: int) -> torch.Tensor:
        """The k positions (int64, on ``seeds``' device) each row keeps under its seed: the
        k smallest of a hash of every position keyed by the seed, made distinct by the
        position in the low bits (so no tie, and any device picks the same).

        Args:
            seeds: int64 ``(rows,)`` in [0, 2^62), from `row_seeds`.
            c: values in the row, < 2^32.
            k: values kept, in [1, c].
        """
        at = torch.arange(c, device=seeds.device, dtype=torch.int64)
        hi, lo = (seeds // 2**31).unsqueeze(1), (seeds % 2**31).unsqueeze(1)
        key = _mix(_mix(at + lo % _P, 48_271, 11) ^ hi % _P, 69_621, 13) ^ lo % _P
        key = _mix(key % _P, 16_807, 17) * 2 ** max(1, c.bit_length()) + at
        return key.topk(k, dim=1, largest=False, sorted=True).indices

    def _encode(self, x: torch.Tensor, k: int) -> torch.Tensor:
        seeds = self.row_seeds(x)
        values = x.gather(1, self.positions(seeds, x.shape[1], k))  # new: never aliases x
        bad = ~torch.isfinite(x).all(dim=1, keepdim=True)  # rare: such rows send NaN
        values = torch.where(bad, torch.full_like(values, math.nan), values)
        return torch.cat([values.view(torch.uint8), seeds.view(-1, 1).view(torch.uint8)], dim=1)

    def _decode(self, buf: torch.Tensor, c: int, k: int, values: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
        seeds = _view_as(buf[:, 4 * k:], torch.int64).view(-1)
        if self.rescale:
            values = (values * (c / k)).clamp_(-F32_MAX, F32_MAX)  # clamp keeps NaN
        return out.scatter_(1, self.positions(seeds, c, k), values)

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


def check_sparse(name: str, keep, seed) -> None:
    if (not isinstance(keep, (int, float)) or isinstance(keep, bool)
            or not (math.isfinite(keep) and 0 < keep <= 1)):
        raise ValueError(f"codec {name}: keep must be a number in (0, 1], got {keep!r}")
    if (not isinstance(seed, int) or isinstance(seed, bool)) or not 0 <= seed < 1 << 64:
        raise ValueError(f"codec {name}: seed must be an int in [0, 2**64), got {seed!r}")
