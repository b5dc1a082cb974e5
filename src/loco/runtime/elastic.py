"""Elastic runs: workers that die are restarted alone, and the others keep training.

``launch(fn, M, launcher="processes", elastic=Elastic(...))`` starts torchft's
Lighthouse (the quorum service) in this process and every worker as a process of its own,
with an [`ElasticComm`][loco.comm.membership.ElasticComm] as ``ctx.comm``. There is no
``torch.distributed`` world spanning the workers: each sync's group is the quorum of the
workers alive then. When a worker process dies, this supervisor restarts that worker only
(up to ``restarts`` times); the restarted process joins at the next sync and receives its
state from a live worker (``Algorithm.join``). The rest never stop.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loco.comm.thread import CommThread
from loco.lazy import renamed_arguments
from loco.runtime.context import (
    MESH_DIMS,
    Mesh,
    RankContext,
    WorkerError,
    attempt_store,
    emulated,
    rank_device,
    worker_comms,
)
from loco.runtime.starter import adopt_environment, context, cpu_threads
from loco.runtime.vitals import DIR_ENV, death_note, read_vitals

log = logging.getLogger("loco.elastic")

HOST_ENV = "LOCO_ELASTIC_HOST"
"""Environment variable: the address the other workers reach this one at, for a worker of
an external Lighthouse's job (default: this machine's host name)."""

RESTART_ENV = "LOCO_WORKER_RESTART"
"""Environment variable holding how many times this worker process was restarted (0 for
the first start); fault injection acts on first starts only."""


def restart_count() -> int:
    """How many times torch elastic (the processes launcher, torchrun) restarted this
    process's workers, or the elastic supervisor this worker (``RESTART_ENV``)."""
    return max(int(os.environ.get(v) or 0) for v in ("TORCHELASTIC_RESTART_COUNT", RESTART_ENV))


@dataclass(frozen=True)
class Elastic:
    """How an elastic run behaves (``elastic`` of [`launch`][loco.runtime.launch.launch]).

    Args:
        min_workers: the fewest live workers a sync counts with; below it the workers wait
            (at most the timeout) for more. In [1, M]; default None: M // 2 + 1, a majority.
        restarts: how many times each worker is restarted after it died, >= 0; default 3.
        heartbeat_timeout: seconds without a heartbeat after which a worker counts as gone
            (its peers go on without it), > 0; default 1.0.
        lighthouse: the address (``http://host:port``) of a Lighthouse that runs already
            (``torchft_lighthouse``, see [Elastic membership](../elastic.md)): then this
            process is one worker of the job, ``worker``, started by you or by torchrun
            (one process per worker, on any machine); default None: ``launch`` starts the
            Lighthouse and every worker, as processes of this machine.
        worker: with ``lighthouse``: this process's worker index, in [0, M).
        start_wait: seconds the workers that start together wait for all M before they
            begin with those that came (at least ``min_workers``), > 0; default None: the
            launch's ``timeout``.
    """

    min_workers: int | None = None
    restarts: int = 3
    heartbeat_timeout: float = 1.0
    lighthouse: str | None = None
    worker: int | None = None
    start_wait: float | None = None

    def check(self, workers: int) -> int:
        """Validate against M workers; returns the min_workers in effect.

        Args:
            workers: M, the workers of the job.

        Raises:
            ValueError: an option out of its range.
        """
        need = workers // 2 + 1 if self.min_workers is None else self.min_workers
        if not isinstance(need, int) or not 1 <= need <= workers:
            raise ValueError(f"min_workers must be an integer in [1, workers={workers}] "
                             f"(got {self.min_workers!r})")
        if not isinstance(self.restarts, int) or self.restarts < 0:
            raise ValueError(f"restarts must be an integer >= 0 (got {self.restarts!r})")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0 (got {self.heartbeat_timeout!r})")
        if self.start_wait is not None and not self.start_wait > 0:
            raise ValueError(f"start_wait must be > 0 (got {self.start_wait!r})")
        if (self.lighthouse is None) != (self.worker is None):
            raise ValueError("lighthouse and worker go together: this process is worker "
                             f"`worker` of the job of that Lighthouse (got lighthouse="
                             f"{self.lighthouse!r}, worker={self.worker!r})")
        if self.worker is not None and not 0 <= self.worker < workers:
            raise ValueError(f"worker must be in [0, workers={workers}) (got {self.worker!r})")
        return need


