"""DataParallel's DDP path: ``torch.nn.parallel.DistributedDataParallel`` with a
communication hook that averages each bucket through ``Comm.all_reduce_mean`` while the
backward pass runs. Its maths against the explicit path and a single-process big batch, its
bytes bucket by bucket, the overlap, and which path runs when."""

import math
import time

import pytest
import torch

import loco
from loco.comm.link import LinkSpec
from workers import BATCH, batch, make_model, max_diff, params_of, reference_big_batch, ulps

STEPS = 4
CAP = 0.02  # MiB: the tiny test model's 30,784 fp32 gradients fall into several buckets


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def ddp_run(ctx, steps=STEPS, explicit=False, codec="fp32", clip=0.5, poison=None,
            accumulate=False, aggregation="drop"):
    """DataParallel over ``steps`` steps. ``explicit``: the loop calls ``model.forward``, which
    bypasses the forward hooks, so DDP does not run and ``step()`` averages (the explicit
    path). Returns the parameters, every step's applied gradient, each worker's own gradient
    of every step (captured in the backward pass, before any reduction), the train records
    with the step they were issued in, and when each step's last gradient was computed."""
    model = make_model()
    algo = loco.DataParallel(model, sgd(model), ctx.comm, max_grad_norm=clip, codec=codec,
                             bucket_cap_mb=CAP, on_nonfinite="skip", aggregation=aggregation)
    first = next(model.parameters())  # the token embedding: its gradient comes last
    applied, own, last_grad, issued = [], [], [], []
    for t in range(steps):
        mine = {}
        hooks = [p.register_hook(lambda g, n=n: mine.__setitem__(n, g.clone()))
                 for n, p in model.named_parameters()]
        hooks.append(first.register_hook(lambda g: last_grad.append(time.perf_counter())))
        if poison is not None and poison == (ctx.rank, t):  # a NaN that arises in backward
            hooks.append(first.register_hook(lambda g: torch.full_like(g, math.nan)))
        forward = model.forward if explicit else model
        n_before = len(ctx.comm.records)
        if accumulate:  # two half batches: the first accumulates locally (no_sync)
            x, y = batch(ctx.rank, t)
            with algo.no_sync():
                forward(x[:BATCH // 2], y[:BATCH // 2]).backward()
            forward(x[BATCH // 2:], y[BATCH // 2:]).backward()
        else:
            forward(*batch(ctx.rank, t)).backward()
        for h in hooks:
            h.remove()
        algo.step()
        applied.append({n: p.grad.clone() for n, p in model.named_parameters()})
        own.append(mine)
        algo.zero_grad()
        issued += [(t, r) for r in list(ctx.comm.records)[n_before:] if r.tag == "train"]
    return {"params": params_of(dict(model.named_parameters())), "applied": applied,
            "own": own, "issued": issued, "last_grad": last_grad, "ddp": algo.ddp is not None,
            "skipped": dict(algo.skipped), "waited": ctx.comm.totals().waited,
            "sent": ctx.comm.totals().sent_bytes, "issued_bytes": ctx.comm.issued_bytes(),
            "setup_ops": [r.op for r in ctx.comm.records if r.tag == "setup"]}


@pytest.mark.numerics
def test_ddp_path_is_the_explicit_path_bit_for_bit_and_a_big_batch():
    """Bucket by bucket during the backward pass, each value is still averaged by one
    worker as g_0 + g_1 then / 2, as the explicit path's one reduction does: the same bits
    (the clip and the SGD step run the same operations after it). Against one process on the
    concatenated batch the tolerances are test_algorithms.py's big-batch ones, for the same
    reason: a mean of M per-worker means groups the per-token sums differently from one mean
    over M·b sequences (a sum of n <= 128 terms rounds by up to log2 n ulps each way: 16
    ulps of the largest gradient), and SGD with momentum carries a gradient error to the
    parameters times lr · (1 + μ + ...), plus one rounding of each step."""
    ddp = loco.launch(ddp_run, 2)
    explicit = loco.launch(ddp_run, 2, kwargs={"explicit": True})
    assert all(r["ddp"] for r in ddp)
    assert all(not r["issued"] or r["issued"][0][1].issued_at >= r["last_grad"][0]
               for r in explicit)  # (the explicit path reduces after the backward pass)
    for d, e in zip(ddp, explicit, strict=True):
        assert max_diff(d["params"], e["params"]) == 0
        for a, b in zip(d["applied"], e["applied"], strict=True):
            assert max_diff(a, b) == 0
    assert max_diff(ddp[0]["params"], ddp[1]["params"]) == 0
    params, grads = reference_big_batch(2, STEPS, 0.5, sgd)
    grad_tol = max(ulps(g, 16) for g in grads)
    carried = sum(sum(0.9 ** k for k in range(t + 1)) for t in range(STEPS))
    for r in ddp:
        for have, want in zip(r["applied"], grads, strict=True):
            assert max_diff(have, want) <= grad_tol
        assert max_diff(r["params"], params) <= 0.5 * carried * grad_tol + ulps(params, STEPS)


def test_buckets_bytes_exact_and_reduced_while_backward_runs():
    """Each bucket is one mean-all-reduce of its n values: 2 (M − 1) · ⌈n / M⌉ · 4 bytes
    sent and received. The first step reduces one bucket of everything (DDP learns the order
    the gradients come in), then buckets of about CAP, the first of them issued before the
    backward pass has computed its last gradient."""
    m = 3
    out = loco.launch(ddp_run, m)
    n = sum(p.numel() for p in make_model().parameters())
    largest = max(p.numel() for p in make_model().parameters())
    for r in out:
        for t in range(STEPS):
            recs = [rec for s, rec in r["issued"] if s == t]
            assert sum(rec.raw_bytes for rec in recs) == 4 * n  # every gradient, once
            for rec in recs:
                assert rec.op == "all_reduce_mean"
                assert rec.sent_bytes == rec.recv_bytes == 2 * (m - 1) * math.ceil(
                    rec.raw_bytes / 4 / m) * 4
            if t == 0:
                assert len(recs) == 1
            else:
                # a bucket closes once it holds CAP or more: at most one parameter over it
                assert len(recs) >= 3
                assert max(rec.raw_bytes for rec in recs) < CAP * 2 ** 20 + 4 * largest
                # reduced while the backward pass still ran
                assert recs[0].issued_at < r["last_grad"][t]
        assert r["sent"] == r["issued_bytes"] == sum(rec.sent_bytes for _, rec in r["issued"])
        # DDP's own traffic (the rebuilt buckets' layout, once) went through the Comm too
        assert r["setup_ops"].count("broadcast") > 0


@pytest.mark.numerics
def test_bf16_gradients_round_as_stated():
    """As the explicit path: each worker's gradient goes out in bf16, the owner sums in fp32
    and sends the mean back in bf16; with M = 2 the sum and the halving are exact, so the
    applied (unclipped) gradient is bf16((bf16(g_0) + bf16(g_1)) / 2) bit for bit."""
    out = loco.launch(ddp_run, 2, kwargs={"codec": "bf16", "clip": None})
    fp32 = loco.launch(ddp_run, 2, kwargs={"clip": None})
    assert out[0]["ddp"] and out[0]["sent"] * 2 == fp32[0]["sent"]
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    for t in range(STEPS):
        for name, applied in out[0]["applied"][t].items():
            g0, g1 = out[0]["own"][t][name], out[1]["own"][t][name]
            assert torch.equal(applied, r((r(g0) + r(g1)) / 2))
    assert max_diff(out[0]["params"], out[1]["params"]) == 0


def test_nonfinite_gradient_from_backward_reaches_every_worker():
    """A NaN that arises in one worker's backward pass is averaged into every worker's
    gradient (the plain mean): both skip that step alike and stay identical. With the
    default guard that worker's gradient is left out instead: nothing is skipped, and the
    workers stay identical."""
    out = loco.launch(ddp_run, 2, kwargs={"poison": (1, 2), "aggregation": "mean"})
    for r in out:
        assert r["ddp"] and r["skipped"] == {"inner_steps": 1, "syncs": 0}
    assert max_diff(out[0]["params"], out[1]["params"]) == 0
    guarded = loco.launch(ddp_run, 2, kwargs={"poison": (1, 2)})
    for r in guarded:
        assert r["skipped"] == {"inner_steps": 0, "syncs": 0}
    assert max_diff(guarded[0]["params"], guarded[1]["params"]) == 0


def test_no_sync_accumulates_locally_and_averages_once():
    """Two backward passes per step, the first inside ``no_sync()``: one reduction of the
    summed gradient per step, the same bits as the explicit path's."""
    ddp = loco.launch(ddp_run, 2, kwargs={"accumulate": True})
    explicit = loco.launch(ddp_run, 2, kwargs={"accumulate": True, "explicit": True})
    assert sum(rec.raw_bytes for _, rec in ddp[0]["issued"]) == STEPS * 4 * sum(
        p.numel() for p in make_model().parameters())
    assert max_diff(ddp[0]["params"], explicit[0]["params"]) == 0


def test_blocked_time_is_counted_under_a_slow_link():
    """The backward pass ends once every bucket has crossed the emulated link; that wait is
    the loop's blocked time, as the explicit path's wait in step()."""
    out = loco.launch(ddp_run, 2, kwargs={"steps": 2}, link=LinkSpec(1e9, 0.02))
    for r in out:
        assert r["ddp"] and r["waited"] >= 2 * 2 * 0.02 * 0.9  # 2 steps, 2 phases each


def test_other_cases_take_the_explicit_path():
    """Workers of several ranks, pipeline stages and elastic membership keep the explicit
    path (FSDP2 too: tests/test_fsdp.py)."""
    from loco.runtime.pipeline import stage_part

    def ranks(ctx):
        model = make_model()
        algo = loco.DataParallel(model, sgd(model), ctx.comm, inner=ctx.inner)
        model(*batch(ctx.rank, 0)).backward()
        algo.step()
        return algo.ddp is None, ctx.comm.totals().ops
    assert loco.launch(ranks, 4, worker_ranks=2) == [(True, 1)] * 4

    comm = loco.Comm(None, 0, 1)
    try:
        stage = stage_part(make_model(), 0, 2)
        assert loco.DataParallel(stage, sgd(stage), comm).ddp is None
        model = make_model()
        assert loco.DataParallel(model, sgd(model), comm).ddp is not None
        comm.elastic = True  # what DataParallel looks at, without a Lighthouse
        comm.register_state = lambda *args: None
        assert loco.DataParallel(model, sgd(model), comm).ddp is None
    finally:
        comm.close()


def test_a_deep_copy_of_the_model_is_not_driven_by_ddp():
    """The forward hooks travel with ``copy.deepcopy(model)`` but act on the model only."""
    import copy

    comm = loco.Comm(None, 0, 1)
    try:
        model = make_model()
        algo = loco.DataParallel(model, sgd(model), comm)
        calls, pre_forward = [], algo.ddp._pre_forward
        algo.ddp._pre_forward = lambda *a, **k: (calls.append(1), pre_forward(*a, **k))[1]
        twin = copy.deepcopy(model)
        twin(*batch(0, 0)).backward()
        assert calls == [] and comm.totals().ops == 0
        model(*batch(0, 0)).backward()
        algo.step()
        assert calls == [1] and comm.totals().ops == 1  # one bucket: the model's gradients
    finally:
        comm.close()


class DDPWithoutForwardSyncBuffers(torch.nn.parallel.DistributedDataParallel):
    """torch 2.11's DDP, as far as its arguments go: no ``forward_sync_buffers`` (added in
    2.12): passing it raised a TypeError there, the DataParallel failure of the first GPU
    check (docs/gpu.md). It records what it was given."""

    given: list = []

    def __init__(self, module, process_group=None, broadcast_buffers=True, init_sync=True,
                 gradient_as_bucket_view=False, bucket_cap_mb=None):
        self.given.append({"broadcast_buffers": broadcast_buffers, "init_sync": init_sync})
        super().__init__(module, process_group=process_group, init_sync=init_sync,
                         gradient_as_bucket_view=gradient_as_bucket_view,
                         bucket_cap_mb=bucket_cap_mb, forward_sync_buffers=broadcast_buffers)


def test_ddp_path_runs_on_a_torch_without_forward_sync_buffers(monkeypatch):
    """On a torch whose DDP has no ``forward_sync_buffers`` (2.11, the first GPU machine's),
    the DDP path is still taken, asks for no buffer broadcast through ``broadcast_buffers``
    and gives the same parameters as on this torch, bit for bit."""
    import loco.algorithms.data_parallel as dp
    today = loco.launch(ddp_run, 2, kwargs={"steps": 2})
    monkeypatch.setattr(dp, "DistributedDataParallel", DDPWithoutForwardSyncBuffers)
    DDPWithoutForwardSyncBuffers.given.clear()
    older = loco.launch(ddp_run, 2, kwargs={"steps": 2})
    assert DDPWithoutForwardSyncBuffers.given == [{"broadcast_buffers": False,
                                                  "init_sync": False}] * 2
    for a, b in zip(today, older, strict=True):
        assert a["ddp"] and b["ddp"] and max_diff(a["params"], b["params"]) == 0
