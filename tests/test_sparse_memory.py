"""SparseLoCo's memory (docs/memory.md): the chunked top-k codec encodes, decodes and adds in
pieces of ``PIECE_VALUES`` values, the all-gather mean keeps no padded copy of Δ, and the
error feedback subtracts the kept values from ``C(e)``'s bytes instead of keeping a dense
``D(C(e))``: each the same bits as before."""

import math

import pytest
import torch
import torch.nn.functional as F
from workers import batch, make_model, make_optimizer

import loco
from loco.algorithms import buffers
from loco.comm.codecs import chunk_topk
from loco.comm.codecs import get_codec

CODECS = [("topk_2bit", 64, 0.125), ("topk_2bit_packed", 64, 0.125), ("topk_2bit", 4096, None)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def vector(n: int, seed: int = 0, bad: bool = True) -> torch.Tensor:
    """n values, with a NaN, an infinity and signed zeros where there is room."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if bad and n > 300:
        x[7], x[200], x[250:260] = math.nan, -math.inf, 0.0
        x[260:270] = -0.0
    return x


@pytest.mark.parametrize("name,block,keep", CODECS)
@pytest.mark.parametrize("rows,chunks", [(1, 1), (1, 7), (3, 5), (2, 9)])
def test_pieces_give_the_bytes_and_values_of_one_pass(name, block, keep, rows, chunks,
                                                      monkeypatch):
    """Pieces of 2 chunks (the rows' chunks not whole pieces) against one piece: the same
    bytes, the same decode, the same sums, bit for bit."""
    codec = get_codec(name, block=block, keep=keep)
    x = vector(rows * chunks * block).view(rows, -1)
    whole = codec.encode_rows(x)
    dense = codec.decode_rows(whole, x.shape[1])
    total = torch.randn(x.shape)
    summed, bad = total.clone(), codec.add_rows(whole, x.shape[1], total.clone())
    codec.add_rows(whole, x.shape[1], summed)
    monkeypatch.setattr(chunk_topk, "PIECE_VALUES", 2 * block)
    assert torch.equal(codec.encode_rows(x), whole)
    out = torch.empty((rows, codec.row_bytes(x.shape[1])), dtype=torch.uint8)
    assert codec.encode_rows(x, out=out) is out and torch.equal(out, whole)
    assert torch.equal(bits(codec.decode_rows(whole, x.shape[1])), bits(dense))
    pieced = total.clone()
    assert torch.equal(codec.add_rows(whole, x.shape[1], pieced), bad)
    assert torch.equal(bits(pieced), bits(summed))


@pytest.mark.parametrize("name,block,keep", CODECS)
@pytest.mark.parametrize("n", [1, 63, 64 * 5 + 17, 4096 + 1, 3 * 4096 + 700])
def test_a_flat_vector_encodes_as_its_padded_row(name, block, keep, n, monkeypatch):
    """``encode_flat`` (whole chunks in place, the last from a one-chunk copy) gives
    ``codec.encode``'s bytes, ``decode_flat`` its decode, at sizes that are not whole chunks
    nor whole pieces."""
    monkeypatch.setattr(chunk_topk, "PIECE_VALUES", 3 * block)
    codec = get_codec(name, block=block, keep=keep)
    x = vector(n)
    want = codec.encode(x)
    out = torch.full((want.numel() + 5,), 7, dtype=torch.uint8)
    got = chunk_topk.encode_flat(codec, x, out)
    assert torch.equal(got.view(-1), want)
    assert out[want.numel():].tolist() == [7] * 5  # the bytes after it untouched
    decoded = torch.empty(n)
    chunk_topk.decode_flat(codec, got, decoded)
    assert torch.equal(bits(decoded), bits(codec.decode(want, (n,))))


@pytest.mark.parametrize("name,block,keep", CODECS)
@pytest.mark.parametrize("n", [5, 64 * 7, 64 * 7 + 3, 4096 * 2 + 100])
def test_sparse_error_feedback_is_the_dense_subtraction(name, block, keep, n, monkeypatch):
    """e − D(C(e)) from C(e)'s bytes equals the dense subtraction bit for bit, with NaN,
    infinities and signed zeros, on the CPU's shorter path and the device path."""
    codec = get_codec(name, block=block, keep=keep)
    for seed in range(3):
        e = vector(n, seed)
        message = codec.encode(e)
        want = e.clone().sub_(codec.decode(message, (n,)))
        for device_path in (False, True):
            monkeypatch.setattr(chunk_topk, "device_path", lambda d, on=device_path: on)
            monkeypatch.setattr(chunk_topk, "PIECE_VALUES", 2 * block)
            got = e.clone()
            buffers.feed_back_message(got, codec, torch.cat([message, message]))
            assert torch.equal(bits(got), bits(want)), (seed, device_path)


def gather_worker(ctx, n, name, block, keep):
    codec = get_codec(name, block=block, keep=keep)
    x = vector(n, ctx.rank, bad=False)
    mine = x.clone()
    message = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
    ctx.comm.all_gather_mean(x, codec=codec, sent=message).wait()
    dense = torch.empty(n)
    y = mine.clone()
    ctx.comm.all_gather_mean(y, codec=codec, sent=dense).wait()
    return {"mean": x, "again": y, "mine": mine, "message": message, "sent": dense,
            "kept": ctx.comm.buffer_bytes(), "bytes": ctx.comm.totals().sent_bytes}


@pytest.mark.parametrize("name,block,keep", CODECS[::2])
def test_the_all_gather_mean_keeps_no_copy_of_the_vector(name, block, keep):
    """The all-gather mean of n values (not whole chunks): what every worker gets is the
    dense decodes' sum in rank order, divided (as before); ``sent`` receives C(x) (uint8) or
    D(C(x)) (fp32); the Comm keeps the messages and one chunk, nothing of the vector's size."""
    n = 20 * block + 37
    codec = get_codec(name, block=block, keep=keep)
    out = loco.launch(gather_worker, 2, args=(n, name, block, keep))
    echoes = [codec.decode(codec.encode(r["mine"]), (n,)) for r in out]
    width = codec.padded(n)
    total = F.pad(echoes[0], (0, width - n)).add_(F.pad(echoes[1], (0, width - n)))
    for r in out:
        assert torch.equal(bits(r["mean"]), bits(total[:n] / 2))
        assert torch.equal(bits(r["again"]), bits(r["mean"]))
        assert torch.equal(r["message"], codec.encode(r["mine"]))
    assert all(torch.equal(bits(r["sent"]), bits(e)) for r, e in zip(out, echoes))
    for r in out:
        assert r["bytes"] == 2 * codec.encoded_nbytes(n)
        # the gathered messages, this worker's own, one chunk: a few bytes per chunk
        assert r["kept"] == 3 * codec.encoded_nbytes(n) + 4 * block < n * 4 // 4


def padded_gather_mean(codec, flat, parts, divisor, kept, all_gather, sent=None, guard=None,
                       wire=None):
    """The all-gather mean as it was: Δ padded into a kept copy, encoded whole (an honest
    run: the guard, if any, has nothing to leave out, and no attack flips bits)."""
    n, width = flat.numel(), codec.padded(flat.numel())
    row = kept("padded", (1, width), torch.float32)
    row[0, :n].copy_(flat)
    row[0, n:].zero_()
    mine = codec.encode_rows(row)
    if sent is not None:
        sent.copy_(codec.decode_rows(mine, width, out=row).view(-1)[:n])
    gathered = kept("gathered", (parts, mine.shape[1]), torch.uint8)
    all_gather(gathered, mine[0])
    total = row.zero_()
    bad = codec.add_rows(gathered[0:1], width, total)
    for r in range(1, parts):
        bad |= codec.add_rows(gathered[r:r + 1], width, total)
    total.view(bad.shape[0], -1).masked_fill_(bad, math.nan).div_(divisor)
    return flat.copy_(total.view(-1)[:n])


def run_worker(ctx, kw):
    """SparseLoCo, in loco's runs layout (the paths compared), for three rounds and a
    step."""
    model = make_model(layers=2)
    algo = loco.SparseLoCo(model, make_optimizer(model), ctx.comm, sparse_layout="runs",
                           sparse_values="split", sparse_mean="all", **kw)
    for t in range(3 * kw["sync_every"] + 1):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        algo.step()
        algo.zero_grad()
    algo.flush()
    return ([p.detach().clone() for p in model.parameters()], ctx.comm.totals().sent_bytes,
            algo.memory_bytes(), algo.buffers.sent.dtype)


@pytest.mark.parametrize("kw", [dict(sync_every=3), dict(sync_every=3, codec_block=64),
                                dict(sync_every=3, offload=True),
                                dict(sync_every=3, eager=True)])
def test_sparseloco_gives_the_parameters_and_bytes_it_gave(kw, monkeypatch):
    """A SparseLoCo run against the same run through the old paths: the same parameters
    bit for bit and the same bytes; its outer state smaller by D(C(e)) (kept as bytes)."""
    new = loco.launch(run_worker, 2, args=(kw,))
    with monkeypatch.context() as old_paths:  # a padded copy of Δ, a dense D(C(e))
        old_paths.setattr(chunk_topk.ChunkTopKCodec, "gather_mean", padded_gather_mean)
        old_paths.setattr(buffers.SyncBuffers, "keep_message", lambda self, codecs: False)
        old = loco.launch(run_worker, 2, args=(kw,))
    n = sum(p.numel() for p in make_model(layers=2).parameters())
    codec = get_codec("topk_2bit", block=kw.get("codec_block"))
    for (p_old, b_old, m_old, d_old), (p_new, b_new, m_new, d_new) in zip(old, new):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(p_old, p_new))
        assert b_old == b_new
        assert d_old == torch.float32 and d_new == torch.uint8
        assert m_old["outer"] - m_new["outer"] == 4 * n - codec.encoded_nbytes(n)
        assert m_new["comm"] < m_old["comm"] // 4


def in_flight_worker(ctx):
    model = make_model(layers=2)
    algo = loco.SparseLoCo(model, make_optimizer(model), ctx.comm, sync_every=3, eager=True)
    for t in range(4):  # the sync of step 3 is in flight
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        algo.step()
        algo.zero_grad()
    algo._wait(algo._in_flight)
    kept = algo._sent.clone()
    state = algo.outer_state()
    algo._sent.zero_()
    algo.load_outer_state({k: flat.clone() for k, (_, flat) in state.items()})
    algo.flush()
    return "in_flight.sent" in state, "in_flight.delta" in state, kept, algo._sent


def test_a_sync_in_flight_restores_its_message_from_the_error():
    """The outer state (checkpoints, healing) holds vectors of the share's values: not the
    message's bytes, which loading makes again from the error, the same bytes."""
    for has_sent, has_delta, kept, rebuilt in loco.launch(in_flight_worker, 2):
        assert has_delta and not has_sent
        assert torch.equal(kept, rebuilt)


@pytest.mark.parametrize("launcher", ["threads", "processes"])
def test_a_checkpoint_with_a_sync_in_flight_resumes_bit_for_bit(launcher):
    """Eager SparseLoCo checkpointed with its sync in flight (its message's bytes in the
    state dict; through ``torch.distributed.checkpoint``, made again from the error):
    the resumed run ends where the straight one does, bit for bit."""
    from workers import max_diff, resume_worker

    out = loco.launch(resume_worker, 2, launcher, args=(10, 4, 3, "sparseloco"),
                      kwargs=dict(eager=True, codec_block=64, codec_keep=0.25))
    for straight, resumed in out:
        assert max_diff(straight, resumed) == 0
