"""The bodies of a Comm's averages ([`Comm.all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean]
and [`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean]): checked, weighed, played
by this worker's injected attacks (a training average), counted and issued on the Comm's
thread, where the guard judges what is received (``loco.comm.guard``) and a job key's MACs
are put on and checked (``loco.comm.seal``).
"""

from __future__ import annotations

from typing import Any

import torch

from loco.comm.handles import Handle
from loco.comm.reduce import layout, piece_width, reduce_mean
from loco.comm.seal import mac_bytes, sealed

Comm = Any  # a loco.comm.comm.Comm (not imported: comm.py imports this module)


def _start(comm: Comm, tensor: torch.Tensor, tag: str, weight: float | None
           ) -> tuple[torch.Tensor, int | None]:
    """``tensor``'s flat view, weighed and played by this worker's attacks where it is a
    training average; and its step (None: not a training average, left unguarded)."""
    flat = tensor.view(-1)
    if weight is not None:
        flat.mul_(weight)
    return flat, comm.shield.send(flat) if tag == "train" else None


def issue_all_reduce_mean(comm: Comm, tensor: torch.Tensor, tag: str, codec: Any,
                          sent: torch.Tensor | None, weight: float | None) -> Handle:
    """[`Comm.all_reduce_mean`][loco.comm.comm.Comm.all_reduce_mean]'s body, its tensor on
    the Comm's device (see there for the arguments).

    Args:
        comm: the Comm.
        tensor: the contiguous tensor to average, in place.
        tag: the tag its bytes are counted under.
        codec: the wire format, or None.
        sent: where ``D(C(x))`` goes, or None.
        weight: what this worker's values are multiplied by first, or None.
    """
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_mean needs a contiguous tensor")
    if codec is not None and tensor.dtype != torch.float32:
        raise ValueError(f"all_reduce_mean with codec {codec.name} needs an fp32 tensor "
                         f"(got {tensor.dtype})")
    flat, step = _start(comm, tensor, tag, weight)
    if codec is not None and codec.name == "fp32":  # lossless: the unencoded mean
        codec = None
    m, n, b = comm.size, flat.numel(), flat.element_size()
    chunk, row_bytes = layout(n, m, codec, b)
    wire = 2 * (m - 1) * row_bytes
    if comm.job_key is not None and step is not None:  # a tag per row, both legs, each piece
        wire += mac_bytes(m - 1, 2 * -(-chunk // piece_width(chunk, m, codec, b)))
    divisor = comm.contributors
    # Two dependent phases (reduce-scatter, then all-gather): two latencies on a link.
    return comm._submit("all_reduce_mean", tag, n * b, wire, wire,
                        lambda: comm._reduce_mean(flat, chunk, codec, m, divisor, sent, step),
                        [flat] + ([] if sent is None else [sent]), phases=2)


def reduce_on_thread(comm: Comm, flat: torch.Tensor, chunk: int, codec: Any, m: int,
                     divisor: int, sent: torch.Tensor | None, step: int | None
                     ) -> torch.Tensor:
    """On the Comm's thread (``Comm._reduce_mean``): the reduction of
    ``issue_all_reduce_mean``'s arguments. A training average (a step) is guarded; a guard
    must see each worker's rows, and a MAC must ride with them: loco's reduce-scatter, not
    the transport's own sum."""
    guard, wire = comm.shield.around(step, comm.senders())
    native = not (comm.rank_order or guard is not None or comm.job_key is not None)
    if native and codec is None and wire is not None:  # what the transport's sum sends
        wire(flat)
        wire = None
    return reduce_mean(flat, chunk, codec, m, divisor, comm._buffers,
                       *sealed(comm, step, guard, comm._all_to_all, comm._gather), sent,
                       comm._sum if native else None, guard, wire)


def issue_all_gather_mean(comm: Comm, tensor: torch.Tensor, tag: str, codec: Any,
                          sent: torch.Tensor | None, weight: float | None) -> Handle:
    """[`Comm.all_gather_mean`][loco.comm.comm.Comm.all_gather_mean]'s body, its tensor on
    the Comm's device (see there for the arguments).

    Args:
        comm: the Comm.
        tensor: the contiguous fp32 tensor to average, in place.
        tag: the tag its bytes are counted under.
        codec: the wire format (one that ``gathers``).
        sent: where ``D(C(x))`` or ``C(x)`` goes, or None.
        weight: what this worker's values are multiplied by first, or None.
    """
    if not tensor.is_contiguous() or tensor.dtype != torch.float32 or codec is None:
        raise ValueError("all_gather_mean needs a contiguous fp32 tensor and a codec (got "
                         f"{tensor.dtype}, contiguous={tensor.is_contiguous()}, {codec})")
    flat, step = _start(comm, tensor, tag, weight)
    m, n = comm.size, flat.numel()
    wire = (m - 1) * codec.row_bytes(codec.padded(n)) if n else 0
    wire += mac_bytes(m - 1) if comm.job_key is not None and step is not None else 0
    divisor = comm.contributors

    def run() -> torch.Tensor:  # on the Comm's thread
        guard, flip = comm.shield.around(step, comm.senders())
        gather = sealed(comm, step, guard, None, comm._gather, "a message")[1]
        return codec.gather_mean(flat, m, divisor, comm._buffers, gather, sent, guard, flip)

    return comm._submit("all_gather_mean", tag, n * 4, wire, wire, run,
                        [flat] + ([] if sent is None else [sent]))
