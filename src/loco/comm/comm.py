"""[`Comm`][loco.comm.comm.Comm]: asynchronous, byte-counting communication among the workers
of one ``torch.distributed`` process group (gloo on CPU, NCCL on GPU), optionally held back
by an emulated link ([`EmulatedLink`][loco.comm.link.EmulatedLink]). How its operations move
and count bytes: ``docs/bytes.md``.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loco.comm.accounting import RECORDS_KEPT, CommStats, Counter, DeviceTimes, OpRecord
from loco.comm.guard import Shield
from loco.comm.means import issue_all_gather_mean, issue_all_reduce_mean, reduce_on_thread
from loco.comm.seal import mac_bytes, sealed
from loco.comm.exchange import Build, Consume, exchange_pieces, exchange_whole, sendrecv
from loco.comm.handles import Aborted, Handle
from loco.comm.hostreads import allowed
from loco.comm.reduce import Buffers
from loco.comm.streams import HostStaging, streams_for
from loco.comm.thread import CommThread

if TYPE_CHECKING:
    from loco.comm.codecs import Codec
    from loco.comm.link import EmulatedLink


UNMETERED_TAGS = frozenset({"diagnostic", "report"})
"""Tags whose bytes are counted but that do not pass through an emulated link: measurements
loco takes for its own reports (the replicas' spread, the end-of-run totals), which the
method itself would not send, so they neither delay training nor occupy the link."""


@dataclass
class _Posted:
    """Point-to-point work posted on gloo, to be completed by a blocking wait elsewhere."""

    works: list
    result: Any


class Comm:
    """Asynchronous, byte-counting communication among the workers of one process group.

    Every operation is issued on a communication thread, in order, and returns a
    [`Handle`][loco.comm.handles.Handle] at once; every worker of the group must issue the
    same collectives in the same order. [`launch`][loco.runtime.launch.launch] builds the
    Comms of a run (``ctx.comm``, ``ctx.pipe``); build one yourself only around your own
    process group. Every tensor handed to it must live on its ``device`` (or on
    ``stage_from``, which it stages).

    Args:
        group: a ``torch.distributed`` process group (or backend) object; its methods are
            called directly, so the same code serves a group created with
            ``init_process_group`` and one of several groups that threads of one process own
            on a shared store.
        rank: this worker's rank in ``group``, in [0, size) (for the outer Comm, the
            replica index; for the pipeline's, the global rank).
        size: the number of workers in ``group`` (M), >= 1.
        device: where the tensors live (``"cpu"`` for gloo, a CUDA device for NCCL); default
            ``"cpu"``. A CUDA device without an index means the current one.
        name: a name for the threads and error messages; default ``"replicas"``.
        keep_records: keep the latest [`OpRecord`][loco.comm.accounting.OpRecord]s in
            ``records`` (at most ``RECORDS_KEPT``); default True. The totals in ``stats`` are
            kept either way.
        abort_event: an event the launcher sets when any worker fails, so that waits here
            end promptly with [`Aborted`][loco.comm.handles.Aborted]; default None (a
            private event).
        link: an emulated slow link ([`EmulatedLink`][loco.comm.link.EmulatedLink]) that
            every operation passes through (but those of ``UNMETERED_TAGS``); default None
            (the transport's own speed).
        thread: the [`CommThread`][loco.comm.thread.CommThread] to issue through, shared
            with other Comms of this worker; default None (a thread of its own).
        stage_from: a second device whose tensors the Comm takes and stages through host
            memory ([`HostStaging`][loco.comm.streams.HostStaging]): the model's GPU, for
            a Comm on the CPU (an elastic worker's gloo group); ``wait()`` returns the
            caller's tensors, written on that device. Default None: every tensor on
            ``device``.
    """

    def __init__(self, group: Any, rank: int, size: int, device: torch.device | str = "cpu",
                 name: str = "replicas", keep_records: bool = True,
                 abort_event: threading.Event | None = None,
                 link: EmulatedLink | None = None, thread: CommThread | None = None,
                 stage_from: torch.device | str | None = None):
        self.group = group
        self.rank = rank
        self.size = size
        self.contributors = size
        """What ``all_reduce_mean`` divides the sum by: the workers that contribute (all of
        them here; fewer in an [`ElasticComm`][loco.comm.membership.ElasticComm] where a
        worker just healed sends zeros)."""
        self.workers = size
        """M, the workers of the job at full strength (``size`` may be fewer in an
        [`ElasticComm`][loco.comm.membership.ElasticComm])."""
        self.job_key = None
        """The job key whose MACs training payloads carry (``loco.comm.seal``), or None."""
        self.sealed_ops = 0  # training operations tagged so far: their sequence numbers
        self.shield = Shield()
        """The guard over its averages and this worker's attacks (set by the algorithm)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._buffers = Buffers(self.device)  # kept between all-reduces
        self.stage_from = None if stage_from is None else torch.device(stage_from)
        """The device whose tensors this Comm stages through host memory, or None."""
        self.issue_in_order = False
        """Whether submitting an operation returns only once the communication thread has
        issued it (on CUDA: enqueued its NCCL calls, which does not wait for the GPU). Set
        where another library issues collectives on other communicators from the training
        thread (FSDP2 inside a worker): every rank then issues its NCCL operations in one
        order, the training thread's, as NCCL asks of communicators used concurrently."""
        self.name = name
        self.stats = CommStats()
        """Totals by tag, of completed operations."""
        # The latest operations, for tests and inspection (bounded: a long run must not
        # grow without end; the counters above hold the totals).
        self.records: deque[OpRecord] = deque(maxlen=RECORDS_KEPT)
        self._issued: dict[str, int] = defaultdict(int)  # bytes handed over, by tag
        self._times = DeviceTimes()  # CUDA: times waiting for their events to happen
        self.keep_records = keep_records
        self._lock = threading.Lock()
        self._closed = False
        # Set by the launcher when any worker fails, so that waits here end promptly instead
        # of sitting out the transport's timeout.
        self._abort_event = abort_event or threading.Event()
        self._streams = streams_for(self.device)
        self._thread = thread or CommThread(f"loco-comm-{name}-{rank}")
        self._thread.attach()
        # An emulated link (None: the transport's own speed) and the thread that completes
        # operations once their bytes have crossed it, earliest deadline first.
        self.link = link
        self._due: list = []  # heap of (deadline, sequence, record, future, value)
        self._due_cv = threading.Condition()
        self._sequence = 0
        self._draining = False
        if link is not None:
            self._delivery_thread = threading.Thread(
                target=self._deliver, name=f"loco-link-{name}-{rank}", daemon=True)
            self._delivery_thread.start()

    def _deliver(self) -> None:
        while True:
            with self._due_cv:
                if not self._due:
                    if self._draining:
                        return
                    self._due_cv.wait(0.05)
                    continue
                left = self._due[0][0] - time.perf_counter()
                if left > 0 and not self._abort_event.is_set():
                    self._due_cv.wait(min(left, 0.05))
                    continue
                _, _, rec, future, value = heapq.heappop(self._due)
            self._finish(rec)
            future.set_result(value)

    def check_aborted(self) -> None:
        """Raise [`Aborted`][loco.comm.handles.Aborted] if another worker has failed."""
        if self._abort_event.is_set():
            raise Aborted(f"{self.name} rank {self.rank} stopped: another worker failed")

    def _check_devices(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"{op}: a tensor on {t.device} was handed to the {self.name} Comm, whose "
                    f"tensors live on {self.device}"
                    + (f" (or on {self.stage_from}, staged)" if self.stage_from else "")
                    + "; create communication buffers with device=comm.device")

    # ----------------------------------------------------------------------------- plumbing
    @property
    def _staging(self) -> HostStaging | None:
        return None if self.stage_from is None else HostStaging(self.stage_from)

    def _staged(self, tensors: Sequence[torch.Tensor | None], issue: Callable[..., Handle],
                result: Callable[[Any, list], Any], back: Sequence[int] = ()
                ) -> Handle | None:
        """An operation on host copies, when some of ``tensors`` live on ``stage_from``
        (see [`HostStaging`][loco.comm.streams.HostStaging]); None otherwise.

        Args:
            tensors: the operation's tensors (None for an absent one).
            issue: issues the operation on their host copies, given in the same order.
            result: makes ``wait()``'s value from the operation's and the host copies.
            back: the positions in ``tensors`` the operation writes: copied back.
        """
        staging = self._staging
        if staging is None or not staging.wants(tensors):
            return None
        hosts, ready = staging.to_host(tensors)
        if ready is not None:  # the transport reads the copies once they are made
            self._thread.submit(Future(), ready.synchronize)
        handle = issue(*hosts)
        pairs = [(tensors[i], hosts[i]) for i in back if tensors[i] is not hosts[i]]

        def finish(value: Any) -> Any:
            staging.back(pairs)
            return result(value, hosts)

        return handle.then(finish)

    def _submit(self, op: str, tag: str, raw: int, sent: int, recv: int, fn,
                tensors: Sequence[torch.Tensor], participants: tuple[int, ...] | None = None,
                phases: int = 1) -> Handle:
        """Queue ``fn`` on the communication thread (``tensors``: every tensor it reads or
        writes, all on this Comm's device). ``fn`` returns the operation's result, or a
        ``_Posted`` whose works a helper thread waits for. With an emulated link the handle
        completes once the larger of sent and received bytes have crossed it, counted from
        the moment the transport completed (every participant had joined), plus one latency
        per dependent phase."""
        if self._closed:
            raise RuntimeError(f"the {self.name} Comm of rank {self.rank} is closed")
        self.check_aborted()
        self._check_devices(op, tensors)
        rec = OpRecord(op, tag, raw, sent, recv, participants or tuple(range(self.size)),
                       time.perf_counter())
        with self._lock:
            self._issued[tag] += sent
        ready = self._streams.issue(tensors)  # the caller's work so far comes first
        future: Future = Future()
        issued = threading.Event()

        def run():
            try:
                result, done = self._streams.run(ready, fn)
            finally:
                issued.set()
            if isinstance(result, _Posted):
                threading.Thread(target=self._await_posted, args=(result, rec, future, phases),
                                 name=f"loco-p2p-{self.name}-{self.rank}", daemon=True).start()
            else:
                self._complete(rec, future, result, done, phases, ready)

        self._thread.submit(future, run)
        while self.issue_in_order and not issued.wait(0.05) and not future.done():
            self.check_aborted()
        return Handle(future, rec, self)

    def _await_posted(self, posted: _Posted, rec: OpRecord, future: Future, phases: int):
        try:
            with record_function(f"loco/{rec.op}"):  # e.g. loco/exchange (NoLoCo's swap)
                for w in posted.works:
                    w.wait()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)
            return
        self._complete(rec, future, posted.result, None, phases)

    def _complete(self, rec: OpRecord, future: Future, result, done, phases: int,
                  ready: Any = None) -> None:
        """The transport is done (on CUDA: enqueued): finish now, timed on the device's
        clock from ``ready`` to ``done`` where the streams keep one, or once the link has
        carried the bytes (timed on the host's: the link's delay is the host's)."""
        nbytes = max(rec.sent_bytes, rec.recv_bytes)
        if self.link is None or nbytes == 0 or rec.tag in UNMETERED_TAGS:
            self._finish(rec, self._streams.span(ready, done))
            future.set_result((result, done))
            return
        self._streams.synchronize(done)  # the data exists on every end from now on
        with self._due_cv:
            deadline = self.link.reserve(nbytes, phases=phases)
            self._sequence += 1
            heapq.heappush(self._due, (deadline, self._sequence, rec, future, (result, done)))
            self._due_cv.notify()

    def _finish(self, rec: OpRecord, span: tuple | None = None) -> None:
        """Count a completed operation; its seconds on the host's clock, or (``span``: its
        events) on the device's once they have happened."""
        with self._lock:
            if span is None:
                rec.seconds = time.perf_counter() - rec.issued_at
            else:
                self._times.add(rec, "seconds", *span)
            self.stats.add(rec)
            if self.keep_records:
                self.records.append(rec)
            if self._times:  # those that have happened already (queries: never blocks)
                self._times.settle(self.stats)

    def update_times(self, wait: bool = False) -> None:
        """Fill in the times of a CUDA Comm's operations and waits whose events have
        happened on the device (``seconds``, ``waited``, in the records and the totals); the
        reads of the totals (``totals``, ``state_dict``) do so themselves. Nothing to do on
        another device, where the host's clock times them as they complete.

        Args:
            wait: also wait for the events that have not happened yet, so that every time
                is in (an event's ``synchronize``, in an ``allowed("log")`` region: only
                where the host may wait, e.g. for the run's summary); default False (only
                ask the events, which never blocks).
        """
        if not self._times:
            return
        with allowed("log") if wait else nullcontext(), self._lock:
            self._times.settle(self.stats, wait)

    def _post(self, sends: Sequence[tuple], recvs: Sequence[tuple]) -> list:
        """Post sends and receives ``(tensor, peer, message tag)`` together. On a process
        group: ``batch_isend_irecv``, one NCCL group, so that a send and a receive between
        the same two ranks cannot block each other (gloo runs them one by one). On a bare
        gloo backend (the threads launcher's groups, which torch.distributed's registry does
        not know): one call each, which gloo runs independently."""
        if isinstance(self.group, dist.ProcessGroup):
            ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=p, tag=k)
                   for t, p, k in sends]
            ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p, tag=k)
                    for t, p, k in recvs]
            return dist.batch_isend_irecv(ops) if ops else []
        return ([self.group.send([t], p, k) for t, p, k in sends]
                + [self.group.recv([t], p, k) for t, p, k in recvs])

    def _posted(self, works: list, result: Any) -> Any:
        """What a point-to-point body returns: on CUDA the works are ordered on the stream
        (``wait()`` does not block the CPU) and the result is final; on gloo a ``_Posted``."""
        if self._streams.blocking_completion:
            return _Posted(works, result)
        for w in works:
            w.wait()
        return result

    # ---------------------------------------------------------------------------- operations
    def all_reduce_mean(self, tensor: torch.Tensor, tag: str = "train",
                        codec: Codec | None = None, sent: torch.Tensor | None = None,
                        weight: float | None = None) -> Handle:
        """Average ``tensor`` over all workers, in place, asynchronously.

        The caller must not touch ``tensor`` until ``wait()`` returns. Without a codec it is
        the group's own all-reduce (NCCL's, gloo's: their sum, in the tensor's dtype, the
        same bits on every worker; pass fp32 for the fp32 reduction the algorithms
        require), divided by the contributors. With a codec (an fp32 tensor) every worker
        encodes its chunks, an all-to-all sends chunk j to worker j, which decodes and
        averages it in fp32 (in rank order) and encodes the mean, and an all-gather into
        one flat buffer brings every worker the means to decode: only encoded bytes travel,
        in both directions.

        Each worker is counted as sending and receiving ``2 (M − 1)`` chunks of
        ``ceil(n / M)`` values (a ring all-reduce's traffic; with a codec, rounded up to
        whole blocks, with their scales).

        Args:
            tensor: the contiguous tensor to average, overwritten with the mean; fp32 when a
                codec is given.
            tag: the tag its bytes are counted under; default ``"train"``.
            codec: wire format of the values (see
                [`get_codec`][loco.comm.codecs.catalog.get_codec]); default None: the tensor's own
                dtype, unencoded (``"fp32"``, a lossless cast of the fp32 tensor, is the
                same). A codec that ``gathers`` goes through
                [`all_gather_mean`][loco.comm.comm.Comm.all_gather_mean] instead.
            sent: a 1-D fp32 tensor of ``tensor.numel()`` values that receives what this
                worker's values became on the wire (its encoded chunks, decoded), written
                before ``wait()`` returns: the error feedback's ``D(C(x))``; default None.
            weight: multiplies this worker's values first (in place, before anything is
                sent), so that the mean is a weighted one; default None (1).

        Returns:
            A handle whose ``wait()`` returns ``tensor``'s flat view, holding the mean.

        Raises:
            ValueError: ``tensor`` is not contiguous, or not fp32 with a codec.
        """
        if codec is not None and codec.gathers:
            return self.all_gather_mean(tensor, tag, codec, sent, weight)
        staged = self._staged((tensor, sent), lambda t, s: self.all_reduce_mean(
            t, tag, codec, s, weight), lambda _, h: tensor.view(-1), back=(0, 1))
        if staged is not None:
            return staged
        return issue_all_reduce_mean(self, tensor, tag, codec, sent, weight)

    def _reduce_mean(self, flat: torch.Tensor, chunk: int, codec: Codec | None, m: int,
                     divisor: int, sent: torch.Tensor | None = None,
                     step: int | None = None) -> torch.Tensor:
        """On the communication thread: an average's reduction among ``m`` workers
        (``loco.comm.means``; ``step`` None: not a training average)."""
        return reduce_on_thread(self, flat, chunk, codec, m, divisor, sent, step)

    def senders(self) -> list[int]:
        """The worker each rank of the group is (the ranks themselves; an elastic quorum's
        members)."""
        return list(range(self.size))

    def all_gather_mean(self, tensor: torch.Tensor, tag: str = "train", codec: Codec = None,
                        sent: torch.Tensor | None = None, weight: float | None = None
                        ) -> Handle:
        """Average ``tensor`` over all workers, in place, asynchronously, by all-gathering
        every worker's whole encoded tensor: each worker decodes all M and sums them in fp32
        in rank order (the same bits everywhere). For the formats whose kept positions
        differ between workers (``codec.gathers``: SparseLoCo's chunked top-k), which a
        reduce-scatter would have to encode twice.

        Each worker sends and receives ``(M − 1) · codec.row_bytes(codec.padded(n))`` bytes:
        unlike an all-reduce's, they grow with M.

        Args:
            tensor: the contiguous fp32 tensor to average, overwritten with the mean.
            tag: the tag its bytes are counted under; default ``"train"``.
            codec: the wire format (see [`get_codec`][loco.comm.codecs.catalog.get_codec]).
            sent: fp32, receives ``D(C(tensor))`` as for ``all_reduce_mean``; or uint8 of at
                least ``codec.encoded_nbytes(n)`` bytes, ``C(tensor)`` itself; default None.
            weight: as for [`all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean].

        Returns:
            A handle whose ``wait()`` returns ``tensor``'s flat view, holding the mean.

        Raises:
            ValueError: ``tensor`` is not contiguous or not fp32, or no codec.
        """
        staged = self._staged((tensor, sent), lambda t, s: self.all_gather_mean(
            t, tag, codec, s, weight), lambda _, h: tensor.view(-1), back=(0, 1))
        if staged is not None:
            return staged
        return issue_all_gather_mean(self, tensor, tag, codec, sent, weight)

    def buffer(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer this Comm keeps for a caller's ``role`` (counted in ``buffer_bytes``), as
        the last user left it: the input of a ``keep`` all-gather (``Share.gather``).

        Args:
            role: what it is for; distinct from the Comm's own roles.
            shape: its shape.
            dtype: its dtype.
        """
        return self._buffers(role, shape, dtype)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers this Comm keeps between operations (its reductions' and
        gathers' [`Buffers`][loco.comm.reduce.Buffers]), for the memory accounting. A
        staging Comm (``stage_from``) keeps none of its own: its host copies are made per
        operation (from PyTorch's caching host allocator) and dropped after it."""
        kept = list(self._buffers.values())  # one step under the GIL: the thread may add
        guard = self.shield.guard  # its counters and the digests' history
        return sum(b.numel() * b.element_size() for b in kept) + (
            guard.nbytes() if guard is not None else 0)

    def _all_to_all(self, received: torch.Tensor, outgoing: torch.Tensor) -> None:
        """The group's all-to-all of two flat buffers of equal size (``all_to_all_single``)."""
        self.group.alltoall_base(received, outgoing, [], [], dist.AllToAllOptions()).wait()

    def _sum(self, flat: torch.Tensor) -> None:
        """The group's own sum all-reduce of ``flat``, in place (``all_reduce``): NCCL's and
        gloo's give every rank the same bits."""
        self.group.allreduce([flat], dist.AllreduceOptions()).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "setup") -> Handle:
        """Copy ``tensor`` from worker ``src`` to every worker, in place.

        Done as point-to-point sends from ``src`` so the bytes are exact: the source sends
        ``(M - 1) * nbytes``, every other worker receives ``nbytes``.

        Args:
            tensor: the source's data on ``src``; the buffer it is copied into elsewhere
                (same shape and dtype on every worker).
            src: the rank that sends, in [0, M); default 0.
            tag: the tag its bytes are counted under; default ``"setup"``.

        Returns:
            A handle whose ``wait()`` returns ``tensor``.
        """
        staged = self._staged((tensor,), lambda t: self.broadcast(t, src, tag),
                              lambda _, h: tensor, back=(0,))
        if staged is not None:
            return staged
        m, nbytes = self.size, tensor.numel() * tensor.element_size()
        sent = (m - 1) * nbytes if self.rank == src else 0
        recv = 0 if self.rank == src else nbytes

        def run():
            if self.rank == src:
                works = self._post([(tensor, dst, 0) for dst in range(m) if dst != src], [])
            else:
                works = self._post([], [(tensor, src, 0)]) if m > 1 else []
            for w in works:
                w.wait()
            return tensor

        return self._submit("broadcast", tag, nbytes, sent, recv, run, [tensor])

    def all_gather(self, tensor: torch.Tensor, tag: str = "setup", keep: bool = False,
                   judged: bool = False) -> Handle:
        """Gather one equally shaped tensor from every worker; the handle returns the list.

        Args:
            tensor: this worker's tensor (same shape and dtype on every worker).
            tag: the tag its bytes are counted under; default ``"setup"``.
            keep: gather into this Comm's kept buffer (counted in ``buffer_bytes``), which
                the next ``keep`` gather overwrites (``Share.gather``, which uses it at
                once); default False: new tensors. A staging Comm ignores it.
            judged: the rows are contributions the caller's guard judges (DeMo's
                messages): with a job key, a row whose MAC fails is zeroed and handed to
                the guard (``mac``) rather than failing the gather; default False.

        Returns:
            A handle whose ``wait()`` returns M tensors, in rank order: rows of one
                contiguous ``(M, *tensor.shape)`` tensor.
        """
        staged = self._staged((tensor,), lambda t: self.all_gather(t, tag),
                              lambda out, h: [self._staging.to_device(o) for o in out])
        if staged is not None:
            return staged
        m, nbytes = self.size, tensor.numel() * tensor.element_size()
        shape = (m, *tensor.shape)

        def run():
            out = (self._buffers("all_gather", shape, tensor.dtype) if keep else
                   torch.empty(shape, dtype=tensor.dtype, device=tensor.device))
            if m == 1:
                out[0].copy_(tensor)
            else:  # (a training gather carries MACs with a job key: a forged one fails it,
                guard = self.shield.guard if judged and self.shield.judges else None  # or is
                sealed(self, train, guard, None, self._gather, "a message")[1](  # judged)
                    out, tensor.contiguous())
            return list(out.unbind(0))

        train = 0 if tag == "train" else None
        wire = (m - 1) * nbytes + (mac_bytes(m - 1) if self.job_key is not None and train == 0
                                   else 0)
        return self._submit("all_gather", tag, nbytes, wire, wire, run, [tensor])

    def _gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """The group's all-gather of the contiguous ``tensor`` into ``out``, contiguous, of
        shape ``(M, *tensor.shape)`` (``all_gather_into_tensor``)."""
        self.group._allgather_base(out.view(-1), tensor.view(-1)).wait()

    def exchange(self, tensor: torch.Tensor, members: Iterable[int], tag: str = "train"
                 ) -> Handle:
        """Swap ``tensor`` with the other ``members`` of a group (ranks, this one included),
        point to point; the handle returns every member's tensor, in ``members`` order.

        Only the group's workers take part: nothing waits for the rest of the world. Each
        member sends its tensor to the others and receives theirs: ``(n - 1) * nbytes`` each
        way for a group of n. The sends and receives are posted together, as one NCCL group
        (see [`sendrecv`][loco.comm.comm.Comm.sendrecv]).

        Args:
            tensor: this worker's contiguous tensor (same shape and dtype on every member).
            members: the ranks of the group, this one included, in any order; every member
                must call ``exchange`` with the same group.
            tag: the tag its bytes are counted under; default ``"train"``.

        Returns:
            A handle whose ``wait()`` returns every member's tensor, in sorted rank order
                (this worker's own ``tensor`` among them).

        Raises:
            ValueError: this worker is not in ``members``, a member out of range, or a
                tensor not on this Comm's device.
        """
        return exchange_whole(self, tensor, members, tag)

    def exchange_pieces(self, sizes: Sequence[int], members: Iterable[int], build: Build,
                        consume: Consume, tag: str = "train",
                        tensors: Sequence[torch.Tensor] = ()) -> Handle:
        """An [`exchange`][loco.comm.comm.Comm.exchange] of a message of pieces of ``sizes``
        bytes, built, swapped and consumed one piece at a time by ``build(k, out)`` and
        ``consume(k, pieces)`` on the Comm's thread: one operation, counted as ``exchange``
        of the whole message (see [`exchange_pieces`][loco.comm.exchange.exchange_pieces]).

        Args:
            sizes: bytes of each piece, the same on every member.
            members: the group's ranks, this one included.
            build: ``build(k, out)`` writes piece k of this worker's message into ``out``.
            consume: ``consume(k, pieces)`` takes piece k of every member, in rank order.
            tag: the tag its bytes are counted under; default ``"train"``.
            tensors: the tensors ``build`` and ``consume`` use; default none.

        Returns:
            A handle whose ``wait()`` returns the sorted members once all is consumed.
        """
        return exchange_pieces(self, sizes, members, build, consume, tag, tensors)

    def send(self, tensor: torch.Tensor, dst: int, tag: str = "train") -> Handle:
        """Send ``tensor`` to worker ``dst``, point to point, asynchronously (see
        [`sendrecv`][loco.comm.comm.Comm.sendrecv]); the caller must not modify
        ``tensor`` until ``wait()`` returns.

        Args:
            tensor: the contiguous tensor to send.
            dst: the receiving rank, in [0, M) and not this one.
            tag: the tag its bytes are counted under; default ``"train"``.

        Returns:
            A handle whose ``wait()`` returns an empty list.
        """
        return self.sendrecv([(tensor, dst)], [], tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: str = "train") -> Handle:
        """Receive into ``tensor`` from worker ``src`` (see
        [`sendrecv`][loco.comm.comm.Comm.sendrecv]); the handle returns ``[tensor]``.

        Args:
            tensor: the contiguous buffer to receive into (the sender's shape and dtype).
            src: the sending rank, in [0, M) and not this one.
            tag: the tag its bytes are counted under; default ``"train"``.

        Returns:
            A handle whose ``wait()`` returns ``[tensor]``.
        """
        return self.sendrecv([], [(tensor, src)], tag)

    def sendrecv(self, sends: Sequence[tuple], recvs: Sequence[tuple], tag: str = "train"
                 ) -> Handle:
        """Post every send ``(tensor, dst)`` and receive ``(tensor, src)``, point to point; the
        handle completes when all are done and returns the receive buffers, in order.

        An entry may carry a third item, the transport's message tag (an int, 0 if left out):
        messages between two workers with one tag arrive in the order they were posted.

        The sends and receives of one call are posted together: on a process group with
        ``torch.distributed.batch_isend_irecv``, which NCCL runs as one group (NCCL needs a
        send and a receive between the same two ranks in one group, or both block). The
        communication thread only *posts* them, in issue order like every other operation:
        on CUDA their completion is an event on the Comm's stream; on gloo, which reports a
        point-to-point completion only through a blocking wait, a helper thread waits for
        them. Any set of point-to-point operations whose sends and receives match therefore
        completes, whatever order the workers issue and wait on them in ("post all sends and
        receives of a step, then wait" cannot deadlock). Only this worker and its peers take
        part: ``participants`` are this worker and the peers, sorted; ``raw`` and ``sent``
        bytes are the bytes sent, ``received`` the bytes received; ``seconds`` runs from
        issue to completion.

        Args:
            sends: ``(tensor, dst)`` or ``(tensor, dst, message_tag)`` items: contiguous
                tensors to send to rank ``dst`` (in [0, M), not this one).
            recvs: ``(tensor, src)`` or ``(tensor, src, message_tag)`` items: contiguous
                buffers to receive into from rank ``src``.
            tag: the tag the bytes are counted under; default ``"train"``.

        Returns:
            A handle whose ``wait()`` returns the receive buffers, in the order of ``recvs``.

        Raises:
            ValueError: a peer out of range or this worker itself, a non-contiguous tensor,
                or one not on this Comm's device.
        """
        return sendrecv(self, sends, recvs, tag)

    # ----------------------------------------------------------------------- a sync's frame
    rank_order = False
    """Whether the unencoded mean sums the workers' values in rank order, through an
    all-to-all and an all-gather (every worker the same bits, and the bits of a single
    process adding them up in rank order), rather than with the group's own all-reduce
    (NCCL's, gloo's: every worker the same bits, the sum grouped as the transport's ring
    or tree does, which differs in the last bits for M >= 3). The same bytes either way.
    True in an [`ElasticComm`][loco.comm.membership.ElasticComm], whose members talk all to
    all, and in tests that compare with a reference summing in rank order
    (docs/bytes.md)."""

    elastic = False
    """Whether the membership may change between syncs
    ([`ElasticComm`][loco.comm.membership.ElasticComm])."""

    def begin(self) -> bool:
        """Called before the collective of an outer sync. A fixed group has nothing to
        agree on: returns False (see
        [`ElasticComm.begin`][loco.comm.membership.ElasticComm.begin])."""
        return False

    def settle(self, handle: Handle, reissue: Callable[[], Handle] | None = None) -> Any:
        """Wait for the collective of an outer sync and return its result (see
        [`ElasticComm.settle`][loco.comm.membership.ElasticComm.settle], which may retry it).

        Args:
            handle: the sync's handle.
            reissue: how to issue it again (only an ElasticComm retries); default None.
        """
        return handle.wait()

    # ------------------------------------------------------------------------------ helpers
    def account(self, op: str, raw: int, sent: int, recv: int, tag: str = "train") -> None:
        """Count an operation another library ran on this Comm's group (FSDP2's all-gathers
        and reduce-scatters inside a worker, see [`shard_worker`][loco.runtime.fsdp.shard_worker]),
        so that the totals hold every byte of the link. Counted when issued, with no time
        in flight or waited: loco does not see it complete, and the emulated link does not
        delay it.

        Args:
            op: the operation's name (e.g. ``"fsdp_all_gather"``).
            raw: the bytes the caller asked to move.
            sent: bytes this rank puts on the wire.
            recv: bytes this rank takes off the wire.
            tag: the tag its bytes are counted under; default ``"train"``.
        """
        rec = OpRecord(op, tag, raw, sent, recv, tuple(range(self.size)), time.perf_counter())
        with self._lock:
            self._issued[tag] += sent
        self._finish(rec)

    def totals(self, tag: str = "train") -> Counter:
        """A copy of the totals of one tag, of the operations completed so far.

        Args:
            tag: the tag; default ``"train"`` (zero totals for a tag never used).
        """
        self.update_times()
        with self._lock:
            return Counter(**asdict(self.stats[tag]))

    def issued_bytes(self, tag: str = "train") -> int:
        """Bytes of the operations issued so far, finished or not: unlike ``totals``, the
        same at the same step whatever the timing of operations in flight.

        Args:
            tag: the tag; default ``"train"``.
        """
        with self._lock:
            return self._issued[tag]

    def peak_sent_bytes(self, tag: str = "train") -> int:
        """The sent bytes of the largest single completed operation of one tag.

        Args:
            tag: the tag; default ``"train"``.
        """
        with self._lock:
            return self.stats[tag].peak_sent_bytes

    def barrier(self, tag: str = "setup") -> None:
        """Wait until every worker of this Comm got here (a one-value all-reduce).

        Args:
            tag: the tag its bytes are counted under; default ``"setup"``.
        """
        self.all_reduce_mean(torch.zeros(1, device=self.device), tag=tag).wait()

    def state_dict(self) -> dict:
        """The counters, for a checkpoint: a resumed run reports the bytes of the whole run."""
        self.update_times()
        with self._lock:
            return {"stats": self.stats.as_dict(), "issued": dict(self._issued)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters of [`state_dict`][loco.comm.comm.Comm.state_dict]
        (the records are cleared).

        Args:
            state: a dict from ``state_dict()``.
        """
        with self._lock:
            self.stats = CommStats()
            for tag, counter in state["stats"].items():
                self.stats.by_tag[tag] = Counter(**counter)
            self.records.clear()
            self._issued = defaultdict(int, {k: int(v) for k, v in state["issued"].items()})

    def verify_identical(self, tensors: Iterable[torch.Tensor], what: str = "parameters"
                         ) -> None:
        """Fail loudly unless every worker holds bit-identical ``tensors``.

        Compares SHA-256 checksums with an all-gather (tag ``"setup"``); collective.

        Args:
            tensors: the tensors to compare, in the same order on every worker.
            what: what they are, for the error message; default ``"parameters"``.

        Raises:
            RuntimeError: some worker's checksum differs from worker 0's.
        """
        with allowed("setup"):  # once, at the start: the tensors are read on the host
            h = hashlib.sha256()
            for t in tensors:
                h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
            digest = torch.frombuffer(bytearray(h.digest()), dtype=torch.int64).to(self.device)
            digests = self.all_gather(digest, tag="setup").wait()
            differ = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if differ:
            raise RuntimeError(
                f"workers start from different {what}: worker(s) {differ} differ from worker 0 "
                f"(sha256 checksums disagree); broadcast the initial state from worker 0")

    def close(self) -> None:
        """Finish what was issued, then stop the communication thread (the last of the Comms
        sharing it stops it) and the link's delivery thread."""
        if not self._closed:
            self._closed = True
            joined = not self._abort_event.is_set()  # after an abort it may be stuck
            self._thread.release(join=joined)
            if self.link is not None:  # every result is handed over first
                with self._due_cv:
                    self._draining = True
                    self._due_cv.notify()
                if joined:
                    self._delivery_thread.join()
