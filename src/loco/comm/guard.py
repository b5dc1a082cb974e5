"""The guard: robust aggregation of the workers' contributions, judged by whoever reduces
them, with no word from the senders (docs/security.md).

Every average loco forms itself passes the contributions it combines, decoded, through
[`Guard.combine`][loco.comm.guard.Guard.combine]: in a reduce-scatter each chunk's reducer
holds that chunk of every worker's contribution; in an all-gather (SparseLoCo's formats,
DeMo) every worker holds every message. For each contribution (a row) it computes the norm
and a digest on the device, and compares them with the others' and with the sender's past:

- ``nonfinite``: a NaN or an infinity;
- ``high``: a norm above ``factor`` times the median norm (the upper median of the rows
  that are not zeros: with two the larger, so a pair never calls one of them high: two
  cannot tell which is wrong);
- ``low``: a norm below the median over ``factor``; a row of zeros only where every worker
  is to contribute (one that joins, or waits for its block to end, sends zeros);
- ``stale``: exactly what the same sender sent before (one of its last ``HISTORY`` rows);
- ``mac``: a payload whose MAC failed (``loco.comm.auth``), marked by the caller;
- ``tokens``: a worker that claims to train more than ``factor`` times as fast as the
  median worker (the lower median: of an even count the faster of the middle two), for a
  token-weighted merge (``cap_claims``): its claim counts as the median's.

What it does with them is ``aggregation``: ``drop`` leaves out every named row (a ``low``
one only where every worker's share is equal; ``tokens`` is a claim, not a row) and divides
by the rows kept; ``clip`` scales a high row down to ``factor`` times the median norm
(``factor`` 1: Templar's clip of every peer to the median) and leaves out the others as
``drop`` does; ``trimmed`` and ``median`` are coordinate-wise (the mean without the
largest and smallest ``max(1, M // 4)`` values, or the median) over the rows, every row
named as above but none left out; ``mean`` is no guard at all. When no row is left out or
clipped, ``drop`` and ``clip`` give the plain mean's bits: kept rows are summed in rank order
as the mean is, and a row times 1 is itself.

What it decides is counted on the device (no host read at a sync) and read once, by
[`Guard.report`][loco.comm.guard.Guard.report], for the summary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

AGGREGATIONS = ("drop", "clip", "trimmed", "median", "mean")
"""``--aggregation``'s choices (see the module)."""
COORDINATEWISE = ("trimmed", "median")
"""The choices that combine coordinate by coordinate."""
DEFAULT_AGGREGATION = "drop"
DEFAULT_FACTOR = 4.0
"""The factor of the median norm beyond which a contribution is high (measured:
docs/security.md, "Choosing the default")."""
SIGNS = ("nonfinite", "high", "low", "stale", "mac", "tokens")
"""What the guard names a contribution for, in the order of its counters."""
PACE_MARGIN = 1.5
"""How much faster than the next fastest worker the fastest claim may set a round's pace
(``Guard.cap_claims``): one worker's claim alone cannot cut the others' steps by more than
a third."""
HISTORY = 256
"""Digests of each sender's past rows that a new row is compared with (``stale``)."""
STALE_MIN = 64
"""Rows of fewer values are not compared with the past (a short row may repeat honestly)."""


