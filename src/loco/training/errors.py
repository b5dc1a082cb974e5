"""How a worker's failure is reported: a TrainingError naming its rank and step."""

from __future__ import annotations

from loco import checkpoint
from loco.algorithms.base import NonFiniteError
from loco.runtime.faults import InjectedFault


class TrainingError(RuntimeError):
    """A worker's failure, with its rank and step. ``brief``: an expected failure (bad
    numbers, an injected fault, a bad checkpoint) that needs no traceback."""

    def __init__(self, message: str, brief: bool = False):
        super().__init__(message)
        self.brief = brief


def failure(e: Exception, rank: int, step: int, comm_timeout: float) -> TrainingError:
    """The TrainingError reporting ``e``, raised by worker ``rank`` at ``step``."""
    where = f"worker {rank} failed at step {step}"
    expected = isinstance(e, (NonFiniteError, InjectedFault, checkpoint.CheckpointError))
    if not expected and ("timed out" in str(e).lower() or "timeout" in str(e).lower()):
        return TrainingError(f"{where}: a communication took longer than --comm-timeout "
                             f"{comm_timeout:g} s; a peer stopped answering or is far too "
                             f"slow ({str(e).splitlines()[0][:200]})", brief=True)
    return TrainingError(f"{where}: {type(e).__name__}: {e}", brief=expected)
