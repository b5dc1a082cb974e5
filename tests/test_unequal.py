"""Workers of unequal speed: the emulation (``--worker-speed``), its checks, and the
goodput each run reports."""

import json

import pytest
import torch
from test_cli import small_run
from workers import batch, make_model, max_diff, once, params_of, smooth_optimizer, ulps

import loco
from loco.algorithms.asynchronous import BlockStarts
from loco.cli import main
from loco.config import ConfigError, build_config, worker_speeds
from loco.training import emulation
from loco.training.goodput import goodput
from loco.training.local_steps import FirstRound, LocalSteps, fit


@pytest.mark.parametrize("value,workers,message", [
    ("1,2", 2, "in (0, 1]"), ("1,0", 2, "in (0, 1]"), ("1,fast", 2, "in (0, 1]"),
    ("1,0.5", 3, "one factor per worker: 3"), ("1", 2, "one factor per worker: 2")])
def test_bad_worker_speeds_are_refused_naming_the_option(value, workers, message):
    cfg = build_config(overrides={"worker_speed": value, "workers": workers})
    with pytest.raises(ConfigError, match=r"^--worker-speed: ") as e:
        worker_speeds(cfg)
    assert message in str(e.value)


def test_worker_speeds_parse_one_factor_per_worker():
    cfg = build_config(overrides={"worker_speed": "1, 1,0.5,0.33", "workers": 4})
    assert worker_speeds(cfg) == (1.0, 1.0, 0.5, 0.33)
    assert worker_speeds(build_config()) is None


class Clock:
    """A stand-in for ``time``: compute advances it by ``work`` seconds, sleeps are kept."""

    def __init__(self, work):
        self.now, self.work, self.slept = 0.0, work, []

    def perf_counter(self):
        self.now += self.work  # one call before the step, one after: ``work`` apart
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)


@pytest.mark.parametrize("factor,pause", [(0.25, 0.6), (0.5, 0.2), (1.0, None)])
def test_a_slow_worker_sleeps_the_rest_of_its_longer_step(monkeypatch, factor, pause):
    """Speed s: after a step's compute of c seconds it sleeps (1/s − 1)·c, counted in the
    loop's throttle seconds; speed 1 sleeps never (and takes no time)."""
    clock = Clock(work=0.2)
    monkeypatch.setattr(emulation, "time", clock)
    loop = type("Loop", (), {"throttle_seconds": 1.0})()
    with emulation.Throttle(factor, torch.device("cpu")).compute(loop):
        pass
    assert clock.slept == ([] if pause is None else [pytest.approx(pause)])
    assert loop.throttle_seconds == pytest.approx(1.0 + (pause or 0))


def counters(train, blocked, trained, applied):
    return {"train_seconds": train, "blocked_seconds": blocked, "trained_steps": trained,
            "applied_steps": applied}


def test_goodput_of_the_synchronous_barrier_is_the_slowest_share():
    """Speeds 1, 1, 1/2, 1/3, natural steps of 1 s, 10 steps in lockstep (30 s): the fast
    workers wait 20 s and 15 s; goodput 40 / (30 + 30 + 15 + 10) = 4·(1/3) / (17/6)."""
    ranks = [counters(30, 20, 10, 10), counters(30, 20, 10, 10), counters(30, 10, 10, 10),
             counters(30, 0, 10, 10)]
    g = goodput(ranks, [[0], [1], [2], [3]])
    assert g["total"] == pytest.approx(4 * (1 / 3) / (17 / 6), abs=1e-4)
    assert g["per_worker"] == [pytest.approx(1 / 3, abs=1e-4)] * 2 + [
        pytest.approx(2 / 3, abs=1e-4), 1.0]
    assert g["step_seconds"] == [1.0, 1.0, 2.0, 3.0]
    # steps discarded count against it; a worker of two ranks sums them
    g = goodput([counters(10, 0, 10, 5), counters(10, 0, 10, 10)], [[0, 1]])
    assert g["total"] == g["per_worker"][0] == 0.75
    # the lead's 2 s of evaluation, which the other waited out (blocked), leave the wall
    g = goodput([counters(10, 0, 10, 10), counters(12, 2, 10, 10)], [[0], [1]], held=2)
    assert g["total"] == 1.0
    # worker 1 reached that sync 1.5 s late and waited only 0.5 s of the 2: busy 11.5 s,
    # more than the 10 s left once the evaluation is out; the wall is then its busy time
    # (goodput above 1 before), and the lead's share is 10 / 11.5
    g = goodput([counters(10, 0, 10, 10), counters(12, 0.5, 10, 10)], [[0], [1]], held=2)
    assert g["per_worker"] == [round(10 / 11.5, 4), 1.0] and g["step_seconds"] == [1.0, 1.15]


