"""Run one function on every rank: as threads, as local processes, or under torchrun.

``launch(fn, mesh=Mesh(workers=M, stages=S, worker_ranks=R))`` calls ``fn(ctx, *args)`` on
each of the M · S · R ranks and returns their return values in rank order. ``ctx`` is the
rank's [`RankContext`][loco.runtime.context.RankContext]: its place in the
[`Mesh`][loco.runtime.context.Mesh], rank = (worker · S + stage) · R + worker_rank, and its
Comms:

* ``ctx.comm``, over the M ranks that hold the same stage and worker rank in every worker
  (its rank there is the worker index): what the outer algorithm talks through (the slow
  link);
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
from loco.lazy import renamed, renamed_arguments
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
from loco.runtime.elastic import Elastic, launch_elastic, run_worker
from loco.runtime.starter import (START_METHOD, adopt_environment, context, cpu_threads,
                                  thread_ranks_core)
from loco.runtime.vitals import DIR_ENV, death_note, read_vitals

LAUNCHERS = ("threads", "processes", "torchrun")
"""How the ranks run: threads of this process, local processes, or ranks of torchrun."""
DEFAULT_TIMEOUT = 300.0
"""Seconds a communication may take before it fails (``timeout`` of ``launch``)."""


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (from its environment variables
    ``TORCHELASTIC_RUN_ID`` and ``RANK``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@renamed_arguments("launch", {"workers": "ranks", "shards": "worker_ranks",
                               "ranks_per_replica": "stages"})
def launch(fn: Callable[..., Any], ranks: int | None = None, launcher: str = "threads", *,
           mesh: Mesh | None = None, stages: int | None = None, worker_ranks: int | None = None,
           args: tuple = (), kwargs: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
           max_restarts: int = 0, link: LinkSpec | None = None,
           fast_link: LinkSpec | None = None, elastic: Elastic | None = None,
           replicas: int | None = None) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order.

    The run has M workers of S pipeline stages of R ranks each: M · S · R ranks, laid out by
    ``mesh``, or by the count of ``ranks`` split into workers of ``stages`` × ``worker_ranks``.
    Under torchrun (detected from the environment, whatever ``launcher`` says) this process
    is one rank: it runs ``fn`` once and returns a one-item list.

    Args:
        fn: the function each rank runs; its first argument is the rank's
            [`RankContext`][loco.runtime.context.RankContext]. Must be picklable (a
            module-level function) for the ``"processes"`` launcher.
        ranks: all ranks, M · S · R, >= 1 and a multiple of S · R; not with ``mesh``.
            Default None: the mesh's, or without one two ranks. Under torchrun it must equal
            torchrun's world size, unless ``launcher`` is ``"torchrun"`` (then the world
            size is torchrun's).
        launcher: ``"threads"`` (default: threads of this process on gloo over loopback),
            ``"processes"`` (local processes by torch elastic) or ``"torchrun"`` (only valid
            in a process torchrun started).
        mesh: the layout, [`Mesh`][loco.runtime.context.Mesh]``(workers=M, stages=S,
            worker_ranks=R)``; default None: from the counts.
        stages: S, the pipeline stages of each worker, >= 1; default None: 1. Not with
            ``mesh``.
        worker_ranks: R, the ranks that share each stage of a worker, joined by its fast
            link (``ctx.inner``), >= 1; default None: 1. Not yet with pipeline stages
            (S > 1); not with ``mesh``.
        args: positional arguments passed to ``fn`` after the context; default none.
        kwargs: keyword arguments passed to ``fn``; default none.
        timeout: seconds a communication may take before it fails instead of hanging;
            default 300.
        max_restarts: ``"processes"`` only: how many times torch elastic restarts all
            ranks after one died; default 0. Apart from these, ranks that all fail before
            any reached ``fn`` (while connecting) are started again once.
        link: an emulated link of that bandwidth and latency for every rank, shared by all
            its communication but ``ctx.inner`` (see [`LinkSpec`][loco.comm.link.LinkSpec]);
            default None (the transport's own speed).
        fast_link: an emulated link of that bandwidth and latency for every rank's
            ``ctx.inner``, the fast link inside a worker, apart from ``link``; default None
            (the transport's own speed).
        elastic: run with elastic membership ([`Elastic`][loco.runtime.elastic.Elastic]):
            workers of R ranks each (S = 1), under ``"processes"``; a worker that dies is
            restarted alone (all its ranks) and the others keep training (see
            [`launch_elastic`][loco.runtime.elastic.launch_elastic]). Default None: a fixed
            membership.
        replicas: the old name of M; use ``mesh=Mesh(M, ...)`` (or ``ranks``). Read for one
            release with a ``DeprecationWarning``, as are ``workers`` (the old name of
            ``ranks``, all ranks), ``shards`` (of ``worker_ranks``) and
            ``ranks_per_replica`` (of ``stages``).

    Returns:
        ``fn``'s return value of every rank, in rank order (under torchrun: this rank's
            only).

    Raises:
        ValueError: an unknown ``launcher``, a count below 1, ``ranks`` not a multiple of
            S · R, R > 1 with S > 1, or ``"torchrun"`` outside torchrun.
        TypeError: a layout given twice (``mesh`` with a count, a count by both its name and
            its old name).
        WorkerError: a rank raised (its traceback is in the message); under torchrun
            the rank's own exception propagates instead.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (got {launcher!r})")
    mesh = _layout(ranks, mesh, stages, worker_ranks, replicas)
    if mesh.worker_ranks > 1 and mesh.stages > 1:
        raise ValueError("worker_ranks > 1 with pipeline stages (stages > 1) is not supported "
                         "yet; use one or the other")
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    links = (link, fast_link)
    if elastic is not None:
        return _launch_elastic(fn, args, mesh, launcher, timeout, elastic, links)
    if launcher == "torchrun" and not under_torchrun():
        raise ValueError("launcher 'torchrun' needs a process started by torchrun "
                         "(its RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID are missing)")
    if under_torchrun():
        share_cores()
        return [_run_from_env(fn, args, mesh.world_size if launcher != "torchrun" else None,
                              mesh.stages, mesh.worker_ranks, timeout, "torchrun", links)]
    if launcher == "threads":
        return _launch_threads(fn, args, mesh, timeout, links)
    return _launch_processes(fn, args, mesh, timeout, max_restarts, links)


def _layout(ranks: int | None, mesh: Mesh | None, stages: int | None,
            worker_ranks: int | None, replicas: int | None) -> Mesh:
    """The run's mesh from ``launch``'s arguments, checked: ``mesh`` itself, or ``ranks``
    (default 2) split into workers of ``stages`` × ``worker_ranks`` ranks; ``replicas``, the
    old name of M, with a DeprecationWarning."""
    if replicas is not None:
        renamed("launch(replicas=M)", "launch(mesh=Mesh(workers=M, ...))", stacklevel=5)
        if mesh is not None or ranks is not None:
            raise TypeError("give mesh, ranks or replicas (the old name of M), not both")
        mesh = Mesh(replicas, 1 if stages is None else stages,
                    1 if worker_ranks is None else worker_ranks)
        stages = worker_ranks = None
    if mesh is not None:
        if ranks is not None or stages is not None or worker_ranks is not None:
            raise TypeError("give mesh or the counts (ranks, stages, worker_ranks), not both")
        for name, n in zip(("workers", "stages", "worker_ranks"), mesh.shape):
            if n < 1:
                raise ValueError(f"{name} must be >= 1 (got {n})")
        return mesh
    ranks = 2 if ranks is None else ranks
    stages = 1 if stages is None else stages
    worker_ranks = 1 if worker_ranks is None else worker_ranks
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1 (got {ranks})")
    if stages < 1 or ranks % stages:
        raise ValueError(f"ranks ({ranks}) must be a multiple of stages ({stages}): "
                         "workers x pipeline stages")
    if worker_ranks < 1 or ranks % (stages * worker_ranks):
        raise ValueError(f"ranks ({ranks}) must be a multiple of stages x worker_ranks "
                         f"({stages} x {worker_ranks}): workers x stages x worker ranks")
    return Mesh(ranks // (stages * worker_ranks), stages, worker_ranks)


def _launch_elastic(fn, args, mesh: Mesh, launcher: str, timeout: float, spec: Elastic,
                    links: tuple) -> list:
    """An elastic run: every worker as local processes (``spec.lighthouse`` None), or this
    process as (one rank of) one worker (under torchrun, or started by hand)."""
    if mesh.stages > 1:
        raise ValueError("elastic membership runs without pipeline stages "
                         "(stages must be 1) for now")
    if spec.lighthouse is not None:
        spec.check(mesh.workers)
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
        r = mesh.worker_ranks
        if world != r:
            raise ValueError(f"an elastic worker of {r} rank(s) is one torchrun job "
                             f"of {r} process(es) (--nproc-per-node {r}), "
                             "one job per worker, each with its --worker-index (got a world "
                             f"of {world})")
        return [run_worker(fn, args, mesh.workers, timeout, spec, links,
                           "torchrun" if under_torchrun() else "processes", mesh.worker_ranks)]
    if launcher != "processes" or under_torchrun():
        raise ValueError("elastic membership starts its workers under the 'processes' "
                         "launcher; under torchrun give the Lighthouse's address and each "
                         "job's worker index (Elastic(lighthouse=..., worker=...))")
    return launch_elastic(fn, args, mesh.workers, timeout, spec, links, mesh.worker_ranks)


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
                    failed: threading.Event) -> RankContext:
    """One thread rank's context: its gloo groups on the shared ``store`` and their Comms,
    all stopped by ``failed``."""
    worker, stage = mesh.coords(rank)
    index = mesh.worker_rank_of(rank)
    n = mesh.world_size
    group = _gloo_group(dist.PrefixStore(f"loco/outer/{stage}/{index}", store),
                        worker, mesh.workers, timeout, loopback=True)
    wire = emulated(links[0])  # this rank's slow link
    comm = Comm(group, worker, mesh.workers, "cpu", abort_event=failed, link=wire)
    inner = None
    if mesh.worker_ranks > 1:  # the worker's fast link
        inner_group = _gloo_group(dist.PrefixStore(f"loco/inner/{worker}/{stage}", store),
                                  index, mesh.worker_ranks, timeout, loopback=True)
        inner = Comm(inner_group, index, mesh.worker_ranks, "cpu", name="inner",
                     abort_event=failed, link=emulated(links[1]))
    pipe = None
    if mesh.stages > 1:
        pipe_group = _gloo_group(dist.PrefixStore("loco/pipe", store), rank, n, timeout,
                                 loopback=True)
        pipe = Comm(pipe_group, rank, n, "cpu", name="pipe", abort_event=failed, link=wire)
    return RankContext(rank, n, mesh, comm, torch.device("cpu"), "threads", pipe=pipe,
                       inner=inner)


def _launch_threads(fn, args, mesh: Mesh, timeout: float, links: tuple) -> list:
    """The ranks as threads of this process. A launch whose ranks all fail before any
    reaches ``fn`` (while their gloo groups connect) starts them again, once, as the
    processes launcher does; ``fn`` itself never runs twice."""
    for attempt in range(2):
        results, errors, reached = _threads_once(fn, args, mesh, timeout, links)
        if not errors:
            return results
        error = _first_cause(errors)
        if attempt or reached:
            raise error
        _starting_again(error)


def _first_cause(errors: list[tuple[int, BaseException, str]]) -> WorkerError:
    """The WorkerError for a threads launch's errors (in the order they happened): the first
    worker that failed on its own; the rest were stopped."""
    rank, error, trace = next((e for e in errors if not isinstance(e[1], Aborted)), errors[0])
    if getattr(error, "brief", False):  # an expected failure: its message says it all
        return WorkerError(str(error))
    return WorkerError(f"worker {rank} failed:\n{trace}")


def _starting_again(error: BaseException) -> None:
    print(f"[loco] the ranks failed while connecting ({error}); starting them again, once",
          file=sys.stderr, flush=True)


def _threads_once(fn, args, mesh: Mesh, timeout: float, links: tuple):
    """One threads launch: (results, errors in the order they happened, whether any rank
    reached ``fn``)."""
    store = dist.HashStore()
    n = mesh.world_size
    results: list = [None] * n
    errors: list[tuple[int, BaseException, str]] = []  # in the order they happened
    reached: list[int] = []
    failed = threading.Event()  # shared by every worker's Comm: a failure stops them all

    # One intra-op thread per worker when workers outnumber cores: more only oversubscribes.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(n))
    core = thread_ranks_core()

    def body(rank: int):
        if core is not None:  # the threads it starts (Comm, gloo's) stay there too
            os.sched_setaffinity(0, {core})
        try:
            ctx = _thread_context(rank, mesh, store, timeout, links, failed)
            reached.append(rank)
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
    return results, errors, bool(reached)


# ----------------------------------------------------------------------------- processes
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
                    dict(os.environ), fn, args, mesh.stages, mesh.worker_ranks, timeout, links,
                    started)
                return [out[r] for r in sorted(out)]
            except ChildFailedError as e:
                error = _worker_error(e)
                if attempt or os.listdir(started):
                    raise error from None
        _starting_again(error)


def _elastic_agent(mesh: Mesh, max_restarts: int):
    """torch elastic's launcher of ``_process_entry`` on this machine, for one launch. Its
    rendezvous store binds port 0, a port the kernel picks as it binds: one picked free
    beforehand could be taken by another process before the agent binds it."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=mesh.world_size,
        run_id=f"loco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
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
    offloaded outer step or a codec on the CPU to one core whatever the machine has
    (``$LOCO_CPU_THREADS`` instead when set: `cpu_threads`)."""
    torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _process_entry(env: dict, fn, args, stages: int, worker_ranks: int, timeout: float,
                   links: tuple, started: str):
    adopt_environment(env)
    share_cores()
    return _run_from_env(fn, args, int(os.environ["WORLD_SIZE"]), stages, worker_ranks, timeout,
                         "processes", links, started)


def _run_from_env(fn, args, asked: int | None, stages: int, worker_ranks: int, timeout: float,
                  launcher: str, links: tuple, started: str | None = None):
    """This process as one rank of a torch.distributed world from the environment; ``asked``:
    the ranks the caller expects (None: whatever the world is); ``started``: a directory
    where the rank leaves a file once it is connected, before it calls ``fn``."""
    world = int(os.environ["WORLD_SIZE"])
    if asked is not None and asked != world:
        raise ValueError(f"{asked} ranks asked for (--workers x --worker-ranks x --stages) "
                         f"but torchrun started {world}; leave --workers out or make them agree")
    if world % (stages * worker_ranks):
        raise ValueError(f"torchrun's {world} ranks do not split into workers of "
                         f"{stages} stage(s) x {worker_ranks} rank(s) (--stages x "
                         "--worker-ranks must divide the world size)")
    rank = int(os.environ["RANK"])
    device = rank_device(launcher)
    use_cuda = device.type == "cuda"
    mesh = Mesh(world // (stages * worker_ranks), stages, worker_ranks)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=attempt_store(rank, world,
                                                                               timeout),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout),
                            **({"device_id": device} if use_cuda else {}))
    try:
        worker = mesh.coords(rank)[0]
        # Every rank creates every group of every dimension, in the same order.
        device_mesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=MESH_DIMS)
        group = device_mesh.get_group("replica")  # this stage and worker rank in every worker
        wire = emulated(links[0])  # this rank's slow link
        # NCCL: one thread issues every operation of this rank, in one order (CommThread).
        thread = CommThread(f"loco-comm-{rank}") if use_cuda else None
        comm = Comm(group, worker, mesh.workers, device, link=wire, thread=thread)
        # Stages talk point to point over the default group, in global ranks.
        pipe = (Comm(dist.group.WORLD, rank, world, device, name="pipe", link=wire,
                     thread=thread) if stages > 1 else None)
        inner, checkpoint_group = worker_comms(mesh, rank, device, links[1], thread)
        ctx = RankContext(rank, world, mesh, comm, device, launcher, pipe=pipe, inner=inner,
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