class Guard:
    """One worker's guard over the contributions of ``size`` workers (see the module).

    Args:
        aggregation: one of ``AGGREGATIONS``.
        factor: the factor of the median norm, >= 1.
        size: the workers M whose rows it combines.
        device: where its counters live (the Comm's device).

    Raises:
        ValueError: an unknown aggregation or a factor below 1.
    """

    def __init__(self, aggregation: str = DEFAULT_AGGREGATION, factor: float = DEFAULT_FACTOR,
                 size: int = 1, device: torch.device | str = "cpu"):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)} "
                             f"(got {aggregation!r})")
        if not factor >= 1:
            raise ValueError(f"the guard's factor must be >= 1 (got {factor!r})")
        self.aggregation, self.factor, self.size = aggregation, float(factor), size
        self.device = torch.device(device)
        self.step = 0
        """The inner step the rows belong to (kept up to date by the algorithm)."""
        shape = (size, len(SIGNS))
        self.counts = torch.zeros(shape, dtype=torch.int64, device=self.device)
        """Rows named, by sender and sign."""
        self.first = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.last = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self.acted = torch.zeros(size, dtype=torch.int64, device=self.device)
        """Rows left out or clipped, by sender."""
        self.peak = torch.zeros(size, dtype=torch.float32, device=self.device)
        """The largest ratio of a sender's finite row norm to the median it was judged by
        (what ``factor`` must stay above for an honest run to be left alone)."""
        self.compare_past = True
        """Whether rows are compared with their senders' past (``stale``): not in an elastic
        run, where a sync retried after a member is lost resends the same rows."""
        self.expect_all = True
        """Whether every worker is to contribute to the next average: a row of zeros is
        then named ``low`` (else it is what a worker that waits or joins sends)."""
        self.senders: list[int] = list(range(size))
        """The worker each row of the next average comes from (an elastic quorum's members)."""
        self.forged_next: torch.Tensor | None = None
        """Rows whose MAC failed, for the next ``judge`` (set by ``loco.comm.seal``)."""
        self.last_scales: torch.Tensor | None = None
        """The scale ``combine`` gave each row of the last average it formed."""
        self.last_left_out: torch.Tensor | None = None
        """Which rows of the last average ``combine`` formed it did not count
        (``left_out``)."""
        self._forged = torch.zeros(size, dtype=torch.bool, device=self.device)
        """The rows the last ``judge`` was told were forged (zeroed by the seal: left out
        even where zeros are not named)."""
        self._history = torch.full((size, HISTORY, 2), float("nan"), device=self.device)
        self._next = 0

    def nbytes(self) -> int:
        """Bytes of the tensors it keeps (counters and the digests' history), for a rank's
        memory accounting (``Comm.buffer_bytes``)."""
        kept = (self.counts, self.first, self.last, self.acted, self.peak, self._history)
        return sum(t.numel() * t.element_size() for t in kept)

    @property
    def active(self) -> bool:
        """Whether it checks anything (``aggregation`` is not ``mean``)."""
        return self.aggregation != "mean"

    @property
    def coordinatewise(self) -> bool:
        """Whether it combines coordinate by coordinate (``trimmed``, ``median``)."""
        return self.aggregation in COORDINATEWISE

    # ------------------------------------------------------------------------ judging
    def judge(self, norms: torch.Tensor, digests: torch.Tensor | None = None,
              forged: torch.Tensor | None = None, trusted: int | None = None
              ) -> torch.Tensor:
        """Name the rows that stand out, count them, and say what becomes of each.

        Args:
            norms: fp32, one row norm per sender, in rank order (on the device).
            digests: ``(M, 2)`` from ``digest``, compared with each sender's past rows; or
                None (not compared).
            forged: bool per row, whose MAC failed; or None (``forged_next``, if set).
            trusted: the row of the worker that judges, whose norm stands for the median
                (a pair has no median: each judges the other by itself); default None.

        Returns:
            The scale of each row: 1 for a row kept as it is, 0 for one left out, in (0, 1)
            for one clipped (``drop`` and ``clip``; otherwise all ones).
        """
        if forged is None and self.forged_next is not None:
            forged, self.forged_next = self.forged_next, None
        signs, median = self._signs(norms, digests, forged, trusted)
        self._count(signs, self.senders)
        return self._act(signs, norms, median)

    def _signs(self, norms: torch.Tensor, digests: torch.Tensor | None,
               forged: torch.Tensor | None, trusted: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's signs (rows × ``SIGNS``; a forged row, zeroed by the seal, is named
        ``mac`` only) and the median they were judged against; notes each sender's peak
        ratio to the median."""
        finite = torch.isfinite(norms)
        zero = norms == 0
        forged = torch.zeros_like(finite) if forged is None else forged.to(finite.device)
        self._forged = forged
        median = (self._median(norms, finite, zero) if trusted is None
                  else norms[trusted].nan_to_num(0.0, 0.0, 0.0))
        # fewer than three contributions cannot tell which is wrong (but one judging by itself)
        decides = (~zero).sum() >= 3 if trusted is None else torch.ones((), dtype=torch.bool)
        high = finite & (norms > self.factor * median) & decides
        ratio = torch.where(finite & (median > 0), norms / median, torch.zeros_like(norms))
        self.peak[self.senders] = torch.maximum(self.peak[self.senders], ratio.to(self.device))
        low = (finite & (norms * self.factor < median) & (~zero | self.expect_all) & decides
               & ~forged)
        stale = (self._stale(digests) if digests is not None and self.compare_past
                 else torch.zeros_like(finite))
        return torch.stack([~finite & ~forged, high, low, stale, forged,
                            torch.zeros_like(finite)], dim=1), median

    def _act(self, signs: torch.Tensor, norms: torch.Tensor, median: torch.Tensor
             ) -> torch.Tensor:
        """Each row's scale from its signs (see ``judge``), the rows acted on counted."""
        nonfinite, high, low, stale, forged, _ = signs.unbind(1)
        out = nonfinite | stale | forged
        if self.aggregation == "drop":  # (low: where equal shares are due; weighed merges
            out = out | high | (low & self.expect_all)  # of unequal steps only name it)
            scale = torch.ones_like(norms)
        elif self.aggregation == "clip":
            scale = torch.where(high, self.factor * median / norms, torch.ones_like(norms))
        else:
            return torch.ones_like(norms)
        self.acted[self.senders] += (out | high).to(self.device, torch.int64)
        return scale.masked_fill(out, 0.0)

    @staticmethod
    def _median(norms: torch.Tensor, finite: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The upper median of the norms of the rows that contribute (not zero; a
        non-finite one counts as the largest), on the device: a worker that waits or joins
        sends zeros, and must not pull the median down."""
        n = norms.numel()
        order = torch.sort(torch.where(finite, norms, torch.inf).masked_fill(zero, -1.0)).values
        nonzero = n - zero.sum()
        at = (n - nonzero + nonzero // 2).clamp(max=n - 1).view(1)  # (a tensor index: no read)
        return order.index_select(0, at)[0].clamp(min=0.0)

    def cap_claims(self, seconds: list[float]) -> list[float]:
        """Judge claimed speeds (``--local-steps proportional``), from which a round's
        steps are shared and a token-weighted merge weighs: a claim faster than the median
        claim times ``factor`` is named ``tokens`` and counts as the median's (a lie is
        void, not capped: a worker that claims to be 10 times as fast trains the median
        worker's share, and the others' shares stand); and the fastest claim left sets the
        round's pace only as far as ``PACE_MARGIN`` beyond the next fastest (one worker
        alone cannot cut every other one's steps by more, whatever it claims below the
        factor). The speeds cannot be checked (every worker waits for the slowest at a
        sync, so no one sees who arrived last); what a lie can do is bounded.

        Args:
            seconds: every worker's claimed seconds per step, host values (gathered and
                read already); 0: unknown.

        Returns:
            The claims as the schedule takes them.
        """
        known = sorted(t for t in seconds if t > 0)
        if len(known) < 3:  # two cannot tell which of them lies
            return list(seconds)
        # The lower median (of an even count the faster of the middle two): honest speeds
        # that differ widely put the upper one among the slow workers (speeds 1, 1, 0.5,
        # 0.33 on a shared CPU measured the fastest at 4.3 times faster than it).
        median = known[(len(known) - 1) // 2]
        liars = [m for m, t in enumerate(seconds) if 0 < t < median / self.factor]
        if liars:
            signs = torch.zeros((len(seconds), len(SIGNS)), dtype=torch.bool)
            signs[liars, SIGNS.index("tokens")] = True
            self._count(signs, list(range(len(seconds))))
            self.acted[liars] += 1
        claims = [median if m in liars else t for m, t in enumerate(seconds)]
        fastest, second = sorted(t for t in claims if t > 0)[:2]
        pace = max(fastest, second / PACE_MARGIN)
        return [max(t, pace) if t > 0 else t for t in claims]

    def left_out(self, scale: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """The rows ``judge`` left out that the mean must not count: all of them where every
        worker is to contribute, else those not of zeros (a worker that waits or joins sends
        zeros, and is not counted in the first place) and the forged ones (zeroed by the
        seal).

        Args:
            scale: ``judge``'s scales.
            norms: the rows' norms.
        """
        return (scale == 0) & ((norms != 0) | self.expect_all | self._forged)

    def _count(self, signs: torch.Tensor, senders: list[int]) -> None:
        """Count ``signs`` (rows × ``SIGNS``) against the rows' ``senders`` (passed, not
        read from ``self.senders``: the claims are judged on the training thread while
        the Comm's thread may be judging an average)."""
        every = torch.zeros(self.counts.shape, dtype=torch.bool, device=self.device)
        every[senders] = signs.to(self.device)
        step = torch.full_like(self.first, self.step)
        self.counts += every.to(torch.int64)
        self.first = torch.where(every & (self.first < 0), step, self.first)
        self.last = torch.where(every, step, self.last)

    def _stale(self, digests: torch.Tensor) -> torch.Tensor:
        """Whether each sender's row repeats one of its last ``HISTORY`` (``digests``:
        ``(M, 2)``, NaN: not compared); the new digests join the history."""
        history = self._history[self.senders]
        seen = ((history == digests[:, None, :]).all(dim=2).any(dim=1)
                & torch.isfinite(digests).all(dim=1))
        self._history[self.senders, self._next % HISTORY] = digests
        self._next += 1
        return seen

    @staticmethod
    def digest(norms: torch.Tensor, sums: torch.Tensor, width: int) -> torch.Tensor | None:
        """Each row's digest, ``(M, 2)``: its norm and the sum of its values (two fp32
        numbers that an honest new row matches only by a chance of about 2^-48), NaN for a
        row of zeros; None for rows too short to compare with the past (``STALE_MIN``).

        Args:
            norms: each row's norm.
            sums: each row's sum of values.
            width: values per row.
        """
        if width < STALE_MIN:
            return None
        d = torch.stack([norms, sums.to(norms.dtype)], dim=1)
        return d.masked_fill((norms == 0)[:, None], float("nan"))

    # ---------------------------------------------------------------------- combining
    def combine(self, rows: torch.Tensor, divisor: int, total: torch.Tensor,
                forged: torch.Tensor | None = None, trusted: int | None = None,
                effects: torch.Tensor | None = None) -> torch.Tensor:
        """The guarded mean of ``rows``: ``drop``/``clip``: the rows kept (scaled) summed in
        rank order and divided by ``divisor`` less the rows left out; ``trimmed``/
        ``median``: coordinate-wise over all rows.

        Args:
            rows: ``(M, c)``, one sender per row in rank order (overwritten).
            divisor: the workers that contribute (what the plain mean divides by).
            total: the ``(1, c)`` result, of ``rows``' dtype.
            forged: as for ``judge``.
            trusted: as for ``judge``.
            effects: the norms to judge the rows by, where a message holds more than the
                rows averaged (NoLoCo: what each member's Δ and φ together do to the
                judge's step); default: the rows' own norms.

        Returns:
            ``total``; ``last_scales`` and ``last_left_out`` say what became of each row.
        """
        norms = torch.linalg.vector_norm(rows, dim=1)
        digests = self.digest(norms, rows.sum(dim=1), rows.shape[1])
        scale = self.last_scales = self.judge(norms if effects is None else effects, digests,
                                              forged, trusted)
        left_out = self.last_left_out = self.left_out(scale, norms)
        if self.coordinatewise:  # a forged row (zeroed) sorts last, as a NaN, not as zeros
            return self.coordinatewise_mean(rows.masked_fill_(self._forged[:, None], math.nan),
                                            total)
        if self.aggregation == "clip":
            rows.mul_(scale[:, None]).nan_to_num_(0.0, 0.0, 0.0)  # (NaN × 0 is NaN)
        else:
            rows.masked_fill_((scale == 0)[:, None], 0.0)
        if rows.shape[0] == 1:
            total.copy_(rows)
        else:  # in rank order, as the plain mean (loco.comm.reduce._sum_rows)
            torch.add(rows[0], rows[1], out=total[0])
            for row in rows[2:]:
                total[0].add_(row)
        return total.div_((divisor - left_out.sum()).clamp(min=1))

    def coordinatewise_mean(self, rows: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``trimmed`` or ``median`` of the rows, per column.

        Args:
            rows: ``(M, c)``, one sender per row (a NaN sorts last: the largest).
            total: the ``(1, c)`` result.

        Returns:
            ``total``.
        """
        m = rows.shape[0]
        ordered = torch.sort(rows, dim=0).values  # NaN sorts last: the largest
        if self.aggregation == "median":
            mid = ordered[(m - 1) // 2:m // 2 + 1]
            return torch.mean(mid, dim=0, keepdim=True, out=total)
        cut = max(1, m // 4) if m >= 3 else 0
        return torch.mean(ordered[cut:m - cut], dim=0, keepdim=True, out=total)

    # ----------------------------------------------------------------------- reporting
    def report(self) -> list[dict]:
        """What it named, by sender and sign (a host read: at the end of a run): ``worker``,
        ``sign``, ``rows`` (how many of its rows, over every average this worker reduced),
        ``first_step`` and ``last_step``."""
        return named(self.counts, self.first, self.last)


def named(counts: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> list[dict]:
    """The rows of a guard's report (``Guard.report``; a host read) from its counters, by
    sender and sign: ``worker``, ``sign``, ``rows``, ``first_step``, ``last_step``.

    Args:
        counts: ``(workers, len(SIGNS))`` rows named.
        first: the first step each was named at (< 0: never).
        last: the last step.
    """
    counts, first, last = (t.to(torch.int64).tolist() for t in (counts, first, last))
    return [{"worker": w, "sign": sign, "rows": counts[w][k], "first_step": first[w][k],
             "last_step": last[w][k]}
            for w in range(len(counts)) for k, sign in enumerate(SIGNS) if counts[w][k]]


class Shield:
    """What a Comm does for trust around the averages it forms: the ``guard`` that judges
    the contributions it reduces and the ``injector`` that plays this worker's attacks
    (``loco.comm.attacks``; None for an honest worker). Set by the algorithm
    (``Algorithm.__init__``), which gives ``clock``, its inner step.

    Args:
        guard: the guard, or None (a plain mean).
        injector: this worker's attacks, or None.
        clock: returns the current inner step; default: always 0.
    """

    def __init__(self, guard: Guard | None = None, injector: Any = None,
                 clock: Callable[[], int] | None = None):
        self.guard = guard
        self.injector = injector
        self.clock = clock or (lambda: 0)
        self.all_contribute: Callable[[], bool] = lambda: True
        """Whether every worker is to contribute to the average being issued (the
        algorithm's answer: not where workers send zeros as they wait or join)."""

    @classmethod
    def build(cls, aggregation: str, factor: float, inject: str | None, worker: int,
              size: int, device: torch.device, clock: Callable[[], int]) -> "Shield":
        """The shield of one worker: a guard, and the attacks that are this worker's.

        Args:
            aggregation: as for ``Guard``.
            factor: as for ``Guard``.
            inject: ``--inject``'s text (every worker's attacks), or None.
            worker: this worker's index.
            size: the workers M.
            device: where the guard's counters live.
            clock: returns the current inner step.

        Raises:
            ValueError: a bad aggregation, factor or attack.
        """
        from loco.comm.attacks import Injector, parse_attacks

        mine = [a for a in parse_attacks(inject) if a.worker == worker]
        return cls(Guard(aggregation, factor, size, device),
                   Injector(mine, worker) if mine else None, clock)

    @property
    def judges(self) -> bool:
        """Whether averages must go where a receiver sees each contribution (a guard that
        checks): loco's reduce-scatter, not the transport's own all-reduce."""
        return self.guard is not None and self.guard.active

    def send(self, flat: torch.Tensor, step: int | None = None) -> int:
        """On the calling thread, as an average is issued: this worker's attacks on its
        contribution; returns the step, for ``at`` and ``wire``.

        Args:
            flat: this worker's contribution, changed in place.
            step: the inner step it belongs to; default the algorithm's clock.
        """
        step = self.clock() if step is None else step
        if self.injector is not None:
            self.injector.step = step
            self.injector.contribution(flat)
        return step

    def at(self, step: int, senders: Sequence[int]) -> Guard | None:
        """On the communication thread, as the average runs: the guard (None where it does
        not check), told the step and which worker sent each row.

        Args:
            step: the inner step the average belongs to.
            senders: the worker of each row (rank order).
        """
        if not self.judges:
            return None
        self.guard.step, self.guard.senders = step, list(senders)
        self.guard.expect_all = self.all_contribute()
        return self.guard

    def around(self, step: int | None, senders: Sequence[int]) -> tuple:
        """``(at(step, senders), wire(step))``, or ``(None, None)`` for an average that is
        not a training one.

        Args:
            step: the inner step, or None (not a training average).
            senders: as for ``at``.
        """
        if step is None:
            return None, None
        return self.at(step, senders), self.wire(step)

    def wire(self, step: int) -> Callable[[torch.Tensor], None] | None:
        """What flips bits in this worker's outgoing bytes (``bitflip``), or None.

        Args:
            step: the inner step the bytes belong to.
        """
        injector = self.injector
        if injector is None or not any(a.kind == "bitflip" for a in injector.attacks):
            return None

        def flip(payload: torch.Tensor) -> None:
            injector.step = step
            injector.wire(payload)
        return flip
