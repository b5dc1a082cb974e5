"""DeMo (Peng, Quesnelle, Kingma 2024) against a plain single-process reference of its
update, written here with loops and an explicit DCT matrix; its wire bytes against the
formula; exact resume; its options; and a short run through the command line.

How close the reference must be, and why (``test_demo_matches_reference``): the reference
recomputes each worker's step from the state the threads held before it (lock step, so one
rounding difference never grows into another trajectory). A coefficient is two dot products
of n1 and n2 terms, computed here chunk by chunk and in demo.py as batched products, so in
another order: a sum of n terms in another order differs by at most about n·ε·Σ|terms| each
way (γ_n), hence the bound ``2·(n1 + n2 + 2)·ε·Σ|terms|`` per value (``slack``; the 2 covers
the clipped gradient, whose norm is also summed in another order). The discrete decisions
are then checked against it: the implementation's top-k of each chunk must be a top-k of the
reference's coefficients up to that bound, its values equal theirs up to it (and bf16's
half ulp), and each parameter's new value equal the reference's, bit for bit where
``|IDCT(mean)|`` exceeds its bound (the sign cannot differ there) and within lr (sign 0 or ±1)
or 2·lr (opposite signs) where it does not; such values must stay rare. Measured on AVX2 and
on ``ATEN_CPU_CAPABILITY=default``: the same top-k everywhere, momenta within a few ulps.
"""

import json
import math

import pytest
import torch
from test_cli import expect_error
from test_harness import train_args
from test_reliability import assert_same_tensors, final_state, job, records
from workers import batch, make_model, max_diff, resume_worker

import loco
from loco.algorithms import DeMo
from loco.algorithms.demo import (
    dct_chunks,
    dct_matrix,
    idct_chunks,
    make_plan,
    payload_bytes,
)
from loco.cli import main

pytestmark = pytest.mark.numerics

EPS = torch.finfo(torch.float32).eps
BASE_LR, CLIP = 1e-2, 0.5


def schedule(t):
    """The test's learning-rate factor at step t: changes every step."""
    return 1.0 / (1 + t)


def optimizer(model):
    """AdamW in two groups (weight decay on matrices only), as loco train builds it."""
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1},
                              {"params": vecs, "weight_decay": 0.0}], lr=BASE_LR, fused=True)


def demo_worker(ctx, steps, **kw):
    """DeMo on the test model with a scheduler; records, every step, the state before it (the
    parameters, this worker's raw gradient and momentum), this worker's message and the state
    after it."""
    model = make_model()
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    algo = DeMo(model, opt, ctx.comm, max_grad_norm=CLIP, **kw)
    sent, gather = [], ctx.comm.all_gather

    def spy(tensor, tag="setup", **kw):
        if tag == "train":
            sent.append(tensor.clone())
        return gather(tensor, tag, **kw)
    ctx.comm.all_gather = spy
    names = [n for n, _ in model.named_parameters()]
    record = []
    for t in range(steps):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        before = {"params": _copy(model.parameters(), names),
                  "grads": _copy((p.grad for p in model.parameters()), names),
                  "mom": _copy(algo.moms, names)}
        algo.step()
        algo.zero_grad()
        sched.step()
        record.append({**before, "sent": sent[-1], "after": _copy(model.parameters(), names),
                       "mom_after": _copy(algo.moms, names)})
    return {"record": record, "sent_bytes": ctx.comm.totals().sent_bytes,
            "payload": algo.payload_bytes, "pieces": len(algo.pieces),
            "groups": len(algo.groups)}


def _copy(tensors, names):
    return {n: t.detach().clone() for n, t in zip(names, tensors)}


# --------------------------------------------------------------------------- the reference
def dct(n):
    """The orthonormal DCT-II matrix, entry by entry from its cos formula."""
    c = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        for i in range(n):
            s = math.sqrt((1 if k == 0 else 2) / n)
            c[k, i] = s * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return c.float()


def side(n, chunk):
    """The largest divisor of n that is at most chunk."""
    d = min(n, chunk)
    while n % d:
        d -= 1
    return d


def layout(shape, chunk, topk):
    """(rows, cols, n1, n2, k, index bits) of a parameter."""
    rows = shape[0] if len(shape) >= 2 else 1
    cols = math.prod(shape) // rows
    n1, n2 = side(rows, chunk), side(cols, chunk)
    k = min(topk, n1 * n2)
    return rows, cols, n1, n2, k, math.ceil(math.log2(n1 * n2))


