"""The dropping codecs (topk, dare, random_drop): exact byte counts, which values they keep,
determinism of the random draws, non-finite values, parameters, and the quantized all-reduce
through real workers (bit-identical results, exact wire bytes)."""

import math

import pytest
import torch
import torch.nn.functional as F

import loco
from loco.comm.codecs import get_codec
from loco.comm.codecs.formats import CODEC_NAMES, DEFAULT_KEEP, SPARSE_CODEC_NAMES
from loco.comm.codecs.dropping import RandomDropCodec

pytestmark = pytest.mark.numerics

RANDOM = ("dare", "random_drop")
TIMEOUT = 120


def normal(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def kept_positions(decoded):
    return [row.nonzero().view(-1) for row in decoded]


# --------------------------------------------------------------------------- registry, sizes
def test_registered_with_the_other_codecs():
    assert set(SPARSE_CODEC_NAMES) == {"topk", "dare", "random_drop"}
    assert set(SPARSE_CODEC_NAMES) <= set(CODEC_NAMES)
    assert DEFAULT_KEEP == 0.125
    for name in SPARSE_CODEC_NAMES:
        codec = get_codec(name)
        assert codec.name == name and codec.keep == DEFAULT_KEEP and codec.block is None
        assert codec.align == (8 if name == "topk" else 1)
    assert repr(get_codec("topk", keep=0.25)) == "Codec(topk, keep=0.25)"
    assert repr(get_codec("dare", seed=7)) == "Codec(dare, keep=0.125, seed=7)"


@pytest.mark.parametrize("keep,c,k", [(0.1, 30, 3), (0.1, 31, 4), (1 / 3, 3, 1), (1 / 3, 4, 2),
                                      (0.125, 8, 1), (0.125, 9, 2), (1, 5, 5), (1e-9, 5, 1),
                                      (0.5, 0, 0)])
def test_kept_is_the_exact_ceiling(keep, c, k):
    """k = ceil(keep · c) from keep's decimal form: ceil(0.1 * 30) in floats would be 4."""
    assert get_codec("random_drop", keep=keep).kept(c) == k


@pytest.mark.parametrize("name", RANDOM)
@pytest.mark.parametrize("keep", [0.01, 0.125, 0.3, 1.0])
def test_random_row_bytes(name, keep):
    codec = get_codec(name, keep=keep)
    assert codec.row_bytes(0) == codec.encoded_nbytes(0) == 0
    for c in (1, 7, 100, 1001, 70000):
        k = math.ceil(keep * c - 1e-9)
        assert codec.row_bytes(c) == codec.encoded_nbytes(c) == 4 * k + 8
        assert codec.encode(normal(c)).numel() == 4 * k + 8
        x = normal(3, c)
        assert codec.encode_rows(x).shape == (3, 4 * k + 8)


@pytest.mark.parametrize("keep,c,nbytes,bitmap", [
    (0.125, 8, 4 + 1, True),             # k = 1: 1 bitmap byte vs a 2-byte index
    (0.125, 64, 32 + 8, True),           # k = 8: 8 bitmap bytes vs 16 index bytes
    (0.25, 16, 16 + 2, True),
    (0.01, 800, 32 + 16, False),         # k = 8: 16 index bytes vs 100 bitmap bytes
    (0.0625, 64, 16 + 8, True),          # k = 4: a tie (8 bytes each) takes the bitmap
    (0.01, 65536, 656 * 6, False),       # the longest row with 2-byte indices
    (0.01, 65544, 656 * 8, False),       # 4-byte indices from here: 656 · 4 < 8193
    (0.1, 80000, 8000 * 4 + 10000, True),
    (1.0, 24, 96 + 3, True),
])
def test_topk_row_bytes(keep, c, nbytes, bitmap):
    codec = get_codec("topk", keep=keep)
    k = codec.kept(c)
    assert codec.uses_bitmap(c) == bitmap
    assert nbytes == 4 * k + min(c // 8, k * codec.index_width(c))
    assert codec.row_bytes(c) == codec.encoded_nbytes(c) == nbytes
    assert codec.encode_rows(normal(2, c)).shape == (2, nbytes)
    assert codec.encoded_nbytes(c - 3) == nbytes  # padded to whole bitmap bytes
    with pytest.raises(ValueError, match="not a multiple of 8"):
        codec.row_bytes(c + 1)


def test_bytes_per_value_against_fp4():
    """At keep 1/8 and a long row: topk 5 bits per value, the random codecs 4 (+ 8 bytes a
    row), FP4 E3M0 at block 32 4.25."""
    c = 1 << 20
    assert get_codec("topk").row_bytes(c) * 8 / c == 5.0
    assert get_codec("dare").row_bytes(c) == c // 2 + 8
    assert get_codec("fp4_e3m0").row_bytes(c) * 8 / c == 4.25


# --------------------------------------------------------------------------- topk
@pytest.mark.parametrize("keep,c", [(0.125, 256), (0.01, 800), (0.3, 1000), (1.0, 64),
                                    (0.001, 70000)])
def test_topk_keeps_exactly_the_k_largest(keep, c):
    codec = get_codec("topk", keep=keep)
    x = normal(3, c) * 10 ** (torch.rand(3, c, generator=torch.Generator().manual_seed(1)) * 4)
    d = codec.decode_rows(codec.encode_rows(x), c)
    k = codec.kept(c)
    for row, dec in zip(x, d):
        top = row.abs().topk(k).indices
        expect = torch.zeros(c).index_copy_(0, top, row[top])
        assert torch.equal(dec, expect)  # the k largest, exact; every other value 0
    assert torch.equal(codec.decode_rows(codec.encode_rows(d), c), d)  # lossless again


def test_topk_bytes_by_hand():
    """c = 16, keep 1/4: the 4 largest magnitudes in position order, then a 2-byte bitmap
    (bit i of byte j marks value 8j + i)."""
    x = torch.tensor([0.5, -3.0, 0.1, 0.0, 2.0, 0.2, 0.3, 0.0,
                      0.0, 0.0, -0.6, 0.0, 0.0, 0.0, 0.0, 1.5])
    codec = get_codec("topk", keep=0.25)
    buf = codec.encode(x)
    values = torch.tensor([-3.0, 2.0, -0.6, 1.5]).view(torch.uint8)
    assert buf.tolist() == values.tolist() + [0b00010010, 0b10000100]
    # with indices (keep 0.01 of 800: 8 values, 2-byte little-endian indices)
    y = torch.zeros(800)
    pos = [3, 100, 255, 256, 300, 513, 700, 799]
    y[pos] = torch.arange(1.0, 9.0)
    buf = get_codec("topk", keep=0.01).encode(y)
    assert buf[:32].tolist() == torch.arange(1.0, 9.0).view(torch.uint8).tolist()
    assert buf[32:].tolist() == [b for p in pos for b in (p & 255, p >> 8)]
    assert torch.equal(get_codec("topk", keep=0.01).decode(buf, (800,)), y)


def test_topk_four_byte_indices():
    c = 65544
    codec = get_codec("topk", keep=0.0001)  # k = 7
    x = torch.zeros(c)
    pos = torch.tensor([0, 1, 65535, 65536, 65540, 65543, 40000])
    x[pos] = torch.tensor([1.0, -2, 3, -4, 5, -6, 7])
    buf = codec.encode(x)
    assert codec.index_width(c) == 4 and not codec.uses_bitmap(c)
    assert buf[28:].tolist() == [b for p in sorted(pos.tolist()) for b in p.to_bytes(4, "little")]
    assert torch.equal(codec.decode(buf, x.shape), x)


# --------------------------------------------------------------------------- dare, random_drop
@pytest.mark.parametrize("name", RANDOM)
@pytest.mark.parametrize("keep,c", [(0.125, 1000), (0.01, 333), (0.5, 64), (1.0, 50)])
def test_random_codecs_keep_k_values(name, keep, c):
    codec = get_codec(name, keep=keep)
    x = normal(4, c)
    buf = codec.encode_rows(x)
    d = codec.decode_rows(buf, c)
    k = codec.kept(c)
    for row, dec, b in zip(x, d, buf):
        where = dec.nonzero().view(-1)
        assert where.numel() == k
        scale = c / k if name == "dare" else 1.0
        assert torch.equal(dec[where], row[where] * scale)
        # the positions are the k smallest keys under the row's seed, sent in the row
        seed = codec.row_seeds(row.view(1, -1))
        assert b[4 * k:].tolist() == list(seed.numpy().tobytes())
        expect = RandomDropCodec.positions(seed, c, k)[0]
        assert torch.equal(where, expect.sort().values)
        assert torch.equal(b[:4 * k].view(torch.float32), row[expect])
    if keep == 1.0:
        assert torch.equal(d, x)  # nothing dropped, and dare's scale is 1


@pytest.mark.parametrize("name", RANDOM)
def test_random_draws_are_deterministic_and_depend_on_seed_and_row(name):
    x = normal(2000)
    codec = get_codec(name, seed=5)
    once = codec.encode(x)
    assert torch.equal(once, codec.encode(x.clone()))  # a pure function of the row
    assert torch.equal(once, get_codec(name, seed=5).encode(x))  # any instance alike
    where = codec.decode(once, x.shape).nonzero()
    others = [get_codec(name, seed=6).encode(x), codec.encode(x + 1e-3),
              codec.encode_rows(torch.stack([x + 1e-3, x]))[0]]
    for other in others:
        assert not torch.equal(get_codec(name).decode(other, x.shape).nonzero(), where)
    # a row's bytes do not depend on its neighbours
    rows = codec.encode_rows(torch.stack([x + 1, x]))
    assert torch.equal(rows[1], once)


def test_dare_is_unbiased_and_random_drop_is_not():
    """Over many independent draws DARE's mean is x; random dropping shrinks x by keep."""
    x = normal(200)
    codec = {n: get_codec(n, keep=0.25) for n in RANDOM}
    draws = {n: torch.stack([c.decode(c.encode(x), x.shape) for c in
                             [get_codec(n, keep=0.25, seed=s) for s in range(400)]])
             for n in codec}
    kept = (draws["random_drop"] != 0).double().mean(dim=0)
    assert 0.17 < kept.min() and kept.max() < 0.34  # each value kept about 1/4 of the time
    assert ((draws["dare"].double().mean(0) - x).norm() / x.norm()) < 0.2
    ratio = (draws["random_drop"].double().mean(0) @ x.double()) / (x.double() @ x.double())
    assert abs(ratio - 0.25) < 0.03


@pytest.mark.parametrize("name,low,high", [("topk", 0.6, 0.75), ("random_drop", 0.9, 0.97),
                                           ("dare", 2.5, 2.8)])
def test_relative_l2_error_on_normal_data(name, low, high):
    """keep 1/8 of normal values: top-k leaves 0.70 of the norm out, random dropping
    sqrt(7/8) = 0.935, DARE sqrt(8 - 1) = 2.65 (unbiased, but with variance)."""
    x = normal(1 << 14)
    d = get_codec(name).decode(get_codec(name).encode(x), x.shape)
    assert low < ((d - x).norm() / x.norm()).item() < high


def test_dare_rescale_is_clamped_to_fp32_range():
    x = torch.full((16,), 3e38)
    d = get_codec("dare", keep=0.25).decode(get_codec("dare", keep=0.25).encode(x), x.shape)
    assert torch.equal(d[d != 0], torch.full((4,), torch.finfo(torch.float32).max))


# --------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_topk_keeps_non_finite_values(bad):
    codec = get_codec("topk")
    x = normal(3, 64) * 1e30
    x[1, 40] = bad
    buf = codec.encode_rows(x)  # never raises, not one byte more
    assert buf.shape == (3, codec.row_bytes(64))
    d = codec.decode_rows(buf, 64)
    assert d[1, 40].isnan() if math.isnan(bad) else d[1, 40] == bad
    assert torch.isfinite(d[0]).all() and torch.isfinite(d[2]).all()
    assert torch.equal(buf[0], codec.encode(x[0])) and torch.equal(buf[2], codec.encode(x[2]))


@pytest.mark.parametrize("name", RANDOM)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_random_codecs_send_a_non_finite_row_as_nan(name, bad):
    codec = get_codec(name)
    x = normal(3, 64)
    x[1, 40] = bad
    buf = codec.encode_rows(x)
    assert buf.shape == (3, codec.row_bytes(64))
    d = codec.decode_rows(buf, 64)
    k = codec.kept(64)
    assert d[1].isnan().sum() == k and (d[1][~d[1].isnan()] == 0).all()
    assert torch.isfinite(d[0]).all() and torch.isfinite(d[2]).all()
    assert torch.equal(buf[0], codec.encode(x[0])) and torch.equal(buf[2], codec.encode(x[2]))


# --------------------------------------------------------------------------- the all-reduce
def simulate(codec, xs):
    """The Comm's quantized mean-all-reduce in one process: every worker encodes its M
    chunks, the owner of a chunk decodes, sums in rank order, divides and re-encodes, and
    everyone decodes the gathered means."""
    m, n = len(xs), xs[0].numel()
    chunk = codec.padded(math.ceil(n / m))
    encoded = [codec.encode_rows(F.pad(x, (0, m * chunk - n)).view(m, chunk)) for x in xs]
    means = [codec.encode_rows(codec.decode_rows(torch.stack([e[j] for e in encoded]), chunk)
                               .sum(dim=0, keepdim=True).div_(m)) for j in range(m)]
    return codec.decode_rows(torch.cat(means), chunk).view(-1)[:n]


def reduce_worker(ctx, name, n, bad):
    codec = get_codec(name, keep=0.1)
    x = normal(n, seed=ctx.rank)
    if bad is not None and ctx.rank == 1:
        x[n // 3] = bad
    got = ctx.comm.all_reduce_mean(x, codec=codec).wait().clone()
    return got, [(r.sent_bytes, r.recv_bytes) for r in ctx.comm.records if r.tag == "train"]


@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
@pytest.mark.parametrize("workers,n", [(2, 1001), (3, 500)])
def test_all_reduce_is_bit_identical_with_exact_bytes(name, workers, n):
    out = loco.launch(reduce_worker, workers, args=(name, n, None), timeout=TIMEOUT)
    codec = get_codec(name, keep=0.1)
    expect = simulate(codec, [normal(n, seed=r) for r in range(workers)])
    chunk = codec.padded(math.ceil(n / workers))
    wire = 2 * (workers - 1) * codec.row_bytes(chunk)
    for got, records in out:
        assert torch.equal(got.view(torch.int32), expect.view(torch.int32))
        assert records == [(wire, wire)]
    assert 0 < (expect != 0).sum() <= workers * codec.kept(chunk)  # M chunks of k values


@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_all_reduce_carries_non_finite_to_every_worker(name, bad):
    """One worker's non-finite value makes the reduced chunk it sits in non-finite on every
    worker, bit for bit the same, at no extra byte; the other chunk is the clean one."""
    n = 1001
    out = loco.launch(reduce_worker, 2, args=(name, n, bad), timeout=TIMEOUT)
    clean = loco.launch(reduce_worker, 2, args=(name, n, None), timeout=TIMEOUT)[0]
    assert torch.equal(out[0][0].view(torch.int32), out[1][0].view(torch.int32))
    half = get_codec(name).padded(math.ceil(n / 2))
    for got, records in out:
        assert not torch.isfinite(got[:half]).all()  # the poisoned value sits in chunk 0
        assert torch.equal(got[half:], clean[0][half:])
        assert records == clean[1]


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
@pytest.mark.parametrize("keep", [0, -0.1, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_bad_keep_is_refused(name, keep):
    with pytest.raises(ValueError, match=rf"codec {name}: keep must be a number in \(0, 1\]"):
        get_codec(name, keep=keep)


@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
@pytest.mark.parametrize("seed", [-1, 1 << 64, 1.0, True, "3"])
def test_bad_seed_is_refused(name, seed):
    with pytest.raises(ValueError, match=rf"codec {name}: seed must be an int in \[0, 2\*\*64\)"):
        get_codec(name, seed=seed)


def test_keep_and_seed_are_ignored_by_the_other_codecs():
    assert get_codec("fp4_e3m0", keep=0.5, seed=3).row_bytes(64) == 34
    assert get_codec("topk", block=3).row_bytes(64) == 40  # block is ignored here


@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
def test_decode_refuses_wrong_sizes(name):
    codec = get_codec(name)
    buf = codec.encode_rows(normal(2, 64))
    with pytest.raises(ValueError, match="rows of 64 values take"):
        codec.decode_rows(buf[:, 1:], 64)
    with pytest.raises(ValueError, match="expected"):
        codec.decode(buf.view(-1)[1:], (128,))


def test_topk_decode_refuses_a_corrupt_position_field():
    """Checked on the device by ``torch._assert_async`` (a RuntimeError on the CPU, a
    device-side assertion on a GPU), not read on the host."""
    codec = get_codec("topk")
    buf = codec.encode(normal(64))
    buf[-1] ^= 0xFF
    with pytest.raises(RuntimeError, match="does not mark exactly 8 of 64"):
        codec.decode(buf, (64,))
    codec = get_codec("topk", keep=0.01)
    buf = codec.encode(normal(800))
    buf[-2:] = 0xFF
    with pytest.raises(RuntimeError, match="beyond the row's 800 values"):
        codec.decode(buf, (800,))


@pytest.mark.parametrize("name", SPARSE_CODEC_NAMES)
def test_device_probe(name, monkeypatch):
    assert get_codec(name, device="cpu", keep=0.5).keep == 0.5
    cls = type(get_codec(name))
    monkeypatch.setattr(cls, "decode_rows", lambda self, buf, c: torch.zeros(buf.shape[0], c))
    with pytest.raises(RuntimeError, match=f"codec {name} cannot run on cpu: round trip"):
        get_codec(name, device="cpu")


def test_positions_are_distinct_in_range_and_a_pure_function_of_the_seed():
    top = 2**31 - 2  # a seed is two residues mod 2^31 - 1 (row_seeds)
    seeds = torch.tensor([0, 1, top * 2**31 + top, 123456789 * 2**31 + 42])
    where = RandomDropCodec.positions(seeds, 50, 7)
    assert where.shape == (4, 7) and where.min() >= 0 and where.max() < 50
    assert all(len(set(row.tolist())) == 7 for row in where)
    assert torch.equal(where, RandomDropCodec.positions(seeds.clone(), 50, 7))
    assert len({tuple(row.tolist()) for row in where}) == 4  # other seeds, other draws
    # every position comes up about as often as the others (k/c = 1/4 over 2000 seeds:
    # 500 expected each, a binomial's standard deviation 19; 6 of them allow 114)
    counts = torch.bincount(RandomDropCodec.positions(torch.arange(2000) * 7919, 40, 10)
                            .view(-1), minlength=40)
    assert (counts - 500).abs().max() < 114


@pytest.mark.parametrize("name", RANDOM)
def test_random_codecs_read_nothing_back_to_the_host(name):
    """Seeds, positions and the non-finite mask are computed on the row's device: on
    ``meta`` (no values at all) any read to the host would raise."""
    codec = get_codec(name, keep=0.25)
    x = torch.empty(3, 64, device="meta")
    buf = codec.encode_rows(x)
    assert buf.shape == (3, codec.row_bytes(64)) and buf.device.type == "meta"
    assert codec.decode_rows(buf, 64).shape == (3, 64)
