"""Wire codecs: exact sizes, error bounds derived from each format, the bit layout, ties,
idempotence, and the edge cases (zeros, huge, tiny, non-finite). The dropping codecs (topk,
dare, random_drop) share the API tests here; their own properties are in
test_sparse_codecs.py."""

import hashlib
import json
import math
import os
import random
import struct
from pathlib import Path

import pytest
import torch

from loco.comm.codecs import fp4, int2, scaled
from loco.comm.codecs import get_codec
from loco.comm.codecs.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, SPARSE_CODEC_NAMES,
                                      chunk_topk_bytes)

pytestmark = pytest.mark.numerics

SCALED = ("fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1")
DROPPING = SPARSE_CODEC_NAMES + CHUNK_TOPK_CODEC_NAMES
DENSE = tuple(n for n in CODEC_NAMES if n not in DROPPING)  # every value sent
# re-encoding a decoded row gives it back: not so for the random draws of dare/random_drop,
# nor for int2, which clips (a decoded block's largest value is re-scaled and clipped again),
# nor for topk_2bit when a chunk has fewer than k non-zeros (the kept zeros pull the low
# magnitude down on the second pass)
IDEMPOTENT = tuple(n for n in DENSE if n != "int2") + ("topk",)
BITS = {"fp32": 32, "bf16": 16, "fp8_e4m3": 8, "int8": 8, "fp4_e3m0": 4, "fp4_e2m1": 4,
        "int2": 2}
FMT_MAX = {"fp8_e4m3": 448.0, "int8": 127.0, "fp4_e3m0": 16.0, "fp4_e2m1": 6.0}
GRID = {"fp4_e3m0": (0, 0.25, 0.5, 1, 2, 4, 8, 16), "fp4_e2m1": (0, 0.5, 1, 1.5, 2, 3, 4, 6)}
F32_MAX = torch.finfo(torch.float32).max
B = 32


@pytest.fixture(params=[False, True], ids=["denormals", "flush_denormal"])
def flush(request):
    """Run with and without flushing denormals: training turns flushing on."""
    torch.set_flush_denormal(request.param)
    yield request.param
    torch.set_flush_denormal(False)


def expected_nbytes(name, numel, block=B):
    """The bytes docs/codecs.md gives; the dropping codecs at their default keep of 1/8."""
    if name == "topk":  # 8-aligned; k = c/8 fp32 values, and a bitmap (c/8 <= 2k indices)
        c = math.ceil(numel / 8) * 8
        return 4 * math.ceil(c / 8) + c // 8
    if name in SPARSE_CODEC_NAMES:  # k fp32 values and an 8-byte seed
        return 4 * math.ceil(numel / 8) + 8 if numel else 0
    if name in CHUNK_TOPK_CODEC_NAMES:  # 64 of each chunk of 4096, by default
        return math.ceil(numel / 4096) * chunk_topk_bytes(name, 4096, 64)
    if name in ("fp32", "bf16"):
        return numel * BITS[name] // 8
    n = math.ceil(numel / block) * block
    return n * BITS[name] // 8 + n // block


