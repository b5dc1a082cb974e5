"""Decoupled DiLoCo's quorum and grace window on asynchronous outer steps (``--quorum``,
``--grace``), and Async Local-SGD's delayed Nesterov outer rule (``--outer-rule
delayed-nesterov``): the rule against literal tables of arrivals, the schedule a worker
derives from them, DiLoCo on real gloo process groups against a single-process reference
written from the two papers' rules, resuming, and the one-line errors."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from workers import batch, make_model, make_optimizer, max_diff, params_of, train_steps

import loco
from loco.algorithms.asynchronous import admit
from loco.algorithms.delayed_nesterov import DelayedNesterov
from loco.config import ConfigError, build_config
from loco.config.train_config import validate
from loco.training.quorum import QuorumSteps

INF = math.inf


# ------------------------------------------------------------------------ the rule itself
# (held steps, outer steps since the block began, arrivals, Q, grace) -> merged, or None
@pytest.mark.parametrize("held,stale,arrivals,quorum,grace,merged", [
    # one block ready, a quorum of two: the sync is held
    ([12, 6, 3], [0, 0, 0], [0.0, 0.5, 2.0], 2, 0.5, None),
    # two ready: they merge; the third would finish 2 s after the second ready: left out
    ([24, 12, 6], [0, 0, 0], [-1.0, 0.0, 2.0], 2, 0.5, [0, 1]),
    # ... and in, with a grace of 2 s (its 6 steps as they are)
    ([24, 12, 6], [0, 0, 0], [-1.0, 0.0, 2.0], 2, 2.0, [0, 1, 2]),
    # the window opens at the Q-th ready arrival, not at the sync: 0.25 s after the sync
    # is 0.75 s after it closed
    ([24, 12, 6], [0, 0, 0], [-2.0, -0.5, 0.25], 2, 0.5, [0, 1]),
    # a block that saw S = 1 outer step is due: ready whatever its steps and arrival
    ([12, 6, 9], [0, 0, 1], [0.0, 0.3, 5.0], 2, 0.5, [0, 1, 2]),
    # a ready block is in, however late after the window (it is at the sync already)
    ([12, 12, 6], [0, 0, 0], [-9.0, 0.0, 0.1], 1, 0.0, [0, 1]),
    # an arrival not known yet never comes within a window
    ([12, 6, 3], [0, 0, 0], [0.0, INF, INF], 1, 1e9, [0]),
    # the last round: every block with steps is due, and no quorum holds it
    ([4, 2, 1], [0, 0, 0], [0.0, 1.0, 2.0], 3, 0.0, "last"),
])
def test_the_quorum_and_grace_rule_on_literal_arrivals(held, stale, arrivals, quorum, grace,
                                                        merged):
    last = merged == "last"
    got = admit(held, stale, arrivals, quorum, grace, sync_every=12 if not last else 4,
                max_staleness=1, last=last)
    assert got == ([0, 1, 2] if last else merged)


class Gathered:
    """A stand-in Comm whose all-gathers answer the rows of a literal table in turn (the
    arrivals at each sync), then every worker's value as this worker's own."""

    device = torch.device("cpu")

    def __init__(self, workers, rows=(), replica=0):
        self.workers, self.rows, self.replica = workers, list(rows), replica

    def all_gather(self, tensor, tag):
        if self.rows:
            row = self.rows.pop(0)
            assert float(tensor) == row[self.replica]  # it sent its own arrival
            out = [torch.tensor([a], dtype=torch.float64) for a in row]
        else:
            out = [tensor.clone() for _ in range(self.workers)]
        return SimpleNamespace(wait=lambda: out)


# M = 3, H = 12: worker 0 trains 12 steps a round, worker 1 six, worker 2 three; S = 1,
# Q = 2, a grace of 0.5 s; the run's last full round is round 5.
PLAN = [[12, 6, 3]] * 6
ARRIVALS = [[0.0, 0.5, 2.0], [-1.0, 0.0, 2.0], [0.0, 0.3, 1.0],
            [0.0, 0.5, 2.0], [-2.0, -0.5, 0.25], [0.0, 0.0, 0.0]]
MERGED = [None, [0, 1], [0, 1, 2], None, [0, 1], [0, 1, 2]]
SENT = [[0, 0, 0], [24, 12, 0], [12, 6, 9], [0, 0, 0], [24, 12, 0], [12, 6, 9]]


def test_every_worker_derives_the_same_syncs_from_the_gathered_arrivals():
    """Round by round: held while fewer than Q blocks are ready; the ready ones and those
    within the grace merge; worker 2's block, due after one outer step, merges at round 2
    with its 9 steps; the weights are M times each merged block's share of the steps."""
    for replica in range(3):
        comm = Gathered(3, ARRIVALS, replica)
        plan = QuorumSteps(12, 3, replica, comm, quorum_size=2, grace=0.5, max_staleness=1,
                           rounds=PLAN, last_round=5, ahead=1,
                           measure=lambda r, m=replica: ARRIVALS[r][m])
        held = [plan.holds(12 * (r + 1)) for r in range(6)]
        assert held == [True, False, False, True, False, False]
        assert plan.admitted == MERGED
        assert [[plan.block_steps(r, m) for m in range(3)] for r in range(6)] == SENT
        assert plan.weight(24, 12) == [2.0, 1.0, 0.0][replica]  # 3 * 24/36, 3 * 12/36
        assert plan.weight(36, 12) == pytest.approx([4 / 3, 2 / 3, 1.0][replica])
        # blocks merged by the outer steps they missed: worker 2's at rounds 2 and 5 saw
        # one each (round 1's; round 4's), every other none (a held sync takes no step)
        assert plan.staleness(6) == {0: 8, 1: 2}
        assert plan.held_syncs() == 2


