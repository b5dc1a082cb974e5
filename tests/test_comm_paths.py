"""What each Comm operation asks of the transport, and what it reads on the host.

* Which collective every path issues, on a spy around the process group: the group's own
  all-reduce for an unencoded mean, ``all_to_all_single`` and ``all_gather_into_tensor``
  (``alltoall_base``, ``_allgather_base``) on flat buffers for the codecs, never a list
  form; and the bytes each records, by the formulas of docs/bytes.md.
* No host read on an operation's path: every codec's encode and decode, and the whole
  mean all-reduce and all-gather mean over a 2-rank gloo group, under ``HostReadCounter``.
* SparseLoCo's all-gathered top-k summed by scatter-adding each worker's kept values, bit for
  bit the sum of the dense decodes in rank order, in buffers kept by the Comm
  (``Comm.buffer_bytes``).
"""

import math
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loco
from loco.comm.codecs import scaled
from loco.comm.codecs import get_codec
from loco.comm.comm import Comm
from loco.comm.membership import ElasticComm
from loco.comm.codecs.formats import CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES
from loco.comm.hostreads import HostReadCounter
from loco.comm.codecs.chunk_topk import gather_mean
from loco.comm.reduce import Buffers, layout, reduce_mean

LIST_FORMS = {"allgather", "alltoall", "reduce_scatter", "allgather_coalesced", "gather",
              "scatter", "allreduce_coalesced"}
"""The group's methods that take lists of tensors (``all_gather(list, t)``,
``all_to_all(list, list)``, ...): a copy per rank each way, which the Comm never calls."""


class SpyGroup:
    """A process group that records the name of every method called on it."""

    def __init__(self, group, calls):
        self._group, self._calls = group, calls

    def __getattr__(self, name):
        method = getattr(self._group, name)

        def call(*args, **kwargs):
            self._calls.append(name)
            return method(*args, **kwargs)
        return call


def spy_worker(ctx, n):
    """Every kind of operation once, on a spied group: the group's methods each called,
    its bytes and its result."""
    comm, calls, out = ctx.comm, [], {}
    comm.group = SpyGroup(comm.group, calls)
    g = torch.Generator().manual_seed(ctx.rank)
    x = lambda: torch.randn(n, generator=g)  # noqa: E731
    ops = {
        "mean": lambda: comm.all_reduce_mean(x()),
        "mean_fp4": lambda: comm.all_reduce_mean(x(), codec=get_codec("fp4_e3m0")),
        "mean_topk": lambda: comm.all_reduce_mean(x(), codec=get_codec("topk")),
        "gather_mean": lambda: comm.all_reduce_mean(x(), codec=get_codec("topk_2bit")),
        "all_gather": lambda: comm.all_gather(x(), tag="train"),
        "broadcast": lambda: comm.broadcast(x(), src=1, tag="train"),
        "exchange": lambda: comm.exchange(x(), range(comm.size)),
    }
    for name, op in ops.items():
        calls.clear()
        handle = op()
        value = handle.wait()
        rec = handle.record
        out[name] = (list(calls), rec.sent_bytes, rec.recv_bytes, value)
    calls.clear()
    comm.verify_identical([torch.ones(3)])
    comm.barrier()
    out["setup"] = (list(calls),)
    return out


def test_each_path_issues_the_native_collectives_on_flat_buffers_with_exact_bytes(monkeypatch):
    """M = 3 workers: the unencoded mean is one all-reduce; a codec's is an all-to-all and an
    all-gather into one buffer; SparseLoCo's top-k and ``all_gather`` one all-gather into
    one buffer; broadcast and exchange point to point; no list form anywhere (the
    torch.distributed functions too). Bytes as docs/bytes.md; results the same on every
    worker."""
    for name in ("all_gather", "all_to_all", "reduce_scatter", "gather", "scatter"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"dist.{_n}"))
    m, n = 3, 1001
    out = loco.launch(spy_worker, m, args=(n,))
    chunk = math.ceil(n / m)
    fp4, topk = get_codec("fp4_e3m0"), get_codec("topk")
    two_bit = get_codec("topk_2bit")
    expect = {
        "mean": (["allreduce"], 2 * (m - 1) * chunk * 4),
        "mean_fp4": (["alltoall_base", "_allgather_base"],
                     2 * (m - 1) * fp4.row_bytes(layout(n, m, fp4, 4)[0])),
        "mean_topk": (["alltoall_base", "_allgather_base"],
                      2 * (m - 1) * topk.row_bytes(layout(n, m, topk, 4)[0])),
        "gather_mean": (["_allgather_base"], (m - 1) * two_bit.row_bytes(two_bit.padded(n))),
        "all_gather": (["_allgather_base"], (m - 1) * n * 4),
    }
    for rank, ops in enumerate(out):
        for name, (calls, wire) in expect.items():
            assert ops[name][:3] == (calls, wire, wire), (rank, name)
        calls, sent, recv, _ = ops["broadcast"]
        assert set(calls) == ({"send"} if rank == 1 else {"recv"})
        assert (sent, recv) == ((m - 1) * n * 4, 0) if rank == 1 else (0, n * 4)
        calls, sent, recv, _ = ops["exchange"]
        assert sorted(calls) == ["recv"] * (m - 1) + ["send"] * (m - 1)
        assert sent == recv == (m - 1) * n * 4
        assert ops["setup"] == (["_allgather_base", "allreduce"],)
        assert not LIST_FORMS & {c for op in ops.values() for c in op[0]}
    for name in ("mean", "mean_fp4", "mean_topk", "gather_mean", "broadcast"):
        assert all(torch.equal(o[name][3], out[0][name][3]) for o in out), name
    gens = [torch.Generator().manual_seed(r) for r in range(m)]
    draws = [[torch.randn(n, generator=g) for _ in range(5)] for g in gens]
    # The sum in another order than rank order: within an ulp or so of the values.
    assert torch.allclose(out[0]["mean"][3], sum(d[0] for d in draws) / m, rtol=0, atol=1e-6)
    for o in out:  # all_gather: the fifth operation, its values in rank order
        assert all(torch.equal(a, d[4]) for a, d in zip(o["all_gather"][3], draws))


