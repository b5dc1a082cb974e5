"""Elastic membership through the command line, one process (or torchrun job) per worker, as
a multi-machine run: a killed worker restarted and rejoining, torchrun jobs of several ranks
joined by one Lighthouse, a worker started mid-run, and a run that lost every worker resumed
from its lead's checkpoint. The algorithms' elastic maths against their reference are in
test_elastic.py; this file takes long mostly waiting (quorums, restarts, emulated links),
so it is a file of its own that the suite's workers run beside the others."""

from __future__ import annotations

import os
import sys

import pytest


def test_loco_train_elastic_survives_a_killed_worker(corpus, tmp_path, monkeypatch):
    """The CLI: 4 workers, worker 3 killed (SIGKILL) before step 10 and not restarted; the
    others finish, and the run's records say who took part in every sync."""
    import json

    from test_cli import small_run

    from loco.cli import main

    monkeypatch.setenv("LOCO_FAULT", "3:10:kill")
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--workers", "4", "--steps", "16", "--elastic",
                          "--launcher", "processes", "--max-restarts", "0",
                          "--checkpoint-every", "0", "--final-eval-batches", "2")) == 0
    summary = json.loads((out / "summary.json").read_text())
    elastic = summary["elastic"]
    assert elastic["min_workers"] == 3  # a majority of 4
    # streaming, H = 4, P = 2: a fragment sent every 2 steps; those sent at 2, 4, 6 and 8
    # (applied at 9) with all four, those from step 10 on with three
    assert elastic["syncs_by_participants"] == {"4": 4, "3": 4}
    assert [loss["left"] for loss in elastic["losses"]] == [[3]]
    assert elastic["losses"][0]["to_next_sync"] > 0
    assert elastic["losses"][0]["to_full_strength"] is None
    # steps x members x batch x seq: the members of the latest sync count each step, so
    # step 10, after whose inner step the first sync without worker 3 began, counts three
    assert summary["tokens"] == (9 * 4 + 7 * 3) * 4 * 32
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r.get("event") == "elastic_sync"]
    assert [len(r["participants"]) for r in syncs] == [4] * 4 + [3] * 4
    assert [r["left"] for r in records if r.get("event") == "membership" and r["left"]] == [[3]]
    # loco compare plots the participants of the syncs of elastic runs
    from loco.report import load_run, write_report

    write_report([load_run(str(out))], str(tmp_path / "compared"))
    assert (tmp_path / "compared" / "participants.png").exists()