def test_a_worker_measures_its_own_arrival():
    """Not ready: its missing steps times its mean step time; ready: when its H-th step
    ended, from the moment it reached the sync (a fake clock)."""
    now = [0.0]
    comm = Gathered(2)
    plan = QuorumSteps(4, 2, 0, comm, quorum_size=1, rounds=[[3, 4], [3, 4]], ahead=1,
                       clock=lambda: now[0])
    for tick in (1, 2, 3, 4):
        if plan.trains(tick):
            plan.trained(0.5)
        if tick < 4:
            plan.tick_done(comm, tick)
    assert plan.arrival(0) == pytest.approx((4 - 3) * 0.5)  # one step of 0.5 s missing
    plan.admitted.append(None)  # round 0's sync held: worker 0's block goes on
    plan.tick_done(comm, 4)
    for tick in (5, 6, 7):
        now[0] = 10.0 + tick
        if plan.trains(tick):
            plan.trained(0.5)
        plan.tick_done(comm, tick)  # its 4th step: at tick 5 or 6
    done = 10.0 + next(t for t in (5, 6, 7) if plan.steps_between(5, t, 0) == 1)
    now[0] = 20.0
    assert plan.arrival(1) == done - 20.0


# ----------------------------------------------------------- delayed Nesterov, by itself
def reference_delayed_nesterov(theta, updates, lr, beta, every):
    """Async Local-SGD's Algorithm 3 (c = 0) as the paper writes it, one update at a time."""
    theta, m, buffer = theta.clone(), torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(updates, start=1):
        buffer = buffer + g
        if t % every == 0:
            m = beta * m + buffer / every
            theta = theta - lr * (beta * m + g / every)
            buffer = torch.zeros_like(theta)
        else:
            theta = theta - lr * g / every
    return theta


@pytest.mark.parametrize("every", [1, 3, 4])
def test_delayed_nesterov_matches_the_papers_algorithm(every):
    gen = torch.Generator().manual_seed(every)
    theta = torch.randn(257, generator=gen)
    updates = [torch.randn(257, generator=gen) for _ in range(11)]
    p, taken = theta.clone(), [0]
    opt = DelayedNesterov([p], lr=0.7, momentum=0.9, every=every, clock=lambda: taken[0])
    for g in updates:
        p.grad = g.clone()
        opt.step()
        taken[0] += 1
    want = reference_delayed_nesterov(theta, updates, 0.7, 0.9, every)
    assert torch.allclose(p, want, rtol=1e-5, atol=1e-6)
    if every > 1:  # and it is not Nesterov's
        assert not torch.allclose(p, reference_delayed_nesterov(theta, updates, 0.7, 0.9, 1),
                                  rtol=1e-3)
    if every == 1:  # N = 1 is torch's Nesterov SGD
        q = theta.clone()
        sgd = torch.optim.SGD([q], lr=0.7, momentum=0.9, nesterov=True)
        for g in updates:
            q.grad = g.clone()
            sgd.step()
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