@renamed_arguments("launch_elastic", {"replicas": "workers", "shards": "worker_ranks"})
def launch_elastic(fn: Callable[..., Any], args: tuple, workers: int, timeout: float,
                   spec: Elastic, links: tuple = (None, None), worker_ranks: int = 1) -> list:
    """Run ``fn(ctx, *args)`` on M workers of R rank processes each, with elastic
    membership (see the module).

    Args:
        fn: the worker function (picklable).
        args: its positional arguments after ``ctx``.
        workers: M, the workers (``replicas``, its old name, is read for one release with a
            ``DeprecationWarning``; so is ``shards`` for ``worker_ranks``).
        timeout: seconds any wait of a worker may last.
        spec: the [`Elastic`][loco.runtime.elastic.Elastic] options.
        links: the emulated slow and fast links ([`LinkSpec`][loco.comm.link.LinkSpec] or
            None each); default none.
        worker_ranks: R, the ranks (processes) of every worker, joined by its own process group
            (``ctx.inner``, ``ctx.device_mesh``); default 1. When one of them dies, the
            worker's other ranks are stopped and all R restart together.

    Returns:
        Each rank's return value, in rank order (worker · R + worker rank); None for the ranks
            of a worker lost for good (it died more than ``restarts`` times).

    Raises:
        WorkerError: a worker raised an exception (it is not restarted: it would raise
            again; the others finish first), or every worker was lost.
    """
    from loco.comm.membership import start_lighthouse

    min_workers = spec.check(workers)
    lighthouse = start_lighthouse(min_workers, spec.heartbeat_timeout,
                                  join_timeout=timeout)
    ctx = context(getattr(fn, "__module__", None), "loco.comm.membership")  # every rank's
    job = _Job(ctx, _RankSpec(fn, args, workers, worker_ranks, lighthouse.address(),
                              min_workers, timeout, links, "127.0.0.1", ctx.Event(),
                              dict(os.environ), spec.start_wait))
    try:
        for w in range(workers):
            job.start(w, 0)
        while not job.settled():
            job.collect()
            for w in range(workers):
                job.check(w, spec.restarts)
            time.sleep(0.05)
    finally:
        job.stop()
        lighthouse.shutdown()
    return job.outcome()


@dataclass(frozen=True)
class _RankSpec:
    """What every rank process of an elastic job is started with.

    Args:
        fn: the worker function.
        args: its positional arguments after ``ctx``.
        workers: M, the workers of the job.
        worker_ranks: R, the ranks of every worker.
        lighthouse: the Lighthouse's address.
        min_workers: the fewest live workers a sync counts with.
        timeout: seconds any wait may last.
        links: the emulated slow and fast links (``LinkSpec`` or None each).
        host: the address the other workers reach this one at.
        job_over: a multiprocessing Event the supervisor sets when a rank finished the job
            (then one still joining stops); None for a worker of an external Lighthouse.
        env: the supervisor's environment at launch, which every rank process (and every
            restart) adopts; None: keep the process's own.
        start_wait: seconds the starting workers wait for all M (``Elastic.start_wait``);
            None: ``timeout``.
    """

    fn: Callable[..., Any]
    args: tuple
    workers: int
    worker_ranks: int
    lighthouse: str
    min_workers: int
    timeout: float
    links: tuple
    host: str
    job_over: Any = None
    env: dict | None = None
    start_wait: float | None = None


