"""The communication interface on real gloo groups: results, exact byte counts, asynchrony,
and the launcher's handling of a failing worker."""

import math
import time

import pytest
import torch

import loco
from loco.comm.codecs import get_codec


def reduce_worker(ctx, sizes):
    out = []
    for n in sizes:
        t = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)
        handle = ctx.comm.all_reduce_mean(t)
        handle.wait()
        out.append((t, handle.record))
    return out, ctx.comm.totals()


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_mean_all_reduce_values_and_exact_bytes(workers):
    sizes = [1, 7, 1000, 1001, 4099]
    results = loco.launch(reduce_worker, workers, args=(sizes,))
    mean_factor = sum(r + 1 for r in range(workers)) / workers
    for rank, (out, totals) in enumerate(results):
        for n, (t, rec) in zip(sizes, out):
            assert torch.allclose(t, torch.arange(n, dtype=torch.float32) * mean_factor)
            chunk = math.ceil(n / workers)
            assert rec.raw_bytes == 4 * n
            assert rec.sent_bytes == rec.recv_bytes == 2 * (workers - 1) * chunk * 4
            assert rec.participants == tuple(range(workers))
        assert totals.ops == len(sizes)
        assert totals.sent_bytes == sum(2 * (workers - 1) * math.ceil(n / workers) * 4 for n in sizes)
    # every worker ends with bit-identical results
    for (out, _) in results[1:]:
        assert all(torch.equal(a[0], b[0]) for a, b in zip(out, results[0][0]))


def pieces_worker(ctx, piece_bytes, codecs, n):
    """Each codec's mean of a worker-dependent tensor of n values, with error feedback's echo,
    the bytes counted and the largest buffer the Comm kept."""
    from loco.comm import reduce

    if piece_bytes is not None:
        reduce.PIECE_BYTES = piece_bytes  # (threads: every rank sets the same value)
    g = torch.Generator().manual_seed(ctx.rank)
    out = {}
    for name in codecs:
        codec = None if name is None else get_codec(name)
        t = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
        sent = torch.zeros(n)
        handle = ctx.comm.all_reduce_mean(t, codec=codec, sent=sent)
        handle.wait()
        out[name] = (t, sent, handle.record.sent_bytes)
    kept = max(b.numel() * b.element_size() for b in ctx.comm._buffers.values())
    return out, kept


@pytest.mark.parametrize("workers", [2, 3])
def test_a_large_all_reduce_in_pieces_is_bit_identical_with_bounded_buffers(workers,
                                                                            monkeypatch):
    """Cut into pieces of at most 4 KiB (a 20,011-value tensor: tens of pieces, the last
    chunk short), the mean, what each worker sent (the echo error feedback reads) and the
    bytes are those of the tensor in one piece, for the unencoded path, a cast and the
    scaled codecs; the buffers the Comm keeps stay within a piece."""
    from loco.comm import reduce

    codecs, n = [None, "bf16", "fp4_e3m0", "int8", "int2"], 20011
    whole, _ = zip(*loco.launch(pieces_worker, workers, args=(None, codecs, n)))
    monkeypatch.setattr(reduce, "PIECE_BYTES", 4096)
    pieces, kept = zip(*loco.launch(pieces_worker, workers, args=(4096, codecs, n)))
    for a, b in zip(whole, pieces):
        for name in codecs:
            assert torch.equal(a[name][0], b[name][0]), name  # the mean
            assert torch.equal(a[name][1], b[name][1]), name  # the echo
            assert a[name][2] == b[name][2] > 0, name  # the bytes
    assert max(kept) <= 4096 * 2  # per role: a piece of fp32 rows (the sum: one row)
    assert reduce.piece_width(10**6, 2, get_codec("topk", keep=0.1), 4) == 10**6


def in_order_worker(ctx, in_order):
    """How long all_reduce_mean takes to return when the communication thread takes 0.3 s
    to issue the operation."""
    ctx.comm.issue_in_order = in_order
    run = ctx.comm._streams.run
    ctx.comm._streams.run = lambda ready, fn: (time.sleep(0.3), run(ready, fn))[1]
    t0 = time.perf_counter()
    handle = ctx.comm.all_reduce_mean(torch.ones(4))
    returned = time.perf_counter() - t0
    handle.wait()
    return returned


