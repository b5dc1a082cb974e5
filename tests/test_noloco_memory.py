"""NoLoCo's exchange in pieces (``Comm.exchange_pieces``): the parameters of the whole
message's exchange and of a single-process reference, bit for bit, at a size that is not
whole pieces; the bytes of the whole message counted as one operation; the Comm's kept
buffers one piece each, not model-sized; the Comm's thread keeps no operation's tensors."""

import gc
import time
import weakref

import pytest
import torch
from workers import make_model, make_optimizer, max_diff, params_of, reference_noloco, train_steps

import loco
from loco.algorithms.noloco import message_bounds
from loco.comm.codecs import get_codec

pytestmark = pytest.mark.numerics

PAPER = dict(outer_lr=0.7, outer_momentum=0.5, gamma=0.7)
SMALL = 20_000
"""Bytes of a piece, the group's messages together, in these tests: 1,250 values of the tiny
model's 28,896 in a pair (fp32), so the last piece is not a whole one."""


class Pieced(loco.NoLoCo):
    piece_bytes = SMALL


def run(ctx, steps, pieced=True, **kw):
    """NoLoCo (in small pieces, or whole) for ``steps`` steps: the parameters, the train
    records, the piece sizes and the Comm's kept buffers."""
    model = make_model()
    cls = Pieced if pieced else loco.NoLoCo
    algo = cls(model, make_optimizer(model), ctx.comm, warn=False, **kw)
    train_steps(model, algo.inner_optimizer, ctx.rank, range(steps),
                lambda: (algo.step(), algo.zero_grad()))
    return {"params": params_of(dict(model.named_parameters())),
            "records": [r for r in ctx.comm.records if r.tag == "train"],
            "sizes": algo.piece_sizes(), "bounds": algo.bounds,
            # the exchange's buffers (and apart, the guard's counters and history)
            "kept": ctx.comm.buffer_bytes() - ctx.comm.shield.guard.nbytes(),
            "guard": ctx.comm.shield.guard.nbytes(), "memory": algo.memory_bytes(),
            "numel": algo.slow.numel()}


@pytest.mark.parametrize("group_size,nesterov", [(2, False), (4, True)])
def test_pieces_match_the_single_process_reference(group_size, nesterov):
    steps, H, M = 8, 4, 4
    out = loco.launch(run, M, args=(steps,), kwargs=dict(
        sync_every=H, group_size=group_size, nesterov=nesterov, **PAPER))
    ref = reference_noloco(M, steps, H, group_size, 0.7, 0.5, 0.7, nesterov)
    bounds = out[0]["bounds"]
    widths = {b - a for a, b in zip(bounds, bounds[1:])}
    assert len(bounds) > 10 and len(widths) == 2  # many pieces, the last one shorter
    for r, expected in zip(out, ref):
        assert max_diff(r["params"], expected) == 0


CODECS = {"fp32": {}, "bf16": dict(codec="bf16"),
          "int8_nesterov": dict(codec="int8", nesterov=True),
          "fp4_bf16": dict(codec="fp4_e3m0", slow_codec="bf16"),
          "fp4_block_48": dict(codec="fp4_e3m0", codec_block=48),
          "topk": dict(codec="topk"), "group_of_four": dict(group_size=4)}


def test_pieces_give_the_whole_messages_bits_and_bytes():
    """Every codec: the same parameters, bit for bit, in pieces as in one piece, and the
    same bytes, counted once per outer step; the dropping codecs (top-k) go whole. Two
    outer steps of H = 2 (the second exchange on the outer state the first left)."""
    steps, H, M = 4, 2, 4
    for name, kw in CODECS.items():
        pieced = loco.launch(run, M, args=(steps,), kwargs=dict(sync_every=H, **PAPER, **kw))
        whole = loco.launch(run, M, args=(steps,),
                            kwargs=dict(pieced=False, sync_every=H, **PAPER, **kw))
        assert len(whole[0]["sizes"]) == 1 and (len(pieced[0]["sizes"]) > 1) == (name != "topk")
        for p, w in zip(pieced, whole):
            assert max_diff(p["params"], w["params"]) == 0, name
            assert sum(p["sizes"]) == sum(w["sizes"]), name
            assert [(r.op, r.sent_bytes, r.recv_bytes, r.raw_bytes) for r in p["records"]] == \
                [(r.op, r.sent_bytes, r.recv_bytes, r.raw_bytes) for r in w["records"]], name
            assert len(p["records"]) == steps // H


