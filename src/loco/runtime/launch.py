"""Run one function on every worker: as threads, as local processes, or under torchrun.

``launch(fn, workers=M)`` calls ``fn(ctx, *args)`` on every rank and returns the ranks' return
values in rank order. ``ctx`` is a :class:`WorkerContext` with the rank, the mesh of replicas
and ``ctx.comm``, the :class:`~loco.comm.Comm` over the replicas.

``launch(fn, workers=R * S, ranks_per_replica=S)`` starts R replicas of S pipeline stages each:
rank = replica · S + stage. ``ctx.comm`` is then the Comm over the R ranks of this rank's stage
(its rank there is the replica index), which is what the outer algorithm talks through, and
``ctx.pipe`` is a Comm over the whole world (rank there = global rank) for the point-to-point
traffic between stages (see :mod:`loco.runtime.pipeline`). With S = 1, ``ctx.pipe`` is None.

* ``threads`` (default): M threads in this process. Each builds its own gloo process group on
  one shared in-memory store; the traffic is real gloo traffic over loopback. Starts in a
  fraction of a second, so it suits the default run and tests.
* ``processes``: M local processes started by torch.distributed's elastic launcher with a c10d
  rendezvous bound to 127.0.0.1; ``fn`` and ``args`` must be picklable.
* under ``torchrun`` (detected from its environment, any number of nodes): this process is one
  rank; ``init_process_group`` uses the environment's rendezvous, NCCL with one GPU per rank
  when CUDA is present and gloo otherwise. The return list then holds this rank's value only.

Ranks form a mesh of ``replicas × ranks_per_replica``: rank = replica · ranks_per_replica +
local. The outer algorithms talk across replicas (one Comm per local position, ``ctx.comm``);
the ranks of one replica are the stages of a pipeline and talk through ``ctx.pipe``.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loco.comm import Comm
from loco.comm.handles import Aborted
from loco.comm.thread import CommThread
from loco.comm.link import EmulatedLink, LinkSpec
from loco.runtime.elastic import Elastic, launch_elastic, run_worker

LAUNCHERS = ("threads", "processes", "torchrun")
"""How the workers run: threads of this process, local processes, or ranks of torchrun."""
DEFAULT_TIMEOUT = 300.0
"""Seconds a communication may take before it fails (``timeout`` of ``launch``)."""


MESH_DIMS = ("replica", "stage", "shard")
"""The named dimensions of a run's ``DeviceMesh``, outermost first: the workers (replicas)
of the outer algorithm, the pipeline stages of a worker, and the ranks that share one stage
of one worker (its fast-link group)."""


@dataclass(frozen=True)
class Mesh:
    """Ranks laid out as ``replicas × stages × shards``: rank = (replica · S + stage) · R +
    shard, so the ranks of one worker's stage are adjacent (on one node where possible).

    Args:
        replicas: M, the workers (replicas) of the outer algorithm, >= 1.
        ranks_per_replica: S, the pipeline stages of each replica, >= 1; default 1.
        shards: R, the ranks that share each stage of a worker and talk over its fast link
            (``ctx.inner``), >= 1; default 1.
    """

    replicas: int
    ranks_per_replica: int = 1
    shards: int = 1

    @property
    def world_size(self) -> int:
        """All ranks: replicas × stages × shards."""
        return self.replicas * self.ranks_per_replica * self.shards

    @property
    def shape(self) -> tuple[int, int, int]:
        """(M, S, R): the sizes of ``MESH_DIMS``."""
        return (self.replicas, self.ranks_per_replica, self.shards)

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage: the position inside the replica) of a global rank.

        Args:
            rank: a global rank, in [0, world_size).
        """
        return divmod(rank // self.shards, self.ranks_per_replica)

    def shard_of(self, rank: int) -> int:
        """The rank's index among the ranks of its worker's stage, in [0, R).

        Args:
            rank: a global rank, in [0, world_size).
        """
        return rank % self.shards

    def replica_peers(self, local: int, shard: int = 0) -> list[int]:
        """Global ranks that hold the same place in every replica: the outer group (the
        slow link).

        Args:
            local: the position inside a replica (the pipeline stage), in [0, S).
            shard: the index among the stage's ranks, in [0, R); default 0.
        """
        return [self.rank_of(r, local, shard) for r in range(self.replicas)]

    def worker_peers(self, replica: int, local: int) -> list[int]:
        """Global ranks of one stage of one worker: its fast-link group, in shard order.

        Args:
            replica: the replica, in [0, M).
            local: the pipeline stage, in [0, S).
        """
        return [self.rank_of(replica, local, k) for k in range(self.shards)]

    def rank_of(self, replica: int, local: int, shard: int = 0) -> int:
        """Global rank of position ``local`` (the pipeline stage) in ``replica``.

        Args:
            replica: the replica, in [0, M).
            local: the position inside it, in [0, S).
            shard: the index among the stage's ranks, in [0, R); default 0.
        """
        return (replica * self.ranks_per_replica + local) * self.shards + shard


@dataclass
class WorkerContext:
    """What one rank knows about the run; [`launch`][loco.runtime.launch.launch] passes it to
    the function as its first argument.

    Args:
        rank: this rank's global rank, in [0, world_size).
        world_size: all ranks of the run, replicas × ranks_per_replica.
        mesh: the layout of the ranks.
        comm: the [`Comm`][loco.comm.comm.Comm] over the replicas of this rank's stage
            (its rank there is the replica index): what the outer algorithm talks through.
        device: this rank's device (a CUDA device under torchrun with GPUs, else CPU).
        launcher: how it was started: ``"threads"``, ``"processes"`` or ``"torchrun"``.
        extras: free room for the caller's own per-rank values; default empty.
        pipe: a Comm over the whole world (rank there = global rank) for the traffic
            between pipeline stages; None (default) when every replica is a single rank.
        inner: a Comm over the R ranks of this worker's stage (rank there = the shard), the
            fast link inside a worker, shaped only by ``launch``'s ``fast_link``; None
            (default) when R = 1.
        device_mesh: the run's ``torch.distributed.device_mesh.DeviceMesh`` of shape
            (M, S, R) with dimension names ``MESH_DIMS`` (processes and torchrun); None
            (default) under the threads launcher, whose groups torch.distributed's registry
            does not know.
        checkpoint_group: a gloo process group over the R ranks of this worker's stage, for
            ``torch.distributed.checkpoint`` on the checkpoint writer's thread (processes and
            torchrun, R > 1); None (default) otherwise.
    """

    rank: int
    world_size: int
    mesh: Mesh
    comm: Comm
    device: torch.device
    launcher: str
    extras: dict = field(default_factory=dict)
    # Comm over the whole world (rank = global rank) for traffic between pipeline stages;
    # None when every replica is a single rank.
    pipe: Comm | None = None
    inner: Comm | None = None
    device_mesh: Any = None
    checkpoint_group: Any = None

    @property
    def replica(self) -> int:
        """The replica this rank belongs to (its rank in ``comm``)."""
        return self.mesh.coords(self.rank)[0]

    @property
    def stage(self) -> int:
        """Pipeline stage of this rank (its position inside the replica)."""
        return self.mesh.coords(self.rank)[1]

    @property
    def stages(self) -> int:
        """S, the pipeline stages of every replica."""
        return self.mesh.ranks_per_replica

    @property
    def shard(self) -> int:
        """This rank's index among the ranks of its worker's stage (its rank in ``inner``)."""
        return self.mesh.shard_of(self.rank)

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0."""
        return self.rank == 0


class WorkerError(RuntimeError):
    """A worker raised; the message names the worker and carries its traceback.

    [`launch`][loco.runtime.launch.launch] raises it for the first worker that failed on
    its own (not for those stopped because of it).
    """


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (from its environment variables
    ``TORCHELASTIC_RUN_ID`` and ``RANK``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def launch(fn: Callable[..., Any], workers: int = 2, launcher: str = "threads", *,
           args: tuple = (), kwargs: dict | None = None, ranks_per_replica: int = 1,
           timeout: float = DEFAULT_TIMEOUT, max_restarts: int = 0,
           link: LinkSpec | None = None, shards: int = 1,
           fast_link: LinkSpec | None = None, elastic: Elastic | None = None) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order.

    Under torchrun (detected from the environment, whatever ``launcher`` says) this process
    is one rank: it runs ``fn`` once and returns a one-item list.

    Args:
        fn: the function each rank runs; its first argument is the rank's
            [`WorkerContext`][loco.runtime.launch.WorkerContext]. Must be picklable (a
            module-level function) for the ``"processes"`` launcher.
        workers: all ranks, R replicas × S stages, >= 1 and a multiple of
            ``ranks_per_replica``; default 2. Under torchrun it must equal torchrun's world
            size, unless ``launcher`` is ``"torchrun"`` (then torchrun's is used).
        launcher: ``"threads"`` (default: threads of this process on gloo over loopback,
            starts in a fraction of a second), ``"processes"`` (local processes by torch
            elastic) or ``"torchrun"`` (only valid in a process torchrun started).
        args: positional arguments passed to ``fn`` after the context; default none.
        kwargs: keyword arguments passed to ``fn``; default none.
        ranks_per_replica: S, pipeline stages per replica, >= 1 and dividing ``workers``;
            default 1.
        timeout: seconds a communication may take before it fails instead of hanging;
            default 300.
        max_restarts: ``"processes"`` only: how many times torch elastic restarts all
            workers after one died; default 0.
        link: an emulated link of that bandwidth and latency for every rank, shared by all
            its communication but ``ctx.inner`` (see [`LinkSpec`][loco.comm.link.LinkSpec]);
            default None (the transport's own speed).
        shards: R, the ranks that share each stage of a worker, joined by its fast link
            (``ctx.inner``); >= 1, with ``workers`` a multiple of S · R; default 1. Not yet
            with pipeline stages (S > 1).
        fast_link: an emulated link of that bandwidth and latency for every rank's
            ``ctx.inner``, the fast link inside a worker, apart from ``link``; default None
            (the transport's own speed).
        elastic: run with elastic membership ([`Elastic`][loco.runtime.elastic.Elastic]):
            workers of R = ``shards`` ranks each (no pipeline stages), under
            ``"processes"``; a worker that dies is restarted alone (all its ranks) and the
            others keep training (see
            [`launch_elastic`][loco.runtime.elastic.launch_elastic]). Default None: a fixed
            membership.

    Returns:
        ``fn``'s return value of every rank, in rank order (under torchrun: this rank's
            only).

    Raises:
        ValueError: an unknown ``launcher``, ``workers`` < 1 or not a multiple of
            ``ranks_per_replica``, or ``"torchrun"`` outside torchrun.
        WorkerError: a worker raised (its traceback is in the message); under torchrun
            the rank's own exception propagates instead.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (got {launcher!r})")
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (got {workers})")
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    if ranks_per_replica < 1 or workers % ranks_per_replica:
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_replica "
                         f"({ranks_per_replica}): replicas x pipeline stages")
    if shards < 1 or workers % (ranks_per_replica * shards):
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_replica x "
                         f"shards ({ranks_per_replica} x {shards}): replicas x stages x shards")
    if shards > 1 and ranks_per_replica > 1:
        raise ValueError("shards > 1 with pipeline stages (ranks_per_replica > 1) is not "
                         "supported yet; use one or the other")
    if elastic is not None:
        return _launch_elastic(fn, args, workers, launcher, timeout, elastic,
                               (link, fast_link), ranks_per_replica, shards)
    if launcher == "torchrun" and not under_torchrun():
        raise ValueError("launcher 'torchrun' needs a process started by torchrun "
                         "(its RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID are missing)")
    if under_torchrun():
        return [_run_from_env(fn, args, workers if launcher != "torchrun" else None,
                              ranks_per_replica, timeout, "torchrun", (link, fast_link),
                              shards)]
    mesh = Mesh(workers // (ranks_per_replica * shards), ranks_per_replica, shards)
    if launcher == "threads":
        return _launch_threads(fn, args, mesh, timeout, (link, fast_link))
    return _launch_processes(fn, args, mesh, timeout, max_restarts, (link, fast_link))


def _launch_elastic(fn, args, workers: int, launcher: str, timeout: float, spec: Elastic,
                    links: tuple, stages: int, shards: int) -> list:
    """An elastic run: every worker as local processes (``spec.lighthouse`` None), or this
    process as (one rank of) one worker (under torchrun, or started by hand)."""
    if stages > 1:
        raise ValueError("elastic membership runs without pipeline stages "
                         "(ranks_per_replica must be 1) for now")
    if workers % shards:
        raise ValueError(f"workers ({workers}) must be a multiple of shards ({shards})")
    workers //= shards
    if spec.lighthouse is not None:
        spec.check(workers)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
        if world != shards:
            raise ValueError(f"an elastic worker of {shards} rank(s) is one torchrun job of "
                             f"{shards} process(es) (--nproc-per-node {shards}), one job per "
                             f"worker, each with its --worker-index (got a world of {world})")
        return [run_worker(fn, args, workers, timeout, spec, links,
                           "torchrun" if under_torchrun() else "processes", shards)]
    if launcher != "processes" or under_torchrun():
        raise ValueError("elastic membership starts its workers under the 'processes' "
                         "launcher; under torchrun give the Lighthouse's address and each "
                         "job's worker index (Elastic(lighthouse=..., worker=...))")
    return launch_elastic(fn, args, workers, timeout, spec, links, shards)


# ------------------------------------------------------------------------------- threads
def _gloo_group(store, rank: int, size: int, timeout: float, loopback: bool):
    td = datetime.timedelta(seconds=timeout)
    if not loopback:  # honours GLOO_SOCKET_IFNAME, as torch does
        return dist.ProcessGroupGloo(store, rank, size, td)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = td
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _emulated(spec: LinkSpec | None) -> EmulatedLink | None:
    """A rank's emulated link of that speed, or None for the transport's own."""
    return EmulatedLink(spec) if spec is not None else None


def _launch_threads(fn, args, mesh: Mesh, timeout: float, links: tuple) -> list:
    store = dist.HashStore()
    n = mesh.world_size
    results: list = [None] * n
    errors: list[tuple[int, BaseException, str]] = []  # in the order they happened
    failed = threading.Event()  # shared by every worker's Comm: a failure stops them all

    # One intra-op thread per worker when workers outnumber cores: more only oversubscribes.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))

    def body(rank: int):
        try:
            replica, local = mesh.coords(rank)
            shard = mesh.shard_of(rank)
            group = _gloo_group(dist.PrefixStore(f"loco/outer/{local}/{shard}", store),
                                replica, mesh.replicas, timeout, loopback=True)
            wire = _emulated(links[0])  # this rank's slow link
            comm = Comm(group, replica, mesh.replicas, "cpu", abort_event=failed, link=wire)
            inner = None
            if mesh.shards > 1:  # the worker's fast link
                inner_group = _gloo_group(
                    dist.PrefixStore(f"loco/inner/{replica}/{local}", store), shard,
                    mesh.shards, timeout, loopback=True)
                inner = Comm(inner_group, shard, mesh.shards, "cpu", name="inner",
                             abort_event=failed, link=_emulated(links[1]))
            pipe = None
            if mesh.ranks_per_replica > 1:
                pipe_group = _gloo_group(dist.PrefixStore("loco/pipe", store), rank, n, timeout,
                                         loopback=True)
                pipe = Comm(pipe_group, rank, n, "cpu", name="pipe", abort_event=failed,
                            link=wire)
            ctx = WorkerContext(rank, n, mesh, comm, torch.device("cpu"), "threads", pipe=pipe,
                                inner=inner)
            try:
                results[rank] = fn(ctx, *args)
            finally:
                for c in (comm, pipe, inner):
                    if c is not None:
                        c.close()
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append((rank, e, traceback.format_exc()))
            failed.set()

    threads = [threading.Thread(target=body, args=(r,), name=f"loco-worker-{r}", daemon=True)
               for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(prev_threads)
    if errors:
        # The cause is the first worker that failed on its own; the rest were stopped.
        rank, error, trace = next((e for e in errors if not isinstance(e[1], Aborted)),
                                  errors[0])
        if getattr(error, "brief", False):  # an expected failure: its message says it all
            raise WorkerError(str(error))
        raise WorkerError(f"worker {rank} failed:\n{trace}")
    return results


# ----------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_processes(fn, args, mesh: Mesh, timeout: float, max_restarts: int,
                      links: tuple) -> list:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=mesh.world_size,
        run_id=f"loco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"is_host": True}, local_addr="127.0.0.1",
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        out = elastic_launch(config, _process_entry)(fn, args, mesh.ranks_per_replica, timeout,
                                                     links, mesh.shards)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # torch elastic's error file: the exception's text
            message = message.get("message")
        raise WorkerError(f"worker {rank} failed (exit code {failure.exitcode}): "
                          f"{message or 'see its output above'}") from None
    return [out[r] for r in sorted(out)]


def _process_entry(fn, args, ranks_per_replica: int, timeout: float, links: tuple,
                   shards: int = 1):
    workers = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    return _run_from_env(fn, args, workers, ranks_per_replica, timeout, "processes", links,
                         shards)


def _attempt_store(rank: int, world: int, timeout: float):
    """The rendezvous store of torch elastic's environment, under a prefix of its own for
    each restart: after a worker died, the store still holds the dead attempt's addresses,
    and a restarted group reading them would try to connect to a process that is gone."""
    td = datetime.timedelta(seconds=timeout)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agent hosts it
        store = dist.TCPStore(host, port, world, is_master=False, timeout=td)
    else:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=td,
                              multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"loco/attempt{attempt}", store)


def _worker_group(mesh: Mesh, rank: int, backend: str | None = None):
    """A process group over the R ranks of this rank's worker (and stage), of loco's own:
    the same ranks as the device mesh's ``"shard"`` group, which FSDP2 issues on from the
    training thread, while loco's inner Comm issues from its communication thread (and the
    checkpoint writer from its own, with ``backend="gloo"``: DCP's plans are Python objects
    on the CPU); two threads must not share one communicator (NCCL runs a communicator's
    operations in the order they are issued, which would then differ between ranks). Every
    rank creates every worker's group, in the same order."""
    mine = None
    for replica in range(mesh.replicas):
        for local in range(mesh.ranks_per_replica):
            ranks = mesh.worker_peers(replica, local)
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine = group
    return mine


