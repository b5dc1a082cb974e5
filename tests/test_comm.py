"""The communication interface on real gloo groups: results, exact byte counts, asynchrony,
and the launcher's handling of a failing worker."""

import math
import time

import pytest
import torch

import loco


def reduce_worker(ctx, sizes):
    out = []
    for n in sizes:
        t = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)
        handle = ctx.comm.all_reduce_mean(t)
        handle.wait()
        out.append((t, handle.record))
    return out, ctx.comm.totals()


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_mean_all_reduce_values_and_exact_bytes(workers):
    sizes = [1, 7, 1000, 1001, 4099]
    results = loco.launch(reduce_worker, workers, args=(sizes,))
    mean_factor = sum(r + 1 for r in range(workers)) / workers
    for rank, (out, totals) in enumerate(results):
        for n, (t, rec) in zip(sizes, out):
            assert torch.allclose(t, torch.arange(n, dtype=torch.float32) * mean_factor)
            chunk = math.ceil(n / workers)
            assert rec.raw_bytes == 4 * n
            assert rec.sent_bytes == rec.recv_bytes == 2 * (workers - 1) * chunk * 4
            assert rec.participants == tuple(range(workers))
        assert totals.ops == len(sizes)
        assert totals.sent_bytes == sum(2 * (workers - 1) * math.ceil(n / workers) * 4 for n in sizes)
    # every worker ends with bit-identical results
    for (out, _) in results[1:]:
        assert all(torch.equal(a[0], b[0]) for a, b in zip(out, results[0][0]))


def test_broadcast_bytes_are_exact():
    def fn(ctx):
        t = torch.full((250,), float(ctx.rank))
        rec = ctx.comm.broadcast(t, src=1).record
        ctx.comm.totals("setup")  # noqa: B018 - the counters exist per tag
        return t, rec
    for rank, (t, rec) in enumerate(loco.launch(fn, 3)):
        assert torch.equal(t, torch.ones(250))
        assert rec.sent_bytes == (2 * 1000 if rank == 1 else 0)
        assert rec.recv_bytes == (0 if rank == 1 else 1000)


def test_reduction_completes_in_the_background():
    """The caller gets a handle at once; the reduction finishes without anyone waiting."""
    def fn(ctx):
        t = torch.ones(1 << 16)
        handle = ctx.comm.all_reduce_mean(t)
        deadline = time.time() + 10
        while not handle.done() and time.time() < deadline:
            torch.randn(64, 64) @ torch.randn(64, 64)  # the worker keeps computing
        done_before_wait = handle.done()
        handle.wait()
        return done_before_wait, handle.record.waited
    for done, waited in loco.launch(fn, 2):
        assert done and waited < 0.05


def test_a_failing_worker_stops_the_run_with_its_name():
    def fn(ctx):
        if ctx.rank == 1:
            raise ValueError("boom at step 3")
        ctx.comm.all_reduce_mean(torch.ones(10)).wait()  # would wait for worker 1 forever
    t0 = time.time()
    with pytest.raises(loco.WorkerError, match=r"worker 1 failed(.|\n)*boom at step 3"):
        loco.launch(fn, 2, timeout=60)
    assert time.time() - t0 < 30


def test_mesh_layout():
    mesh = loco.Mesh(replicas=3, ranks_per_replica=2)
    assert mesh.world_size == 6
    assert mesh.coords(5) == (2, 1)
    assert mesh.replica_peers(1) == [1, 3, 5]


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="launcher"):
        loco.launch(lambda ctx: None, 2, "mpi")
    with pytest.raises(ValueError, match="workers"):
        loco.launch(lambda ctx: None, 0)
