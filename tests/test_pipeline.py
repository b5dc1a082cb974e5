"""Pipeline stages across the ranks of a worker: the launcher's stage groups, point-to-point
Comm ops, the split of the model, and fixed and random routing checked against single-process
references (the unsplit model; per-sample paths through the workers' stage weights)."""

import pytest
import torch
import torch.nn.functional as F
from workers import BATCH, SEQ, batch, make_model

import loco
from loco.runtime import (
    PipelineStage,
    routing_path,
    routing_permutation,
    split_stages,
    stage_bounds,
)

pytestmark = pytest.mark.numerics

LAYERS = 4
STEPS = (0, 1)  # two micro-steps, accumulating gradients
# The references compute the same maths with the batch cut differently (the unsplit model; one
# sample at a time), so matmul sums are grouped differently and may round differently, by a
# few ulps of the result and without amplification (no optimizer step between). Losses here
# lie in [4, 8), where one fp32 ulp is 2^-21; gradients are smaller. 16 such ulps (measured:
# at most 1, on the generic, AVX2 and AVX-512 kernels).
TOL = 16 * 2.0**-21


# --------------------------------------------------------------------------- worker fns
def pipe_worker(ctx, routing, seed=7, same_init=False):
    model = make_model(0 if same_init else ctx.worker, layers=LAYERS)
    stage = PipelineStage(model, ctx, BATCH, SEQ, routing=routing, seed=seed)
    losses, sources = [], []
    for t in STEPS:
        loss = stage.forward_backward(batch(ctx.worker, t) if stage.is_first else None, t)
        losses.append(loss)
        sources.append(list(stage.last_sources))
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    ev = stage.evaluate(batch(ctx.worker, 99) if stage.is_first else None)
    records = [r for r in ctx.pipe.records] if ctx.pipe is not None else []
    return {"stage": ctx.stage, "worker": ctx.worker, "losses": losses, "grads": grads,
            "sources": sources, "eval": ev, "processed": stage.samples_processed,
            "records": records}


def by_coords(results):
    return {(r["worker"], r["stage"]): r for r in results}


# --------------------------------------------------------------------------- references
def reference_fixed(replica):
    model = make_model(replica, layers=LAYERS)
    losses = []
    for t in STEPS:
        loss = model(*batch(replica, t))
        loss.backward()
        losses.append(loss.detach())
    with torch.no_grad():
        ev = model(*batch(replica, 99))
    return losses, {n: p.grad for n, p in model.named_parameters()}, ev


def reference_routed(replicas, stages, seed, routing="random"):
    """Every sample on its own, through the stage weights of the replicas its path visits."""
    models = [make_model(r, layers=LAYERS) for r in range(replicas)]
    bounds = stage_bounds(LAYERS, stages)
    cos, sin = models[0].rope_cos[:SEQ], models[0].rope_sin[:SEQ]
    losses = []  # [step][last-stage replica]
    for t in STEPS:
        per_last = [[] for _ in range(replicas)]
        total = 0.0
        for origin in range(replicas):
            x, y = batch(origin, t)
            for s in range(BATCH):
                path = routing_path(seed, t, s, origin, replicas, stages, routing)
                h = models[path[0]].embed(x[s:s + 1])
                for k, (a, b) in enumerate(bounds):
                    for i in range(a, b):
                        h = models[path[k]].blocks[i](h, cos, sin)
                last = models[path[-1]]
                logits = F.linear(last.norm(h), last.embed.weight).float()
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y[s])
                per_last[path[-1]].append(loss.detach())
                total = total + loss / BATCH
        total.backward()
        assert all(len(v) == BATCH for v in per_last)
        losses.append([torch.stack(v).mean() for v in per_last])
    return losses, [{n: p.grad for n, p in m.named_parameters()} for m in models]


# --------------------------------------------------------------------------- pure parts
def test_stage_bounds_and_split():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_bounds(4, 1) == [(0, 4)]
    with pytest.raises(ValueError):
        stage_bounds(2, 3)
    model = make_model(layers=LAYERS)
    parts = split_stages(model, 3)
    names = [set(dict(p.named_parameters())) for p in parts]
    assert "embed.weight" in names[0] and "embed.weight" in names[2]
    assert "embed.weight" not in names[1] and "norm.weight" in names[2]
    assert any(n.startswith("blocks.2.") for n in names[1])
    # together the parts own every parameter of the model (the tied matrix on both ends)
    assert set.union(*names) == set(dict(model.named_parameters()))
    # one stage owns the whole model and computes its loss
    (whole,) = split_stages(model, 1)
    x, y = batch(0, 0)
    assert torch.allclose(whole.loss(whole(x), y), model(x, y))