def test_a_worker_trains_the_steps_that_fit_into_the_fastest_ones_round():
    """Rounded down (a step that ends late holds everyone), with 2% slack for the noise,
    at least 1, at most the ticks; all of them where the time is unknown."""
    assert [fit(20, 0.1, t) for t in (0.1, 0.2, 0.3, 0.15, 0.101, 5.0, 0.0)] == [
        20, 10, 6, 13, 20, 1, 20]


def test_a_run_with_a_slow_worker_records_its_speed_and_its_goodput(corpus, tmp_path):
    """Worker 1 at half speed: it sleeps as long as its forward and backward passes took
    (at most half its busy time), the summary records the speeds, every step as trained
    and applied, and the goodput of what was recorded. Nothing here compares two measured
    durations, which a busy machine can reorder (the fast worker's share of a loaded CPU
    may be the smaller): goodput's formula is held to the recorded times, whatever they
    were today (``test_goodput_of_the_synchronous_barrier_is_the_slowest_share`` holds it
    to hand-written ones)."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--worker-speed", "1,0.5", "--algorithm",
                          "diloco")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["worker_speeds"] == [1.0, 0.5]
    fast, slow = s["per_worker"]
    assert fast["throttle_seconds"] == 0 and slow["throttle_seconds"] > 0
    # the pause is the measured forward and backward time x (1/0.5 - 1): within its busy time
    assert slow["throttle_seconds"] <= (slow["train_seconds"] - slow["blocked_seconds"]) / 2
    assert fast["trained_steps"] == slow["trained_steps"] == fast["applied_steps"] == 12
    held = s["eval_seconds"] + s["diagnostic_seconds"]
    assert s["goodput"] == goodput(s["per_worker"], [[0], [1]], held)
    assert 0 < s["goodput"]["total"] <= 1 and all(0 < g <= 1 for g in s["goodput"]["per_worker"])


# ---------------------------------------------------------------- speed-aware local steps
def test_a_worker_of_n_steps_trains_on_n_ticks_of_each_round_the_last_among_them():
    """In the run's first round a worker of n steps trains the first n ticks; in a later
    round n of the H ticks, evenly, the round's last among them (literal tables)."""
    plan = LocalSteps(10, 3, 0, rounds=[[10, 5, 4], [10, 5, 3], [10, 1, 7]])
    trained = [[t for t in range(1, 31) if plan.trains(t, m)] for m in range(3)]
    assert trained == [list(range(1, 31)),
                       [1, 2, 3, 4, 5, 12, 14, 16, 18, 20, 30],
                       [1, 2, 3, 4, 14, 17, 20, 22, 23, 25, 26, 28, 29, 30]]
    assert plan.steps_until(30) == 10 + 5 + 4 + 10 + 5 + 3 + 10 + 1 + 7
    assert plan.steps_until(35) == plan.steps_until(30) + 3 * 5  # later rounds: H each
    assert plan.steps_until(7) == 7 + 5 + 4
    # weights: M times the worker's share of the steps of the ticks a sync covers
    assert plan.weight(20, 10) == pytest.approx(3 * 10 / 18)
    assert LocalSteps(10, 3, 2, rounds=[[10, 5, 4]]).weight(10, 10) == pytest.approx(
        3 * 4 / 19)


class Gathers:
    """A stand-in Comm whose all-gathers return the given rows, one per call, and keep what
    this worker sent. A row arrives when ``arrived`` counts it (default: at once)."""

    device = "cpu"

    def __init__(self, *rows, arrived=None):
        self.rows, self.sent, self.arrived, self.early = list(rows), [], arrived, 0
        """``early``: how often this worker waited for a row that had not arrived."""

    @property
    def calls(self):
        return len(self.sent)

    def all_gather(self, tensor, tag):
        self.sent.append(float(tensor))
        i, box = len(self.sent) - 1, self

        class Handle:
            def done(self):
                return box.arrived is None or box.arrived > i

            def wait(self):
                if box.arrived is not None and box.arrived <= i:
                    box.early, box.arrived = box.early + 1, i + 1
                return [torch.tensor([v]) for v in box.rows[i]]
        return Handle()


