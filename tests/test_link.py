"""Emulated slow links: parsing, the time an operation takes, queueing, and compute that goes
on meanwhile."""

import math
import time

import pytest
import torch

import loco
from loco.comm.link import EmulatedLink, LinkSpec, parse_bandwidth, parse_latency

RATE = 8e6  # bits/s: 1 MB per second
LATENCY = 0.05


@pytest.mark.parametrize("text,bits", [("100Mbit", 1e8), ("1Gbit", 1e9), ("1.5gbit/s", 1.5e9),
                                       ("800kbit", 8e5), ("10mbps", 1e7), ("10Mbps", 1e7),
                                       ("2e6", 2e6), ("1E6", 1e6)])
def test_parse_bandwidth(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text,seconds", [("50ms", 0.05), ("0.2s", 0.2), ("300us", 3e-4),
                                          ("0", 0.0), ("1.5", 1.5)])
def test_parse_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["fast", "100MB", "10MBps", "10MB/s", "1GBit", "0Mbit",
                                 "-1Gbit", "", "inf"])
def test_bad_bandwidth(bad):
    with pytest.raises(ValueError, match="100Mbit"):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["soon", "-5ms", "5 min", ""])
def test_bad_latency(bad):
    with pytest.raises(ValueError, match="50ms"):
        parse_latency(bad)


def test_queue_arithmetic():
    link = EmulatedLink(LinkSpec(RATE, LATENCY))
    # 100 KB takes 0.1 s on the wire plus the latency; a second one queues behind the first,
    # but their latencies overlap (latency is propagation, not occupancy)
    assert link.reserve(100_000, start=10.0) == pytest.approx(10.0 + 0.1 + LATENCY)
    assert link.reserve(100_000, start=10.0) == pytest.approx(10.0 + 0.2 + LATENCY)
    assert link.reserve(100_000, start=11.0) == pytest.approx(11.0 + 0.1 + LATENCY)  # idle again
    assert LinkSpec(RATE, LATENCY).seconds(200_000) == pytest.approx(0.25)
    assert math.isinf(LinkSpec.parse(None, "5ms").bandwidth)
    assert LinkSpec.parse(None, None) is None


def reduce_worker(ctx, n, count):
    """Issue ``count`` reductions of n fp32 values at once, then wait for each in turn."""
    tensors = [torch.ones(n) for _ in range(count)]
    start = time.perf_counter()
    handles = [ctx.comm.all_reduce_mean(t) for t in tensors]
    done = []
    for h in handles:
        h.wait()
        done.append(time.perf_counter() - start)
    return {"done": done, "sent": [h.record.sent_bytes for h in handles],
            "seconds": [h.record.seconds for h in handles]}


def test_an_operation_takes_latency_plus_bytes_over_bandwidth_and_queued_ones_add_up():
    n = 50_000  # 2 workers: 2 (M-1) ceil(n/M) 4 = 200,000 bytes each way per reduction
    out = loco.launch(reduce_worker, 2, args=(n, 3), link=LinkSpec(RATE, LATENCY))
    for r in out:
        assert r["sent"] == [200_000] * 3
        one = LATENCY + 200_000 * 8 / RATE  # 0.25 s
        for k, t in enumerate(r["done"]):
            # the k-th waits for the k before it to leave the link: latency + (k+1) B/W
            assert t >= LATENCY + (k + 1) * 0.2 - 1e-3
            assert t < LATENCY + (k + 1) * 0.2 + 0.5  # and not for much else
        assert r["seconds"][0] >= one - 1e-3


def compute_worker(ctx, n):
    """Compute for a while with a slow reduction in flight, then wait for it."""
    t = torch.ones(n)
    start = time.perf_counter()
    h = ctx.comm.all_reduce_mean(t)
    issued = time.perf_counter() - start
    a = torch.randn(64, 64)
    for _ in range(200):  # ~ a few ms of work
        a = torch.tanh(a @ a)
    computed = time.perf_counter() - start
    h.wait()
    return {"issued": issued, "computed": computed, "done": time.perf_counter() - start,
            "waited": h.record.waited}


def test_compute_goes_on_while_the_link_is_busy():
    n = 250_000  # 1 MB each way: 1 s on the link
    out = loco.launch(compute_worker, 2, args=(n,), link=LinkSpec(RATE, LATENCY))
    for r in out:
        assert r["issued"] < 0.1  # issuing does not block
        assert r["computed"] < 0.6  # the compute did not wait for the link
        assert r["done"] >= LATENCY + 1.0 - 1e-3  # the wait did
        assert r["waited"] >= r["done"] - r["computed"] - 0.05


