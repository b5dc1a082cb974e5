"""SparseLoCo as its reference code cuts and quantises (tplr-ai/templar ``compress.py``):
each tensor in 2-D tiles, and optionally the values' 2 bits per tensor.

**Tiles.** A tensor of shape ``(R, C, ...)`` is read as a matrix ``R × (numel / R)`` (a 1-D
one as ``1 × n``) and cut into tiles of ``h × w`` values, ``h`` the largest divisor of ``R``
and ``w`` of the columns not above the side ``s`` (64: a 64 × 64 tile of 4,096 values,
``_get_smaller_split``). Of each tile the ``k`` largest magnitudes are sent (64 by default),
``k`` clamped to the tile: a tile of at most ``k`` values (a 1-D tensor's, of at most 64) is
sent whole, with no positions. The fragment's flat vector is read in tile order (a
permutation made once), so that each tile is one chunk of a
[`ChunkTopKCodec`][loco.comm.codecs.chunk_topk.ChunkTopKCodec], one codec per tile size.

**Values** (``values``): ``"split"``, loco's 2 bits of each tile (the sign, and whether the
magnitude is at least the tile's mean kept magnitude, decoded to each half's mean); or
``"stat"``, the reference's quantiser of each tensor's kept values together
([`StatTopK`][loco.comm.codecs.tiles.StatTopK]).

The message is the tensors' codes back to back, in the fragment's order; the mean is
formed in tile order and read back into the fragment's order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loco.comm.codecs.bitpack import pack, unpack
from loco.comm.codecs.chunk_topk import ChunkTopKCodec, judge_parts, robust_columns, sum_into
from loco.comm.codecs.contract import Codec

TILE_VALUES = ("split", "stat")
"""How a tiled top-k codes its kept values: loco's per tile, or the reference's per tensor."""


def largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` (>= 1) not above ``most`` (>= 1)."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


class StatTopK(ChunkTopKCodec):
    """The reference's 2-bit quantiser over the top-k of a row's chunks: a row is one tensor.

    Of each chunk the ``k`` largest magnitudes are kept, as ``ChunkTopKCodec`` keeps them.
    All the row's kept values ``v`` are then coded together: ``shift = mean(v)``, ``σ =
    ‖v − shift‖ / sqrt(n − 1)``, bin width ``b = 6σ / 4`` (1 where that is 0 or not finite),
    each value's code ``clamp(round((v − shift) / b + 2), 0, 3)``, decoded to the mean of the
    centred values of its code (0 for an empty code) plus ``shift``. A row is laid out
    ``[shift, 4 decoded values as fp32][per chunk: 2-bit codes, positions]``. A non-finite
    value makes the row's header non-finite, and the whole row decodes as NaN.

    Args:
        name: ``"topk_2bit"`` (positions Elias-Fano coded) or ``"topk_2bit_packed"``.
        block: values per chunk, in [1, 65536].
        k: values kept per chunk, in [1, block].
        mean: as ``ChunkTopKCodec``'s.
    """

    HEADER = 20
    BINS = 4
    RANGE = 6  # the bins span 6σ

    def __init__(self, name: str, block: int, k: int, mean: str = "all"):
        super().__init__(name, block, 1.0, k=k, mean=mean)
        self.chunk_bytes -= 4  # no magnitudes per chunk: the row's header holds them

    def _row_bytes(self, c: int) -> int:
        return self.HEADER + c // self.block * self.chunk_bytes if c else 0

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode every row on its own (see the class), each in one pass (a row is a tensor).

        Args:
            x: fp32 ``(rows, c)``, ``c`` a multiple of ``block``.
            out: where to write the bytes, uint8 ``(rows, row_bytes(c))``; default None.
        """
        self._check_rows(x)
        rows, c = x.shape
        enc = torch.empty((rows, self.row_bytes(c)), dtype=torch.uint8, device=x.device)
        for r in range(rows if c else 0):
            self._encode_row(x[r].detach().reshape(-1, self.block), enc[r])
        return enc if out is None else out.copy_(enc)

    def _encode_row(self, chunks: torch.Tensor, into: torch.Tensor) -> None:
        idx = torch.topk(chunks.abs(), self.k, dim=1, sorted=False).indices.sort(dim=1).values
        v = chunks.gather(1, idx)
        shift = v.mean()
        centred = v - shift
        width = self.RANGE * (centred.norm() / math.sqrt(max(v.numel() - 1, 1))) / self.BINS
        width = torch.where((width == 0) | ~width.isfinite(), 1.0, width)
        q = torch.nan_to_num(centred / width + self.BINS // 2, nan=0.0).round()
        q = q.clamp(0, self.BINS - 1).to(torch.int64)
        sums = torch.zeros(self.BINS, device=v.device).scatter_add_(0, q.view(-1),
                                                                      centred.view(-1))
        counts = torch.zeros(self.BINS, device=v.device).scatter_add_(
            0, q.view(-1), torch.ones_like(centred).view(-1))
        lookup = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
        header = torch.cat([shift.view(1), lookup]).view(torch.uint8)
        body = torch.cat([pack(q, 2), self._where(idx)], dim=1)
        into.copy_(torch.cat([header, body.view(-1)]))

    def _kept_pieces(self, buf: torch.Tensor):
        """``(a, b, idx, vals, bad)`` per row's chunks (``a``, ``b`` over all the rows')."""
        per_row = (buf.shape[1] - self.HEADER) // self.chunk_bytes if buf.shape[1] else 0
        nv = self._value_bytes
        for r in range(buf.shape[0] if per_row else 0):
            header = buf[r, :self.HEADER].clone().view(torch.float32)
            chunks = buf[r, self.HEADER:].view(per_row, self.chunk_bytes)
            idx, valid = self._positions(chunks[:, nv:])
            vals = header[1:][unpack(chunks[:, :nv], self.k, 2)] + header[0]
            bad = ~(header.isfinite().all() & valid)[:, None]
            yield r * per_row, (r + 1) * per_row, idx, vals, bad

    def __repr__(self) -> str:
        return f"Codec({self.name}, stat, block={self.block}, k={self.k})"


class TilePlan:
    """The tiles of a fragment's tensors, in the fragment's flat order.

    Args:
        shapes: each tensor's shape, in the order its values lie in the flat vector.
        side: the tiles' largest side (64).
    """

    def __init__(self, shapes: list, side: int):
        self.tiles: list[tuple[int, int, int]] = []
        """Per tensor: ``(values, h, w)``."""
        order, start = [], 0
        for shape in shapes:
            n = math.prod(shape)
            rows = shape[0] if len(shape) > 1 else 1
            h, w = largest_divisor(rows, side), largest_divisor(n // rows, side)
            grid = torch.arange(n).view(rows // h, h, n // rows // w, w)
            order.append(grid.permute(0, 2, 1, 3).reshape(-1) + start)
            self.tiles.append((n, h, w))
            start += n
        self.numel = start
        flat = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
        self.order = None if torch.equal(flat, torch.arange(start)) else flat
        """The fragment's positions in tile order (None: it is in tile order already)."""


class TiledTopK(Codec):
    """SparseLoCo's chunked top-k over one fragment's tiles (see the module).

    Its flat operations (``encode_flat``, ``decode_flat``, ``subtract_flat``,
    ``gather_mean``) are those of ``ChunkTopKCodec``, for the fragment's vector only.

    Args:
        name: ``"topk_2bit"`` or ``"topk_2bit_packed"`` (how positions are coded).
        shapes: the fragment's tensors' shapes, in its flat order.
        side: the tiles' largest side, >= 1 (64).
        k: the values kept per tile, >= 1, clamped to each tile (64).
        values: ``"split"`` or ``"stat"`` (see the module).
        mean: ``"all"`` or ``"senders"`` (``ChunkTopKCodec``'s).
        keep: the share it stands for, for the reports (``k / side²``); default None.
    """

    gathers = True

    def __init__(self, name: str, shapes: list, side: int, k: int, values: str = "split",
                 mean: str = "all", keep: float | None = None):
        super().__init__(name)
        self.plan, self.values, self.mean = TilePlan(shapes, side), values, mean
        self.k, self.keep = k, keep if keep is not None else k / side ** 2
        made: dict = {}
        self.segments = []
        """Per tensor: ``(codec, start, values, byte start, bytes)``."""
        start = at = 0
        for n, h, w in self.plan.tiles:
            block, kept = h * w, min(k, h * w)
            if (block, kept) not in made:
                made[block, kept] = (StatTopK(name, block, kept, mean) if values == "stat"
                                     else ChunkTopKCodec(name, block, 1.0, k=kept, mean=mean))
            codec = made[block, kept]
            nbytes = codec.row_bytes(n)
            self.segments.append((codec, start, n, at, nbytes))
            start, at = start + n, at + nbytes
        self._nbytes = at

    def _row_bytes(self, c: int) -> int:
        if c not in (0, self.plan.numel):
            raise ValueError(f"{self}: made for {self.plan.numel} values, not {c}")
        return self._nbytes if c else 0

    def _tiled(self, flat: torch.Tensor, buffers=None) -> torch.Tensor:
        """``flat`` in tile order: itself, or a kept buffer holding it permuted."""
        if self.plan.order is None:
            return flat
        out = (buffers("tiled", (flat.numel(),), torch.float32) if buffers is not None
               else torch.empty_like(flat))
        return torch.index_select(flat, 0, self._order(flat.device), out=out)

    def _order(self, device: torch.device) -> torch.Tensor:
        if self.plan.order.device != device:
            self.plan.order = self.plan.order.to(device)
        return self.plan.order

    def _untile(self, tiled: torch.Tensor, flat: torch.Tensor) -> None:
        """``flat`` ← ``tiled`` read back into the fragment's order."""
        if tiled is not flat:
            flat.index_copy_(0, self._order(flat.device), tiled)

    def encode_flat(self, flat: torch.Tensor, out: torch.Tensor, buffers=None) -> torch.Tensor:
        """``C(flat)`` into ``out``'s first ``encoded_nbytes(n)`` bytes, as one row."""
        tiled = self._tiled(flat, buffers)
        mine = out[:self._nbytes].view(1, -1)
        for codec, a, n, at, nbytes in self.segments:
            mine[:, at:at + nbytes].copy_(codec.encode_rows(tiled[a:a + n].view(1, -1)))
        return mine

    def decode_flat(self, message: torch.Tensor, out: torch.Tensor, buffers=None) -> None:
        """``D(C(flat))`` from ``message`` into the 1-D fp32 ``out``."""
        tiled = torch.empty_like(out) if self.plan.order is not None else out
        for codec, a, n, at, nbytes in self.segments:
            codec.decode_rows(message[:, at:at + nbytes], n, out=tiled[a:a + n].view(1, -1))
        self._untile(tiled, out)

    def subtract_flat(self, message: torch.Tensor, x: torch.Tensor) -> None:
        """``x ← x − D(C)``, in place, bit for bit as ``x.sub_(decoded)``."""
        tiled = self._tiled(x)
        message = message.reshape(1, -1)
        for codec, a, n, at, nbytes in self.segments:
            codec.subtract_rows(message[:, at:at + nbytes], n, tiled[a:a + n].view(1, -1))
        self._untile(tiled, x)

    def gather_mean(self, flat: torch.Tensor, parts: int, divisor: int, buffers, all_gather,
                    sent: torch.Tensor | None = None, guard=None, wire=None) -> torch.Tensor:
        """As ``loco.comm.codecs.chunk_topk.gather_mean``, over the tiles: one all-gather
        of every worker's message, the mean formed in tile order, tensor by tensor, in rank
        order (so every worker gets the same bits), and read back into ``flat``."""
        n = flat.numel()
        if n == 0:
            return flat
        keeps_bytes = sent is not None and sent.dtype == torch.uint8
        mine = sent if keeps_bytes else buffers("message", (self._nbytes,), torch.uint8)
        mine = self.encode_flat(flat, mine, buffers)
        if sent is not None and not keeps_bytes:
            self.decode_flat(mine, sent[:n], buffers)
        if wire is not None:
            wire(mine)
        gathered = buffers("gathered", (parts, self._nbytes), torch.uint8)
        if parts == 1:
            gathered.copy_(mine)
        else:
            all_gather(gathered, mine[0])
        parts_of = [(codec, gathered[:, at:at + nb], m) for codec, _, m, at, nb in self.segments]
        scales, divisor = judge_parts(parts_of, n, divisor, guard)
        total = self._tiled(flat, buffers)
        for (codec, a, m, at, nb) in self.segments:
            self._combine(codec, gathered[:, at:at + nb], total[a:a + m].view(1, -1), divisor,
                          scales, guard)
        self._untile(total, flat)
        return flat

    @staticmethod
    def _combine(codec: ChunkTopKCodec, messages: torch.Tensor, total: torch.Tensor,
                 divisor: Any, scales: Any, guard: Any) -> None:
        """``total`` (1, c) ← one tensor's mean of ``messages`` (``ChunkTopKCodec``'s rules:
        by ``codec.mean``, or per position by the guard's coordinate-wise rule)."""
        if guard is not None and guard.coordinatewise:
            total[0] = robust_columns(codec.decode_rows(messages, total.shape[1]),
                                      guard.aggregation)
            return
        sum_into(total, codec, messages, divisor, scales)

    def __repr__(self) -> str:
        return f"Codec({self.name}, tiles, {self.values}, k={self.k}, mean={self.mean})"


def tiled_codec(codec: ChunkTopKCodec, shapes: list, values: str = "split") -> TiledTopK:
    """A chunked top-k codec's tiled twin for one fragment: tiles of side ``sqrt(block)``
    (64 for 4,096), the same ``k``, positions coding and mean.

    Args:
        codec: the fragment's chunked top-k codec.
        shapes: the fragment's tensors' shapes, in its flat order.
        values: ``"split"`` or ``"stat"``.
    """
    side = math.isqrt(codec.block)
    return TiledTopK(codec.name, shapes, side, codec.k, values, codec.mean, codec.keep)


__all__ = ["TILE_VALUES", "StatTopK", "TilePlan", "TiledTopK", "largest_divisor",
           "tiled_codec"]
