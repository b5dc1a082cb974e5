"""The library's codecs against the test-side quantiser (tests/quantise.py), written from the
formats' maths without loco's code: bytes worked out by hand, the scale rule at its edges,
and the bytes and round trips of random rows, bit for bit. The shared references
(``workers.reference_streaming``) take their round trips from the quantiser, so these pins
are what ties a reference run to the formats as documented."""

import itertools
import math
import struct

import pytest
import quantise as q
import torch

from loco.comm.codecs import get_codec
from loco.comm.codecs.bitpack import ef_decode, ef_encode

pytestmark = pytest.mark.numerics

F32_MAX = torch.finfo(torch.float32).max


def library_bytes(name, x, block=None, keep=None) -> bytes:
    return bytes(get_codec(name, block, keep=keep).encode(torch.tensor(x)).tolist())


def library_roundtrip(name, x, block=None, keep=None) -> torch.Tensor:
    codec = get_codec(name, block, keep=keep)
    x = torch.as_tensor(x, dtype=torch.float32)
    return codec.decode(codec.encode(x), x.shape)


def varied(n: int, seed: int) -> torch.Tensor:
    """Normal values over five decades of magnitude, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** (5 * torch.rand(n, generator=g) - 3)
    x[::97] = 0.0
    return x


# --------------------------------------------------------------------------- by hand
# Each case: (codec, block, values, bytes). The scale byte is e + 127 with e the smallest
# integer such that max|x| <= fmt_max · 2^e; ties go to the even code.
HAND = [
    # E3M0, e = 0: 1 -> k 3; -2 -> 4 | 8; 12, between 8 and 16, -> 8 (k 6, even); 0.3 -> 0.25
    ("fp4_e3m0", 4, [1.0, -2.0, 12.0, 0.3], [0xC3, 0x16, 0x7F]),
    # E2M1, e = 0: 5 -> 4 (k 6, not 7); -0.25 -> 0, never negative; 6 -> k 7; 1.25 -> 1 (k 2)
    ("fp4_e2m1", 4, [5.0, -0.25, 6.0, 1.25], [0x06, 0x27, 0x7F]),
    # int8, e = 0: -63.5 -> -64 (even), 0xC0 in two's complement
    ("int8", 2, [127.0, -63.5], [0x7F, 0xC0, 0x7F]),
    # int8, e = 1: 254 / 2 = 127; 1 / 2 = 0.5 -> 0 (even)
    ("int8", 2, [254.0, 1.0], [0x7F, 0x00, 0x80]),
    # int2, e = 0 (3 <= 3 · 2^0): codes big | sign << 1 = 1, 3, 0, 0 at bits 0, 2, 4, 6
    ("int2", 4, [3.0, -1.0, 0.5, 0.0], [0x0D, 0x7F]),
    # int2: a block of zeros goes under scale byte 0
    ("int2", 4, [0.0, 0.0, 0.0, 0.0], [0x00, 0x00]),
    # a block holding a NaN: values zero, scale byte 0xFF
    ("fp4_e3m0", 2, [1.0, math.nan], [0x00, 0xFF]),
    # fp8 E4M3, e = 0 (448 fits): 448 = 0x7E; -1 = 0xB8
    ("fp8_e4m3", 2, [448.0, -1.0], [0x7E, 0xB8, 0x7F]),
]


@pytest.mark.parametrize("name,block,values,expected", HAND)
def test_hand_worked_bytes(name, block, values, expected):
    x = torch.tensor(values)
    assert library_bytes(name, values, block) == bytes(expected)
    assert q.scaled_bytes(name, x, block) == bytes(expected)


@pytest.mark.parametrize("name,block,values,decoded", [
    ("fp4_e3m0", 4, [1.0, -2.0, 12.0, 0.3], [1.0, -2.0, 8.0, 0.25]),
    ("fp4_e2m1", 4, [5.0, -0.25, 6.0, 1.25], [4.0, 0.0, 6.0, 1.0]),
    ("int2", 4, [3.0, -1.0, 0.5, 0.0], [1.5, -1.5, 0.5, 0.5]),  # clips; zero to +0.5
    ("int2", 4, [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]),
    ("int8", 2, [254.0, 1.0], [254.0, 0.0]),
    # E2M1 at fp32's top: e = 126, F32_MAX / 2^126 rounds to 6, 6 · 2^126 is past fp32's max
    ("fp4_e2m1", 2, [F32_MAX, -1.0], [F32_MAX, -0.0]),
])
def test_hand_worked_round_trips(name, block, values, decoded):
    expected = torch.tensor(decoded)
    assert torch.equal(library_roundtrip(name, values, block), expected)
    assert torch.equal(q.roundtrip(name, torch.tensor(values), block), expected)


def test_a_nonfinite_block_decodes_as_nan_and_its_neighbours_do_not():
    x = [1.0, math.inf, 0.5, -0.5]
    for out in (library_roundtrip("fp4_e3m0", x, 2), q.roundtrip("fp4_e3m0", torch.tensor(x), 2)):
        assert out[:2].isnan().all() and torch.equal(out[2:], torch.tensor([0.5, -0.5]))


@pytest.mark.parametrize("name,amax,e", [
    ("fp4_e3m0", 16.0, 0), ("fp4_e3m0", 16.000002, 1), ("fp4_e3m0", 8.0, -1),
    ("fp4_e3m0", 0.0, -126), ("fp4_e3m0", 1e-45, -126), ("fp4_e3m0", 3e38, 124),
    ("fp4_e2m1", 6.0, 0), ("fp4_e2m1", 6.5, 1), ("fp4_e2m1", 3.0, -1),
    ("int8", 127.0, 0), ("int8", 128.0, 1), ("int8", 1.0, -6),
    ("fp8_e4m3", 448.0, 0), ("fp8_e4m3", 449.0, 1), ("int2", 3.0, 0), ("int2", 3.5, 1),
    ("int2", 1.5, -1)])
def test_the_scale_is_the_smallest_power_of_two_that_fits(name, amax, e):
    """e = ceil(log2(max|x| / fmt_max)), clamped to [-126, 127], worked out by hand."""
    block = 4
    x = [amax, -amax / 3, 0.0, 0.0]
    assert library_bytes(name, x, block)[-1] == e + 127
    blocks = torch.tensor([x], dtype=torch.float32).double()
    assert q.scale_exponents(blocks, q.FMT_MAX[name]).item() == e


def test_ties_go_to_the_even_code_in_both_grids():
    """Every midpoint of both FP4 grids, scaled to fill the block (its largest value is the
    grid's top): the even neighbour, as docs/codecs.md says."""
    for name, grid in q.GRIDS.items():
        mids = [(a + b) / 2 for a, b in itertools.pairwise(grid)]
        want = [grid[i + (i % 2)] for i in range(len(mids))]  # of codes i, i + 1: the even
        x = torch.tensor([*mids, grid[-1]])
        assert torch.equal(library_roundtrip(name, x, 8), torch.tensor([*want, grid[-1]]))
        assert torch.equal(q.roundtrip(name, x, 8), torch.tensor([*want, grid[-1]]))


def test_int8_rounds_half_to_even():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 126.5], dtype=torch.float64)
    assert q.round_half_even(y).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 2.0, 126.0]


