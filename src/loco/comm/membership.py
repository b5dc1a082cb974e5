"""Workers that come and go: a Comm over the live membership, kept by torchft.

An [`ElasticComm`][loco.comm.membership.ElasticComm] is a [`Comm`][loco.comm.comm.Comm]
whose process group is the *membership* of the moment. torchft provides the parts that are
hard to get right: a Lighthouse that forms a quorum of the live workers at every sync (a
worker that stops heartbeating is left out), a gloo group rebuilt for each new quorum, and
the transfer of the state from a live worker to one that is behind (a restarted worker, or
one whose sync failed while the others' succeeded). loco keeps its own collectives, codecs
and byte counters on top of that group.

Every outer sync goes through three calls, which a static Comm answers at once:

1. [`begin`][loco.comm.membership.ElasticComm.begin]: the quorum. A worker that is behind
   receives the state of a live one here (it then contributes zeros to this sync); the
   members exchange who contributes, so the mean divides by the contributors only.
2. the collective itself, as on any Comm (``all_reduce_mean`` of the pseudo-gradient).
3. [`settle`][loco.comm.membership.ElasticComm.settle]: wait for it, then *commit*: every
   participant tells every other whether its collective succeeded. A sync counts only if
   all did; otherwise it is discarded everywhere (the global copy is left as it was) and
   retried with a new quorum, from the same pseudo-gradient (NoLoCo: over the groups of
   the new members).

The members talk only in all-to-all patterns (every member sends to every other directly),
so that when one dies every survivor's next operation fails at once, instead of some of
them waiting on a neighbour in a ring until the timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import re
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loco.comm.auth import (AdmissionError, AuthError, JobKey, admit, context, open_state,
                            proves_request, request_proof, seal_state)
from loco.comm.comm import Comm
from loco.comm.handles import Aborted, Handle
from loco.comm.hostreads import allowed

if TYPE_CHECKING:
    from loco.comm.codecs import Codec

log = logging.getLogger("loco.elastic")

_STORE_KEY = "loco/elastic/store"

PROOF_HEADER = "X-Loco-Key-Proof"
"""The HTTP header in which a joiner proves the job key to the worker it fetches state from."""

MEMBERSHIP_TAG = "membership"
"""Tag of the small exchanges of the quorum and the commit (who contributes, who succeeded)."""


class _Quiet(logging.Filter):
    """Drops torchft's warning, at every new quorum, that there is no NCCL flight recorder
    to reset (true on every CPU run, and of no use)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def _torchft():
    try:
        import torchft.manager
        import torchft.process_group
    except ImportError as e:  # pragma: no cover - torchft is a dependency of loco
        raise RuntimeError("elastic membership needs torchft (pip install torchft)") from e
    logging.getLogger("torchft.manager").addFilter(_Quiet())
    # The state a joiner receives arrives in a read-only buffer that torch copies anyway.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


