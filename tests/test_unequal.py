"""Workers of unequal speed: the emulation (``--worker-speed``), its checks, and the
goodput each run reports."""

import json

import pytest
from test_cli import small_run

from loco.cli import main
from loco.config import ConfigError, build_config, worker_speeds
from loco.training import speed


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
    import torch

    clock = Clock(work=0.2)
    monkeypatch.setattr(speed, "time", clock)
    loop = type("Loop", (), {"throttle_seconds": 1.0})()
    with speed.Throttle(factor, torch.device("cpu")).compute(loop):
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
    g = speed.goodput(ranks, [[0], [1], [2], [3]])
    assert g["total"] == pytest.approx(4 * (1 / 3) / (17 / 6), abs=1e-4)
    assert g["per_worker"] == [pytest.approx(1 / 3, abs=1e-4)] * 2 + [
        pytest.approx(2 / 3, abs=1e-4), 1.0]
    assert g["step_seconds"] == [1.0, 1.0, 2.0, 3.0]
    # steps discarded count against it; a worker of two ranks sums them
    g = speed.goodput([counters(10, 0, 10, 5), counters(10, 0, 10, 10)], [[0, 1]])
    assert g["total"] == g["per_worker"][0] == 0.75
    # the lead's 2 s of evaluation, which the other waited out (blocked), leave the wall
    g = speed.goodput([counters(10, 0, 10, 10), counters(12, 2, 10, 10)], [[0], [1]], held=2)
    assert g["total"] == 1.0


def test_a_worker_trains_the_steps_that_fit_into_the_fastest_ones_round():
    """Rounded down (a step that ends late holds everyone), with 2% slack for the noise,
    at least 1, at most the ticks; all of them where the time is unknown."""
    assert [speed.fit(20, 0.1, t) for t in (0.1, 0.2, 0.3, 0.15, 0.101, 5.0, 0.0)] == [
        20, 10, 6, 13, 20, 1, 20]


