"""MACs on what loco's own averages move between workers, with a job key
(``loco.comm.auth.JobKey``; with ``encrypt``, AES-256-GCM in their place, which hides the
bytes and authenticates them, its nonce and tag in the MAC's 32 bytes): every row of a reduce-scatter's all-to-all, every row of its
all-gather, every all-gathered message and every piece of a gossip exchange carries a
32-byte HMAC-SHA256 tag bound to the operation's sequence number, its piece, its leg, the
sender and (point to point) the receiver; a replayed or altered row fails.

[`Seal`][loco.comm.seal.Seal] wraps a Comm's transport callables (its all-to-all, its
all-gather, its point-to-point posts) so that the arithmetic in ``loco.comm.reduce`` and
``loco.comm.codecs.chunk_topk`` is unchanged: the bytes go out with their tags appended and
come back checked and stripped. A contribution whose tag fails is handed to the guard as ``mac``
(left out and named: ``Guard.forged_next``); without a guard, and for a reduced mean (which
no one can do without), the operation fails with ``AuthError`` naming the sender.

The tags are computed on the host: a payload on a GPU is copied to host memory for them
(a read of the device at a sync); their cost is measured by ``benchmarks/auth_cost.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from loco.comm.auth import TAG_BYTES, AuthError, JobKey, context
from loco.comm.hostreads import allowed


class Seal:
    """The tags of one operation (sequence number ``op``) of worker ``me`` among
    ``senders`` (the worker each rank of the group is).

    Args:
        key: the job key.
        me: this worker.
        senders: the worker of each rank, in rank order.
        op: the operation's sequence number on this Comm (the same on every worker).
        guard: the guard that takes forged contributions (None: a forged one fails the
            operation).
        buffers: the Comm's kept buffers (for the tagged copies).
    """

    def __init__(self, key: JobKey, me: int, senders: Sequence[int], op: int, guard: Any,
                 buffers: Callable[..., torch.Tensor]):
        self.key, self.me, self.senders, self.op = key, me, list(senders), op
        self.guard, self.buffers = guard, buffers
        self._piece = 0

    def _ctx(self, leg: str, sender: int, receiver: int = -1) -> bytes:
        return context("loco", self.op, self._piece, leg, sender, receiver)

    def _protect(self, data: bytes, ctx: bytes) -> tuple[bytes | None, bytes]:
        """One row's ``(body, 32-byte tag)``: ``(None, its HMAC)`` (the bytes go as they
        are), or with encryption (``JobKey.encrypt``) the AES-GCM cipher text (as long as
        the bytes) and its 12-byte nonce and 16-byte tag, padded."""
        if not self.key.encrypt:
            return None, self.key.tag(data, ctx)
        sealed, n = self.key.seal(data, ctx), len(data)
        return sealed[12:12 + n], (sealed[:12] + sealed[12 + n:]).ljust(TAG_BYTES, b"\0")

    def _open(self, body: bytes, tag: bytes, ctx: bytes) -> bytes | None:
        """One row's bytes from ``_protect``'s body and tag: ``body`` once its MAC holds,
        decrypted with encryption; None where it fails."""
        if not self.key.encrypt:
            return body if self.key.verify(body, tag, ctx) else None
        try:
            return self.key.open(tag[:12] + body + tag[12:28], ctx)
        except AuthError:
            return None

    def _tagged(self, rows: torch.Tensor, role: str, contexts: list[bytes]) -> torch.Tensor:
        """``rows`` (any dtype, ``(n, w)``) as bytes (encrypted, with encryption) with each
        row's tag appended, in a kept buffer ``(n, w·itemsize + 32)``."""
        raw = rows.contiguous().view(torch.uint8).view(rows.shape[0], -1)
        width = raw.shape[1]
        out = self.buffers(role, (raw.shape[0], width + TAG_BYTES), torch.uint8)
        out[:, :width].copy_(raw)
        with allowed("sync"):
            host = raw.cpu().numpy()
            for i, ctx in enumerate(contexts):
                body, tag = self._protect(host[i].tobytes(), ctx)
                if body is not None:
                    out[i, :width].copy_(_bytes(body))
                out[i, width:].copy_(_bytes(tag))
        return out

    def _checked(self, tagged: torch.Tensor, rows: torch.Tensor, contexts: list[bytes]
                 ) -> list[int]:
        """Copy the payloads of ``tagged`` into ``rows`` (their bytes; decrypted, with
        encryption); the rows whose tag failed (their bytes zeroed)."""
        raw = rows.view(torch.uint8).view(rows.shape[0], -1)
        width, bad = raw.shape[1], []
        raw.copy_(tagged[:, :width])
        with allowed("sync"):
            host = tagged.cpu().numpy()
            for i, ctx in enumerate(contexts):
                data = self._open(host[i, :width].tobytes(), host[i, width:].tobytes(), ctx)
                if data is None:
                    bad.append(i)
                elif self.key.encrypt:
                    raw[i].copy_(_bytes(data))
        raw[bad] = 0
        return bad

    def _forged(self, bad: list[int], what: str) -> None:
        """Hand the rows that failed to the guard (left out, named ``mac``); fail without
        one."""
        if not bad:
            return
        if self.guard is None:
            raise AuthError(f"{what} from worker(s) {[self.senders[i] for i in bad]} failed "
                            "its MAC: tampered with, replayed, or sent without the job key")
        forged = torch.zeros(len(self.senders), dtype=torch.bool)
        forged[bad] = True
        self.guard.forged_next = forged

    def tag_piece(self, piece: torch.Tensor, into: torch.Tensor) -> None:
        """This worker's tag of an exchange's next piece (with encryption, the piece is
        encrypted in place).

        Args:
            piece: the piece's uint8 bytes.
            into: where the 32-byte tag goes.
        """
        tagged = self._tagged(piece.view(1, -1), "sealed piece", [self._ctx("exchange", self.me)])
        into.copy_(tagged[0, piece.numel():])
        if self.key.encrypt:
            piece.copy_(tagged[0, :piece.numel()])

    def check_pieces(self, pieces: list[torch.Tensor], tags: list[torch.Tensor]) -> None:
        """Check every member's piece against its tag (with encryption, decrypt it in
        place); a failed one is zeroed and handed to the guard (or fails the exchange);
        then on to the next piece.

        Args:
            pieces: every member's piece, in member order (this worker's own among them).
            tags: their tags, in the same order.
        """
        bad = []
        with allowed("sync"):
            for i, (piece, tag) in enumerate(zip(pieces, tags)):
                ctx = self._ctx("exchange", self.senders[i])
                data = self._open(piece.cpu().numpy().tobytes(), tag.cpu().numpy().tobytes(),
                                  ctx)
                if data is None:
                    bad.append(i)
                    piece.zero_()
                elif self.key.encrypt:
                    piece.copy_(_bytes(data))
        self._forged(bad, "an exchanged piece")
        self._piece += 1

    def all_to_all(self, raw: Callable) -> Callable:
        """An all-to-all with each row tagged for its receiver and checked from its sender.

        Args:
            raw: the transport's ``raw(received, outgoing)``, flat buffers of
                ``len(senders)`` equal rows.
        """
        def run(received: torch.Tensor, outgoing: torch.Tensor) -> None:
            n = len(self.senders)
            out_ctx = [self._ctx("scatter", self.me, r) for r in self.senders]
            tagged = self._tagged(outgoing.view(n, -1), "sealed out", out_ctx)
            into = self.buffers("sealed in", tagged.shape, torch.uint8)
            raw(into.view(-1), tagged.view(-1))
            in_ctx = [self._ctx("scatter", s, self.me) for s in self.senders]
            self._forged(self._checked(into, received.view(n, -1), in_ctx), "a contribution")
            self._piece += 1
        return run

    def all_gather(self, raw: Callable, what: str = "a reduced mean") -> Callable:
        """An all-gather with this worker's tensor tagged and every row checked: a failed
        one is a contribution for the guard, or an ``AuthError`` (a reduced mean).

        Args:
            raw: the transport's ``raw(out, tensor)``.
            what: ``"a reduced mean"`` (default) or ``"a message"`` (a contribution).
        """
        def run(out: torch.Tensor, tensor: torch.Tensor) -> None:
            mine = self._tagged(tensor.reshape(1, -1), "sealed mine",
                                [self._ctx("gather", self.me)])
            into = self.buffers("sealed all", (out.shape[0], mine.shape[1]), torch.uint8)
            raw(into, mine[0])
            bad = self._checked(into, out.view(out.shape[0], -1),
                                [self._ctx("gather", s) for s in self.senders])
            if bad and what == "a reduced mean":
                raise AuthError(f"a reduced mean from worker(s) {[self.senders[i] for i in bad]}"
                                " failed its MAC: tampered with, replayed, or sent without the "
                                "job key")
            self._forged(bad, what)
            self._piece += 1
        return run


