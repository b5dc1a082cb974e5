"""Replicas that drift are caught: the workers compare a digest of the state that must be
identical on all of them (``Algorithm.replicated_tensors``: DiLoCo's global copy and outer
momentum, DataParallel's and DeMo's parameters), name a worker whose digest differs from the
majority's and heal it from a worker of the majority (docs/security.md, "Replicas that
drift").

The digest ([`digest`][loco.algorithms.replicas.digest]) is computed where the tensors live,
with integer arithmetic only, so it is the same on any device and in any reduction order;
[`check_replicas`][loco.algorithms.replicas.check_replicas] gathers one digest per worker
(tag ``verify``, a few bytes) and acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loco.comm import Comm
from loco.comm.hostreads import allowed

PIECE = 1 << 22
"""Values digested at a time: the int64 copies a piece needs (32 MiB each) bound the
digest's memory whatever the tensors' size; the positions' weights (int64, as many as the
largest piece digested, at most ``PIECE``) are kept per device."""
TAG = "verify"
"""The tag the checks' bytes are counted under (``Comm.totals("verify")``)."""
DIGEST_WORDS = 3
"""int64 words of a digest: the values' count, their plain sum, their weighted sum."""

_MASK64 = (1 << 64) - 1
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}  # per device: w(j) for j < PIECE, made once