def test_routing_permutation_is_a_deterministic_permutation():
    perms = {tuple(routing_permutation(3, 5, s, 0, 4)) for s in range(50)}
    assert all(sorted(p) == [0, 1, 2, 3] for p in perms)
    assert len(perms) > 5  # varies with the sample index
    assert routing_permutation(3, 5, 1, 0, 4) == routing_permutation(3, 5, 1, 0, 4)
    assert routing_path(3, 5, 1, 2, 4, 1) == [2]
    assert routing_path(3, 5, 1, 2, 4, 3, "fixed") == [2, 2, 2]


# --------------------------------------------------------------------------- launcher
def mesh_worker(ctx):
    h = ctx.comm.all_gather(torch.tensor([ctx.rank]))
    gathered = [int(t) for t in h.wait()]
    return {"rank": ctx.rank, "stage": ctx.stage, "worker": ctx.worker,
            "worker_rank": ctx.worker_rank, "mesh": ctx.mesh,
            "comm": (ctx.comm.rank, ctx.comm.size), "gathered": gathered,
            "participants": h.record.participants,
            "pipe": None if ctx.pipe is None else (ctx.pipe.rank, ctx.pipe.size)}


def test_launch_with_stages_gives_per_stage_comm():
    M, S = 3, 2
    out = loco.launch(mesh_worker, mesh=loco.Mesh(M, S))
    mesh = loco.Mesh(M, S)
    for rank, o in enumerate(out):
        worker, stage = mesh.coords(rank)
        assert (o["worker"], o["stage"]) == (worker, stage)
        assert o["comm"] == (worker, M)
        assert o["pipe"] == (rank, M * S)
        assert o["gathered"] == mesh.outer_peers(stage)
        # the op's participants, as global ranks, are all of this rank's stage
        glob = [mesh.outer_peers(stage)[p] for p in o["participants"]]
        assert {mesh.coords(g)[1] for g in glob} == {stage}
    # one stage: as before, no pipe
    out = loco.launch(mesh_worker, 2)
    assert [o["pipe"] for o in out] == [None, None]
    assert [o["comm"] for o in out] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="multiple"):
        loco.launch(mesh_worker, 3, stages=2)


@pytest.mark.parametrize("counts,mesh", [
    (dict(ranks=6, stages=2), loco.Mesh(3, 2)),
    (dict(ranks=4, worker_ranks=2), loco.Mesh(2, 1, 2)),
    (dict(), loco.Mesh(2)),
])
def test_counts_give_the_layout_of_the_mesh(counts, mesh):
    """All ranks (``ranks``, by keyword or by position) split into workers of ``stages`` x
    ``worker_ranks`` lay the ranks out as that ``mesh`` does."""
    layout = loco.launch(mesh_worker, mesh=mesh)
    assert loco.launch(mesh_worker, **counts) == layout
    positional = dict(counts)
    assert loco.launch(mesh_worker, positional.pop("ranks", 2), **positional) == layout
    assert [o["mesh"] for o in layout] == [mesh] * len(layout)


@pytest.mark.parametrize("old,new", [
    (dict(workers=6, ranks_per_replica=2), dict(mesh=loco.Mesh(3, 2))),
    (dict(workers=4, shards=2), dict(mesh=loco.Mesh(2, 1, 2))),
    (dict(replicas=3, stages=2), dict(mesh=loco.Mesh(3, 2))),
    (dict(replicas=2, shards=2), dict(mesh=loco.Mesh(2, 1, 2))),
    (dict(replicas=2), dict(ranks=2)),
])
def test_old_names_still_give_the_layout_and_warn(old, new):
    """``launch``'s old names, ``workers`` (all ranks: now ``ranks``), ``replicas`` (M: now
    ``mesh``), ``shards`` (now ``worker_ranks``) and ``ranks_per_replica`` (now ``stages``),
    lay the ranks out as the new ones do, for one release, each with a DeprecationWarning
    that names the new one."""
    layout = loco.launch(mesh_worker, **new)
    with pytest.warns(DeprecationWarning, match="the old name goes in the next release") as w:
        assert loco.launch(mesh_worker, **old) == layout
    said = " ".join(str(x.message) for x in w)
    for name in set(old) - {"stages"}:  # stages is a current name
        assert f"launch({name}=" in said


