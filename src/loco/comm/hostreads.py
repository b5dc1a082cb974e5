"""Host reads: the operations that make the CPU wait until the device has computed a value.

On a GPU, a step that reads a device value on the host (``.item()``, ``bool(t)``, a
``nonzero``, a ``unique``, a boolean mask) stops the CPU until every kernel queued before it
has run, so the next step's kernels are not queued in time and the GPU idles. loco reads the
device only at a sync, a logging step, an evaluation or a checkpoint; every other inner step
must read nothing. Code that reads on purpose says so with [`allowed`][loco.comm.hostreads.allowed]
(``with allowed("sync"): ...``), and two instruments check the rest:

* **counting** (any device): [`HostReadCounter`][loco.comm.hostreads.HostReadCounter], a
  ``TorchDispatchMode`` on the training thread that counts the operations of
  ``HOST_READ_OPS`` (and indexing with a boolean mask), by the reason of the ``allowed``
  region they ran in (``"step"`` outside any);
* **refusing** (CUDA): ``torch.cuda.set_sync_debug_mode("error")`` outside the ``allowed``
  regions, so that any synchronising CUDA call raises where it is made
  ([`Guard`][loco.comm.hostreads.Guard]).

``LOCO_HOST_READS`` turns them on for a training run: ``count`` (the GPU's code path is taken
on any device, ``device_path``, and the counts go into ``summary.json``), ``warn`` or
``error`` (CUDA's sync-debug mode, off the ``allowed`` regions).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODE_ENV = "LOCO_HOST_READS"
"""The environment variable that turns the instruments on: ``count``, ``warn`` or ``error``;
unset or empty: off."""
MODES = ("count", "warn", "error")

aten = torch.ops.aten
HOST_READ_OPS = frozenset({
    aten._local_scalar_dense.default,  # .item(), bool(t), float(t), int(t)
    aten.nonzero.default, aten.nonzero_static.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.unique_dim_consecutive.default,
    aten.masked_select.default, aten.equal.default,
    aten.repeat_interleave.Tensor,  # its output's size is the sum of the counts
})
"""Operations whose result's size or value the host needs from the device: on a GPU each
waits for every kernel queued before it."""
MASKED_OPS = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                        aten._index_put_impl_.default})
"""Indexing operations that read the device when an index is a boolean mask (``t[mask]``:
its ``nonzero`` runs inside the operation)."""

_local = threading.local()
_TOLIST = torch.Tensor.tolist
_tolist_counters = [0]  # counters entered, in any thread


def _counted_tolist(self):
    counter = getattr(_local, "counter", None)
    if counter is not None:
        counter.count()
    return _TOLIST(self)

_relaxed = [0]  # threads inside an allowed region, while a Guard is on
_lock = threading.Lock()
_guard: list[Guard | None] = [None]


def mode() -> str | None:
    """The instruments ``LOCO_HOST_READS`` asks for: ``"count"``, ``"warn"``, ``"error"``
    or None (off).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(MODE_ENV, "").strip().lower() or None
    if value is not None and value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)} (got {value!r})")
    return value


def device_path(device: torch.device | str) -> bool:
    """Whether code on ``device`` takes the path that never reads the device on the host:
    on CUDA, and on any device while ``LOCO_HOST_READS=count`` (so that a CPU run counts
    what a GPU run would read). A CPU otherwise reads its own memory for free and may take a
    shorter path (the same results: each such choice is tested both ways).

    Args:
        device: where the tensors live.
    """
    return torch.device(device).type == "cuda" or mode() == "count"


def reason() -> str:
    """The reason of the innermost ``allowed`` region this thread is in; ``"step"``
    outside any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else "step"


@contextmanager
def allowed(why: str):
    """A region that may read the device on the host, for ``why`` (``"sync"``, ``"log"``,
    ``"eval"``, ``"checkpoint"``, ...): the counter files its reads under ``why``, and a
    ``Guard`` lets CUDA synchronise inside it.

    Args:
        why: the reason, a short word.
    """
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(why)
    guard = _guard[0]
    if guard is not None:
        guard.relax(+1)
    try:
        yield
    finally:
        if guard is not None:
            guard.relax(-1)
        stack.pop()


def reads_host(func, args) -> bool:
    """Whether the operation ``func`` called with ``args`` reads the device on the host."""
    if func in HOST_READ_OPS:
        return True
    if func in MASKED_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices or ())
    return False


class HostReadCounter(TorchDispatchMode):
    """Counts the host reads of the operations run on this thread while it is entered, by
    the reason of the ``allowed`` region they ran in (``"step"``: outside any).

    ``counts`` holds the totals; ``take()`` returns the counts since its last call (a
    step's), and ``worst`` the most a single ``take()`` saw per reason.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._since: Counter = Counter()
        self.worst: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if reads_host(func, args):
            self.count()
        return func(*args, **(kwargs or {}))

    def count(self) -> None:
        """Count one read, under the current region's reason."""
        why = reason()
        self.counts[why] += 1
        self._since[why] += 1

    def __enter__(self) -> HostReadCounter:
        # ``Tensor.tolist`` copies to the host without an operation the mode sees (and a CPU
        # tensor's without any): it is counted by a wrapper, for this thread's counter.
        with _lock:
            if not _tolist_counters[0]:
                torch.Tensor.tolist = _counted_tolist
            _tolist_counters[0] += 1
        _local.counter = self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        _local.counter = None
        with _lock:
            _tolist_counters[0] -= 1
            if not _tolist_counters[0]:
                torch.Tensor.tolist = _TOLIST

    def take(self) -> Counter:
        """The reads counted since the last call, by reason; updates ``worst``."""
        since, self._since = self._since, Counter()
        for why, n in since.items():
            self.worst[why] = max(self.worst[why], n)
        return since


class Guard:
    """CUDA's sync-debug mode (``"warn"`` or ``"error"``) outside the ``allowed`` regions,
    while entered: any synchronising CUDA call (a device value read on the host, a blocking
    copy, a stream or device synchronise) warns or raises where it is made. The mode is
    process-wide; it is relaxed while any thread is inside an ``allowed`` region.

    Args:
        level: ``"warn"`` or ``"error"``.
    """

    def __init__(self, level: str):
        if level not in ("warn", "error"):
            raise ValueError(f"level must be warn or error (got {level!r})")
        self.level = level

    def relax(self, delta: int) -> None:
        """One more (+1) or one fewer (-1) thread inside an ``allowed`` region."""
        with _lock:
            _relaxed[0] += delta
            torch.cuda.set_sync_debug_mode(0 if _relaxed[0] else self.level)

    def __enter__(self) -> Guard:
        with _lock:
            _guard[0] = self
            torch.cuda.set_sync_debug_mode(0 if _relaxed[0] else self.level)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _guard[0] = None
            torch.cuda.set_sync_debug_mode(0)


__all__ = ["HOST_READ_OPS", "MODE_ENV", "Guard", "HostReadCounter", "allowed", "device_path",
           "mode", "reads_host", "reason"]
