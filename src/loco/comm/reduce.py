"""The mean all-reduce's arithmetic, apart from the transport: how a flat tensor is cut into
chunks, encoded, averaged and decoded, and into which buffers.

The one definition of the codec calls an all-reduce makes (their shapes, dtypes and
buffers): [`Comm.all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean] runs
[`reduce_mean`][loco.comm.reduce.reduce_mean] over the process group, and
[`Codec.prepare`][loco.comm.codecs.contract.Codec.prepare] runs it over a loopback, so that it
compiles exactly the fused kernels the all-reduce will call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import record_function

from loco.comm.guard import Guard


def chunk_elems(numel: int, parts: int) -> int:
    """Values per chunk when ``numel`` values are cut into ``parts`` equal chunks:
    ``ceil(numel / parts)`` (the last chunk zero-padded).

    Args:
        numel: values, >= 0.
        parts: chunks (the workers M), >= 1.
    """
    return math.ceil(numel / parts) if numel else 0


def layout(numel: int, parts: int, codec: Any, itemsize: int) -> tuple[int, int]:
    """``(chunk, row_bytes)`` of a mean all-reduce: the values per chunk and the bytes one
    chunk takes on the wire. With a codec a chunk holds whole blocks
    (``codec.padded(ceil(numel / parts))`` values) and carries its own scales
    (``codec.row_bytes(chunk)``); without one it is ``ceil(numel / parts)`` values of
    ``itemsize`` bytes.

    Args:
        numel: values of the flat tensor, >= 0.
        parts: workers M, >= 1.
        codec: the wire format, or None (the tensor's own dtype).
        itemsize: bytes per value of the tensor (used without a codec).
    """
    if codec is None:
        chunk = chunk_elems(numel, parts)
        return chunk, chunk * itemsize
    chunk = codec.padded(chunk_elems(numel, parts))
    return chunk, codec.row_bytes(chunk)


class Buffers(dict):
    """Buffers kept between the operations of one Comm, by ``(role, dtype)``: a sync does not
    allocate, and page in, fragment-sized memory every time. Operations run one at a time
    (on the Comm's thread), so one buffer per role and dtype is kept, the largest asked for
    so far; a smaller request uses its beginning.

    Args:
        device: where the buffers live.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __call__(self, role: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` for ``role`` (its contents are left as they were).

        Args:
            role: what the buffer is for, e.g. ``"received"``.
            shape: its shape.
            dtype: its dtype.
        """
        numel = math.prod(shape)
        buf = self.get((role, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self[role, dtype] = buf
        return buf[:numel].view(shape)


AllToAll = Callable[[torch.Tensor, torch.Tensor], None]
AllGather = Callable[[torch.Tensor, torch.Tensor], None]
AllReduce = Callable[[torch.Tensor], None]


#: The most bytes of fp32 values one piece of a large all-reduce holds, all workers' rows
#: together: the bound on the buffers it keeps (``reduce_mean``).
PIECE_BYTES = 64 << 20


def piece_width(chunk: int, parts: int, codec: Any, itemsize: int) -> int:
    """Values per row of one piece of a mean all-reduce of ``parts`` chunks of ``chunk``:
    ``chunk`` itself (one piece) for a small one or a codec whose blocks are not encoded on
    their own (``codec.blockwise``); else whole blocks, at most ``PIECE_BYTES`` of the
    ``parts`` rows together.

    Args:
        chunk: values per chunk, from [`layout`][loco.comm.reduce.layout].
        parts: workers M, >= 1.
        codec: the wire format, or None.
        itemsize: bytes per value (4 under a codec, which reduces in fp32).
    """
    if codec is not None and not codec.blockwise:
        return chunk
    align = codec.align if codec is not None else 1
    width = max(align, PIECE_BYTES // (parts * max(itemsize, 4)) // align * align)
    return min(chunk, width)


def reduce_mean(flat: torch.Tensor, chunk: int, codec: Any, parts: int, divisor: int,
                buffers: Buffers, all_to_all: AllToAll, all_gather: AllGather,
                sent: torch.Tensor | None = None, all_reduce: AllReduce | None = None,
                guard: Guard | None = None, wire: Callable[[torch.Tensor], Any] | None = None
                ) -> torch.Tensor:
    """Average ``flat`` over ``parts`` workers, in place. Unencoded, with ``all_reduce``:
    the transport's own sum (NCCL's or gloo's all-reduce, which gives every worker the same
    bits), divided by ``divisor``. Otherwise through two collectives: a reduce-scatter done
    as an all-to-all (worker j receives chunk j of every worker, decodes it and sums it in
    fp32, in rank order, so every worker gets the same bits) and an all-gather of the
    encoded means, which every worker decodes.

    A large tensor goes in pieces (`piece_width`): piece k holds values [k·w, (k+1)·w) of
    every chunk, so the buffers kept stay under ``PIECE_BYTES`` whatever the tensor; the
    values, the bytes and who reduces what are those of one piece (blocks are encoded on
    their own), at the cost of two collectives per piece.

    Args:
        flat: the contiguous 1-D tensor, overwritten with the mean; fp32 with a codec.
        chunk: values per chunk, from [`layout`][loco.comm.reduce.layout].
        codec: the wire format, or None (the tensor's own dtype, unencoded).
        parts: workers M, >= 1.
        divisor: what the sum is divided by (the workers that contribute).
        buffers: where the operation's intermediate results are kept.
        sent: where to write what this worker's values became on the wire (its encoded
            chunks, decoded: ``D(C(flat))``, the first ``numel`` values), for error
            feedback; default None.
        all_to_all: ``all_to_all(received, outgoing)``: flat buffers of equal size; worker
            j's slice i of ``outgoing`` lands in worker i's slice j of ``received``.
        all_gather: ``all_gather(out, tensor)``: every worker's contiguous ``tensor`` into
            ``out``, a contiguous tensor of shape ``(parts, *tensor.shape)``, in rank order.
        all_reduce: ``all_reduce(tensor)``: the sum over the workers, in place, the same
            bits on every worker; used without a codec; default None (the all-to-all and
            all-gather above, summing in rank order).
        guard: what combines each chunk's rows in place of their mean
            ([`Guard.combine`][loco.comm.guard.Guard.combine]); default None (the mean).
        wire: called on this worker's outgoing rows once encoded, before they are sent
            (an injected ``bitflip``); default None.

    Returns:
        ``flat``, holding the mean.
    """
    n = flat.numel()
    if n == 0 or (parts == 1 and codec is None):
        return flat
    if codec is None and all_reduce is not None:
        if sent is not None:  # unencoded, what went on the wire is the values themselves
            sent.copy_(flat)
        with record_function("loco/all_reduce"):
            all_reduce(flat)
        return flat.div_(divisor)
    ops = (codec, parts, divisor, buffers, all_to_all, all_gather, guard, wire)
    width = piece_width(chunk, parts, codec, flat.element_size())
    if width == chunk:
        rows = _rows(flat, parts * chunk, buffers).view(parts, chunk)
        echo = None if sent is None else (lambda e: sent.copy_(e.reshape(-1)[:n]))
        rows = _reduce_rows(rows, *ops, echo)
        if rows.data_ptr() != flat.data_ptr():
            flat.copy_(rows.reshape(-1)[:n])
        return flat
    for start in _piece_starts(chunk, width, flat.is_meta):
        w = min(width, chunk - start)
        rows = _piece(flat, buffers("piece", (parts, w), flat.dtype), chunk, start)
        echo = None if sent is None else (lambda e, s=start: _put(e, sent, chunk, s))
        _put(_reduce_rows(rows, *ops, echo), flat, chunk, start)
    return flat


def _reduce_rows(rows: torch.Tensor, codec: Any, parts: int, divisor: int, buffers: Buffers,
                 all_to_all: AllToAll, all_gather: AllGather, guard: Guard | None,
                 wire: Callable[[torch.Tensor], Any] | None,
                 echo: Callable[[torch.Tensor], Any] | None) -> torch.Tensor:
    """The mean of ``rows`` (parts, c), row j reduced by worker j: in ``rows`` or a new
    tensor (returned). ``echo`` receives what this worker's rows became on the wire."""
    width = rows.shape[1]
    if parts == 1:  # nothing to send, but the value is what the wire format can carry
        rows = codec.decode_rows(codec.encode_rows(rows), width)
        if echo is not None:
            echo(rows)
        return rows
    encode, decode = _coders(codec, width, buffers)
    # One profiler range per phase, on the calling thread: docs/profiling.md.
    with record_function("loco/encode"):
        outgoing = encode(rows, "outgoing")
        if echo is not None:  # before the all-to-all: the kept buffers are reused below
            echo(rows if codec is None else decode(outgoing, "echo"))
        if wire is not None:
            wire(outgoing)
    received = buffers("received", outgoing.shape, outgoing.dtype)
    with record_function("loco/all_to_all"):
        all_to_all(received.view(-1), outgoing.view(-1))
    with record_function("loco/reduce"):
        mine = encode(_mean_rows(received, width, codec, decode, divisor, buffers, guard),
                      "mine")
    # Everyone decodes the same gathered bytes into ``rows``. Unencoded, they land there.
    gathered = rows if codec is None else buffers("gathered", (parts, mine.shape[1]), mine.dtype)
    with record_function("loco/all_gather"):
        all_gather(gathered, mine[0])
    with record_function("loco/decode"):
        if gathered.data_ptr() != rows.data_ptr():
            rows = decode(gathered, rows)
    return rows


def _piece_starts(chunk: int, width: int, meta: bool) -> list[int]:
    """Where each piece of ``width`` values starts in a chunk of ``chunk``. On the meta
    device (``loco plan``'s dry run) only the first piece and the last: a meta tensor holds
    no values, so every piece of one width runs the same operations on the same kept
    buffers, and the bytes are counted before the reduction (a 70B model's sync has
    thousands of pieces)."""
    starts = list(range(0, chunk, width))
    return starts[:1] + starts[-1:] if meta and len(starts) > 2 else starts


def _spans(rows: torch.Tensor, n: int, chunk: int, start: int):
    """Each row of a piece (parts, w) with the range [lo, hi) of the flat tensor of ``n``
    values it holds: values [start, start + w) of its chunk, cut at ``n``."""
    w = rows.shape[1]
    for j, row in enumerate(rows):
        lo = min(n, j * chunk + start)
        yield row, lo, min(n, lo + w)


def _piece(flat: torch.Tensor, rows: torch.Tensor, chunk: int, start: int) -> torch.Tensor:
    """Into ``rows`` (parts, w): values [start, start + w) of each chunk of ``flat``, zero
    past its end."""
    for row, lo, hi in _spans(rows, flat.numel(), chunk, start):
        row[:hi - lo].copy_(flat[lo:hi])
        row[hi - lo:].zero_()
    return rows


def _put(rows: torch.Tensor, flat: torch.Tensor, chunk: int, start: int) -> None:
    """Write ``rows`` (parts, w) back where `_piece` took them from (within ``flat``)."""
    for row, lo, hi in _spans(rows, flat.numel(), chunk, start):
        flat[lo:hi].copy_(row[:hi - lo])


def _coders(codec: Any, chunk: int, buffers: Buffers) -> tuple:
    """``encode(rows, into)`` and ``decode(buf, into)`` for one all-reduce. With a codec
    that writes straight into a buffer, the result goes into ``into``: a tensor, or the kept
    buffer of that role (a str); with another codec, into new tensors; without one, the
    values are the result."""
    if codec is None:
        return (lambda x, into: x), (lambda x, into: x)
    if not codec.writes_into:  # the dropping codecs: new tensors, copied where needed
        return ((lambda x, into: codec.encode_rows(x)),
                (lambda buf, into: codec.decode_rows(buf, chunk)))

    def buffer(into, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        return into if isinstance(into, torch.Tensor) else buffers(into, (rows, width), dtype)

    def encode(x: torch.Tensor, into) -> torch.Tensor:
        out = buffer(into, x.shape[0], codec.row_bytes(chunk), torch.uint8)
        return codec.encode_rows(x, out=out)

    def decode(buf: torch.Tensor, into) -> torch.Tensor:
        out = buffer(into, buf.shape[0], chunk, torch.float32)
        return codec.decode_rows(buf, chunk, out=out)

    return encode, decode


def _mean_rows(received: torch.Tensor, c: int, codec: Any, decode: Callable, divisor: int,
               buffers: Buffers, guard: Guard | None = None) -> torch.Tensor:
    """The (1, c) mean of the rows ``received`` holds (decoded by ``decode``), summed in
    rank order then divided by ``divisor``, in the kept ``"sum"`` buffer: in one pass where
    the codec can (``codec.decode_mean_rows``, the same bits), else decoded, summed, divided;
    with a guard, what it combines them into."""
    if guard is not None:
        decoded = decode(received, "decoded")
        return guard.combine(decoded, divisor, buffers("sum", (1, c), decoded.dtype))
    if codec is not None and codec.writes_into and received.shape[0] >= 2:
        # The decoded rows' buffer is kept either way, so that a rank's buffers (its
        # memory_bytes_per_rank, and loco plan's, made on the meta device) do not depend on
        # whether this CPU compiled the kernel: at most one piece.
        buffers("decoded", (received.shape[0], c), torch.float32)
        total = buffers("sum", (1, c), torch.float32)
        if codec.decode_mean_rows(received, c, total, divisor):
            return total
    return _sum_rows(decode(received, "decoded"), buffers).div_(divisor)


def _sum_rows(rows: torch.Tensor, buffers: Buffers) -> torch.Tensor:
    """The (1, c) sum of the rows of ``rows``, added one after another in rank order, into
    a kept buffer (a pass per row: faster than ``sum(dim=0)``, docs/benchmarks.md)."""
    total = buffers("sum", (1, rows.shape[1]), rows.dtype)
    torch.add(rows[0], rows[1], out=total[0])
    for row in rows[2:]:
        total[0].add_(row)
    return total


def _rows(flat: torch.Tensor, size: int, buffers: Buffers) -> torch.Tensor:
    """``flat`` padded with zeros to ``size`` values: ``flat`` itself when it has them all,
    else a copy in a kept buffer."""
    if flat.numel() == size:
        return flat
    padded = buffers("padded", (size,), flat.dtype)
    padded[:flat.numel()].copy_(flat)
    padded[flat.numel():].zero_()
    return padded
