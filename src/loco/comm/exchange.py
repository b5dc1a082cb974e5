"""A group's exchange in pieces ([`Comm.exchange_pieces`][loco.comm.comm.Comm.exchange_pieces]):
a message every member builds, swaps and consumes one piece at a time, so that neither its
own message nor the members' are ever held whole.

Piece k of every member's message is built into one kept send buffer, sent to every other
member of the group while their piece k is received into kept receive buffers (the sends and
receives posted together, as [`Comm.exchange`][loco.comm.comm.Comm.exchange] does), and
handed, once all have arrived, to the caller, which consumes it (NoLoCo: sums the group's
means) before piece k + 1 is built into the same buffers. The buffers are the Comm's
(``Comm.buffer_bytes`` counts them), each the size of the largest piece. The whole is one
operation: issued on the Comm's thread, counted once, with the bytes of the whole message.

Also the bodies of the Comm's other point-to-point operations (``exchange``, ``sendrecv``):
validated, counted and posted as one operation each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from loco.comm.auth import TAG_BYTES
from loco.comm.seal import exchange_seal, mac_bytes

if TYPE_CHECKING:
    from loco.comm.handles import Handle

Comm = Any  # a loco.comm.comm.Comm (not imported: comm.py imports this module)

ALIGN = 16
"""Bytes the receive buffers' rows are rounded up to, so that every row starts aligned for
any dtype a piece holds (fp32 values are read in place)."""

Build = Callable[[int, torch.Tensor], Any]
Consume = Callable[[int, list], Any]


def check_peers(comm: Comm, op: str, peers: Iterable[int],
                tensors: Iterable[torch.Tensor] = ()) -> None:
    """Raise unless every one of ``peers`` is another rank of ``comm``'s group and every
    one of ``tensors`` is contiguous.

    Raises:
        ValueError: a peer out of range or this worker itself, or a non-contiguous tensor.
    """
    for p in peers:
        if not 0 <= p < comm.size or p == comm.rank:
            raise ValueError(f"{comm.name} rank {comm.rank} cannot exchange with peer {p} "
                             f"(group of {comm.size})")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"{op} needs contiguous tensors")


def exchange_whole(comm: Comm, tensor: torch.Tensor, members: Iterable[int], tag: str
                   ) -> Handle:
    """[`Comm.exchange`][loco.comm.comm.Comm.exchange]'s body: ``tensor`` sent to the other
    members and theirs received into new tensors, posted together (staged through host
    memory where ``tensor`` lives on ``comm.stage_from``)."""
    members = tuple(sorted(members))
    staged = comm._staged((tensor,), lambda t: comm.exchange(t, members, tag),
                          lambda out, h: [tensor if o is h[0] else comm._staging.to_device(o)
                                          for o in out])
    if staged is not None:
        return staged
    if comm.rank not in members:
        raise ValueError(f"{comm.name} rank {comm.rank} is not in the group {members}")
    peers = [r for r in members if r != comm.rank]
    out = {comm.rank: tensor, **{r: torch.empty_like(tensor) for r in peers}}
    return p2p(comm, "exchange", tag, tensor.numel() * tensor.element_size(),
               [(tensor, r) for r in peers], [(out[r], r) for r in peers],
               [out[r] for r in members])


def sendrecv(comm: Comm, sends: Sequence[tuple], recvs: Sequence[tuple], tag: str) -> Handle:
    """[`Comm.sendrecv`][loco.comm.comm.Comm.sendrecv]'s body: staged through host memory
    where a tensor lives on ``comm.stage_from``, else posted as one operation."""
    staged = comm._staged([t for t, *_ in (*sends, *recvs)], lambda *h: comm.sendrecv(
        [(t, *rest) for t, (_, *rest) in zip(h, sends)],
        [(t, *rest) for t, (_, *rest) in zip(h[len(sends):], recvs)], tag),
        lambda out, h: [t for t, *_ in recvs], back=range(len(sends), len(sends) + len(recvs)))
    if staged is not None:
        return staged
    op = "sendrecv" if sends and recvs else ("send" if sends else "recv")
    raw = sum(t.numel() * t.element_size() for t, *_ in sends)
    return p2p(comm, op, tag, raw, sends, recvs, [t for t, *_ in recvs])


def p2p(comm: Comm, op: str, tag: str, raw: int, sends: Sequence[tuple],
        recvs: Sequence[tuple], result: Any) -> Handle:
    """Validate, count and post point-to-point sends and receives ``(tensor, peer[,
    message tag])`` as one operation on ``comm`` (see
    [`Comm.sendrecv`][loco.comm.comm.Comm.sendrecv]); ``wait()`` returns ``result``."""
    sends = [(t, int(p), int(rest[0]) if rest else 0) for t, p, *rest in sends]
    recvs = [(t, int(p), int(rest[0]) if rest else 0) for t, p, *rest in recvs]
    check_peers(comm, op, [p for _, p, _ in sends + recvs], [t for t, _, _ in sends + recvs])
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    sent, received = sum(nbytes(t) for t, _, _ in sends), sum(nbytes(t) for t, _, _ in recvs)
    peers = tuple(sorted({p for _, p, _ in sends + recvs} | {comm.rank}))
    return comm._submit(op, tag, raw, sent, received,
                        lambda: comm._posted(comm._post(sends, recvs), result),
                        [t for t, _, _ in sends + recvs], participants=peers)


def exchange_pieces(comm: Comm, sizes: Sequence[int], members: Iterable[int], build: Build,
                    consume: Consume, tag: str = "train",
                    tensors: Sequence[torch.Tensor] = ()) -> Handle:
    """Swap a message of pieces of ``sizes`` bytes with the other ``members`` of a group,
    one piece at a time, asynchronously: one operation on ``comm``'s thread.

    For each piece k in turn: ``build(k, out)`` writes this worker's piece k into ``out``
    (uint8, ``sizes[k]`` bytes on ``comm``'s device); it is sent to every other member while
    theirs are received; ``consume(k, pieces)`` takes every member's piece k, in sorted rank
    order (``out`` among them; all of them its to overwrite, none kept after it returns),
    before piece k + 1 is built into the same buffers. Both run on the Comm's thread (on
    CUDA, on its stream, after the caller's work up to the issue). Counted as one
    ``exchange`` of the whole message, like [`Comm.exchange`][loco.comm.comm.Comm.exchange]
    of ``sum(sizes)`` bytes: ``(n - 1) * sum(sizes)`` bytes each way for a group of n.
    On gloo the thread waits for each piece (as in a collective): every member must issue
    its operations on ``comm`` in the same order.

    Args:
        comm: the Comm.
        sizes: bytes of each piece, the same on every member, each >= 0.
        members: the group's ranks, this one included; every member calls this alike.
        build: writes piece k of this worker's message.
        consume: takes piece k of every member's message.
        tag: the tag its bytes are counted under; default ``"train"``.
        tensors: the tensors ``build`` and ``consume`` read or write (on ``comm``'s device),
            marked as used by the Comm's stream; default none.

    Returns:
        A handle whose ``wait()`` returns ``members``, sorted, once every piece is consumed.

    Raises:
        ValueError: this worker is not in ``members``, a member out of range, a negative
            size, or a tensor not on ``comm``'s device.
    """
    members = tuple(sorted(int(r) for r in members))
    if comm.rank not in members:
        raise ValueError(f"{comm.name} rank {comm.rank} is not in the group {members}")
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"exchange_pieces: piece sizes must be >= 0 (got {sizes})")
    peers = [r for r in members if r != comm.rank]
    check_peers(comm, "exchange_pieces", peers)
    total = sum(sizes) + (mac_bytes(len(sizes)) if comm.job_key is not None else 0)

    def run():
        _run(comm, sizes, members, build, consume)
        return members

    return comm._submit("exchange", tag, total, len(peers) * total, len(peers) * total, run,
                        list(tensors), participants=members)


def _run(comm: Comm, sizes: list[int], members: tuple[int, ...], build: Build,
         consume: Consume) -> None:
    """On the Comm's thread: every piece in turn, built, swapped, consumed. The transport's
    waits order the next piece after this one's (on CUDA, on the Comm's stream; on gloo
    the thread blocks, as in a collective)."""
    if not sizes:
        return
    peers = [r for r in members if r != comm.rank]
    workers = comm.senders()  # (an elastic quorum's ranks are not its workers)
    guard = comm.shield.at(comm.shield.clock(), [workers[r] for r in members])
    seal = exchange_seal(comm, members, guard)
    mac = 0 if seal is None else TAG_BYTES  # each piece with its tag after it
    stride = -(-(max(sizes) + mac) // ALIGN) * ALIGN
    out = comm._buffers("exchange_out", (stride,), torch.uint8)
    into = comm._buffers("exchange_in", (len(peers), stride), torch.uint8)
    for k, size in enumerate(sizes):
        mine, got = out[:size], [into[j, :size] for j in range(len(peers))]
        build(k, mine)
        if seal is not None:
            seal.tag_piece(mine, out[size:size + mac])
        with record_function("loco/exchange"):
            works = comm._post([(out[:size + mac], p, 0) for p in peers],
                               [(into[j, :size + mac], p, 0) for j, p in enumerate(peers)])
            for w in works:
                w.wait()
        theirs = {comm.rank: mine, **dict(zip(peers, got))}
        if seal is not None:
            tags = {comm.rank: out[size:size + mac],
                    **{p: into[j, size:size + mac] for j, p in enumerate(peers)}}
            seal.check_pieces([theirs[r] for r in members], [tags[r] for r in members])
        consume(k, [theirs[r] for r in members])
