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
    plan = speed.LocalSteps(10, 3, 0, rounds=[[10, 5, 3], [10, 1, 7]])
    for worker, (first, second) in enumerate([(10, 10), (5, 1), (3, 7)]):
        ticks = [t for t in range(1, 21) if plan.trains(t, worker)]
        assert sum(t <= 10 for t in ticks) == first and sum(t > 10 for t in ticks) == second
        assert 10 in ticks and 20 in ticks  # the round's last tick: the sync follows it
    assert [t for t in range(1, 11) if plan.trains(t, 1)] == [2, 4, 6, 8, 10]  # evenly
    assert plan.steps_until(20) == 10 + 5 + 3 + 10 + 1 + 7
    assert plan.steps_until(25) == plan.steps_until(20) + 3 * 5  # later rounds: H each
    # weights: M times the worker's share of the steps of the ticks a sync covers
    assert plan.weight(10, 10) == pytest.approx(3 * 10 / 18)
    assert speed.LocalSteps(10, 3, 2, rounds=[[10, 5, 3]]).weight(10, 10) == pytest.approx(
        3 * 3 / 18)


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
    plans = [speed.LocalSteps(8, 3, m) for m in range(3)]
    plan = plans[0]
    plan.trained(0.1)
    plan.agree(comm)  # the end of round 0: gathered, not waited for
    assert plan.rounds == [[8, 8, 8]] * 2
    plan.agree(comm)  # the end of round 1: round 0's times fix round 2
    assert plan.rounds[2] == [8, 4, 2]
    plan.settle()  # before a checkpoint: round 1's times fix round 3
    assert plan.rounds[3] == [8, 8, 1]
    assert comm.calls == 2


def test_local_steps_refuse_what_they_cannot_do():
    for extra, message in [({"algorithm": "noloco"}, "needs a method with rounds"),
                           ({"worker_ranks": 2}, "--worker-ranks"),
                           ({"elastic": True, "launcher": "processes"}, "--elastic")]:
        cfg = build_config(overrides={"local_steps": "proportional", **extra})
        with pytest.raises(ConfigError, match=f"^--local-steps: .*{message}"):
            from loco.config.sections import check_local_steps
            check_local_steps(cfg)


def test_a_slow_worker_trains_fewer_steps_per_round_and_waits_less(corpus, tmp_path):
    """Worker 1 at a quarter of the speed, speed-aware local steps: from round 2 on it
    trains fewer steps per round than H (the rounds are recorded), the tokens count the
    steps trained, and every step trained is applied."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--worker-speed", "1,0.25", "--algorithm", "diloco",
                          "--local-steps", "proportional", "--steps", "16")) == 0
    s = json.loads((out / "summary.json").read_text())
    rounds = s["local_steps"]["rounds"]
    assert rounds[:2] == [[4, 4], [4, 4]] and all(r[0] == 4 for r in rounds)
    assert all(r[1] < 4 for r in rounds[2:4])
    fast, slow = s["per_worker"]
    assert fast["trained_steps"] == 16 and slow["trained_steps"] == 8 + sum(
        r[1] for r in rounds[2:4])
    assert slow["applied_steps"] == slow["trained_steps"]
    assert s["tokens"] == (fast["trained_steps"] + slow["trained_steps"]) * 4 * 32


def test_loco_compare_shows_the_goodput_over_the_seeds():
    from types import SimpleNamespace

    from loco.report.tables import goodput_cell

    def run(total):
        return SimpleNamespace(summary=SimpleNamespace(goodput={"total": total}))
    assert goodput_cell([run(0.5), run(0.7)]) == "60.0%"
    assert goodput_cell([run(0.5), SimpleNamespace(summary=SimpleNamespace(goodput=None))]) == "-"