def rank_order_worker(ctx, n):
    """The unencoded mean the way an ElasticComm forms it (``rank_order``: an all-to-all
    and an all-gather, summed in rank order)."""
    calls = []
    ctx.comm.group = SpyGroup(ctx.comm.group, calls)
    ctx.comm.rank_order = True
    t = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank))
    ctx.comm.all_reduce_mean(t).wait()
    return t, calls


@pytest.mark.numerics
def test_an_elastic_comm_keeps_the_all_to_all_reduction_in_rank_order():
    """An ElasticComm's members talk all to all (a dead one fails everyone's operation at
    once), so its unencoded mean is not the group's ring all-reduce: the rank-order sum of
    before, bit for bit."""
    assert ElasticComm.rank_order and not Comm.rank_order
    m, n = 3, 1001
    out = loco.launch(rank_order_worker, m, args=(n,))
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(m)]
    want = (xs[0] + xs[1] + xs[2]) / m
    for t, calls in out:
        assert torch.equal(t, want) and calls == ["alltoall_base", "_allgather_base"]


# ------------------------------------------------------------------------------ host reads
def rows(c, seed=0):
    x = torch.randn(2, c, generator=torch.Generator().manual_seed(seed))
    x[0, 3] = float("nan")  # a non-finite value: the masking paths run
    return x


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_no_codec_reads_the_host_to_encode_or_decode(name, monkeypatch):
    """Encoding and decoding (and the chunked top-k's adding into a sum) run without one
    host read, a NaN in the data or not, on the path a GPU takes (the scaled codecs read
    whether a block is non-finite on the CPU, where that is free: ``_branch_free`` says
    which path), and give the same bits as outside the counter."""
    monkeypatch.setattr(scaled, "_branch_free", lambda t: True)
    codec = get_codec(name, kernel="eager")
    c = codec.padded(8192)
    x = rows(c)
    want = codec.decode_rows(codec.encode_rows(x), c)
    with HostReadCounter() as counter:
        buf = codec.encode_rows(x)
        got = codec.decode_rows(buf, c, out=torch.empty(2, c))
        if name in CHUNK_TOPK_CODEC_NAMES:
            codec.add_rows(buf, c, torch.zeros(2, c))
    assert dict(counter.counts) == {}
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def pair():
    """Two Comms of one 2-rank gloo group, in this process."""
    store = dist.HashStore()
    groups = [None, None]

    def make(r):
        groups[r] = dist.ProcessGroupGloo(store, r, 2)
    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [Comm(g, r, 2) for r, g in enumerate(groups)]


def run_both(body):
    """``body(comm, rank)`` on rank 1 in a thread and on rank 0 here, under a counter."""
    comms = pair()
    other = threading.Thread(target=body, args=(comms[1], 1))
    other.start()
    with HostReadCounter() as counter:
        mine = body(comms[0], 0)
    other.join()
    for c in comms:
        c.close()
    return mine, counter


@pytest.mark.parametrize("name", [None, "fp32", "bf16", "fp4_e3m0", "int8", "topk", "dare",
                                  "topk_2bit", "topk_2bit_packed"])
def test_a_whole_reduction_reads_nothing_on_the_host(name, monkeypatch):
    """The mean all-reduce's and the all-gather mean's arithmetic and collectives, as the
    communication thread runs them (``HostReadCounter`` counts per thread: the reduction
    runs here), with error feedback's echo and an all-gather: no host read."""
    monkeypatch.setattr(scaled, "_branch_free", lambda t: True)
    codec = None if name is None else get_codec(name, kernel="eager")
    if codec is not None:  # a codec's first use may build its tables: set-up, not a sync
        codec.decode(codec.encode(torch.ones(64)), (64,))

    def body(comm, rank):
        flat = torch.randn(10_001, generator=torch.Generator().manual_seed(rank))
        sent = torch.empty_like(flat)
        if codec is not None and codec.gathers:
            gather_mean(codec, flat, 2, 2, comm._buffers, comm._gather, sent)
        else:
            chunk, _ = layout(flat.numel(), 2, codec, 4)
            comm._reduce_mean(flat, chunk, codec, 2, 2, sent)
        out = torch.empty(2, 3)
        comm._gather(out, torch.full((3,), float(rank)))
        return flat, out

    (flat, gathered), counter = run_both(body)
    assert dict(counter.counts) == {}
    assert torch.isfinite(flat).all() and gathered[:, 0].tolist() == [0.0, 1.0]


