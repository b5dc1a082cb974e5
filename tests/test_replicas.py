"""Replicas that drift are caught (``--verify-every``): the digest sees any flipped bit and
is the same on every call; a worker whose global copy differs is named and healed from the
majority's; without a majority the run stops; with the check off a flipped copy persists."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import small_run
from workers import make_model, make_optimizer, train_steps

import loco
import loco.training.finish
import loco.training.loop
from loco.algorithms import replicas
from loco.algorithms.replicas import ReplicasDisagree, check_replicas, digest
from loco.cli import main

SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of value ``index`` of the flat tensor ``t``, in place."""
    bits = t.view(-1).view(SIGNED[t.element_size()])
    width = 8 * t.element_size()
    bits[index] ^= -(1 << (width - 1)) if bit == width - 1 else 1 << bit


# --------------------------------------------------------------------------------- digest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_single_flipped_bit_changes_the_digest(dtype):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3000, generator=g).to(dtype), torch.randn(7, 11, generator=g).to(dtype)]
    before = digest(values)
    width = 8 * values[0].element_size()
    for _ in range(400):
        which = int(torch.randint(0, 2, (), generator=g))
        index = int(torch.randint(0, values[which].numel(), (), generator=g))
        bit = int(torch.randint(0, width, (), generator=g))
        flipped = [v.clone() for v in values]
        flip(flipped[which], index, bit)
        assert not torch.equal(digest(flipped), before), (which, index, bit)
    for bit in range(width):  # every bit of one value, the sign's and the exponent's too
        flipped = [v.clone() for v in values]
        flip(flipped[1], 5, bit)
        assert not torch.equal(digest(flipped), before), bit


def test_the_digest_is_the_same_on_every_call_and_sees_order_and_pieces(monkeypatch):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=g), torch.randn(500, generator=g)
    first = digest([a, b])
    assert first.dtype == torch.int64 and first.shape == (replicas.DIGEST_WORDS,)
    assert all(torch.equal(digest([a.clone(), b.clone()]), first) for _ in range(3))
    assert torch.equal(digest([torch.cat([a, b])]), first)  # the values in order, any split
    assert not torch.equal(digest([b, a]), first)
    swapped = a.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    assert not torch.equal(digest([swapped, b]), first)
    monkeypatch.setattr(replicas, "PIECE", 64)  # many pieces, cut inside the tensors
    small = digest([a, b])
    assert torch.equal(digest([torch.cat([a, b])]), small)
    for index in (0, 63, 64, 999, 1000, 1499):
        flipped = torch.cat([a, b])
        flip(flipped, index, 0)
        assert not torch.equal(digest([flipped]), small), index


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_digest_is_the_same_on_the_gpu():
    values = [torch.randn(5_000_000), torch.randn(300).bfloat16()]
    on_gpu = digest([v.cuda() for v in values])
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), digest(values))


# ------------------------------------------------------------------------ check_replicas
def check_worker(ctx, algo_name="diloco", bad=(), steps=8, **kw):
    """Train ``steps`` steps, flip one bit of the replicated state of the workers in ``bad``
    (their shard ``ctx.worker_rank``, each a different value), check; return the verdict (or
    the error), the digests before the flip and after the check."""
    model = make_model()
    opt = make_optimizer(model)
    cls = {"diloco": loco.DiLoCo, "streaming": loco.StreamingDiLoCo, "ddp": loco.DataParallel,
           "demo": loco.DeMo, "noloco": loco.NoLoCo, "sparta": loco.Sparta}[algo_name]
    algo = cls(model, opt, ctx.comm, inner=ctx.inner, **kw)
    train_steps(model, opt, ctx.worker * ctx.worker_ranks + ctx.worker_rank, range(steps),
                lambda: (algo.step(), algo.zero_grad()))
    algo.flush()
    tensors = algo.replicated_tensors()
    before = digest(tensors) if tensors else None
    if ctx.worker in bad:
        flip(tensors[0], 7 + bad.index(ctx.worker), 20)
    try:
        verdict = check_replicas(algo, ctx.comm, steps, [ctx.inner])
    except ReplicasDisagree as e:
        return {"error": str(e)}
    model_equals_global = None
    if algo_name in ("diloco", "streaming"):  # the replica restarted from the global copy
        global_params = algo.global_parameters()
        model_equals_global = all(torch.equal(p, global_params[n])
                                  for n, p in model.named_parameters())
    return {"verdict": verdict, "before": before,
            "after": digest(tensors) if tensors else None,
            "model_is_global": model_equals_global,
            "verify": [r for r in ctx.comm.records if r.tag == "verify"]}