def test_a_run_with_a_slow_worker_records_its_speed_and_a_goodput_below_one(corpus,
                                                                            tmp_path):
    """Worker 1 at half speed: it sleeps about as long as it computes, the fast worker waits
    for it at the syncs, the summary records the speeds, every step as trained and applied,
    and a goodput below one (the synchronous barrier's)."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--worker-speed", "1,0.5", "--algorithm",
                          "diloco")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["worker_speeds"] == [1.0, 0.5]
    fast, slow = s["per_worker"]
    assert fast["throttle_seconds"] == 0 and slow["throttle_seconds"] > 0
    assert fast["trained_steps"] == slow["trained_steps"] == fast["applied_steps"] == 12
    assert fast["blocked_seconds"] > slow["blocked_seconds"]
    assert 0 < s["goodput"]["total"] < 1
    assert s["goodput"]["per_worker"][0] < s["goodput"]["per_worker"][1]


# ---------------------------------------------------------------- speed-aware local steps
def test_a_worker_of_n_steps_trains_on_n_ticks_of_each_round_the_last_among_them():
    """n of the H ticks, evenly, the round's last among them; in the run's first round the
    first 3 (the probe) and the rest of n spread over the rest."""
    plan = speed.LocalSteps(10, 3, 0, rounds=[[10, 5, 4], [10, 5, 3], [10, 1, 7]])
    for worker, counts in enumerate([(10, 10, 10), (5, 5, 1), (4, 3, 7)]):
        ticks = [t for t in range(1, 31) if plan.trains(t, worker)]
        assert [sum(10 * r < t <= 10 * r + 10 for t in ticks) for r in range(3)] == list(counts)
        assert {10, 20, 30} <= set(ticks)  # the round's last tick: the sync follows it
    assert [t for t in range(1, 11) if plan.trains(t, 1)] == [1, 2, 3, 7, 10]  # probe first
    assert [t for t in range(11, 21) if plan.trains(t, 1)] == [12, 14, 16, 18, 20]  # evenly
    assert plan.steps_until(30) == 10 + 5 + 4 + 10 + 5 + 3 + 10 + 1 + 7
    assert plan.steps_until(35) == plan.steps_until(30) + 3 * 5  # later rounds: H each
    # weights: M times the worker's share of the steps of the ticks a sync covers
    assert plan.weight(20, 10) == pytest.approx(3 * 10 / 18)
    assert speed.LocalSteps(10, 3, 2, rounds=[[10, 5, 4]]).weight(10, 10) == pytest.approx(
        3 * 4 / 19)


class Gathers:
    """A stand-in Comm whose all-gathers return the given times, one list per call."""

    device = "cpu"

    def __init__(self, *times):
        self.times, self.calls = list(times), 0

    def all_gather(self, tensor, tag):
        import torch

        values, self.calls = self.times[self.calls], self.calls + 1
        return type("Handle", (), {"wait": lambda self: [torch.tensor([v]) for v in values]})()


def test_the_times_of_round_r_fix_round_r_plus_2_the_same_on_every_worker():
    """Rounds 0 and 1 train H each; the step times gathered at round r's end give round
    r + 2 ``round(H · fastest / time)`` steps (at least 1), without waiting for the gather
    (it is settled at the next round's end, or before a checkpoint)."""
    comm = Gathers([0.1, 0.2, 0.4], [0.1, 0.1, 5.0])
    plan = speed.LocalSteps(4, 3, 0)  # H < 6: too short to probe
    plan.trained(0.1)
    plan.tick_done(comm, 4)  # the end of round 0: gathered, not waited for
    assert plan.rounds == [[4, 4, 4]] * 2
    plan.tick_done(comm, 8)  # the end of round 1: round 0's times fix round 2
    assert plan.rounds[2] == [4, 2, 1]
    plan.settle()  # before a checkpoint: round 1's times fix round 3
    assert plan.rounds[3] == [4, 4, 1]
    assert comm.calls == 2


def test_the_first_ticks_fix_the_first_two_rounds():
    """H >= 6: after the run's first 3 ticks (the first, a warm-up, not timed) the workers
    agree at once on the rest of round 0 and on round 1; round 0's end fixes round 2."""
    comm = Gathers([0.1, 0.2, 0.3], [0.1, 0.1, 0.1])
    plan = speed.LocalSteps(12, 3, 0)
    for t, seconds in [(1, 9.0), (2, 0.1), (3, 0.1)]:
        assert plan.trains(t, 2)
        plan.trained(seconds)
        plan.tick_done(comm, t)
    assert plan.rounds == [[12, 3 + 4, 3 + 3], [12, 6, 4]] and comm.calls == 1  # 4.5: even
    assert [t for t in range(1, 13) if plan.trains(t, 2)] == [1, 2, 3, 6, 9, 12]
    plan.tick_done(comm, 12)
    plan.settle()
    assert plan.rounds[2] == [12, 12, 12]
    assert speed.LocalSteps(12, 3, 0, rounds=[[12, 8, 6], [12, 6, 4]]).probing is False


def test_asynchronous_blocks_span_rounds_until_h_steps_or_s_plus_1_rounds():
    """A worker's block ends at the first sync where it holds H steps, spans S + 1 rounds,
    or the run's last full round ends; it weighs by its steps among the blocks ending at
    that sync, and 0 at the others; the staleness of every block is counted."""
    rounds = [[12, 12, 12], [12, 6, 4], [12, 6, 4], [12, 6, 4], [12, 6, 4]]
    plan = speed.LocalSteps(12, 3, 2, rounds=rounds, max_staleness=1, last_round=4)
    assert [plan.block_steps(r, 2) for r in range(5)] == [12, 0, 8, 0, 8]
    assert [plan.block_steps(r, 1) for r in range(5)] == [12, 0, 12, 0, 12]
    assert plan.weight(12 * 3, 12) == pytest.approx(3 * 8 / (12 + 12 + 8))  # round 2
    assert plan.weight(12 * 4, 12) == 0  # round 3
    longer = speed.LocalSteps(12, 3, 2, rounds=rounds, max_staleness=5, last_round=4)
    assert [longer.block_steps(r, 2) for r in range(5)] == [12, 0, 0, 12, 4]  # last round
    assert longer.staleness(5) == {0: 1 + 5 + 1 + 1, 1: 2, 2: 1}



def test_local_steps_refuse_what_they_cannot_do():
    for extra, message in [({"algorithm": "noloco"}, "needs a method with rounds"),
                           ({"worker_ranks": 2}, "--worker-ranks"),
                           ({"stages": 2}, "--stages"),
                           ({"elastic": True, "launcher": "processes", "algorithm": "diloco",
                             "error_feedback": 0.9}, "not with --error-feedback")]:
        cfg = build_config(overrides={"local_steps": "proportional", **extra})
        with pytest.raises(ConfigError, match=f"^--local-steps: .*{message}"):
            from loco.config.sections import check_local_steps
            check_local_steps(cfg)


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
    plan = speed.LocalSteps(4, 3, 0, ahead=1)
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
    from loco.config.sections import check_local_steps

    cfg = build_config(overrides={"algorithm": "diloco", **overrides})
    with pytest.raises(ConfigError, match=f"^--max-staleness: .*{message}"):
        check_local_steps(cfg)
    fine = build_config(overrides={"algorithm": "streaming", "fragments": 1, "overlap": "0",
                                   "max_staleness": 2, "local_steps": "proportional"})
    check_local_steps(fine)


def test_elastic_plans_hear_the_quorum_and_restart_a_joiners_blocks():
    """Elastic: the step times travel with the quorums (each worker leaves its own, in µs),
    round r's times fix round r + 1 (absent workers: H), a worker that did not contribute
    starts its blocks with the next round, the weights count the contributors only, and a
    joiner takes the rounds and restarts from a live worker."""
    from types import SimpleNamespace

    quorum = SimpleNamespace(note=0, notes={}, members=(0, 1, 2), contributing=(0, 1, 2))
    plan = speed.LocalSteps(4, 4, 0, quorum=quorum, max_staleness=2)
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
    joiner = speed.LocalSteps(4, 4, 3, quorum=quorum, max_staleness=2)
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
    plan = speed.LocalSteps(4, 2, 0, ahead=1)
    for seconds in (0.1, 0.3, 0.3):
        plan.trained(seconds)
        plan.tick_done(comm, 4 * (len(sent) + 1))
    assert sent == pytest.approx([0.1, 0.2, 0.25])