class _Job:
    """The supervisor's view of an elastic job's processes: R per worker, keyed
    (worker, worker rank); a worker's ranks live, die and restart together. Each process sends
    its one result down a pipe of its own: a process killed mid-send (the supervisor stops
    the ranks of a worker that lost one) breaks only its pipe, never another's (a queue
    shared by all holds one write lock, which a process killed while writing keeps
    forever, and every other process then hangs at exit)."""

    def __init__(self, ctx, spec: _RankSpec, entry: Callable | None = None):
        self.ctx, self.spec, self.ranks = ctx, spec, spec.worker_ranks
        self.entry = entry or _entry  # a rank's process: (spec, key, restart, port, pipe)
        self.pipes: dict[tuple[int, int], Any] = {}  # the read ends, until each one's result
        self.procs: dict[int, list] = {}
        self.stores: list = []  # each start's store of the worker's ranks, kept alive
        self.restarts: dict[int, int] = {}
        self.done: dict[tuple[int, int], Any] = {}
        self.raised: dict[tuple[int, int], str] = {}  # not restarted: it would raise again
        self.lost: dict[int, str] = {}
        self.deaths: dict[int, int] = {}  # the step each worker last died at (by SIGKILL)

    def start(self, worker: int, restart: int) -> None:
        port = None
        if self.ranks > 1:  # the rendezvous of the worker's own process group
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self.stores.append(store)
            port = store.port
        self.restarts[worker] = restart
        self.procs[worker] = []
        for r in range(self.ranks):
            if (old := self.pipes.pop((worker, r), None)) is not None:
                old.close()  # the killed process's, never to be read
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=self.entry, args=(self.spec, (worker, r), restart, port,
                                                      writer),
                                 name=f"loco-worker-{worker}-{r}", daemon=True)
            p.start()
            writer.close()  # the child's alone: its death is the pipe's end
            self.pipes[(worker, r)] = reader
            self.procs[worker].append(p)

    def settled(self) -> bool:
        return all(self._finished(w) or w in self.lost or self._raised(w)
                   for w in range(self.spec.workers))

    def _finished(self, worker: int) -> bool:
        return all((worker, r) in self.done for r in range(self.ranks))

    def _raised(self, worker: int) -> bool:
        return any((worker, r) in self.raised for r in range(self.ranks))

    def collect(self, wait: float = 0.0) -> None:
        """Take every result sent so far, waiting up to ``wait`` seconds for the first."""
        while ready := wait_ready(list(self.pipes.values()), timeout=wait):
            for key in [k for k, c in self.pipes.items() if c in ready]:
                conn = self.pipes.pop(key)
                try:
                    _, ok, value = conn.recv()
                except (EOFError, OSError):  # it died before sending, or while it sent
                    continue
                finally:
                    conn.close()
                if ok:
                    self.done[key] = pickle.loads(value)
                else:
                    self.raised[key] = value
            wait = 0.0
        if self.done and not self.spec.job_over.is_set():
            self.spec.job_over.set()

    def _dead(self, worker: int) -> list:
        return [p for r, p in enumerate(self.procs[worker])
                if not p.is_alive() and (worker, r) not in self.done]

    def check(self, worker: int, restarts: int) -> None:
        """A worker with a rank that died without a word (killed, crashed): stop its other
        ranks (whose errors, their fast link broken, are its consequence), then restart them
        all, or count the worker lost. One whose rank raised: stop its other ranks."""
        if worker in self.lost or self._finished(worker) or not self._dead(worker):
            return
        self.collect(wait=1.0)  # a result still in the pipe
        dead = self._dead(worker)
        if not dead:
            return
        silent = [p for r, p in enumerate(self.procs[worker])
                  if p in dead and (worker, r) not in self.raised]
        for p in self.procs[worker]:
            if p.is_alive():
                p.kill()
                p.join()
        if not silent:  # it raised: it would again
            log.error("elastic: worker %d failed:\n%s", worker, self.raised[min(
                k for k in self.raised if k[0] == worker)])
            return
        if any(k[0] == worker for k in self.raised):
            log.warning("elastic: worker %d lost a rank; its other ranks stopped", worker)
        for r in range(self.ranks):
            self.done.pop((worker, r), None)
            self.raised.pop((worker, r), None)
        code = silent[0].exitcode
        record = read_vitals(os.environ.get(DIR_ENV),
                             worker * self.ranks + self.procs[worker].index(silent[0]))
        died = death_note(code, record)
        again = died and record is not None and self.deaths.get(worker) == record["step"]
        if died and record is not None:
            self.deaths[worker] = record["step"]
        if self.restarts[worker] < restarts and not again:
            log.warning("elastic: worker %d died (exit code %s%s); restart %d of %d", worker,
                        code, f", {died}" if died else "", self.restarts[worker] + 1,
                        restarts)
            self.start(worker, self.restarts[worker] + 1)
        elif again:
            self.lost[worker] = (f"died twice in a row at step {record['step']}, {died}; not "
                                 "restarted again")
            log.warning("elastic: worker %d %s", worker, self.lost[worker])
        else:
            self.lost[worker] = (f"died {self.restarts[worker] + 1} times (exit code {code}"
                                 f"{', ' + died if died else ''})")

    def stop(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.is_alive():
                    p.kill()

    def outcome(self) -> list:
        if self.raised:
            key = min(self.raised)
            raise WorkerError(f"worker {key[0]} failed:\n{self.raised[key]}")
        if not self.done:
            raise WorkerError("every worker of the elastic run was lost: " + "; ".join(
                f"worker {w} {e}" for w, e in sorted(self.lost.items())))
        return [self.done.get((w, r)) for w in range(self.spec.workers)
                for r in range(self.ranks)]


#: A rank's one result goes down its pipe whole: the main thread's and ``_too_late``'s
#: sends never interleave.
_SENDING = threading.Lock()


def _too_late(job_over, comm, key: tuple[int, int], results) -> None:
    """Once a worker has finished the job, one still joining it (restarted too late to
    rejoin: no quorum with a live worker will come) exits cleanly, its result None."""
    # Polled, not waited on: a process that exits while waiting on a multiprocessing Event
    # leaves it a sleeper that the setter would wait for forever.
    while not (job_over.is_set() and (comm.waiting or comm.joining)):
        time.sleep(0.2)
    print(f"[loco] worker {key[0]}: the job finished while it waited to join", flush=True)
    with _SENDING:  # the pipe holds it when send returns
        results.send((key, True, pickle.dumps(None)))
    os._exit(0)


@renamed_arguments("run_worker", {"replicas": "workers", "shards": "worker_ranks"})
def run_worker(fn: Callable[..., Any], args: tuple, workers: int, timeout: float,
               spec: Elastic, links: tuple = (None, None), launcher: str = "processes",
               worker_ranks: int = 1) -> Any:
    """Run ``fn(ctx, *args)`` as (one rank of) worker ``spec.worker`` of the elastic job
    whose Lighthouse runs at ``spec.lighthouse`` (``launch`` with ``Elastic(lighthouse=...,
    worker=...)``). A worker of R > 1 ranks is a torchrun job of R processes: this is its
    rank ``RANK``.

    Args:
        fn: the worker function.
        args: its positional arguments after ``ctx``.
        workers: M, the workers of the job (``replicas``, its old name, is read for one
            release with a ``DeprecationWarning``; so is ``shards`` for ``worker_ranks``).
        timeout: seconds any wait may last.
        spec: the [`Elastic`][loco.runtime.elastic.Elastic] options, with ``lighthouse``
            and ``worker``.
        links: the emulated slow and fast links ([`LinkSpec`][loco.comm.link.LinkSpec] or
            None each); default none.
        launcher: what ``ctx.launcher`` says; default ``"processes"``.
        worker_ranks: R, the ranks of every worker (torchrun's world here); default 1.

    Returns:
        ``fn``'s return value.
    """
    # The address the other workers reach this one at (its torchft servers, its store, its
    # gloo pairs): LOCO_ELASTIC_HOST, or this machine's name.
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    index = int(os.environ["RANK"]) if worker_ranks > 1 else 0
    store = attempt_store(index, worker_ranks, timeout) if worker_ranks > 1 else None

    def watch(comm):
        if restart_count() > 0:
            threading.Thread(target=_alone, args=(comm,), daemon=True,
                             name="loco-alone").start()
    job = _RankSpec(fn, args, workers, worker_ranks, spec.lighthouse, spec.check(workers),
                    timeout, links, host, start_wait=spec.start_wait)
    return _run(job, (spec.worker, index), store, launcher, started=watch)


def _alone(comm, polls: int = 3) -> None:
    """A restarted worker of an external Lighthouse's job that is still joining while the
    Lighthouse hears from no other worker (``polls`` times, a second apart): the job is over
    (or every other worker is gone), so no quorum will come; it exits cleanly rather than
    wait out the timeout."""
    lonely = 0
    while lonely < polls:
        time.sleep(1.0)
        alone = (comm.waiting or comm.joining) and set(comm.alive()) <= {comm.worker}
        lonely = lonely + 1 if alone else 0
    print(f"[loco] worker {comm.worker}: no other worker is alive while it waits to join (the "
          "job is over); exiting", flush=True)
    os._exit(0)


def _run(job: _RankSpec, key: tuple[int, int], store, launcher: str,
         started: Callable[[Any], None] | None = None) -> Any:
    """One rank of an elastic worker: its device (under torchrun with CUDA, the GPU of
    ``LOCAL_RANK``), the worker's own process group (R > 1), its ElasticComm (gloo, which
    stages a GPU's tensors through host memory) and context, then ``job.fn``."""
    from loco.comm.membership import ElasticComm

    worker, shard = key
    device = rank_device(launcher)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers: no line per quorum
    inner, device_mesh, checkpoint_group = (
        _worker_world(store, shard, job.worker_ranks, job.timeout, job.links[1], device)
        if job.worker_ranks > 1 else (None, None, None))
    comm = ElasticComm(worker, job.workers, job.lighthouse, job.min_workers, job.timeout,
                       host=job.host, shard=shard, shards=job.worker_ranks, store=store,
                       link=emulated(job.links[0]), start_wait=job.start_wait,
                       stage_from=device if device.type != "cpu" else None)
    if started is not None:
        started(comm)
    mesh = Mesh(job.workers, 1, job.worker_ranks)
    ctx = RankContext(mesh.rank_of(worker, 0, shard), mesh.world_size, mesh, comm,
                      device, launcher, inner=inner, device_mesh=device_mesh,
                      checkpoint_group=checkpoint_group)
    try:
        return job.fn(ctx, *job.args)
    finally:
        comm.close()
        if inner is not None:
            inner.close()
            dist.destroy_process_group()


def _worker_world(store, shard: int, shards: int, timeout: float, fast_link: Any,
                  device: torch.device) -> tuple:
    """The process group of one worker's R ranks (its own world: there is none across the
    workers; NCCL on GPUs), its device mesh of shape (1, 1, R), the fast-link Comm over it
    (on ``device``, issuing from one thread on a GPU, as NCCL asks) and a gloo group for
    checkpoints."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo",
                            store=dist.PrefixStore("loco/world", store), rank=shard,
                            world_size=shards, timeout=datetime.timedelta(seconds=timeout),
                            **({"device_id": device} if cuda else {}))
    local = Mesh(1, 1, shards)
    device_mesh = init_device_mesh(device.type, local.shape, mesh_dim_names=MESH_DIMS)
    thread = CommThread(f"loco-comm-inner-{shard}") if cuda else None
    inner, checkpoint_group = worker_comms(local, shard, device, fast_link, thread)
    return inner, device_mesh, checkpoint_group


def _entry(job: _RankSpec, key: tuple[int, int], restart: int, port: int | None,
           results) -> None:
    """A rank process of an elastic worker started by ``launch_elastic``: ``job.fn`` in its
    context; the result (or the traceback) goes back through ``results``, this process's
    own pipe to the supervisor."""
    if job.env is not None:
        adopt_environment(job.env)
    os.environ[RESTART_ENV] = str(restart)
    torch.set_num_threads(cpu_threads(job.workers * job.worker_ranks))
    store = (dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=job.timeout))
             if port is not None else None)

    def watch(comm):
        threading.Thread(target=_too_late, args=(job.job_over, comm, key, results),
                         daemon=True, name="loco-job-over").start()
    try:
        value = _run(job, key, store, "processes", started=watch)
        # By value: tensors pickled by multiprocessing would be shared memory this process
        # must outlive.
        with _SENDING:
            results.send((key, True, pickle.dumps(value)))
    except BaseException:  # the supervisor tells a cause from a consequence, and says it
        with _SENDING:
            results.send((key, False, traceback.format_exc()))
        raise SystemExit(1) from None


def recovery_report(events: list[dict], syncs: list[dict], workers: int) -> dict:
    """What an elastic run's membership did, from one worker's
    [`ElasticComm`][loco.comm.membership.ElasticComm] records (their times are seconds since
    that worker started).

    Args:
        events: ``comm.events``.
        syncs: ``comm.syncs``.
        workers: M, the workers at full strength.

    Returns:
        ``syncs_by_participants`` (participants: committed syncs), ``dropped_syncs``, and
            ``losses``: for each time workers left, ``left``, ``noticed_at`` (the first
            dropped sync since the last committed one, or the start of the quorum that
            left them out), the seconds from
            then to the survivors' next committed sync (``to_next_sync``) and to the first
            committed sync at full strength again (``to_full_strength``, None if never).
    """
    by_participants: dict[int, int] = {}
    for rec in syncs:
        n = len(rec["participants"])
        by_participants[n] = by_participants.get(n, 0) + 1
    losses = []
    for i, ev in enumerate(events):
        if ev["event"] != "membership" or not ev["left"]:
            continue
        last_sync = max((r["time"] for r in syncs if r["time"] <= ev["time"]), default=0.0)
        dropped = [e["time"] for e in events[:i]
                   if e["event"] == "sync_dropped" and e["time"] >= last_sync]
        noticed = min(dropped, default=ev["time"] - ev.get("quorum_seconds", 0.0))
        after = [r for r in syncs if r["time"] >= ev["time"]]
        full = next((r["time"] for r in after if len(r["participants"]) == workers), None)
        losses.append({"left": ev["left"], "noticed_at": noticed,
                       "to_next_sync": after[0]["time"] - noticed if after else None,
                       "to_full_strength": None if full is None else full - noticed})
    return {"syncs_by_participants": dict(sorted(by_participants.items())),
            "dropped_syncs": sum(e["event"] == "sync_dropped" for e in events),
            "losses": losses, "events": list(events)}


__all__ = ["Elastic", "HOST_ENV", "RESTART_ENV", "launch_elastic", "recovery_report",
           "restart_count", "run_worker"]
