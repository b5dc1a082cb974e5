"""A non-finite value on one worker: every worker of the sync decides alike, with every codec.

One replica's weight is set to +inf just before it sends; its pseudo-gradient is then -inf
(or +inf: NoLoCo's sign is the other way). With ``on_nonfinite="skip"`` every worker of the
sync (all of them for DiLoCo and Streaming DiLoCo, the gossip group for NoLoCo) skips that
same sync: the global copy and the outer optimizer state stay bit for bit what they were, the
replicas restart from them, and the later syncs go on. With ``"stop"`` every one of them
raises NonFiniteError. A worker left alone in a collective would fail the test through the
communication timeout instead of hanging it.

Before the fix, a scaled codec (fp8, int8, fp4) raised inside the poisoned worker's encoder,
on its communication thread, while its peers waited in the collective.
"""

import pytest
import torch

import loco
from loco.algorithms.base import NonFiniteError
from loco.comm.codecs import CODEC_NAMES, SPARSE_CODEC_NAMES, get_codec
from workers import batch, make_model, make_optimizer

pytestmark = pytest.mark.numerics

TIMEOUT = 20  # seconds a collective may wait: a worker left behind fails instead of hanging
H = 4
POISONED = 1  # the worker whose replica gets an infinite weight
METHODS = {  # name: (fragments P, overlap τ, α) of the (Streaming) DiLoCo setting
    "diloco": (1, 0, 0.0),  # DiLoCo (the DiLoCo class itself with fp32)
    "streaming": (2, 1, 0.5),
}