def value_size(k, values):
    return {"sign": (k + 7) // 8, "bf16": 2 * k, "fp32": 4 * k}[values]


def chunk_grid(rows, cols, n1, n2):
    return [(i, j) for i in range(0, rows, n1) for j in range(0, cols, n2)]


def read_bits(data, start, n, width):
    """n little-endian unsigned integers of ``width`` bits from bytes ``data`` at ``start``."""
    out = []
    for v in range(n):
        x = 0
        for b in range(width):
            bit = v * width + b
            x |= ((data[start + bit // 8] >> (bit % 8)) & 1) << b
        out.append(x)
    return out


def read_message(message, shapes, chunk, topk, values):
    """Every parameter's (indices, values) per chunk from one worker's bytes: per parameter,
    every chunk's row of packed indices, then every chunk's row of values."""
    data, at, out = bytes(message.tolist()), 0, []
    for shape in shapes:
        rows, cols, n1, n2, k, bits = layout(shape, chunk, topk)
        chunks = len(chunk_grid(rows, cols, n1, n2))
        ib, vb = (k * bits + 7) // 8, value_size(k, values)
        idx = [read_bits(data, at + c * ib, k, bits) for c in range(chunks)]
        at += chunks * ib
        vals = []
        for c in range(chunks):
            raw = data[at + c * vb: at + (c + 1) * vb]
            if values == "sign":
                vals.append([-1.0 if s else 1.0 for s in read_bits(raw, 0, k, 1)])
            else:
                dtype = torch.bfloat16 if values == "bf16" else torch.float32
                vals.append(torch.frombuffer(bytearray(raw), dtype=dtype).float().tolist())
        at += chunks * vb
        out.append((idx, vals))
    assert at == len(data)
    return out


def slack(c1, c2, x):
    """The rounding bound of ``c1 @ x @ c2.T`` computed in another order, per entry."""
    n = c1.shape[0] + c2.shape[0] + 2
    return 2 * n * EPS * (c1.abs() @ x.abs() @ c2.abs().T)


def clipped(grads):
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = min(1.0, CLIP / (norm + 1e-6))
    return {n: g * coef for n, g in grads.items()}


def check_worker(step, lr, beta, chunk, topk, values, msg, stats):
    """One worker's momentum update, top-k, message and new momentum against the
    reference."""
    g = clipped(step["grads"])
    for (name, m), (idx, vals) in zip(step["mom"].items(), msg):
        rows, cols, n1, n2, k, _ = layout(m.shape, chunk, topk)
        u = (beta * m + lr * g[name]).reshape(rows, cols)
        c1, c2 = dct(n1), dct(n2)
        bound = torch.zeros(rows, cols)
        for c, (i, j) in enumerate(chunk_grid(rows, cols, n1, n2)):
            x = u[i:i + n1, j:j + n2]
            y, tol = (c1 @ x @ c2.T).reshape(-1), slack(c1, c2, x).reshape(-1)
            kept = torch.tensor(idx[c])
            assert len(set(idx[c])) == k
            rest = torch.ones(n1 * n2, dtype=torch.bool)
            rest[kept] = False
            if rest.any():  # a top-k up to rounding: no coefficient left out is larger
                assert (y[kept].abs() + tol[kept]).min() >= (y[rest].abs() - tol[rest]).max()
            got = torch.tensor(vals[c])
            if values == "sign":
                assert torch.equal(got, torch.where(y[kept] < 0, -1.0, 1.0))
            else:
                half = 2.0 ** -8 if values == "bf16" else 0.0  # bf16 rounds to 8 bits
                assert ((got - y[kept]).abs() <= half * y[kept].abs() + tol[kept]).all()
            sent = torch.zeros(n1 * n2)
            sent[kept] = y[kept]
            # m ← m − IDCT(kept): the kept values' bound carried through the inverse, plus
            # the inverse's own rounding
            carried = torch.zeros(n1 * n2)
            carried[kept] = tol[kept]
            bound[i:i + n1, j:j + n2] = (c1.abs().T @ carried.reshape(n1, n2) @ c2.abs()
                                         + slack(c1.T, c2.T, sent.reshape(n1, n2)) + 2 * EPS
                                         * x.abs())
            x -= c1.T @ sent.reshape(n1, n2) @ c2
        diff = (u.reshape(m.shape) - step["mom_after"][name]).abs()
        assert (diff <= bound.reshape(m.shape)).all(), name
        stats["mom"] = max(stats["mom"], float(diff.max() / (EPS * u.abs().max())))


def reference_step(steps, t, chunk, topk, values, beta, stats):
    """Step t of every worker (``steps[m]``, the threads' records), checked against the
    reference maths; returns the parameters every worker should hold after it."""
    lr = BASE_LR * schedule(t)
    shapes = [p.shape for p in steps[0]["params"].values()]
    msgs = [read_message(s["sent"], shapes, chunk, topk, values) for s in steps]
    for m, s in enumerate(steps):
        check_worker(s, lr, beta, chunk, topk, values, msgs[m], stats)
    after = {}
    for p_i, (name, p) in enumerate(steps[0]["params"].items()):
        rows, cols, n1, n2, _, _ = layout(p.shape, chunk, topk)
        c1, c2 = dct(n1), dct(n2)
        v, tol = torch.zeros(rows, cols), torch.zeros(rows, cols)
        for c, (i, j) in enumerate(chunk_grid(rows, cols, n1, n2)):
            # bloc97/DeMo's decompress: scatter_reduce_(..., "mean", include_self=False)
            # over every worker's indices: each index's mean over the workers that sent it
            total, senders = torch.zeros(n1 * n2), torch.zeros(n1 * n2)
            for idx, vals in (msg[p_i] for msg in msgs):  # summed in rank order
                for a, b in zip(idx[c], vals[c]):
                    total[a] += b
                    senders[a] += 1
            total = (total / senders.clamp(min=1)).reshape(n1, n2)
            v[i:i + n1, j:j + n2] = c1.T @ total @ c2
            tol[i:i + n1, j:j + n2] = slack(c1.T, c2.T, total)
        wd = 0.1 if p.dim() >= 2 else 0.0
        after[name] = (p * (1 - lr * wd) - lr * torch.sign(v).reshape(p.shape), tol.reshape(
            p.shape), v.reshape(p.shape))
    return after


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("values", ["sign", "bf16"])
def test_demo_matches_reference(workers, values):
    """Five steps of M thread workers against the reference, step by step (see the module's
    description for the tolerances); the replicas stay identical bit for bit."""
    steps, chunk, topk, beta = 5, 16, 8, 0.9
    out = loco.launch(demo_worker, workers, args=(steps,),
                      kwargs={"decay": beta, "topk": topk, "chunk": chunk, "values": values})
    stats, unsure, total = {"mom": 0.0}, 0, 0
    for t in range(steps):
        records_t = [o["record"][t] for o in out]
        for r in records_t[1:]:  # the same update from the same bytes: identical replicas
            assert max_diff(r["after"], records_t[0]["after"]) == 0
        lr = BASE_LR * schedule(t)
        for name, (want, tol, v) in reference_step(records_t, t, chunk, topk, values, beta,
                                                   stats).items():
            have = records_t[0]["after"][name]
            sure = v.abs() > tol  # the sign of IDCT(mean) is certain here
            assert torch.equal(have[sure], want[sure]), name
            assert ((have - want).abs() <= 2 * lr * (1 + 4 * EPS)).all(), name
            unsure += int((~sure).sum())
            total += v.numel()
    assert unsure <= total // 1000, (unsure, total)  # uncertain signs are rare
    moved = max_diff(out[0]["record"][-1]["after"], out[0]["record"][0]["params"])
    assert moved > 1e-3  # the model really moved


def test_dct_is_orthonormal_and_round_trips():
    """The DCT-II matrix from the cos formula; IDCT(DCT(x)) == x to 1e-6 for matrices,
    vectors and odd sizes."""
    for n in (1, 2, 5, 16, 48, 64):
        c = dct_matrix(n)
        assert (c - dct(n)).abs().max() <= 2 * EPS
        assert (c @ c.T - torch.eye(n)).abs().max() <= 1e-6
    g = torch.Generator().manual_seed(0)
    for shape in ((96, 32), (64, 64), (30, 7), (32,), (10,), (3, 4, 5), ()):
        x = torch.randn(shape, generator=g)
        plan = make_plan(x.shape, 16, 8, "bf16", 0)
        c1, c2 = dct_matrix(plan.n1), dct_matrix(plan.n2)
        y = dct_chunks(x, plan, c1, c2)
        assert y.shape == (plan.chunks, plan.n1 * plan.n2)
        back = idct_chunks(y, plan, c1, c2).reshape(x.shape)
        assert (back - x).abs().max() <= 1e-6
        assert abs(float((y ** 2).sum()) - float((x ** 2).sum())) <= 1e-4 * float(
            (x ** 2).sum()) + 1e-6  # orthonormal: the energy is kept


def own_payload(shapes, chunk, topk, values):
    """The formula: Σ over parameters of chunks × (ceil(k · bits / 8) + value bytes)."""
    total = 0
    for shape in shapes:
        rows, cols, n1, n2, k, bits = layout(shape, chunk, topk)
        total += (rows // n1) * (cols // n2) * ((k * bits + 7) // 8 + value_size(k, values))
    return total


@pytest.mark.parametrize("values", ["sign", "bf16", "fp32"])
def test_bytes_are_exact(values):
    """Every step, each worker sends its message to the M − 1 others: (M − 1) × payload."""
    workers, steps = 3, 2
    out = loco.launch(demo_worker, workers, args=(steps,), kwargs={"values": values})
    shapes = [p.shape for p in make_model().parameters()]
    payload = own_payload(shapes, 64, 32, values)
    assert payload == payload_bytes(shapes, 64, 32, values) == out[0]["payload"]
    for o in out:
        assert o["sent_bytes"] == steps * (workers - 1) * payload
    # The test model: 17 chunks of 2048 or 1536 coefficients (11-bit indices: embed 64×32,
    # qkv, w1, w3 96×32 in two 48×32, w2 32×96 in two 32×48), 2 of 1024 (proj 32×32, 10
    # bits), 5 vectors of 32 (5 bits, all kept) and 4 of 16 (4 bits, all kept).
    v32, v16 = {"sign": (4, 2), "bf16": (64, 32), "fp32": (128, 64)}[values]
    assert payload == 17 * (44 + v32) + 2 * (40 + v32) + 5 * (20 + v32) + 4 * (8 + v16)


def test_pieces_of_any_size_give_the_same_bits(monkeypatch):
    """DeMo computes at most PIECE_VALUES values at a time (whole chunk-rows): the matrices
    cut into one chunk-row (16 x 32 values) per piece, every message and every parameter is
    bit for bit the run's with each group whole (each chunk's transform is its own product;
    the vectors' groups, under 512 values, stay whole: a chunk of one row is a vector-matrix
    product whose kernel, and last bits, change with the rows computed at once)."""
    from loco.algorithms import demo as demo_module

    whole = loco.launch(demo_worker, 3, args=(3,), kwargs={"chunk": 16, "values": "fp32"})
    monkeypatch.setattr(demo_module, "PIECE_VALUES", 16 * 32)
    cut = loco.launch(demo_worker, 3, args=(3,), kwargs={"chunk": 16, "values": "fp32"})
    for a, b in zip(whole, cut):
        for ra, rb in zip(a["record"], b["record"]):
            assert torch.equal(ra["sent"], rb["sent"])
            assert max_diff(ra["after"], rb["after"]) == 0
    assert cut[0]["pieces"] > whole[0]["pieces"] == whole[0]["groups"]


def rank_order_worker(ctx):
    """Three workers' messages for the piece of most chunks, each index sent by every worker with
    the values 1, 1e8 and -1e8 (worker 0, 1, 2), decoded: in rank order each index sums to
    (1 + 1e8) - 1e8 = 0 in fp32 (1 + 1e8 rounds to 1e8); in another order to 0 or 1."""
    from loco.comm.codecs.bitpack import pack

    from loco.algorithms.demo import encode_values

    model = make_model()
    algo = DeMo(model, optimizer(model), ctx.comm, values="fp32")
    piece = max(algo.pieces, key=lambda p: p.plan.chunks)
    plan = piece.plan
    idx = torch.arange(plan.k).expand(plan.chunks, plan.k)
    stacked = torch.zeros(3, algo.payload_bytes, dtype=torch.uint8)
    for w, value in enumerate((1.0, 1e8, -1e8)):
        stacked[w, piece.index_at] = pack(idx, plan.bits).reshape(-1)
        vals = torch.zeros(plan.chunks, plan.k)
        vals[:, 0] = value
        stacked[w, piece.value_at] = encode_values(vals, "fp32").reshape(-1)
    return algo._decode(stacked, piece)


def test_every_index_sums_in_rank_order_whatever_order_one_scatter_adds_in(monkeypatch):
    """On a GPU one ``scatter_add_`` adds colliding indices in any order (float atomics),
    differently on every worker, and DeMo never re-syncs its replicas. DeMo sums each index
    in rank order, one worker's distinct indices per call: with a stand-in that adds each
    call's columns in a fresh random order, every chunk's sum is still the rank-order sum
    (a single call over all workers' columns gives 1 instead of 0 in most chunks)."""
    original = torch.Tensor.scatter_add_

    def shuffled(self, dim, index, src):
        if dim == 1 and index.dim() == 2 and index.shape[1] > 1:
            order = torch.randperm(index.shape[1])
            return original(self, dim, index[:, order], src[:, order])
        return original(self, dim, index, src)
    monkeypatch.setattr(torch.Tensor, "scatter_add_", shuffled)
    (total,) = loco.launch(rank_order_worker, 1)
    assert total.shape[0] >= 8 and torch.equal(total[:, 0], torch.zeros(total.shape[0]))


def test_state_dict_resumes_bit_for_bit():
    """Snapshot mid-run, restore into fresh objects, finish: bit-identical to going on."""
    for straight, resumed in loco.launch(resume_worker, 2, args=(8, 5, 4, "demo")):
        assert max_diff(straight, resumed) == 0


def nonfinite_worker(ctx, steps):
    """DeMo with on_nonfinite="skip"; worker 1's gradient is NaN at step 1."""
    model = make_model()
    algo = DeMo(model, optimizer(model), ctx.comm, on_nonfinite="skip", max_grad_norm=CLIP)
    for t in range(steps):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        if ctx.rank == 1 and t == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        algo.step()
        algo.zero_grad()
    algo.settle_nonfinite()  # skips are counted on the device, read at a logging step
    return {n: p.detach().clone() for n, p in model.named_parameters()}, algo.skipped


def test_a_nonfinite_gradient_is_skipped_by_its_worker_alone():
    """The step is collective: the worker whose gradient is NaN adds nothing to its momentum
    and still sends; every replica takes the same finite update."""
    (p0, s0), (p1, s1) = loco.launch(nonfinite_worker, 2, args=(3,))
    assert s0["inner_steps"] == 0 and s1["inner_steps"] == 1
    assert max_diff(p0, p1) == 0
    assert all(torch.isfinite(p).all() for p in p0.values())


@pytest.mark.parametrize("argv, option, allowed", [
    (["--demo-topk", "0"], "--demo-topk", "must be an integer >= 1 (got 0)"),
    (["--demo-chunk", "0"], "--demo-chunk", "must be an integer >= 1 (got 0)"),
    (["--demo-decay", "1.5"], "--demo-decay", "must be in [0, 1] (got 1.5)"),
    (["--worker-ranks", "2"], "--worker-ranks", "must be 1 with --algorithm demo"),
    (["--stages", "2"], "--stages", "must be 1 with --algorithm demo"),
    (["--inner-optimizer", "muon"], "--inner-optimizer", "DeMo is its own optimizer"),
])
def test_bad_options_are_refused_in_one_line(argv, option, allowed, capsys, monkeypatch):
    expect_error(["train", "--algorithm", "demo", *argv], option, allowed, capsys, monkeypatch)


def test_elastic_is_refused(capsys, monkeypatch):
    from loco.config import ConfigError, TrainConfig, validate

    with pytest.raises(ConfigError, match="--elastic: is not supported with --algorithm demo"):
        validate(TrainConfig(algorithm="demo", elastic=True, lighthouse="localhost:1",
                             worker_index=0))


@pytest.mark.slow
def test_trains_through_the_command_line(corpus, tmp_path):
    """``loco train --algorithm demo``: the loss falls, the bytes are the formula's."""
    out = tmp_path / "demo"
    assert main(train_args(corpus, out, "--algorithm", "demo", "--steps", "8", "--lr",
                           "1e-3", "--warmup", "0", "--log-every", "2")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["algorithm"] == "demo" and math.isfinite(s["final_eval_loss"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert losses[-1] < losses[0]
    vocab = s["corpus"]["vocab_size"]
    from loco.model import Transformer, model_config

    model = Transformer(model_config("tiny", vocab, 32), torch.Generator())
    shapes = [p.shape for p in model.parameters()]
    assert s["bytes_sent_per_rank"] == 8 * (2 - 1) * own_payload(shapes, 64, 32, "bf16")
    # the momenta, and DeMo's payload maps and DCT matrices (counted one by one:
    # tests/test_memory.py)
    assert s["memory_bytes_per_rank"]["outer"] > 4 * s["model_parameters"]


@pytest.mark.slow
def test_interrupted_run_resumes_bit_identical(corpus, tmp_path, monkeypatch, capsys):
    """Worker 1 fails at step 11, after the checkpoint of step 8; the resumed run ends as
    the uninterrupted one, momenta included."""
    full, out = tmp_path / "full", tmp_path / "run"
    assert main(job(corpus, full, "--algorithm", "demo")) == 0
    monkeypatch.setenv("LOCO_FAULT", "1:11")
    assert main(job(corpus, out, "--algorithm", "demo")) == 1
    assert "worker 1 failed at step 11" in capsys.readouterr().err
    monkeypatch.delenv("LOCO_FAULT")
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert records(out) == records(full)
    for rank in range(2):
        assert_same_tensors(final_state(out, rank)["algorithm"],
                            final_state(full, rank)["algorithm"])
