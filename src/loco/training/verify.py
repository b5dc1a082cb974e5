"""The replica check in the training loop (``--verify-every K``): every K rounds of H inner
steps, at the step a checkpoint would be taken (no sync in flight anywhere), the workers
compare a digest of their replicated state and heal a worker whose copy drifted
([`check_replicas`][loco.algorithms.replicas.check_replicas]); the lead rank's summary
records what was found (``replicas_verified``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from loco.algorithms.replicas import TAG, ReplicasDisagree, check_replicas
from loco.comm.handles import Aborted
from loco.comm.hostreads import allowed
from loco.training.worker import Loop, Rank

log = logging.getLogger("loco")


@dataclass
class ReplicaChecks:
    """One rank's record of the replica checks of this run (``Loop.replica_checks``).

    Args:
        every: K, rounds of H inner steps between two checks (``--verify-every``).
        checks: checks made.
        differed: the checks that named workers: ``step``, ``workers``, ``healed_from``.
        skipped: checks of an elastic run left out because a member was lost during them.
        seconds: time the checks took, healing included.
    """

    every: int
    checks: int = 0
    differed: list[dict] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0


def verify_due(cfg, step: int, elastic_gap: int | None = None) -> bool:
    """Whether the replicas are checked after ``step``: at the end of every K-th round of H
    steps, once the syncs a round's end leaves in flight are applied (the step a checkpoint
    would be taken at, ``Method.checkpoint_delay``); never with K = 0.

    In an elastic run a restarted worker joins at a sync's quorum (its send, or a retry when
    it is applied) and trains from the next step on: the check is one step later, where no
    quorum is held, and only if the next sync is sent after that step.

    Args:
        cfg: the run's resolved configuration (``verify_every``, ``sync_every``).
        step: the inner step just trained.
        elastic_gap: in an elastic run, the inner steps from a round's end to the next sync
            sent (H / P); default None: a fixed membership.
    """
    if not cfg.trust.verify_every:
        return False
    delay = cfg.method_class.checkpoint_delay(cfg)
    if elastic_gap is not None:
        delay += 1
        if elastic_gap <= delay:
            return False
    rounds, rest = divmod(step - delay, cfg.method.sync_every)
    return step > delay and rest == 0 and rounds % cfg.trust.verify_every == 0


def elastic_gap(w: Rank) -> int | None:
    """``verify_due``'s ``elastic_gap`` for this run: None for a fixed membership; H / P for
    an elastic method with a global copy; 0 (never checked) for one that syncs every step
    (DataParallel: a worker may join at any step)."""
    if not w.ctx.comm.elastic:
        return None
    if not w.cfg.method_class.global_copy:
        return 0
    return w.cfg.method.sync_every // len(w.algo.fragment_list)


def checked(w: Rank) -> bool:
    """Whether this run checks its replicas at all: K > 0, a method with replicated state
    and, in an elastic run, a step to check at."""
    return (bool(w.cfg.trust.verify_every) and bool(w.algo.replicated_tensors())
            and elastic_gap(w) != 0)


def verify_if_due(w: Rank, loop: Loop, step: int) -> None:
    """Check the replicas after ``step`` if it is due (``verify_due``) and the method has
    replicated state; record the verdict in ``loop.replica_checks``.

    Raises:
        ReplicasDisagree: no strict majority of the workers agrees (the run stops).
    """
    if not verify_due(w.cfg, step, elastic_gap(w)) or not w.algo.replicated_tensors():
        return
    assert not w.algo.sync_in_flight, "a sync is in flight"
    checks = loop.replica_checks = loop.replica_checks or ReplicaChecks(w.cfg.trust.verify_every)
    t0 = time.perf_counter()
    try:
        with allowed("verify"):  # a few numbers read once per check
            verdict = check_replicas(w.algo, w.ctx.comm, step, (w.ctx.inner, w.ctx.pipe))
    except (Aborted, ReplicasDisagree):
        raise
    except Exception as e:  # noqa: BLE001 - elastic: a member lost; the next sync's quorum
        if not w.ctx.comm.elastic:  # drops it, the next check sees the others
            raise
        log.warning("step %d: the replica check was left out: %s", step, e)
        checks.skipped += 1
        return
    finally:
        checks.seconds += time.perf_counter() - t0
    checks.checks += 1
    if not verdict.agree:
        checks.differed.append(verdict.as_dict())
        if w.main:
            log.warning("step %d: the replicated state of worker(s) %s differed from the "
                        "majority's; healed from worker %d", step, verdict.workers,
                        verdict.healed_from)


def replicas_verified(w: Rank, loop: Loop) -> dict | None:
    """The summary's ``replicas_verified``: ``every`` (K), ``checks``, ``differed`` (each
    check that named workers), ``skipped``, the ``bytes_sent`` of this rank's checks (tag
    ``verify``) and their ``seconds``; None when nothing is checked (``checked``).

    Args:
        w: the lead rank's worker.
        loop: its loop's running values.
    """
    if not checked(w):
        return None
    checks = loop.replica_checks or ReplicaChecks(w.cfg.trust.verify_every)
    return {"every": checks.every, "checks": checks.checks, "differed": list(checks.differed),
            "skipped": checks.skipped, "bytes_sent": w.ctx.comm.totals(TAG).sent_bytes,
            "seconds": checks.seconds}