# -------------------------------------------- DiLoCo with them, on real process groups
H = 4
PLAN4 = [[4, 2, 1]] * 6
ARRIVALS4 = [[0.0, 0.5, 2.0], [-1.0, 0.0, 2.0], [0.0, 0.3, 1.0],
             [0.0, 0.5, 2.0], [-1.0, 0.0, 0.2], [0.0, 0.0, 0.0]]
MERGED4 = [None, [0, 1], [0, 1, 2], None, [0, 1, 2], [0, 1, 2]]
STEPS = 6 * H


def quorum_worker(ctx, resume_at=None, **kw):
    """DiLoCo (fp32) whose workers train on the ticks of ``PLAN4`` only, its syncs decided
    by a quorum of 2 and a grace of 0.5 s from the arrivals ``ARRIVALS4``, S = 1; with
    ``resume_at``: also rebuilt from its state (and the decisions so far) after that many
    ticks, and finished again. Returns the global copy and the decisions."""

    def build(admitted=None):
        model = make_model(layers=2)
        opt = make_optimizer(model)
        algo = loco.DiLoCo(model, opt, ctx.comm, sync_every=H, outer_lr=0.7,
                           outer_momentum=0.9, **kw)
        plan = QuorumSteps(H, 3, ctx.rank, ctx.comm, quorum_size=2, grace=0.5,
                           max_staleness=1, rounds=PLAN4, last_round=STEPS // H - 1, ahead=1,
                           admitted=admitted, measure=lambda r: ARRIVALS4[r][ctx.rank])
        algo.pacing.weight_of, algo.pacing.sync_held = plan.weight, plan.holds
        algo.keep_block_starts()
        return model, opt, algo, plan

    def run(model, opt, algo, plan, first, last):
        for t in range(first, last):
            if plan.trains(t + 1):
                train_steps(model, opt, ctx.rank, [t], lambda: (algo.step(), algo.zero_grad()))
            else:
                algo.idle_step()

    parts = build()
    run(*parts, 0, resume_at or STEPS)
    if resume_at is None:
        return params_of(parts[2].global_parameters()), parts[3].admitted
    snapshot, decided = copy.deepcopy(parts[2].state_dict()), list(parts[3].admitted)
    run(*parts, resume_at, STEPS)
    straight = params_of(parts[2].global_parameters())
    parts = build(decided)
    parts[2].load_state_dict(snapshot)
    run(*parts, resume_at, STEPS)
    return straight, params_of(parts[2].global_parameters())