# --------------------------------------------------------------------------- positions
# Elias-Fano by hand: 4 positions of 16, l = floor(log2(16 / 4)) = 2 low bits each
# (1, 1, 2, 2 -> 0b10100101), then a bitmap of 4 + (15 >> 2) = 7 bits where x_i sets bit
# (x_i >> 2) + i: 0, 2, 3, 6 -> 0b1001101.
EF_HAND = ([1, 5, 6, 14], 16, [0xA5, 0x4D])


def test_elias_fano_by_hand():
    positions, n, expected = EF_HAND
    assert q.elias_fano(positions, n) == bytes(expected)
    assert bytes(ef_encode(torch.tensor([positions]), n)[0].tolist()) == bytes(expected)
    assert ef_decode(torch.tensor([expected], dtype=torch.uint8), n, 4).tolist() == [positions]


@pytest.mark.parametrize("n,k", [(4096, 64), (64, 16), (100, 7), (10, 10), (5, 1), (64, 63)])
def test_elias_fano_of_random_sets(n, k):
    g = torch.Generator().manual_seed(n * 131 + k)
    rows = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(5)])
    ours = b"".join(q.elias_fano(r.tolist(), n) for r in rows)
    assert bytes(ef_encode(rows, n).view(-1).tolist()) == ours


# SparseLoCo's chunk by hand: block 8, keep 1/2 -> k = 4. The 4 largest magnitudes are at
# 1, 3, 5, 7 (-4, 1, 2, -3); their mean 2.5 splits them: hi = (4 + 3) / 2 = 3.5, lo =
# (1 + 2) / 2 = 1.5. Codes sign | hi << 1: 3, 0, 0, 3 -> 0b11000011; bf16 1.5 = 0x3FC0,
# 3.5 = 0x4060 (little-endian). Positions: Elias-Fano, l = 1: lows 1, 1, 1, 1 -> 0x0F, bitmap
# of 4 + (7 >> 1) = 7 bits, bits 0, 2, 4, 6 -> 0x55; packed, 3 bits each: 1 | 3 << 3 | 5 << 6
# | 7 << 9 = 0x0F59.
CHUNK_X = [0.5, -4.0, 0.0, 1.0, 0.0, 2.0, 0.1, -3.0]
CHUNK_HEAD = [0xC3, 0xC0, 0x3F, 0x60, 0x40]


@pytest.mark.parametrize("name,positions", [("topk_2bit", [0x0F, 0x55]),
                                            ("topk_2bit_packed", [0x59, 0x0F])])
