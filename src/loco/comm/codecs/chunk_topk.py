"""SparseLoCo's wire format: in every chunk of ``block`` values, the ``k`` largest magnitudes,
each in 2 bits, with two bf16 magnitudes per chunk and the set of positions coded compactly.

Workers keep different positions, so a mean cannot be formed chunk by chunk on the way (a
reduce-scatter would encode it a second time): these codecs are all-gathered
(``gathers``; [`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean]).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.profiler import record_function

from loco.comm.codecs.bitpack import ef_decode_checked, ef_encode, pack, unpack
from loco.comm.codecs.contract import Codec, check_out, zeroed_rows
from loco.comm.codecs.formats import (
    DEFAULT_CHUNK,
    DEFAULT_CHUNK_KEEP,
    chunk_kept,
    chunk_topk_bytes,
    index_bits,
)
from loco.comm.hostreads import device_path

PIECE_VALUES = 1 << 24
"""The most values (all rows together) a chunked top-k codec encodes, decodes or adds at
once: the bound on its temporaries (the piece's magnitudes, 64 MiB of fp32, and a few bytes
per chunk), whatever the size of the rows."""


class ChunkTopKCodec(Codec):
    """``topk_2bit`` (positions Elias-Fano coded) and ``topk_2bit_packed`` (positions as
    ``ceil(log2 block)``-bit integers: 12 bits for 4096, the peers' packing).

    Of each chunk of ``block`` values, the ``k = ceil(keep · block)`` largest magnitudes
    are sent. Where several equal magnitudes share the k-th place, ``torch.topk`` picks which
    of them are kept, and it promises no order for ties (not the lower position): k values
    are kept all the same, but which ones, and so the bytes, may differ between devices or
    torch builds. The workers agree regardless: each decodes the bytes that were sent.
    Each kept value is 2 bits: its sign, and whether its magnitude is at least the mean
    magnitude ``m`` of the chunk's kept values. It decodes as ``±lo`` or ``±hi``, the mean
    magnitude of the kept values below ``m`` and of those at or above it (each rounded to
    bf16), so each group's decoded magnitudes sum to about its true ones. A chunk is laid
    out ``[2-bit codes][lo, hi as bf16][positions]``; a row is its chunks back to back.

    A non-finite value makes its chunk's magnitudes NaN or infinite, and such a chunk decodes
    as NaN throughout (as a scaled codec's block does): every worker sees it, and the sync is
    skipped or stopped alike.

    A chunk whose every value is kept (``k = block``) sends no positions.

    Args:
        name: ``"topk_2bit"`` or ``"topk_2bit_packed"``.
        block: values per chunk, an integer in [2, 65536].
        keep: the share kept per chunk, in (0, 1]; ``k`` is computed exactly from its
            shortest decimal form.
        k: the values kept per chunk, in [1, block], in place of ``keep``'s; default None.
        mean: how the gathered messages are averaged (``gather_mean``): ``"all"``, the sum
            over the workers divided by their count M (the paper's box), or ``"senders"``,
            each position's sum divided by the workers that sent it a nonzero value
            (the reference code's ``scatter_reduce(..., "mean")``); default ``"all"``.
    """

    gathers = True
    PROBE = (1.0, -2.0, 2.0, -1.0)  # two magnitudes: exact when every value is kept

    def __init__(self, name: str, block: int, keep: float, k: int | None = None,
                 mean: str = "all"):
        super().__init__(name, block)
        self.keep, self.mean = keep, mean
        self.k = chunk_kept(block, keep) if k is None else k
        self.elias_fano = name == "topk_2bit"
        self.chunk_bytes = chunk_topk_bytes(name, block, self.k)
        self._value_bytes = -(-2 * self.k // 8)

    def _row_bytes(self, c: int) -> int:
        return c // self.block * self.chunk_bytes

    def encode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode every row on its own, chunk by chunk (see the class), in pieces of at most
        ``PIECE_VALUES`` values (all rows together): each chunk's bytes depend on its values
        only, so the pieces give the same bytes as one pass, with temporaries of one piece.

        Args:
            x: fp32 ``(rows, c)``, ``c`` a multiple of ``block`` (a non-contiguous ``x`` is
                copied first).
            out: where to write the bytes, uint8 ``(rows, row_bytes(c))``; default None.

        Returns:
            uint8 ``(rows, row_bytes(c))`` (``out`` when given), never aliasing ``x``.
        """
        self._check_rows(x)
        rows, c = x.shape
        shape = (rows, self.row_bytes(c))
        if out is not None:
            check_out(self, out, shape, torch.uint8)
        enc = out if out is not None and out.is_contiguous() else torch.empty(
            shape, dtype=torch.uint8, device=x.device)
        chunks = x.detach().reshape(-1, self.block)
        into = enc.view(-1, self.chunk_bytes)
        for a, b in self._pieces(chunks.shape[0]):
            self._encode_chunks(chunks[a:b], into[a:b])
        return enc if out is None or enc is out else out.copy_(enc)

    def _pieces(self, chunks: int):
        """The ranges ``(a, b)`` of at most ``PIECE_VALUES`` values' chunks, of ``chunks``."""
        step = max(1, PIECE_VALUES // self.block)
        return [(a, min(a + step, chunks)) for a in range(0, chunks, step)]

    def _encode_chunks(self, chunks: torch.Tensor, into: torch.Tensor) -> None:
        """Encode the chunks ``(n, block)`` into the contiguous uint8 ``(n, chunk_bytes)``."""
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
        torch.cat([pack(codes, 2), scales, self._where(idx)], dim=1, out=into)

    def _where(self, idx: torch.Tensor) -> torch.Tensor:
        """The positions' bytes of chunks' sorted kept positions ``idx`` ``(n, k)``: none
        when every value is kept, else Elias-Fano or packed."""
        if self.k == self.block:
            return idx.new_zeros((idx.shape[0], 0), dtype=torch.uint8)
        if self.elias_fano:
            return ef_encode(idx, self.block)
        return pack(idx, index_bits(self.block))

    def _positions(self, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept positions (int64 ``(n, k)``, within their chunk) that ``_where`` coded,
        and whether each chunk's code was sound (bool ``(n,)``; a damaged Elias-Fano code
        is not)."""
        n = where.shape[0]
        valid = torch.ones(n, dtype=torch.bool, device=where.device)
        if self.k == self.block:
            idx = torch.arange(self.k, device=where.device).expand(n, -1).contiguous()
        elif self.elias_fano:  # a damaged chunk (a worker's message) reads as non-finite
            idx, valid = ef_decode_checked(where, self.block, self.k)
        else:
            idx = unpack(where, self.k, index_bits(self.block))
        return idx.clamp_(0, self.block - 1), valid  # damaged bytes stay inside their chunk

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
        dense = out if out.is_contiguous() else torch.zeros_like(out)
        chunks = dense.view(-1, self.block)
        for a, b, idx, vals, bad in self._kept_pieces(buf):
            chunks[a:b].scatter_(1, idx, vals)
            chunks[a:b].masked_fill_(bad, math.nan)  # masked, not read: no device wait
        return dense if dense is out else out.copy_(dense)

    def row_stats(self, buf: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's squared norm and sum of values (fp32, ``(rows,)``), from its kept
        values without the dense decode: NaN for a row with a non-finite chunk.

        Args:
            buf: uint8 ``(rows, row_bytes(c))``.
            c: values per row, a multiple of ``block``.
        """
        self._check_buf(buf, c)
        per_chunk = torch.empty((buf.shape[0] * (c // self.block), 2), device=buf.device)
        for a, b, _, vals, bad in self._kept_pieces(buf):
            vals.masked_fill_(bad, math.nan)
            torch.stack([vals.square().sum(dim=1), vals.sum(dim=1)], dim=1, out=per_chunk[a:b])
        sums = per_chunk.view(buf.shape[0], -1, 2).sum(dim=1)
        return sums[:, 0], sums[:, 1]

    def add_rows(self, buf: torch.Tensor, c: int, total: torch.Tensor,
                 scale: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        """Add the kept values of the rows ``buf`` into ``total`` where they go (a scatter-add
        of ``k`` values per chunk: each position gets at most one), leaving out the chunks
        that held a non-finite value, which are returned for the caller to mark.

        Args:
            buf: uint8 ``(rows, row_bytes(c))``.
            c: values per row, a multiple of ``block``.
            total: the contiguous fp32 ``(rows, c)`` sum, updated in place.
            scale: a 0-dim fp32 tensor the values are multiplied by first (a guard's clip);
                default None.
            counts: fp32 like ``total``: 1 is added where a nonzero value is added (the
                senders of each position, for ``mean="senders"``); default None.

        Returns:
            bool ``(rows · c / block, 1)``: the chunks that held a NaN or an infinity.
        """
        self._check_buf(buf, c)
        check_out(self, total, (buf.shape[0], c), torch.float32)
        chunks = total.view(-1, self.block)
        bad = torch.empty((chunks.shape[0], 1), dtype=torch.bool, device=total.device)
        for a, b, idx, vals, piece_bad in self._kept_pieces(buf):
            if scale is not None:
                vals.mul_(scale)
            chunks[a:b].scatter_add_(1, idx, vals.masked_fill_(piece_bad, 0.0))
            if counts is not None:
                counts.view(-1, self.block)[a:b].scatter_add_(1, idx, (vals != 0).float())
            bad[a:b].copy_(piece_bad)
        return bad

    def subtract_rows(self, buf: torch.Tensor, c: int, x: torch.Tensor) -> None:
        """``x ← x − decode_rows(buf, c)``, in place, without the dense decode: the error
        feedback's ``e ← e − D(C(e))`` from ``C(e)``'s bytes. Each kept value's negation is
        added where it goes (``x + (−v)`` is ``x − v`` exactly, and ``x − 0`` is ``x``), and
        a chunk that held a non-finite value has NaN subtracted throughout (as its dense
        decode, NaN there, would): the same bits as ``x.sub_(decode_rows(buf, c))``.

        Args:
            buf: uint8 ``(rows, row_bytes(c))``.
            c: values per row, a multiple of ``block``.
            x: the contiguous fp32 ``(rows, c)``, updated in place.
        """
        self._check_buf(buf, c)
        check_out(self, x, (buf.shape[0], c), torch.float32)
        chunks = x.view(-1, self.block)
        for a, b, idx, vals, bad in self._kept_pieces(buf):
            chunks[a:b].scatter_add_(1, idx, vals.masked_fill_(bad, 0.0).neg_())
            if device_path(x.device) or bool(bad.any()):  # CPU: a read of a CPU tensor
                nan = torch.zeros(bad.shape, dtype=torch.float32, device=x.device)
                chunks[a:b].sub_(nan.masked_fill_(bad, math.nan))

    def _kept_pieces(self, buf: torch.Tensor):
        """``(a, b, *_kept(chunks a to b))`` for the pieces (`_pieces`) of the rows ``buf``'s
        chunks, one piece decoded at a time."""
        every = buf.reshape(-1, self.chunk_bytes)  # copies only rows apart in memory
        for a, b in self._pieces(every.shape[0]):
            yield (a, b, *self._kept(every[a:b]))

    def _kept(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per chunk of the rows ``buf``: the kept positions (int64, ``(chunks, k)``), their
        decoded values (fp32) and whether the chunk held a non-finite value (bool,
        ``(chunks, 1)``), all on ``buf``'s device."""
        chunks = buf.reshape(-1, self.chunk_bytes)
        nv = self._value_bytes
        codes = unpack(chunks[:, :nv], self.k, 2)
        # a packed copy (a clone of one row would keep its stride, an odd one maybe)
        scales = chunks[:, nv:nv + 4].clone(memory_format=torch.contiguous_format)
        scales = scales.view(torch.bfloat16).to(torch.float32)
        idx, valid = self._positions(chunks[:, nv + 4:])
        mag = torch.where(codes >= 2, scales[:, 1:2], scales[:, 0:1])
        vals = torch.where(codes & 1 == 1, -mag, mag)
        return idx, vals, ~(torch.isfinite(scales).all(dim=1, keepdim=True) & valid[:, None])

    # A flat vector's operations (those of a codec of another layout differ: ``TiledTopK``).
    def encode_flat(self, flat: torch.Tensor, out: torch.Tensor,
                    buffers: Any = None) -> torch.Tensor:
        """The module's ``encode_flat`` with this codec.

        Args:
            flat: the values.
            out: where the bytes go.
            buffers: a Comm's kept buffers, or None.
        """
        return encode_flat(self, flat, out, buffers)

    def decode_flat(self, message: torch.Tensor, out: torch.Tensor,
                    buffers: Any = None) -> None:
        """The module's ``decode_flat`` with this codec.

        Args:
            message: ``encode_flat``'s row.
            out: where the values go.
            buffers: a Comm's kept buffers, or None.
        """
        decode_flat(self, message, out, buffers)

    def subtract_flat(self, message: torch.Tensor, x: torch.Tensor) -> None:
        """The module's ``subtract_flat`` with this codec.

        Args:
            message: ``encode_flat``'s bytes.
            x: the values, updated in place.
        """
        subtract_flat(self, message, x)

    def gather_mean(self, flat: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module's ``gather_mean`` with this codec.

        Args:
            flat: the values, overwritten with the mean.
            *args: the rest of ``gather_mean``'s arguments, from ``parts`` on.
            **kwargs: the same, by name.
        """
        return gather_mean(self, flat, *args, **kwargs)

    def __repr__(self) -> str:
        return f"Codec({self.name}, block={self.block}, k={self.k})"


BF16_MAX = torch.finfo(torch.bfloat16).max


# ---------------------------------------------------------- a flat vector, as one padded row
# ``codec.encode(flat)`` is one row of ``codec.padded(n)`` values, ``flat`` zero-padded. These
# give its bytes, and use them, with no padded copy of ``flat``: its whole chunks are read and
# written where they are, the last, partial one through a copy of one chunk.

def _split(codec: ChunkTopKCodec, n: int) -> tuple[int, int]:
    """(values in the whole chunks of ``n``, their bytes)."""
    whole = n - n % codec.block
    return whole, codec.row_bytes(whole)


def _last_chunk(codec: ChunkTopKCodec, buffers, values: torch.Tensor | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """A ``(1, block)`` fp32 buffer (``buffers``' ``"last chunk"``, or new where it is None)
    holding ``values`` then zeros (left as it was without ``values``)."""
    shape = (1, codec.block)
    if buffers is not None:
        last = buffers("last chunk", shape, torch.float32)
    else:
        last = torch.empty(shape, dtype=torch.float32, device=device or values.device)
    if values is not None:
        last[0, :values.numel()].copy_(values)
        last[0, values.numel():].zero_()
    return last


def encode_flat(codec: ChunkTopKCodec, flat: torch.Tensor, out: torch.Tensor,
                buffers=None) -> torch.Tensor:
    """``C(flat)``, the bytes of ``codec.encode(flat)``, into ``out``'s first
    ``codec.encoded_nbytes(n)`` bytes, with no padded copy of ``flat``.

    Args:
        codec: a chunked top-k codec.
        flat: the contiguous 1-D fp32 values, ``n`` of them, >= 1.
        out: 1-D uint8, at least ``encoded_nbytes(n)`` bytes; on another device than
            ``flat``, the bytes are made on ``flat``'s and copied.
        buffers: a Comm's [`Buffers`][loco.comm.reduce.Buffers] for the one-chunk copy;
            default None (a new one).

    Returns:
        ``out``'s first ``encoded_nbytes(n)`` bytes, as one row ``(1, encoded_nbytes(n))``.
    """
    n = flat.numel()
    nbytes = codec.encoded_nbytes(n)
    if out.device != flat.device:
        here = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
        return out[:nbytes].copy_(encode_flat(codec, flat, here).view(-1)).view(1, -1)
    mine = out[:nbytes].view(1, -1)
    whole, split = _split(codec, n)
    if whole:
        codec.encode_rows(flat[:whole].view(1, -1), out=mine[:, :split])
    if whole < n:
        codec.encode_rows(_last_chunk(codec, buffers, flat[whole:]), out=mine[:, split:])
    return mine


def decode_flat(codec: ChunkTopKCodec, message: torch.Tensor, out: torch.Tensor,
                buffers=None) -> None:
    """``D(C(flat))`` from ``message`` (``encode_flat``'s row) into ``out``, 1-D fp32 of ``n``
    values: the first ``n`` of ``codec.decode`` of the padded row.

    Args:
        codec: the codec that made ``message``.
        message: uint8 ``(1, encoded_nbytes(n))``.
        out: the contiguous 1-D fp32 result.
        buffers: as for ``encode_flat``.
    """
    n = out.numel()
    whole, split = _split(codec, n)
    if whole:
        codec.decode_rows(message[:, :split], whole, out=out[:whole].view(1, -1))
    if whole < n:
        last = _last_chunk(codec, buffers, device=out.device)
        codec.decode_rows(message[:, split:], codec.block, out=last)
        out[whole:].copy_(last[0, :n - whole])


def subtract_flat(codec: ChunkTopKCodec, message: torch.Tensor, x: torch.Tensor) -> None:
    """``x ← x − D(C)``, ``message`` the bytes ``C`` of a vector of ``x``'s ``n`` values
    (``encode_flat``'s), in place and bit for bit as ``x.sub_(decoded)`` (see
    [`subtract_rows`][loco.comm.codecs.chunk_topk.ChunkTopKCodec.subtract_rows]), with no
    vector-sized temporary.

    Args:
        codec: the codec that made ``message``.
        message: uint8, at least ``encoded_nbytes(n)`` bytes, on ``x``'s device.
        x: the contiguous 1-D fp32 values.
    """
    n = x.numel()
    whole, split = _split(codec, n)
    message = message.reshape(1, -1)
    if whole:
        codec.subtract_rows(message[:, :split], whole, x[:whole].view(1, -1))
    if whole < n:
        last = _last_chunk(codec, None, x[whole:])
        codec.subtract_rows(message[:, split:codec.encoded_nbytes(n)], codec.block, last)
        x[whole:].copy_(last[0, :n - whole])


def gather_mean(codec: ChunkTopKCodec, flat: torch.Tensor, parts: int, divisor: int,
                buffers, all_gather, sent: torch.Tensor | None = None, guard=None,
                wire=None) -> torch.Tensor:
    """Average ``flat`` over ``parts`` workers, in place, through one all-gather of every
    worker's encoded ``flat`` (``encode_flat``): each adds the messages' kept values where they
    go (``codec.add_rows``), in rank order, so all get the same bits: for every value the fp32
    sum of the workers' kept values in rank order, divided by ``divisor``; a chunk any worker
    sent non-finite is NaN throughout. The sum is formed in ``flat`` itself (its last, partial
    chunk in a kept one-chunk buffer), in pieces of at most ``PIECE_VALUES`` values; this
    worker's message and the gathered ones are kept buffers of a few bytes per chunk.

    Args:
        codec: a chunked top-k codec (one that ``gathers``).
        flat: the contiguous 1-D fp32 tensor, overwritten with the mean.
        parts: workers M, >= 1.
        divisor: what the sum is divided by (the workers that contribute).
        buffers: the Comm's [`Buffers`][loco.comm.reduce.Buffers].
        all_gather: ``all_gather(out, tensor)``, the group's all-gather into ``out``
            ``(parts, bytes)``.
        sent: fp32, ``numel`` values: receives ``D(C(flat))``; or uint8 of at least
            ``codec.encoded_nbytes(numel)`` bytes: receives ``C(flat)`` itself, the message
            (for ``subtract_flat``); default None.
        guard: a [`Guard`][loco.comm.guard.Guard] that judges each message by its norm
            and digest (``row_stats``) and scales it (0: left out) before the sum, which
            is divided by ``divisor`` less the messages left out; default None.
        wire: called on this worker's message before it is sent (an injected
            ``bitflip``); default None.

    Returns:
        ``flat``, holding the mean.
    """
    n = flat.numel()
    if n == 0:
        return flat
    nbytes = codec.encoded_nbytes(n)
    keeps_bytes = sent is not None and sent.dtype == torch.uint8
    mine = sent if keeps_bytes else buffers("message", (nbytes,), torch.uint8)
    with record_function("loco/encode"):
        mine = encode_flat(codec, flat, mine, buffers)
    if sent is not None and not keeps_bytes:  # flat's values are encoded: D(C(flat))
        decode_flat(codec, mine, sent[:n], buffers)
    if wire is not None:
        wire(mine)
    gathered = buffers("gathered", (parts, nbytes), torch.uint8)
    with record_function("loco/all_gather"):
        if parts == 1:
            gathered.copy_(mine)
        else:
            all_gather(gathered, mine[0])
    with record_function("loco/decode"):
        whole, split = _split(codec, n)
        scales, divisor = _judged(codec, gathered, whole, split, divisor, guard)
        combine = (sum_into if guard is None or not guard.coordinatewise
                   else functools.partial(_per_index, guard=guard))
        if whole:
            combine(flat[:whole].view(1, -1), codec, gathered[:, :split], divisor, scales)
        if whole < n:
            last = _last_chunk(codec, buffers)
            combine(last, codec, gathered[:, split:], divisor, scales)
            flat[whole:].copy_(last[0, :n - whole])
    return flat


def _judged(codec: ChunkTopKCodec, gathered: torch.Tensor, whole: int, split: int,
            divisor: int, guard) -> tuple[torch.Tensor | None, Any]:
    """``judge_parts`` of a flat vector's messages: its whole chunks, and its last one."""
    parts = [(codec, gathered[:, :split], whole)] if whole else []
    if split < gathered.shape[1]:
        parts.append((codec, gathered[:, split:], codec.block))
    return judge_parts(parts, whole or codec.block, divisor, guard)


def judge_parts(parts: list, n: int, divisor: int, guard) -> tuple[torch.Tensor | None, Any]:
    """The guard's scale of each message (None without a guard, or one that does not scale:
    it names the messages all the same) and the divisor less the messages it leaves out.

    Args:
        parts: ``(codec, bytes (M, row_bytes(c)), c)`` of each part of the messages.
        n: the values the digest counts.
        divisor: the workers that contribute.
        guard: a [`Guard`][loco.comm.guard.Guard], or None.
    """
    if guard is None:
        return None, divisor
    stats = [codec.row_stats(m, c) for codec, m, c in parts]
    square = sum(s[0] for s in stats)
    sums = sum(s[1] for s in stats)
    norms = square.sqrt()
    scales = guard.judge(norms, guard.digest(norms, sums, n))
    if guard.coordinatewise:
        return None, divisor
    return scales, divisor - guard.left_out(scales, norms).sum()


def _per_index(total: torch.Tensor, codec: ChunkTopKCodec, messages: torch.Tensor,
               divisor: Any, scales: Any, guard: Any) -> None:
    """``total`` (1, c) ← per index, over the values the workers that sent it sent (a
    decoded 0 is an index not sent), as the dense formats' coordinate-wise rules are over
    all workers: the median (the mean of the middle two of an even count), or the mean
    without the largest and smallest ``max(1, k // 4)`` of k >= 3 values (``"trimmed"``);
    0 where none sent it. Decoded a piece of whole chunks at a time (``PIECE_VALUES``
    values over all the messages)."""
    m, c = messages.shape[0], total.shape[1]
    chunks, step = c // codec.block, max(1, PIECE_VALUES // (m * codec.block))
    for a in range(0, chunks, step):
        b = min(chunks, a + step)
        rows = codec.decode_rows(messages[:, a * codec.chunk_bytes:b * codec.chunk_bytes],
                                 (b - a) * codec.block)
        total[0, a * codec.block:b * codec.block] = robust_columns(rows, guard.aggregation)


def robust_columns(rows: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Each column's median or trimmed mean over its nonzero finite values (see
    ``_per_index``; a non-finite value is named by its message's norm and counts as not
    sent: it would sort past the placeholders of the workers that did not send)."""
    sent = (rows != 0) & rows.isfinite()
    count = sent.sum(dim=0)
    ordered = torch.sort(rows.masked_fill(~sent, math.inf), dim=0).values
    if aggregation == "median":
        lo = ordered.gather(0, ((count - 1) // 2).clamp(min=0)[None])
        hi = ordered.gather(0, (count // 2).clamp(max=rows.shape[0] - 1)[None])
        return torch.where(count > 0, (lo[0] + hi[0]) / 2, 0.0)
    cut = torch.where(count >= 3, (count // 4).clamp(min=1), 0)
    rank = torch.arange(rows.shape[0], device=rows.device)[:, None]
    kept = (rank >= cut) & (rank < count - cut)
    total = torch.where(kept, ordered, 0.0).sum(dim=0)
    return torch.where(count > 0, total / (count - 2 * cut).clamp(min=1), 0.0)


def sum_into(total: torch.Tensor, codec: ChunkTopKCodec, messages: torch.Tensor,
              divisor: Any, scales: torch.Tensor | None = None) -> None:
    """``total`` (1, c) ← the sum of the rows of ``messages``' kept values (each times its
    ``scales`` entry, where given: 0 leaves it out), added in rank order, NaN throughout a
    chunk any of them sent non-finite, divided by ``divisor`` (``codec.mean == "all"``) or,
    position by position, by the messages that sent it a nonzero value (``"senders"``: 0
    where none did)."""
    c = total.shape[1]
    total.zero_()
    counts = torch.zeros_like(total) if codec.mean == "senders" else None
    bad = torch.zeros((c // codec.block, 1), dtype=torch.bool, device=total.device)
    for r in range(messages.shape[0]):  # (times 1: the same bits; times 0: nothing added)
        scale = None if scales is None else scales[r]
        kept = codec.add_rows(messages[r:r + 1], c, total, scale, counts)
        bad |= kept if scale is None else kept & (scale != 0)
    total.view(bad.shape[0], -1).masked_fill_(bad, math.nan)
    total.div_(divisor if counts is None else counts.clamp_(min=1))


__all__ = ["DEFAULT_CHUNK", "DEFAULT_CHUNK_KEEP", "PIECE_VALUES", "ChunkTopKCodec",
           "decode_flat", "encode_flat", "gather_mean", "subtract_flat"]