def start_lighthouse(min_workers: int, heartbeat_timeout: float = 1.0,
                     join_timeout: float = 60.0) -> Any:
    """Start torchft's Lighthouse, the quorum service, in this process.

    Args:
        min_workers: the fewest workers a quorum may have (``--min-workers``), >= 1.
        heartbeat_timeout: seconds without a heartbeat after which a worker counts as gone;
            default 1.0.
        join_timeout: seconds a quorum waits for a worker that is alive but has not asked
            to join yet (one still computing its inner steps); default 60.

    Returns:
        The ``torchft.coordination.LighthouseServer``; its ``address()`` is what the
            workers connect to, ``shutdown()`` stops it.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers: no line per quorum
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_workers,
                            join_timeout_ms=int(join_timeout * 1000), quorum_tick_ms=10,
                            heartbeat_timeout_ms=int(heartbeat_timeout * 1000))


def _transport(host: str, timeout: datetime.timedelta):
    """torchft's HTTP checkpoint transport (a joiner fetches a live worker's state from
    it), advertised at ``host`` rather than at this machine's host name, which the other
    workers may not resolve.

    Once its ``key`` is set (``ElasticComm.use_key``) it serves the state sealed
    ([`seal_state`][loco.comm.auth.seal_state], bound to the step and this server's
    address) and only to a request that proves the key (``PROOF_HEADER``, each proof used
    once); a joiner deserialises what it fetches only after checking its tag, and a state
    that fails raises an [`AuthError`][loco.comm.auth.AuthError] naming its sender.
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torchft.checkpointing.http_transport import HTTPTransport, _to_cpu

    class HostTransport(HTTPTransport):
        key: JobKey | None = None

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._sealed, self._proofs = b"", set()
            self._server.RequestHandlerClass = _keyed_handler(
                self._server.RequestHandlerClass, self)

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            if self.key is None:
                return super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            values, spec = tree_flatten(state_dict)
            self._sealed = seal_state(self.key, tree_unflatten(_to_cpu(values, False), spec),
                                      context("state", step, self.address()))
            self._proofs = set()
            self.allow_checkpoint(step)

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            if self.key is None:
                return super().recv_checkpoint(src_rank, metadata, step, timeout)
            url = f"{metadata}{step}/full"
            proof = request_proof(self.key, urllib.parse.urlparse(url).path)
            request = urllib.request.Request(url, headers={PROOF_HEADER: proof})
            try:
                with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as r:
                    body = r.read()
            except urllib.error.HTTPError as e:
                if e.code != 403:
                    raise
                raise AuthError(f"the worker at {metadata} refused to send its state: this "
                                "process's job key differs from the job's") from None
            return open_state(self.key, body, context("state", step, metadata),
                              f"the worker at {metadata} (quorum rank {src_rank})")

    return HostTransport(timeout=timeout, num_chunks=0)


