"""DataParallel, DiLoCo and Local against plain single-process references of their maths,
on real gloo process groups. How close each comparison must be, and why: see the
tolerances in ``workers.py`` and each test's comment."""

import math

import pytest
import torch

import loco
from workers import (ddp_worker, diloco_worker, make_model, make_optimizer, max_diff,
                     params_of, reference_big_batch, reference_diloco, resume_worker,
                     train_steps, ulps)

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_matches_reference(workers, nesterov):
    steps, H = 12, 4  # three outer rounds
    out = loco.launch(diloco_worker, workers, args=(steps, H, 0.7, 0.9, nesterov))
    ref = reference_diloco(workers, steps, H, 0.7, 0.9, nesterov)
    # The reference rounds μ·m and lr·update on their own; torch's SGD may fuse each into
    # its addition (FMA). That is at most 2 rounding errors per outer step; the replicas then
    # restart from the global copy, so the errors add up rather than grow (measured: at most
    # 1.5 ulps on the generic, AVX2 and AVX-512 kernels; 0 on the generic ones, which do not
    # fuse).
    for r in out:
        assert max_diff(r["params"], ref) <= ulps(ref, 2 * steps // H)
    # the global model is bit-identical on every worker
    assert all(max_diff(r["params"], out[0]["params"]) == 0 for r in out)


def test_diloco_moves_the_model():
    """Guards the reference test against passing because nothing happened."""
    out = loco.launch(diloco_worker, 2, args=(8, 4, 0.7, 0.9))
    assert max_diff(out[0]["params"], params_of(dict(make_model().named_parameters()))) > 1e-3


def test_outer_lr_one_no_momentum_is_parameter_average():
    """FedAvg: pins the sign of the pseudo-gradient (a reversed sign shipped in a peer)."""
    workers, H = 3, 5
    out = loco.launch(diloco_worker, workers, args=(H, H, 1.0, 0.0))
    trained = []
    for m in range(workers):  # each worker's local params just before the sync
        model = make_model()
        train_steps(model, make_optimizer(model), m, range(H))
        trained.append(params_of(dict(model.named_parameters())))
    average = {k: torch.stack([t[k] for t in trained]).mean(0) for k in trained[0]}
    # θ^g − 1·mean(θ^g − θ_m) against mean(θ_m): the same value after 3 roundings each way
    assert max_diff(out[0]["params"], average) <= ulps(average, 4)
    assert max_diff(trained[0], average) > 1e-4  # the workers really differed


def test_one_worker_every_step_lr_one_is_plain_training():
    steps = 6
    out = loco.launch(diloco_worker, 1, args=(steps, 1, 1.0, 0.0))
    model = make_model()
    train_steps(model, make_optimizer(model), 0, range(steps))
    plain = params_of(dict(model.named_parameters()))
    # θ^g − (θ^g − θ) is θ up to 2 roundings per step (exact when the two are close)
    assert max_diff(out[0]["params"], plain) <= ulps(plain, 2 * steps)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.parametrize("workers", [2, 4])
def test_data_parallel_equals_big_batch(workers):
    """M workers with batch b step like one worker with batch M·b: the same gradient every
    step (averaged, then clipped, as DDP clips), so the same parameters."""
    steps, clip, lr, mu = 5, 0.5, 0.5, 0.9
    out = loco.launch(ddp_worker, workers, args=(steps, clip, sgd))
    params, grads = reference_big_batch(workers, steps, clip, sgd)
    # A mean of M per-worker means adds the same per-token terms as one mean over M·b
    # sequences, grouped differently: a sum of n terms rounds by up to log2(n) ulps of the
    # result, n = M·b·T <= 256 tokens here, so 8 ulps each way: 16 (measured: at most 3).
    grad_tol = max(ulps(g, 16) for g in grads)
    # SGD with momentum passes a gradient error on to the parameters scaled by lr and the
    # momentum's sum 1 + μ + μ² + ..., and rounds each step once more. Adam would not do:
    # its lr·g/(|g| + eps) turns a rounding-sized change of a near-zero gradient into a
    # change of order lr, so a tight tolerance would not hold; the algorithm does not
    # depend on the inner optimizer.
    carried = sum(sum(mu ** k for k in range(t + 1)) for t in range(steps))
    param_tol = lr * carried * grad_tol + ulps(params, steps)
    for r in out:
        for have, want in zip(r["grads"], grads, strict=True):
            assert max_diff(have, want) <= grad_tol
        assert max_diff(r["params"], params) <= param_tol
    unclipped, _ = reference_big_batch(workers, steps, None, sgd)
    assert max_diff(params, unclipped) > 1e3 * param_tol  # clipping really acted


def test_local_never_communicates():
    def fn(ctx):
        model = make_model()
        opt = make_optimizer(model)
        algo = loco.Local(model, opt, ctx.comm)
        train_steps(model, opt, ctx.rank, range(4), lambda: (algo.step(), algo.zero_grad()))
        return ctx.comm.totals("train").ops, params_of(algo.global_parameters())
    (ops0, p0), (ops1, p1) = loco.launch(fn, 2)
    assert ops0 == ops1 == 0
    assert max_diff(p0, p1) > 1e-4  # different data, no sync: replicas differ


def test_data_parallel_sends_H_times_diloco():
    steps, H, M = 8, 4, 2
    ddp = loco.launch(ddp_worker, M, args=(steps,))
    dil = loco.launch(diloco_worker, M, args=(steps, H, 0.7, 0.9))
    n = sum(p.numel() for p in make_model().parameters())
    # two syncs of an fp32 ring all-reduce: 2 (M - 1) · ceil(n / M) values of 4 bytes each
    assert dil[0]["sent"] == 2 * 2 * (M - 1) * math.ceil(n / M) * 4
    assert ddp[0]["sent"] == H * dil[0]["sent"]


def test_different_initial_weights_are_detected():
    with pytest.raises(loco.WorkerError, match="different initial weights"):
        loco.launch(diloco_worker, 2, args=(1, 1, 0.7, 0.9, True, "rank", "verify"))


def test_broadcast_makes_initial_weights_identical():
    out = loco.launch(diloco_worker, 3, args=(0, 1, 0.7, 0.9, True, "rank", "broadcast"))
    assert max_diff(out[1]["params"], out[0]["params"]) == 0
    assert max_diff(out[2]["params"], params_of(dict(make_model(0).named_parameters()))) == 0


@pytest.mark.parametrize("algo", ["ddp", "diloco", "local"])
def test_state_dict_restores_everything(algo):
    """Snapshot mid-run (between outer steps), restore into fresh objects, finish: the
    result is bit-identical to the uninterrupted run."""
    for straight, resumed in loco.launch(resume_worker, 2, args=(10, 6, 4, algo)):
        assert max_diff(straight, resumed) == 0


def test_threads_and_processes_launchers_agree():
    args = (8, 4, 0.7, 0.9)
    threads = loco.launch(diloco_worker, 2, "threads", args=args)
    procs = loco.launch(diloco_worker, 2, "processes", args=args)
    # The same operations on the same CPU: bit-identical. (Both launchers give each worker
    # cores ÷ workers intra-op threads; the test model's operations are below torch's
    # parallel grain anyway, checked with 1 to 16 threads.)
    for a, b in zip(threads, procs):
        assert max_diff(a["params"], b["params"]) == 0
        assert a["sent"] == b["sent"]


@pytest.mark.numerics
def test_data_parallel_bf16_gradients_halve_the_bytes_and_round_as_stated():
    """The Streaming DiLoCo paper's data-parallel baseline sends 16-bit gradients. Each
    worker's gradient goes out in bf16; the chunk's owner sums in fp32 and sends the mean
    back in bf16. With M = 2 the sum and the halving are exact, so the applied gradient is
    bf16((bf16(g_0) + bf16(g_1)) / 2) bit for bit."""
    steps = 3
    fp32 = loco.launch(ddp_worker, 2, args=(steps,))
    bf16 = loco.launch(ddp_worker, 2, args=(steps, None, make_optimizer, "bf16"))
    assert bf16[0]["sent"] * 2 == fp32[0]["sent"]
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    for step in range(steps):
        for name, applied in bf16[0]["grads"][step].items():
            expected = r((r(bf16[0]["raw"][step][name]) + r(bf16[1]["raw"][step][name])) / 2)
            assert torch.equal(applied, expected)
    assert max_diff(bf16[0]["params"], bf16[1]["params"]) == 0
    # bf16 gradients (8 bits of mantissa) move AdamW's steps: measured 0.003 after 3 steps
    assert max_diff(bf16[0]["params"], fp32[0]["params"]) > 1e-4
    with pytest.raises(ValueError, match="fp32 or bf16"):
        model = make_model()
        loco.DataParallel(model, make_optimizer(model), loco.Comm(None, 0, 1), codec="int8")
