"""Elastic runs: workers that die are restarted alone, and the others keep training.

``launch(fn, workers=M, launcher="processes", elastic=Elastic(...))`` starts torchft's
Lighthouse (the quorum service) in this process and every worker as a process of its own,
with an [`ElasticComm`][loco.comm.elastic.ElasticComm] as ``ctx.comm``. There is no
``torch.distributed`` world spanning the workers: each sync's group is the quorum of the
workers alive then. When a worker process dies, this supervisor restarts that worker only
(up to ``restarts`` times); the restarted process joins at the next sync and receives its
state from a live worker (``Algorithm.join``). The rest never stop.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

log = logging.getLogger("loco.elastic")

HOST_ENV = "LOCO_ELASTIC_HOST"
"""Environment variable: the address the other workers reach this one at, for a worker of
an external Lighthouse's job (default: this machine's host name)."""

RESTART_ENV = "LOCO_WORKER_RESTART"
"""Environment variable holding how many times this worker process was restarted (0 for
the first start); fault injection acts on first starts only."""


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
    """

    min_workers: int | None = None
    restarts: int = 3
    heartbeat_timeout: float = 1.0
    lighthouse: str | None = None
    worker: int | None = None

    def check(self, workers: int) -> int:
        """Validate against M workers; returns the min_workers in effect.

        Args:
            workers: M.

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
        if (self.lighthouse is None) != (self.worker is None):
            raise ValueError("lighthouse and worker go together: this process is worker "
                             f"`worker` of the job of that Lighthouse (got lighthouse="
                             f"{self.lighthouse!r}, worker={self.worker!r})")
        if self.worker is not None and not 0 <= self.worker < workers:
            raise ValueError(f"worker must be in [0, workers={workers}) (got {self.worker!r})")
        return need


def launch_elastic(fn: Callable[..., Any], args: tuple, workers: int, timeout: float,
                   spec: Elastic, link: Any = None) -> list:
    """Run ``fn(ctx, *args)`` on M worker processes with elastic membership (see the module).

    Args:
        fn: the worker function (picklable).
        args: its positional arguments after ``ctx``.
        workers: M.
        timeout: seconds any wait of a worker may last.
        spec: the [`Elastic`][loco.runtime.elastic.Elastic] options.
        link: an emulated slow link ([`LinkSpec`][loco.comm.link.LinkSpec]) or None.

    Returns:
        Each worker's return value, in worker order; None for a worker that was lost for
            good (it died more than ``restarts`` times).

    Raises:
        WorkerError: a worker raised an exception (it is not restarted: it would raise
            again; the others finish first), or every worker was lost.
    """
    from loco.comm.elastic import start_lighthouse
    from loco.runtime.launch import WorkerError

    min_workers = spec.check(workers)
    lighthouse = start_lighthouse(min_workers, spec.heartbeat_timeout,
                                  join_timeout=timeout)
    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    job_over = ctx.Event()  # set when a worker finished: one still joining then stops
    job = (fn, args, workers, lighthouse.address(), min_workers, timeout, link, job_over)
    procs = {w: _start(ctx, job, w, 0, results) for w in range(workers)}
    restarts = dict.fromkeys(range(workers), 0)
    done: dict[int, Any] = {}
    raised: dict[int, str] = {}  # a worker that raised is not restarted: it would again
    lost: dict[int, str] = {}
    try:
        while len(done) + len(raised) + len(lost) < workers:
            _collect(results, done, raised)
            if done and not job_over.is_set():
                job_over.set()
            for w, p in list(procs.items()):
                if w in done or w in raised or w in lost or p.is_alive():
                    continue
                _collect(results, done, raised, wait=1.0)  # a result still in the pipe
                if w in done or w in raised:
                    continue
                if restarts[w] < spec.restarts:
                    restarts[w] += 1
                    log.warning("elastic: worker %d died (exit code %s); restart %d of %d",
                                w, p.exitcode, restarts[w], spec.restarts)
                    procs[w] = _start(ctx, job, w, restarts[w], results)
                else:
                    lost[w] = f"died {restarts[w] + 1} times (exit code {p.exitcode})"
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    if raised:
        w = min(raised)
        raise WorkerError(f"worker {w} failed:\n{raised[w]}")
    if not done:
        raise WorkerError("every worker of the elastic run was lost: " + "; ".join(
            f"worker {w} {e}" for w, e in sorted(lost.items())))
    return [done.get(w) for w in range(workers)]


def _start(ctx, job: tuple, worker: int, restart: int, results) -> Any:
    p = ctx.Process(target=_entry, args=(*job, worker, restart, results),
                    name=f"loco-worker-{worker}", daemon=True)
    p.start()
    return p


def _collect(results, done: dict, errors: dict, wait: float = 0.0) -> None:
    while True:
        try:
            worker, ok, value = results.get(timeout=wait) if wait else results.get_nowait()
        except queue.Empty:
            return
        if ok:
            done[worker] = pickle.loads(value)
        else:
            errors[worker] = value
        wait = 0.0


def _too_late(job_over, comm, worker: int, results) -> None:
    """Once a worker has finished the job, one still waiting for a quorum (restarted too
    late to rejoin: no quorum will come) exits cleanly, its result None."""
    # Polled, not waited on: a process that exits while waiting on a multiprocessing Event
    # leaves it a sleeper that the setter would wait for forever.
    while not (job_over.is_set() and comm.waiting):
        time.sleep(0.2)
    print(f"[loco] worker {worker}: the job finished while it waited to join", flush=True)
    results.put((worker, True, pickle.dumps(None)))
    time.sleep(0.5)  # the queue's feeder thread hands the result over
    os._exit(0)


def run_worker(fn: Callable[..., Any], args: tuple, workers: int, timeout: float,
               spec: Elastic, link: Any = None, launcher: str = "processes") -> Any:
    """Run ``fn(ctx, *args)`` as worker ``spec.worker`` of the elastic job whose Lighthouse
    runs at ``spec.lighthouse`` (``launch`` with ``Elastic(lighthouse=..., worker=...)``).

    Args:
        fn: the worker function.
        args: its positional arguments after ``ctx``.
        workers: M.
        timeout: seconds any wait may last.
        spec: the [`Elastic`][loco.runtime.elastic.Elastic] options, with ``lighthouse``
            and ``worker``.
        link: an emulated slow link ([`LinkSpec`][loco.comm.link.LinkSpec]) or None.
        launcher: what ``ctx.launcher`` says; default ``"processes"``.

    Returns:
        ``fn``'s return value.
    """
    # The address the other workers reach this one at (its torchft servers, its store, its
    # gloo pairs): LOCO_ELASTIC_HOST, or this machine's name.
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    comm = _comm(spec.worker, workers, spec.lighthouse, spec.check(workers), timeout, link,
                 host)
    try:
        return fn(_context(comm, launcher), *args)
    finally:
        comm.close()


def _comm(worker: int, workers: int, lighthouse: str, min_workers: int, timeout: float,
          link: Any, host: str = "127.0.0.1"):
    from loco.comm.elastic import ElasticComm
    from loco.runtime.launch import _emulated

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers: no line per quorum
    return ElasticComm(worker, workers, lighthouse, min_workers, timeout, host=host,
                       link=_emulated(link))


def _context(comm, launcher: str):
    from loco.runtime.launch import Mesh, WorkerContext

    return WorkerContext(comm.worker, comm.workers, Mesh(comm.workers, 1, 1), comm,
                         torch.device("cpu"), launcher)


def _entry(fn, args, workers, lighthouse, min_workers, timeout, link, job_over, worker,
           restart, results) -> None:
    """A worker process: its ElasticComm and context, then ``fn``; the result (or the
    traceback) goes back through ``results``."""
    os.environ[RESTART_ENV] = str(restart)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    comm = _comm(worker, workers, lighthouse, min_workers, timeout, link)
    threading.Thread(target=_too_late, args=(job_over, comm, worker, results), daemon=True,
                     name="loco-job-over").start()
    try:
        value = fn(_context(comm, "processes"), *args)
        # By value: a queue would pass tensors as shared memory this process must outlive.
        results.put((worker, True, pickle.dumps(value)))
    except BaseException:
        trace = traceback.format_exc()
        print(f"[loco] worker {worker} failed:\n{trace}", flush=True)
        results.put((worker, False, trace))
        raise SystemExit(1) from None
    finally:
        comm.close()


def recovery_report(events: list[dict], syncs: list[dict], workers: int) -> dict:
    """What an elastic run's membership did, from one worker's
    [`ElasticComm`][loco.comm.elastic.ElasticComm] records (their times are seconds since
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


__all__ = ["Elastic", "HOST_ENV", "RESTART_ENV", "launch_elastic", "recovery_report", "run_worker"]