def test_issue_in_order_returns_once_the_operation_is_issued():
    """With FSDP2 on a GPU (another library's collectives issued from the training thread),
    a submission returns only once the communication thread has issued it, so every rank
    issues its NCCL calls in the training thread's order; otherwise at once."""
    assert all(t >= 0.3 for t in loco.launch(in_order_worker, 2, args=(True,)))
    assert all(t < 0.15 for t in loco.launch(in_order_worker, 2, args=(False,)))


def test_broadcast_bytes_are_exact():
    def fn(ctx):
        t = torch.full((250,), float(ctx.rank))
        rec = ctx.comm.broadcast(t, src=1).record
        ctx.comm.totals("setup")
        return t, rec
    for rank, (t, rec) in enumerate(loco.launch(fn, 3)):
        assert torch.equal(t, torch.ones(250))
        assert rec.sent_bytes == (2 * 1000 if rank == 1 else 0)
        assert rec.recv_bytes == (0 if rank == 1 else 1000)


def test_reduction_completes_in_the_background():
    """The caller gets a handle at once; the reduction finishes without anyone waiting."""
    def fn(ctx):
        t = torch.ones(1 << 16)
        handle = ctx.comm.all_reduce_mean(t)
        deadline = time.time() + 10
        while not handle.done() and time.time() < deadline:
            torch.randn(64, 64) @ torch.randn(64, 64)  # the worker keeps computing
        done_before_wait = handle.done()
        handle.wait()
        return done_before_wait, handle.record.waited
    for done, waited in loco.launch(fn, 2):
        assert done and waited < 0.05


def test_a_failing_worker_stops_the_run_with_its_name():
    def fn(ctx):
        if ctx.rank == 1:
            raise ValueError("boom at step 3")
        ctx.comm.all_reduce_mean(torch.ones(10)).wait()  # would wait for worker 1 forever
    t0 = time.time()
    with pytest.raises(loco.WorkerError, match=r"worker 1 failed(.|\n)*boom at step 3"):
        loco.launch(fn, 2, timeout=60)
    assert time.time() - t0 < 30


def test_mesh_layout():
    mesh = loco.Mesh(workers=3, stages=2)
    assert mesh.world_size == 6
    assert mesh.coords(5) == (2, 1)
    assert mesh.outer_peers(1) == [1, 3, 5]


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="launcher"):
        loco.launch(lambda ctx: None, 2, "mpi")
    with pytest.raises(ValueError, match="ranks"):
        loco.launch(lambda ctx: None, 0)
    with pytest.raises(ValueError, match="workers"):
        loco.launch(lambda ctx: None, mesh=loco.Mesh(0))


# ------------------------------------------------------------------ devices, NCCL's needs
def test_every_operation_refuses_a_tensor_on_another_device():
    """A CPU tensor handed to a NCCL Comm would crash in NCCL; the Comm says what is wrong
    before anything is issued (``meta`` stands in for the other device here)."""
    def fn(ctx):
        meta = torch.empty(8, device="meta")
        cpu = torch.zeros(8)
        calls = [lambda: ctx.comm.all_reduce_mean(meta),
                 lambda: ctx.comm.broadcast(meta),
                 lambda: ctx.comm.all_gather(meta),
                 lambda: ctx.comm.exchange(meta, [0, 1]),
                 lambda: ctx.comm.sendrecv([(cpu, 1 - ctx.rank)], [(meta, 1 - ctx.rank)]),
                 lambda: ctx.comm.send(meta, 1 - ctx.rank),
                 lambda: ctx.comm.recv(meta, 1 - ctx.rank)]
        messages = []
        for call in calls:
            with pytest.raises(ValueError, match="tensor on meta .* live on cpu") as e:
                call()
            messages.append(str(e.value))
        ctx.comm.all_reduce_mean(cpu).wait()  # nothing half-issued is left behind
        return messages, ctx.comm.totals("train").ops, ctx.comm.issued_bytes("train")
    for messages, ops, issued in loco.launch(fn, 2):
        assert all("device=comm.device" in m for m in messages)
        assert ops == 1 and issued == 2 * 4 * 4