def test_the_times_of_round_r_fix_round_r_plus_2_the_same_on_every_worker():
    """Rounds 0 and 1 train H each; the step times gathered at round r's end give round
    r + 2 ``round(H · fastest / time)`` steps (at least 1), without waiting for the gather
    (it is settled at the next round's end, or before a checkpoint)."""
    comm = Gathers([0.1, 0.2, 0.4], [0.1, 0.1, 5.0])
    plan = LocalSteps(4, 3, 0)  # H < 6: too short to probe
    plan.trained(0.1)
    plan.tick_done(comm, 4)  # the end of round 0: gathered, not waited for
    assert plan.rounds == [[4, 4, 4]] * 2
    plan.tick_done(comm, 8)  # the end of round 1: round 0's times fix round 2
    assert plan.rounds[2] == [4, 2, 1]
    plan.settle()  # before a checkpoint: round 1's times fix round 3
    assert plan.rounds[3] == [4, 4, 1]
    assert comm.calls == 2


def probe(plan, comm, seconds=(0.9, 0.1, 0.1)):
    """The run's first 3 ticks of ``plan``: trained (the first, a warm-up, not timed)."""
    for t, s in enumerate(seconds, 1):
        assert plan.trains(t)
        plan.trained(s)
        plan.tick_done(comm, t)


def test_a_fast_worker_trains_on_until_the_probe_times_arrive():
    """H = 12, worker 0 the fastest of three: after the probe's 3 ticks it sends its mean
    time (the first left out) and trains on, not waiting; the times arrive after its 7th
    tick: its share is all 12 (``fit``: 1.02 · 12 · 0.1 / t, at least the probe's 3: 12, 6,
    3); its steps are agreed at the first sync past the probe (a second gather; worker 1
    trained 7 before the times reached it), and round 1 is shared by the probe's times.
    Until then the tokens count what is known: its own ticks, the others' probe, then
    their shares."""
    comm = Gathers([0.1, 0.2, 0.35], [12, 7, 3], arrived=0)
    plan = LocalSteps(12, 3, 0)
    probe(plan, comm)
    assert comm.sent == [pytest.approx(0.1)]
    for t in range(4, 8):
        assert plan.trains(t)
        plan.trained(0.1)
        plan.tick_done(comm, t)
    assert plan.steps_until(7) == 7 + 3 + 3 and comm.early == 0  # it never waited
    comm.arrived = 1
    assert plan.trains(8) and plan.first.mine == 12 and plan.steps_until(9) == 9 + 6 + 3
    assert comm.calls == 1
    assert plan.weight(12, 12) == pytest.approx(3 * 12 / (12 + 7 + 3))  # the sync agrees
    assert comm.sent[1] == 12 and plan.rounds == [[12, 7, 3], [12, 6, 3]]
    assert [t for t in range(13, 25) if plan.trains(t, 2)] == [16, 20, 24]


def test_the_first_rounds_time_counts_the_probes_ticks_as_any_other():
    """The probe's mean (its 2nd and 3rd ticks) is only the first guess, for the first
    round's shares: the time sent at the round's end is the mean over all its timed ticks,
    the probe's among them, not half the probe's and half the rest's (a probe of 2 noisy
    ticks weighed as much as the round's other 9 held a worker's shares down for rounds)."""
    comm = Gathers([0.1, 0.2, 0.35], [12, 6, 3], [0.1, 0.2, 0.35])
    plan = LocalSteps(12, 3, 0)
    probe(plan, comm)
    for t in range(4, 13):
        assert plan.trains(t)
        plan.trained(0.4)
        plan.tick_done(comm, t)
    assert comm.sent == pytest.approx([0.1, 12, (2 * 0.1 + 9 * 0.4) / 11])


@pytest.mark.parametrize("replica,arrives_after,steps", [
    (2, 3, 3),  # the slowest: the times arrive as it sends its own; it stops at its share
    (1, 3, 6),  # in time: its share, 6 of the round's ticks, the first 6
    (1, 8, 8)])  # late: it trained 8 meanwhile, more than its share; all 8 count
def test_a_slower_worker_stops_at_its_share_or_where_the_times_reached_it(replica,
                                                                          arrives_after, steps):
    comm = Gathers([0.1, 0.2, 0.35], [12, steps, 3] if replica == 1 else [12, 6, steps],
                   arrived=0)
    plan = LocalSteps(12, 3, replica)
    probe(plan, comm, (0.9, 0.35, 0.35) if replica == 2 else (0.9, 0.2, 0.2))
    for t in range(4, 13):
        if t == arrives_after + 1:
            comm.arrived = 1
        if plan.trains(t):
            plan.trained(0.2)
        plan.tick_done(comm, t)
    assert plan.ticks_trained == steps and comm.sent[1] == steps
    assert plan.rounds[0][replica] == steps


