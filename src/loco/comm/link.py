"""An emulated slow link: each worker's connection to the others as a bandwidth and a latency.

``loco train --link-bandwidth 100Mbit --link-latency 50ms`` gives every worker one such link,
and every communication operation of that worker passes through it (:class:`~loco.comm.Comm`
applies it). The real transfer still happens (gloo over loopback, bytes counted as always);
the link only decides the earliest moment the operation may complete:

* An operation moving B bytes through the link (the larger of what this worker sends and
  what it receives: the link is full duplex) occupies it for B · 8 / bandwidth seconds.
  Transfers queue on the link one behind another, first come first served, as packets do
  behind a token-bucket rate limiter (``tc ... tbf``).
* Latency is propagation delay: it is added once per dependent phase of an operation (one
  for a send, a broadcast or an all-gather; two for a mean all-reduce, whose all-gather
  needs its reduce-scatter's result), after its last byte has left, and it does not occupy
  the link (a second transfer may start while the first is still travelling).
* An operation starts when its data exists on both ends: when the real transfer completed,
  which is only once every participant has issued it. A peer that issues 1 s late delays
  everyone's completion by that second, as it would on a real link.

So an operation of k phases that every participant has issued by ``s`` completes no earlier
than ``s + k · latency + B · 8 / bandwidth`` on an idle link, and operations issued together
queue: the j-th completes no earlier than ``k · latency + (B_1 + … + B_j) · 8 / bandwidth``
after the first starts. The waiting
happens on the communication thread's side: the worker that issued the operation computes
on until it calls ``wait()``, so overlapped methods hide the link and blocking ones pay it.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)"


def parse_bandwidth(text: str) -> float:
    """Bits per second from ``"100Mbit"``, ``"1.5Gbit/s"``, ``"800kbit"``, ``"10Mbps"`` (a
    bare number is bits per second; bytes are not accepted, to avoid a factor 8 mistake).

    Args:
        text: a number > 0, optionally followed by ``bit``, ``bit/s``, ``bitps`` or ``bps``
            with an optional prefix k, M, G or T (powers of 1000, any case). The unit's b
            must be lower case: ``B`` means bytes (``10MBps``, ``10MB/s``) and is refused.

    Returns:
        The rate in bits per second, finite and > 0.

    Raises:
        ValueError: anything else (a unit of bytes, a rate <= 0, not finite).
    """
    # Case-insensitive but for the unit's b: lower-cased, 10MBps (bytes) would read as 10Mbps.
    m = re.fullmatch(_NUMBER + r"\s*(?:([kmgtKMGT]?)(?:bit(?:/s|ps)?|bps))?", text.strip())
    value = float(m.group(1)) * _PREFIXES[(m.group(2) or "").lower()] if m else math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"expected a rate > 0 such as 100Mbit, 1Gbit or 800kbit "
                         f"(got {text!r})")
    return value


def parse_latency(text: str) -> float:
    """Seconds from ``"50ms"``, ``"0.2s"``, ``"300us"`` (a bare number is seconds).

    Args:
        text: a number >= 0, optionally followed by ``s``, ``ms`` or ``us``.

    Returns:
        The delay in seconds, finite and >= 0.

    Raises:
        ValueError: anything else.
    """
    m = re.fullmatch(_NUMBER + r"\s*(s|ms|us)?", text.strip().lower())
    value = float(m.group(1)) * _LATENCY_UNITS[m.group(2) or "s"] if m else math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"expected a delay >= 0 such as 50ms, 0.2s or 300us (got {text!r})")
    return value


@dataclass(frozen=True)
class LinkSpec:
    """A link's speed: ``bandwidth`` in bits per second (inf: unlimited), ``latency`` in s.

    Args:
        bandwidth: bits per second, > 0; default ``math.inf`` (unlimited).
        latency: one-way delay added to every operation, in seconds, >= 0; default 0.

    Raises:
        ValueError: a bandwidth <= 0 or a negative or infinite latency.
    """

    bandwidth: float = math.inf
    latency: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0:  # also refuses NaN
            raise ValueError(f"LinkSpec: bandwidth must be > 0 bits/s (got {self.bandwidth!r})")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"LinkSpec: latency must be >= 0 s and finite "
                             f"(got {self.latency!r})")

    @classmethod
    def parse(cls, bandwidth: str | None, latency: str | None) -> "LinkSpec | None":
        """From the command line's strings; None when neither is given.

        Args:
            bandwidth: a rate for [`parse_bandwidth`][loco.comm.link.parse_bandwidth], or
                None for unlimited.
            latency: a delay for [`parse_latency`][loco.comm.link.parse_latency], or None
                for 0.

        Raises:
            ValueError: a string that does not parse.
        """
        if bandwidth is None and latency is None:
            return None
        return cls(math.inf if bandwidth is None else parse_bandwidth(bandwidth),
                   0.0 if latency is None else parse_latency(latency))

    def seconds(self, nbytes: int) -> float:
        """Time for ``nbytes`` on an idle link: latency + bytes · 8 / bandwidth.

        Args:
            nbytes: bytes to move, >= 0.
        """
        return self.latency + nbytes * 8 / self.bandwidth

    def __str__(self) -> str:
        rate = ("unlimited" if math.isinf(self.bandwidth)
                else f"{self.bandwidth / 1e6:g} Mbit/s")
        return f"{rate}, {self.latency * 1e3:g} ms"


class EmulatedLink:
    """One worker's link, shared by all its Comms: a FIFO of transfers.

    A transfer of B bytes occupies the link for ``B · 8 / bandwidth`` seconds, behind the
    transfers queued before it (first come, first served); the latency is added once per
    dependent phase of the operation after its last byte and does not occupy the link. The
    Comm's operation completes no earlier than that, counted from when every participant
    had issued it.

    Args:
        spec: the link's bandwidth and latency.
    """

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self._free_at = 0.0  # when the link has sent everything queued so far
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, start: float | None = None, phases: int = 1) -> float:
        """Queue a transfer of ``nbytes`` that starts at ``start`` (default now); return the
        time.perf_counter() at which it has arrived.

        It begins when the link is free (after the transfers queued before it), occupies
        the link for ``nbytes · 8 / bandwidth`` and arrives ``phases · latency`` after that:
        an operation of k dependent phases (a phase waits for the previous one's data, as
        the all-gather of a mean all-reduce waits for its reduce-scatter) pays the latency k
        times.

        Args:
            nbytes: bytes to move, >= 0.
            start: the ``time.perf_counter()`` it is ready to go; default None (now).
            phases: dependent phases of the operation, >= 1; default 1.
        """
        start = time.perf_counter() if start is None else start
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + nbytes * 8 / self.spec.bandwidth
            return self._free_at + phases * self.spec.latency
