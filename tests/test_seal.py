"""MACs on loco's own averages (loco.comm.seal): a keyed run is the unkeyed one bit for bit,
with exactly 32 bytes more per tagged row; a payload tagged with another key is rejected
and its sender named (left out by the guard, or the operation fails)."""

from __future__ import annotations

import pytest
import torch

import loco
from loco.comm.auth import AuthError, JobKey
from loco.comm.codecs import get_codec
from loco.comm.guard import Guard, Shield

KEY, OTHER = JobKey(b"k" * 32), JobKey(b"z" * 32)
SECRET = JobKey(b"k" * 32, encrypt=True)  # the same key, encrypting (--encrypt)


def reduce(ctx, codec: str | None, key: JobKey | None, stranger: int | None = None,
           aggregation: str = "drop", seeds: tuple[int, ...] = (0, 1, 2, 3)):
    ctx.comm.job_key = OTHER if ctx.rank == stranger else key
    ctx.comm.shield = Shield(Guard(aggregation, 4.0, ctx.comm.size), None, lambda: 7)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(seeds[ctx.rank]))
    handle = ctx.comm.all_reduce_mean(x, tag="train",
                                      codec=None if codec is None else get_codec(codec))
    handle.wait()
    return x, handle.record.sent_bytes, ctx.comm.shield.guard.report()


@pytest.mark.parametrize("key", [KEY, SECRET], ids=["mac", "encrypted"])
@pytest.mark.parametrize("codec", [None, "fp4_e3m0", "topk_2bit"])
def test_a_keyed_average_is_the_unkeyed_one_with_its_tags_bytes(codec, key):
    keyed = loco.launch(reduce, 4, args=(codec, key))
    plain = loco.launch(reduce, 4, args=(codec, None))
    assert all(torch.equal(k[0], p[0]) for k, p in zip(keyed, plain))
    # a tag per row to each of the 3 others: both legs of a reduce-scatter, one all-gather
    legs = 1 if codec == "topk_2bit" else 2
    assert keyed[0][1] - plain[0][1] == 3 * legs * 32


@pytest.mark.parametrize("codec", ["topk_2bit"])
def test_a_message_under_another_key_is_left_out_and_named(codec):
    out = loco.launch(reduce, 4, args=(codec, KEY, 2))
    honest = [0, 1, 3]
    for r in honest:
        assert {(d["worker"], d["sign"]) for d in out[r][2]} == {(2, "mac")}
    # the mean of the other three: what three workers alone form, bit for bit
    three = loco.launch(reduce, 3, args=(codec, KEY), kwargs={"seeds": (0, 1, 3)})
    assert all(torch.equal(out[r][0], three[0][0]) for r in honest)


def test_a_reduced_mean_under_another_key_fails_the_operation_naming_its_reducer():
    # (whichever fails first: an honest worker names the stranger; the stranger, all others)
    with pytest.raises(loco.WorkerError, match=r"worker\(s\) \[(2|0, 1, 3)\] failed its MAC"):
        loco.launch(reduce, 4, args=("fp4_e3m0", KEY, 2))


def test_without_a_guard_a_forged_contribution_fails_the_operation():
    with pytest.raises(loco.WorkerError, match="failed its MAC"):
        loco.launch(reduce, 4, args=("topk_2bit", KEY, 2, "mean"))


def gossip(ctx, key: JobKey | None, stranger: int | None = None):
    ctx.comm.job_key = OTHER if ctx.rank == stranger else key
    ctx.comm.shield = Shield(Guard("drop", 4.0, ctx.comm.size), None, lambda: 1)
    mine = torch.full((40,), float(ctx.rank), dtype=torch.float32)
    got = {}

    def build(k, out):
        out.copy_(mine[k * 20:(k + 1) * 20].view(torch.uint8))

    def consume(k, pieces):
        got[k] = [p.view(torch.float32).clone() for p in pieces]

    members = [0, 1] if ctx.rank < 2 else [2, 3]
    h = ctx.comm.exchange_pieces([80, 80], members, build, consume)
    h.wait()
    return got, h.record.sent_bytes, ctx.comm.shield.guard.forged_next


@pytest.mark.parametrize("key", [KEY, SECRET], ids=["mac", "encrypted"])
def test_gossip_pieces_carry_macs_and_a_forged_one_is_zeroed_and_handed_to_the_guard(key):
    keyed = loco.launch(gossip, 4, args=(key,))
    plain = loco.launch(gossip, 4, args=(None,))
    for k, p in zip(keyed, plain):
        assert all(torch.equal(a, b) for piece in (0, 1) for a, b in zip(k[0][piece], p[0][piece]))
        assert k[1] - p[1] == 2 * 32  # a tag on each of 2 pieces, to the one partner
    forged = loco.launch(gossip, 4, args=(key, 1))
    assert torch.equal(forged[0][0][1][1], torch.zeros(20))  # worker 1's piece, zeroed
    assert forged[0][2].tolist() == [False, True]


def test_encrypted_rows_hide_their_bytes_and_open_only_as_sent():
    """With encryption the bytes that go out are not the rows' (a fresh nonce each time:
    the same rows encrypt differently), come back as the rows, and a flipped bit, another
    row's context or another key fails."""
    from loco.comm.seal import Seal

    kept: dict = {}

    def buffers(role, shape, dtype):
        return kept.setdefault(role, torch.empty(shape, dtype=dtype))

    rows = torch.arange(32, dtype=torch.float32).view(2, 16)
    seal = Seal(SECRET, 0, [0, 1], 1, None, buffers)
    ctx = [seal._ctx("scatter", 0, r) for r in (0, 1)]
    sent = seal._tagged(rows, "out", ctx).clone()
    plain = rows.view(torch.uint8).view(2, -1)
    assert sent.shape == (2, 64 + 32) and not torch.equal(sent[:, :64], plain)
    assert not torch.equal(seal._tagged(rows, "out", ctx)[:, :64], sent[:, :64])
    back = torch.empty_like(rows)
    assert seal._checked(sent, back, ctx) == [] and torch.equal(back, rows)
    assert seal._checked(sent, back, ctx[::-1]) == [0, 1]
    other = Seal(JobKey(b"z" * 32, encrypt=True), 0, [0, 1], 1, None, buffers)
    assert other._checked(sent, back, ctx) == [0, 1]
    sent[1, 3] ^= 1
    assert seal._checked(sent, back, ctx) == [1] and torch.equal(back[1], torch.zeros(16))


def demo_keyed(ctx, stranger: int):
    from test_guard import trained

    ctx.comm.job_key = OTHER if ctx.rank == stranger else KEY
    return trained(ctx, lambda model, comm: loco.DeMo(
        model, torch.optim.SGD(model.parameters(), lr=3e-3), comm), 3)


def test_a_demo_message_under_another_key_is_left_out_and_named():
    """DeMo's all-gathered messages are contributions: one whose MAC fails is left out by
    the guard and named ``mac`` by every honest worker, the step goes on."""
    out = loco.launch(demo_keyed, 4, args=(2,))
    for r in (0, 1, 3):
        assert {(d["worker"], d["sign"]) for d in out[r][1]} == {(2, "mac")}
