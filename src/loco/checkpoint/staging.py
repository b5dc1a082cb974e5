"""Copies of a rank's state for the checkpoint writer: a snapshot that training cannot
change, host buffers reused by every checkpoint (``Stager``), or the live tensors themselves
for a write in place (``compact``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


def snapshot(state: Any) -> Any:
    """A copy of ``state`` that later training cannot change: every tensor copied to CPU
    memory, every dict, list and tuple rebuilt (numbers and strings are immutable).

    Args:
        state: tensors, numbers, strings, None, and dicts, lists and tuples of them.

    Returns:
        The copy, with the same structure (an ``OrderedDict`` keeps its ``_metadata``).
    """
    return map_tensors(state, lambda t, path: t.detach().to("cpu", copy=True))


def map_tensors(state: Any, leaf: Callable[[torch.Tensor, str], Any], path: str = "") -> Any:
    """``state`` rebuilt with ``leaf(tensor, path)`` in place of each tensor: every dict,
    list and tuple rebuilt (an ``OrderedDict`` keeps a module state_dict's ``_metadata``, its
    version information), other values kept. ``path`` names a tensor's place, e.g.
    ``/model/weight``.

    Args:
        state: tensors, numbers, strings, None, and dicts, lists and tuples of them.
        leaf: what a tensor becomes.
        path: the place of ``state`` itself; default "".
    """
    if isinstance(state, torch.Tensor):
        return leaf(state, path)
    if isinstance(state, OrderedDict):
        out = OrderedDict((k, map_tensors(v, leaf, f"{path}/{k}")) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = map_tensors(state._metadata, leaf)
        return out
    if isinstance(state, dict):
        return {k: map_tensors(v, leaf, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map_tensors(v, leaf, f"{path}/{i}") for i, v in enumerate(state))
    return state


class Stager:
    """Copies of a state's tensors in host buffers allocated once and reused by every
    checkpoint, so the background writer reads a fixed copy while training goes on. A
    tensor on a GPU gets a page-locked buffer, and its copy is queued on a side stream of
    the Stager's own: the side stream waits for an event on the caller's stream (the work
    that wrote the tensors), the copies are queued on it without blocking the host, and the
    caller's stream waits for the event after them (``ready``, which the writer waits for
    too) before it runs anything that could change them. A ``DTensor`` (FSDP2's shards) is
    staged the same way, its local shard into a buffer of its own, wrapped as a DTensor
    with the same placements (what DCP saves). A tensor whose shape or dtype changed gets a
    new buffer.

    Args:
        pinned: page-lock the buffers of tensors that are on a GPU (default True).
    """

    def __init__(self, pinned: bool = True):
        self.pinned = pinned
        self._buffers: dict[str, torch.Tensor] = {}
        self._wrapped: dict[str, torch.Tensor] = {}  # a DTensor's staged copy, by path
        self._streams: dict[torch.device, Any] = {}
        self.ready: Any = None
        """The CUDA event after the last ``stage``'s copies (None: nothing to wait for)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffers held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """``state`` with every tensor copied into its buffer (see :func:`snapshot` for the
        structures kept). Copies from a GPU are queued on the side stream, behind the work
        that wrote the tensors and ahead of any that changes them, so the caller goes on at
        once; ``ready`` is then the event the reader of the buffers waits for (pass it to
        ``Writer.save``), else None."""
        queued: list = []
        out = map_tensors(state, lambda t, path: self._copy(t, path, queued))
        self.ready = self._queue(queued) if queued else None
        return out

    def _copy(self, tensor: torch.Tensor, path: str, queued: list) -> torch.Tensor:
        """``tensor``'s staged copy: its buffer (a DTensor: its local shard's, wrapped),
        filled now from the CPU, or queued in ``queued`` (source, buffer) from a GPU."""
        t = tensor.detach()
        source = t.to_local() if type(t) is not torch.Tensor else t
        buf = self._buffers.get(path)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = self._buffers[path] = _host_buffer(source, self.pinned and _on_gpu(source))
            self._wrapped.pop(path, None)
        if _on_gpu(source):
            queued.append((source, buf))
        else:
            buf.copy_(source)
        if type(t) is torch.Tensor:
            return buf
        if path not in self._wrapped:  # the placements of the live DTensor, a host shard
            self._wrapped[path] = type(t)(buf, t._spec, requires_grad=False)
        return self._wrapped[path]

    def _queue(self, queued: list) -> Any:
        """Queue the copies from a GPU on the side stream, ordered after the caller's
        stream; the caller's stream waits for their event, which is returned."""
        device = queued[0][0].device
        current = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        written = torch.cuda.Event()
        written.record(current)
        side.wait_event(written)
        with torch.cuda.stream(side):
            for source, buf in queued:
                buf.copy_(source, non_blocking=True)
                source.record_stream(side)  # the allocator keeps it until the copy is done
        ready = torch.cuda.Event()
        ready.record(side)
        current.wait_event(ready)  # nothing the caller queues next changes them before
        return ready


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a GPU (its copy is then queued, into page-locked memory)."""
    return t.is_cuda


def _host_buffer(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty CPU tensor shaped like ``like``, page-locked if ``pin``."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)


def compact(state: Any) -> Any:
    """``state`` (as for :func:`snapshot`) with the live tensors themselves, except those
    that view part of a larger storage (saved alone they would carry all of it) or are not
    on the CPU: copied. What an in-place write saves."""
    def leaf(tensor: torch.Tensor, path: str) -> torch.Tensor:
        t = tensor.detach()
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
        return t if t.device.type == "cpu" and (whole or type(t) is not torch.Tensor) \
            else t.to("cpu", copy=True)
    return map_tensors(state, leaf)
