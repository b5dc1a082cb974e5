"""What one rank of a run knows, and the pieces every launcher builds it from.

A run's ranks form a mesh of M workers × S pipeline stages × R ranks per worker (and
stage): [`Mesh`][loco.runtime.context.Mesh] lays them out and
[`RankContext`][loco.runtime.context.RankContext] is one rank's view of it, handed to the
function every rank runs. The fixed launchers ([`launch`][loco.runtime.launch.launch]) and the
elastic one (``loco.runtime.elastic``) share the rest: the rendezvous store of a torch elastic
attempt, the emulated links, and the fast-link Comm over a worker's R ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loco.comm import Comm
from loco.comm.link import EmulatedLink, LinkSpec
from loco.comm.thread import CommThread
from loco.lazy import old_attribute, old_names, renamed, renamed_arguments

MESH_DIMS = ("replica", "stage", "shard")
"""The named dimensions of a run's ``DeviceMesh``, outermost first, in FSDP's words
(``device_mesh["shard"]`` is what FSDP2 shards over): the M workers of the outer algorithm
(``"replica"``), the S pipeline stages of a worker, and the R ranks that share one stage of
one worker, its fast-link group (``"shard"``)."""

_OLD_MESH = {"replicas": "workers", "shards": "worker_ranks"}
"""``Mesh``'s old names, read for one release."""