def _keyed_handler(base: type, transport: Any) -> type:
    """torchft's request handler ``base``, which, once ``transport.key`` is set, answers
    only ``GET /checkpoint/STEP/full`` of the step served, with the sealed state, to a
    request that proves the key (403 otherwise, and a warning naming the client)."""

    class KeyedHandler(base):
        def do_GET(self) -> None:
            if transport.key is None:
                return super().do_GET()
            with transport._checkpoint_lock.r_lock():  # waits until a state is served
                if not proves_request(transport.key, self.headers.get(PROOF_HEADER),
                                      self.path, transport._proofs):
                    log.warning("elastic: refused the state to %s, which did not prove the "
                                "job key", self.client_address[0])
                    self.send_error(403, "prove the job key")
                    return
                if self.path != f"/checkpoint/{transport._step}/full":
                    self.send_error(400, f"serving /checkpoint/{transport._step}/full only")
                    return
                body = transport._sealed
                self.send_response(200)
                self.send_header("Content-type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

    return KeyedHandler


def _group_class():
    base = _torchft().process_group.ProcessGroupGloo

    class MemberGroup(base):
        """torchft's reconfigurable gloo group, which also remembers this worker's rank in
        the quorum and the quorum's size (torchft keeps them to itself)."""

        member_rank, member_count = 0, 1

        def configure(self, store_addr, replica_id, rank, world_size, *args, **kwargs):
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
            self.member_rank, self.member_count = rank, world_size

        def backend(self):
            return self.parent._get_backend(torch.device("cpu"))

    return MemberGroup


class ElasticComm(Comm):
    """A Comm among the workers alive at each sync (torchft's quorum), see the module.

    Built by [`launch`][loco.runtime.launch.launch] with ``elastic=`` (``ctx.comm``), one
    per rank of every worker. Its ``rank`` and ``size`` are those of the current quorum;
    ``worker`` is this worker's fixed index. With workers of R ranks, rank r of a worker
    talks to rank r of the others (its share of the outer state), and the worker's ranks
    take one quorum and commit or drop every sync together (torchft's replica group).

    Args:
        worker: this worker's index in [0, workers).
        workers: M, how many workers the job has at full strength.
        lighthouse: the Lighthouse's address (``http://host:port``).
        min_workers: the fewest workers a sync may count with, in [1, M].
        timeout: seconds any wait may last (a quorum, a collective, a state transfer).
        host: the address peers reach this worker at; default ``"127.0.0.1"``.
        shard: this rank's index among its worker's ranks, in [0, shards); default 0.
        shards: R, the ranks of every worker; default 1.
        store: with R > 1, a store the worker's ranks share (their own process group's),
            where rank 0 publishes the address of the worker's torchft store; default None.
        start_wait: seconds the first quorum's members wait for all M workers before they
            begin with those that came (``Algorithm.join``); default None: ``timeout``.
        **kwargs: passed to [`Comm`][loco.comm.comm.Comm] (``device``, ``name``,
            ``link``, ``abort_event``, ...).
    """

    elastic = True
    rank_order = True  # all to all: no ring, where a dead member leaves others waiting

    def __init__(self, worker: int, workers: int, lighthouse: str, min_workers: int,
                 timeout: float, host: str = "127.0.0.1", shard: int = 0, shards: int = 1,
                 store: dist.Store | None = None, start_wait: float | None = None,
                 **kwargs: Any):
        super().__init__(None, 0, 1, **kwargs)
        self.lighthouse = lighthouse
        self.waiting = False
        """Whether this worker is waiting for a quorum now."""
        self.joining = False
        """Whether this worker is joining the job (``Algorithm.join``), not training yet."""
        tft = _torchft()
        td = datetime.timedelta(seconds=timeout)
        self.worker, self.workers, self.min_workers, self.timeout = (worker, workers,
                                                                      min_workers, timeout)
        self.shard = shard
        self.start_wait = timeout if start_wait is None else start_wait
        store_host, store_port = self._worker_store(host, shard, shards, store, td)
        self._members_group = _group_class()(timeout=td)
        self._transport = _transport(host, td)
        self._key: JobKey | None = None  # the job key (use_key), unbound
        self._admitted = None  # the group whose members last proved it
        self._session: JobKey | None = None  # the key bound to that admission's session
        self.job_key: JobKey | None = None
        """The job key bound to the current quorum (its admission's session and the
        quorum's agreed rows); None without a key."""
        self.manager = tft.manager.Manager(
            pg=self._members_group, load_state_dict=None, state_dict=None,
            min_replica_size=min_workers, use_async_quorum=False, timeout=td,
            quorum_timeout=td, connect_timeout=td, rank=shard, world_size=shards,
            store_addr=store_host, store_port=store_port, lighthouse_addr=lighthouse,
            replica_id=f"loco_worker_{worker}", hostname=host, init_sync=False,
            checkpoint_transport=self._transport)
        self._incarnation = int.from_bytes(os.urandom(7), "big")  # this process's start
        self._incarnations: dict[int, int] = {}  # of the current members
        self.members: tuple[int, ...] = ()
        """The workers (fixed indexes) of the current quorum, in quorum rank order."""
        self.contributors = 1
        self.contributing: tuple[int, ...] = ()
        """The members of the current quorum that contribute (not just healed)."""
        self.note = 0
        """A number this worker tells the others at every quorum, for its owner (speed-aware
        local steps: its mean step time in µs)."""
        self.notes: dict[int, int] = {}
        """Every member's ``note`` at the latest quorum, by worker."""
        self.healed = False
        """Whether this worker's state was replaced by a peer's since its last commit."""
        self.events: list[dict] = []
        """Every change of membership and every dropped sync, in order (``time``, ``event``,
        ``members``, ``joined``, ``left``, ``quorum_seconds``: how long the quorum that
        brought the change took, ...), for the run's log and reports."""
        self.syncs: list[dict] = []
        """One record per committed sync: ``participants`` (its members), ``contributors``,
        ``retries``, ``time`` (seconds since this Comm was made) and ``unix_time``."""
        self._retries = 0
        self._t0 = time.time()

    def _worker_store(self, host: str, shard: int, shards: int, store: dist.Store | None,
                      td: datetime.timedelta) -> tuple[str, int]:
        """The worker's torchft store (its manager's address, the quorum's rendezvous):
        hosted by its rank 0, at ``host``, which peers must reach; with R > 1 its address
        goes to the other ranks through ``store``."""
        if shards > 1 and store is None:
            raise ValueError("an ElasticComm of a worker of several ranks needs the store "
                             "its ranks share (store=...)")
        if shard == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=td)
            if shards > 1:
                store.set(_STORE_KEY, f"{host} {self._store.port}")
            return host, self._store.port
        address, port = store.get(_STORE_KEY).decode().rsplit(" ", 1)
        return address, int(port)

    # ------------------------------------------------------------------- the state a joiner gets
    def register_state(self, key: str, state_fn: Callable[[], Any],
                       load_fn: Callable[[Any], None]) -> None:
        """Add to what a worker that is behind receives from a live one.

        Args:
            key: a name, unique per Comm.
            state_fn: returns the state (a tree of tensors and numbers) on the live worker.
            load_fn: takes it on the worker that is behind.
        """
        def load(state):
            self.healed = True
            load_fn(state)

        self.manager.register_state_dict_fn(key, load, state_fn)

    def use_key(self, key: bytes | JobKey) -> None:
        """Require the job key from the next quorum on (call it before the first, ``begin``):
        the members of every new quorum prove it ([`admit`][loco.comm.auth.admit]) before
        anything they send counts, and a quorum with a member that cannot is refused
        ([`AdmissionError`][loco.comm.auth.AdmissionError]); the state a joiner receives is
        sealed by its sender, served only to a requester that proves the key, and checked
        before it is loaded.

        Args:
            key: the job key (bytes, see [`load_key`][loco.comm.auth.load_key]) or a
                [`JobKey`][loco.comm.auth.JobKey].
        """
        self._key = key if isinstance(key, JobKey) else JobKey(key)
        self._transport.key = self._key

    # ------------------------------------------------------------------------------- a sync
    def begin(self) -> bool:
        """The quorum of a sync: wait (at most ``timeout``) for at least ``min_workers``
        live workers, take the new group if the membership changed, and agree on who
        contributes (a worker just healed contributes zeros). Collective over the members;
        its time counts as waiting for training traffic (tag ``train``): for the others.

        Returns:
            Whether this worker was healed (its state replaced by a live worker's) here.

        Raises:
            TimeoutError: no quorum of ``min_workers`` formed within ``timeout``; names
                the workers that did not answer.
            AuthError: with a job key (``use_key``), a member could not prove it
                (``AdmissionError``), or the state received from a peer failed its tag;
                names them.
        """
        started = time.monotonic()
        deadline = started + self.timeout
        healed_before = self.healed
        while True:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                # One request for the whole wait: torchft's manager does not take kindly to
                # quorum requests cut short and repeated.
                self.waiting = True
                self.manager.start_quorum(timeout=datetime.timedelta(seconds=left))
                self.waiting = False
                err = self.manager.errored()
                if isinstance(getattr(err, "original_exception", None), AuthError):
                    raise err.original_exception  # a forged state: no retry
                if err is None:
                    self._rebind()
                    self._agree(time.monotonic() - started)
                    with self._lock:  # waiting for the others, as in a collective
                        self.stats["train"].waited += time.monotonic() - started
                    return self.healed and not healed_before
            except (Aborted, AuthError):
                raise
            except Exception as e:  # noqa: BLE001 - no quorum in time, or a peer died in it
                err = e
            self.waiting = False
            self._event("quorum_failed", error=str(err).splitlines()[0][:200])
            if time.monotonic() > deadline:
                alive = self.alive()
                missing = sorted(set(range(self.workers)) - set(alive))
                raise TimeoutError(
                    f"worker {self.worker}: no quorum of --min-workers {self.min_workers} "
                    f"within {self.timeout:g} s: workers {missing} did not answer (alive: "
                    f"{alive}; last members {list(self.members)})")
            self.manager.report_error(err if isinstance(err, Exception) else RuntimeError(err))

    def alive(self) -> list[int]:
        """The workers whose heartbeats the Lighthouse receives now (from its status
        page; the last members if it cannot be read)."""
        try:
            with urllib.request.urlopen(f"{self.lighthouse}/status", timeout=5) as r:
                page = r.read().decode()
        except OSError:
            return sorted(self.members)
        entries = re.findall(r'class="heartbeat([^"]*)">\s*loco_worker_(\d+):', page)
        return sorted({int(w) for state, w in entries if "old" not in state})

    def _rebind(self) -> None:
        backend = self._members_group.backend()
        if backend is not self.group:
            self.group = backend
            self.rank = self._members_group.member_rank
            self.size = self._members_group.member_count

    def _agree(self, waited: float) -> None:
        keyed = self._key is not None
        mine = torch.tensor([self.worker, 0 if self.healed else 1, self._incarnation,
                             self.note, int(keyed), int(keyed and self._admitted is not
                                                         self.group), secrets.randbits(62)],
                            dtype=torch.int64, device=self.device)
        with allowed("sync"):  # the quorum's few numbers, read once per sync
            rows = [r.tolist() for r in self.all_gather(mine, tag=MEMBERSHIP_TAG).wait()]
        self._admit_members(rows)
        members = tuple(r[0] for r in rows)
        incarnations = {r[0]: r[2] for r in rows}
        self.contributors = sum(r[1] for r in rows)
        self.contributing = tuple(r[0] for r in rows if r[1])
        self.notes = {r[0]: r[3] for r in rows}
        # a worker restarted between two quorums left and joined, though it kept its index
        back = {w for w in members
                if incarnations[w] != self._incarnations.get(w, incarnations[w])}
        if members != self.members or back:
            joined = sorted(set(members) - set(self.members) | back)
            left = sorted(set(self.members) - set(members) | back)
            self.members, self._incarnations = members, incarnations
            self._event("membership", members=list(members), joined=joined, left=left,
                        quorum_seconds=round(waited, 3))
        if self.contributors == 0:  # every member was healed: nothing to average
            raise RuntimeError("no member of the quorum has a pseudo-gradient to contribute")

    def _admit_members(self, rows: list[list[int]]) -> None:
        """With a job key: refuse a quorum with a member that holds none; when any member's
        group is new since it last proved the key (the rows' flag, the same on every
        member), every member proves it again ([`admit`][loco.comm.auth.admit]). Then the
        quorum's own key (``job_key``: the session's, bound to the quorum's rows, which
        carry a random number from every member) and its operations numbered from 0
        (``sealed_ops``): every member counts alike, a joiner and a healed worker too, and a
        payload of an earlier quorum does not verify in this one.

        Args:
            rows: every member's row of the quorum, in rank order.

        Raises:
            AdmissionError: naming the workers that could not prove the key.
        """
        if self._key is None:
            return
        names = [f"worker {r[0]}" for r in rows]
        unkeyed = [n for n, r in zip(names, rows) if not r[4]]
        if unkeyed:
            raise AdmissionError(f"worker {self.worker}: {', '.join(unkeyed)} joined the "
                                 "quorum without a job key: not admitted")
        if any(r[5] for r in rows):
            self._session = admit(self, self._key, names)
            self._admitted = self.group
        quorum = hashlib.sha256(self._session.job + repr(rows).encode()).digest()
        self.job_key, self.sealed_ops = self._session.bound(quorum), 0

    def commit(self, ok: bool, record: bool = True) -> bool:
        """Tell every member whether this worker's collective succeeded and learn theirs;
        the sync counts only if all did (torchft's should-commit, here across workers).

        Args:
            ok: whether this worker's collective of the sync completed.
            record: add the sync to ``syncs`` (default True; False for the start).

        Returns:
            Whether the sync is committed (its result may be applied).
        """
        error = None
        try:
            flags = self.all_gather(torch.tensor([int(ok)], device=self.device),
                                    tag=MEMBERSHIP_TAG).wait()
            with allowed("sync"):  # the commit's flags, once per sync
                ok = all(int(f) == 1 for f in flags)
        except Aborted:
            raise
        except Exception as e:  # noqa: BLE001 - a member is gone
            ok, error = False, e
        if not ok:
            self.manager.report_error(error or RuntimeError("a member's collective failed"))
        committed = self.manager.should_commit()
        if committed and record:
            self.syncs.append({"participants": list(self.members),
                               "contributors": self.contributors, "retries": self._retries,
                               "time": time.time() - self._t0, "unix_time": time.time()})
        if committed:
            self.healed, self._retries = False, 0
        else:
            self._retries += 1
            few = len(self.members) < self.min_workers  # the Lighthouse let a smaller quorum be
            self._event("sync_dropped", members=list(self.members),
                        error=str(error).splitlines()[0][:200] if error else
                        f"{len(self.members)} live worker(s), fewer than --min-workers "
                        f"{self.min_workers}" if few else None)
        return committed

    def settle(self, handle: Handle, reissue: Callable[[], Handle] | None = None) -> Any:
        """Wait for the collective of a sync and commit it; if it is not committed, retry
        it with a new quorum (``begin``) until it is: ``reissue()`` issues it again over the
        new members (by default ``handle.reissue``, which ``all_reduce_mean`` sets: the
        same input again).

        Args:
            handle: the sync's handle.
            reissue: issues the sync's collective again, for operations whose peers depend
                on the members (NoLoCo's groups); default None.

        Returns:
            The committed operation's result; None when this worker was healed during a
                retry (its state was replaced by a live worker's): the caller must go on
                from that state instead of this sync.
        """
        while True:
            try:
                result, ok = handle.wait(), True
            except Aborted:
                raise
            except Exception as e:  # noqa: BLE001 - a member died: the commit says no
                log.info("worker %d: sync failed: %s", self.worker, e)
                result, ok = None, False
            if self.commit(ok):
                return result
            if self.begin():
                return None
            handle = (reissue or handle.reissue)()

    def all_reduce_mean(self, tensor: torch.Tensor, tag: str = "train",
                        codec: Codec | None = None, sent: torch.Tensor | None = None,
                        weight: float | None = None) -> Handle:
        """[`Comm.all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean] over the
        members, divided by the contributors; a copy of the input is kept so that a sync
        that is not committed can be issued again from it (``handle.reissue()``).

        Args:
            tensor: as for ``Comm.all_reduce_mean``; zeroed on a worker just healed.
            tag: as for ``Comm.all_reduce_mean``.
            codec: as for ``Comm.all_reduce_mean``.
            sent: as for ``Comm.all_reduce_mean`` (rewritten by a reissue).
            weight: as for ``Comm.all_reduce_mean``: the kept copy is the input before it.

        Returns:
            The handle, with a ``reissue(weight=None)`` that issues the same reduction again
                (weighed anew, where a weight is given).
        """
        if codec is not None and codec.gathers:
            return self.all_gather_mean(tensor, tag, codec, sent, weight)
        return self._reissuable(super().all_reduce_mean, tensor, tag, codec, sent,
                                weight=weight)

    def all_gather_mean(self, tensor: torch.Tensor, tag: str = "train", codec: Codec = None,
                        sent: torch.Tensor | None = None, weight: float | None = None
                        ) -> Handle:
        """[`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean] over the members,
        reissuable as ``all_reduce_mean`` is (same arguments)."""
        return self._reissuable(super().all_gather_mean, tensor, tag, codec, sent,
                                weight=weight)

    def _reissuable(self, op: Callable[..., Handle], tensor: torch.Tensor, *args: Any,
                    weight: float | None = None) -> Handle:
        """``op(tensor, *args, weight=weight)`` from a kept copy of ``tensor`` (zeroed first on
        a worker just healed), with a ``reissue(weight=None)`` that restores the copy and
        issues it again, with ``weight`` where one is given (else the same). A tensor
        the Comm stages keeps its copy on the host: the staged operation comes back here."""
        if self._staging is not None and self._staging.wants((tensor,)):
            return op(tensor, *args, weight=weight)
        if self.healed:
            tensor.zero_()
        saved = tensor.detach().clone()
        handle = op(tensor, *args, weight=weight)

        def reissue(new: float | None = None) -> Handle:
            tensor.copy_(saved)
            return self._reissuable(op, tensor, *args, weight=weight if new is None else new)

        handle.reissue = reissue
        return handle

    def senders(self) -> list[int]:
        """The workers of the quorum, in the order of their ranks in its group."""
        return list(self.members)

    def _gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """All-gather as an all-to-all (``all_to_all_single``, the same bytes) into ``out``
        (M, *tensor.shape): every member hears from every other directly, so a dead one
        fails everyone's operation at once."""
        outgoing = tensor.unsqueeze(0).expand(out.shape).contiguous()
        self.group.alltoall_base(out.view(-1), outgoing.view(-1), [], [],
                                 dist.AllToAllOptions()).wait()


    def _event(self, event: str, **fields: Any) -> None:
        record = {"time": round(time.time() - self._t0, 3), "unix_time": time.time(),
                  "event": event,
                  "worker": self.worker, **fields}
        self.events.append(record)
        log.info("elastic: %s", record)

    def close(self) -> None:
        """Stop the Comm, then torchft's manager (its servers) and this worker's store."""
        super().close()
        self.manager.shutdown(wait=False)


__all__ = ["ElasticComm", "MEMBERSHIP_TAG", "start_lighthouse"]