def test_a_checkpoint_in_the_first_round_agrees_on_it_and_resumes_with_it():
    """``settle`` (before a checkpoint) agrees on the first round; a plan built from the
    saved rounds trains the same ticks of it as the run that went on."""
    comm = Gathers([0.1, 0.2, 0.35], [12, 6, 3])
    plan = LocalSteps(12, 3, 1)
    probe(plan, comm, (0.9, 0.2, 0.2))
    plan.settle()
    resumed = LocalSteps(12, 3, 1, rounds=plan.rounds)
    assert not resumed.probing and resumed.first is None
    assert [resumed.trains(t) for t in range(1, 25)] == [plan.trains(t) for t in range(1, 25)]
    assert [t for t in range(1, 25) if resumed.trains(t)] == [1, 2, 3, 4, 5, 6, 14, 16, 18, 20,
                                                               22, 24]


def test_where_the_guard_judges_claimed_first_round_steps_are_held_to_the_times():
    """A claim of the first round's steps counts between the worker's share and twice the
    ticks its time fits into the slowest worker's probe (at most H): claims of 12 from
    workers of shares 12, 6, 3 and times 0.1, 0.2, 0.35 count as 12, ceil(2.1 / 0.2) = 11
    and ceil(2.1 / 0.35) = 6; a claim below the share counts as the share."""
    from types import SimpleNamespace

    guard = SimpleNamespace(cap_claims=lambda times: times)
    first = FirstRound(None, None, 12, 3, 0, SimpleNamespace(judges=True, guard=guard))
    first.times, first.shares = [0.1, 0.2, 0.35], [12, 6, 3]
    assert first.believable([12, 12, 12]) == [12, 11, 6]
    assert first.believable([12, 1, 4]) == [12, 6, 4]
    first.shield = None
    assert first.believable([12, 12, 12]) == [12, 12, 12]


# -------------------------------------------------------- against the papers, in one process
# Speed-aware local steps are Async Local-SGD's dynamic local updates (Liu et al. 2024, arXiv
# 2401.09135): worker m trains n_m steps a round, by its speed. Its pseudo-gradient is
# weighed by them, and with asynchronous outer steps a worker's block of steps spans rounds
# and merges when it ends, from the global copy it began at: Decoupled DiLoCo's
# token-weighted merge of the contributions that arrived (arXiv 2604.21428),
#
#     Δ_m = θ^g(m's block start) − θ_m,   Δ̄ = Σ_m n_m Δ_m / Σ_m n_m
#
# (synchronous: every worker, its block the H ticks up to the send, from the current θ^g),
# then the outer Nesterov step, and θ_m ← α θ_m + (1 − α) θ^g τ ticks later for the
# workers whose block ended (synchronous: every one), a new block starting there. The ticks each
# worker trains and the blocks each sync merges are literal tables, worked out by hand from
# the rules the docs state (a worker of n steps trains the first n ticks of the run's first
# round, then n spread evenly, each stretch's last; a block ends once it holds H steps,
# spans S + 1 rounds or reaches the run's last round), not the library's formulas.

UH = 12  # H
OUTER_LR, OUTER_MU = 0.4, 0.5  # (μ = 0.9 here turns an ulp into thousands by round 5)
# Streaming DiLoCo, P = 2 on the 4-block test model, dealt "strided": by name prefix; the
# fragment sent after tick t, by t % H (the paper's send at (p + 1) H / P)
FRAGMENTS = {1: [("",)], 2: [("embed.", "blocks.0.", "blocks.2."),
                             ("blocks.1.", "blocks.3.", "norm.")]}
SENDS = {1: {0: 0}, 2: {6: 0, 0: 1}}

AWARE_STEPS = 3 * UH + 5  # three rounds and a part (round 3: H each)
AWARE_ROUNDS = [[12, 5, 3], [12, 6, 1], [12, 4, 12]]  # what loco is given
AWARE_TICKS = [  # the ticks each worker trains
    range(1, 42),
    [1, 2, 3, 4, 5, 14, 16, 18, 20, 22, 24, 27, 30, 33, 36, 37, 38, 39, 40, 41],
    [1, 2, 3, 24, *range(25, 37), 37, 38, 39, 40, 41]]  # (no tick in 7..18: weight 0 at 18)

# Asynchronous outer steps, one fragment: rounds of H = 6 are enough. Worker 1's blocks end
# holding more than H (7 at round 1) and exactly H; worker 2's at S + 1 rounds (S = 1), at
# both at once (S = 2, round 2: 7 steps in 3 rounds), and at the run's last round.
ASYNC_H = 6
ASYNC_STEPS = 5 * ASYNC_H
ASYNC_ROUNDS = [[6, 4, 3], [6, 3, 2], [6, 3, 2], [6, 3, 2], [6, 6, 2]]
ASYNC_TICKS = [
    range(1, 31),
    [*range(1, 5), *range(8, 25, 2), *range(25, 31)],
    [1, 2, 3, *range(9, 31, 3)]]
