"""What a rank holds, counted: every tensor an algorithm and its Comms keep between steps is
in ``memory_bytes()`` (found by walking the objects, not by asking them), and the buffers
that were made smaller give the same bits as before (docs/memory.md)."""

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import loco
from loco.algorithms import buffers
from loco.algorithms.sharding import Share
from workers import batch, make_model, make_optimizer, max_diff, params_of, streaming_worker

H = 4
STEPS = 2 * H + 1  # two rounds and a step: every fragment synced, a sync in flight at most


def held_tensors(obj, skip: set, seen: set | None = None, depth: int = 0) -> list:
    """Every tensor of more than one dimension's worth (dim > 0) reachable from ``obj``'s
    attributes, lists, dicts, dataclasses and the loco objects they hold; not through
    modules (the model), Comms and codecs (counted apart), the ids in ``skip``, or
    futures and threads."""
    seen = set() if seen is None else seen
    if id(obj) in seen or id(obj) in skip or depth > 12:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.dim() > 0 else []
    if isinstance(obj, (nn.Module, loco.Comm, Future, str, bytes, int, float, bool, type(None))):
        return []
    if isinstance(obj, torch.optim.Optimizer):
        return held_tensors(obj.state, skip, seen, depth + 1)
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("loco.algorithms"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in held_tensors(item, skip, seen, depth + 1)]


def storages(tensors) -> dict:
    out = {}
    for t in tensors:
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = t.untyped_storage()
        out[s.data_ptr(), str(t.device)] = s.nbytes()
    return out


def accounted(algo) -> tuple[int, int, dict]:
    """(outer bytes found by walking the algorithm, comm bytes found in its Comms' kept
    buffers, ``memory_bytes()``): the model's parameters, gradients and the inner
    optimizer's state are counted apart, so tensors that share their storage are left
    out; so are the codec (its lookup tables, a few bytes) and the skips counted on the
    device (two values)."""
    own = storages([*algo.model.parameters(), *algo.model.buffers(),
                    *(p.grad for p in algo.model.parameters() if p.grad is not None),
                    *(v for s in algo.inner_optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))])
    skip = {id(algo.model), id(algo.inner_optimizer), id(getattr(algo, "codec", None)),
            id(getattr(algo, "slow_codec", None)),
            id(algo.nonfinite._pending_skips)}  # two counters on the device
    found = {k: v for k, v in storages(held_tensors(algo, skip)).items() if k not in own}
    kept = sum(b.numel() * b.element_size() for c in (algo.comm, algo.inner) if c is not None
               for b in c._buffers.values())
    guard = algo.comm.shield.guard  # the guard's counters and digests' history
    kept += sum(t.numel() * t.element_size() for t in (
        guard.counts, guard.first, guard.last, guard.acted, guard.peak, guard._history))
    buckets = algo.ranks.buckets  # the gradients' average inside a worker
    if buckets is not None:
        kept += buckets.flat.untyped_storage().nbytes()
        found.pop((buckets.flat.untyped_storage().data_ptr(), str(buckets.flat.device)))
    return sum(found.values()), kept, algo.memory_bytes()


CASES = {
    "diloco_plain": (loco.DiLoCo, dict(sync_every=H, aggregation="mean")),  # first: the
    "diloco": (loco.DiLoCo, dict(sync_every=H)),  # Comm's buffers are kept for the rest
    "diloco_fp4_error_feedback_offload": (loco.DiLoCo, dict(sync_every=H, codec="fp4_e3m0",
                                                            error_feedback=0.9, offload=True)),
    "diloco_eager": (loco.DiLoCo, dict(sync_every=H, eager=True)),
    "streaming_fp4": (loco.StreamingDiLoCo, dict(sync_every=H, fragments=2, overlap=1)),
    "streaming_eager_error_feedback": (loco.StreamingDiLoCo, dict(
        sync_every=H, fragments=2, overlap=1, eager=True, error_feedback=0.5)),
    "streaming_outer_thread": (loco.StreamingDiLoCo, dict(sync_every=H, fragments=2,
                                                          overlap=1, outer_thread=True)),
    "sparseloco": (loco.SparseLoCo, dict(sync_every=H)),
    "noloco": (loco.NoLoCo, dict(sync_every=H, warn=False)),
    "demo": (loco.DeMo, {}),
    "ddp": (loco.DataParallel, {}),
    "sparta": (loco.Sparta, dict(sparta_share=0.1)),
    "sparta_diloco": (loco.SpartaDiLoCo, dict(sync_every=H, sparta_share=0.1)),
}


