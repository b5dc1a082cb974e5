"""An emulated slow link: each worker's connection to the others as a bandwidth and a latency.

``loco train --link-bandwidth 100Mbit --link-latency 50ms`` gives every worker one such link,
and every communication operation of that worker passes through it (:class:`~loco.comm.Comm`
applies it). The real transfer still happens (gloo over loopback, bytes counted as always);
the link only decides the earliest moment the operation may complete:

* An operation moving B bytes through the link (the larger of what this worker sends and
  what it receives: the link is full duplex) occupies it for B · 8 / bandwidth seconds.
  Transfers queue on the link one behind another, first come first served, as packets do
  behind a token-bucket rate limiter (``tc ... tbf``).
* Latency is propagation delay: it is added once to every operation, after its last byte has
  left, and it does not occupy the link (a second transfer may start while the first is
  still travelling).

So an operation that starts at ``s`` on an idle link completes no earlier than
``s + latency + B · 8 / bandwidth``, and k operations issued together complete no earlier
than ``latency + (B_1 + … + B_k) · 8 / bandwidth`` after the first starts. The waiting
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
_NUMBER = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)"


def parse_bandwidth(text: str) -> float:
    """Bits per second from ``"100Mbit"``, ``"1.5Gbit/s"``, ``"800kbit"``, ``"10Mbps"`` (a
    bare number is bits per second; bytes are not accepted, to avoid a factor 8 mistake).
    Raises ValueError otherwise."""
    m = re.fullmatch(_NUMBER + r"\s*(?:([kmgt]?)(?:bit(?:/s|ps)?|bps))?", text.strip().lower())
    value = float(m.group(1)) * _PREFIXES[m.group(2) or ""] if m else math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"expected a rate > 0 such as 100Mbit, 1Gbit or 800kbit "
                         f"(got {text!r})")
    return value


def parse_latency(text: str) -> float:
    """Seconds from ``"50ms"``, ``"0.2s"``, ``"300us"`` (a bare number is seconds)."""
    m = re.fullmatch(_NUMBER + r"\s*(s|ms|us)?", text.strip().lower())
    value = float(m.group(1)) * _LATENCY_UNITS[m.group(2) or "s"] if m else math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"expected a delay >= 0 such as 50ms, 0.2s or 300us (got {text!r})")
    return value


@dataclass(frozen=True)
class LinkSpec:
    """A link's speed: ``bandwidth`` in bits per second (inf: unlimited), ``latency`` in s."""

    bandwidth: float = math.inf
    latency: float = 0.0

    @classmethod
    def parse(cls, bandwidth: str | None, latency: str | None) -> "LinkSpec | None":
        """From the command line's strings; None when neither is given."""
        if bandwidth is None and latency is None:
            return None
        return cls(math.inf if bandwidth is None else parse_bandwidth(bandwidth),
                   0.0 if latency is None else parse_latency(latency))

    def seconds(self, nbytes: int) -> float:
        """Time for ``nbytes`` on an idle link: latency + bytes · 8 / bandwidth."""
        return self.latency + nbytes * 8 / self.bandwidth

    def __str__(self) -> str:
        rate = ("unlimited" if math.isinf(self.bandwidth)
                else f"{self.bandwidth / 1e6:g} Mbit/s")
        return f"{rate}, {self.latency * 1e3:g} ms"


class EmulatedLink:
    """One worker's link, shared by all its Comms: a FIFO of transfers (see the module doc)."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self._free_at = 0.0  # when the link has sent everything queued so far
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, start: float | None = None) -> float:
        """Queue a transfer of ``nbytes`` that starts at ``start`` (default now); return the
        time.perf_counter() at which it has arrived."""
        start = time.perf_counter() if start is None else start
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + nbytes * 8 / self.spec.bandwidth
            return self._free_at + self.spec.latency

    @staticmethod
    def hold_until(deadline: float, aborted: threading.Event | None = None) -> None:
        """Sleep until ``deadline`` (a time.perf_counter() value), waking early on abort."""
        while (left := deadline - time.perf_counter()) > 0:
            if aborted is not None and aborted.is_set():
                return
            time.sleep(min(left, 0.05))
