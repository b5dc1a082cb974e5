"""Speed-aware local steps (``--local-steps proportional``): every worker given a share of
each round by its speed, and, with asynchronous outer steps, its blocks of steps.

With speed-aware local steps (Async Local-SGD's "dynamic local updates", Liu et al. 2024,
arXiv 2401.09135) every round of H inner steps is H *ticks* for every worker, and worker i
trains on ``n_i`` of them, spread evenly and always on the round's last: ``n_i`` is H times
its speed over the fastest worker's, so that all reach the round's end together. Skipped
ticks cost nothing; syncs, evaluations and checkpoints stay at the same ticks everywhere. At
each round's end the workers gather their measured step times (one small all-gather) and
every worker derives every ``n_i`` of a later round from the same numbers (the next round
where the method waits for its sync there anyway, the one after where a sync may be in
flight): the schedule is agreed, whatever the speeds do meanwhile. The run's first round
is shared as it goes (``FirstRound``): every worker trains its ticks one after another,
sends its step time after the first few without waiting, and stops once it knows its
share, so that no worker waits for a slower one's first steps. A worker's pseudo-gradient
then weighs by the steps (tokens) behind it. With asynchronous outer steps a worker's
block of steps spans rounds (``loco.algorithms.asynchronous``).

On a GPU a tick's time is the device's (``DeviceSpan``); on a CPU the host's, less the time
the step was blocked on communication.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loco.comm.hostreads import allowed


class DeviceSpan:
    """A trained tick's compute on a GPU, on the device's clock: CUDA timing events around
    its forward and backward passes (the work that makes workers unequal; the step's waits
    for communication come later, in the algorithm's step), read once they have happened,
    never by waiting on a tick that does not sync.

    Args:
        device: the CUDA device whose current stream runs the tick.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(device))
        self.end = None

    def stop(self) -> DeviceSpan:
        """Mark the end of the timed work (on the same stream); returns the span."""
        self.end = torch.cuda.Event(enable_timing=True)
        self.end.record(torch.cuda.current_stream(self.device))
        return self

    def done(self) -> bool:
        """Whether the device has run the timed work (no wait)."""
        return self.end.query()

    def seconds(self) -> float:
        """The span's seconds (waits for its end: call it where the host may read)."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000


PROBE_TICKS = 3
"""With H >= 2 × this, in a fresh run that is not elastic: the ticks every worker trains
first, before it sends its step time (their mean, the first left out: it warms up) to
share the run's first round (``FirstRound``)."""


SLACK = 1.02
"""How far past the fastest worker's time a round's steps may reach (2%: the measure's
noise), so that a worker is given a step that ends just after the others' last one."""


SMOOTHING = 0.5
"""The weight of the past in the step time a worker reports: each round's mean step time
is averaged with the past rounds' (exponentially), so that one round's noise does not swing
the next round's shares."""


def fit(ticks: int, fastest: float, time: float) -> int:
    """How many of ``ticks`` a worker whose steps take ``time`` trains, so that it ends
    with the fastest worker (``fastest`` per step, training them all): as many as fit,
    ``max(1, ⌊SLACK · ticks · fastest / time⌋)``, rounded down, since a worker that ends
    late holds every other one at the sync, and one that ends early idles alone (and the
    slow workers hold the smaller share of the capacity); ``ticks`` where the time is
    unknown (0: it trained no tick)."""
    return max(1, min(ticks, int(SLACK * ticks * fastest / time))) if time > 0 else ticks


def shares(ticks: int, times: list[float]) -> list[int]:
    """Every worker's steps of ``ticks`` from their step ``times`` (``fit``; 0: unknown)."""
    known = [t for t in times if t > 0]
    fastest = min(known) if known else 0.0
    return [fit(ticks, fastest, t) for t in times]


