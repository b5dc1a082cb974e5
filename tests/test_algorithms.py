"""DataParallel, DiLoCo and Local against plain single-process references of their maths,
on real gloo process groups."""

import pytest
import torch

import loco
from workers import (ddp_worker, diloco_worker, make_model, make_optimizer,
                     max_diff, params_of, reference_big_batch, reference_diloco, resume_worker,
                     train_steps)


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_matches_reference(workers, nesterov):
    steps, H = 12, 4  # three outer rounds
    out = loco.launch(diloco_worker, workers, args=(steps, H, 0.7, 0.9, nesterov))
    ref = reference_diloco(workers, steps, H, 0.7, 0.9, nesterov)
    for r in out:
        assert max_diff(r["params"], ref) < 1e-5
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
    assert max_diff(out[0]["params"], average) < 1e-6
    assert max_diff(trained[0], average) > 1e-4  # the workers really differed


def test_one_worker_every_step_lr_one_is_plain_training():
    steps = 6
    out = loco.launch(diloco_worker, 1, args=(steps, 1, 1.0, 0.0))
    model = make_model()
    train_steps(model, make_optimizer(model), 0, range(steps))
    assert max_diff(out[0]["params"], params_of(dict(model.named_parameters()))) < 1e-6


@pytest.mark.parametrize("workers", [2, 4])
def test_data_parallel_equals_big_batch(workers):
    steps, clip = 5, 0.5  # clipping must act on the averaged gradient, as DDP's does
    out = loco.launch(ddp_worker, workers, args=(steps, clip))
    ref = reference_big_batch(workers, steps, clip)
    # A mean of M per-worker means rounds differently from one mean over M·b tokens, and
    # Adam's division by sqrt(v) magnifies that for near-zero gradients: hence 5e-5, not 1e-5.
    for r in out:
        assert max_diff(r["params"], ref) < 5e-5
    assert max_diff(out[0]["params"], reference_big_batch(workers, steps, None)) > 1e-4


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
    assert dil[0]["sent"] > 0
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
    for a, b in zip(threads, procs):
        assert max_diff(a["params"], b["params"]) < 1e-6
        assert a["sent"] == b["sent"]
