"""The elastic supervisor's results: each rank process sends its one result down a pipe of
its own, so that a process killed while it sends (the supervisor stops the other ranks of a
worker that lost one) cannot stop the others' results, nor their exit.

A queue shared by every process has one write lock; a process killed while its feeder
thread wrote held it forever, and every other process then hung at exit, joining its feeder
(CI, 2026-11-28: an elastic test waited 25 minutes on six such processes)."""
from __future__ import annotations

import pickle
import time
from pathlib import Path

from loco.runtime.elastic import _Job, _RankSpec
from loco.runtime.starter import context

BIG = 64 * 2**20  # far beyond a pipe's buffer: its send blocks until it is read


def entry(spec, key, restart, port, pipe):
    """A stand-in rank: worker 1 says it is about to send, then sends BIG bytes (blocked:
    nobody reads yet); the others wait until it has begun, then send a small result."""
    marker = Path(spec.args[0])
    if key[0] == 1:
        marker.write_text("sending")
        pipe.send((key, True, pickle.dumps(b"x" * BIG)))
        return
    while not marker.exists():
        time.sleep(0.05)
    time.sleep(1.0)  # worker 1 is in its send by now (if it is not, the test is weaker only)
    pipe.send((key, True, pickle.dumps(key[0] * 10)))


def test_a_rank_killed_while_it_sends_stops_no_other_result(tmp_path):
    ctx = context(__name__)
    spec = _RankSpec(None, (str(tmp_path / "marker"),), 3, 1, "", 2, 60.0, (), "127.0.0.1",
                     ctx.Event())
    job = _Job(ctx, spec, entry=entry)
    for w in range(3):
        job.start(w, 0)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "marker").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        victim = job.procs[1][0]
        victim.kill()
        victim.join(10)
        while not (job._finished(0) and job._finished(2)) and time.monotonic() < deadline:
            job.collect(wait=0.2)
        assert job.done == {(0, 0): 0, (2, 0): 20}
        for w in (0, 2):  # their sends went through: they exit, none hangs
            job.procs[w][0].join(30)
            assert job.procs[w][0].exitcode == 0
        job.collect(wait=0.2)  # the victim's pipe: its end, a partial message at most
        assert (1, 0) not in job.done and job.pipes == {}
    finally:
        job.stop()
