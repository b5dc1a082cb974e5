"""SPARTA and SPARTA + DiLoCo against plain single-process references of their maths (the
shared-seed draw, the fp32 mean in rank order, the replacement, DiLoCo's outer step), the
draw's distribution, the exact bytes, resuming, the option checks and ``loco train``."""

import copy
import itertools
import json
import math
from collections import Counter

import pytest
import torch
from test_cli import small_run
from workers import make_model, make_optimizer, max_diff, params_of, train_steps

import loco
from loco.algorithms.sparta import (
    Sparta,
    SpartaDiLoCo,
    sparse_bytes,
    sparse_count,
    sparse_indices,
)
from loco.cli import main

SHARE, SEED = 0.02, 7  # a larger share than the default, so that every tensor takes part


@pytest.fixture
def rank_order(monkeypatch):
    """The Comm's mean summed in rank order, as the reference sums it: with M >= 3 the
    group's own all-reduce groups the sum otherwise (docs/bytes.md); M = 2 is one addition
    either way."""
    from loco.comm.comm import Comm

    monkeypatch.setattr(Comm, "rank_order", True)


def flat_of(model) -> torch.Tensor:
    """The trainable values in ``parameters()`` order, one fp32 copy."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def sparta_worker(ctx, steps, share=SHARE, seed=SEED, cls=Sparta, **kw):
    model = make_model()
    opt = make_optimizer(model)
    algo = cls(model, opt, ctx.comm, sparta_share=share, seed=seed, **kw)
    flats = []

    def step():
        algo.step()
        algo.zero_grad()
        flats.append(flat_of(model))
    train_steps(model, opt, ctx.rank, range(steps), step)
    return {"params": params_of(algo.global_parameters()), "flats": flats,
            "sent": ctx.comm.totals("train").sent_bytes, "k": algo.averager.count,
            "n": algo.averager.numel}


# --------------------------------------------------------------------------- references
def drawn(seed: int, step: int, n: int, k: int) -> torch.Tensor:
    """The indices averaged after step ``step``, restated from the draw's rule rather than
    taken from ``sparse_indices``: a CPU generator seeded (seed · 1000003 + step) mod 2^32;
    for k > n / 4 the first k of a random permutation, otherwise the first k distinct values
    of a sequence of uniform draws below n; sorted."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2 ** 32)
    if 4 * k > n:
        return torch.randperm(n, generator=g)[:k].sort().values
    sequence = torch.randint(n, (8 * k + 64,), generator=g).tolist()
    first = list(dict.fromkeys(sequence))[:k]  # distinct, in order of first draw
    assert len(first) == k  # 8k + 64 draws below n >= 4k hold k distinct values
    return torch.tensor(sorted(first))