def test_bytes_are_the_whole_messages_once_per_outer_step():
    M, H = 4, 4
    out = loco.launch(run, M, args=(2 * H,), kwargs=dict(
        sync_every=H, codec="fp4_e3m0", slow_codec="bf16", **PAPER))
    n = out[0]["numel"]
    c = -(-n // 32) * 32
    message = c // 2 + c // 32 + 2 * n
    for r in out:
        assert sum(r["sizes"]) == message
        assert [(x.op, x.sent_bytes, x.recv_bytes, x.raw_bytes) for x in r["records"]] == \
            [("exchange", message, message, message)] * 2


def test_kept_buffers_are_one_piece_per_member_and_counted():
    """The Comm keeps this worker's piece and the other members' (rows rounded up to 16
    bytes): at most the piece's bytes, far from a model-sized message; ``comm`` counts
    them, ``outer`` only φ and δ."""
    for group_size in (2, 4):
        out = loco.launch(run, 4, args=(4,), kwargs=dict(sync_every=2, group_size=group_size,
                                                         **PAPER))
        for r in out:
            stride = -(-max(r["sizes"]) // 16) * 16
            assert r["kept"] == group_size * stride <= SMALL + 16 * group_size
            assert r["kept"] * 10 < 8 * r["numel"]  # the whole message: 8 bytes a value
            assert r["memory"]["comm"] == r["kept"] + r["guard"]
            assert r["memory"]["outer"] == 2 * 4 * r["numel"]


@pytest.mark.parametrize("codec,block", [("fp32", 32), ("fp4_e3m0", 32), ("int8", 48),
                                         ("topk", 32)])
def test_message_bounds_are_whole_blocks_within_the_limit(codec, block):
    c, slow = get_codec(codec, block), get_codec("bf16")
    for numel in (0, 1, 31, 1000, 12_345):
        bounds = message_bounds(c, slow, numel, 2, 1000)
        assert bounds[0] == 0 and bounds[-1] == numel and bounds == sorted(set(bounds))
        pieces = list(zip(bounds, bounds[1:]))
        assert sum(c.encoded_nbytes(b - a) for a, b in pieces) == c.encoded_nbytes(numel) \
            or numel == 0
        if c.blockwise:
            assert all((b - a) % c.align == 0 for a, b in pieces[:-1])
            assert all(c.encoded_nbytes(b - a) + slow.encoded_nbytes(b - a) <= 500
                       for a, b in pieces[:-1])
        else:
            assert len(pieces) == (numel > 0)


def swap_in_pieces(ctx, sizes):
    """Each rank's message of ``sizes`` pieces, byte j of piece k being (rank, k, j) mixed;
    what every member's pieces were when consumed, and the records."""
    def fill(rank, k, out):
        out.copy_((torch.arange(out.numel()) * 7 + 31 * rank + 5 * k) % 251)

    got = []
    handle = ctx.comm.exchange_pieces(sizes, range(ctx.comm.size), fill.__get__(ctx.rank),
                                      lambda k, pieces: got.append([p.clone() for p in pieces]))
    assert handle.wait() == tuple(range(ctx.comm.size))
    expected = []
    for k, s in enumerate(sizes):
        row = []
        for r in range(ctx.comm.size):
            t = torch.empty(s, dtype=torch.uint8)
            fill(r, k, t)
            row.append(t)
        expected.append(row)
    same = all(torch.equal(a, b) for g, e in zip(got, expected) for a, b in zip(g, e))
    return same, len(got), [(r.op, r.sent_bytes, r.recv_bytes, r.participants)
                            for r in ctx.comm.records], ctx.comm.buffer_bytes()


def test_exchange_pieces_swaps_every_piece_and_counts_one_operation():
    sizes = [40, 40, 13, 0, 7]
    for M in (2, 3):
        for same, count, records, kept in loco.launch(swap_in_pieces, M, args=(sizes,)):
            assert same and count == len(sizes)
            total = (M - 1) * sum(sizes)
            assert records == [("exchange", total, total, tuple(range(M)))]
            assert kept == M * 48  # one row of the largest piece, rounded up to 16, per member


def released(ctx):
    """Whether the tensors of a finished exchange (the received ones) are freed once the
    caller drops them: the Comm's thread does not keep the last operation."""
    mine = torch.full((1000,), float(ctx.rank))
    out = ctx.comm.exchange(mine, [0, 1]).wait()
    refs = [weakref.ref(t) for t in out if t is not mine]
    del out
    for _ in range(50):  # the helper thread that waited may still be finishing
        gc.collect()
        if all(r() is None for r in refs):
            return True
        time.sleep(0.02)
    return False


def test_the_comm_thread_keeps_no_finished_operations_tensors():
    assert all(loco.launch(released, 2))