def accounting_worker(ctx, cases, blocks: bool = False):
    out = {}
    for name, (cls, kw) in cases.items():
        model = make_model(layers=4)
        opt = make_optimizer(model)
        algo = cls(model, opt, ctx.comm, inner=ctx.inner, **kw)
        if blocks:
            algo.keep_block_starts()
        for t in range(STEPS):
            x, y = batch(ctx.rank, t)
            model(x, y).backward()
            algo.step()
        algo.flush()
        out[name] = accounted(algo)  # with the last step's gradients held
        algo.zero_grad()
    return out


def test_memory_bytes_counts_every_tensor_the_algorithm_and_its_comm_keep():
    """For every method and option: the tensors reachable from the algorithm (but the
    model's, its gradients and its inner optimizer's) are exactly the ``outer`` part,
    each storage once; the Comm's kept buffers exactly the ``comm`` part."""
    got = loco.launch(accounting_worker, 2, args=(CASES,))[0]
    for name, (outer, kept, memory) in got.items():
        assert memory["outer"] == outer, name
        assert memory["comm"] == kept, name
    assert got["ddp"][2]["outer"] == 0
    # the plain mean is the transport's own all-reduce: nothing kept but the guard's
    # counters; the guard's reduce-scatter keeps its buffers
    assert got["diloco_plain"][2]["comm"] < 8192 < got["diloco"][2]["comm"]
    assert got["streaming_fp4"][2]["comm"] > 0  # FP4's kept reduction buffers


def test_workers_of_two_ranks_count_what_they_keep():
    """R = 2, the model whole on each rank: DataParallel's explicit buffer, the shares of
    the global copy and the sync buffers, the fast link's kept buffers."""
    cases = {k: CASES[k] for k in ("ddp", "streaming_fp4", "noloco")}
    for got in loco.launch(accounting_worker, mesh=loco.Mesh(2, 1, 2), args=(cases,)):
        for name, (outer, kept, memory) in got.items():
            assert memory["outer"] == outer and memory["comm"] == kept, name
        assert got["ddp"][2]["outer"] > 0


def test_asynchronous_block_starts_are_counted():
    cases = {"streaming": CASES["streaming_fp4"]}
    got = loco.launch(accounting_worker, 2, args=(cases,), kwargs={"blocks": True})[0]
    outer, _, memory = got["streaming"]
    assert memory["outer"] == outer


def fragment_sizes(algo) -> list[int]:
    return [f.share.numel for f in algo.fragment_list]


def test_one_pseudo_gradient_buffer_sized_to_the_largest_fragment():
    """P = 3, offloaded with eager updates and error feedback: every fragment's Δ, Δ̄'s host
    buffer and D(C(e)) are views of one buffer each, as long as the largest fragment; the
    error feedback lives beside the global copy."""
    model = make_model(layers=6)
    comm = loco.Comm(None, 0, 1)
    try:
        algo = loco.StreamingDiLoCo(model, make_optimizer(model), comm, sync_every=6,
                                    fragments=3, overlap=1, eager=True, error_feedback=0.5,
                                    offload=True)
    finally:
        comm.close()
    biggest = max(fragment_sizes(algo))
    for name in ("delta", "grad"):
        views = [getattr(f, name) for f in algo.fragment_list]
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1, name
        assert views[0].untyped_storage().nbytes() == 4 * biggest
    assert algo._sent.numel() == biggest
    for f in algo.fragment_list:
        assert f.delta.numel() == f.share.numel and f.global_flat.grad is f.grad
        assert f.error.device == f.global_flat.device and f.error.numel() == f.share.numel


def test_offloaded_error_feedback_gives_the_bits_of_the_unoffloaded():
    """Streaming DiLoCo with FP4 and error feedback, offloaded (global copy, momentum and
    error on the host) and not: the same global parameters, bit for bit; with eager
    updates too."""
    for extra in ({}, {"eager": True}):
        kw = dict(sync_every=H, fragments=2, overlap=1, codec="fp4_e3m0", error_feedback=0.9,
                  **extra)
        plain = loco.launch(streaming_worker, 2, args=(STEPS + H,), kwargs=kw)
        off = loco.launch(streaming_worker, 2, args=(STEPS + H,), kwargs={**kw, "offload": True})
        assert max_diff(plain[0]["params"], off[0]["params"]) == 0, extra