def sparse_mean_(models, step, share, seed) -> None:
    """The sparse average by hand: the same shared-seed draw (``drawn``) on one flat copy of
    every model, the values summed one worker after another in rank order (as the chunk's
    owner does) and divided by M, written back into each model."""
    flats = [flat_of(m) for m in models]
    n = flats[0].numel()
    idx = drawn(seed, step, n, max(1, round(share * n)))
    total = flats[0][idx] + flats[1][idx]
    for f in flats[2:]:
        total = total + f[idx]
    mean = total / len(models)
    with torch.no_grad():
        for model, f in zip(models, flats):
            f[idx] = mean
            offset = 0
            for p in model.parameters():
                p.copy_(f[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def reference(workers, steps, share=SHARE, seed=SEED, sync_every=None, outer_lr=0.7,
              outer_momentum=0.9):
    """SPARTA (``sync_every`` None) or SPARTA + DiLoCo in one process. The outer step is
    torch's fused SGD with Nesterov momentum on one flat copy, as DiLoCo steps it (its
    arithmetic against the paper's box is tests/test_algorithms.py's); the pseudo-gradients
    are averaged in rank order. Returns every replica's parameters, and the global copy."""
    models = [make_model() for _ in range(workers)]
    opts = [make_optimizer(m) for m in models]
    glob = flat_of(models[0]).clone()
    outer = torch.optim.SGD([glob], lr=outer_lr, momentum=outer_momentum, nesterov=True,
                            fused=True)
    for t in range(1, steps + 1):
        for m in range(workers):
            train_steps(models[m], opts[m], m, [t - 1])
        sparse_mean_(models, t, share, seed)
        if sync_every is None or t % sync_every:
            continue
        deltas = [glob - flat_of(m) for m in models]
        total = deltas[0] + deltas[1]
        for d in deltas[2:]:
            total = total + d
        glob.grad = total / workers
        outer.step()
        with torch.no_grad():
            for model in models:
                offset = 0
                for p in model.parameters():
                    p.copy_(glob[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    names = [n for n, _ in models[0].named_parameters()]
    shapes = [p.shape for p in models[0].parameters()]
    pieces = glob.detach().split([math.prod(s) for s in shapes])
    return ([params_of(dict(m.named_parameters())) for m in models],
            {n: v.view(s) for n, v, s in zip(names, pieces, shapes)})


# --------------------------------------------------------------------------- (a) maths
@pytest.mark.numerics
@pytest.mark.usefixtures("rank_order")
@pytest.mark.parametrize("workers", [2, 3])
def test_sparta_matches_reference_bit_for_bit(workers):
    """The same operations in the same order: equal bits, on every instruction set."""
    steps = 6
    out = loco.launch(sparta_worker, workers, args=(steps,))
    replicas, _ = reference(workers, steps)
    for r, ref in zip(out, replicas, strict=True):
        assert max_diff(r["params"], ref) == 0
    assert max_diff(out[0]["params"], out[1]["params"]) > 1e-4  # the replicas still differ


@pytest.mark.numerics
@pytest.mark.usefixtures("rank_order")
@pytest.mark.parametrize("workers", [2, 3])
def test_sparta_diloco_matches_reference_bit_for_bit(workers):
    """Three outer rounds of H = 4 and two steps past the last: the sparse average after
    every inner step, before the outer step of its round."""
    steps, H = 14, 4
    out = loco.launch(sparta_worker, workers, args=(steps,),
                      kwargs={"cls": SpartaDiLoCo, "sync_every": H})
    _, glob = reference(workers, steps, sync_every=H)
    for r in out:
        assert max_diff(r["params"], glob) == 0
    moved = params_of(dict(make_model().named_parameters()))
    assert max_diff(out[0]["params"], moved) > 1e-3  # the global model moved


@pytest.mark.numerics
def test_sparta_diloco_differs_from_diloco():
    """Guards the reference test against a sparse average that does nothing."""
    from workers import diloco_worker
    steps, H = 8, 4
    dil = loco.launch(diloco_worker, 2, args=(steps, H, 0.7, 0.9))
    sparta = loco.launch(sparta_worker, 2, args=(steps,),
                         kwargs={"cls": SpartaDiLoCo, "sync_every": H})
    # measured 0.008 apart; an average that moved nothing would leave rounding (~1e-7)
    assert max_diff(dil[0]["params"], sparta[0]["params"]) > 1e-3


# --------------------------------------------------------------------------- (b) the draw
def test_every_worker_averages_the_same_indices_fresh_each_step():
    steps = 4
    out = loco.launch(sparta_worker, 3, args=(steps,))
    n, k = out[0]["n"], out[0]["k"]
    assert k == max(1, round(SHARE * n))
    draws = [drawn(SEED, t, n, k) for t in range(1, steps + 1)]
    for t, idx in enumerate(draws):
        rest = torch.ones(n, dtype=torch.bool)
        rest[idx] = False
        for r in out[1:]:  # equal where averaged, different (almost) everywhere else
            assert torch.equal(r["flats"][t][idx], out[0]["flats"][t][idx])
            assert (r["flats"][t][rest] != out[0]["flats"][t][rest]).float().mean() > 0.9
    for a, b in itertools.pairwise(draws):
        assert len(set(a.tolist()) & set(b.tolist())) < k // 4  # fresh each step
    assert not torch.equal(draws[0], drawn(SEED + 1, 1, n, k))  # the seed matters


@pytest.mark.parametrize("n,k", [(28896, 578), (1000, 5), (1000, 250), (1000, 251), (7, 7),
                                 (1, 1), (100, 25)])
def test_the_library_draws_what_the_rule_says(n, k):
    """sparse_indices against the rule restated in ``drawn``, over seeds and steps (n = 28,896:
    the test model's values, k its 2 %)."""
    for seed, step in [(SEED, 1), (SEED, 6), (0, 1), (3, 5), (2 ** 40, 7)]:
        assert torch.equal(sparse_indices(seed, step, n, k), drawn(seed, step, n, k))


@pytest.mark.parametrize("n,k", [(1000, 5), (1000, 250), (1000, 251), (7, 7), (1, 1)])
def test_the_draw_is_k_distinct_sorted_indices_and_repeatable(n, k):
    idx = sparse_indices(3, 5, n, k)
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert idx.unique().numel() == k and torch.equal(idx, idx.sort().values)
    assert 0 <= int(idx.min()) and int(idx.max()) < n
    assert torch.equal(idx, sparse_indices(3, 5, n, k))


def test_the_draw_is_a_uniform_subset():
    """Every 2-subset of 8 equally likely on the cheap path (4k <= N), by a chi-square test
    over 5,600 steps (deterministic seeds: the statistic is fixed; the 99.9 % point of
    chi-square with 27 degrees of freedom is 55.5). The randperm path is randperm's."""
    n, k, draws = 8, 2, 5600
    counts = Counter(tuple(sparse_indices(0, t, n, k).tolist()) for t in range(1, draws + 1))
    assert len(counts) == math.comb(n, k)
    expected = draws / math.comb(n, k)
    assert sum((c - expected) ** 2 / expected for c in counts.values()) < 55.5
    g = torch.Generator().manual_seed(9 * 1_000_003 + 4)  # (seed, step) = (9, 4)
    assert torch.equal(sparse_indices(9, 4, 10, 3), torch.randperm(10, generator=g)[:3].sort()
                       .values)


# --------------------------------------------------------------------------- (c) bytes
@pytest.mark.parametrize("workers", [2, 3])
def test_bytes_are_exact(workers):
    steps, H = 9, 4
    out = loco.launch(sparta_worker, workers, args=(steps,))
    k, n = out[0]["k"], out[0]["n"]
    per_step = 2 * (workers - 1) * math.ceil(k / workers) * 4
    assert sparse_bytes(k, workers) == per_step
    assert all(r["sent"] == steps * per_step for r in out)
    out = loco.launch(sparta_worker, workers, args=(steps,),
                      kwargs={"cls": SpartaDiLoCo, "sync_every": H})
    outer = 2 * (workers - 1) * math.ceil(n / workers) * 4
    assert all(r["sent"] == steps * per_step + steps // H * outer for r in out)


def test_the_share_sets_k():
    assert sparse_count(0.005, 1000) == 5 and sparse_count(1e-9, 1000) == 1
    assert sparse_count(1.0, 1000) == 1000 and sparse_count(0.0025, 1000) == 2  # half to even


# --------------------------------------------------------------------------- (d) resume
def resume_worker(ctx, steps, split, cls, **kw):
    """Train ``split`` steps, snapshot, finish; rebuild from the snapshot and finish again."""
    def build():
        model = make_model()
        opt = make_optimizer(model)
        return model, opt, cls(model, opt, ctx.comm, sparta_share=SHARE, seed=SEED, **kw)
    model, opt, algo = build()
    step = lambda: (algo.step(), algo.zero_grad())
    train_steps(model, opt, ctx.rank, range(split), step)
    snapshot = copy.deepcopy(algo.state_dict())
    train_steps(model, opt, ctx.rank, range(split, steps), step)
    straight = params_of(algo.global_parameters())
    model, opt, algo = build()
    algo.load_state_dict(snapshot)
    train_steps(model, opt, ctx.rank, range(split, steps), step)
    return straight, params_of(algo.global_parameters())


@pytest.mark.parametrize("cls,kw", [(Sparta, {}), (SpartaDiLoCo, {"sync_every": 4})])
def test_resume_continues_bit_for_bit(cls, kw):
    for straight, resumed in loco.launch(resume_worker, 2, args=(10, 6, cls), kwargs=kw):
        assert max_diff(straight, resumed) == 0


# --------------------------------------------------------------------------- (e) checks
@pytest.mark.parametrize("algorithm", ["sparta", "sparta_diloco"])
@pytest.mark.parametrize("share", ["0", "1.5", "nan"])
def test_a_bad_share_is_refused_in_one_line(algorithm, share, capsys):
    assert main(["train", "--algorithm", algorithm, "--sparta-share", share]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith(f"--sparta-share: must be in (0, 1], the share of the values averaged "
                        f"every step (published: 0.0005 to 0.005) (got {float(share)!r})")


@pytest.mark.parametrize("flags,option", [(["--worker-ranks", "2"], "--worker-ranks"),
                                          (["--stages", "2"], "--stages")])
def test_unsupported_layouts_are_refused(flags, option, capsys):
    for algorithm in ("sparta", "sparta_diloco"):
        assert main(["train", "--algorithm", algorithm, "--model", "tiny", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{option}: {algorithm} supports" in err


def test_the_library_refuses_a_bad_share():
    model = make_model()
    for share in (0, 1.5):
        with pytest.raises(ValueError, match=r"sparta_share must be in \(0, 1\]"):
            Sparta(model, make_optimizer(model), loco.Comm(None, 0, 1), sparta_share=share)


# --------------------------------------------------------------------------- (f) CLI
def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,extra", [("sparta", ["--steps", "6"]),
                                             ("sparta_diloco", ["--steps", "8"])])
def test_loco_train_runs_it(algorithm, extra, corpus, tmp_path):
    out = tmp_path / algorithm
    assert main(small_run(corpus, out, "--algorithm", algorithm, "--final-eval-batches", "2",
                          "--sparta-share", "0.01", *extra)) == 0
    s = summary(out)
    assert s["algorithm"] == algorithm and math.isfinite(s["final_eval_loss"])
    steps, n = s["config"]["steps"], s["model_parameters"]
    k = sparse_count(0.01, n)
    syncs = steps // 4 if algorithm == "sparta_diloco" else 0
    assert s["bytes_sent_per_rank"] == steps * sparse_bytes(k, 2) + syncs * 2 * 4 * (
        math.ceil(n / 2))
