"""Run one function on every rank: as threads, as local processes, or under torchrun.

``launch(fn, replicas=M, stages=S, shards=R)`` calls ``fn(ctx, *args)`` on each of the
M · S · R ranks and returns their return values in rank order. ``ctx`` is the rank's
[`WorkerContext`][loco.runtime.context.WorkerContext]: its place in the
[`Mesh`][loco.runtime.context.Mesh], rank = (replica · S + stage) · R + shard, and its Comms:

* ``ctx.comm``, over the M ranks that hold the same stage and shard in every replica (its
  rank there is the replica index): what the outer algorithm talks through (the slow link);
* ``ctx.pipe`` (S > 1), over the whole world (rank there = global rank): the point-to-point
  traffic between pipeline stages (see [`loco.runtime.pipeline`][loco.runtime.pipeline]);
* ``ctx.inner`` (R > 1), over the R ranks of this worker's stage: the fast link inside a
  worker.

Launchers:

* ``threads`` (default): every rank a thread of this process, each with its own gloo process
  group on one shared in-memory store, talking real gloo traffic over loopback.
* ``processes``: local processes started by torch.distributed's elastic launcher with a
  c10d rendezvous bound to 127.0.0.1; ``fn`` and ``args`` must be picklable.
* under ``torchrun`` (detected from its environment, any number of nodes): this process is one
  rank; ``init_process_group`` uses the environment's rendezvous, NCCL with one GPU per rank
  when CUDA is present and gloo otherwise. The return list then holds this rank's value only.
"""

from __future__ import annotations

import datetime
import functools
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loco.comm import Comm
from loco.comm.handles import Aborted
from loco.comm.link import LinkSpec
from loco.comm.thread import CommThread
from loco.runtime.context import (
    MESH_DIMS,
    Mesh,
    WorkerContext,
    WorkerError,
    attempt_store,
    emulated,
    rank_device,
    worker_comms,
)
from loco.runtime.elastic import Elastic, launch_elastic, run_worker
from loco.runtime.starter import START_METHOD, adopt_environment, context
from loco.runtime.vitals import DIR_ENV, death_note, read_vitals