def test_a_layout_given_twice_is_refused():
    with pytest.raises(TypeError, match="not both"):
        loco.launch(mesh_worker, 4, mesh=loco.Mesh(2))
    with pytest.raises(TypeError, match="not both"):
        loco.launch(mesh_worker, mesh=loco.Mesh(2), stages=2)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="not both"):
        loco.launch(mesh_worker, 4, replicas=2)
    with pytest.raises(TypeError, match="not both"):
        loco.launch(mesh_worker, 4, stages=2, ranks_per_replica=2)
    with pytest.raises(ValueError, match=r"stages must be >= 1 \(got 0\)"):
        loco.launch(mesh_worker, mesh=loco.Mesh(2, 0))


def p2p_worker(ctx):
    """Every rank sends to and receives from every other rank in one step: posted first,
    waited after, on several ops, in different orders on different ranks."""
    n, me = ctx.pipe.size, ctx.pipe.rank
    peers = [p for p in range(n) if p != me]
    if me % 2:
        peers.reverse()
    bufs = {p: torch.empty(1000) for p in peers}
    sends = [(torch.full((1000,), float(me)), p) for p in peers]
    recvs = [(bufs[p], p) for p in peers]
    h1 = ctx.pipe.sendrecv(sends[:1], recvs[1:])
    h2 = ctx.pipe.sendrecv(sends[1:], recvs[:1])
    h1.wait(), h2.wait()
    one = torch.full((10,), float(me))
    # a single send / recv pair along a ring, in matching order
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = torch.empty(10)
    if me == 0:
        hs, hr = ctx.pipe.send(one, nxt), ctx.pipe.recv(got, prv)
    else:
        hr, hs = ctx.pipe.recv(got, prv), ctx.pipe.send(one, nxt)
    hr.wait(), hs.wait()
    return {p: float(b[0]) for p, b in bufs.items()}, float(got[0]), hs.record, hr.record


def test_point_to_point_ops_values_bytes_and_no_deadlock():
    out = loco.launch(p2p_worker, mesh=loco.Mesh(2, 2), timeout=30)
    for me, (bufs, got, send_rec, recv_rec) in enumerate(out):
        assert bufs == {p: float(p) for p in range(4) if p != me}
        assert got == float((me - 1) % 4)
        assert (send_rec.op, send_rec.sent_bytes, send_rec.recv_bytes) == ("send", 40, 0)
        assert (recv_rec.op, recv_rec.sent_bytes, recv_rec.recv_bytes) == ("recv", 0, 40)
        assert send_rec.participants == tuple(sorted((me, (me + 1) % 4)))
        assert recv_rec.participants == tuple(sorted((me, (me - 1) % 4)))


# --------------------------------------------------------------------------- fixed routing
def check_fixed(results, M, S):
    res = by_coords(results)
    for r in range(M):
        losses, grads, ev = reference_fixed(r)
        last = res[(r, S - 1)]
        for got, want in zip(last["losses"], losses):
            assert abs(got.item() - want.item()) < TOL
        assert abs(last["eval"].item() - ev.item()) < TOL
        assert all(res[(r, k)]["losses"] == [None] * len(STEPS) for k in range(S - 1))
        seen = set()
        for k in range(S):
            for n, g in res[(r, k)]["grads"].items():
                assert (g - grads[n]).abs().max().item() < TOL, (r, k, n)
                seen.add(n)
        assert seen == set(grads)
        # the two copies of the tied embedding got the same (summed) gradient, bit for bit
        assert torch.equal(res[(r, 0)]["grads"]["embed.weight"],
                           res[(r, S - 1)]["grads"]["embed.weight"])


def test_fixed_routing_matches_the_unsplit_model():
    M, S = 2, 2
    check_fixed(loco.launch(pipe_worker, mesh=loco.Mesh(M, S), args=("fixed",)), M, S)


def test_fixed_routing_under_the_processes_launcher():
    M, S = 2, 2
    check_fixed(loco.launch(pipe_worker, mesh=loco.Mesh(M, S), launcher="processes",
                            args=("fixed",)), M, S)