def _bytes(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor (on the host; copied where it is written)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def exchange_seal(comm: Any, members: Sequence[int], guard: Any) -> Seal | None:
    """The seal of one gossip exchange (each piece's tags are bound to the sender alone:
    the same bytes go to every member), or None without a job key. Called on the Comm's
    thread as the exchange runs.

    Args:
        comm: the Comm.
        members: the group's ranks, sorted.
        guard: the guard that takes forged pieces, or None.
    """
    if comm.job_key is None:
        return None
    comm.sealed_ops += 1
    senders = comm.senders()
    return Seal(comm.job_key, senders[comm.rank], [senders[r] for r in members],
                comm.sealed_ops, guard, comm._buffers)


def mac_bytes(rows_per_leg: int, legs: int = 1) -> int:
    """The tags' bytes one worker sends in an operation.

    Args:
        rows_per_leg: tagged rows it sends to others in each leg.
        legs: legs of the operation; default 1.
    """
    return rows_per_leg * legs * TAG_BYTES


def sealed(comm: Any, step: int | None, guard: Any, all_to_all: Callable, all_gather: Callable,
           gathers: str = "a reduced mean") -> tuple[Callable, Callable]:
    """A Comm's transport callables for one training operation, tagged and checked when
    the Comm has a job key (``comm.job_key``). Called on the Comm's thread as the
    operation runs (in the one order every worker runs them: the sequence number is taken
    there).

    Args:
        comm: the Comm.
        step: the inner step; None: a setup or report operation (left as it is).
        guard: the guard that takes forged contributions, or None.
        all_to_all: the transport's all-to-all.
        all_gather: the transport's all-gather.
        gathers: what the all-gather moves: ``"a reduced mean"`` (default) or
            ``"a message"`` (contributions, which the guard judges).
    """
    if comm.job_key is None or step is None:
        return all_to_all, all_gather
    comm.sealed_ops += 1
    senders = comm.senders()
    seal = Seal(comm.job_key, senders[comm.rank], senders, comm.sealed_ops, guard, comm._buffers)
    return seal.all_to_all(all_to_all), seal.all_gather(all_gather, gathers)