# One case: 2 jobs of 2 ranks (a restarted job is R processes that rejoin rank by rank); jobs
# of one rank are the same path with R = 1, and the processes launcher's tests cover M = 3.
@pytest.mark.parametrize("workers,ranks", [(2, 2)])
def test_torchrun_workers_of_a_lighthouse_job_survive_and_rejoin(corpus, tmp_path, workers,
                                                                 ranks):
    """One torchrun job per worker (the multi-machine setting), of R processes each, all
    joined by one Lighthouse: the last worker's last rank is killed at step 4; torchrun
    restarts the job (all R ranks, --max-restarts 1) and the worker rejoins from a live one
    while the others go on (with 3 workers; with 2, --min-workers 2 makes the other wait
    for it)."""
    import json
    import os
    import subprocess
    import sys

    from test_cli import small_run

    from loco.comm.membership import start_lighthouse
    from loco.data import prepare_corpus

    text, cache = corpus
    prepare_corpus(text, 300, 0.05, cache)  # once, before the processes read it
    lighthouse = start_lighthouse(min_workers=2)
    out = tmp_path / "run"
    # over an emulated 20 ms link; with 2 workers and --min-workers 2 the survivor waits for
    # the restarted one at the sync after the kill however long its restart takes, and the
    # 8 steps left are 4 syncs with it (the steps cost CPU, not the wait: the restart
    # happens the same way at step 4, after the fragment of step 2 went to both workers,
    # as at any later one)
    args = small_run(corpus, out, "--workers", str(workers), "--worker-ranks", str(ranks),
                     "--steps", "12", "--elastic", "--min-workers", "2",
                     "--link-latency", "20ms", "--log-every", "50", "--eval-every", "0",
                     "--lighthouse", lighthouse.address(), "--checkpoint-every", "0",
                     "--final-eval-batches", "2")
    victim = workers - 1
    env = {**os.environ, "LOCO_FAULT": f"{victim * ranks + ranks - 1}:4:kill",
           "OMP_NUM_THREADS": "1"}
    try:
        jobs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", str(ranks), "--max-restarts", "1", "-m",
                                  "loco", *args, "--worker-index", str(w)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for w in range(workers)]
        # a hang, not a speed: ~70 s alone, 164 s with one core busy, over 240 s once so
        logs = [job.communicate(timeout=900)[0] for job in jobs]
    finally:
        lighthouse.shutdown()
    assert [job.returncode for job in jobs] == [0] * workers, logs[victim][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    elastic = summary["elastic"]
    assert [loss["left"] for loss in elastic["losses"]] == [[victim]]
    assert elastic["losses"][0]["to_full_strength"] is not None  # the victim came back
    assert set(elastic["syncs_by_participants"]) == {str(n) for n in (workers - 1, workers)
                                                     if n >= 2}
    joined = [e for e in elastic["events"]
              if e["event"] == "membership" and e["joined"] == [victim]]
    assert joined and joined[-1]["members"] == list(range(workers))


def _by_hand(argv: list[str], env: dict, log: str, gate: str | None) -> None:
    """A worker started by hand, ``loco train`` with ``argv``, in a process forked from
    loco's rank server (torch imported there once; a fresh ``python -m loco`` would only add
    the imports) with ``env`` and its output to ``log``. With ``gate``, it imports what
    ``loco train`` runs on (torchft, the training modules) and then waits for that file:
    the worker itself (its Lighthouse client, model, state) begins only once it is there."""
    import time

    import torch

    from loco.runtime import starter

    starter.adopt_environment(env)
    # what OMP_NUM_THREADS=1 in the environment of a fresh Python gives (torch's thread
    # pool here is the server's, made before the environment above)
    torch.set_num_threads(1)
    with open(log, "w") as f:  # the workers' own prints and gloo's, as a terminal's would
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    import loco.cli
    if gate:
        import loco.comm.membership
        import loco.runtime.elastic
        import loco.training.job
        while not os.path.exists(gate):
            time.sleep(0.05)
    sys.exit(loco.cli.main(argv))


def test_a_worker_started_mid_run_joins_a_job_that_began_without_it(corpus, tmp_path):
    """Scaling up: a job of M = 3 whose workers 0 and 1 start alone (--min-workers 2: they
    wait --start-wait for worker 2, then begin); worker 2, started by hand once they are
    past step 20, joins at their next sync from a live worker, and the syncs from then on
    count three. Worker 1 starts 5 s after worker 0: their waits end together all the same
    (each used to end on its own clock, and worker 0 then broadcast the start to a worker 1
    still asking for a quorum, until gloo's time-out)."""
    import json
    import time

    from test_cli import small_run

    from loco.comm.membership import start_lighthouse
    from loco.data import prepare_corpus
    from workers import forked, join_all

    text, cache = corpus
    prepare_corpus(text, 300, 0.05, cache)
    lighthouse = start_lighthouse(min_workers=2)
    out = tmp_path / "run"
    # --comm-timeout is gloo's and the quorum's: 8 s was seen to expire in the first
    # broadcast on a 2-core machine loaded with other jobs, and 15 s in the first quorum or
    # broadcast when the whole file ran (workers 0 and 1 reach them seconds apart). The wait
    # for worker 2 at the start is --start-wait's alone: 5 s, over for worker 0 (started 5 s
    # earlier) when the first quorum forms and not for worker 1, whose wait ends with it.
    # 100 steps: worker 2's process has imported torch and loco before it is released at
    # step 20, so its join (its set-up and one quorum) took 10 steps (load 10 on 2 cores) of
    # the 80 left: a wider margin than a fresh Python released at step 50 of 300 had (it
    # joined 82 steps later at load 22).
    args = small_run(corpus, out, "--workers", "3", "--steps", "100", "--elastic",
                     "--min-workers", "2", "--comm-timeout", "30", "--start-wait", "5",
                     "--link-latency", "20ms",
                     "--log-every", "10", "--eval-every", "0", "--checkpoint-every", "0",
                     "--lighthouse", lighthouse.address(), "--final-eval-batches", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gate, logs = tmp_path / "go", [tmp_path / f"worker{w}.log" for w in range(3)]

    def start(w, gate=None):
        return forked(_by_hand, [*args, "--worker-index", str(w)], env, str(logs[w]),
                      gate and str(gate))

    def ends():  # the failed ones' logs
        return "\n".join(f"worker {w}:\n{log.read_text()[-3000:]}"
                         for w, (log, job) in enumerate(zip(logs, jobs)) if job.exitcode)
    jobs = [start(0), start(2, gate)]
    try:
        time.sleep(5)
        jobs.insert(1, start(1))
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and '"step": 20,' in metrics.read_text()):
            if not jobs[0].is_alive() or time.monotonic() > deadline:
                pytest.fail("worker 0 ended or stalled before step 20:\n"
                            + logs[0].read_text()[-3000:])
            time.sleep(0.2)
        gate.touch()  # worker 2's `loco train` starts now
        join_all(jobs, 900)  # a hang, not a speed: ~70 s alone, 164 s with one core busy
    finally:
        lighthouse.shutdown()
        for job in jobs:
            job.kill()  # any still running (or still waiting for the gate) after a failure
    assert [job.exitcode for job in jobs] == [0, 0, 0], ends()
    elastic = json.loads((out / "summary.json").read_text())["elastic"]
    assert set(elastic["syncs_by_participants"]) == {"2", "3"} and elastic["losses"] == []
    joins = [e for e in elastic["events"] if e["event"] == "membership" and e["joined"]]
    assert [e["members"] for e in joins] == [[0, 1], [0, 1, 2]]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first_three = min(r["step"] for r in records if r.get("event") == "elastic_sync"
                      and len(r["participants"]) == 3)
    assert first_three > 20  # it joined the running job, after the step it was started at


# Workers of 2 ranks: the lead's checkpoint is a file per rank, each read by its own rank;
# workers of one rank are the case R = 1 of the same code (the suite's time budget keeps one).
@pytest.mark.parametrize("workers,ranks", [(2, 2)])
def test_an_elastic_run_that_lost_every_worker_resumes_from_its_lead_checkpoint(
        corpus, tmp_path, workers, ranks):
    """The lead (worker 0) writes the checkpoint, one file per rank (its share); every
    process of the run is killed; --resume continues all workers from it, rank r of each
    from file r."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_cli import small_run

    from loco import checkpoint
    from loco.cli import main

    out, steps = tmp_path / "run", 34  # checkpoints at 9, 17, 25 and 33: 3 late chances
    args = small_run(corpus, out, "--workers", str(workers), "--worker-ranks", str(ranks),
                     "--steps", str(steps), "--elastic",
                     "--launcher", "processes", "--checkpoint-every", "2",
                     "--link-latency", "20ms", "--eval-every", "0", "--log-every", "10",
                     "--final-eval-batches", "2")
    job = subprocess.Popen([sys.executable, "-m", "loco", *args], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while (checkpoint.latest(str(out)) or {}).get("step", 0) < 9:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and every worker at once
        job.wait()
    meta = checkpoint.latest(str(out))
    step = int(meta["step"])
    assert meta["elastic"] and step < steps and (step - 1) % 8 == 0  # every 2 rounds, + tau
    assert sorted(os.listdir(out / "checkpoints" / f"step{step:08d}")) == [
        f"rank{r:04d}.pt" for r in range(ranks)]
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["inner_steps"] == steps
    assert summary["elastic"]["syncs_by_participants"] == {
        str(workers): (steps - step) // 2 + 1}
    assert summary["tokens"] == steps * workers * ranks * 4 * 32
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if "train_loss" in r]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # cut at the checkpoint
    assert checkpoint.latest(str(out))["step"] == steps


def test_a_silent_worker_is_lost_and_the_others_train_on(corpus, tmp_path):
    """``--inject 3:silent@10``: worker 3's process ends without a word before step 10, and
    again each time it is restarted and rejoins; it is counted lost, and the others finish."""
    import json

    from test_cli import small_run

    from loco.cli import main

    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--workers", "4", "--steps", "16", "--elastic",
                          "--launcher", "processes", "--max-restarts", "0",
                          "--checkpoint-every", "0", "--final-eval-batches", "2",
                          "--inject", "3:silent@10")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [loss["left"] for loss in summary["elastic"]["losses"]] == [[3]]
    assert summary["guard"]["injected"] == ["3:silent@10"]