def reference_quorum(merged, rule="nesterov", every=1, lr=0.7, beta=0.9):
    """DiLoCo with asynchronous outer steps as the two papers describe them, in one
    process: worker m trains on the ticks of its steps per round (``PLAN4``: the first
    round's first ticks, then spread evenly, as speed-aware local steps do); at round r's
    sync the blocks of ``merged[r]`` send θ^g(their start) − θ_m, weighed by M n_m / N
    (N: the steps of the merged blocks), the others zeros; the mean (rank order) takes an
    outer step (Nesterov, or delayed Nesterov: the momentum every ``every`` outer steps,
    1/N gradient steps between), and the merged workers restart from the new θ^g; a held
    sync (``None``) sends nothing and takes no step."""
    M = 3
    models = [make_model(layers=2) for _ in range(M)]
    opts = [make_optimizer(m) for m in models]
    names = [n for n, _ in models[0].named_parameters()]

    def flat(m):
        return torch.cat([p.detach().reshape(-1) for p in models[m].parameters()])
    glob = flat(0).clone()
    starts = [glob.clone() for _ in range(M)]
    momentum, buffer, held, steps = (torch.zeros_like(glob), torch.zeros_like(glob),
                                     [0] * M, 0)

    def trains(m, t):  # the first round's first n ticks; later n ticks spread evenly
        n, k = PLAN4[(t - 1) // H][m], (t - 1) % H
        return k < n if t <= H else (k + 1) * n // H > k * n // H
    for t in range(1, STEPS + 1):
        for m in range(M):
            if trains(m, t):
                train_steps(models[m], opts[m], m, [t - 1])
                held[m] += 1
        if t % H or merged[t // H - 1] is None:
            continue
        who = merged[t // H - 1]
        total = sum(held[m] for m in who)
        with torch.no_grad():
            deltas = [(starts[m] - flat(m)).mul_(M * held[m] / total) if m in who
                      else torch.zeros_like(glob) for m in range(M)]
            mean = torch.stack(deltas).sum(0) / M
            steps += 1
            if rule == "nesterov":
                momentum.mul_(beta).add_(mean)
                glob.add_(mean.add(momentum, alpha=beta), alpha=-lr)
            elif steps % every:  # delayed Nesterov, between its momentum steps
                buffer.add_(mean)
                glob.add_(mean, alpha=-lr / every)
            else:
                buffer.add_(mean)
                momentum.mul_(beta).add_(buffer.div_(every))
                glob.add_(mean.div(every).add_(momentum, alpha=beta), alpha=-lr)
                buffer.zero_()
            for m in who:
                offset = 0
                for p in models[m].parameters():
                    p.copy_(glob[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                starts[m], held[m] = glob.clone(), 0
    out, offset = {}, 0
    for n, p in zip(names, models[0].parameters()):
        out[n] = glob[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return out


@pytest.fixture
def rank_order(monkeypatch):
    """The Comm sums the mean in rank order, as the reference does."""
    from loco.comm.comm import Comm

    monkeypatch.setattr(Comm, "rank_order", True)


@pytest.mark.parametrize("kw", [{}, {"outer_rule": "delayed-nesterov", "momentum_every": 2}])
@pytest.mark.usefixtures("rank_order")
def test_diloco_with_a_quorum_matches_its_reference(kw):
    """Three workers on gloo: the syncs held and merged as the literal arrivals decide, the
    partial blocks the grace admits weighed by their steps; bit for bit the reference's,
    with Nesterov and with delayed Nesterov, and not the run without a quorum."""
    out = loco.launch(quorum_worker, 3, kwargs=kw)
    rule = {"rule": kw["outer_rule"], "every": 2} if kw else {}
    ref = reference_quorum(MERGED4, **rule)
    for params, admitted in out:
        assert admitted == MERGED4
        assert max_diff(params, ref) == 0
    every_round = reference_quorum([[0, 1, 2]] * 6, **rule)
    assert max_diff(ref, every_round) > 1e-5


@pytest.mark.usefixtures("rank_order")
def test_a_quorum_run_with_delayed_nesterov_resumes_bit_for_bit():
    """A checkpoint one tick after round 1's sync (N = 2: the buffer holds that one update;
    worker 2's block spans the sync) continues bit for bit with the saved decisions."""
    kw = {"outer_rule": "delayed-nesterov", "momentum_every": 2, "resume_at": 2 * H + 1}
    for straight, resumed in loco.launch(quorum_worker, 3, kwargs=kw):
        assert max_diff(straight, resumed) == 0


def test_delayed_nesterov_buffer_travels_with_the_outer_state():
    """A joining worker (or a resharded checkpoint) takes the buffer Δ with the global copy
    and the momentum: ``outer_state`` names it, ``load_outer_state`` puts it back."""
    def fn(ctx):
        def build():
            model = make_model(layers=2)
            opt = make_optimizer(model)
            return model, opt, loco.DiLoCo(model, opt, ctx.comm, sync_every=2,
                                           outer_rule="delayed-nesterov", momentum_every=3)
        model, opt, algo = build()
        train_steps(model, opt, 0, range(2), lambda: (algo.step(), algo.zero_grad()))
        state = {k: flat.clone() for k, (_, flat) in algo.outer_state().items()}
        other = build()[2]
        other.load_outer_state(state)
        return sorted(state), max((state[k] - flat).abs().max().item()
                                  for k, (_, flat) in other.outer_state().items())
    names, diff = loco.launch(fn, 1)[0]
    assert names == ["fragment0.global", "fragment0.momentum", "fragment0.pending"]
    assert diff == 0


# ------------------------------------------------------------------------ one-line errors
@pytest.mark.parametrize("overrides,option,message", [
    ({"quorum": 2}, "quorum", "add --max-staleness S >= 1"),
    ({"quorum": 5, "max_staleness": 1, "local_steps": "proportional"}, "quorum",
     r"must be an integer in \[1, --workers 4\]"),
    ({"quorum": 0, "max_staleness": 1, "local_steps": "proportional"}, "quorum",
     r"in \[1, --workers 4\]"),
    ({"quorum": 2, "max_staleness": 1, "local_steps": "proportional", "elastic": True,
      "launcher": "processes"}, "quorum", "not supported with --elastic"),
    ({"grace": 1.0}, "grace", "only means something with --quorum"),
    ({"grace": -1.0, "quorum": 2, "max_staleness": 1, "local_steps": "proportional"},
     "grace", "must be a number of seconds >= 0"),
    ({"momentum_every": 2}, "momentum-every", "only means something with --outer-rule "
     "delayed-nesterov"),
    ({"outer_rule": "delayed-nesterov", "momentum_every": 0}, "momentum-every",
     "must be an integer >= 1"),
    ({"outer_rule": "delayed-nesterov", "eager": True}, "outer-rule", "not with --eager"),
    ({"outer_rule": "delayed-nesterov", "nesterov": False}, "outer-rule",
     "not with --no-nesterov"),
])
def test_bad_options_stop_with_one_line_naming_the_option(overrides, option, message):
    cfg = build_config(overrides={"algorithm": "diloco", **overrides})
    with pytest.raises(ConfigError, match=f"^--{option}: .*{message}") as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_the_outer_rule_belongs_to_diloco_and_its_kin():
    """DiLoCo and the methods built on it take --outer-rule (and N); a comparison refuses
    it for any other method."""
    from loco.compare.presets import only_for

    for option in ("outer_rule", "momentum_every"):
        assert set(only_for(option)) == {"diloco", "sparseloco", "sparta_diloco"}


# ------------------------------------------------------------------------ the command line
def test_a_cli_run_with_a_quorum_records_its_syncs_and_resumes_from_them(corpus, tmp_path,
                                                                         capsys):
    """A run with a quorum of both workers and delayed Nesterov fails at step 10 (after
    round 1's checkpoint) and resumes: the decisions of rounds 0 and 1 come back from the
    checkpoint (without them the third sync could not be decided), and the summary lists
    every sync's merged workers, the last round's all of them. (Which syncs are held
    follows the measured speeds: not asserted.)"""
    import json

    from test_cli import small_run

    from loco.cli import main

    out = tmp_path / "run"
    args = small_run(corpus, out, "--algorithm", "diloco", "--worker-speed", "1,0.5",
                     "--local-steps", "proportional", "--max-staleness", "1", "--quorum",
                     "2", "--grace", "0", "--outer-rule", "delayed-nesterov",
                     "--fault", "0:10")
    assert main(args) == 1
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    q = s["local_steps"]
    assert s["resumed_from_step"] == 8 and q["quorum"] == 2 and q["grace"] == 0
    assert len(q["merged"]) == 3 and q["merged"][-1] == [0, 1]
    assert q["held_syncs"] == q["merged"].count(None)
    assert "syncs held for their quorum" in capsys.readouterr().out
    assert s["config"]["momentum_every"] is None  # N = S + 1 = 2, derived


def host_reads_worker(ctx):
    """DiLoCo with delayed Nesterov and a quorum (``PLAN4``, the arrivals ``ARRIVALS4``),
    counting the host's reads of the device at every tick, by region."""
    from loco.comm import hostreads
    from loco.config import TrainConfig, resolve
    from loco.training.build import make_optimizer as run_optimizer

    cfg = resolve(TrainConfig(algorithm="diloco", model="tiny", workers=3, sync_every=H,
                              steps=STEPS))
    model = make_model(layers=2)
    opt = run_optimizer(model, cfg)  # the run's AdamW (the tests' own reads its step count)
    algo = loco.DiLoCo(model, opt, ctx.comm, sync_every=H, outer_rule="delayed-nesterov",
                       momentum_every=2)
    plan = QuorumSteps(H, 3, ctx.rank, ctx.comm, quorum_size=2, grace=0.5, max_staleness=1,
                       rounds=PLAN4, last_round=STEPS // H - 1, ahead=1,
                       measure=lambda r: ARRIVALS4[r][ctx.rank])
    algo.pacing.weight_of, algo.pacing.sync_held = plan.weight, plan.holds
    algo.keep_block_starts()
    ticks = []
    with hostreads.HostReadCounter() as counter:
        for t in range(STEPS):
            if plan.trains(t + 1):
                x, y = batch(ctx.rank, t)
                model(x, y).backward()
                algo.step()
                algo.zero_grad()
            else:
                algo.idle_step()
            ticks.append(dict(counter.take()))
    return ticks


def test_no_tick_reads_the_device_outside_a_sync(monkeypatch):
    """The quorum's arrivals are read at the sync, delayed Nesterov's phase is a host
    counter: no tick reads the device outside the sync's allowance."""
    from loco.comm import hostreads

    monkeypatch.setenv(hostreads.MODE_ENV, "count")
    for ticks in loco.launch(host_reads_worker, 3):
        assert not [t + 1 for t, reads in enumerate(ticks) if reads.get("step")]
        assert set().union(*ticks) <= {"sync", "host"}
        assert any(reads.get("sync") for reads in ticks)