def test_error_feedback_through_a_host_buffer_gives_the_same_bits():
    """The offloaded error feedback's arithmetic (Δ through a staging buffer to the host,
    e back in one copy) against the one-device path, on random values."""
    g = torch.Generator().manual_seed(0)
    error, delta, sent = (torch.randn(1000, generator=g) for _ in range(3))
    e1, d1, e2, d2 = error.clone(), delta.clone(), error.clone(), delta.clone()
    buffers.error_feedback(e1, d1, 0.9)
    buffers.error_feedback(e2, d2, 0.9, staging=torch.empty(1200))
    assert torch.equal(e1, e2) and torch.equal(d1, d2)
    buffers.feed_back(e1, sent)
    buffers.feed_back(e2, sent, staging=torch.empty(1200))
    assert torch.equal(e1, e2)


def test_offloaded_pieces_and_swaps_are_exact(monkeypatch):
    """θ^g − θ_m in pieces is the one-go difference; a swap done twice restores both sides,
    whatever the piece size."""
    monkeypatch.setattr(buffers, "PIECE_VALUES", 7)
    g = torch.Generator().manual_seed(1)
    base, theta = torch.randn(50, generator=g), torch.randn(50, generator=g)
    out = theta.clone()
    buffers.subtract_from(base, out)
    assert torch.equal(out, base - theta)
    a, b = [torch.randn(3, 5, generator=g), torch.randn(20, generator=g)], \
        [torch.randn(3, 5, generator=g), torch.randn(20, generator=g)]
    a0, b0 = [t.clone() for t in a], [t.clone() for t in b]
    buffers.swap(a, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b0)) and all(
        torch.equal(x, y) for x, y in zip(b, a0))
    buffers.swap(a, b)
    assert all(torch.equal(x, y) for x, y in zip(a, a0)) and all(
        torch.equal(x, y) for x, y in zip(b, b0))


def global_in_model_worker(ctx):
    """Offloaded, outer thread, a sync in flight: inside ``global_in_model`` the model's
    parameters are the global copy; after it the replica is back, bit for bit, and the run
    goes on as it would have."""
    model = make_model(layers=4)
    algo = loco.StreamingDiLoCo(model, make_optimizer(model), ctx.comm, sync_every=H,
                                fragments=2, overlap=1, offload=True, outer_thread=True)
    seen = []
    for t in range(2 * H + 1):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        algo.step()
        algo.zero_grad()
        if algo.sync_in_flight and not seen:
            replica = params_of(dict(model.named_parameters()))
            expected = params_of(algo.global_parameters())
            with algo.global_in_model() as params:
                assert all(params[n] is p for n, p in model.named_parameters())
                seen.append(max_diff(params_of(params), expected))
            seen.append(max_diff(params_of(dict(model.named_parameters())), replica))
    algo.flush()
    return seen, params_of(algo.global_parameters())


def test_an_offloaded_global_copy_is_evaluated_in_the_models_parameters():
    runs = loco.launch(global_in_model_worker, 2)
    plain = loco.launch(streaming_worker, 2, args=(2 * H + 1,),
                        kwargs=dict(sync_every=H, fragments=2, overlap=1))
    for seen, final in runs:
        assert seen == [0, 0]
        assert max_diff(final, plain[0]["params"]) == 0


def test_an_offloaded_run_evaluates_the_same_without_the_global_parameters(
        corpus, tmp_path, monkeypatch):
    """``loco train --offload``: the evaluations swap the global copy into the model (they
    never ask for ``global_parameters``, a copy on the model's device), and every logged
    loss is the one without offload."""
    import json

    from loco.cli import main
    from test_cli import small_run

    def losses(out):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r.get("eval_loss"), r.get("loss")) for r in records], json.loads(
            (out / "summary.json").read_text())["final_eval_loss"]

    assert main(small_run(corpus, tmp_path / "plain", "--eval-every", "2")) == 0

    def refused(self):
        raise AssertionError("global_parameters() called")
    monkeypatch.setattr(loco.StreamingDiLoCo, "global_parameters", refused)
    assert main(small_run(corpus, tmp_path / "off", "--eval-every", "2", "--offload")) == 0
    assert losses(tmp_path / "off") == losses(tmp_path / "plain")


class RowsComm:
    """A fast link of two ranks whose all-gather returns the rows of one buffer, as the
    Comm's does; the other rank's range is ``other``."""

    size, rank = 2, 0

    def __init__(self, other):
        self.other, self.made = other, []

    def all_gather(self, tensor, tag="setup", keep=False):
        out = torch.stack([tensor, self.other])
        self.made.append(out)
        return type("H", (), {"wait": lambda _: list(out.unbind(0))})()

    def buffer(self, role, shape, dtype):
        return torch.empty(shape, dtype=dtype)