def _worker_comms(mesh: Mesh, rank: int, device: torch.device, fast_link: LinkSpec | None,
                  thread: CommThread | None = None) -> tuple:
    """The fast-link Comm over this rank's worker (its R ranks) and a gloo group of the same
    ranks for checkpoints; (None, None) for workers of one rank."""
    if mesh.shards == 1:
        return None, None
    inner = Comm(_worker_group(mesh, rank), mesh.shard_of(rank), mesh.shards, device,
                 name="inner", link=_emulated(fast_link), thread=thread)
    return inner, _worker_group(mesh, rank, "gloo")


def _run_from_env(fn, args, workers: int | None, ranks_per_replica: int, timeout: float,
                  launcher: str, links: tuple = (None, None), shards: int = 1):
    world = int(os.environ["WORLD_SIZE"])
    if workers is not None and workers != world:
        raise ValueError(f"{workers} ranks asked for (--workers x --worker-ranks x --stages) "
                         f"but torchrun started {world}; leave --workers out or make them agree")
    if world % (ranks_per_replica * shards):
        raise ValueError(f"torchrun's {world} ranks do not split into workers of "
                         f"{ranks_per_replica} stage(s) x {shards} rank(s) (--stages x "
                         "--worker-ranks must divide the world size)")
    rank = int(os.environ["RANK"])
    use_cuda = launcher == "torchrun" and torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = Mesh(world // (ranks_per_replica * shards), ranks_per_replica, shards)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=_attempt_store(rank, world,
                                                                               timeout),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout),
                            **({"device_id": device} if use_cuda else {}))
    try:
        replica, local = mesh.coords(rank)
        # Every rank creates every group of every dimension, in the same order.
        device_mesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=MESH_DIMS)
        group = device_mesh.get_group("replica")  # this stage and shard in every worker
        wire = _emulated(links[0])  # this rank's slow link
        # NCCL: one thread issues every operation of this rank, in one order (CommThread).
        thread = CommThread(f"loco-comm-{rank}") if use_cuda else None
        comm = Comm(group, replica, mesh.replicas, device, link=wire, thread=thread)
        # Stages talk point to point over the default group, in global ranks.
        pipe = (Comm(dist.group.WORLD, rank, world, device, name="pipe", link=wire,
                     thread=thread) if ranks_per_replica > 1 else None)
        inner, checkpoint_group = _worker_comms(mesh, rank, device, links[1], thread)
        ctx = WorkerContext(rank, world, mesh, comm, device, launcher, pipe=pipe, inner=inner,
                            device_mesh=device_mesh, checkpoint_group=checkpoint_group)
        try:
            return fn(ctx, *args)
        finally:
            for c in (comm, pipe, inner):
                if c is not None:
                    c.close()
    except BaseException:
        print(f"[loco] worker {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
