"""Old names users type still work for one release, each with a DeprecationWarning that names
the new one: ``Mesh``'s and the rank context's, the per-rank classes', the elastic launcher's
arguments (``launch``'s are in ``test_pipeline.py``)."""

import inspect
import warnings

import pytest

import loco

OLD = "the old name goes in the next release"


def test_mesh_speaks_workers_stages_and_worker_ranks():
    mesh = loco.Mesh(workers=3, stages=1, worker_ranks=2)
    assert mesh.shape == (3, 1, 2) and mesh.world_size == 6
    assert mesh.worker_rank_of(5) == 1 and mesh.coords(5) == (2, 0)
    assert mesh.outer_peers(0, 1) == [1, 3, 5] and mesh.worker_peers(2, 0) == [4, 5]


def test_old_mesh_names_still_work_and_warn():
    new = loco.Mesh(3, 1, 2)
    with pytest.warns(DeprecationWarning, match=r"Mesh\(replicas=\.\.\.\) is now "
                                                r"Mesh\(workers=\.\.\.\)"):
        assert loco.Mesh(replicas=3, shards=2) == new
    for old, value in (("replicas", 3), ("shards", 2)):
        with pytest.warns(DeprecationWarning, match=f"Mesh.{old} is now"):
            assert getattr(new, old) == value
    with pytest.warns(DeprecationWarning, match="Mesh.shard_of is now Mesh.worker_rank_of"):
        assert new.shard_of(5) == 1
    with pytest.warns(DeprecationWarning, match="Mesh.replica_peers is now Mesh.outer_peers"):
        assert new.replica_peers(0, 1) == [1, 3, 5]
    with pytest.raises(TypeError, match="not both"):
        loco.Mesh(3, workers=3, replicas=3)


def context_worker(ctx):
    """The rank's place by its new names and by its old ones, with what the old ones said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = (ctx.replica, ctx.shard, ctx.replicas, ctx.shards)
    return ((ctx.worker, ctx.worker_rank, ctx.workers, ctx.worker_ranks), old,
            [(w.category, str(w.message)) for w in caught])


def test_old_rank_context_names_still_work_and_warn():
    for rank, (new, old, said) in enumerate(loco.launch(context_worker, 4, worker_ranks=2)):
        assert new == old == (rank // 2, rank % 2, 2, 2)
        assert [c for c, _ in said] == [DeprecationWarning] * 4
        assert [m.split(" is now ")[0] for _, m in said] == [
            "ctx.replica", "ctx.shard", "ctx.replicas", "ctx.shards"]


@pytest.mark.parametrize("module,old,new", [
    ("loco", "WorkerContext", "RankContext"),
    ("loco.runtime", "WorkerContext", "RankContext"),
    ("loco.runtime.context", "WorkerContext", "RankContext"),
    ("loco.training", "Worker", "Rank"),
    ("loco.training.worker", "Worker", "Rank"),
])
def test_old_class_names_still_import_and_warn(module, old, new):
    import importlib

    package = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is now {module}.{new}; {OLD}"):
        assert getattr(package, old) is getattr(package, new)
    with pytest.warns(DeprecationWarning):  # every use warns, not the first only
        getattr(package, old)
    with pytest.raises(AttributeError):
        getattr(package, "NoSuchName")


def test_old_elastic_arguments_still_work_and_warn():
    from loco.runtime.elastic import launch_elastic, run_worker
    from loco.runtime.pipeline import routing_path, routing_permutation

    for fn in (launch_elastic, run_worker):
        params = inspect.signature(fn).parameters
        assert "workers" in params and "worker_ranks" in params
        assert "replicas" not in params and "shards" not in params
    with pytest.warns(DeprecationWarning, match=r"routing_permutation\(replicas=\.\.\.\) is "
                                                r"now routing_permutation\(workers=\.\.\.\)"):
        assert routing_permutation(1, 2, 0, 0, replicas=4) == routing_permutation(1, 2, 0, 0, 4)
    with pytest.warns(DeprecationWarning, match=r"routing_path\(replicas="):
        assert routing_path(1, 2, 0, 1, replicas=4, stages=3) == routing_path(1, 2, 0, 1, 4, 3)
    with pytest.raises(TypeError, match="not both"):
        routing_permutation(1, 2, 0, 0, workers=4, replicas=4)


def test_old_summary_keys_still_read_and_warn():
    """A ``summary.json`` of a run before the rename (``bytes_sent_per_worker``: the busiest
    rank's bytes) reads as the new keys, the values unchanged; the old attribute still
    gives them; both warn."""
    from loco.training.summary import OLD_KEYS, Summary

    old = {"bytes_sent_per_worker": 120, "bytes_received_per_worker": 110,
           "raw_bytes_per_worker": 480, "peak_sync_bytes_per_worker": 40,
           "slow_link_bytes_sent_per_worker": 240, "worker_ranks": 2}
    with pytest.warns(DeprecationWarning, match=r"bytes_sent_per_worker.*is now "
                                                r"bytes_sent_per_rank.*" + OLD):
        s = Summary.from_dict(old)
    assert (s.bytes_sent_per_rank, s.bytes_received_per_rank, s.raw_bytes_per_rank,
            s.peak_sync_bytes_per_rank) == (120, 110, 480, 40)
    assert s.unknown == {} and s.slow_link_bytes_sent_per_worker == 240
    assert not set(OLD_KEYS) & set(s.to_dict())  # written under the new names only
    with pytest.warns(DeprecationWarning, match="Summary.bytes_sent_per_worker is now "
                                                "Summary.bytes_sent_per_rank"):
        assert s.bytes_sent_per_worker == 120
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Summary.from_dict(s.to_dict()) == s  # a new file: no warning
    with pytest.raises(AttributeError):
        s.no_such_key


def test_streaming_diloco_takes_its_flags_names_and_reads_the_old_keywords_one_release():
    import torch

    import loco

    def build(ctx, **kw):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        algo = loco.StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    ctx.comm, sync_every=4, codec="fp32", **kw)
        return algo.alpha, algo.fragment_pattern

    assert loco.launch(build, 1, kwargs=dict(mixing=0.25, fragment_pattern="sequential")) \
        == [(0.25, "sequential")]
    with pytest.warns(DeprecationWarning, match=r"StreamingDiLoCo\(alpha=...\)"):
        assert loco.launch(build, 1, kwargs=dict(alpha=0.25, pattern="sequential")) \
            == [(0.25, "sequential")]
