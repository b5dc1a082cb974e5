"""``loco train``'s worker: NoLoCo without collectives, checkpoints off the training thread
and off in-flight syncs, the spread diagnostic apart, communication tensors on the Comm's
device."""

import importlib
import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch

import loco.training
import loco.training.build
import loco.training.evaluation
import loco.training.finish
from loco import checkpoint
from loco.cli import main
from test_cli import small_run


def job(corpus, out, *extra):
    return small_run(corpus, out, "--final-eval-batches", "2", *extra)


def test_noloco_train_runs_no_all_worker_collective(corpus, tmp_path, monkeypatch):
    """4 workers in pairs, checkpoints every round and the spread diagnostic on: the training
    traffic is point-to-point exchanges within a pair, the checkpoints use no communication,
    and every operation of all workers is labelled setup, diagnostic or report."""
    records = {}
    write_totals = loco.training.finish.write_comm_totals

    def spy(out, ctx):  # after the rank's last operation
        records[ctx.rank] = list(ctx.comm.records)
        write_totals(out, ctx)

    monkeypatch.setattr(loco.training.finish, "write_comm_totals", spy)
    out = tmp_path / "run"
    assert main(job(corpus, out, "--algorithm", "noloco", "--workers", "4", "--group-size", "2",
                    "--spread-every", "2", "--checkpoint-every", "1")) == 0
    assert checkpoint.latest(str(out))["step"] == 12
    assert sorted(records) == [0, 1, 2, 3]
    for rank, recs in records.items():
        train = [r for r in recs if r.tag == "train"]
        assert len(train) == 3  # Δ and φ together, at each of the 3 outer steps
        assert all(r.op == "exchange" and len(r.participants) == 2 and rank in r.participants
                   for r in train)
        everyone = {r.tag for r in recs if len(r.participants) == 4}
        assert everyone <= {"setup", "diagnostic", "report"}, everyone
        assert any(r.tag == "diagnostic" and r.op == "all_reduce_mean" for r in recs)
        totals = json.loads((out / "comm" / f"rank{rank}.json").read_text())["outer"]
        assert set(totals) <= {"setup", "train", "diagnostic", "report"}, set(totals)
        assert "diagnostic" in totals and "checkpoint" not in totals
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diagnostic_seconds"] > 0


def test_spread_diagnostic_is_not_blocked_time():
    waited = {"train": 1.0, "diagnostic": 5.0, "checkpoint": 7.0, "report": 3.0}
    comm = SimpleNamespace(totals=lambda tag="train": SimpleNamespace(waited=waited.get(tag, 0)))
    assert loco.training.blocked_seconds(SimpleNamespace(comm=comm, pipe=None, inner=None)) == 1.0
    assert loco.training.blocked_seconds(SimpleNamespace(comm=comm, pipe=comm, inner=None)) == 2.0
    # the fast link inside a worker blocks its ranks too
    assert loco.training.blocked_seconds(SimpleNamespace(comm=comm, pipe=None, inner=comm)) == 2.0


@pytest.mark.parametrize("staged", [False, True])
def test_streaming_checkpoints_wait_for_the_sync_in_flight_and_write_in_the_background(
        corpus, tmp_path, monkeypatch, staged):
    """H = 4, P = 2, τ = 1: the second fragment is sent at steps 4, 8 and 12, and applied a
    step later. The rounds' checkpoints are taken at 5 and 9, with nothing in flight (so
    the training thread never waits for a sync to save), and at the end (12, after the
    flush). A model on the CPU: each rank's training thread writes its files in place; with
    staging buffers (a model on a GPU; here forced on the CPU), its checkpoint thread."""
    if staged:
        monkeypatch.setattr(loco.training.build, "make_stager", lambda ctx: checkpoint.Stager())
    saves = []
    save_rank = checkpoint.save_rank

    def spy(out, step, rank, state):
        saves.append((rank, step, state["algorithm"]["in_flight"],
                      threading.current_thread().name))
        return save_rank(out, step, rank, state)

    monkeypatch.setattr(checkpoint.files, "save_rank", spy)
    out = tmp_path / "run"
    assert main(job(corpus, out, "--algorithm", "streaming", "--fragments", "2",
                    "--overlap", "1", "--checkpoint-every", "1")) == 0
    for rank in range(2):
        mine = [s for s in saves if s[0] == rank]
        assert [step for _, step, _, _ in mine] == [5, 9, 12]
        assert all(flight is None for _, _, flight, _ in mine)
        assert all((name == f"loco-checkpoint-{rank}") == staged for _, _, _, name in mine)
    assert checkpoint.latest(str(out))["step"] == 12