@pytest.mark.parametrize("algo_name,kw", [
    ("diloco", dict(sync_every=4)),
    ("streaming", dict(sync_every=4, fragments=2, overlap=1, codec="fp32")),
    ("ddp", {}),
    ("demo", {}),
])
def test_a_flipped_bit_is_named_and_healed_from_the_majority(algo_name, kw):
    out = loco.launch(check_worker, 4, args=(algo_name, (2,)), kwargs=kw)
    for r in out:
        v = r["verdict"]
        assert (v.step, v.workers, v.healed_from) == (8, [2], 0)
        assert torch.equal(r["after"], out[0]["before"])  # every copy is the majority's again
    if algo_name == "diloco":  # α = 0: the healed worker's replica is the global copy again
        assert out[2]["model_is_global"]
    # the digests: 3 int64 from each worker; the heal: worker 0 sends to worker 2 only
    gathered = [rec for rec in out[1]["verify"] if rec.op == "all_gather"]
    assert [rec.sent_bytes for rec in gathered] == [3 * 8 * replicas.DIGEST_WORDS]
    assert not [rec for rec in out[1]["verify"] if rec.op != "all_gather"]
    assert [rec.participants for rec in out[2]["verify"] if rec.op != "all_gather"] == [(0, 2)]


def test_identical_replicas_agree_and_two_named_workers_of_five_are_healed():
    agree = loco.launch(check_worker, 3, args=("diloco",), kwargs=dict(sync_every=4))
    assert all(r["verdict"].agree and torch.equal(r["after"], r["before"]) for r in agree)
    out = loco.launch(check_worker, 5, args=("diloco", (0, 3)),
                      kwargs=dict(sync_every=4))
    for r in out:
        assert (r["verdict"].workers, r["verdict"].healed_from) == ([0, 3], 1)
        assert torch.equal(r["after"], out[1]["before"])


def test_a_worker_of_two_ranks_is_named_when_one_of_its_shares_differs():
    def worker(ctx):
        return check_worker(ctx, "diloco", (1,) if ctx.worker_rank == 1 else (), sync_every=4)
    out = loco.launch(worker, mesh=loco.Mesh(3, 1, 2))
    for r in out:
        assert (r["verdict"].workers, r["verdict"].healed_from) == ([1], 0)
    for rank, r in enumerate(out):
        assert torch.equal(r["after"], out[rank % 2]["before"])  # rank (m, s): shard s


@pytest.mark.parametrize("m,bad,groups", [
    (2, (1,), "[0] vs [1]"),
    (3, (1, 2), "[0] vs [1] vs [2]"),
    (4, (2, 3), "[0, 1] vs [2] vs [3]"),
])
def test_without_a_majority_the_run_stops_with_one_line(m, bad, groups):
    out = loco.launch(check_worker, m, args=("diloco", bad), kwargs=dict(sync_every=4))
    for r in out:
        assert "\n" not in r["error"]
        assert r["error"] == (f"replicas disagree at step 8 with no majority: workers "
                              f"{groups} hold different copies; the run stops (no copy "
                              "can be trusted)")


@pytest.mark.parametrize("algo_name,kw", [("noloco", dict(sync_every=4)), ("sparta", {})])
def test_methods_whose_replicas_differ_by_design_are_not_checked(algo_name, kw):
    for r in loco.launch(check_worker, 2, args=(algo_name,), kwargs=kw):
        assert r["verdict"] is None and r["verify"] == []


# ----------------------------------------------------------------------- in a training run
@pytest.mark.parametrize("every,delay,gap,steps", [
    (1, 0, None, [4, 8, 12, 16, 20, 24]),  # DiLoCo, H = 4: every round's end
    (2, 0, None, [8, 16, 24]),
    (2, 1, None, [9, 17]),                 # Streaming, τ = 1: once the round's sync is applied
    (0, 0, None, []),                      # never
    (1, 0, 4, [5, 9, 13, 17, 21]),         # elastic DiLoCo: one step later, no quorum there
    (1, 1, 2, []),                         # elastic, P = 2: the next send is at step 2
    (1, 0, 0, []),                         # elastic DataParallel: a quorum at every step
])
def test_the_check_is_due_after_every_kth_round_where_no_sync_is_in_flight(every, delay, gap,
                                                                           steps):
    from types import SimpleNamespace

    from loco.training.verify import verify_due

    method = SimpleNamespace(checkpoint_delay=lambda cfg: delay)
    cfg = SimpleNamespace(trust=SimpleNamespace(verify_every=every),
                          method=SimpleNamespace(sync_every=4), method_class=method)
    assert [s for s in range(1, 25) if verify_due(cfg, s, gap)] == steps