def test_chunked_topk_by_hand(name, positions):
    expected = bytes(CHUNK_HEAD + positions)
    assert library_bytes(name, CHUNK_X, 8, 0.5) == expected
    assert q.chunk_topk_bytes(name, torch.tensor(CHUNK_X), 8, 4) == expected
    decoded = torch.tensor([0.0, -3.5, 0.0, 1.5, 0.0, 1.5, 0.0, -3.5])
    assert torch.equal(library_roundtrip(name, CHUNK_X, 8, 0.5), decoded)
    assert torch.equal(q.roundtrip(name, torch.tensor(CHUNK_X), 8, 0.5), decoded)


def test_topk_by_hand():
    """keep 1/4 of 8: k = 2, the values 5 and -7 in position order, then the bitmap (1 byte,
    bits 1 and 6: 0x42) since it is smaller than two 2-byte indices."""
    x = [0.0, 5.0, 0.0, -1.0, 0.0, 0.0, -7.0, 0.0]
    assert library_bytes("topk", x, keep=0.25) == struct.pack("<ff", 5.0, -7.0) + b"\x42"
    decoded = torch.tensor([0.0, 5.0, 0.0, 0.0, 0.0, 0.0, -7.0, 0.0])
    assert torch.equal(q.roundtrip("topk", torch.tensor(x), keep=0.25), decoded)


@pytest.mark.parametrize("keep,c,k", [(0.1, 30, 3), (0.125, 64, 8), (1 / 64, 4096, 64),
                                      (0.3, 10, 3), (0.0001, 64, 1)])
def test_kept_counts_from_the_decimal_form(keep, c, k):
    """k = ceil(keep · c) from keep's decimal form (0.1 · 30 is 3.0000000000000004 in
    floating point): the quantiser's count, and the library's chunk bytes of that count."""
    assert q.kept(keep, c) == k
    codec = get_codec("topk_2bit", c, keep=keep)
    assert codec.k == k


# --------------------------------------------------------------------------- random rows
SCALED_CASES = [(n, b) for n in q.SCALED for b in (32, 64)] + [("int2", 4), ("fp4_e2m1", 2)]


@pytest.mark.parametrize("name,block", SCALED_CASES)
def test_scaled_bytes_and_round_trips_of_random_rows(name, block):
    x = varied(40 * block + 3, block)  # a partial last block, zero-padded
    row = torch.nn.functional.pad(x, (0, q.padded(name, x.numel(), block) - x.numel()))
    assert library_bytes(name, x.tolist(), block) == q.scaled_bytes(name, row, block)
    assert torch.equal(library_roundtrip(name, x, block), q.roundtrip(name, x, block))


@pytest.mark.parametrize("name,block,keep", [
    ("topk_2bit", 64, 0.25), ("topk_2bit", 4096, None), ("topk_2bit_packed", 64, 0.25),
    ("topk_2bit_packed", 32, 0.5), ("topk_2bit", 16, 1.0)])
def test_chunked_topk_bytes_and_round_trips_of_random_rows(name, block, keep):
    """Whole chunks of distinct nonzero magnitudes: which of several equal magnitudes at the
    k-th place a chunk keeps is not part of the format (see the test below)."""
    x = varied(5 * block, block)
    x[x == 0] = 1e-7
    b, k = q.defaults(name, block, keep)
    row = torch.nn.functional.pad(x, (0, q.padded(name, x.numel(), b) - x.numel()))
    assert library_bytes(name, x.tolist(), block, keep) == q.chunk_topk_bytes(
        name, row, b, q.kept(k, b))
    assert torch.equal(library_roundtrip(name, x, block, keep), q.roundtrip(name, x, block, keep))


@pytest.mark.parametrize("name,block,keep", [
    ("fp4_e3m0", None, None), ("int8", 64, None), ("int2", None, None), ("topk", None, 0.25),
    ("bf16", None, None), ("fp8_e4m3", 32, None)])
@pytest.mark.parametrize("rows", [2, 3])
def test_the_all_reduce_rows_round_trip_alike(name, block, keep, rows):
    """The all-reduce's layout: M rows of padded(ceil(n / M)) values, each encoded on its
    own (``topk`` keeps k of each row, not of the whole vector)."""
    x = varied(1000, rows)
    codec = get_codec(name, block, keep=keep)
    chunk = codec.padded(math.ceil(x.numel() / rows))
    padded = torch.nn.functional.pad(x, (0, chunk * rows - x.numel())).view(rows, chunk)
    lib = codec.decode_rows(codec.encode_rows(padded), chunk).view(-1)[:x.numel()]
    assert torch.equal(lib, q.roundtrip(name, x, block, keep, rows))


def test_a_tie_at_the_kth_magnitude_keeps_k_of_the_tied_values():
    """Which of equal magnitudes a chunk keeps is torch.topk's choice, not a documented
    rule (ChunkTopKCodec's docstring): k of them are kept, each decoded as itself."""
    x = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    out = library_roundtrip("topk_2bit", x, 8, 0.5)
    kept = out != 0
    assert int(kept.sum()) == 4 and torch.equal(out[kept], x[kept])
