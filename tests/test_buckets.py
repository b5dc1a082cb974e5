"""Gradients averaged over a worker's ranks in buckets while the backward pass runs
(``loco.algorithms.buckets.GradientBuckets``, ``--worker-parallel ddp``): the first bucket's
reduction is issued before the backward pass ends, the means are those of one all-reduce of
all gradients bit for bit, gradient accumulation and parameters without a gradient are
handled."""

from __future__ import annotations

import pytest
import torch
from workers import batch, make_model

import loco
from loco.algorithms.buckets import GradientBuckets
from loco.algorithms.sharding import flatten_fp32, unflatten_views


def whole_mean(ctx, params):
    """The reference: every gradient flattened and averaged in one all-reduce."""
    flat = flatten_fp32([p.grad if p.grad is not None else torch.zeros_like(p)
                         for p in params])
    ctx.inner.all_reduce_mean(flat, tag="train").wait()
    return [v.clone() for v in unflatten_views(flat, params)]


def bucket_worker(ctx, steps, accumulate=1, unused=None):
    model = make_model(layers=4)
    params = [p for p in model.parameters()]
    if unused is not None:  # a trained parameter the loss does not reach: no gradient
        params.insert(unused, torch.nn.Parameter(torch.ones(3)))
    buckets = GradientBuckets(params, ctx.inner, bucket_bytes=16 << 10)
    events, issue = [], ctx.inner.all_reduce_mean

    def spy(tensor, *args, **kwargs):
        events.append(("issue", tensor.numel()))
        return issue(tensor, *args, **kwargs)
    ctx.inner.all_reduce_mean = spy
    same = []
    for t in range(steps):
        for a in range(accumulate):
            x, y = batch(ctx.worker_rank, accumulate * t + a)
            model(x, y).backward()
            events.append(("backward done", a))
        ctx.inner.all_reduce_mean = issue
        want = whole_mean(ctx, params)
        ctx.inner.all_reduce_mean = spy
        buckets.finish()
        same.append(all(torch.equal(p.grad, w) for p, w in zip(params, want)))
        for p in params:
            p.grad = None
    buckets.close()
    return events, same, len(buckets.buckets)


def test_the_first_bucket_is_reduced_before_the_backward_pass_ends():
    for events, same, n in loco.launch(bucket_worker, mesh=loco.Mesh(1, 1, 2), args=(2,)):
        assert n > 2 and all(same)
        done = [i for i, e in enumerate(events) if e[0] == "backward done"]
        for start, end in zip([-1, *done], done):
            step = events[start + 1:end + 1]
            issued = [e for e in step if e[0] == "issue"]
            assert issued and step.index(issued[0]) < len(step) - 1  # before the end
            assert len(issued) == n  # every bucket went during the backward pass


@pytest.mark.parametrize("accumulate, unused", [(2, None), (1, 5)])
def test_accumulated_and_missing_gradients_give_the_whole_mean(accumulate, unused):
    """Two backward passes before the step: the mean of the sums (the buckets that went
    during the first pass are reduced again). A parameter without a gradient inside a
    bucket: the bucket waits for ``finish()``, which reduces it with zeros for that
    parameter (and sets them as its gradient)."""
    for events, same, n in loco.launch(bucket_worker, mesh=loco.Mesh(1, 1, 2),
                                       args=(2, accumulate, unused)):
        assert all(same)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one parameter"):
        GradientBuckets([], None)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 4"):
        GradientBuckets([torch.zeros(2, requires_grad=True)], None, bucket_bytes=2)


def fsdp_data_parallel_worker(ctx, steps):
    """DataParallel across 2 workers, FSDP2 over each worker's 2 ranks: the order of the
    cross-worker reductions and the ends of the backward passes."""
    from loco.runtime.fsdp import shard_worker

    model = make_model(layers=2)
    shard_worker(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    algo = loco.DataParallel(model, opt, ctx.comm, inner=ctx.inner)
    events, issue = [], ctx.comm.all_reduce_mean

    def spy(tensor, *args, **kwargs):
        events.append("issue")
        return issue(tensor, *args, **kwargs)
    ctx.comm.all_reduce_mean = spy
    for t in range(steps):
        x, y = batch(ctx.worker * 2 + ctx.worker_rank, t)
        model(x, y).backward()
        events.append("backward done")
        algo.step()
        algo.zero_grad()
    return events


@pytest.mark.slow
def test_data_parallel_with_fsdp_inside_reduces_each_unit_during_backward():
    """Each FSDP2 unit's gradient shard is averaged across the workers from FSDP2's
    all-reduce hook, as soon as its reduce-scatter is done: one reduction per unit (the 2
    blocks and the root), all before the backward pass returns, none in ``step()``."""
    for events in loco.launch(fsdp_data_parallel_worker, launcher="processes",
                              mesh=loco.Mesh(2, 1, 2), args=(2,)):
        assert events == ["issue"] * 3 + ["backward done"] + ["issue"] * 3 + ["backward done"]