def staged_worker(ctx, stage):
    """Every operation once, its tensors staged through host copies (``stage``: the CPU
    stands in for the model's GPU) or not; what reached the transport, by storage."""
    comm = ctx.comm
    comm.stage_from = torch.device("cpu") if stage else None
    handed = set()  # the storage of every tensor handed to the transport
    check = comm._check_devices

    def spy(op, tensors):
        handed.update(t.untyped_storage().data_ptr() for t in tensors)
        check(op, tensors)
    comm._check_devices = spy
    g, peer = torch.Generator().manual_seed(ctx.rank), 1 - ctx.rank
    x, y = torch.randn(1000, generator=g), torch.randn(5000, generator=g)
    sx, sy = torch.zeros(1000), torch.zeros(5000)
    b, e = torch.full((7,), float(ctx.rank)), torch.full((3,), float(ctx.rank + 1))
    s, r = torch.full((4,), 2.0 * ctx.rank), torch.zeros(4)
    fx = comm.all_reduce_mean(x, codec=get_codec("fp4_e3m0"), sent=sx).wait()
    fy = comm.all_reduce_mean(y, codec=get_codec("topk_2bit"), sent=sy).wait()  # gathers
    fb = comm.broadcast(b, src=1).wait()
    gathered = comm.all_gather(torch.tensor([ctx.rank, 10 * ctx.rank])).wait()
    swapped = comm.exchange(e, [0, 1]).wait()
    received = comm.sendrecv([(s, peer)], [(r, peer)]).wait()
    callers = {t.untyped_storage().data_ptr() for t in (x, y, sx, sy, b, e, s, r)}
    return {"values": [x, sx, y, sy, b, *gathered, *swapped, r],
            "same": [fx.data_ptr() == x.data_ptr(), fy.data_ptr() == y.data_ptr(), fb is b,
                     swapped[ctx.rank] is e, received[0] is r],
            "handed_callers": bool(handed & callers), "sent": comm.totals("train").sent_bytes}


def test_a_staging_comm_hands_the_transport_host_copies_and_gives_back_the_callers():
    """``stage_from``: every operation's tensors reach the transport as host copies (never
    the caller's), the caller's tensors get the results, bit for bit an unstaged run's, and
    the same bytes are counted (an elastic worker on a GPU; here the CPU stands in)."""
    plain = loco.launch(staged_worker, 2, args=(False,))
    staged = loco.launch(staged_worker, 2, args=(True,))
    for p, q in zip(plain, staged):
        assert all(torch.equal(a, b) for a, b in zip(p["values"], q["values"]))
        assert all(q["same"]) and q["sent"] == p["sent"] > 0
        assert p["handed_callers"] and not q["handed_callers"]


def test_a_staged_handle_copies_back_once_and_through_a_reissue():
    """``Handle.then``: the copy back runs once however often ``wait()`` is called, and an
    elastic ``reissue()`` carries it to the new handle."""
    def fn(ctx):
        calls, t = [], torch.ones(4)
        handle = ctx.comm.all_reduce_mean(t)
        handle.reissue = lambda: ctx.comm.all_reduce_mean(t)
        handle.then(lambda value: calls.append("then") or value * 2)
        first, second = handle.wait(), handle.wait()
        again = handle.reissue().wait()
        return calls, first, second, again
    calls, first, second, again = loco.launch(fn, 1)[0]
    assert calls == ["then", "then"] and first is second
    assert torch.equal(first, torch.full((4,), 2.0)) and torch.equal(again, first)