def reduce_worker(ctx, codec_name, bad):
    """The quantized mean-all-reduce of one vector, clean, then with ``bad`` at index 40 on
    worker POISONED; and the wire bytes of both."""
    codec = get_codec(codec_name)
    x = torch.randn(200, generator=torch.Generator().manual_seed(ctx.rank))
    poisoned = x.clone()
    if ctx.rank == POISONED:
        poisoned[40] = bad
    clean = ctx.comm.all_reduce_mean(x, codec=codec).wait()
    got = ctx.comm.all_reduce_mean(poisoned, codec=codec).wait()
    return clean, got, [r.sent_bytes for r in ctx.comm.records if r.tag == "train"]


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_reduction_carries_nonfinite_to_every_worker(codec, bad):
    """The agreement every algorithm relies on: one worker's non-finite value makes the
    reduced block it sits in non-finite on every worker, bit for bit the same, at no extra
    byte; every other value is the one the clean reduction gives."""
    out = loco.launch(reduce_worker, 2, args=(codec, bad), timeout=TIMEOUT)
    bits = [got.view(torch.int32) for _, got, _ in out]
    assert torch.equal(bits[0], bits[1])  # the same bytes everywhere, NaN included
    if codec in SPARSE_CODEC_NAMES:  # a row is one unit: its chunk is non-finite, not a block
        for _, got, sent in out:
            assert not torch.isfinite(got).all() and sent[0] == sent[1]
        return
    align = get_codec(codec).align
    block = slice(40 // align * align, 40 // align * align + align)
    for clean, got, sent in out:
        assert not torch.isfinite(got[block]).any()
        rest = torch.ones(got.numel(), dtype=torch.bool)
        rest[block] = False
        assert torch.equal(got[rest], clean[rest])
        assert sent[0] == sent[1]  # the marker costs no byte


def build(ctx, model, method: str, codec: str, policy: str, **extra):
    """The method with the plain mean (``aggregation="mean"``): with the default guard a
    non-finite contribution of one worker is left out of the average, and nothing is
    skipped (tests/test_guard.py); what this file tests is the average that carries it."""
    opt = make_optimizer(model)
    extra.setdefault("aggregation", "mean")
    if method == "noloco":
        return loco.NoLoCo(model, opt, ctx.comm, sync_every=H, codec=codec, warn=False,
                           on_nonfinite=policy, **extra)
    if method == "diloco" and codec == "fp32":
        return loco.DiLoCo(model, opt, ctx.comm, sync_every=H, on_nonfinite=policy, **extra)
    fragments, overlap, alpha = METHODS[method]
    return loco.StreamingDiLoCo(model, opt, ctx.comm, sync_every=H, fragments=fragments,
                                overlap=overlap, alpha=alpha, codec=codec,
                                on_nonfinite=policy, **extra)


def outer_state(algo) -> list[torch.Tensor]:
    """What a skipped sync must leave alone: the global copy and the outer momentum."""
    if isinstance(algo, loco.NoLoCo):
        return [algo.slow.clone(), algo.momentum.clone()]
    return [t.clone() for f in algo.fragment_list
            for t in (f.global_flat, *(s["momentum_buffer"]
                                       for s in f.outer_optimizer.state.values()))]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def skipped_sync(algo) -> tuple[int | None, bool]:
    """The fragment of the sync just skipped (None for NoLoCo), and whether its parameters
    restarted from the global (slow) copy, bit for bit."""
    if isinstance(algo, loco.NoLoCo):
        return None, all(torch.equal(p, g) for p, g in zip(algo.params, algo.slow_params))
    f = algo.fragment_list[algo.sync_log[-1]["fragment"]]
    return f.index, all(torch.equal(p, g) for p, g in zip(f.params, f.global_params))


def poisoned_worker(ctx, method, codec, policy, steps, poison_at, **extra):
    """Train; worker POISONED sets a weight (of fragment 0) to +inf before inner step
    ``poison_at``, whose sync then carries it. Returns what every step did to the outer state,
    or where NonFiniteError stopped the worker."""
    model = make_model()
    algo = build(ctx, model, method, codec, policy, **extra)
    param = algo.params[0] if method == "noloco" else algo.fragment_list[0].params[0]
    synced, skips = [], []
    for t in range(1, steps + 1):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        if ctx.rank == POISONED and t == poison_at:
            with torch.no_grad():
                param.fill_(float("inf"))
        before, skipped = outer_state(algo), algo.skipped["syncs"]
        try:
            algo.step()
        except NonFiniteError as err:
            return {"stopped": str(err), "unchanged": same(before, outer_state(algo))}
        algo.zero_grad()
        if algo.skipped["syncs"] != skipped:
            fragment, restarted = skipped_sync(algo)
            skips.append({"step": t, "fragment": fragment, "restarted": restarted,
                          "unchanged": same(before, outer_state(algo))})
        elif not same(before, outer_state(algo)):
            synced.append(t)
    return {"synced": synced, "skips": skips, "skipped": dict(algo.skipped),
            "outer": outer_state(algo),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def schedule(method: str):
    """(steps, the step the poison is sent at, the steps syncs are applied at, τ)."""
    if method == "noloco":
        return 3 * H, 2 * H, [H, 2 * H, 3 * H], 0
    fragments, overlap, _ = METHODS[method]
    sends = range(H // fragments, 3 * H + 1, H // fragments)  # fragment 0 first
    applied = [t + overlap for t in sends if t + overlap <= 3 * H]
    return 3 * H, H + H // fragments, applied, overlap  # fragment 0's second sync


# (codec, method) cases of each policy: a covering design in place of the full grid of
# codec x method x policy (48 runs): every (codec, method) pair once, under one policy or the
# other, so that every codec meets both policies (its two methods) and each method both
# policies (half of the codecs each). The DiLoCo class itself (fp32 with "diloco") under both.
SKIP_CASES = [(c, ("diloco", "streaming")[i % 2]) for i, c in enumerate(CODEC_NAMES)]
STOP_CASES = [(c, ("streaming", "diloco")[i % 2]) for i, c in enumerate(CODEC_NAMES)] + [
    ("fp32", "diloco")]


@pytest.mark.parametrize("codec,method,extra", [
    *((c, m, {}) for c, m in SKIP_CASES),
    # the outer step on a helper thread (loco.algorithms.outer_thread): its verdict
    *(("fp32", m, {"outer_thread": True}) for m in ("diloco", "streaming")),
    ("fp4_e3m0", "streaming", {"outer_thread": True})])
def test_skip_agrees_on_every_worker(method, codec, extra):
    steps, poison_at, applied, overlap = schedule(method)
    out = loco.launch(poisoned_worker, 2, args=(method, codec, "skip", steps, poison_at),
                      kwargs=extra, timeout=TIMEOUT)
    skip_at = poison_at + overlap
    for rank, r in enumerate(out):
        # the same sync skipped everywhere, nothing of the outer state touched by it
        assert r["skips"] == [{"step": skip_at, "fragment": 0, "restarted": True,
                               "unchanged": True}]
        assert r["skipped"] == {"syncs": 1,
                                "inner_steps": overlap if rank == POISONED else 0}
        # every other sync applied: the run goes on, finite
        assert r["synced"] == [t for t in applied if t != skip_at]
        assert r["finite"]
    assert same(out[0]["outer"], out[1]["outer"])  # the replicas still agree bit for bit


@pytest.mark.parametrize("codec,method,extra", [
    *((c, m, {}) for c, m in STOP_CASES),
    ("fp4_e3m0", "streaming", {"outer_thread": True})])
def test_stop_raises_on_every_worker(method, codec, extra):
    _, poison_at, _, overlap = schedule(method)
    out = loco.launch(poisoned_worker, 2, args=(method, codec, "stop", poison_at + overlap,
                                                poison_at), kwargs=extra, timeout=TIMEOUT)
    for rank, r in enumerate(out):
        assert r["unchanged"]  # stopped before the outer state moved
        assert f"at step {poison_at + overlap}," in r["stopped"]
        # with τ > 0 the poisoned replica's own next gradient is caught first
        what = "gradient" if overlap and rank == POISONED else "pseudo-gradient (fragment 0)"
        assert f"non-finite {what} at" in r["stopped"]


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_noloco_group_agrees(policy, codec):
    """Four workers in pairs: the poisoned worker's pair skips (or stops at) that outer step,
    the other pair is not concerned and steps as usual."""
    steps, poison_at, applied, _ = schedule("noloco")
    if policy == "stop":
        steps = poison_at  # the stopped pair's partners would wait for it afterwards
    out = loco.launch(poisoned_worker, 4, args=("noloco", codec, policy, steps, poison_at),
                      timeout=TIMEOUT)
    group = next(g for g in loco.algorithms.noloco.gossip_groups(0, poison_at // H - 1, 4, 2)
                 if POISONED in g)
    for rank, r in enumerate(out):
        if rank not in group:
            assert r["skips"] == [] and r["synced"] == applied[:steps // H]
        elif policy == "stop":
            assert r["unchanged"]
            assert f"non-finite pseudo-gradient at step {poison_at}," in r["stopped"]
        else:
            assert r["skips"] == [{"step": poison_at, "fragment": None, "restarted": True,
                                   "unchanged": True}]
            assert r["skipped"] == {"syncs": 1, "inner_steps": 0}
            assert r["synced"] == [t for t in applied if t != poison_at] and r["finite"]


def ddp_poisoned_worker(ctx, policy, steps, poison_at):
    model = make_model()
    algo = loco.DataParallel(model, make_optimizer(model), ctx.comm, on_nonfinite=policy,
                             aggregation="mean")  # the plain mean (see ``build``)
    moved = []
    for t in range(1, steps + 1):
        x, y = batch(ctx.rank, t)
        poison = None
        if ctx.rank == POISONED and t == poison_at:  # in the backward pass, as an overflow
            poison = next(iter(model.parameters())).register_hook(
                lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        model(x, y).backward()
        if poison is not None:
            poison.remove()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            algo.step()
        except NonFiniteError as err:
            return {"stopped": str(err), "unchanged": same(before, list(model.parameters()))}
        algo.zero_grad()
        if not same(before, [p.detach() for p in model.parameters()]):
            moved.append(t)
    return {"moved": moved, "skipped": dict(algo.skipped),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_data_parallel_gradient_agrees(policy):
    """DataParallel averages the gradient unencoded (fp32): the infinity reaches every
    worker's averaged gradient, so all skip (or stop at) that inner step."""
    out = loco.launch(ddp_poisoned_worker, 2, args=(policy, 6, 3), timeout=TIMEOUT)
    for r in out:
        if policy == "stop":
            assert r["unchanged"] and "non-finite gradient at step 3," in r["stopped"]
        else:
            assert r["moved"] == [1, 2, 4, 5, 6]
            assert r["skipped"] == {"syncs": 0, "inner_steps": 1}
    if policy == "skip":
        assert same(out[0]["params"], out[1]["params"])