class FirstRound:
    """The run's first round while its steps are being agreed (a fresh run that probes).

    Every worker trains the round's ticks one after another from the first. After the
    probe's p ticks it sends its step time (one all-gather, not waited for) and trains on.
    Once it has every worker's time (the slowest worker's come last, so that one has them
    at once) it knows its steps of the round, ``mine``: its share, as many as fit into the
    fastest worker's H (``fit``, at least p), or the ticks it has trained meanwhile if more
    (it could not know when to stop); it stops there. Where the steps are needed (the first
    sync past the probe, a checkpoint, the round's end) every worker sends its own
    (``agree``: collective, waited for), so a fast worker never waits for a slower one's
    probe, only for the sync it would wait for anyway.

    Args:
        comm: the Comm the times travel over (and the steps, in ``agree``).
        times: the all-gather of every worker's probe time, in flight.
        sync_every: H.
        probe: p, the ticks every worker trains before it sends its time.
        replica: this worker's index.
        shield: the Comm's shield (``loco.comm.guard.Shield``) or None: where its guard
            judges, claimed times are capped (``Guard.cap_claims``) and claimed steps held
            to what the times allow (``believable``).
    """

    def __init__(self, comm: Any, times: Any, sync_every: int, probe: int, replica: int,
                 shield: Any = None):
        self.comm, self._times, self.shield = comm, times, shield
        self.sync_every, self.probe, self.replica = sync_every, probe, replica
        self.times: list[float] | None = None
        """Every worker's probe time (seconds per step; 0: unknown), once arrived."""
        self.shares: list[int] | None = None
        """Every worker's share of the round, ``max(p, fit(H, fastest, time))``."""
        self.mine: int | None = None
        """This worker's steps of the round, once it has the times."""

    def heard(self, trained: int, wait: bool = False) -> bool:
        """Whether this worker has every worker's probe time: reads them if they have
        arrived (``wait``: waits for them) and fixes ``mine`` (its share, or ``trained``,
        the ticks it has trained so far, if more)."""
        if self.times is None and (wait or self._times.done()):
            with allowed("sync"):
                times = [float(t) for t in self._times.wait()]
            if self.shield is not None and self.shield.judges:
                times = self.shield.guard.cap_claims(times)
            self.times = times
            self.shares = [max(self.probe, n) for n in shares(self.sync_every, times)]
            self.mine = max(self.shares[self.replica], trained)
        return self.times is not None

    def agree(self, trained: int) -> list[int]:
        """Every worker's steps of the round (collective: every worker calls it at the same
        point; it first waits for the times, where they have not arrived, with ``trained``
        as in ``heard``)."""
        self.heard(trained, wait=True)
        mine = torch.tensor([float(self.mine)], dtype=torch.float64, device=self.comm.device)
        with allowed("sync"):
            claims = [round(float(n)) for n in self.comm.all_gather(mine, tag="train").wait()]
        return self.believable(claims)

    def believable(self, claims: list[int]) -> list[int]:
        """The steps as the schedule takes them: the claims; where the guard judges, each
        held between the worker's share and what it can have trained while the slowest
        worker probed (twice the ticks of its time in the slowest one's p, at most H)."""
        if self.shield is None or not self.shield.judges:
            return claims
        slowest, h = max(self.times), self.sync_every
        return [min(max(n, s), max(s, min(h, math.ceil(2 * self.probe * slowest / t))
                                    if t > 0 else h))
                for n, s, t in zip(claims, self.shares, self.times)]