# ------------------------------------------------------------------- SparseLoCo's decode
def dense_mean(xs, codec, divisor):
    """The all-gather mean as it was computed before: every message decoded dense, the
    decodes added in rank order, divided."""
    n = xs[0].numel()
    width = codec.padded(n)
    total = torch.zeros(1, width)
    for x in xs:
        total.add_(codec.decode_rows(codec.encode_rows(F.pad(x, (0, width - n)).view(1, -1)),
                                     width))
    return total.view(-1)[:n].div_(divisor)


def sparse_inputs(m, n, seed):
    xs = []
    for r in range(m):
        g = torch.Generator().manual_seed(seed + r)
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
        xs.append(x)
    if m > 1:
        xs[1][5] = float("nan")  # worker 1's first chunk non-finite
    if m > 2:
        xs[2][200] = float("inf")  # worker 2's fourth chunk
    return xs


def gather_worker(ctx, name, n, syncs):
    codec = get_codec(name, block=64, keep=0.125)
    out, ptrs = [], []
    for s in range(syncs):
        x = sparse_inputs(ctx.comm.size, n, 10 * s)[ctx.rank]
        sent = torch.empty(n)
        ctx.comm.all_reduce_mean(x, codec=codec, sent=sent).wait()
        out.append((x, sent))
        ptrs.append({k: v.data_ptr() for k, v in ctx.comm._buffers.items()})
    return out, ptrs, ctx.comm.buffer_bytes(), dict(ctx.comm._buffers)


@pytest.mark.numerics
@pytest.mark.parametrize("name", CHUNK_TOPK_CODEC_NAMES)
@pytest.mark.parametrize("m,n", [(1, 640), (2, 640), (3, 1000)])
def test_sparseloco_sums_kept_values_in_rank_order_bit_for_bit(name, m, n):
    """Scatter-adding each worker's kept values gives, bit for bit, the sum of the dense
    decodes in rank order (NaN throughout a chunk any worker sent non-finite, a padded last
    chunk, M = 1 to 3), the echo error feedback reads is D(C(x)); the Comm keeps only the
    messages, gathered and its own (and one chunk where n is not whole chunks: no padded
    copy of x), the same buffers every sync, which ``buffer_bytes`` counts."""
    syncs = 2
    out = loco.launch(gather_worker, m, args=(name, n, syncs))
    codec = get_codec(name, block=64, keep=0.125)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - NaN's bits too
    for s in range(syncs):
        xs = sparse_inputs(m, n, 10 * s)
        want = dense_mean(xs, codec, m)
        assert torch.isnan(want).any() == (m > 1)
        for rank, (results, ptrs, nbytes, kept) in enumerate(out):
            mean, sent = results[s]
            assert torch.equal(bits(mean), bits(want)), (rank, s)
            assert torch.equal(bits(sent), bits(codec.decode(codec.encode(xs[rank]), (n,))))
    for results, ptrs, nbytes, kept in out:
        assert ptrs[0] == ptrs[1]  # nothing allocated for the second sync
        roles = {role for role, _ in kept}
        assert roles == ({"gathered", "message"} | ({"last chunk"} if n % 64 else set()))
        width = codec.padded(n)
        assert nbytes == (m + 1) * codec.row_bytes(width) + (4 * 64 if n % 64 else 0)


def buffers_worker(ctx):
    comm = ctx.comm
    comm.all_reduce_mean(torch.ones(1000)).wait()
    native = comm.buffer_bytes()
    comm.all_reduce_mean(torch.ones(1000), codec=get_codec("fp4_e3m0")).wait()
    return native, comm.buffer_bytes(), sum(b.numel() * b.element_size()
                                            for b in comm._buffers.values())


def test_buffer_bytes_counts_what_the_comm_keeps():
    """The group's all-reduce keeps nothing; a codec's reduction keeps its buffers, all of
    them counted."""
    for native, coded, kept in loco.launch(buffers_worker, 2):
        assert native == 0 and coded == kept > 0


def test_reduce_mean_without_an_all_reduce_sums_in_rank_order():
    """``reduce_mean`` over a loopback (what ``Codec.prepare`` runs): with no ``all_reduce``
    the unencoded mean still goes the all-to-all way, and an all-gather's ``out`` is one
    (parts, ...) tensor whose rows a list-style loopback can fill."""
    flat = torch.arange(6.0)
    reduce_mean(flat, 3, None, 2, 2, Buffers(torch.device("cpu")),
                lambda received, outgoing: received.copy_(outgoing),
                lambda out, tensor: [o.copy_(tensor) for o in out])
    assert torch.equal(flat, torch.tensor([1.5, 2.5, 3.5, 1.5, 2.5, 3.5]))