@dataclass(frozen=True)
class Mesh:
    """Ranks laid out as ``workers × stages × worker_ranks``:
    rank = (worker · S + stage) · R + worker_rank, so the ranks of one worker's stage are
    adjacent (on one node where possible).

    Args:
        workers: M, the workers of the outer algorithm, >= 1.
        stages: S, the pipeline stages of each worker, >= 1; default 1.
        worker_ranks: R, the ranks that share each stage of a worker and talk over its fast
            link (``ctx.inner``), >= 1; default 1.

    ``replicas`` and ``shards``, the old names of ``workers`` and ``worker_ranks`` (keywords
    and attributes), still work for one release, with a ``DeprecationWarning``.
    """

    workers: int
    stages: int = 1
    worker_ranks: int = 1

    @property
    def world_size(self) -> int:
        """All ranks: M · S · R."""
        return self.workers * self.stages * self.worker_ranks

    @property
    def shape(self) -> tuple[int, int, int]:
        """(M, S, R): the sizes of ``MESH_DIMS``."""
        return (self.workers, self.stages, self.worker_ranks)

    def coords(self, rank: int) -> tuple[int, int]:
        """(worker, stage) of a global rank.

        Args:
            rank: a global rank, in [0, world_size).
        """
        return divmod(rank // self.worker_ranks, self.stages)

    def worker_rank_of(self, rank: int) -> int:
        """The rank's index among the ranks of its worker's stage, in [0, R).

        Args:
            rank: a global rank, in [0, world_size).
        """
        return rank % self.worker_ranks

    def outer_peers(self, stage: int, worker_rank: int = 0) -> list[int]:
        """Global ranks that hold the same place in every worker: the outer group (the
        slow link), in worker order.

        Args:
            stage: the pipeline stage, in [0, S).
            worker_rank: the index among the stage's ranks, in [0, R); default 0.
        """
        return [self.rank_of(w, stage, worker_rank) for w in range(self.workers)]

    def worker_peers(self, worker: int, stage: int) -> list[int]:
        """Global ranks of one stage of one worker: its fast-link group, in worker-rank
        order.

        Args:
            worker: the worker, in [0, M).
            stage: the pipeline stage, in [0, S).
        """
        return [self.rank_of(worker, stage, k) for k in range(self.worker_ranks)]

    def rank_of(self, worker: int, stage: int, worker_rank: int = 0) -> int:
        """Global rank of pipeline stage ``stage`` of ``worker``.

        Args:
            worker: the worker, in [0, M).
            stage: the pipeline stage, in [0, S).
            worker_rank: the index among the stage's ranks, in [0, R); default 0.
        """
        return (worker * self.stages + stage) * self.worker_ranks + worker_rank

    replicas = old_attribute("Mesh.replicas", "Mesh.workers", "workers")

    shards = old_attribute("Mesh.shards", "Mesh.worker_ranks", "worker_ranks")

    def shard_of(self, rank: int) -> int:
        """The old name of ``worker_rank_of``, for one release.

        Args:
            rank: a global rank, in [0, world_size).
        """
        renamed("Mesh.shard_of", "Mesh.worker_rank_of")
        return self.worker_rank_of(rank)

    def replica_peers(self, stage: int, shard: int = 0) -> list[int]:
        """The old name of ``outer_peers``, for one release.

        Args:
            stage: the pipeline stage, in [0, S).
            shard: the old name of ``worker_rank``, in [0, R); default 0.
        """
        renamed("Mesh.replica_peers", "Mesh.outer_peers")
        return self.outer_peers(stage, shard)


Mesh.__init__ = renamed_arguments("Mesh", _OLD_MESH)(Mesh.__init__)


@dataclass
class RankContext:
    """What one rank knows about the run; [`launch`][loco.runtime.launch.launch] passes it to
    the function as its first argument. (Its old name ``WorkerContext`` still imports, for
    one release, with a ``DeprecationWarning``; so do the old names of its properties:
    ``replica``, ``shard``, ``replicas``, ``shards``.)

    Args:
        rank: this rank's global rank, in [0, world_size).
        world_size: all ranks of the run, M · S · R.
        mesh: the layout of the ranks.
        comm: the [`Comm`][loco.comm.comm.Comm] over the workers of this rank's stage
            (its rank there is the worker index): what the outer algorithm talks through.
        device: this rank's device (a CUDA device under torchrun with GPUs, else CPU).
        launcher: how it was started: ``"threads"``, ``"processes"`` or ``"torchrun"``.
        extras: free room for the caller's own per-rank values; default empty.
        pipe: a Comm over the whole world (rank there = global rank) for the traffic
            between pipeline stages; None (default) when S = 1.
        inner: a Comm over the R ranks of this worker's stage (rank there = the worker
            rank), the fast link inside a worker, shaped only by ``launch``'s
            ``fast_link``; None (default) when R = 1.
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
    pipe: Comm | None = None
    inner: Comm | None = None
    device_mesh: Any = None
    checkpoint_group: Any = None

    @property
    def worker(self) -> int:
        """The worker this rank belongs to (its rank in ``comm``), in [0, M)."""
        return self.mesh.coords(self.rank)[0]

    @property
    def stage(self) -> int:
        """Pipeline stage of this rank (its position inside the worker), in [0, S)."""
        return self.mesh.coords(self.rank)[1]

    @property
    def worker_rank(self) -> int:
        """This rank's index among the ranks of its worker's stage (its rank in ``inner``),
        in [0, R)."""
        return self.mesh.worker_rank_of(self.rank)

    @property
    def workers(self) -> int:
        """M, the workers of the run."""
        return self.mesh.workers

    @property
    def stages(self) -> int:
        """S, the pipeline stages of every worker."""
        return self.mesh.stages

    @property
    def worker_ranks(self) -> int:
        """R, the ranks of each stage of a worker."""
        return self.mesh.worker_ranks

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0."""
        return self.rank == 0

    replica = old_attribute("ctx.replica", "ctx.worker", "worker")

    shard = old_attribute("ctx.shard", "ctx.worker_rank", "worker_rank")

    replicas = old_attribute("ctx.replicas", "ctx.workers", "workers")

    shards = old_attribute("ctx.shards", "ctx.worker_ranks", "worker_ranks")


class WorkerError(RuntimeError):
    """A worker raised; the message names the worker and carries its traceback.

    [`launch`][loco.runtime.launch.launch] raises it for the first worker that failed on
    its own (not for those stopped because of it).
    """


def emulated(spec: LinkSpec | None) -> EmulatedLink | None:
    """A rank's emulated link of that speed, or None for the transport's own.

    Args:
        spec: the link's bandwidth and latency, or None.
    """
    return EmulatedLink(spec) if spec is not None else None


def attempt_store(rank: int, world: int, timeout: float) -> dist.Store:
    """The rendezvous store of torch elastic's environment (``MASTER_ADDR``,
    ``MASTER_PORT``), under a prefix of its own for each restart
    (``TORCHELASTIC_RESTART_COUNT``): after a worker died, the store still holds the dead
    attempt's addresses, which a restarted group must not read.

    Args:
        rank: this process's rank in the store's world; rank 0 hosts it unless torch
            elastic's agent does.
        world: the processes that share the store.
        timeout: seconds a wait on the store may last.
    """
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
    for worker in range(mesh.workers):
        for stage in range(mesh.stages):
            ranks = mesh.worker_peers(worker, stage)
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine = group
    return mine


def rank_device(launcher: str) -> torch.device:
    """This rank's device: under torchrun with CUDA present, the GPU of ``LOCAL_RANK`` (made
    the current device); otherwise the CPU (the threads and processes launchers).

    Args:
        launcher: ``"threads"``, ``"processes"`` or ``"torchrun"``.
    """
    if launcher != "torchrun" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def worker_comms(mesh: Mesh, rank: int, device: torch.device, fast_link: LinkSpec | None,
                 thread: CommThread | None = None) -> tuple:
    """The fast-link Comm over this rank's worker (its R ranks) and a gloo group of the same
    ranks for checkpoints; (None, None) for workers of one rank. Collective over the default
    process group: every rank calls it.

    Args:
        mesh: the run's layout.
        rank: this rank's global rank.
        device: the Comm's device.
        fast_link: the emulated fast link, or None.
        thread: the rank's communication thread, shared with its other Comms (NCCL); None
            for the Comm's own.
    """
    if mesh.worker_ranks == 1:
        return None, None
    inner = Comm(_worker_group(mesh, rank), mesh.worker_rank_of(rank), mesh.worker_ranks, device,
                 name="inner", link=emulated(fast_link), thread=thread)
    return inner, _worker_group(mesh, rank, "gloo")


__all__ = ["MESH_DIMS", "Mesh", "RankContext", "WorkerError", "attempt_store", "emulated",
           "rank_device", "worker_comms"]

__getattr__ = old_names(__name__, {"WorkerContext": "RankContext"})