class LocalSteps:
    """Speed-aware local steps: which ticks each worker trains on, round by round; with
    asynchronous outer steps, which syncs each worker contributes to.

    Args:
        sync_every: H, the ticks of a round.
        workers: M.
        replica: this worker's index.
        rounds: the steps per round of every worker so far (one list of M per round, from a
            checkpoint); default: none yet (a fresh run: the first round shared as it goes
            by the times of its first ``PROBE_TICKS`` ticks, ``FirstRound``; the second by
            them too).
        max_staleness: S, asynchronous outer steps: a worker's block of steps spans rounds
            until it holds H steps or S + 1 rounds, and its pseudo-gradient is sent at the
            sync that ends it, S outer steps old at most; 0 (default): every worker sends
            every round's steps (synchronous).
        last_round: the run's last full round (0-based): every block ends there; -1 (a run
            shorter than H): no probe.
        ahead: how many rounds after a round the one its times fix comes: 2 (default) where
            a sync may be in flight at a round's end (the gather is settled a round later,
            never waited for); 1 where the method waits for its sync at the round's end
            anyway (the workers meet there: the gather after it is waited for at once).
        quorum: with elastic membership, the ElasticComm: the step times travel with its
            quorums (no gather of their own, no probe: round r's fix round r + 1), a sync
            weighs the steps of the workers that contribute to it, and a worker's blocks
            start again where it joined; None (default): every worker is in every sync.
    """

    def __init__(self, sync_every: int, workers: int, replica: int,
                 rounds: list[list[int]] | None = None, max_staleness: int = 0,
                 last_round: int | None = None, ahead: int = 2, quorum: Any = None):
        self.sync_every, self.workers, self.replica = sync_every, workers, replica
        self.max_staleness, self.last_round, self.ahead = max_staleness, last_round, ahead
        self.quorum = quorum
        self.probe = (PROBE_TICKS if sync_every >= 2 * PROBE_TICKS and quorum is None
                      and (last_round is None or last_round >= 0) else 0)
        self.probing = rounds is None and self.probe > 0
        self.rounds = [list(r) for r in rounds or [[sync_every] * workers] * (
            1 if self.probing else 2)]
        """Every round's steps per worker, agreed so far; the times of round r fix round
        r + ``ahead``; a fresh run's first round is agreed after its probe
        (``agree_first``), the second shared by the probe's times (both H each where there
        is no probe)."""
        self.first: FirstRound | None = None
        """The first round's probe, from its last tick until its steps are agreed."""
        self.busy = 0.0  # this round's seconds of trained ticks, waits left out
        self._spans: list[DeviceSpan] = []  # this round's GPU ticks not yet in busy
        self.steps = 0  # this round's trained ticks
        self._pending: Any = None  # the gather of the last round's times, in flight
        self._shield: Any = None  # the slow link's (loco.comm.guard.Shield), from agree
        self._fixes = 0  # the round that gather fixes
        self.ticks_trained = 0  # in this run (since a resume)
        self.smoothed = 0.0  # this worker's step time, averaged over rounds (SMOOTHING)
        self.restarts: dict[int, int] = {}
        """Elastic: the round from which each worker that joined (or was healed) counts its
        blocks, by worker."""

    def counts(self, tick: int) -> list[int]:
        """Every worker's steps in the round of ``tick`` (1-based)."""
        return self.round_counts((tick - 1) // self.sync_every)

    def round_counts(self, r: int) -> list[int]:
        """Every worker's steps in round ``r`` (0-based); the first round's agreed
        (collective where they are not yet: ``agree_first``)."""
        if r == 0:
            self.agree_first()
        return self.rounds[r] if r < len(self.rounds) else [self.sync_every] * self.workers

    def trains(self, tick: int, worker: int | None = None) -> bool:
        """Whether ``worker`` (default this one) trains at ``tick``. In the run's first
        round a worker of n steps trains its first n ticks (``first_steps``); in a later
        one tick k (0-based in its round) when ``floor((k+1)·n/H) > floor(k·n/H)``: n ticks,
        spread evenly, the round's last among them."""
        h = self.sync_every
        if tick <= h:
            return tick <= self.probe or tick <= self.first_steps(worker)
        n, k = self.counts(tick)[self.replica if worker is None else worker], (tick - 1) % h
        return (k + 1) * n // h > k * n // h

    def first_steps(self, worker: int | None = None) -> int:
        """A worker's steps in the run's first round: this one's (``worker`` None or its
        index) as far as it knows (H while it has not the probe's times: it trains on),
        another one's agreed (collective where they are not yet: ``agree_first``)."""
        me = worker is None or worker == self.replica
        if self.first is not None and me:
            return self.first.mine if self.first.heard(self.ticks_trained) else self.sync_every
        return self.round_counts(0)[self.replica if worker is None else worker]

    def agree_first(self) -> None:
        """Agree on every worker's steps of the run's first round (``FirstRound.agree``:
        collective, waited for) and share the second by the probe's times; nothing where
        they are agreed already."""
        first, self.first = self.first, None
        if first is not None:
            self.rounds[0] = first.agree(self.ticks_trained)
            self.rounds[1:] = [shares(self.sync_every, first.times)]

    def steps_between(self, first: int, last: int, worker: int) -> int:
        """How many of the ticks ``first``..``last`` (inclusive) ``worker`` trains on."""
        return sum(self.trains(t, worker) for t in range(max(first, 1), last + 1))

    def block_steps(self, r: int, worker: int) -> int:
        """Asynchronous outer steps: the steps ``worker`` sends at round ``r``'s sync, the
        whole block that sync ends; 0 where its block goes on past it. A block ends at the
        first sync where it holds at least H steps, or spans S + 1 rounds, or at the run's
        last full round; a worker that joined (elastic) starts its blocks anew."""
        held = age = 0
        for q in range(r + 1):
            if q == self.restarts.get(worker):  # it joined: its blocks start anew
                held = age = 0
            held += self.round_counts(q)[worker]
            ends = (held >= self.sync_every or age >= self.max_staleness
                    or (self.last_round is not None and q >= self.last_round))
            if q == r:
                return held if ends else 0
            held, age = (0, 0) if ends else (held, age + 1)
        return 0

    def weight(self, tick: int, span: int) -> float:
        """This worker's weight in the average of a sync sent at ``tick`` that covers the
        ``span`` ticks before it: M times its share of the steps all workers send then
        (those trained in the span; asynchronous: their whole blocks), so that the mean of
        the weighted pseudo-gradients weighs each by its tokens (a token-weighted merge).
        0: this worker sends nothing at this sync (asynchronous: its block goes on)."""
        who = range(self.workers) if self.quorum is None else self.quorum.contributing
        if self.max_staleness:
            steps = {m: self.block_steps(tick // self.sync_every - 1, m) for m in who}
        else:
            steps = {m: self.steps_between(tick - span + 1, tick, m) for m in who}
        total = sum(steps.values())
        return len(steps) * steps.get(self.replica, 0) / total if total else 1.0

    def staleness(self, rounds: int) -> dict[int, int]:
        """Asynchronous outer steps: how many blocks, of all workers, ended in the first
        ``rounds`` rounds at each staleness (the outer steps the global copy took between
        a block's start and its sync: the rounds it spanned, less one)."""
        counts: dict[int, int] = {}
        for m in range(self.workers):
            start = 0
            for r in range(rounds):
                if self.block_steps(r, m):
                    counts[r - start] = counts.get(r - start, 0) + 1
                    start = r + 1
        return dict(sorted(counts.items()))

    def trained(self, seconds: float | DeviceSpan) -> None:
        """Count a trained tick of ``seconds`` (its time blocked on communication left out;
        the run's first tick, which warms up, not at all), or of a ``DeviceSpan`` (a GPU's
        tick, read when the round's times are gathered)."""
        self.ticks_trained += 1
        if self.probing and self.ticks_trained == 1:
            return
        if isinstance(seconds, DeviceSpan):
            self._spans.append(seconds)
        else:
            self.busy += seconds
        self.steps += 1

    def _read_spans(self, wait: bool) -> None:
        """Add the GPU ticks' device times to ``busy``: every one (``wait``, at a round's
        end, where the host may read), or those the device has run already."""
        left = []
        for span in self._spans:
            if wait or span.done():
                with allowed("sync"):
                    self.busy += span.seconds()
            else:
                left.append(span)
        self._spans = left

    def tick_done(self, comm: Any, tick: int) -> None:
        """After every tick: at the end of the run's first probe ticks, send this worker's
        time of them (``FirstRound``, not waited for); at a round's end, start the gather
        that fixes the round ``ahead`` of it (``agree``; settled at once where ``ahead`` is
        1)."""
        if self.quorum is not None:
            return self.heard(tick)
        if self.probing and tick == self.probe:
            self.probing = False
            self._read_spans(wait=True)
            # the probe's mean: the first guess at this worker's time, for the first round's
            # shares; the round's own mean at its end counts these ticks and the later ones
            # alike (the guess is not averaged in as if it were a round of its own)
            handle = self._post(comm, self.busy / self.steps if self.steps else 0.0)
            self.first = FirstRound(comm, handle, self.sync_every, self.probe, self.replica,
                                    self._shield)
        elif tick % self.sync_every == 0:
            self.agree(comm, tick // self.sync_every - 1 + self.ahead)
            if self.ahead == 1:
                self.settle()

    def heard(self, tick: int) -> None:
        """Elastic, after every tick: leave this worker's step time so far (in µs) for the
        next quorum to carry; at a round's end, after its sync's quorum: the workers that
        did not contribute to it (just joined, or healed) start their blocks with the next
        round, which every member's time from that quorum fixes (absent workers: H)."""
        if tick % self.sync_every == 0:  # a round's end: every GPU tick of it is read
            self._read_spans(wait=True)
        mine = self._smoothed()
        self.quorum.note = round(mine * 1e6)
        if tick % self.sync_every:
            return
        r = tick // self.sync_every - 1
        self.rejoined(r)
        self.smoothed, self.busy, self.steps = mine, 0.0, 0
        times = [self.quorum.notes.get(m, 0) / 1e6 for m in range(self.workers)]
        while len(self.rounds) <= r:
            self.rounds.append([self.sync_every] * self.workers)
        self.rounds[r + 1:] = [shares(self.sync_every, times)]

    def rejoined(self, r: int) -> None:
        """Elastic, after round ``r``'s sync: its members that did not contribute to it
        (they just joined, or were healed) start their blocks with round r + 1."""
        for m in set(self.quorum.members) - set(self.quorum.contributing):
            self.restarts[m] = r + 1

    def heal_state(self) -> dict:
        """What a worker that joins takes from a live one (elastic): the rounds and the
        restarts."""
        return {"rounds": [list(r) for r in self.rounds], "restarts": dict(self.restarts)}

    def load_heal_state(self, state: dict) -> None:
        """Take a live worker's ``heal_state``."""
        self.rounds = [list(r) for r in state["rounds"]]
        self.restarts = {int(k): int(v) for k, v in state["restarts"].items()}

    def agree(self, comm: Any, fixes: int) -> None:
        """At a round's end: start gathering every worker's mean step time of the round
        (one float each over ``comm``, counted as training bytes: the method sends it), to
        fix round ``fixes``; first settle the previous round's gather, which has long
        arrived. Collective: every worker calls it at the same ticks."""
        self.settle()
        self._gather(comm, fixes)

    def _smoothed(self) -> float:
        """This round's mean step time so far averaged with the earlier rounds'
        (``SMOOTHING``); either alone where the other is unknown (0)."""
        self._read_spans(wait=False)
        mean = self.busy / self.steps if self.steps else 0.0
        return (SMOOTHING * self.smoothed + (1 - SMOOTHING) * mean if mean and self.smoothed
                else mean or self.smoothed)

    def _post(self, comm: Any, seconds: float) -> Any:
        """Start gathering every worker's step time, this one's ``seconds`` (a claim: the
        Comm's shield may play a lie, and judges the claims); returns the handle."""
        self._shield = getattr(comm, "shield", None)  # what lies (an attack), what caps lies
        if self._shield is not None and self._shield.injector is not None:
            self._shield.injector.step = self._shield.clock()
            seconds = self._shield.injector.claim(seconds)
        return comm.all_gather(
            torch.tensor([seconds], dtype=torch.float64, device=comm.device), tag="train")

    def _gather(self, comm: Any, fixes: int) -> None:
        self._read_spans(wait=True)
        mine = self.smoothed = self._smoothed()
        self._pending = self._post(comm, mine)
        self._fixes = fixes
        self.busy, self.steps = 0.0, 0

    def settle(self) -> None:
        """Agree on the first round where it is not yet (``agree_first``), then fix the
        round the gather in flight decides (waiting for it): before the next gather, and
        before a checkpoint saves ``rounds`` (``fit``)."""
        self.agree_first()
        if self._pending is None:
            return
        times = [float(t) for t in self._pending.wait()]
        self._pending = None
        if self._shield is not None and self._shield.judges:
            times = self._shield.guard.cap_claims(times)
        counts = shares(self.sync_every, times)
        while len(self.rounds) < self._fixes:  # a checkpoint taken before the probe
            self.rounds.append([self.sync_every] * self.workers)
        self.rounds[self._fixes:] = [counts]

    def steps_until(self, tick: int) -> int:
        """Steps every worker together trained in ticks 1..``tick``. In the run's first
        round, while its steps are not agreed, those known so far (nothing is gathered):
        this worker's own, another's probe, or its share once the times are in."""
        h = self.sync_every
        if self.first is None:
            first = self.rounds[0]
        else:
            first = (list(self.first.shares) if self.first.heard(self.ticks_trained)
                     else [self.probe] * self.workers)
            first[self.replica] = self.first_steps()
        total = sum(min(tick, n) for n in first)
        done = tick // h
        total += sum(sum(self.round_counts(r)) for r in range(1, done))
        return total + sum(self.steps_between(max(done * h, h) + 1, tick, m)
                           for m in range(self.workers))


__all__ = ["PROBE_TICKS", "SLACK", "SMOOTHING", "DeviceSpan", "FirstRound", "LocalSteps",
           "fit", "shares"]