# --------------------------------------------------------------------------- random routing
@pytest.mark.parametrize("M,S", [(2, 2), (3, 3)])
def test_random_routing_matches_the_per_sample_reference(M, S):
    seed = 7
    results = loco.launch(pipe_worker, mesh=loco.Mesh(M, S), args=("random", seed))
    res = by_coords(results)
    losses, grads = reference_routed(M, S, seed)
    for q in range(M):
        for t in range(len(STEPS)):
            assert abs(res[(q, S - 1)]["losses"][t].item() - losses[t][q].item()) < TOL
    for (r, k), o in res.items():
        for n, g in o["grads"].items():
            assert (g - grads[r][n]).abs().max().item() < TOL, (r, k, n)
        assert torch.equal(res[(r, 0)]["grads"]["embed.weight"],
                           res[(r, S - 1)]["grads"]["embed.weight"])
    # routing really mattered: fixed routing gives other losses and gradients ...
    fixed_losses, fixed_grads = reference_routed(M, S, seed, routing="fixed")
    assert max(abs(res[(q, S - 1)]["losses"][t].item() - fixed_losses[t][q].item())
               for q in range(M) for t in range(len(STEPS))) > 1e-4
    # ... while evaluation uses fixed routing
    for q in range(M):
        assert abs(res[(q, S - 1)]["eval"].item() - reference_fixed(q)[2].item()) < TOL
    # load is balanced: every rank processed its batch size per step, and for every sample
    # index the sources of one stage's replicas form a permutation
    for (r, k), o in res.items():
        assert o["processed"] == BATCH * len(STEPS)
        for src in o["sources"]:
            assert len(src) == BATCH
    for k in range(1, S):
        for t in range(len(STEPS)):
            for s in range(BATCH):
                assert sorted(res[(q, k)]["sources"][t][s] for q in range(M)) == list(range(M))
    # traffic went only between adjacent stages (and stage 0 <-> S-1 for the tied weight)
    mesh = loco.Mesh(M, S)
    for (r, k), o in res.items():
        for rec in o["records"]:
            stages = {mesh.coords(p)[1] for p in rec.participants}
            assert stages <= {k - 1, k, k + 1} or stages == {0, S - 1}, (k, rec)


def test_random_routing_with_equal_weights_equals_fixed_routing_gradient_sum():
    """With identical weights everywhere the stage weights a sample visits do not matter:
    the sum of the replicas' gradients equals fixed routing's."""
    M, S = 2, 2
    rand = by_coords(loco.launch(pipe_worker, mesh=loco.Mesh(M, S),
                                 args=("random", 7, True)))
    fixed = by_coords(loco.launch(pipe_worker, mesh=loco.Mesh(M, S),
                                  args=("fixed", 7, True)))
    for k in range(S):
        for n in rand[(0, k)]["grads"]:
            a = sum(rand[(r, k)]["grads"][n] for r in range(M))
            b = sum(fixed[(r, k)]["grads"][n] for r in range(M))
            assert (a - b).abs().max().item() < TOL


# --------------------------------------------------------------------------- with an outer algorithm
def diloco_pipe_worker(ctx, steps=4):
    from workers import make_optimizer

    model = make_model(layers=LAYERS)
    stage = PipelineStage(model, ctx, BATCH, SEQ, routing="random", seed=1)
    opt = make_optimizer(stage.module)
    algo = loco.DiLoCo(stage.module, opt, ctx.comm, sync_every=2, outer_lr=0.7,
                       outer_momentum=0.9)
    for t in range(steps):
        stage.forward_backward(batch(ctx.worker, t) if stage.is_first else None, t)
        algo.step()
        algo.zero_grad()
    return {"stage": ctx.stage, "worker": ctx.worker,
            "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
            "global": {n: p.detach().clone() for n, p in algo.global_parameters().items()}}


def test_diloco_over_stages_keeps_tied_copies_and_stage_replicas_in_step():
    M, S = 2, 2
    res = by_coords(loco.launch(diloco_pipe_worker, mesh=loco.Mesh(M, S)))
    for r in range(M):
        # the tied embedding's two copies (stage 0 and stage S-1) stay identical
        assert torch.equal(res[(r, 0)]["params"]["embed.weight"],
                           res[(r, S - 1)]["params"]["embed.weight"])
    for k in range(S):
        # the outer reduction ran among the replicas of a stage
        for n, g in res[(0, k)]["global"].items():
            assert torch.equal(g, res[(1, k)]["global"][n])
    # and training moved the weights
    assert not torch.equal(res[(0, 0)]["params"]["embed.weight"],
                           make_model(layers=LAYERS).embed.weight)


