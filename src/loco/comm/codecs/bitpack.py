"""Fixed-width bit packing and Elias-Fano coding of sorted index sets, row by row, in torch
ops only (no Python loop over values): the index and value codes of the sparse formats
(SparseLoCo's top-k, DeMo's DCT coefficients).

Bits are little-endian within a row: value ``j``'s bit ``b`` is bit ``j · width + b`` of the
row, and bit ``i`` of a row is bit ``i % 8`` of byte ``i // 8``. A row of ``n`` values of
``width`` bits takes exactly ``packed_bytes(n, width)`` bytes.
"""

from __future__ import annotations

import functools

import torch

from loco.comm.codecs.formats import ef_bytes, ef_low_bits, packed_bytes


@functools.lru_cache(maxsize=64)
def _spans(n: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``n`` values of ``width`` bits lies in a packed row: the byte of its
    first bit plus 0, 1, ... (as many as a value can touch, (n, touch)) and its first bit's
    position in that byte (n, 1). Cached: a codec packs rows of the same shape every sync."""
    start = torch.arange(n, device=device, dtype=torch.int64) * width
    touch = (width + 7 + 7) // 8  # a value of width bits starting at bit 7 of a byte
    where = (start // 8).unsqueeze(1) + torch.arange(touch, device=device, dtype=torch.int64)
    return where, (start % 8).unsqueeze(1)


def pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack the rows of ``values`` (non-negative integers below ``2**width``) into
    ``width`` bits each.

    Each value is shifted to its first bit's place in its first byte and cut into the bytes
    it touches; the pieces of different values occupy different bits, so adding them into
    the row is the same as or-ing them.

    Args:
        values: an integer tensor of shape (rows, n).
        width: bits per value, in [0, 32]; 0 packs nothing.

    Returns:
        uint8 of shape (rows, ``packed_bytes(n, width)``).
    """
    rows, n = values.shape
    nbytes = packed_bytes(n, width)
    if width == 0 or n == 0 or rows == 0:
        return torch.zeros(rows, nbytes, dtype=torch.uint8, device=values.device)
    where, shift = _spans(n, width, values.device)
    shifted = (values.to(torch.int64) << shift.T).unsqueeze(-1)  # (rows, n, 1)
    pieces = (shifted >> (8 * torch.arange(where.shape[1], device=values.device))) & 0xFF
    out = torch.zeros(rows, nbytes + where.shape[1], dtype=torch.int64, device=values.device)
    out.scatter_add_(1, where.reshape(1, -1).expand(rows, -1), pieces.reshape(rows, -1))
    return out[:, :nbytes].to(torch.uint8)


def unpack(buf: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """The ``n`` values of ``width`` bits per row that
    [`pack`][loco.comm.codecs.bitpack.pack] wrote.

    Args:
        buf: uint8 of shape (rows, >= ``packed_bytes(n, width)``).
        n: values per row.
        width: bits per value, in [0, 32].

    Returns:
        int64 of shape (rows, n).
    """
    rows, nbytes = buf.shape[0], packed_bytes(n, width)
    if width == 0 or n == 0 or rows == 0:
        return torch.zeros(rows, n, dtype=torch.int64, device=buf.device)
    where, shift = _spans(n, width, buf.device)
    # A value's last bytes may lie past the row's end: read the row's last byte there
    # instead; its bits land above the value's and are masked off.
    pieces = buf[:, :nbytes][:, where.clamp(max=nbytes - 1)].to(torch.int64)  # (rows, n, t)
    word = (pieces << (8 * torch.arange(where.shape[1], device=buf.device))).sum(-1)
    return (word >> shift.T) & ((1 << width) - 1)


def _bytes_of(bits: torch.Tensor) -> torch.Tensor:
    """uint8 (rows, m) of 0/1 -> uint8 (rows, ceil(m / 8)), bit i of a row in byte i // 8."""
    rows, m = bits.shape
    pad = -m % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (bits.view(rows, (m + pad) // 8, 8) * weights).sum(-1, dtype=torch.uint8)


def _bits_of(buf: torch.Tensor, m: int) -> torch.Tensor:
    """The first ``m`` bits of each row of ``buf`` as uint8 0/1, shape (rows, m)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=buf.device)
    bits = (buf.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(buf.shape[0], -1)[:, :m]


# ------------------------------------------------------------------------------ Elias-Fano
def ef_encode(sorted_idx: torch.Tensor, n: int) -> torch.Tensor:
    """Elias-Fano code of each row of ``sorted_idx`` (distinct indices below ``n``, in
    increasing order), ``ef_bytes(n, k)`` bytes per row.

    Args:
        sorted_idx: integers of shape (rows, k), each row strictly increasing, in [0, n).
        n: the range of the indices.

    Returns:
        uint8 of shape (rows, ``ef_bytes(n, k)``).
    """
    rows, k = sorted_idx.shape
    if k == 0:
        return torch.zeros(rows, 0, dtype=torch.uint8, device=sorted_idx.device)
    low = ef_low_bits(n, k)
    idx = sorted_idx.to(torch.int64)
    width = k + ((n - 1) >> low)
    bitmap = torch.zeros(rows, width, dtype=torch.uint8, device=idx.device)
    bitmap.scatter_(1, (idx >> low) + torch.arange(k, device=idx.device), 1)
    return torch.cat([pack(idx & ((1 << low) - 1), low), _bytes_of(bitmap)], dim=1)


def ef_decode(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The sorted indices that [`ef_encode`][loco.comm.codecs.bitpack.ef_encode] coded, found on the
    device: the j-th set bit of a row's bitmap, at the first bit where the running count of
    set bits reaches j (a binary search), is its j-th index's high part plus j. Nothing is
    read on the host.

    Args:
        buf: uint8 of shape (rows, >= ``ef_bytes(n, k)``).
        n: the range of the indices.
        k: indices per row.

    Returns:
        int64 of shape (rows, k), each row increasing.

    Raises:
        RuntimeError: a row's bitmap does not hold exactly ``k`` set bits (corrupt input);
            checked with ``torch._assert_async``: at once on the CPU, on a GPU when the
            device gets there (a device-side assertion).
    """
    idx, valid = ef_decode_checked(buf, n, k)
    torch._assert_async(valid.all(),
                        f"Elias-Fano rows must hold exactly {k} set bits each (corrupt input)")
    return idx


def ef_decode_checked(buf: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[`ef_decode`][loco.comm.codecs.bitpack.ef_decode] without its assertion: the indices
    (a corrupt row's are meaningless, but each is in ``[0, n + something)``: clamp before
    use), and whether each row's bitmap holds exactly ``k`` set bits (bool, ``(rows,)``),
    for a reader that must survive damaged input (a worker's message,
    ``loco.comm.codecs.chunk_topk``)."""
    rows = buf.shape[0]
    if k == 0:
        return (torch.zeros(rows, 0, dtype=torch.int64, device=buf.device),
                torch.ones(rows, dtype=torch.bool, device=buf.device))
    low = ef_low_bits(n, k)
    low_bytes = packed_bytes(k, low)
    width = k + ((n - 1) >> low)
    bitmap = _bits_of(buf[:, low_bytes:low_bytes + packed_bytes(width, 1)], width)
    count = bitmap.cumsum(dim=1)  # int64: the set bits up to and including each bit
    nth = torch.arange(1, k + 1, device=buf.device).expand(rows, k).contiguous()
    high = torch.searchsorted(count, nth) - (nth - 1)
    return (high << low) | unpack(buf[:, :low_bytes], k, low), count[:, -1] == k


__all__ = ["ef_bytes", "ef_decode", "ef_decode_checked", "ef_encode", "ef_low_bits", "pack", "packed_bytes",
           "unpack"]