class StubComm:
    """One worker, whose operations insist on tensors on its device."""

    rank, size, device = 0, 1, torch.device("cpu")

    def _done(self, tensor, result):
        assert tensor.device == self.device, f"{tensor.device} tensor for a {self.device} Comm"
        return SimpleNamespace(wait=lambda: result)

    def all_reduce_mean(self, tensor, tag="train"):
        return self._done(tensor, tensor)

    def all_gather(self, tensor, tag="setup"):
        return self._done(tensor, [tensor])


def test_communication_tensors_live_on_the_comms_device(monkeypatch):
    """Under NCCL a tensor made without ``device=`` would be a CPU tensor handed to NCCL:
    with the default device elsewhere (meta here), every tensor reaching the Comm is still on
    the Comm's device."""
    model = torch.nn.Linear(3, 2)
    algo = SimpleNamespace(params=list(model.parameters()))
    monkeypatch.setattr(loco.training.evaluation, "evaluate", lambda *a, **k: 1.5)
    with torch.device("meta"):
        assert loco.training.replica_spread(algo, StubComm()) == 0.0
        report = loco.training.replica_report(model, algo, StubComm(), [], None, False)
    assert report["eval_losses"] == [1.5] and report["average_eval_loss"] == 1.5


@pytest.mark.parametrize("lead", [True, False])
def test_a_failed_run_still_commits_the_last_checkpoint_every_rank_wrote(lead, corpus,
                                                                         tmp_path, monkeypatch,
                                                                         capsys):
    """Without a barrier the lead commits once every rank's file exists; a run that fails
    right after a checkpoint (the lead, or another rank) still leaves it committed."""
    out = tmp_path / "run"
    monkeypatch.setenv("LOCO_FAULT", "0:5" if lead else "1:5")
    assert main(job(corpus, out, "--algorithm", "diloco")) == 1
    assert f"worker {0 if lead else 1} failed at step 5" in capsys.readouterr().err
    assert checkpoint.latest(str(out))["step"] == 4
    for rank in range(2):
        assert checkpoint.load_rank(str(out), 4, rank)["step"] == 4


def test_paper_settings_run_end_to_end(corpus, tmp_path):
    """Fragments that do not divide H, a different tau per worker and the paper's Table 3
    (the first replica, the replicas' average and the global model) in one streaming run."""
    out = tmp_path / "t3"
    assert main(job(corpus, out, "--workers", "4", "--model", "medium", "--dim", "32",
                    "--heads", "2", "--fragments", "3", "--sync-every", "7",
                    "--overlap", "0,1,0,1", "--eval-replicas", "--adam-betas", "0.9,0.999",
                    "--checkpoint-every", "0")) == 0
    summary = json.loads((out / "summary.json").read_text())
    reps = summary["replicas"]
    assert len(reps["eval_losses"]) == 4
    assert reps["global_eval_loss"] == reps["final_eval_loss"] == summary["final_eval_loss"]
    assert reps["average_eval_loss"] is not None
    syncs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sent = [s["step"] for s in syncs if s.get("event") == "sync"]
    assert sent[:3] == [2, 4, 7]  # floor((p + 1) 7 / 3): 2, 4, 7
    assert summary["config"]["overlap"] == "0,1,0,1"


