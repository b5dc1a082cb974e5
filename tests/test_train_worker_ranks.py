"""``loco train`` with workers of several ranks (``--worker-ranks R``): every rank reads its
own batches, the ranks of a worker average their gradients over its fast link, and each
sends 1/R of the worker's pseudo-gradient over the slow link. A worker's slow-link bytes do
not grow with R; its fast-link bytes are reported apart, and each link can be emulated on
its own."""

import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import loco
import loco.training.job
from loco import checkpoint
from loco.checkpoint import check_layout, resume_config
from loco.cli import main
from loco.comm.link import LinkSpec
from loco.config import ConfigError, TrainConfig
from loco.report import find_runs, write_report
from test_cli import expect_error, records_of, small_run
from test_reliability import assert_same_tensors, final_state, records
from workers import resumed_tensors, resumed_tensors_of_each

ALGORITHMS = ["diloco", "streaming", "noloco", "ddp", "local"]
M, R, STEPS = 2, 2, 12  # small_run's workers and steps


def run(corpus, out, *extra):
    return small_run(corpus, out, "--final-eval-batches", "2", *extra)


@pytest.fixture(scope="module", autouse=True)
def no_loss_plots():
    """No test here reads a run's ``loss.png`` (tests/test_cli.py does): the runs this
    module trains in its own process (threads) skip drawing it, 0.17 s of CPU each (the
    ranks of the processes launcher, forked from their server, still draw theirs)."""
    import loco.plot

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loco.plot, "plot_losses", lambda *args, **kw: None)
        yield


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Every algorithm with workers of one rank and of R, the job otherwise the same."""
    root = tmp_path_factory.mktemp("ranks")
    out = {}
    for algorithm in ALGORITHMS:
        for r in (1, R):
            out[algorithm, r] = root / f"{algorithm}-{r}"
            assert main(run(corpus, out[algorithm, r], "--algorithm", algorithm,
                            "--worker-ranks", str(r))) == 0
    return out


def summary_of(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_workers_of_two_ranks_send_no_more_over_the_slow_link(algorithm, runs):
    """Each rank reads its own batch, so a step holds R times the tokens; the slow link
    carries a worker's share once (each rank 1/R of it), not R copies: its bytes per worker
    equal those of workers of one rank, up to the padding of the shards (at most one value,
    or one FP4 block of 17 bytes, per shard and operation; measured: 0 on the tiny model)."""
    one, two = summary_of(runs[algorithm, 1]), summary_of(runs[algorithm, R])
    assert (two["worker_ranks"], two["worker_parallel"]) == (R, "ddp")
    assert (one["worker_ranks"], one["workers"], two["workers"]) == (1, M, M)
    assert two["tokens"] == R * one["tokens"] == STEPS * M * R * 4 * 32
    assert math.isfinite(two["final_eval_loss"])
    assert len(two["per_worker"]) == M * R
    slack = two["syncs"] * R * 2 * (M - 1) * 17
    assert abs(two["slow_link_bytes_sent_per_worker"]
               - one["slow_link_bytes_sent_per_worker"]) <= slack
    assert abs(two["slow_link_bytes_sent_per_rank"]
               - one["slow_link_bytes_sent_per_rank"] / R) <= slack
    # The old fields keep their meaning: the busiest rank of the slow link.
    assert two["bytes_sent_per_rank"] == two["slow_link_bytes_sent_per_rank"]
    assert one["bytes_sent_per_rank"] == one["slow_link_bytes_sent_per_worker"]
    assert one["fast_link_bytes_sent_per_worker"] == one["fast_link_bytes_sent_per_rank"] == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_fast_link_carries_every_steps_gradients(algorithm, runs):
    """Every inner step the R ranks average their fp32 gradients over the fast link: each
    sends at least 2 (R - 1) ceil(n / R) values per step; a worker sends R times that."""
    two = summary_of(runs[algorithm, R])
    n = two["model_parameters"]
    floor = STEPS * 2 * (R - 1) * math.ceil(n / R) * 4
    assert two["fast_link_bytes_sent_per_rank"] >= floor
    assert two["fast_link_bytes_sent_per_worker"] >= R * floor
    assert all(c["fast_link_bytes_sent"] >= floor for c in two["per_worker"])


def test_summary_reports_memory_and_the_metrics_both_links(runs):
    out = runs["diloco", R]
    two = summary_of(out)
    assert two["max_rss_bytes"] > 0
    memory = two["memory_bytes_per_rank"]
    if memory is not None:  # where the algorithm reports it (algo.memory_bytes())
        assert set(memory) == {"model", "gradients", "inner_optimizer", "outer", "comm",
                               "staging"}
        assert memory["model"] == 4 * two["model_parameters"]
    timed = [r for r in records_of(out) if "train_loss" in r or "eval_loss" in r]
    assert all("slow_link_bytes_sent" in r and "fast_link_bytes_sent" in r for r in timed)
    # the last step's record: the lead rank's bytes, as its totals at the end of training
    last = next(r for r in records_of(out) if r["step"] == STEPS and "train_loss" in r)
    assert last["slow_link_bytes_sent"] == last["bytes_sent"]
    assert last["slow_link_bytes_sent"] == two["per_worker"][0]["bytes_sent"]
    assert last["fast_link_bytes_sent"] == two["per_worker"][0]["fast_link_bytes_sent"]
    assert "fast_link_bytes_sent" not in records_of(runs["diloco", 1])[-1]
    ranks = [json.loads((out / "comm" / f"rank{r}.json").read_text()) for r in range(M * R)]
    assert [(r["worker"], r["worker_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r["replica"], r["shard"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # old keys
    assert [r["outer"]["train"]["sent_bytes"] for r in ranks] == [
        c["bytes_sent"] for c in two["per_worker"]]
    # Written after the final evaluation, which replica 1 does not take part in.
    assert [r["inner"]["train"]["sent_bytes"] for r in ranks[2:]] == [
        c["fast_link_bytes_sent"] for c in two["per_worker"][2:]]


def test_checkpoint_records_the_layout_and_rank_files_do_not_reshard(runs, capsys,
                                                                     monkeypatch):
    """Under the threads launcher each rank's file holds its own shard of the outer state:
    such a run is resumed with the worker layout it was written with."""
    meta = checkpoint.latest(str(runs["diloco", R]))
    assert (meta["worker_ranks"], meta["worker_parallel"], meta["world_size"]) == (R, "ddp",
                                                                                   M * R)
    assert not meta["dcp_workers"]  # threads: per-rank files
    for written, asked in ((R, 1), (1, R)):
        expect_error(["train", "--resume", str(runs["diloco", written]), "--worker-ranks",
                      str(asked), "--no-progress"], "--worker-ranks",
                      f"which do not reshard; resume with --worker-ranks {written}",
                      capsys, monkeypatch)
    cfg = resume_config(str(runs["diloco", R]), {})
    with pytest.raises(ConfigError, match="--worker-ranks: .*resume with --worker-ranks 2"):
        loco.training.job.prepare_config(cfg.replace(worker_ranks=1))


def test_check_layout_names_the_option_that_differs():
    meta = {"step": 8, "worker_ranks": 2, "worker_parallel": "fsdp"}
    check_layout(meta, 2, "fsdp")
    with pytest.raises(ConfigError, match="^--worker-parallel: .*resume with "
                                          "--worker-parallel fsdp"):
        check_layout(meta, 2, "ddp")
    with pytest.raises(ConfigError, match="^--worker-ranks: .*do not reshard; resume with "
                                          "--worker-ranks 2 --worker-parallel fsdp"):
        check_layout(meta, 4, "fsdp")
    check_layout({"step": 8, "config": {}}, 1, "ddp")  # written before --worker-ranks
    with pytest.raises(ConfigError, match="resume with --worker-ranks 1"):
        check_layout({"step": 8}, 2, "ddp")
    # written through DCP (processes, torchrun): any R of the same worker_parallel
    dcp = dict(meta, dcp_workers=2)
    for ranks in (3, 4):
        check_layout(dcp, ranks, "fsdp", "torchrun")
    check_layout(dict(dcp, worker_parallel="ddp"), 1, "ddp", "threads")
    with pytest.raises(ConfigError, match="^--worker-parallel: .*flat ranges under ddp"):
        check_layout(dcp, 1, "ddp")
    with pytest.raises(ConfigError, match="^--launcher: .*resume with --launcher processes"):
        check_layout(dcp, 2, "fsdp", "threads")


@pytest.fixture(scope="module")
def resharded(corpus, tmp_path_factory):
    """The two runs whose DCP checkpoints reshard to workers of 3 ranks, in one launch of
    M * 3 processes (one start of the ranks, not two): ``"ddp"``, DiLoCo with ddp inside
    workers of R ranks (processes), rank 1 failing at step 11 without restarts (its last
    checkpoint: step 8); ``"fsdp"``, the FSDP2 run restarted after rank 1 failed at step 7.
    ``(name, "seen")``: the run's exit code, its metrics records and every rank's final
    state, read before the reshard (resuming trims a resumed run's metrics), then its ranks'
    ``resumed_tensors`` at 3 ranks per worker."""
    root = tmp_path_factory.mktemp("resharded")
    out = {"ddp": root / "ddp", "fsdp": root / "fsdp"}
    codes = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCO_FAULT", "1:11")
        codes["ddp"] = main(run(corpus, out["ddp"], "--algorithm", "diloco", "--worker-ranks",
                                str(R), "--launcher", "processes", "--max-restarts", "0"))
        patch.setenv("LOCO_FAULT", "1:7")
        codes["fsdp"] = main(run(corpus, out["fsdp"], *FSDP_FLAGS, "--max-restarts", "1"))
    seen = {name: (codes[name], records(d), [final_state(d, rank) for rank in range(M * R)])
            for name, d in out.items()}
    jobs = []
    for d in out.values():
        cfg = loco.training.job.prepare_config(resume_config(str(d), {
            "worker_ranks": 3, "launcher": "processes"}))
        jobs.append((cfg, loco.training.job.prepare_data(cfg)))
    got = loco.launch(resumed_tensors_of_each, M * 3, "processes", worker_ranks=3,
                      args=(jobs,))
    for i, name in enumerate(seen):
        out[name, "seen"] = (*seen[name], [r[i] for r in got])
    return out


def test_dcp_checkpoint_reshards_to_workers_of_another_size(runs, resharded, tmp_path,
                                                           monkeypatch, capsys):
    """Workers of 2 ranks (processes) save through torch.distributed.checkpoint; a run
    resumed with workers of 3 ranks (processes) or of 1 (threads: no process group needed)
    loads every tensor of the worker exactly (model, AdamW, global copy, outer momentum),
    its byte counters sum to the old ranks' and its loaders continue after as many tokens;
    then it trains to the end, its tokens and slow-link bytes those of the whole run."""
    out, (code, _, saved, by_three) = resharded["ddp"], resharded["ddp", "seen"]
    assert code == 1
    meta = checkpoint.latest(str(out))
    assert (meta["step"], meta["dcp_workers"]) == (8, M)
    cfg = loco.training.job.prepare_config(resume_config(str(out), {
        "worker_ranks": 1, "launcher": "threads"}))
    by_one = loco.launch(resumed_tensors, M, "threads", worker_ranks=1,
                         args=(cfg, loco.training.job.prepare_data(cfg)))
    for ranks, got in ((3, by_three), (1, by_one)):
        for m in range(M):
            mine, before = got[m * ranks:(m + 1) * ranks], saved[m * R:(m + 1) * R]
            whole = before[0]["algorithm"]["tensors"]
            for r in mine:
                assert_same_tensors(r["tensors"]["model"], whole["model"])
                assert_same_tensors(r["tensors"]["outer"], whole["outer"])
                assert_same_tensors(r["tensors"]["inner_optimizer"]["state"],
                                    whole["inner_optimizer"]["state"])
            for link in ("comm", "inner") if ranks > 1 else ("comm",):  # R' = 1: no fast link
                for field in ("sent_bytes", "ops"):
                    total = sum(s[link]["stats"]["train"][field] for s in before)
                    assert sum(r[link]["stats"]["train"][field] for r in mine) == total
            # every rank read 8 batches; the worker's R' ranks read as many tokens in all
            assert all(8 * R // ranks == r["loader"]["position"] for r in mine)
            assert all(r["tokens"] == 8 * M * R * 4 * 32 for r in mine)
    # a worker's DCP files are checked before any worker starts
    metadata = out / "checkpoints" / "step00000008" / "worker0001" / ".metadata"
    metadata.rename(tmp_path / "metadata")
    expect_error(["train", "--resume", str(out), "--no-progress"], "--resume",
                 "worker0001 is missing or incomplete", capsys, monkeypatch)
    monkeypatch.undo()
    (tmp_path / "metadata").rename(metadata)
    assert main(["train", "--resume", str(out), "--worker-ranks", "1", "--launcher",
                 "threads", "--no-progress"]) == 0
    a, full = summary_of(out), summary_of(runs["diloco", R])
    assert (a["resumed_from_step"], a["worker_ranks"], len(a["per_worker"])) == (8, 1, M)
    assert a["tokens"] == 8 * M * R * 4 * 32 + (STEPS - 8) * M * 1 * 4 * 32
    assert math.isfinite(a["final_eval_loss"])
    slack = a["syncs"] * R * 2 * (M - 1) * 17  # the padding of the shards, as above
    assert abs(a["slow_link_bytes_sent_per_worker"]
               - full["slow_link_bytes_sent_per_worker"]) <= slack


@pytest.mark.parametrize("algorithm", ["diloco", "streaming"])
def test_interrupted_and_resumed_run_of_two_rank_workers_is_bit_identical(
        algorithm, runs, corpus, tmp_path, monkeypatch, capsys):
    """Rank 1 (worker 0's second rank) fails at step 11, after the checkpoint of step 8
    (streaming: 9); the resumed run ends with every rank's state, every metrics record and
    both links' bytes as the uninterrupted run's."""
    out = tmp_path / "run"
    monkeypatch.setenv("LOCO_FAULT", "1:11")
    assert main(run(corpus, out, "--algorithm", algorithm, "--worker-ranks", str(R))) == 1
    assert "worker 1 failed at step 11: InjectedFault" in capsys.readouterr().err
    assert checkpoint.latest(str(out))["step"] == (9 if algorithm == "streaming" else 8)
    monkeypatch.delenv("LOCO_FAULT")
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    full = runs[algorithm, R]
    assert records(out) == records(full)
    for rank in range(M * R):
        assert_same_tensors(final_state(out, rank)["algorithm"],
                            final_state(full, rank)["algorithm"])
    a, b = summary_of(out), summary_of(full)
    for key in ("final_eval_loss", "slow_link_bytes_sent_per_worker",
                "fast_link_bytes_sent_per_worker", "tokens"):
        assert a[key] == b[key], key


def test_compare_report_shows_both_links_per_worker(runs, tmp_path):
    numbers = write_report(find_runs([str(runs["diloco", 1]), str(runs["diloco", R])]),
                           str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    head = next(line for line in text.splitlines() if line.startswith("| method"))
    assert "slow link / worker (B)" in head and "fast link / worker (B)" in head
    for label in ("diloco-1", f"diloco-{R}"):
        s = numbers[label]
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} "))
        assert f"| {s['slow_link_bytes_sent_per_worker']:,} | " \
               f"{s['fast_link_bytes_sent_per_worker']:,} |" in row
    # a report of workers of one rank only has no such columns
    write_report(find_runs([str(runs["diloco", 1])]), str(tmp_path / "one"))
    assert "slow link" not in (tmp_path / "one" / "report.md").read_text()


# ---------------------------------------------------------------------- the fast link
def timed_reductions(ctx, n):
    """Seconds of one fp32 all-reduce over the fast link, then one over the slow link."""
    seconds = []
    for comm in (ctx.inner, ctx.comm):
        t0 = time.perf_counter()
        comm.all_reduce_mean(torch.ones(n), tag="train").wait()
        seconds.append(time.perf_counter() - t0)
    return seconds


def test_each_link_is_emulated_on_its_own():
    """``fast_link`` shapes ``ctx.inner`` only, ``link`` everything else: an all-reduce is
    two dependent phases, so it takes at least two latencies of its own link and is not
    slowed by the other's."""
    latency, n = 0.5, 1000  # wide: an unshaped all-reduce must stay under it on a busy CPU
    fast = loco.launch(timed_reductions, 4, worker_ranks=2, args=(n,),
                       fast_link=LinkSpec(latency=latency))
    slow = loco.launch(timed_reductions, 4, worker_ranks=2, args=(n,),
                       link=LinkSpec(latency=latency))
    for inner, outer in fast:
        assert inner >= 2 * latency and outer < latency
    for inner, outer in slow:
        assert outer >= 2 * latency and inner < latency


def test_the_fast_link_is_emulated_under_the_processes_launcher():
    """The same for the ranks torch elastic starts (the path torchrun takes too), with one
    worker of two ranks to keep it short: the fast link's all-reduce pays its own 0.1 s
    latency twice, and not the slow link's 0.3 s."""
    fast, slow = 0.1, 0.3
    for inner, _ in loco.launch(timed_reductions, 2, "processes", worker_ranks=2,
                                args=(1000,), link=LinkSpec(latency=slow),
                                fast_link=LinkSpec(latency=fast)):
        assert 2 * fast <= inner < 2 * slow


def test_fast_link_emulation_blocks_every_step_and_is_reported(corpus, tmp_path):
    """DataParallel inside a worker averages its ranks' gradients every step: with a 20 ms
    fast link each step waits at least two latencies (the two phases of the all-reduce)."""
    out = tmp_path / "run"
    assert main(run(corpus, out, "--algorithm", "ddp", "--worker-ranks", "2",
                    "--fast-link-latency", "20ms")) == 0
    summary = summary_of(out)
    assert summary["fast_link"] == {"bandwidth": None, "latency": "20ms"}
    assert summary["link"] is None
    for c in summary["per_worker"]:
        assert c["blocked_seconds"] >= STEPS * 2 * 0.020 * 0.98


def test_launch_training_lays_out_workers_of_r_ranks(monkeypatch):
    """M workers of R ranks: M·R ranks in all, R of them per worker (the mesh's worker
    ranks), and each link's emulation passed to its own Comm."""
    seen = {}

    def fake_launch(fn, **kw):
        seen.update(kw)
        return [{"final_eval_loss": 1.0}]

    monkeypatch.setattr(loco.training.job, "launch", fake_launch)
    cfg = TrainConfig(workers=3, worker_ranks=4, link_latency="50ms",
                      fast_link_bandwidth="100Gbit")
    loco.training.job.launch_training(cfg, corpus=None)
    assert seen["mesh"] == loco.Mesh(workers=3, stages=1, worker_ranks=4)
    assert seen["link"] == LinkSpec(latency=0.05)
    assert seen["fast_link"] == LinkSpec(bandwidth=100e9)


# ---------------------------------------------------------------------- bad input
def test_a_batch_must_fit_every_rank_of_every_worker():
    """Each of the M·R ranks reads its own share of the windows."""
    corpus = SimpleNamespace(train=np.zeros(1 + 32 * 40), val=np.zeros(1000),
                             eval_extra=None)  # 40 windows
    cfg = TrainConfig(workers=2, batch_size=16, seq_len=32)
    loco.training.job.check_fits(cfg, corpus)  # 20 windows per worker
    with pytest.raises(ConfigError, match=r"--batch-size: .*4 ranks \(2 workers x 2 ranks\) "
                                          r"has 10 windows.*--worker-ranks"):
        loco.training.job.check_fits(cfg.replace(worker_ranks=2), corpus)


def test_torchrun_world_must_be_workers_times_ranks_times_stages(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"^--worker-ranks: --workers x --worker-ranks x "
                                          r"--stages must be torchrun's world size 6"):
        loco.training.job.prepare_config(TrainConfig(worker_ranks=4, out="unused"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = loco.training.job.prepare_config(TrainConfig(worker_ranks=2, out="unused"))
    assert (cfg.runtime.workers, cfg.runtime.worker_ranks) == (4, 2)


def test_fast_link_flags_warn_where_they_do_not_apply():
    """Workers of one rank have no fast link; under FSDP2 its own collectives are counted
    on the fast link but not delayed by the emulation."""
    from loco.config import warnings_for

    def fast_link_warnings(**kw):
        cfg = TrainConfig(fast_link_latency="1ms", steps=400, sync_every=100, **kw)
        return [m for m in warnings_for(cfg) if "--fast-link-latency" in m]

    assert "ignored" in fast_link_warnings()[0] and "--worker-ranks 1" in fast_link_warnings()[0]
    assert fast_link_warnings(worker_ranks=2) == []
    [fsdp] = fast_link_warnings(worker_ranks=2, worker_parallel="fsdp", launcher="processes")
    assert "FSDP2" in fsdp and "counted but not delayed" in fsdp


# ---------------------------------------------------------------------- FSDP2 inside
FSDP_STEPS = 8  # two outer rounds of H = 4: each FSDP2 step is about 0.37 s of CPU (4 ranks)
FSDP_FLAGS = ("--algorithm", "streaming", "--worker-ranks", str(R), "--eval-replicas",
              "--steps", str(FSDP_STEPS), "--worker-parallel", "fsdp", "--launcher",
              "processes")


@pytest.fixture(scope="module")
def fsdp_run(corpus, tmp_path_factory):
    """Streaming DiLoCo, workers of R ranks with FSDP2 inside, processes, uninterrupted."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    assert main(run(corpus, out, *FSDP_FLAGS)) == 0
    return out


@pytest.mark.numerics
def test_fsdp_inside_workers_trains_as_ddp_inside_them(runs, corpus, tmp_path, fsdp_run):
    """--worker-parallel fsdp under the processes launcher: each rank holds half the model,
    the global model is evaluated from its shards (periodically, and at the end with every
    replica and their average), every loss is that of the same job with ddp inside the
    workers, and so are the slow link's bytes. Tolerance 5e-5: FSDP2 reduce-scatters the gradients where ddp all-reduces them,
    another summation order (measured: at most 3e-6)."""
    ddp, fsdp = tmp_path / "ddp", fsdp_run
    assert main(run(corpus, ddp, *FSDP_FLAGS[:7])) == 0
    a, b = summary_of(fsdp), summary_of(ddp)
    assert (a["worker_parallel"], a["launcher"]) == ("fsdp", "processes")
    evals = [[r["eval_loss"] for r in records_of(out) if "eval_loss" in r] for out in (fsdp, ddp)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=5e-5)
    for key in ("eval_losses", "average_eval_loss", "global_eval_loss"):
        assert a["replicas"][key] == pytest.approx(b["replicas"][key], abs=5e-5)
    assert a["slow_link_bytes_sent_per_worker"] == b["slow_link_bytes_sent_per_worker"]
    # FSDP2's traffic is counted on the fast link: every step each rank sends at least its
    # gathered share of the parameters (forward) and the reduce-scattered gradients
    n = a["model_parameters"]
    assert a["fast_link_bytes_sent_per_rank"] >= FSDP_STEPS * 2 * (R - 1) * n / R * 4
    if a["memory_bytes_per_rank"] is not None:  # a worker's ranks split the model
        shards = [c["memory_bytes"]["model"] for c in a["per_worker"][:R]]
        assert sum(shards) == b["memory_bytes_per_rank"]["model"]
        assert max(shards) < b["memory_bytes_per_rank"]["model"]


def test_fsdp_run_restarted_after_a_failure_ends_bit_identical(resharded, fsdp_run):
    """--worker-parallel fsdp under the processes launcher: rank 1 (worker 0's second rank)
    fails at step 7 of 8; the launcher restarts every rank from the checkpoint of step 5, each
    loading its own FSDP2 shards, AdamW state, share of the outer state and the sync in
    flight through torch.distributed.checkpoint; the run ends with every rank's state and
    every metrics record as the uninterrupted run's, bit for bit. Its last checkpoint then
    loads into workers of 3 ranks, every tensor exactly."""
    full, out = fsdp_run, resharded["fsdp"]
    code, got_records, states, got = resharded["fsdp", "seen"]
    assert code == 0
    assert summary_of(out)["restarts"] == 1 and summary_of(out)["resumed_from_step"] == 5
    assert got_records == records(full)
    for rank in range(M * R):
        assert_same_tensors(states[rank]["algorithm"], final_state(full, rank)["algorithm"])
    # DCP reshards FSDP2's shards, AdamW's and the outer state's to workers of 3 ranks
    for rank, r in enumerate(got):
        whole = states[rank // 3 * R]["algorithm"]["tensors"]
        assert_same_tensors(r["tensors"]["model"], whole["model"])
        assert_same_tensors(r["tensors"]["outer"], whole["outer"])
        assert_same_tensors(r["tensors"]["inner_optimizer"]["state"],
                            whole["inner_optimizer"]["state"])
