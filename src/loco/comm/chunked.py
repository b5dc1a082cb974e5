"""SparseLoCo's wire format: in every chunk of ``block`` values, the ``k`` largest magnitudes,
each in 2 bits, with two bf16 magnitudes per chunk and the set of positions coded compactly.

Workers keep different positions, so a mean cannot be formed chunk by chunk on the way (a
reduce-scatter would encode it a second time): these codecs are all-gathered
(``gathers``; [`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean]).
"""

from __future__ import annotations

import math

import torch

from loco.comm.bits import ef_decode, ef_encode, pack, unpack
from loco.comm.codec import Codec, check_out, zeroed_rows
from loco.comm.formats import (
    DEFAULT_CHUNK,
    DEFAULT_CHUNK_KEEP,
    chunk_kept,
    chunk_topk_bytes,
    index_bits,
)


class ChunkTopKCodec(Codec):
    """``topk_2bit`` (positions Elias-Fano coded) and ``topk_2bit_packed`` (positions as
    ``ceil(log2 block)``-bit integers: 12 bits for 4096, the peers' packing).

    Of each chunk of ``block`` values, the ``k = ceil(keep · block)`` largest magnitudes
    are sent (ties: the lower position, as ``torch.topk`` orders them on one device).
    Each kept value is 2 bits: its sign, and whether its magnitude is at least the mean
    magnitude ``m`` of the chunk's kept values. It decodes as ``±lo`` or ``±hi``, the mean
    magnitude of the kept values below ``m`` and of those at or above it (each rounded to
    bf16), so each group's decoded magnitudes sum to about its true ones. A chunk is laid
    out ``[2-bit codes][lo, hi as bf16][positions]``; a row is its chunks back to back.

    A non-finite value makes its chunk's magnitudes NaN or infinite, and such a chunk decodes
    as NaN throughout (as a scaled codec's block does): every worker sees it, and the sync is
    skipped or stopped alike.

    Args:
        name: ``"topk_2bit"`` or ``"topk_2bit_packed"``.
        block: values per chunk, an integer in [2, 65536].
        keep: the share kept per chunk, in (0, 1]; ``k`` is computed exactly from its
            shortest decimal form.
    """

    gathers = True
    PROBE = (1.0, -2.0, 2.0, -1.0)  # two magnitudes: exact when every value is kept

    def __init__(self, name: str, block: int, keep: float):
        super().__init__(name, block)
        self.keep = keep
        self.k = chunk_kept(block, keep)
        self.elias_fano = name == "topk_2bit"
        self.chunk_bytes = chunk_topk_bytes(name, block, self.k)
        self._value_bytes = -(-2 * self.k // 8)

    def _row_bytes(self, c: int) -> int:
        return c // self.block * self.chunk_bytes

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode every row on its own, chunk by chunk (see the class).

        Args:
            x: fp32 ``(rows, c)``, ``c`` a multiple of ``block``.
            out: where to copy the bytes, uint8 ``(rows, row_bytes(c))``; default None.

        Returns:
            uint8 ``(rows, row_bytes(c))`` (``out`` when given).
        """
        self._check_rows(x)
        rows = x.shape[0]
        chunks = x.detach().reshape(-1, self.block)
        idx = torch.topk(chunks.abs(), self.k, dim=1, sorted=False).indices.sort(dim=1).values
        v = chunks.gather(1, idx)
        mag = v.abs().double()  # sums of fp32 magnitudes near fp32's max must not overflow
        hi = mag >= mag.mean(dim=1, keepdim=True)
        n_hi = hi.sum(dim=1, dtype=torch.float64)
        sum_hi = (mag * hi).sum(dim=1)
        s_hi = sum_hi / n_hi.clamp(min=1)
        s_lo = (mag.sum(dim=1) - sum_hi) / (self.k - n_hi).clamp(min=1)
        s = torch.stack([s_lo, s_hi], dim=1).float()
        s = torch.where(torch.isfinite(s), s.clamp(max=BF16_MAX), s)  # bf16's max < fp32's
        scales = s.to(torch.bfloat16).view(torch.uint8)
        codes = (v < 0).to(torch.int64) | hi.to(torch.int64) << 1
        where = ef_encode(idx, self.block) if self.elias_fano else pack(
            idx, index_bits(self.block))
        enc = torch.cat([pack(codes, 2), scales, where], dim=1).view(rows, -1)
        return enc if out is None else _into(self, out, enc)

    def decode_rows(self, buf: torch.Tensor, c: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Dense fp32 rows: the kept values at their positions, zeros elsewhere, NaN
        throughout a chunk that held a non-finite value.

        Args:
            buf: uint8 ``(rows, row_bytes(c))``.
            c: values per row.
            out: where to write them, fp32 ``(rows, c)``; default None.

        Returns:
            fp32 ``(rows, c)`` (``out`` when given).
        """
        out = zeroed_rows(self, buf, c, out)
        if c == 0:
            return out
        idx, vals, bad = self._kept(buf)
        dense = out if out.is_contiguous() else torch.zeros_like(out)
        chunks = dense.view(-1, self.block)
        chunks.scatter_(1, idx, vals)
        chunks.masked_fill_(bad, math.nan)  # masked, not read: no wait for the device
        return dense if dense is out else out.copy_(dense)

    def add_rows(self, buf: torch.Tensor, c: int, total: torch.Tensor) -> torch.Tensor:
        """Add the kept values of the rows ``buf`` into ``total`` where they go (a scatter-add
        of ``k`` values per chunk: each position gets at most one), leaving out the chunks
        that held a non-finite value, which are returned for the caller to mark.

        Args:
            buf: uint8 ``(rows, row_bytes(c))``.
            c: values per row, a multiple of ``block``.
            total: the contiguous fp32 ``(rows, c)`` sum, updated in place.

        Returns:
            bool ``(rows · c / block, 1)``: the chunks that held a NaN or an infinity.
        """
        self._check_buf(buf, c)
        check_out(self, total, (buf.shape[0], c), torch.float32)
        idx, vals, bad = self._kept(buf)
        total.view(-1, self.block).scatter_add_(1, idx, vals.masked_fill_(bad, 0.0))
        return bad

    def _kept(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per chunk of the rows ``buf``: the kept positions (int64, ``(chunks, k)``), their
        decoded values (fp32) and whether the chunk held a non-finite value (bool,
        ``(chunks, 1)``), all on ``buf``'s device."""
        chunks = buf.reshape(-1, self.chunk_bytes)
        nv = self._value_bytes
        codes = unpack(chunks[:, :nv], self.k, 2)
        scales = chunks[:, nv:nv + 4].clone().view(torch.bfloat16).to(torch.float32)
        where = chunks[:, nv + 4:]
        idx = (ef_decode(where, self.block, self.k) if self.elias_fano
               else unpack(where, self.k, index_bits(self.block)))
        mag = torch.where(codes >= 2, scales[:, 1:2], scales[:, 0:1])
        vals = torch.where(codes & 1 == 1, -mag, mag)
        return idx, vals, ~torch.isfinite(scales).all(dim=1, keepdim=True)

    def __repr__(self) -> str:
        return f"Codec({self.name}, block={self.block}, k={self.k})"


BF16_MAX = torch.finfo(torch.bfloat16).max


def _into(codec: Codec, out: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    check_out(codec, out, tuple(enc.shape), torch.uint8)
    return out.copy_(enc)


__all__ = ["DEFAULT_CHUNK", "DEFAULT_CHUNK_KEEP", "ChunkTopKCodec"]