def run_with_a_flip(corpus, out, monkeypatch, *extra):
    """A 4-worker DiLoCo run (H = 4, 12 steps) where worker 2's global copy gets one bit
    flipped after step 6 (a test hook around the loop's checkpoint call); returns the
    summary and every worker's digest of its global copy at the end."""
    checkpoint_if_due = loco.training.loop.checkpoint_if_due
    final_evaluation = loco.training.finish.final_evaluation
    ends = {}

    def flip_at_6(w, loop, step):
        if step == 6 and w.ctx.worker == 2:
            flip(w.algo.fragment_list[0].global_flat, 11, 22)
        checkpoint_if_due(w, loop, step)

    def digest_at_end(w):
        ends[w.ctx.worker] = digest(w.algo.replicated_tensors())
        return final_evaluation(w)

    monkeypatch.setattr(loco.training.loop, "checkpoint_if_due", flip_at_6)
    monkeypatch.setattr(loco.training.finish, "final_evaluation", digest_at_end)
    assert main(small_run(corpus, out, "--algorithm", "diloco", "--workers", "4",
                          "--checkpoint-every", "0", *extra)) == 0
    return json.loads((out / "summary.json").read_text()), [ends[m] for m in range(4)]


def test_a_flipped_bit_in_a_run_is_named_in_the_summary_and_healed(corpus, tmp_path,
                                                                    monkeypatch):
    summary, ends = run_with_a_flip(corpus, tmp_path / "run", monkeypatch,
                                    "--verify-every", "1")
    checks = summary["replicas_verified"]
    assert checks["every"] == 1 and checks["checks"] == 3  # after steps 4, 8 and 12
    assert checks["differed"] == [{"step": 8, "workers": [2], "healed_from": 0}]
    # worker 0 sent 3 digests to 3 workers, and worker 2 its global copy and momentum
    digests = 3 * 3 * 8 * replicas.DIGEST_WORDS
    assert checks["bytes_sent"] == digests + 2 * 4 * summary["model_parameters"]
    assert all(torch.equal(d, ends[0]) for d in ends)  # identical again after the heal


def test_without_the_check_a_flipped_copy_persists(corpus, tmp_path, monkeypatch):
    summary, ends = run_with_a_flip(corpus, tmp_path / "run", monkeypatch,
                                    "--verify-every", "0")
    assert summary["replicas_verified"] is None
    assert torch.equal(ends[0], ends[1]) and torch.equal(ends[0], ends[3])
    assert not torch.equal(ends[2], ends[0])  # the drift is still there at the end


def elastic_check_worker(ctx, bad):
    """Streaming DiLoCo under elastic membership: join, train 8 steps (2 rounds), flip a bit
    of the global copy on worker ``bad``, check (twice: the second finds them agreeing)."""
    model = make_model()
    opt = make_optimizer(model)
    algo = loco.StreamingDiLoCo(model, opt, ctx.comm, sync_every=4, fragments=2, overlap=1,
                                codec="fp32")
    algo.join()
    train_steps(model, opt, ctx.worker, range(8), lambda: (algo.step(), algo.zero_grad()))
    algo.flush()
    tensors = algo.replicated_tensors()
    before = digest(tensors)
    if ctx.worker == bad:
        flip(tensors[-1], 3, 21)
    first = check_replicas(algo, ctx.comm, 8)
    second = check_replicas(algo, ctx.comm, 8)
    return {"first": (first.workers, first.healed_from), "agree": second.agree,
            "before": before, "after": digest(tensors)}


def test_an_elastic_run_names_and_heals_a_drifted_worker():
    out = loco.launch(elastic_check_worker, 3, launcher="processes", timeout=60,
                      elastic=loco.Elastic(min_workers=3, restarts=0), args=(1,))
    for r in out:
        assert r["first"] == ([1], 0) and r["agree"]
        assert torch.equal(r["after"], out[0]["before"])