def normal(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def wide(n, seed=0):
    """Normal values times 10^U(-6, 6): blocks spanning twelve decades."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 12 - 6)


def round_trip(codec, x):
    return codec.decode(codec.encode(x), x.shape)


def check_scaled(name, x, allow_zero=False):
    """Decode x (1-D, a whole number of blocks) and check it against the format's guarantees,
    using the block scales read from the wire. Returns the decoded values."""
    codec = get_codec(name, block=B)
    buf = codec.encode(x)
    d = codec.decode(buf, x.shape).double()
    e = buf[-(x.numel() // B):].long() - 127
    x64 = x.double().view(-1, B)
    amax = x64.abs().amax(dim=1)
    # the scale rule: absmax / 2^e in (fmt_max / 2, fmt_max], unless e hit its floor
    ratio = amax / torch.exp2(e.double())
    fmax = FMT_MAX[name]
    assert (ratio <= fmax).all()
    assert ((ratio > fmax / 2) | (e == -126)).all()
    assert (e[amax == 0] == -126).all()
    s = torch.exp2(e.double()).repeat_interleave(B).view_as(d)
    ax, err = x.double().abs(), (d - x.double()).abs()
    # per element: half a grid step at that magnitude, in units of the block's scale
    if name == "int8":
        bound = s / 2
        unclamped = e > -126  # a floored scale is larger than the rule wants
        assert (err.view(-1, B)[unclamped] <= amax[unclamped, None] / 127).all()
    elif name == "fp8_e4m3":
        bound = torch.maximum(ax * 2**-4, s * 2**-10)  # 3 mantissa bits; subnormal step 2^-9
    elif name == "fp4_e2m1":
        bound = torch.maximum(ax / 4, s / 4)
    else:  # E3M0: between g and 2g the worst point is 1.5g; below 0.25 the gap to 0 is 0.25
        bound = torch.maximum(ax / 3, s / 8)
        assert (d[ax < s / 8] == 0).all()
        assert (err[ax >= s / 4] <= ax[ax >= s / 4] / 3).all()
    ok = err <= bound
    if allow_zero:  # flushed denormals may decode to 0
        ok |= d == 0
    assert ok.all(), (name, x[~ok][:5], d[~ok][:5])
    assert torch.isfinite(d).all()
    # decoded values divided by their scale lie on the format's grid (fp32 max: clamped inf)
    q = (d / s)[d.abs() < F32_MAX]
    if name in GRID:
        grid = torch.tensor(GRID[name], dtype=torch.float64)
        assert torch.isin(q.abs(), grid).all()
    elif name == "int8":
        assert torch.equal(q, q.round()) and (q.abs() <= 127).all()
    else:
        assert torch.equal(q, q.float().to(torch.float8_e4m3fn).double())
    # the block's largest element is never clipped away: it keeps at least half its size
    top = x64.abs().argmax(dim=1)
    dtop = d.view(-1, B).gather(1, top[:, None]).squeeze(1).abs()
    assert ((dtop >= amax / 2) | (allow_zero & (dtop == 0))).all()
    return d.float()


# --------------------------------------------------------------------------- sizes and API
CASES = [((), torch.float32), ((0,), torch.float32), ((1001,), torch.float32),
         ((3, 5, 7), torch.bfloat16), ((4, 0, 2), torch.float16), ((33, 9), torch.float64)]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_encode_size_and_decode_shape(name, shape, dtype, contiguous):
    codec = get_codec(name)
    x = normal(math.prod(shape) * 2).to(dtype)
    x = x[::2] if not contiguous else x[: math.prod(shape)]
    x = x.reshape(shape)
    assert x.is_contiguous() == contiguous or x.numel() <= 1
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() == codec.encoded_nbytes(x.numel()) == expected_nbytes(name, x.numel())
    out = codec.decode(buf, x.shape, dtype)
    assert out.shape == x.shape and out.dtype == dtype
    if name == "fp32":
        assert torch.equal(out, x)


@pytest.mark.parametrize("name", DENSE)
def test_attributes_and_row_bytes(name):
    for block in (4, 16, 32, 64) if name == "int2" else (2, 16, 32, 64):
        codec = get_codec(name, block=block)
        scaled = name in SCALED + ("int2",)
        assert codec.name == name and codec.bits == BITS[name]
        assert codec.block == (block if scaled else None)
        assert codec.align == (block if scaled else 1)
        assert codec.padded(1) == codec.align and codec.padded(0) == 0
        assert codec.padded(5 * codec.align) == 5 * codec.align
        assert codec.row_bytes(4 * codec.align) == expected_nbytes(name, 4 * codec.align, block)
        assert repr(codec) == (f"Codec({name}, block={block})" if scaled else f"Codec({name})")
    assert get_codec(name).encode(normal(1000)).numel() * 8 / 1000 >= BITS[name]


def test_fp4_costs_4_25_bits_per_value_at_block_32():
    assert get_codec("fp4_e3m0").row_bytes(3200) * 8 / 3200 == 4.25


# ------------------------------------------------------------------------- error bounds
def test_fp32_exact_and_bf16_rounds_to_nearest(flush):
    x = torch.cat([normal(4096), wide(4096)])
    assert torch.equal(round_trip(get_codec("fp32"), x), x)
    d = round_trip(get_codec("bf16"), x)
    assert torch.equal(d, x.to(torch.bfloat16).float())
    assert ((d - x).abs() <= x.abs() * 2**-8).all()


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("data", [normal, wide])
def test_scaled_error_bounds(name, data, flush):
    for seed in range(3):
        check_scaled(name, data(64 * B, seed))


# measured on 1M standard normal values at block 32: 0.0266, 0.0083, 0.194, 0.115, bf16 0.0017
# (the test uses 16K values: below torch's grain size ops stay on one thread, fast on any box)
# int2: 0.357 (a relative squared error of 0.127: the clipping scale, see Int2Codec)
L2_BOUND = {"fp32": 0.0, "bf16": 0.0025, "fp8_e4m3": 0.032, "int8": 0.010,
            "fp4_e3m0": 0.22, "fp4_e2m1": 0.13, "int2": 0.37}


@pytest.mark.parametrize("name", DENSE)
def test_relative_l2_error_on_normal_data(name):
    x = normal(1 << 14)
    rel = ((round_trip(get_codec(name), x) - x).norm() / x.norm()).item()
    assert rel <= L2_BOUND[name]
    if name != "fp32":  # the bound is not vacuous: the codec really is lossy at this level
        assert rel > L2_BOUND[name] / 2


# --------------------------------------------------------------------------- bit layout
def test_fp4_e3m0_bytes_by_hand():
    vals = [16, -1, 0, 0.25, -0.0, 0.1, 0.125, 0.375, -12, 3, 5, -6, -0.01, 0.75, 1.5, -0.2]
    x = torch.tensor(vals + [0.0] * 16)
    codes = [0x7, 0xB, 0, 0x1, 0, 0, 0, 0x2, 0xE, 0x4, 0x5, 0xE, 0, 0x2, 0x4, 0x9]
    # low nibble = even element; ties (0.125, 0.375, 12, 3, 6, 0.75, 1.5) go to even codes;
    # -0.0 and -0.01 (rounds to 0) get no sign bit; absmax 16 needs e = 0 -> byte 127
    expect = [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2])] + [0] * 8 + [127]
    codec = get_codec("fp4_e3m0")
    assert codec.encode(x).tolist() == expect
    assert expect[:8] == [0xB7, 0x10, 0x00, 0x20, 0x4E, 0xE5, 0x20, 0x94]
    # the same values scaled by 2^-10 only change the scale byte
    assert codec.encode(x * 2**-10).tolist() == expect[:-1] + [117]
    # the ceil rule: 9 fits with e = 0 (and rounds to 8), 17 needs e = 1 (8.5 -> 8)
    one = torch.zeros(B)
    assert codec.encode(one.index_fill(0, torch.tensor([0]), 9.0)).tolist()[::16] == [6, 127]
    assert codec.encode(one.index_fill(0, torch.tensor([0]), 17.0)).tolist()[::16] == [6, 128]
    decoded = codec.decode(torch.tensor(expect, dtype=torch.uint8), x.shape)
    assert decoded[:16].tolist() == [16, -1, 0, 0.25, 0, 0, 0, 0.5, -8, 2, 4, -8, 0, 0.5, 2,
                                     -0.25]


def test_fp4_e2m1_ties_go_to_even_codes():
    x = torch.tensor([6, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -5] + [0.0] * 24)
    buf = get_codec("fp4_e2m1").encode(x).tolist()
    assert buf == [0x07, 0x22, 0x44, 0xE6] + [0] * 12 + [127]


def test_int8_rounds_half_to_even():
    x = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -127] + [0.0] * 25)
    d = round_trip(get_codec("int8"), x)
    assert d[:7].tolist() == [127, 0, 2, 2, 0, -2, -127]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_rows_are_independent(name):
    codec = get_codec(name)
    w = max(4 * B, codec.align)
    x = torch.stack([normal(w, 1), 1e-20 * normal(w, 2), 1e20 * normal(w, 3)])
    enc = codec.encode_rows(x)
    assert enc.shape == (3, codec.row_bytes(w)) and enc.is_contiguous()
    assert torch.equal(enc, torch.cat([codec.encode_rows(x[i : i + 1]) for i in range(3)]))
    dec = codec.decode_rows(enc, w)
    assert torch.equal(dec, torch.cat([codec.decode_rows(enc[i : i + 1], w)
                                       for i in range(3)]))
    # the flat API is the one-row case
    assert torch.equal(codec.encode(x[1]), enc[1])


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_fp32_encode_does_not_alias_input(name):
    x = normal(max(B, get_codec(name).align))
    buf = get_codec(name).encode_rows(x.view(1, -1))
    before = buf.clone()
    x.add_(1.0)
    assert torch.equal(buf, before)


# --------------------------------------------------------------------------- idempotence
@pytest.mark.parametrize("name", IDEMPOTENT)
def test_requantizing_is_lossless(name, flush):
    """A decoded block may come back with a scale one step smaller (its absmax rounded down
    to fmt_max / 2), but every grid value times 2 is still on the grid, so values survive."""
    codec = get_codec(name)
    huge = torch.tensor([F32_MAX, -3.3e38, 1e38, 2e37] * (B // 4))
    for x in (normal(64 * B), wide(64 * B), huge, 1e-37 * normal(4 * B)):
        once = round_trip(codec, x)
        assert torch.equal(round_trip(codec, once), once)


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_all_zeros(name):
    codec = get_codec(name)
    buf = codec.encode(torch.zeros(3 * B))
    assert torch.equal(codec.decode(buf, (3 * B,)), torch.zeros(3 * B))
    if name in SCALED:
        assert buf[-3:].tolist() == [1, 1, 1]  # e = -126
    if name == "int2":
        assert buf[-3:].tolist() == [0, 0, 0]  # the zero block's own scale byte


@pytest.mark.parametrize("name", SCALED)
def test_zero_block_next_to_huge_block(name, flush):
    x = torch.cat([torch.zeros(B), 3e38 * normal(B).clamp(-1, 1), torch.zeros(B)])
    d = check_scaled(name, x)
    assert torch.equal(d[:B], torch.zeros(B)) and torch.equal(d[2 * B :], torch.zeros(B))


@pytest.mark.parametrize("name", DENSE)
def test_huge_values_stay_finite(name, flush):
    x = torch.tensor([1e38, -1e38, 3.3e38, -3.3e38, F32_MAX, -F32_MAX, 2e38, 0.0] * (B // 8))
    d = round_trip(get_codec(name), x)
    if name == "bf16":  # a plain cast: bf16's range ends at 3.39e38, just short of fp32's
        big = x.abs() > torch.finfo(torch.bfloat16).max
        assert torch.equal(d[big], x[big].sign() * math.inf)
        d, x = d[~big], x[~big]
    assert torch.isfinite(d).all()
    # int2 clips: |y| up to 3 decodes as 1.5 (half its size), and 0 as the nearest level
    assert ((d - x).abs() <= (x.abs() / 2 + (x == 0) * 1e38 if name == "int2"
                              else x.abs() / 3)).all()
    if name in SCALED:
        check_scaled(name, x)


@pytest.mark.parametrize("name", SCALED)
def test_tiny_values_are_accurate_or_zero(name, flush):
    for mag in (1e-30, 1e-38, 1e-44):
        x = mag * normal(4 * B).clamp(-1, 1)
        d = check_scaled(name, x, allow_zero=True)
        assert torch.isfinite(d).all()
    # 1e-30 is a normal float: it must survive, flush or not
    assert (round_trip(get_codec(name), torch.full((B,), 1e-30)) != 0).all()


@pytest.mark.parametrize("name", SCALED)
def test_single_nonzero_element(name):
    x = torch.zeros(2 * B)
    x[B + 5] = -3.7
    d = check_scaled(name, x)
    assert torch.equal(d.nonzero().view(-1), torch.tensor([B + 5]))
    assert d[B + 5] < 0


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite(name, bad):
    x = normal(3 * B)
    x[40] = bad
    codec = get_codec(name)
    if name in SCALED + ("int2",):  # the block is marked (scale byte 0xFF) and decodes as NaN
        buf = codec.encode(x)  # never raises: a worker must not fail alone in a collective
        assert buf.numel() == expected_nbytes(name, x.numel())  # not one byte more
        clean = x.clone()
        clean[B:2 * B] = 0  # the other blocks are encoded exactly as without the bad value
        assert torch.equal(buf[-3:], torch.cat([codec.encode(clean)[-3:-2],
                                                torch.tensor([255], dtype=torch.uint8),
                                                codec.encode(clean)[-1:]]))
        d = codec.decode(buf, x.shape)
        assert d[B:2 * B].isnan().all()
        assert torch.equal(torch.cat([d[:B], d[2 * B:]]),
                           torch.cat([round_trip(codec, x[:B]), round_trip(codec, x[2 * B:])]))
        rows = codec.encode_rows(x.view(3, B))  # row by row, the same
        assert torch.equal(rows[1], codec.encode(torch.full((B,), bad)))
        assert torch.equal(codec.decode_rows(rows, B).isnan().any(dim=1),
                           torch.tensor([False, True, False]))
    else:  # fp32 and bf16 pass NaN and Inf through, as an uncompressed all-reduce would
        d = round_trip(codec, x)
        assert torch.equal(d.isnan(), x.isnan()) and torch.equal(d.isinf(), x.isinf())
        assert d[40] == bad or (math.isnan(bad) and d[40].isnan())


# --------------------------------------------------------------------------- get_codec
def test_get_codec_rejects_unknown_names():
    with pytest.raises(ValueError, match="'fp5'") as err:
        get_codec("fp5")
    assert all(n in str(err.value) for n in CODEC_NAMES)


@pytest.mark.parametrize("name,block", [("fp4_e3m0", 0), ("int8", 1), ("fp4_e3m0", 3),
                                        ("fp4_e2m1", 33), ("fp8_e4m3", 2.0), ("int8", "32"),
                                        ("int8", True), ("fp4_e3m0", 65538), ("int8", -32)])
def test_get_codec_rejects_bad_blocks(name, block):
    with pytest.raises(ValueError, match=r"block must be an int in \[2, 65536\]"):
        get_codec(name, block=block)


def test_get_codec_block_edge_cases():
    assert get_codec("int8", block=3).row_bytes(9) == 12  # odd blocks are fine at 8 bits
    assert get_codec("fp4_e3m0", block=65536).align == 65536
    assert get_codec("fp32", block=3).block is None  # ignored without scales
    assert get_codec("bf16", block=0).align == 1


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_device_probe(name):
    assert get_codec(name, device="cpu").name == name
    assert get_codec(name, device=torch.device("cpu")).name == name


def test_device_probe_fails_loudly(monkeypatch):
    """A device that cannot run a format fails at construction, never falling back."""

    def unsupported(self, y):
        raise TypeError("float8 unsupported here")

    monkeypatch.setattr(scaled.Fp8Codec, "_quantize", unsupported)
    with pytest.raises(RuntimeError, match="codec fp8_e4m3 cannot run on cpu: float8 unsup"):
        get_codec("fp8_e4m3", device="cpu")
    get_codec("fp8_e4m3")  # without a device nothing runs
    # a device that runs but computes garbage is caught too
    monkeypatch.setattr(scaled.Int8Codec, "_dequantize", lambda self, q, c: 0 * q.float())
    with pytest.raises(RuntimeError, match="codec int8 cannot run on cpu: round trip"):
        get_codec("int8", device="cpu")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_a_slice_at_an_odd_byte_offset(name):
    """Several encoded tensors may share one message; decoding a slice of it must work."""
    codec = get_codec(name)
    x = torch.randn(70)
    message = torch.cat([torch.zeros(3, dtype=torch.uint8), codec.encode(x)])
    assert torch.equal(codec.decode(message[3:], x.shape), codec.decode(codec.encode(x), x.shape))


# ------------------------------------------------------------------ the wire, pinned
WIRE_FIXTURE = Path(__file__).parent / "fixtures" / "codec_wire.json"
REGENERATE_WIRE = os.environ.get("LOCO_REGENERATE_GOLDEN") == "1"
WIRE_C = 16 * B  # values per row
PINNED = (*SCALED, "int2")  # the casts' NaN bits differ between CPU capabilities (bf16)


def _f32(words):
    """fp32 tensor of the given bit patterns (NaN payloads kept)."""
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _words(values):
    return [struct.unpack("<i", struct.pack("<f", v))[0] for v in values]


def wire_rows(name):
    """Rows of WIRE_C values covering every case of the format, built from Python's random
    and exact arithmetic only (no torch RNG, no libm), so they are the same bits on every
    machine and CPU capability: normal and twelve-decade data, random bit patterns (all,
    then finite only), NaN and infinity payloads, huge and zero blocks, -0, block maxima at
    fmt_max * 2^k and one ulp above, denormals, and every midpoint of the grid as a tie."""
    rng = random.Random(name)
    fmax = FMT_MAX.get(name, 3.0)
    normal_ = [rng.gauss(0, 1) for _ in range(WIRE_C)]
    rows = [_f32(_words(normal_)),
            _f32(_words([v * 10 ** rng.uniform(-6, 6) for v in normal_])),
            _f32([rng.getrandbits(32) - 2**31 for _ in range(WIRE_C)])]
    finite = rows[-1].clone()
    finite[~torch.isfinite(finite)] = -0.0
    nonfinite = rows[0].clone()
    nonfinite[[3, 40, 77, 200, 201, 300, 301, 302, 450]] = _f32(
        [0x7FC00000, 0x7F800000, -0x800000, -0x400000, 0x7FC00001, 0x7F800001, -1,
         0x7FFFFFFF, 0x7F800000])
    huge = [F32_MAX, -3.3e38, 1e38, 2e37, -F32_MAX, 3.39e38, 2e38, 0.0]
    zero_huge = [0.0] * B + [3e38 * rng.uniform(-1, 1) for _ in range(B)] + [-0.0] * B
    zero_huge += [0.0] * (B - 1) + [-1e-3] + [rng.choice([0.0, 1.0, -0.0]) for _ in range(B)]
    boundary = []
    for _ in range(WIRE_C // 2):
        k = rng.randint(-150, 127)
        w = _words([min(fmax * 2.0 ** k, F32_MAX)])[0]
        boundary += [w, w + rng.choice([0, 1, -1])]
    tiny = [rng.gauss(0, 1) * 10.0 ** rng.choice([-30, -37, -38, -40, -44, -45])
            for _ in range(WIRE_C - 4)] + [1e-45, -1e-45, 2**-126, -2**-149]
    grid = sorted(set(GRID.get(name, ())) | {0.5, 1.0, 1.5, 0.25, 0.75, 2.0, 2.5, 127.0})
    if name == "fp8_e4m3":
        grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    ties = [v for m in mids + grid for v in (m, -m)]
    ties = [x for i in range(0, len(ties), B - 1) for x in [fmax] + ties[i:i + B - 1]]
    # blocks of denormals only, of zeros and denormals, of -0 and a denormal (zero blocks
    # where denormals are flushed), and a denormal amid normal values
    subnormal = [0x1, -0x7FFFFFFF, 0x7FFFFF, 0x400000, -0x80000000, 0]
    denormal_blocks = ([rng.choice(subnormal[:4]) for _ in range(B)]
                       + [rng.choice(subnormal) for _ in range(2 * B)]
                       + [-0x80000000] * (B - 1) + [0x3]
                       + [rng.getrandbits(23) | rng.choice([0, 1 << 31]) for _ in range(B)])
    denormal_blocks += _words([rng.gauss(0, 1e-38) for _ in range(WIRE_C - len(denormal_blocks))])
    rows += [finite, nonfinite, _f32(denormal_blocks), _f32(_words(huge * (WIRE_C // 8))), _f32(_words(
        zero_huge + [0.0] * (WIRE_C - len(zero_huge)))), _f32(boundary), _f32(_words(tiny)),
             _f32(_words((ties * WIRE_C)[:WIRE_C])), torch.zeros(WIRE_C)]
    return torch.stack(rows)


def wire_digests(name):
    """sha256 of the encoded bytes of wire_rows, of their decoded fp32 bits, and of the
    decoded bits of random bytes (every scale byte, 0 and 255 included; then under scale
    bytes in [20, 219])."""
    codec = get_codec(name, B, kernel="eager")
    x = wire_rows(name)
    buf = codec.encode_rows(x)
    rng = random.Random(name + "junk")
    junk = torch.tensor([rng.getrandbits(8) for _ in range(buf.numel())],
                        dtype=torch.uint8).view(buf.shape)
    junk[:2, -(WIRE_C // B):] = torch.tensor([0, 255, 1, 254, 127, 128, 200, 50] * 2)
    tame = junk.clone()  # the same value bytes (fp8's NaN codes too) under scales that
    tame[:, -(WIRE_C // B):] = junk[:, -(WIRE_C // B):] % 200 + 20  # cannot overflow
    digest = lambda t: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()
                                      ).hexdigest()[:16]
    return {"encoded": digest(buf), "decoded": digest(codec.decode_rows(buf, WIRE_C)),
            "junk_decoded": digest(codec.decode_rows(junk, WIRE_C)),
            "tame_junk_decoded": digest(codec.decode_rows(tame, WIRE_C))}


@pytest.mark.parametrize("name", PINNED)
def test_wire_bytes_and_decoded_bits_are_pinned(name, flush):
    """Every scaled format's bytes and decoded fp32 bits on wire_rows, as a fixture stored
    before any speed work: a faster encoder or decoder must give them bit for bit, with
    and without flushed denormals. LOCO_REGENERATE_GOLDEN=1 rewrites it (a deliberate
    change of the wire format)."""
    key = f"{name}/{'flush' if flush else 'denormals'}"
    got = wire_digests(name)
    stored = json.loads(WIRE_FIXTURE.read_text()) if WIRE_FIXTURE.exists() else {}
    if REGENERATE_WIRE:
        stored[key] = got
        WIRE_FIXTURE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    assert stored.get(key) == got, key


# ------------------------------------------------------------- the eager path's tables
def reference_codes(name, y):
    """The codes by the formats' definitions (compares, as the fused kernels compute them):
    FP4, how many grid midpoints |y| passes (a tie counts only for odd midpoints, so it
    goes to the even code), the sign bit only for a non-zero code; int2, |y| >= 1 and the
    sign (y < 0)."""
    a = y.abs()
    if name == "int2":
        return (a >= 1).to(torch.uint8) | (y < 0).to(torch.uint8) << 1
    grid = GRID[name]
    k = torch.zeros_like(a, dtype=torch.uint8)
    for i, m in enumerate((lo + hi) / 2 for lo, hi in zip(grid, grid[1:])):
        k += (a >= m) if i % 2 else (a > m)
    return k | ((y < 0) & (k > 0)).to(torch.uint8) << 3


@pytest.mark.parametrize("name", ["fp4_e3m0", "fp4_e2m1", "int2"])
def test_eager_code_table_equals_the_compares_for_every_key(name, flush):
    """The eager encoder's code table (one lookup on y's bits) against the compares, for
    every key of the table: each run of 2^21 bit patterns (one exponent and top two mantissa
    bits), at its start (a tie where a midpoint lies), just after it, in its middle and at
    its end, both signs, every finite fp32 (zeros and denormals included: under flushing
    too, as training runs). Tolerance: exact."""
    starts = torch.arange(1020, dtype=torch.int64) << 21  # 1020 << 21 is +inf
    words = torch.cat([starts, starts + 1, starts + (1 << 20), starts + (1 << 21) - 1])
    words = torch.cat([words, words | (1 << 31)])
    y = words.to(torch.int32).view(torch.float32)
    codec = get_codec(name, B, kernel="eager")
    got = codec._codes(y.clone().view(1, -1))
    assert torch.equal(got, reference_codes(name, y)), name


@pytest.mark.parametrize("name", PINNED)
@pytest.mark.parametrize("piece", [B, 3 * B, 1000, 1 << 30])
def test_eager_pieces_give_the_same_bits(name, piece, monkeypatch):
    """The eager path encodes and decodes in pieces of whole blocks (EAGER_PIECE values):
    any piece size, one block, blocks not dividing the row, the whole tensor, gives the
    same bytes and values, into ``out`` too. Tolerance: exact."""
    x = wire_rows(name)
    codec = get_codec(name, B, kernel="eager")
    buf, values = codec.encode_rows(x), codec.decode_rows(codec.encode_rows(x), WIRE_C)
    monkeypatch.setattr(scaled, "EAGER_PIECE", piece)
    assert torch.equal(codec.encode_rows(x), buf)
    out = torch.full_like(buf, 7)
    assert codec.encode_rows(x, out=out).data_ptr() == out.data_ptr() and torch.equal(out, buf)
    decoded = torch.full(x.shape, 7.0)
    codec.decode_rows(buf, WIRE_C, out=decoded)
    assert torch.equal(decoded.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize("name", ["fp4_e3m0", "fp4_e2m1", "int2"])
def test_the_compares_give_the_tables_bytes(name, flush, monkeypatch):
    """The compares and strided packing (what the fused kernels compile, and eager runs on
    a big-endian CPU) against the tables, on wire_rows. Tolerance: exact."""
    x = wire_rows(name)
    codec = get_codec(name, B, kernel="eager")
    want = codec.encode_rows(x)
    monkeypatch.setattr(int2 if name == "int2" else fp4, "LITTLE_ENDIAN", False)
    assert torch.equal(codec.encode_rows(x), want)


@pytest.mark.parametrize("old, new, name", [
    ("loco.comm.codec", "loco.comm.codecs.contract", "Codec"),
    ("loco.comm.formats", "loco.comm.codecs.formats", "CODEC_NAMES"),
    ("loco.comm.sparse", "loco.comm.codecs.dropping", "TopKCodec"),
    ("loco.comm.chunked", "loco.comm.codecs.chunk_topk", "ChunkTopKCodec"),
    ("loco.comm.tiles", "loco.comm.codecs.tiles", "TiledTopK"),
    ("loco.comm.bits", "loco.comm.codecs.bitpack", "pack"),
    ("loco.comm.kernels", "loco.comm.codecs.fused", "FUSED_MIN_NUMEL"),
    ("loco.comm.cpu_kernels", "loco.comm.codecs.cpp_kernel", "encode_into"),
    ("loco.comm.counters", "loco.comm.accounting", "CommStats"),
    ("loco.comm.elastic", "loco.comm.membership", "ElasticComm"),
])
def test_a_moved_modules_old_path_imports_for_one_release_with_a_warning(old, new, name):
    """``from loco.comm.codec import Codec`` and the other old paths of the modules that moved
    (the codecs into ``loco.comm.codecs``) still give the new modules' objects, and say where
    they are now; a name the new module lacks is an ImportError, as before."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(ImportError):
        exec(f"from {old} import no_such_name", {})