def test_a_different_tau_per_worker_checkpoints_at_one_step(corpus, tmp_path, monkeypatch):
    """Workers with different tau apply the round's last fragment at different steps; the
    checkpoint waits for the slowest (H = 6, max tau = 2: step 8, then the end, 12), the
    same step on every rank, with nothing in flight anywhere (it hung when each rank chose
    its own step)."""
    saves = []
    save_rank = checkpoint.save_rank

    def spy(out, step, rank, state):
        saves.append((rank, step, state["algorithm"]["in_flight"]))
        return save_rank(out, step, rank, state)

    monkeypatch.setattr(checkpoint.files, "save_rank", spy)
    out = tmp_path / "taus"
    assert main(job(corpus, out, "--algorithm", "streaming", "--workers", "2",
                    "--sync-every", "6", "--overlap", "0,2", "--comm-timeout", "30")) == 0
    for rank in range(2):
        assert [(step, flight) for r, step, flight in saves if r == rank] == [
            (8, None), (12, None)]
    assert checkpoint.latest(str(out))["step"] == 12


class PublicView:
    """A schedule seen through its public attributes only: reading or writing a name that
    starts with an underscore raises."""

    def __init__(self, schedule):
        object.__setattr__(self, "_schedule", schedule)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"private attribute {name}")
        return getattr(object.__getattribute__(self, "_schedule"), name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            raise AttributeError(f"private attribute {name}")
        setattr(object.__getattribute__(self, "_schedule"), name, value)


def test_seek_puts_the_schedule_where_stepping_would_through_its_public_api():
    """A worker that joins at step k has, through the schedule's public API alone, the
    learning rate of a worker that trained k steps, at k and at every step after it."""
    from loco.config import TrainConfig

    cfg = TrainConfig(steps=40, warmup=5, lr=1e-3)

    def schedule():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=cfg.optim.lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                            loco.training.lr_lambda(cfg))
    for k in (0, 3, 17):
        trained_opt, trained = schedule()
        for _ in range(k):
            trained_opt.step()
            trained.step()
        joined_opt, joined = schedule()
        loco.training.seek(PublicView(joined), None, k)
        for _ in range(6):
            assert joined.get_last_lr() == trained.get_last_lr()
            assert joined_opt.param_groups[0]["lr"] == trained_opt.param_groups[0]["lr"]
            assert joined.last_epoch == trained.last_epoch
            for opt, s in ((trained_opt, trained), (joined_opt, joined)):
                opt.step()
                s.step()


def test_evaluate_leaves_a_training_model_in_training_mode_when_it_fails():
    model = torch.nn.Linear(2, 2).train()

    def batches():
        raise RuntimeError("the batches failed")
        yield

    with pytest.raises(RuntimeError, match="the batches failed"):
        loco.training.evaluate(model, {}, batches(), None)
    assert model.training


def spread_worker(ctx, bucket):
    """The spread of two different replicas, reduced ``bucket`` values at a time; this
    worker's parameters; the largest buffer the Comm kept."""
    from workers import make_model

    loop = importlib.import_module("loco.training.loop")
    loop.SPREAD_BUCKET = bucket  # each thread sets the same value
    model = make_model(seed=ctx.rank)
    algo = SimpleNamespace(params=list(model.parameters()))
    spread = loop.replica_spread(algo, ctx.comm)
    kept = max((b.numel() for b in ctx.comm._buffers.values()), default=0)
    return spread, [p.detach().clone() for p in model.parameters()], kept


def test_spread_is_the_rms_distance_to_the_mean_in_buckets_of_bounded_memory():
    """The replicas' spread equals its direct computation (fp64) whether the model is
    reduced in one piece or in buckets that cut parameters apart, and the Comm keeps no
    buffer (the transport's all-reduce sums each bucket in place): the spread's memory is
    its own two buckets."""
    whole = loco.launch(spread_worker, 2, args=(1 << 24,))
    cut = loco.launch(spread_worker, 2, args=(1000,))
    a, b = (torch.cat([p.reshape(-1) for p in r[1]]).double() for r in whole)
    mean = (a + b) / 2
    want = math.sqrt(float(((a - mean) ** 2).sum() + ((b - mean) ** 2).sum()) / (2 * a.numel()))
    for runs in (whole, cut):
        for spread, _, _ in runs:
            assert spread == pytest.approx(want, rel=1e-6)  # fp32 means: 1e-6 is ~10 ulps
    assert a.numel() > 10_000
    assert all(kept == 0 for runs in (whole, cut) for _, _, kept in runs)
