"""Runtime: start workers (threads, local processes, torchrun) and give each its context."""

from loco.runtime.launch import LAUNCHERS, Mesh, WorkerContext, WorkerError, launch, under_torchrun

__all__ = ["LAUNCHERS", "Mesh", "WorkerContext", "WorkerError", "launch", "under_torchrun"]