LAUNCHERS = ("threads", "processes", "torchrun")
"""How the workers run: threads of this process, local processes, or ranks of torchrun."""
DEFAULT_TIMEOUT = 300.0
"""Seconds a communication may take before it fails (``timeout`` of ``launch``)."""


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (from its environment variables
    ``TORCHELASTIC_RUN_ID`` and ``RANK``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def launch(fn: Callable[..., Any], workers: int | None = None, launcher: str = "threads", *,
           replicas: int | None = None, stages: int | None = None, shards: int = 1,
           args: tuple = (), kwargs: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
           max_restarts: int = 0, link: LinkSpec | None = None,
           fast_link: LinkSpec | None = None, elastic: Elastic | None = None,
           ranks_per_replica: int | None = None) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order.

    The run has M replicas of S pipeline stages of R shards each: M · S · R ranks. Under
    torchrun (detected from the environment, whatever ``launcher`` says) this process is one
    rank: it runs ``fn`` once and returns a one-item list.

    Args:
        fn: the function each rank runs; its first argument is the rank's
            [`WorkerContext`][loco.runtime.context.WorkerContext]. Must be picklable (a
            module-level function) for the ``"processes"`` launcher.
        replicas: M, the workers (replicas) of the outer algorithm, >= 1. Default None:
            from ``workers``, or without it two ranks in all (M = 2 ÷ (S · R)). Under
            torchrun M · S · R must equal torchrun's world size, unless ``launcher`` is
            ``"torchrun"`` (then M is torchrun's world size ÷ (S · R)).
        stages: S, the pipeline stages of each replica, >= 1; default None: 1.
        shards: R, the ranks that share each stage of a worker, joined by its fast link
            (``ctx.inner``), >= 1; default 1. Not yet with pipeline stages (S > 1).
        launcher: ``"threads"`` (default: threads of this process on gloo over loopback),
            ``"processes"`` (local processes by torch elastic) or ``"torchrun"`` (only valid
            in a process torchrun started).
        args: positional arguments passed to ``fn`` after the context; default none.
        kwargs: keyword arguments passed to ``fn``; default none.
        timeout: seconds a communication may take before it fails instead of hanging;
            default 300.
        max_restarts: ``"processes"`` only: how many times torch elastic restarts all
            workers after one died; default 0. Apart from these, ranks that all fail before
            any reached ``fn`` (while connecting) are started again once.
        link: an emulated link of that bandwidth and latency for every rank, shared by all
            its communication but ``ctx.inner`` (see [`LinkSpec`][loco.comm.link.LinkSpec]);
            default None (the transport's own speed).
        fast_link: an emulated link of that bandwidth and latency for every rank's
            ``ctx.inner``, the fast link inside a worker, apart from ``link``; default None
            (the transport's own speed).
        elastic: run with elastic membership ([`Elastic`][loco.runtime.elastic.Elastic]):
            workers of R = ``shards`` ranks each (S = 1), under ``"processes"``; a worker
            that dies is restarted alone (all its ranks) and the others keep training (see
            [`launch_elastic`][loco.runtime.elastic.launch_elastic]). Default None: a fixed
            membership.
        workers: the old name of the count (also the second positional argument): ALL
            ranks, M · S · R, >= 1 and a multiple of S · R; not with ``replicas``.
        ranks_per_replica: the old name of ``stages``; not with ``stages``.

    Returns:
        ``fn``'s return value of every rank, in rank order (under torchrun: this rank's
            only).

    Raises:
        ValueError: an unknown ``launcher``, a count below 1, ``workers`` not a multiple of
            S · R, R > 1 with S > 1, or ``"torchrun"`` outside torchrun.
        TypeError: a count given by both its name and its old name.
        WorkerError: a worker raised (its traceback is in the message); under torchrun
            the rank's own exception propagates instead.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (got {launcher!r})")
    world, stages = _counts(replicas, stages, shards, workers, ranks_per_replica)
    if shards > 1 and stages > 1:
        raise ValueError("shards > 1 with pipeline stages (stages > 1) is not supported yet; "
                         "use one or the other")
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    links = (link, fast_link)
    mesh = Mesh(world // (stages * shards), stages, shards)
    if elastic is not None:
        return _launch_elastic(fn, args, mesh, launcher, timeout, elastic, links)
    if launcher == "torchrun" and not under_torchrun():
        raise ValueError("launcher 'torchrun' needs a process started by torchrun "
                         "(its RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID are missing)")
    if under_torchrun():
        share_cores()
        return [_run_from_env(fn, args, world if launcher != "torchrun" else None, stages,
                              shards, timeout, "torchrun", links)]
    if launcher == "threads":
        return _launch_threads(fn, args, mesh, timeout, links)
    return _launch_processes(fn, args, mesh, timeout, max_restarts, links)


def _counts(replicas: int | None, stages: int | None, shards: int, workers: int | None,
            ranks_per_replica: int | None) -> tuple[int, int]:
    """(all ranks, S) from ``launch``'s counts, new names or old, checked. The old names
    keep their old meaning and their old messages."""
    if ranks_per_replica is not None:
        if stages is not None:
            raise TypeError("give stages or ranks_per_replica (its old name), not both")
        stages = ranks_per_replica
    stages = 1 if stages is None else stages
    if replicas is not None:
        if workers is not None:
            raise TypeError("give replicas (M) or workers (the old name of all ranks, "
                            "M x S x R), not both")
        for name, n in (("replicas", replicas), ("stages", stages), ("shards", shards)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1 (got {n})")
        return replicas * stages * shards, stages
    workers = 2 if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (got {workers})")
    if stages < 1 or workers % stages:
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_replica "
                         f"({stages}): replicas x pipeline stages")
    if shards < 1 or workers % (stages * shards):
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_replica x "
                         f"shards ({stages} x {shards}): replicas x stages x shards")
    return workers, stages


def _launch_elastic(fn, args, mesh: Mesh, launcher: str, timeout: float, spec: Elastic,
                    links: tuple) -> list:
    """An elastic run: every worker as local processes (``spec.lighthouse`` None), or this
    process as (one rank of) one worker (under torchrun, or started by hand)."""
    if mesh.stages > 1:
        raise ValueError("elastic membership runs without pipeline stages "
                         "(stages must be 1) for now")
    if spec.lighthouse is not None:
        spec.check(mesh.replicas)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
        if world != mesh.shards:
            raise ValueError(f"an elastic worker of {mesh.shards} rank(s) is one torchrun job "
                             f"of {mesh.shards} process(es) (--nproc-per-node {mesh.shards}), "
                             "one job per worker, each with its --worker-index (got a world "
                             f"of {world})")
        return [run_worker(fn, args, mesh.replicas, timeout, spec, links,
                           "torchrun" if under_torchrun() else "processes", mesh.shards)]
    if launcher != "processes" or under_torchrun():
        raise ValueError("elastic membership starts its workers under the 'processes' "
                         "launcher; under torchrun give the Lighthouse's address and each "
                         "job's worker index (Elastic(lighthouse=..., worker=...))")
    return launch_elastic(fn, args, mesh.replicas, timeout, spec, links, mesh.shards)


# ------------------------------------------------------------------------------- threads
def _gloo_group(store, rank: int, size: int, timeout: float, loopback: bool):
    td = datetime.timedelta(seconds=timeout)
    if not loopback:  # honours GLOO_SOCKET_IFNAME, as torch does
        return dist.ProcessGroupGloo(store, rank, size, td)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = td
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _thread_context(rank: int, mesh: Mesh, store, timeout: float, links: tuple,
                    failed: threading.Event) -> WorkerContext:
    """One thread rank's context: its gloo groups on the shared ``store`` and their Comms,
    all stopped by ``failed``."""
    replica, stage = mesh.coords(rank)
    shard = mesh.shard_of(rank)
    n = mesh.world_size
    group = _gloo_group(dist.PrefixStore(f"loco/outer/{stage}/{shard}", store),
                        replica, mesh.replicas, timeout, loopback=True)
    wire = emulated(links[0])  # this rank's slow link
    comm = Comm(group, replica, mesh.replicas, "cpu", abort_event=failed, link=wire)
    inner = None
    if mesh.shards > 1:  # the worker's fast link
        inner_group = _gloo_group(dist.PrefixStore(f"loco/inner/{replica}/{stage}", store),
                                  shard, mesh.shards, timeout, loopback=True)
        inner = Comm(inner_group, shard, mesh.shards, "cpu", name="inner",
                     abort_event=failed, link=emulated(links[1]))
    pipe = None
    if mesh.stages > 1:
        pipe_group = _gloo_group(dist.PrefixStore("loco/pipe", store), rank, n, timeout,
                                 loopback=True)
        pipe = Comm(pipe_group, rank, n, "cpu", name="pipe", abort_event=failed, link=wire)
    return WorkerContext(rank, n, mesh, comm, torch.device("cpu"), "threads", pipe=pipe,
                         inner=inner)


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
            ctx = _thread_context(rank, mesh, store, timeout, links, failed)
            try:
                results[rank] = fn(ctx, *args)
            finally:
                for c in (ctx.comm, ctx.pipe, ctx.inner):
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
    """The ranks as processes of torch elastic's local agent. A launch whose ranks all fail
    before any reaches ``fn`` (while they connect: a gloo mesh torn down mid-connect on a
    loaded machine, a rank that crashes in set-up) starts them again, once; ``fn`` itself
    never runs twice unless ``max_restarts`` says so."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    context(getattr(fn, "__module__", None))  # what the ranks' fork server imports once
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="loco-started-") as started:
            try:
                out = _elastic_agent(mesh, max_restarts)(
                    dict(os.environ), fn, args, mesh.stages, mesh.shards, timeout, links, started)
                return [out[r] for r in sorted(out)]
            except ChildFailedError as e:
                error = _worker_error(e)
                if attempt or os.listdir(started):
                    raise error from None
        print(f"[loco] the ranks failed while connecting ({error}); starting them again, once",
              file=sys.stderr, flush=True)


def _elastic_agent(mesh: Mesh, max_restarts: int):
    """torch elastic's launcher of ``_process_entry`` on this machine, for one launch."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=mesh.world_size,
        run_id=f"loco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"is_host": True}, local_addr="127.0.0.1",
        max_restarts=max_restarts, monitor_interval=0.1, start_method=START_METHOD,
    )
    return elastic_launch(config, _process_entry)


def _worker_error(e) -> WorkerError:
    """The WorkerError for torch elastic's ChildFailedError: the rank that failed on its
    own. A rank that died of a signal of its own (SIGKILL: out of memory; SIGSEGV,
    SIGABRT: a native crash) is the cause; the others' errors (their peer gone) may be
    recorded first, and the agent stops the rest with SIGTERM."""
    rank, failure = e.get_first_failure()
    rank, failure = next(((r, f) for r, f in sorted(e.failures.items())
                          if f.exitcode < 0 and f.exitcode != -signal.SIGTERM), (rank, failure))
    message = failure.message
    if isinstance(message, dict):  # torch elastic's error file: the exception's text
        message = message.get("message")
    died = death_note(failure.exitcode, read_vitals(os.environ.get(DIR_ENV), rank))
    if not died and failure.exitcode < 0:
        died = f"killed by {_signal_name(-failure.exitcode)} (its output above may say more)"
    return WorkerError(f"worker {rank} failed (exit code {failure.exitcode}): "
                       f"{died or message or 'see its output above'}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def share_cores() -> None:
    """Give this process its share of the machine's cores for torch's CPU threads: the cores
    divided by the ranks started on this machine (``LOCAL_WORLD_SIZE``), at least one.
    torchrun sets ``OMP_NUM_THREADS=1`` in every rank it starts, which would leave an
    offloaded outer step or a codec on the CPU to one core whatever the machine has."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _process_entry(env: dict, fn, args, stages: int, shards: int, timeout: float,
                   links: tuple, started: str):
    adopt_environment(env)
    share_cores()
    return _run_from_env(fn, args, int(os.environ["WORLD_SIZE"]), stages, shards, timeout,
                         "processes", links, started)


def _run_from_env(fn, args, asked: int | None, stages: int, shards: int, timeout: float,
                  launcher: str, links: tuple, started: str | None = None):
    """This process as one rank of a torch.distributed world from the environment; ``asked``:
    the ranks the caller expects (None: whatever the world is); ``started``: a directory
    where the rank leaves a file once it is connected, before it calls ``fn``."""
    world = int(os.environ["WORLD_SIZE"])
    if asked is not None and asked != world:
        raise ValueError(f"{asked} ranks asked for (--workers x --worker-ranks x --stages) "
                         f"but torchrun started {world}; leave --workers out or make them agree")
    if world % (stages * shards):
        raise ValueError(f"torchrun's {world} ranks do not split into workers of "
                         f"{stages} stage(s) x {shards} rank(s) (--stages x "
                         "--worker-ranks must divide the world size)")
    rank = int(os.environ["RANK"])
    device = rank_device(launcher)
    use_cuda = device.type == "cuda"
    mesh = Mesh(world // (stages * shards), stages, shards)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=attempt_store(rank, world,
                                                                               timeout),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout),
                            **({"device_id": device} if use_cuda else {}))
    try:
        replica = mesh.coords(rank)[0]
        # Every rank creates every group of every dimension, in the same order.
        device_mesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=MESH_DIMS)
        group = device_mesh.get_group("replica")  # this stage and shard in every worker
        wire = emulated(links[0])  # this rank's slow link
        # NCCL: one thread issues every operation of this rank, in one order (CommThread).
        thread = CommThread(f"loco-comm-{rank}") if use_cuda else None
        comm = Comm(group, replica, mesh.replicas, device, link=wire, thread=thread)
        # Stages talk point to point over the default group, in global ranks.
        pipe = (Comm(dist.group.WORLD, rank, world, device, name="pipe", link=wire,
                     thread=thread) if stages > 1 else None)
        inner, checkpoint_group = worker_comms(mesh, rank, device, links[1], thread)
        ctx = WorkerContext(rank, world, mesh, comm, device, launcher, pipe=pipe, inner=inner,
                            device_mesh=device_mesh, checkpoint_group=checkpoint_group)
        if started is not None:
            open(os.path.join(started, str(rank)), "w").close()
        try:
            return fn(ctx, *args)
        finally:
            for c in (comm, pipe, inner):
                if c is not None:
                    c.close()
    except BaseException:
        print(f"[loco] worker {rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        raise
    finally:
        dist.destroy_process_group()
