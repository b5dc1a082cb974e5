"""The layout of a run's ranks: workers x stages x worker ranks, the same under threads and
processes; the groups across workers (the slow link) and inside a worker (the fast link)."""

import importlib

import pytest
import torch

import loco
from loco.runtime.launch import MESH_DIMS, Mesh


def layout_worker(ctx):
    """Each rank's place, and who is in its groups (found by gathering global ranks)."""
    me = torch.tensor([ctx.rank])
    outer = [int(t) for t in ctx.comm.all_gather(me).wait()]
    inner = [int(t) for t in ctx.inner.all_gather(me).wait()] if ctx.inner else [ctx.rank]
    total = torch.ones(1)
    ctx.inner.all_reduce_mean(total, tag="train").wait()  # fast link: counted apart
    dm = ctx.device_mesh
    return {"worker": ctx.worker, "stage": ctx.stage, "worker_rank": ctx.worker_rank,
            "outer": outer,
            "inner": inner, "outer_train_bytes": ctx.comm.totals("train").sent_bytes,
            "inner_train_bytes": ctx.inner.totals("train").sent_bytes,
            "mesh": None if dm is None else (tuple(dm.mesh.shape), dm.mesh_dim_names)}


def check_layout(out, m, r):
    mesh = Mesh(m, 1, r)
    assert len(out) == m * r == mesh.world_size
    for rank, o in enumerate(out):
        worker, index = divmod(rank, r)  # the ranks of one worker are adjacent
        assert (o["worker"], o["stage"], o["worker_rank"]) == (worker, 0, index)
        assert o["outer"] == mesh.outer_peers(0, index) == [k * r + index for k in range(m)]
        assert o["inner"] == mesh.worker_peers(worker, 0) == list(range(worker * r,
                                                                       (worker + 1) * r))
        assert o["outer_train_bytes"] == 0  # nothing inside a worker crossed the slow link
        assert o["inner_train_bytes"] == 2 * (r - 1) * 4 * 1


@pytest.mark.parametrize("m,r", [(2, 2), (3, 2), (2, 3)])
def test_threads_layout_groups_across_and_inside_workers(m, r):
    out = loco.launch(layout_worker, m * r, worker_ranks=r)
    check_layout(out, m, r)
    assert all(o["mesh"] is None for o in out)  # no DeviceMesh for the threads' raw groups


def test_processes_layout_is_the_same_on_a_device_mesh():
    out = loco.launch(layout_worker, 4, "processes", worker_ranks=2)
    check_layout(out, 2, 2)
    assert all(o["mesh"] == ((2, 1, 2), MESH_DIMS) for o in out)


@pytest.mark.parametrize("kw,message", [
    (dict(ranks=6, worker_ranks=4), r"multiple of stages x worker_ranks \(1 x 4\)"),
    (dict(ranks=4, worker_ranks=0), r"multiple of stages x worker_ranks"),
    (dict(ranks=8, worker_ranks=2, stages=2), r"not supported yet"),
])
def test_bad_layouts_are_refused_before_anything_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        loco.launch(layout_worker, **kw)


def test_one_rank_per_worker_keeps_the_old_layout():
    mesh = Mesh(3, 2)
    assert [mesh.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                                  (2, 1)]
    assert mesh.outer_peers(1) == [1, 3, 5] and mesh.rank_of(2, 1) == 5


def env_worker(ctx, names):
    """The values of the environment variables ``names`` in this rank's process."""
    import os
    return {n: os.environ.get(n) for n in names}


@pytest.mark.parametrize("elastic", [None, loco.Elastic(min_workers=1, restarts=0)])
def test_rank_processes_see_the_launchers_environment_as_of_each_launch(monkeypatch,
                                                                       elastic):
    """Rank processes are forked from a server started by the first launch of this process;
    each launch's ranks still see the launcher's environment as of that launch (a variable
    set, changed or removed since), plus what their starter sets (torch elastic's RANK)."""
    names = ("LOCO_TEST_SET", "LOCO_TEST_GONE", "RANK")
    kw = dict(launcher="processes", args=(names,), elastic=elastic)
    monkeypatch.setenv("LOCO_TEST_SET", "first")
    monkeypatch.setenv("LOCO_TEST_GONE", "here")
    first = loco.launch(env_worker, 2, **kw)
    monkeypatch.setenv("LOCO_TEST_SET", "second")
    monkeypatch.delenv("LOCO_TEST_GONE")
    second = loco.launch(env_worker, 2, **kw)
    ranks = ["0", "1"] if elastic is None else [None, None]
    assert first == [{"LOCO_TEST_SET": "first", "LOCO_TEST_GONE": "here", "RANK": r}
                     for r in ranks]
    assert second == [{"LOCO_TEST_SET": "second", "LOCO_TEST_GONE": None, "RANK": r}
                      for r in ranks]


def counted_worker(ctx, directory, fail):
    """Leaves one file per call in ``directory``; raises if ``fail``."""
    import os
    import uuid
    open(os.path.join(directory, f"{ctx.rank}-{uuid.uuid4().hex}"), "w").close()
    if fail:
        raise ValueError("the job's own error")
    return ctx.rank


@pytest.mark.parametrize("launcher", ["processes", "threads"])
def test_ranks_that_fail_while_connecting_are_started_again_once(monkeypatch, tmp_path,
                                                                   capfd, launcher):
    """Ranks that fail before any reaches the job's function (here: gloo cannot find its
    network interface; threads connect over loopback, so their group fails as a torn-down
    mesh does) are started once more, then the launch fails naming the cause."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "loco-no-such-interface")
    if launcher == "threads":
        def torn(*args, **kwargs):
            raise RuntimeError("Gloo connectFullMesh failed: loco-no-such-interface")
        monkeypatch.setattr(importlib.import_module("loco.runtime.launch"), "_gloo_group", torn)
    with pytest.raises(loco.WorkerError, match=r"(?s)worker \d failed.*loco-no-such-interface"):
        loco.launch(counted_worker, 2, launcher, args=(str(tmp_path), False))
    assert capfd.readouterr().err.count("starting them again, once") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("launcher", ["processes", "threads"])
def test_a_job_that_fails_is_not_started_again(tmp_path, capfd, launcher):
    """Once a rank reached the job's function its failure is the job's: no second run."""
    with pytest.raises(loco.WorkerError, match="the job's own error"):
        loco.launch(counted_worker, 2, launcher, args=(str(tmp_path), True))
    assert "starting them again" not in capfd.readouterr().err
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["0", "1"]
    assert loco.launch(counted_worker, 2, launcher, args=(str(tmp_path), False)) == [0, 1]


def aborting_worker(ctx):
    """Rank 1 dies of SIGABRT (a native crash); rank 0 waits until it is stopped."""
    import os
    import resource
    import time
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where CI allows them
        os.abort()
    time.sleep(120)


def test_a_rank_that_crashed_is_named_with_its_signal():
    with pytest.raises(loco.WorkerError, match=r"worker 1 failed \(exit code -6\): killed by "
                                               r"SIGABRT"):
        loco.launch(aborting_worker, 2, "processes")