def p2p_worker(ctx):
    peer = 1 - ctx.rank
    start = time.perf_counter()
    got = ctx.comm.exchange(torch.full((25_000,), float(ctx.rank)), [0, 1]).wait()
    exchanged = time.perf_counter() - start
    buf = torch.empty(25_000)
    start = time.perf_counter()
    ctx.comm.sendrecv([(torch.full((25_000,), float(ctx.rank)), peer)], [(buf, peer)]).wait()
    sendrecv = time.perf_counter() - start
    return {"exchange": exchanged, "sendrecv": sendrecv, "values": (got[peer][0].item(),
                                                                    buf[0].item())}


def test_point_to_point_operations_pay_the_link_too():
    out = loco.launch(p2p_worker, 2, link=LinkSpec(RATE, LATENCY))
    for rank, r in enumerate(out):
        assert r["values"] == (1.0 - rank, 1.0 - rank)
        # 100 KB each way: 0.1 s + latency
        assert r["exchange"] >= LATENCY + 0.1 - 1e-3
        assert r["sendrecv"] >= LATENCY + 0.1 - 1e-3


@pytest.mark.parametrize("kw", [dict(bandwidth=0), dict(bandwidth=-1.0),
                                dict(bandwidth=math.nan), dict(latency=-0.1),
                                dict(latency=math.inf)])
def test_link_spec_refuses_bad_values(kw):
    with pytest.raises(ValueError, match="LinkSpec: (bandwidth|latency)"):
        LinkSpec(**kw)


def late_peer_worker(ctx, n, late):
    """Worker 1 issues its reduction ``late`` seconds after worker 0."""
    if ctx.rank == 1:
        time.sleep(late)
    start = time.perf_counter()
    ctx.comm.all_reduce_mean(torch.ones(n)).wait()
    return time.perf_counter() - start


def test_a_late_peer_delays_completion_by_its_lateness():
    """The link is charged from when the data exists on both ends: a reduction whose peer
    issues it 0.4 s late cannot have crossed a 0.4 s link before 0.8 s (it used to complete
    at 0.4 s, the link charged from this worker's own issue)."""
    n = 100_000  # 2 workers: 400 KB each way, 0.4 s at 1 MB/s
    on_time, late = loco.launch(late_peer_worker, 2, args=(n, 0.4),
                                link=LinkSpec(RATE, LATENCY))
    transfer = 2 * LATENCY + 0.4  # two dependent phases: two latencies
    assert on_time >= 0.4 + transfer - 0.02  # 20 ms: the threads start apart
    assert late >= transfer - 1e-3 and late < transfer + 0.3


def latency_worker(ctx):
    out = {}
    for name, op in [("all_reduce_mean", lambda: ctx.comm.all_reduce_mean(torch.ones(2))),
                     ("all_gather", lambda: ctx.comm.all_gather(torch.ones(2), tag="train")),
                     ("exchange", lambda: ctx.comm.exchange(torch.ones(2), [0, 1]))]:
        start = time.perf_counter()
        op().wait()
        out[name] = time.perf_counter() - start
    start = time.perf_counter()
    ctx.comm.all_reduce_mean(torch.ones(250_000), tag="diagnostic").wait()
    out["diagnostic"] = time.perf_counter() - start
    out["diagnostic_bytes"] = ctx.comm.totals("diagnostic").sent_bytes
    return out


def test_latency_is_paid_per_dependent_phase_and_diagnostics_skip_the_link():
    from loco.comm.comm import UNMETERED_TAGS

    slow = 0.2
    assert "diagnostic" in UNMETERED_TAGS and "train" not in UNMETERED_TAGS
    for r in loco.launch(latency_worker, 2, link=LinkSpec(RATE, slow)):
        assert r["all_reduce_mean"] >= 2 * slow - 1e-3  # reduce-scatter, then all-gather
        assert r["all_gather"] >= slow - 1e-3 and r["all_gather"] < 2 * slow
        assert r["exchange"] >= slow - 1e-3 and r["exchange"] < 2 * slow
        # 1 MB each way would take 1 s on the link; a diagnostic is counted, not delayed
        assert r["diagnostic"] < 0.5 and r["diagnostic_bytes"] == 1_000_000


def late_sender_worker(ctx, late):
    buf = torch.empty(50_000)
    start = time.perf_counter()
    if ctx.rank == 0:
        ctx.comm.recv(buf, 1).wait()
    else:
        time.sleep(late)
        ctx.comm.send(torch.ones(50_000), 0).wait()
    return time.perf_counter() - start


def test_a_receive_posted_early_waits_for_the_late_sender_and_the_link():
    late = 0.3
    receiver, _ = loco.launch(late_sender_worker, 2, args=(late,), link=LinkSpec(RATE, LATENCY))
    # 200 KB at 1 MB/s after the send; 20 ms for the two threads' starts, which differ (the
    # old link, charged from the receive's posting, completed at about late = 0.3 s)
    assert receiver >= late + LATENCY + 0.2 - 0.02