def _signed(x: int) -> int:
    """The 64-bit two's-complement value of ``x`` as a Python int in int64's range."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _splitmix(x: int) -> int:
    """splitmix64 of ``x`` (Python ints, exact)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _piece_weight(p: int) -> int:
    """The odd multiplier of piece ``p`` (positions ``[p·PIECE, (p+1)·PIECE)``)."""
    return _signed(_splitmix(p) | 1)


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """The odd int64 weights of the first ``n`` positions of a piece (n <= ``PIECE``), on
    ``device``: a splitmix-like mix of the position with wrapping int64 arithmetic (made once
    per device, grown as needed; the same values on every device)."""
    have = _weights.get(device)
    if have is None or have.numel() < n:
        j = torch.arange(n, dtype=torch.int64, device=device)
        z = j * _signed(0x9E3779B97F4A7C15) + _signed(0xD1B54A32D192ED03)
        z = (z ^ (z >> 29)) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> 32)) * _signed(0x94D049BB133111EB)
        have = _weights[device] = (z ^ (z >> 29)) | 1
    return have[:n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as signed integers of their width, flat (a view where it can be):
    floats and complex numbers by their bits, booleans as bytes, integers as they are."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_floating_point():
        return flat.view(_SIGNED[flat.element_size()])
    return flat


@torch.no_grad()
def digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A digest of the tensors' bits, in their order: ``DIGEST_WORDS`` int64 values on the
    first tensor's device (CPU for none), computed there with no read to the host.

    The values' bits, read as signed integers of their width (fp32 as int32, bf16 as int16)
    and widened to int64, give the count of values, their plain sum and their sum weighted
    by an odd pseudo-random weight per position (the position's weight times its piece's),
    all modulo 2^64. Integer sums are exact in any order, so the digest is the same on every
    call, every device and every worker holding the same bits. Any single flipped bit
    changes both sums (by ±2^b, and by an odd weight times 2^b: neither is 0 modulo 2^64);
    several flips, a swap of two values or a shift of the layout change the weighted sum
    but for a 2^-64 chance. At most ``PIECE`` values are widened at a time.

    Args:
        tensors: tensors of any dtype and device (each digested on its own device; the
            partial sums meet on the first's).

    Returns:
        A 1-D int64 tensor of ``DIGEST_WORDS`` values.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    at = 0
    for t in tensors:
        bits = _bits(t)
        start = 0
        while start < bits.numel():
            j = (at + start) % PIECE
            n = min(PIECE - j, bits.numel() - start)
            x = bits[start:start + n].to(torch.int64)
            part = torch.stack([x.sum(), (x * _position_weights(j + n, x.device)[j:]).sum()
                                * _piece_weight((at + start) // PIECE)])
            sums += part.to(device)
            start += n
        at += bits.numel()
    return torch.cat([torch.tensor([at], dtype=torch.int64, device=device), sums])


class ReplicasDisagree(RuntimeError):
    """No strict majority of the workers holds the same replicated state: which copy is
    right cannot be told, and the run stops."""


@dataclass
class Verdict:
    """What one check found, the same on every rank of every worker that took part.

    Args:
        step: the inner step it was made at.
        workers: the workers named (their copy differed from the majority's), sorted.
        healed_from: the worker of the majority they were healed from (None: none named).
    """

    step: int
    workers: list[int] = field(default_factory=list)
    healed_from: int | None = None

    @property
    def agree(self) -> bool:
        """Whether every worker's digest agreed."""
        return not self.workers

    def as_dict(self) -> dict:
        """The summary's record of a check that named workers."""
        return {"step": self.step, "workers": list(self.workers),
                "healed_from": self.healed_from}


def check_replicas(algo, comm: Comm, step: int, within: Sequence[Comm | None] = ()
                   ) -> Verdict | None:
    """Compare the workers' replicated state and heal the workers whose copy differs.

    Collective over ``comm`` (and every Comm of ``within``): every rank of every worker
    calls it at the same step, with no sync in flight. Each rank digests its share
    (``algo.replicated_tensors()``) and all-gathers the digests over ``comm`` (tag
    ``verify``); the workers whose digest differs from that of a strict majority are named
    (the verdicts of a worker's ranks, ``within``, are combined: a worker is named when any
    of its shares differs). The lowest worker not named sends its share, point to point
    (tag ``verify``), to the workers whose share differs, and a named worker's replica
    restarts from the healed state (``algo.restart_from_global()``).

    Args:
        algo: this rank's algorithm.
        comm: the Comm between the same shares of the workers (``ctx.comm``).
        step: the current inner step, for the record.
        within: the Comms between this rank and the other ranks of its worker (or of every
            worker: ``ctx.inner``, ``ctx.pipe``), whose verdicts are combined; None entries
            are skipped.

    Returns:
        The verdict, or None when the algorithm has no replicated state (nothing is sent).

    Raises:
        ReplicasDisagree: no strict majority of the workers holds one digest; the message,
            one line, names the groups of workers that agree.
    """
    tensors = algo.replicated_tensors()
    if not tensors:
        return None
    mine = digest(tensors).to(comm.device)
    with allowed("verify"):
        rows = [tuple(r.tolist()) for r in comm.all_gather(mine, tag=TAG).wait()]
    names = list(comm.members) if comm.elastic else list(range(comm.size))
    groups, majority = _majority(rows)
    here = [r for r in range(len(rows)) if majority is None or r not in majority]
    named = _combine(here, majority is not None, len(rows), within)
    if named is None:
        raise ReplicasDisagree(
            f"replicas disagree at step {step} with no majority: workers "
            + " vs ".join(str(sorted(names[r] for r in g)) for g in groups)
            + " hold different copies; the run stops (no copy can be trusted)")
    if not named:
        return Verdict(step)
    src = min(r for r in range(len(rows)) if r not in named) if len(named) < len(rows) \
        else min(majority)
    _heal(algo, comm, tensors, src, [r for r in here if r != src])
    if comm.rank in named:
        algo.restart_from_global()
    return Verdict(step, sorted(names[r] for r in named), names[src])


def _majority(rows: list[tuple]) -> tuple[list[list[int]], list[int] | None]:
    """The ranks grouped by digest (in order of their lowest rank), and the group of a
    strict majority of them (None: there is none)."""
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row, []).append(rank)
    largest = max(groups.values(), key=len)
    return list(groups.values()), largest if 2 * len(largest) > len(rows) else None


def _combine(here: list[int], has_majority: bool, m: int,
             within: Sequence[Comm | None]) -> list[int] | None:
    """The ranks named by any rank of ``within``'s groups (a union of ``here``); None when
    one of them found no majority."""
    flags = torch.zeros(m + 1, dtype=torch.int64)
    flags[here] = 1
    flags[m] = 0 if has_majority else 1
    for c in within:
        if c is not None and c.size > 1:
            with allowed("verify"):
                rows = c.all_gather(flags.to(c.device), tag=TAG).wait()
                flags = torch.stack(rows).amax(0).cpu()
    if flags[m]:
        return None
    return [r for r in range(m) if flags[r]]


@torch.no_grad()
def _heal(algo, comm: Comm, tensors: list[torch.Tensor], src: int, to: list[int]) -> None:
    """Send the share of rank ``src`` to the ranks ``to`` (those whose share differs),
    point to point over ``comm`` (tag ``verify``), in place; a tensor not on the Comm's
    device travels through a copy."""
    if not to or (comm.rank != src and comm.rank not in to):
        return
    wire = [t if _reachable(comm, t) else t.detach().to(comm.device) for t in tensors]
    if comm.rank == src:
        comm.sendrecv([(w, dst) for dst in to for w in wire], [], tag=TAG).wait()
        return
    comm.sendrecv([], [(w, src) for w in wire], tag=TAG).wait()
    for t, w in zip(tensors, wire):
        if w is not t:
            t.copy_(w)


def _reachable(comm: Comm, t: torch.Tensor) -> bool:
    """Whether the Comm takes ``t`` as it is (on its device, or the one it stages from)
    and contiguous."""
    return t.is_contiguous() and t.device in (torch.device(comm.device), comm.stage_from)


__all__ = [
    "DIGEST_WORDS",
    "PIECE",
    "TAG",
    "ReplicasDisagree",
    "Verdict",
    "check_replicas",
    "digest",
]