def spy_p2p_worker(ctx):
    """NoLoCo-style exchange and a send/receive pair to the same peer, under a process
    group: both must go through one batch_isend_irecv call each (one NCCL group)."""
    import torch.distributed as dist

    calls = []
    original = dist.batch_isend_irecv

    def spy(ops):
        calls.append(sorted((op.op.__name__, op.group_peer) for op in ops))
        return original(ops)

    dist.batch_isend_irecv = spy
    peer = 1 - ctx.rank
    got = ctx.comm.exchange(torch.full((5,), float(ctx.rank)), [0, 1]).wait()
    buf = torch.empty(3)
    ctx.comm.sendrecv([(torch.full((3,), 10.0 + ctx.rank), peer)], [(buf, peer)]).wait()
    return (isinstance(ctx.comm.group, dist.ProcessGroup), calls,
            [t[0].item() for t in got], buf[0].item())


def test_point_to_point_is_posted_as_one_batch_on_a_process_group():
    for rank, (is_pg, calls, got, received) in enumerate(
            loco.launch(spy_p2p_worker, 2, launcher="processes")):
        peer = 1 - rank
        assert is_pg
        assert calls == [[("irecv", peer), ("isend", peer)]] * 2
        assert got == [0.0, 1.0] and received == 10.0 + peer


class FakeWork:
    def wait(self):
        return True


class OrderGroup:
    """A one-member stand-in for a process group that records the thread and order of the
    collectives it runs."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def _allgather_base(self, out, tensor):
        import threading
        self.log.append((self.name, tensor.item(), threading.current_thread().name))
        out[:tensor.numel()].copy_(tensor)
        return FakeWork()


def test_comms_sharing_a_thread_issue_in_one_order_on_one_thread():
    """What a CUDA rank gets from the launcher: its Comms share one CommThread, so their
    operations reach the transport in the order the rank issued them (NCCL's need)."""
    from loco.comm.comm import Comm
    from loco.comm.thread import CommThread

    log = []
    thread = CommThread("loco-comm-shared")
    outer = Comm(OrderGroup("outer", log), 0, 2, thread=thread)
    pipe = Comm(OrderGroup("pipe", log), 0, 2, name="pipe", thread=thread)
    order = [("outer", 0), ("pipe", 1), ("pipe", 2), ("outer", 3), ("pipe", 4), ("outer", 5)]
    handles = [(outer if c == "outer" else pipe).all_gather(torch.tensor([float(v)]))
               for c, v in order]
    for h in handles:
        h.wait()
    outer.close()
    assert thread._thread.is_alive()  # the pipe Comm still uses it
    pipe.close()
    assert not thread._thread.is_alive()
    assert [(c, int(v)) for c, v, _ in log] == order
    assert {t for _, _, t in log} == {"loco-comm-shared"}


def test_handles_use_the_device_hand_over_protocol():
    """The Comm calls its stream hand-over as CUDA needs it: ``issue`` on the caller's thread
    with every tensor of the operation, ``run`` on the communication thread, ``hand_over``
    on the waiting thread with the result; ``done()`` asks ``finished``."""
    import threading

    from loco.comm.streams import HostSync

    class Recording(HostSync):
        def __init__(self):
            self.calls = []

        def issue(self, tensors):
            self.calls.append(("issue", threading.current_thread().name,
                               [t.data_ptr() for t in tensors]))
            return "ready"

        def run(self, ready, fn):
            self.calls.append(("run", threading.current_thread().name, ready))
            return fn(), "done-mark"

        def finished(self, done):
            self.calls.append(("finished", done))
            return True

        def hand_over(self, done, result):
            self.calls.append(("hand_over", threading.current_thread().name, done,
                               result.data_ptr()))

    def fn(ctx):
        rec = Recording()
        ctx.comm._streams = rec
        t = torch.ones(4)
        h = ctx.comm.all_reduce_mean(t)
        while not h.done():
            time.sleep(0.001)
        h.wait()
        return rec.calls, t.data_ptr(), threading.current_thread().name

    for rank, (calls, ptr, me) in enumerate(loco.launch(fn, 2)):
        assert calls[0] == ("issue", me, [ptr])
        assert calls[1] == ("run", f"loco-comm-replicas-{rank}", "ready")
        assert ("finished", "done-mark") in calls
        assert calls[-1] == ("hand_over", me, "done-mark", ptr)