def train_pipe_worker(ctx, cfg_kwargs, layers, steps):
    """``loco train``'s own algorithm set-up (``Method.from_config``) on a pipeline stage."""
    from loco.config import TrainConfig, resolve
    from loco.training import adamw

    cfg = resolve(TrainConfig(**cfg_kwargs))
    model = make_model(layers=layers)
    stage = PipelineStage(model, ctx, BATCH, SEQ, routing=cfg.runtime.routing, seed=3)
    algo = cfg.method_class.from_config(cfg, stage.module, adamw(stage.module, cfg), ctx.comm, stage)
    for t in range(steps):
        stage.forward_backward(batch(ctx.worker, t) if stage.is_first else None, t)
        algo.step()
        algo.zero_grad()
    algo.flush()
    return {"stage": ctx.stage, "worker": ctx.worker,
            "embed": stage.module.embed.weight.detach().clone()
            if stage.module.embed is not None else None,
            "fragments": algo.fragments() if hasattr(algo, "fragments") else None,
            "outer": [(rec.op, rec.participants) for rec in ctx.comm.records
                      if rec.tag == "train"],
            "pipe": [(rec.op, rec.participants) for rec in ctx.pipe.records
                     if rec.tag == "train"]}


def test_streaming_over_uneven_stages_syncs_the_tied_copies_together():
    """5 blocks over 2 stages (3 + 2): balancing alone would put the embedding in fragment 1
    on stage 0 but in fragment 0 on the last stage, so its two copies would be synced at
    different steps and drift apart. Training pins both into fragment 0."""
    from loco.algorithms.fragments import split_fragments

    model = make_model(layers=5)
    first, last = split_stages(model, 2)
    assert "embed.weight" in split_fragments(first, 2)[1]
    assert "embed.weight" in split_fragments(last, 2)[0]

    M, S = 2, 2
    cfg = dict(algorithm="streaming", workers=M, stages=S, fragments=2, sync_every=4,
               overlap=1)
    res = by_coords(loco.launch(train_pipe_worker, mesh=loco.Mesh(M, S),
                                args=(cfg, 5, 10)))
    for r in range(M):
        assert "embed.weight" in res[(r, 0)]["fragments"][0]
        assert "embed.weight" in res[(r, S - 1)]["fragments"][0]
        assert torch.equal(res[(r, 0)]["embed"], res[(r, S - 1)]["embed"])
    assert not torch.equal(res[(0, 0)]["embed"], model.embed.weight)


def test_noloco_over_stages_with_random_routing_has_no_collective():
    """4 replicas x 2 stages: gossip pairs inside each stage, point-to-point traffic between
    stages; no training operation spans all replicas of a stage, nor the world."""
    M, S = 4, 2
    cfg = dict(algorithm="noloco", workers=M, stages=S, routing="random", sync_every=2)
    res = by_coords(loco.launch(train_pipe_worker, mesh=loco.Mesh(M, S),
                                args=(cfg, LAYERS, 6)))
    for (r, k), out in res.items():
        assert len(out["outer"]) == 3  # one gossip exchange per outer step
        assert all(op == "exchange" and len(p) == 2 < M for op, p in out["outer"])
        # batched point-to-point messages to the next or previous stage's replicas (and the
        # tied gradient's pair exchange): never the whole world
        assert out["pipe"] and all(op in ("send", "recv", "exchange") and len(p) <= M + 1 < M * S
                                   for op, p in out["pipe"])
    for r in range(M):  # the tied copies follow the same groups on both stages
        assert torch.equal(res[(r, 0)]["embed"], res[(r, S - 1)]["embed"])


def test_routing_indices_reach_the_device_in_one_copy_and_are_reused(monkeypatch):
    """A routing plan's per-peer sample indices: right, built once per plan (fixed routing
    copies nothing after the first step), and on a GPU one pinned, non-blocking copy for all
    peers (the copy is recorded by stand-ins: no GPU here)."""
    from types import SimpleNamespace

    from loco.runtime.pipeline import PipelineStage

    stage = SimpleNamespace(_group_cache={}, device=torch.device("cpu"))
    groups = PipelineStage._groups(stage, [2, 0, 2, 1])
    assert {p: t.tolist() for p, t in groups.items()} == {0: [1], 1: [3], 2: [0, 2]}
    assert PipelineStage._groups(stage, [2, 0, 2, 1]) is groups  # the same plan: no copy
    copies = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (
        copies.append((str(a[0]), k.get("non_blocking"))) or self) if a and
        str(a[0]).startswith("cuda") else real_to(self, *a, **k))
    gpu = SimpleNamespace(_group_cache={}, device=torch.device("cuda", 0))
    assert [t.tolist() for t in PipelineStage._groups(gpu, [1, 0, 1]).values()] == [[1], [0, 2]]
    assert copies == [("cuda:0", True)]
