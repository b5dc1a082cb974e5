"""Byte accounting: one record per communication operation and totals per tag.

``raw`` bytes are the size of the tensor the caller asked to reduce or send; ``sent`` and
``received`` bytes are what a worker actually put on and took off the wire.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

@dataclass
class OpRecord:
    """One communication operation as this worker saw it.

    Args:
        op: the operation: ``"all_reduce_mean"``, ``"broadcast"``, ``"all_gather"``,
            ``"exchange"``, ``"send"``, ``"recv"`` or ``"sendrecv"``.
        tag: what the bytes were for (``"train"``, ``"setup"``, ``"eval"``, ...), the key
            of the totals in [`CommStats`][loco.comm.accounting.CommStats].
        raw_bytes: the size of the tensor the caller asked to reduce or send.
        sent_bytes: bytes this worker put on the wire.
        recv_bytes: bytes this worker took off the wire.
        participants: ranks (in the Comm's group) taking part, sorted.
        issued_at: ``time.perf_counter()`` when the caller issued it.
        seconds: issue to completion: time in flight, including queueing (0.0 until done).
            On a CUDA Comm on the device's clock, filled in once the operation has
            happened on the device (see ``loco.comm.accounting.DeviceTimes``).
        waited: time the caller spent blocked in ``Handle.wait()`` (0.0 until waited on);
            on a CUDA Comm, the time the caller's stream was held by the wait.
    """

    op: str
    tag: str
    raw_bytes: int
    sent_bytes: int
    recv_bytes: int
    participants: tuple[int, ...]  # ranks (in the Comm's group) taking part
    issued_at: float  # time.perf_counter() when the caller issued it
    seconds: float = 0.0  # issue to completion: time in flight, including queueing
    waited: float = 0.0  # time the caller spent blocked in Handle.wait()

    def as_dict(self) -> dict:
        """The record as a JSON-ready dict (``participants`` as a list)."""
        d = asdict(self)
        d["participants"] = list(self.participants)
        return d


@dataclass
class Counter:
    """Totals of the operations of one tag on one worker.

    Args:
        ops: operations completed.
        raw_bytes: sum of their raw bytes (the sizes of the tensors the callers passed).
        sent_bytes: bytes sent on the wire.
        recv_bytes: bytes received from the wire.
        seconds: sum of their times in flight, issue to completion.
        waited: time callers spent blocked in ``Handle.wait()``.
        peak_sent_bytes: the sent bytes of the largest single operation.
    """

    ops: int = 0
    raw_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    seconds: float = 0.0
    waited: float = 0.0
    peak_sent_bytes: int = 0  # the largest single operation


@dataclass
class CommStats:
    """Per-worker totals, split by tag ("train", "setup", "eval", ...).

    ``stats[tag]`` is the [`Counter`][loco.comm.accounting.Counter] of that tag (a new, zero
    one for a tag not seen yet).

    Args:
        by_tag: the counters by tag; default empty (a ``defaultdict`` of zero counters).
    """

    by_tag: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, rec: OpRecord) -> None:
        """Count a completed operation under its tag (``waited`` is counted by the handle).

        Args:
            rec: the operation's record.
        """
        c = self.by_tag[rec.tag]
        c.ops += 1
        c.raw_bytes += rec.raw_bytes
        c.sent_bytes += rec.sent_bytes
        c.recv_bytes += rec.recv_bytes
        c.seconds += rec.seconds
        c.peak_sent_bytes = max(c.peak_sent_bytes, rec.sent_bytes)

    def __getitem__(self, tag: str) -> Counter:
        return self.by_tag[tag]

    def as_dict(self) -> dict:
        """The counters as JSON-ready dicts, by tag."""
        return {tag: asdict(c) for tag, c in self.by_tag.items()}


class DeviceTimes:
    """Times taken on a device's clock, written into their records once they are known.

    On a GPU, ``Handle.wait()`` returns once the caller's stream is told to wait, long
    before the transfer ran; so an operation's ``seconds`` run from an event recorded on
    the caller's stream at issue to one recorded on the Comm's stream at its end, and a
    wait's ``waited`` from an event on the caller's stream where the wait began to one
    after it. Each is kept here until its end event has happened: ``settle`` asks the
    events (``query()``, which never blocks) and adds the elapsed time to the record and to
    its tag's totals. The events are duck-typed (``query``, ``elapsed_time`` in ms,
    ``synchronize``), as ``torch.cuda.Event``'s.
    """

    def __init__(self):
        self._pending: deque = deque()  # (record, field, start event, end event)

    def add(self, rec: OpRecord, name: str, start: Any, end: Any) -> None:
        """Time ``rec``'s ``name`` (``"seconds"`` or ``"waited"``) from ``start`` to ``end``.

        Args:
            rec: the operation's record.
            name: the field the time is added to.
            start: the event where it starts.
            end: the event where it ends, recorded after ``start``.
        """
        self._pending.append((rec, name, start, end))

    def __len__(self) -> int:
        return len(self._pending)

    def settle(self, stats: CommStats, wait: bool = False) -> None:
        """Add every time whose end event has happened to its record and to ``stats``.

        Args:
            stats: the totals the times are added to, by the records' tags.
            wait: wait for the events that have not happened yet (``synchronize`` each:
                only where the host may wait, e.g. at the end of a run); default False.
        """
        left: deque = deque()
        while self._pending:
            rec, name, start, end = item = self._pending.popleft()
            if wait:
                end.synchronize()
            elif not end.query():
                left.append(item)
                continue
            seconds = start.elapsed_time(end) / 1000
            setattr(rec, name, getattr(rec, name) + seconds)
            counter = stats[rec.tag]
            setattr(counter, name, getattr(counter, name) + seconds)
        self._pending = left


RECORDS_KEPT = 100_000
"""How many of the latest operation records a Comm keeps (``Comm.records``)."""