BLOCKS = {  # S -> every worker's blocks: {the round whose sync ends one: its steps}
    1: [dict.fromkeys(range(5), 6), {1: 7, 3: 6, 4: 6}, {1: 5, 3: 4, 4: 2}],
    2: [dict.fromkeys(range(5), 6), {1: 7, 3: 6, 4: 6}, {2: 7, 4: 4}]}
# Rounding: the reference sums Σ n_m Δ_m / N by name; loco weighs each Δ_m by M n_m / N and
# averages, and its outer step and merge are fused kernels: an ulp or two of the values,
# which the inner AdamW (eps 1e-3: tests/workers.py) carries on without blowing them up.
UTOL = 16


def planned(ctx, steps, rounds, fragments=1, overlap=0, alpha=0.0, staleness=0, h=UH):
    """DiLoCo (P = 1) or Streaming DiLoCo on the test model, AdamW with eps 1e-3, H = ``h``,
    its ticks and weights from loco's plan of ``rounds``; returns the global copy."""
    model = make_model(layers=4)
    kw = dict(sync_every=h, codec="fp32", outer_lr=OUTER_LR, outer_momentum=OUTER_MU)
    algo = (loco.DiLoCo(model, smooth_optimizer(model), ctx.comm, **kw) if fragments == 1 else
            loco.StreamingDiLoCo(model, smooth_optimizer(model), ctx.comm, fragments=fragments,
                                 overlap=overlap, alpha=alpha, **kw))
    plan = LocalSteps(h, ctx.comm.size, ctx.rank, rounds=rounds, max_staleness=staleness,
                      last_round=steps // h - 1)
    algo.pacing.weight_of = plan.weight
    if staleness:
        algo.keep_block_starts()
    for t in range(1, steps + 1):
        if plan.trains(t):
            x, y = batch(ctx.rank, t - 1)
            model(x, y).backward()
            algo.step()
            algo.zero_grad()
        else:
            algo.idle_step()
    algo.flush()
    return params_of(algo.global_parameters())


def reference(steps, ticks, fragments=1, overlap=0, alpha=0.0, blocks=None, h=UH):
    """The boxes above in one process, H = ``h``, the workers training at ``ticks``; with
    ``blocks``, asynchronous outer steps (one fragment). Returns the global copy by name."""
    M = len(ticks)
    models = [make_model(layers=4) for _ in range(M)]
    opts = [smooth_optimizer(m) for m in models]
    named = [dict(m.named_parameters()) for m in models]
    groups = [[n for n in named[0] if n.startswith(prefixes)] for prefixes in
              FRAGMENTS[fragments]]
    glob = {n: p.detach().clone() for n, p in named[0].items()}
    velocity = {n: torch.zeros_like(p) for n, p in glob.items()}
    start = [dict(glob) for _ in range(M)]  # θ^g where each worker's block began
    held, merges = [0] * M, []  # steps in each worker's block; (tick, fragment, workers)
    for t in range(1, steps + 1):
        for m in range(M):
            if t in ticks[m]:
                x, y = batch(m, t - 1)
                models[m](x, y).backward()
                opts[m].step()
                opts[m].zero_grad()
                held[m] += 1
        p = SENDS[fragments].get(t % h)
        if p is not None:
            if blocks is None:
                n = [sum(t - h < u <= t for u in ticks[m]) for m in range(M)]
                origin, merged = [glob] * M, range(M)
            else:
                n = [blocks[m].get(t // h - 1, 0) for m in range(M)]
                origin, merged = start, [m for m in range(M) if n[m]]
                assert all(n[m] == held[m] for m in merged), "the tables disagree"
            with torch.no_grad():
                for name in groups[p]:
                    mean = sum(n[m] * (origin[m][name] - named[m][name]) for m in merged
                               ) / sum(n)
                    velocity[name] = OUTER_MU * velocity[name] + mean
                    glob[name] = glob[name] - OUTER_LR * (mean + OUTER_MU * velocity[name])
            merges.append((t + overlap, p, merged))
        for q, merged in [(q, w) for due, q, w in merges if due == t]:
            with torch.no_grad():
                for m in merged:
                    for name in groups[q]:
                        named[m][name].copy_(alpha * named[m][name] + (1 - alpha) * glob[name])
            if blocks is not None:
                for m in merged:
                    start[m], held[m] = dict(glob), 0
    return glob


def compare(out, ref):
    for got in out:
        assert max_diff(got, ref) <= ulps(ref, UTOL), max_diff(got, ref)


@pytest.mark.numerics
@pytest.mark.parametrize("fragments,overlap,alpha", [(1, 0, 0.0), (2, 1, 0.5)])
def test_speed_aware_local_steps_match_the_box(fragments, overlap, alpha):
    """DiLoCo and Streaming DiLoCo (P = 2, τ = 1, α = 0.5) with a plan of steps per round:
    the workers train at the table's ticks and each pseudo-gradient weighs by its steps in
    the H ticks up to its send; a worker with none there (worker 2 at tick 18) weighs 0 and
    still takes the new global copy."""
    out = loco.launch(planned, 3, args=(AWARE_STEPS, AWARE_ROUNDS, fragments, overlap, alpha))
    compare(out, once(reference, AWARE_STEPS, AWARE_TICKS, fragments, overlap, alpha))


@pytest.mark.numerics
@pytest.mark.parametrize("staleness", [1, 2])
def test_asynchronous_outer_steps_match_the_box(staleness):
    """DiLoCo with asynchronous outer steps, S = 1 and 2: the table's blocks merge from the
    global copy they began at, token-weighted among those ending at the same sync."""
    out = loco.launch(planned, 3, args=(ASYNC_STEPS, ASYNC_ROUNDS, 1, 0, 0.0, staleness,
                                       ASYNC_H))
    compare(out, once(reference, ASYNC_STEPS, ASYNC_TICKS, blocks=BLOCKS[staleness],
                      h=ASYNC_H))


def _spread_first_round(orig):
    def trains(self, tick, worker=None):  # the first round spread like the later ones
        n = self.round_counts((tick - 1) // self.sync_every)[
            self.replica if worker is None else worker]
        k = (tick - 1) % self.sync_every
        return (k + 1) * n // self.sync_every > k * n // self.sync_every
    return trains


def _plain_mean(orig):
    def weight(self, tick, span):
        return 1.0
    return weight


def _late_block_end(orig):
    def block_steps(self, r, worker):  # a block of S + 1 rounds ends a round later
        self.max_staleness += 1
        try:
            return orig(self, r, worker)
        finally:
            self.max_staleness -= 1
    return block_steps


def _from_the_current_copy(orig):
    def of(self, fragment):
        return fragment.global_flat
    return of


MISTAKES = {  # name -> (the class, its method replaced, the replacement given the original)
    "speed-aware: the first round spread like the later ones": (
        LocalSteps, "trains", _spread_first_round),
    "speed-aware: a plain mean, not weighed by steps": (LocalSteps, "weight", _plain_mean),
    "asynchronous: a block of S + 1 rounds ends a round late": (
        LocalSteps, "block_steps", _late_block_end),
    "asynchronous: Δ taken from the current global copy, not the block's start": (
        BlockStarts, "of", _from_the_current_copy)}


@pytest.mark.numerics
@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_mistake_is_caught(mistake, monkeypatch):
    """Each mistake, planted in the library for the run, takes the global copy far outside
    the tolerance of the box's reference: the reference can fail. (The references are the
    box tests' above, computed once: they do not depend on the library.)"""
    cls, method, replace = MISTAKES[mistake]
    monkeypatch.setattr(cls, method, replace(getattr(cls, method)))
    if mistake.startswith("speed-aware"):
        out = loco.launch(planned, 3, args=(AWARE_STEPS, AWARE_ROUNDS))
        ref = once(reference, AWARE_STEPS, AWARE_TICKS, 1, 0, 0.0)
    else:
        out = loco.launch(planned, 3, args=(ASYNC_STEPS, ASYNC_ROUNDS, 1, 0, 0.0, 1, ASYNC_H))
        ref = once(reference, ASYNC_STEPS, ASYNC_TICKS, blocks=BLOCKS[1], h=ASYNC_H)
    assert max(max_diff(got, ref) for got in out) > ulps(ref, 1e4)


def test_asynchronous_blocks_span_rounds_until_h_steps_or_s_plus_1_rounds():
    """A worker's block ends at the first sync where it holds H steps, spans S + 1 rounds,
    or the run's last full round ends; it weighs by its steps among the blocks ending at
    that sync, and 0 at the others; the staleness of every block is counted."""
    rounds = [[12, 12, 12], [12, 6, 4], [12, 6, 4], [12, 6, 4], [12, 6, 4]]
    plan = LocalSteps(12, 3, 2, rounds=rounds, max_staleness=1, last_round=4)
    assert [plan.block_steps(r, 2) for r in range(5)] == [12, 0, 8, 0, 8]
    assert [plan.block_steps(r, 1) for r in range(5)] == [12, 0, 12, 0, 12]
    assert plan.weight(12 * 3, 12) == pytest.approx(3 * 8 / (12 + 12 + 8))  # round 2
    assert plan.weight(12 * 4, 12) == 0  # round 3
    longer = LocalSteps(12, 3, 2, rounds=rounds, max_staleness=5, last_round=4)
    assert [longer.block_steps(r, 2) for r in range(5)] == [12, 0, 0, 12, 4]  # last round
    assert longer.staleness(5) == {0: 1 + 5 + 1 + 1, 1: 2, 2: 1}



def refuse(cfg) -> None:
    """The checks of unequal speeds: the runtime section's (what they need of the run) and
    the method's (what they need of its options; a method without those options has none)."""
    from loco.algorithms.asynchronous import check_whole_model
    from loco.config.sections import check_local_steps

    check_local_steps(cfg)
    check_whole_model(cfg)


def test_local_steps_refuse_what_they_cannot_do():
    for extra, message in [({"algorithm": "noloco"}, "needs a method with rounds"),
                           ({"worker_ranks": 2}, "--worker-ranks"),
                           ({"stages": 2}, "--stages"),
                           ({"elastic": True, "launcher": "processes", "algorithm": "diloco",
                             "error_feedback": 0.9}, "not with --error-feedback")]:
        cfg = build_config(overrides={"local_steps": "proportional", **extra})
        with pytest.raises(ConfigError, match=f"^--local-steps: .*{message}"):
            refuse(cfg)


@pytest.mark.parametrize("staleness", [0, 1])
def test_every_worker_trains_the_first_round_steps_agreed(corpus, tmp_path, staleness):
    """H = 8 (the first round probed): whatever the times, every worker trains exactly the
    steps of every round the summary records, and every step is applied."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--worker-speed", "1,0.25", "--algorithm", "diloco",
                          "--local-steps", "proportional", "--steps", "16", "--sync-every",
                          "8", "--max-staleness", str(staleness))) == 0
    s = json.loads((out / "summary.json").read_text())
    rounds = s["local_steps"]["rounds"]
    for m, w in enumerate(s["per_worker"]):
        assert w["trained_steps"] == w["applied_steps"] == rounds[0][m] + rounds[1][m]
    assert s["tokens"] == sum(w["trained_steps"] for w in s["per_worker"]) * 4 * 32


@pytest.mark.parametrize("speeds,slow,staleness", [("1,0.25", 1, 0), ("0.25,1", 0, 1)])
def test_a_slow_worker_trains_fewer_steps_per_round_and_waits_less(corpus, tmp_path, capsys,
                                                                   speeds, slow, staleness):
    """A worker at a quarter of the speed, speed-aware local steps (and asynchronous outer
    steps): from round 1 on it trains fewer steps per round than H (the rounds are recorded;
    DiLoCo waits for its sync, so round r's times fix round r + 1), the tokens count the
    steps trained, and every step trained is applied; the lead worker may be the slow one
    (ticks without a loss); blocks are at most S outer steps old."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--worker-speed", speeds, "--algorithm", "diloco",
                          "--local-steps", "proportional", "--steps", "16",
                          "--max-staleness", str(staleness))) == 0
    s = json.loads((out / "summary.json").read_text())
    rounds = s["local_steps"]["rounds"]
    assert rounds[0] == [4, 4] and all(r[1 - slow] == 4 for r in rounds)
    assert all(r[slow] < 4 for r in rounds[1:4])
    fast, late = s["per_worker"][1 - slow], s["per_worker"][slow]
    assert fast["trained_steps"] == 16 and late["trained_steps"] == 4 + sum(
        r[slow] for r in rounds[1:4])
    assert late["applied_steps"] == late["trained_steps"]
    assert s["tokens"] == (fast["trained_steps"] + late["trained_steps"]) * 4 * 32
    stale = s["local_steps"]["staleness"]
    assert stale is None if not staleness else max(map(int, stale)) <= staleness
    printed = "asynchronous outer steps: blocks applied" in capsys.readouterr().out
    assert printed == bool(staleness)


def test_loco_compare_shows_the_goodput_over_the_seeds():
    from types import SimpleNamespace

    from loco.report.tables import goodput_cell

    def run(total):
        return SimpleNamespace(summary=SimpleNamespace(goodput={"total": total}))
    assert goodput_cell([run(0.5), run(0.7)]) == "60.0%"
    assert goodput_cell([run(0.5), SimpleNamespace(summary=SimpleNamespace(goodput=None))]) == "-"


def test_where_the_sync_is_waited_for_a_rounds_times_fix_the_next_round():
    """``ahead`` 1 (nothing overlaps a round's sync): the gather at round r's end is waited
    for at once and fixes round r + 1."""
    comm = Gathers([0.1, 0.2, 0.4], [0.1, 0.1, 5.0])
    plan = LocalSteps(4, 3, 0, ahead=1)
    plan.trained(0.1)
    plan.tick_done(comm, 4)
    assert plan.rounds == [[4, 4, 4], [4, 2, 1]] and comm.calls == 1
    plan.tick_done(comm, 8)
    assert plan.rounds[2] == [4, 4, 1] and len(plan.rounds) == 3


@pytest.mark.parametrize("overrides,message", [
    ({"max_staleness": -1}, "must be an integer >= 0"),
    ({"max_staleness": 2}, "add --local-steps proportional"),
    ({"max_staleness": 2, "local_steps": "proportional", "algorithm": "streaming",
      "overlap": "0"}, "not with --fragments 2"),
    ({"max_staleness": 2, "local_steps": "proportional", "algorithm": "streaming",
      "fragments": 1}, "not with --overlap 1"),
    ({"max_staleness": 2, "local_steps": "proportional", "eager": True}, "not with --eager")])
def test_asynchronous_outer_steps_refuse_what_they_cannot_do(overrides, message):
    cfg = build_config(overrides={"algorithm": "diloco", **overrides})
    with pytest.raises(ConfigError, match=f"^--max-staleness: .*{message}"):
        refuse(cfg)
    fine = build_config(overrides={"algorithm": "streaming", "fragments": 1, "overlap": "0",
                                   "max_staleness": 2, "local_steps": "proportional"})
    refuse(fine)


def test_elastic_plans_hear_the_quorum_and_restart_a_joiners_blocks():
    """Elastic: the step times travel with the quorums (each worker leaves its own, in µs),
    round r's times fix round r + 1 (absent workers: H), a worker that did not contribute
    starts its blocks with the next round, the weights count the contributors only, and a
    joiner takes the rounds and restarts from a live worker."""
    from types import SimpleNamespace

    quorum = SimpleNamespace(note=0, notes={}, members=(0, 1, 2), contributing=(0, 1, 2))
    plan = LocalSteps(4, 4, 0, quorum=quorum, max_staleness=2)
    assert plan.probe == 0
    plan.trained(0.1)
    plan.tick_done(None, 1)
    assert quorum.note == 100_000
    quorum.notes = {0: 100_000, 1: 200_000, 2: 400_000}  # worker 3 is not a member
    plan.tick_done(None, 4)
    assert plan.rounds[1] == [4, 2, 1, 4]
    quorum.members, quorum.contributing = (0, 1, 2, 3), (0, 1, 2)  # 3 joins at round 1
    quorum.notes[3] = 400_000
    plan.tick_done(None, 8)
    assert plan.restarts == {3: 2} and plan.rounds[2] == [4, 2, 1, 1]
    assert plan.block_steps(0, 3) == 4 and plan.block_steps(1, 3) == 4  # (absent: H)
    assert plan.block_steps(2, 3) == 0  # anew from round 2: 1 step, its block goes on
    # round 1's sync: only worker 0's block (4 steps) ends among the 3 contributors
    assert [plan.block_steps(1, m) for m in range(3)] == [4, 0, 0]
    assert plan.weight(8, 4) == 3.0
    joiner = LocalSteps(4, 4, 3, quorum=quorum, max_staleness=2)
    joiner.load_heal_state(plan.heal_state())
    assert joiner.rounds == plan.rounds and joiner.restarts == {3: 2}


def test_a_worker_reports_its_step_time_averaged_over_rounds():
    """Each round's mean step time is averaged with the earlier rounds' (half and half), so
    that one noisy round does not swing the shares of the next."""
    sent = []

    class Recording(Gathers):
        def all_gather(self, tensor, tag):
            sent.append(float(tensor))
            return super().all_gather(tensor, tag)
    comm = Recording(*[[0.1, 0.1]] * 3)
    plan = LocalSteps(4, 2, 0, ahead=1)
    for seconds in (0.1, 0.3, 0.3):
        plan.trained(seconds)
        plan.tick_done(comm, 4 * (len(sent) + 1))
    assert sent == pytest.approx([0.1, 0.2, 0.25])