def test_share_gather_copies_from_the_gathers_own_buffer():
    """Data-parallel inside (R = 2): ``gather`` writes every rank's range into the
    parameters straight from the all-gather's buffer (no concatenated second copy), and
    ``full`` returns views of it."""
    params = [torch.zeros(3, 2), torch.zeros(5)]  # 11 values: ranges of 6, padded
    comm = RowsComm(torch.arange(100.0, 106.0))
    share = Share(params, comm)
    for v in share.views:
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape))
    share.gather()
    assert torch.equal(torch.cat([p.view(-1) for p in params]),
                       torch.tensor([0.0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104]))
    full = share.full(torch.ones(6))
    assert full[0].untyped_storage().data_ptr() == comm.made[-1].untyped_storage().data_ptr()


def _share_twice(ctx):
    """Two merges of a worker of two ranks (the Comm of two threads as its fast link): the
    parameters after each, where the gather's result lay, and the Comm's kept bytes."""
    params = [torch.zeros(3, 2), torch.zeros(5)]  # 11 values: ranges of 6, the last padded
    share = Share(params, ctx.comm)
    seen = []
    for merge in range(2):
        for v in share.views:
            v.fill_(10.0 * merge + ctx.rank)
        share.gather()
        seen.append((torch.cat([p.view(-1) for p in params]).tolist(),
                     ctx.comm._buffers["all_gather", torch.float32].data_ptr()))
    return seen, ctx.comm.buffer_bytes()


def test_share_gather_gathers_into_the_fast_links_kept_buffers():
    """``Share.gather`` (data-parallel inside, R = 2) all-gathers into the fast-link Comm's
    kept buffer, filled from its kept input: the second merge allocates neither, both are
    counted in ``buffer_bytes`` (what ``memory_bytes_per_rank`` adds as ``comm``), and the
    parameters are every rank's range, in rank order."""
    out = loco.launch(_share_twice, 2, launcher="threads")
    for seen, kept in out:
        (first, ptr1), (second, ptr2) = seen
        assert first == [0.0] * 6 + [1.0] * 5 and second == [10.0] * 6 + [11.0] * 5
        assert ptr1 == ptr2
        assert kept >= (2 * 6 + 6) * 4  # the gathered (2, 6) and the input (6,), fp32


class NoLoCoBefore(loco.NoLoCo):
    """NoLoCo's outer step as it was before its message was built in place: Δ in a tensor
    of its own, both encodings concatenated, every member decoded before the means."""

    @torch.no_grad()
    def _exchange_and_step(self):
        delta = self.share.read().sub_(self.slow)
        n = delta.numel()
        payload = torch.cat([self.codec.encode(delta), self.slow_codec.encode(self.slow)])
        split = self.codec.encoded_nbytes(n)
        group = next(g for g in self.groups(self.outer_steps) if self.comm.rank in g)
        received = self.comm.exchange(payload, group, tag="train").wait()

        def mean(values):
            total = values[0].clone()
            for v in values[1:]:
                total.add_(v)
            return total.div_(len(values))
        mean_delta = mean([self.codec.decode(b[:split], (n,)) for b in received])
        mean_slow = mean([self.slow_codec.decode(b[split:], (n,)) for b in received])
        pull = mean_slow.sub_(self.slow).mul_(self.gamma)
        g = mean_delta.mul_(self.beta).add_(pull)
        self.momentum.mul_(self.alpha).add_(g)
        self.slow.add_(torch.mul(self.momentum, self.alpha, out=pull).add_(g)
                       if self.nesterov else self.momentum)
        self.restart_from_global()
        self.outer_steps += 1


def noloco_runs(ctx, cases):
    out = {}
    for name, kw in cases.items():
        for cls in (loco.NoLoCo, NoLoCoBefore):
            model = make_model()
            opt = make_optimizer(model)
            algo = cls(model, opt, ctx.comm, sync_every=2, warn=False, **kw)
            for t in range(6):
                x, y = batch(ctx.rank, t)
                model(x, y).backward()
                algo.step()
                algo.zero_grad()
            out[name, cls.__name__] = params_of(dict(model.named_parameters()))
    return out


def test_nolocos_message_built_in_place_gives_the_bits_it_gave():
    """Δ formed in the message, φ cast into it, the means summed in the received bytes:
    the same parameters, bit for bit, as before, for cast and scaled codecs and groups of
    two and four (where this worker's own bytes may come first, between or last)."""
    cases = {"fp32": {}, "fp4_bf16": dict(codec="fp4_e3m0", slow_codec="bf16"),
             "bf16": dict(codec="bf16"), "int8_nesterov": dict(codec="int8", nesterov=True),
             "group_of_four": dict(group_size=4)}
    for out in loco.launch(noloco_runs, 4, args=(cases,)):
        for name in cases:
            assert max_diff(out[name, "NoLoCo"], out[name, "NoLoCoBefore"]) == 0, name
