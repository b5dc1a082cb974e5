"""How the local launchers start rank processes: forked from a server that imported torch once.

A spawned process imports torch and loco afresh (about 1.5 s of CPU each, several seconds
when the ranks of a job import at once on a small machine). Both local launchers (torch
elastic's for ``processes``, and the elastic supervisor) start their ranks with
multiprocessing's ``forkserver`` instead: the server is started once per Python process, it
imports torch and the worker's module, and every rank (and every restart) is a fork of it.
Like spawn, and unlike a plain fork, no rank inherits the launcher's threads or locks.
The server also imports ``torch._dynamo``: torch imports it lazily on the first call of a
function it keeps out of compilation, and every rank makes one (an optimizer's
``add_param_group``, a DTensor's constructor), which cost each rank another 1.5 s of CPU.

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

_ENV_AT_IMPORT = dict(os.environ)
"""This process's environment when this module was imported: in a forked rank, the server's
(it imported the module before forking), or the rank's own before its starter changed it."""


def context(*modules: str):
    """The multiprocessing context rank processes start from.

    Args:
        modules: modules the server imports before its first fork besides torch,
            ``torch._dynamo`` and loco's launchers (e.g. the worker function's); a module
            that fails to import is left to the rank. They count only before the server
            starts, once per process.

    Returns:
        The ``forkserver`` context.
    """
    preload = ["torch", "torch._dynamo", "loco.runtime.launch", *modules]
    mp.set_forkserver_preload([m for m in preload if m and m != "__main__"])
    return mp.get_context(START_METHOD)


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
