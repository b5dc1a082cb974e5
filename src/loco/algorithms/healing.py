"""How the workers come to hold the same state: at the start of a job, and in an elastic job
([`ElasticComm`][loco.comm.membership.ElasticComm]) when a worker joins or falls behind.

At the start every worker's parameters and buffers are broadcast from worker 0 (or only
compared), then their checksums verified (``start_identical``). In an elastic job the first
quorum comes with ``join()``; a worker that joins a running job, or that missed a sync,
receives a live worker's state at the quorum of a sync and takes part in that sync.
Every algorithm holds a [`Healing`][loco.algorithms.healing.Healing] (``algo.healing``):
which sync it is at, and what a worker that is behind receives; and has ``Elastic``'s
methods, which the loop and the elastic ``Comm`` call (``algo.join()``,
``algo.heal_state()``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from loco.algorithms.sharding import WorkerRanks, local
from loco.comm import Comm

INIT_SYNC_MODES = ("broadcast", "verify")
"""How the workers' initial state is made identical (``init_sync`` of ``Algorithm``)."""


def start_identical(model: nn.Module, comm: Comm, ranks: WorkerRanks, mode: str) -> None:
    """Broadcast parameters and buffers from worker 0 (``mode`` ``"broadcast"``), then
    verify their checksums on every worker (and every rank of a worker).

    Args:
        model: this rank's model.
        comm: the communication among the workers.
        ranks: the other ranks of this worker.
        mode: one of ``INIT_SYNC_MODES``.

    Raises:
        RuntimeError: the workers' state differs.
    """
    state = [local(t) for t in model.state_dict(keep_vars=True).values()
             if isinstance(t, torch.Tensor)]
    if mode == "broadcast":
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in state}, key=str):
                same = [t for t in state if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                comm.broadcast(flat, src=0, tag="setup").wait()
                offset = 0
                for t in same:
                    t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
    comm.verify_identical(state, what="initial weights")
    if ranks.inner is not None and not ranks.sharded:  # R ranks hold one replica
        ranks.inner.verify_identical(state, what="initial weights inside a worker")


class Healing:
    """An algorithm's part in an elastic job: the first quorum, which sync it is at, and
    the state a worker that is behind receives from a live one (the counters and the outer
    state: the replica restarts from the global copy).

    Args:
        init_sync: how a fresh job starts identical, one of ``INIT_SYNC_MODES``.

    Raises:
        ValueError: ``init_sync`` is not one of ``INIT_SYNC_MODES``.
    """

    def __init__(self, init_sync: str):
        if init_sync not in INIT_SYNC_MODES:
            raise ValueError(f"init_sync must be one of {INIT_SYNC_MODES} (got {init_sync!r})")
        self.init_sync = init_sync
        self.syncing: tuple | None = None
        """(what, when) of the sync whose quorum this worker is in; a worker that heals
        takes part in the same one."""

    def begin(self, comm: Comm, syncing: tuple) -> bool:
        """Open the quorum of a sync (``comm.begin()``: an elastic Comm's quorum, nothing on
        a fixed one).

        Args:
            comm: the communication among the workers.
            syncing: (what, when) of the sync, the same on every worker.

        Returns:
            Whether this worker was behind and took a live worker's state: it goes on with
            that sync (the algorithm's ``_resume``) instead of starting it.
        """
        self.syncing = syncing
        return comm.begin()

    def join(self, algo: Any) -> bool:
        """Take part in the first quorum of an elastic job (see
        [`Algorithm.join`][loco.algorithms.base.Algorithm.join]).

        Args:
            algo: the algorithm that holds this.

        Returns:
            Whether this worker joined a running job.
        """
        comm = algo.comm
        if not comm.elastic:
            return False
        comm.joining = True
        try:
            deadline = time.monotonic() + getattr(comm, "start_wait", comm.timeout)
            while True:
                if comm.begin():
                    algo._resume()
                    return True
                if _enough_came(algo.ranks, comm, time.monotonic() > deadline):
                    break  # all M, or as many as came within the start wait (>= min_workers)
                time.sleep(0.5)  # the others are still starting
            start_identical(algo.model, comm, algo.ranks, self.init_sync)
            comm.commit(True, record=False)
            return False
        finally:
            comm.joining = False

    def state(self, algo: Any) -> dict:
        """What a worker that is behind receives from ``algo``, at the quorum of a sync:
        the counters and the outer state (copies), and which sync it is.

        Args:
            algo: the algorithm that holds this.
        """
        state = algo.state_dict(tensors=False)
        state["outer"] = {name: flat.clone() for name, (_, flat) in algo.outer_state().items()}
        state["syncing"] = self.syncing
        return state

    @torch.no_grad()
    def load(self, algo: Any, state: dict) -> None:
        """Take a live worker's ``state()``: its counters and outer state; the replica
        restarts from the global copy, the inner optimizer from zero.

        Args:
            algo: the algorithm that holds this.
            state: a dict from ``state()`` of a worker of the same job.
        """
        algo.load_state_dict({k: v for k, v in state.items() if k not in ("outer", "syncing")})
        algo.load_outer_state(state["outer"])
        self.syncing = state["syncing"]
        algo.inner_optimizer.state.clear()
        algo.restart_from_global()


class ReplicaHealing(Healing):
    """Healing where the replica is the global model (data-parallel training): a worker
    that is behind receives the parameters and the inner optimizer's state, with the
    counters."""

    def state(self, algo: Any) -> dict:
        """The whole state of ``algo`` (tensors included), and which sync it is.

        Args:
            algo: the algorithm that holds this.
        """
        return {**algo.state_dict(tensors=True), "syncing": self.syncing}

    @torch.no_grad()
    def load(self, algo: Any, state: dict) -> None:
        """Take a live worker's model, inner optimizer and counters.

        Args:
            algo: the algorithm that holds this.
            state: a dict from ``state()`` of a worker of the same job.
        """
        algo.load_state_dict({k: v for k, v in state.items() if k != "syncing"})
        self.syncing = state["syncing"]


class Elastic:
    """An algorithm's methods in an elastic job (a base of
    [`Algorithm`][loco.algorithms.base.Algorithm], whose ``healing`` they go to), and the two
    hooks a method overrides: ``restart_from_global`` and ``_resume``."""

    def join(self) -> bool:
        """Take part in the first quorum of an elastic job, once, before the first step;
        returns whether this worker joined a running job
        ([`Healing.join`][loco.algorithms.healing.Healing.join])."""
        return self.healing.join(self)

    def heal_state(self) -> dict:
        """What a worker that is behind receives from this one at the quorum of a sync
        ([`Healing.state`][loco.algorithms.healing.Healing.state])."""
        return self.healing.state(self)

    def load_heal_state(self, state: dict) -> None:
        """Take a live worker's ``heal_state()``
        ([`Healing.load`][loco.algorithms.healing.Healing.load]).

        Args:
            state: a dict from ``heal_state()`` of a worker of the same job.
        """
        self.healing.load(self, state)

    def restart_from_global(self) -> None:
        """Set the replica's parameters to the global copy (outer algorithms)."""

    def _resume(self) -> None:
        """Go on with the sync of ``healing.syncing`` after a heal (subclasses)."""


def _enough_came(ranks: WorkerRanks, comm: Comm, my_wait_over: bool) -> bool:
    """Whether the members of this start-up quorum stop waiting for the others: all M
    are here, or any rank's wait is over. Agreed by every rank of every member (one
    integer each, tag ``setup``, inside the worker first): their clocks started apart,
    and a rank that went on waiting alone would ask for a quorum the others never join
    while they broadcast the start."""
    if len(comm.members) == comm.workers:
        return True
    over = torch.tensor([int(my_wait_over)], dtype=torch.int64)
    for c in (ranks.inner, comm):  # (on a GPU: the inner Comm's device differs)
        if c is not None:
            over = max(c.all_gather(over.to(c.device), tag="setup").wait())
    return bool(over)


__all__ = ["INIT_SYNC_MODES", "Elastic", "Healing", "ReplicaHealing", "start_identical"]
