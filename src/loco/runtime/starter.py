"""How the local launchers start rank processes: forked from a server that imported torch once.

A spawned process imports torch and loco afresh (about 1.5 s of CPU each, several seconds
when the ranks of a job import at once on a small machine). Both local launchers (torch
elastic's for ``processes``, and the elastic supervisor) start their ranks with
multiprocessing's ``forkserver`` instead: the server is started once per Python process, it
imports torch, what every rank imports anyway (`PRELOAD`) and the worker's module, and
every rank (and every restart) is a fork of it.
Like spawn, and unlike a plain fork, no rank inherits the launcher's threads or locks.

A fork of the server has the server's environment, taken when it started, not the
launcher's at this launch. [`adopt_environment`][loco.runtime.starter.adopt_environment]
restores spawn's rule in the rank: the launcher's environment as of the launch, plus what
the starter itself set (torch elastic's ``RANK``, ``WORLD_SIZE``, ...).
"""

from __future__ import annotations

import multiprocessing as mp
import os

START_METHOD = "forkserver"
"""The start method of every local rank process."""

PRELOAD = ("torch._dynamo",)
"""What the server imports after torch, besides loco's launchers: what nearly every rank
would import on its own. ``torch._dynamo`` is imported by the first optimizer a process
builds (``torch.optim.Optimizer.__init__``): 1.2 s of CPU in each rank, 5 s of wall for
a job of 4 ranks on 2 cores, paid again by every restart; it starts no thread."""

THREADS_ENV = "LOCO_CPU_THREADS"
"""Set to a number: torch's CPU threads in every rank, whatever the machine's cores."""

ONE_CORE_ENV = "LOCO_THREADS_ONE_CORE"
"""Set to 1: the ``threads`` launcher keeps all its ranks on one core (see `thread_ranks_core`)."""

_ENV_AT_IMPORT = dict(os.environ)
"""This process's environment when this module was imported: in a forked rank, the server's
(it imported the module before forking), or the rank's own before its starter changed it."""


def context(*modules: str):
    """The multiprocessing context rank processes start from.

    Args:
        modules: modules the server imports before its first fork besides torch and loco's
            launchers (e.g. the worker function's); a module that fails to import is left
            to the rank. They count only before the server starts, once per process.

    Returns:
        The ``forkserver`` context.
    """
    preload = ["torch", *PRELOAD, "loco.runtime.launch", *modules]
    mp.set_forkserver_preload([m for m in preload if m and m != "__main__"])
    return mp.get_context(START_METHOD)


def cpu_threads(ranks: int) -> int:
    """torch's intra-op CPU threads for each of ``ranks`` ranks on this machine: the
    machine's cores divided by the ranks, at least one; ``$LOCO_CPU_THREADS`` instead when
    set (e.g. 1 on a machine other jobs keep busy: there a rank's second thread makes
    every operation wait for a core, and a tiny model's step takes ten times longer).

    Raises:
        ValueError: ``$LOCO_CPU_THREADS`` is set but not a whole number >= 1.
    """
    given = os.environ.get(THREADS_ENV)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{THREADS_ENV} must be a whole number >= 1 (got {given!r})")
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def thread_ranks_core() -> int | None:
    """The core the ``threads`` launcher keeps its ranks on, or None (anywhere, the default).

    With ``$LOCO_THREADS_ONE_CORE`` set to 1 (Linux only): the core the calling thread last
    ran on, so that launches from different processes spread as the scheduler spread them.
    Ranks that are threads of one process share its GIL, which torch releases and takes
    back around every operation: on several cores each hand-over wakes a thread on another
    core. For a small model's short operations that costs more than running them side by
    side gains: 4 ranks x 96 steps of the test model took 10.7 s of CPU and 6.5 s on 2
    cores of a VM, against 4.5 s of CPU and 4.5 s on one core (``docs/testing.md``). Use
    it with ``$LOCO_CPU_THREADS`` = 1; a model whose operations take milliseconds gains
    from the cores instead.

    Raises:
        ValueError: ``$LOCO_THREADS_ONE_CORE`` is set to something else than 0 or 1.
    """
    given = os.environ.get(ONE_CORE_ENV, "0")
    if given not in ("0", "1"):
        raise ValueError(f"{ONE_CORE_ENV} must be 0 or 1 (got {given!r})")
    if given == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        with open("/proc/thread-self/stat") as f:  # field 39: the CPU it last ran on
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def adopt_environment(launcher_env: dict[str, str]) -> None:
    """Make this rank's environment the launcher's as of the launch, then reapply what its
    starter set since this module was imported. Call first thing in the rank's entry.

    Args:
        launcher_env: ``dict(os.environ)`` of the launching process at launch time.
    """
    set_by_starter = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(set_by_starter)
