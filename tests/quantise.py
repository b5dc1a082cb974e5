"""A small quantiser for the tests, written from the formats' maths (docs/codecs.md and
docs/algorithms/sparseloco.md) and not from loco's code: it imports nothing from loco. The
shared references (``workers.reference_streaming``) take their round trips D(C(x)) from it,
and ``tests/test_quantise.py`` pins the library's bytes and round trips to it, so that a
wrong codec cannot pass by agreeing with itself.

It is written for clarity, not speed: plain element-wise rules (the smallest scale that
fits, the nearest grid value, the k largest magnitudes), and Python integers for the bit
packing. Only the codecs' values matter to the references; the bytes are for the pins.

What it covers: ``fp32``, ``bf16`` (torch's own casts), the scaled formats (``fp8_e4m3``
through torch's float8 cast, ``int8``, ``fp4_e3m0``, ``fp4_e2m1``, ``int2``), ``topk``,
and SparseLoCo's chunked 2-bit top-k (``topk_2bit``, ``topk_2bit_packed``) with its
Elias-Fano or packed positions. Not ``dare`` and ``random_drop``: their positions are a
keyed hash of the row's bits, which a second copy here could only repeat, not check."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

F32_MAX = torch.finfo(torch.float32).max
NONFINITE_SCALE = 0xFF  # E8M0's NaN: the scale byte of a block that held a NaN or an Inf

GRIDS = {"fp4_e3m0": (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),  # sign + 3 exponent bits
         "fp4_e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)}    # OCP FP4
FMT_MAX = {"fp8_e4m3": 448.0, "int8": 127.0, "fp4_e3m0": 16.0, "fp4_e2m1": 6.0, "int2": 3.0}
SCALED = tuple(FMT_MAX)
VALUE_BITS = {"fp8_e4m3": 8, "int8": 8, "fp4_e3m0": 4, "fp4_e2m1": 4, "int2": 2}
CHUNKED = ("topk_2bit", "topk_2bit_packed")  # all-gathered, not reduced on the way
NAMES = ("fp32", "bf16", *SCALED, "topk", *CHUNKED)
"""The codecs this module round-trips."""


def defaults(name: str, block: int | None, keep: float | None) -> tuple[int, float]:
    """(block, keep) as the command line's defaults fill them: block 32 (scaled) or 4096
    (chunked); keep 1/8 (``topk``) or 1/64 (chunked)."""
    block = block or (4096 if name in CHUNKED else 32)
    keep = keep or (1 / 64 if name in CHUNKED else 1 / 8)
    return block, keep


def align(name: str, block: int | None = None) -> int:
    """Values per row must be a multiple of this: whole blocks (scaled, chunked), whole
    bitmap bytes (``topk``: 8), anything (the casts)."""
    if name in SCALED or name in CHUNKED:
        return defaults(name, block, None)[0]
    return 8 if name == "topk" else 1


def padded(name: str, n: int, block: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    a = align(name, block)
    return -(-n // a) * a


def kept(keep: float, c: int) -> int:
    """k = ceil(keep · c) from keep's shortest decimal form (0.1 of 30 is 3, not 4), at
    least 1 for c >= 1."""
    return max(1, math.ceil(Fraction(repr(float(keep))) * c)) if c else 0


# --------------------------------------------------------------------------- scaled formats
def scale_exponents(blocks: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Each block's e: the smallest integer with max|x| <= fmt_max · 2^e (nothing clips
    but int2, whose fmt_max 3 sits above its top level 1.5), clamped to [-126, 127]; -126
    for a block of zeros. ``blocks``: float64 (nb, block), finite."""
    amax = blocks.abs().amax(dim=1)
    _, E = torch.frexp(amax)  # amax = m · 2^E, m in [0.5, 1): the answer is E - F + {-1, 0, 1}
    _, F = math.frexp(fmt_max)
    e = E.to(torch.int64) - F - 1
    for _ in range(3):  # step up while fmt_max · 2^e is still below amax
        e = torch.where(amax > torch.ldexp(torch.full_like(amax, fmt_max), e), e + 1, e)
    return torch.where(amax == 0, -126, e).clamp(-126, 127)


def nearest(y: torch.Tensor, grid) -> torch.Tensor:
    """The index into ``grid`` (ascending magnitudes) of the grid value nearest |y|; on a
    tie, the even index (the code whose last bit is 0)."""
    g = torch.tensor(grid, dtype=torch.float64)
    dist = (y.abs().unsqueeze(-1) - g).abs()
    k = dist.argmin(dim=-1)  # the lower index of a tie
    above = (k + 1).clamp(max=len(grid) - 1)
    tie = (dist.gather(-1, above.unsqueeze(-1)).squeeze(-1) == dist.min(dim=-1).values) & (
        above != k)
    return torch.where(tie & (k % 2 == 1), above, k)


def round_half_even(y: torch.Tensor) -> torch.Tensor:
    """y rounded to the nearest integer, ties to the even one (float64 in, exact)."""
    r = torch.floor(y)
    frac = y - r
    up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(r, 2) == 1))
    return r + up.to(y.dtype)


def scaled_codes(name: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as int64, decoded values as float64) of the scaled values ``y`` (|y| <=
    fmt_max): the formats' own rounding."""
    if name in GRIDS:
        k = nearest(y, GRIDS[name])
        negative = (y < 0) & (k > 0)  # zero is never negative
        values = torch.tensor(GRIDS[name], dtype=torch.float64)[k]
        return k | negative.to(torch.int64) << 3, torch.where(negative, -values, values)
    if name == "int8":
        q = round_half_even(y)
        return q.to(torch.int64) & 0xFF, q
    if name == "int2":  # levels ±0.5, ±1.5: |y| < 1 is 0.5; a zero has no sign
        big, negative = y.abs() >= 1, y < 0
        values = torch.where(big, 1.5, 0.5).to(torch.float64)
        return big.to(torch.int64) | negative.to(torch.int64) << 1, torch.where(
            negative, -values, values)
    f8 = y.to(torch.float32).to(torch.float8_e4m3fn)  # torch's cast: nearest, ties to even
    return f8.view(torch.uint8).to(torch.int64), f8.to(torch.float64)


def scaled(name: str, x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(codes, scale bytes, decoded fp32) of the 1-D ``x`` (a multiple of ``block`` values):
    per block e from ``scale_exponents``, y = x / 2^e (exact), rounded by the format,
    decoded as q · 2^e clamped to ±fp32 max. A block that holds a NaN or an Inf is sent as
    zeros under scale byte 0xFF and decodes as NaN; int2 sends a block of zeros under byte 0
    (decoded: zeros)."""
    xb = x.double().view(-1, block)
    bad = ~torch.isfinite(xb).all(dim=1)
    xb = torch.where(bad.unsqueeze(1), 0.0, xb)
    e = scale_exponents(xb, FMT_MAX[name])
    codes, q = scaled_codes(name, torch.ldexp(xb, -e.unsqueeze(1)))
    out = torch.ldexp(q, e.unsqueeze(1)).clamp(-F32_MAX, F32_MAX)
    scale = e + 127
    if name == "int2":
        zero = xb.abs().amax(dim=1) == 0
        scale = torch.where(zero, 0, scale)
        out = torch.where(zero.unsqueeze(1), 0.0, out)
    scale = torch.where(bad, NONFINITE_SCALE, scale)
    out = torch.where(bad.unsqueeze(1), math.nan, out)
    return codes.view(-1), scale, out.to(torch.float32).view(-1)


def pack_bits(values, width: int) -> bytes:
    """Values of ``width`` bits back to back, little-endian: value j's bit b is bit
    j · width + b of the row, bit i of the row is bit i % 8 of byte i // 8."""
    word = 0
    for j, v in enumerate(values):
        assert 0 <= v < 1 << width
        word |= int(v) << (j * width)
    return word.to_bytes(-(-len(values) * width // 8), "little")


def scaled_bytes(name: str, x: torch.Tensor, block: int = 32) -> bytes:
    """The row's bytes: the value codes packed (``VALUE_BITS`` each, element 2i in the low
    nibble for the 4-bit formats, element 4i + j at bits 2j for int2), then one scale byte
    per block."""
    codes, scale, _ = scaled(name, x, block)
    if name in ("int2", "fp4_e3m0", "fp4_e2m1"):  # a value's codes are 0 in a marked block
        codes = torch.where(torch.repeat_interleave(scale == NONFINITE_SCALE, block), 0, codes)
    return pack_bits(codes.tolist(), VALUE_BITS[name]) + bytes(scale.tolist())


# --------------------------------------------------------------------------- top-k
def top_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the k largest magnitudes of each row of ``x`` (1-D: the one row;
    NaN and ±Inf rank above every finite value), in ascending order. A tie at the k-th
    magnitude is not settled by the formats: the tests' values have none there."""
    mag = torch.where(torch.isnan(x), math.inf, x.double().abs())
    order = torch.sort(-mag, dim=-1, stable=True).indices  # magnitude down; a tie: lower first
    return order[..., :k].sort(dim=-1).values


def topk_rows(x: torch.Tensor, rows: int, keep: float) -> torch.Tensor:
    """``topk``'s round trip of the 1-D ``x`` as ``rows`` equal rows: each row's
    k = ``kept(keep, c)`` largest magnitudes exactly, zeros elsewhere."""
    out = torch.zeros_like(x)
    for row, dense in zip(x.view(rows, -1), out.view(rows, -1)):
        idx = top_positions(row, kept(keep, row.numel()))
        dense[idx] = row[idx]
    return out


def chunk_levels(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's 2 bits of each chunk's kept values (a row of ``v``): (whether each
    magnitude is at least the row's mean m, lo, hi), lo and hi per row the mean magnitude
    of those below m and of those at or above it (0 for an empty group), in float64
    (rounded to fp32, then bf16, by the caller)."""
    mag = v.double().abs()
    hi = mag >= mag.mean(dim=-1, keepdim=True)
    n_hi = hi.sum(dim=-1)
    s_hi = torch.where(hi, mag, 0.0).sum(dim=-1) / n_hi.clamp(min=1)
    s_lo = torch.where(hi, 0.0, mag).sum(dim=-1) / (v.shape[-1] - n_hi).clamp(min=1)
    return hi, s_lo, s_hi


def bf16(value: torch.Tensor) -> torch.Tensor:
    """float64 ``value`` (any shape) as fp32, then bf16 (nearest, ties to even); finite
    values above bf16's maximum are clamped to it first, a NaN is the positive quiet NaN."""
    f = value.to(torch.float32)
    f = torch.where(torch.isfinite(f), f.clamp(max=torch.finfo(torch.bfloat16).max), f)
    b = f.to(torch.bfloat16)
    return torch.where(torch.isnan(b), torch.tensor(math.nan).to(torch.bfloat16), b)


def chunk_topk(x: torch.Tensor, block: int, k: int) -> tuple[torch.Tensor, ...]:
    """Per chunk of ``block`` values of the 1-D ``x`` (a multiple of ``block``), one row
    each of: kept positions (chunks, k), their codes sign | hi << 1 (chunks, k), lo and hi
    as bf16 (chunks,). Every chunk by the same element-wise rules, all chunks at once."""
    chunks = x.view(-1, block)
    idx = top_positions(chunks, k)
    v = chunks.gather(1, idx)
    hi, lo, top = chunk_levels(v)
    codes = (v < 0).to(torch.int64) | hi.to(torch.int64) << 1
    return idx, codes, bf16(lo), bf16(top)


def chunk_topk_roundtrip(x: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """D(C(x)) of the chunked 2-bit top-k: each kept value ±lo or ±hi, zeros elsewhere; a
    chunk whose levels are not finite is NaN throughout."""
    idx, codes, lo, hi = chunk_topk(x, block, k)
    mag = torch.where(codes >= 2, hi.float()[:, None], lo.float()[:, None])
    out = torch.zeros_like(x).view(-1, block)
    out.scatter_(1, idx, torch.where(codes & 1 == 1, -mag, mag))
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    out[~finite] = math.nan
    return out.view(-1)


def elias_fano(positions, n: int) -> bytes:
    """The Elias-Fano code of the sorted distinct ``positions`` below ``n`` (k of them):
    l = floor(log2(n / k)) low bits of each, packed, then a bitmap of k + ((n − 1) >> l)
    bits where the i-th position x_i sets bit (x_i >> l) + i."""
    k = len(positions)
    low = max(0, math.floor(math.log2(n / k))) if 0 < k < n else 0
    bitmap = [0] * (k + ((n - 1) >> low))
    for i, x in enumerate(positions):
        bitmap[(x >> low) + i] = 1
    return pack_bits([x & ((1 << low) - 1) for x in positions], low) + pack_bits(bitmap, 1)


def chunk_topk_bytes(name: str, x: torch.Tensor, block: int, k: int) -> bytes:
    """The row's bytes: per chunk ``[k 2-bit codes][lo, hi as bf16][positions]``, the
    positions Elias-Fano coded (``topk_2bit``) or in ceil(log2 block) bits each
    (``topk_2bit_packed``), none when every value is kept."""
    out = b""
    for idx, codes, lo, hi in zip(*chunk_topk(x, block, k)):
        scales = torch.stack([lo, hi]).view(torch.uint8)  # little-endian bf16
        where = idx.tolist()
        if k == block:
            pos = b""
        elif name == "topk_2bit":
            pos = elias_fano(where, block)
        else:
            pos = pack_bits(where, max(1, (block - 1).bit_length()))
        out += pack_bits(codes.tolist(), 2) + bytes(scales.tolist()) + pos
    return out


# --------------------------------------------------------------------------- round trips
def roundtrip(name: str, x: torch.Tensor, block: int | None = None, keep: float | None = None,
              rows: int = 1) -> torch.Tensor:
    """D(C(x)) of the fp32 tensor ``x``, flattened, zero-padded and cut into ``rows`` equal
    rows of whole blocks (``rows`` rows of ``padded(ceil(n / rows))``, as the all-reduce
    lays a vector out; 1: ``codec.encode(x)``'s one row), back in ``x``'s shape."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    if name == "fp32":
        return flat.clone().view_as(x)
    if name == "bf16":
        return flat.to(torch.bfloat16).float().view_as(x)
    block, keep = defaults(name, block, keep)
    chunk = padded(name, -(-n // rows), block)
    row = torch.nn.functional.pad(flat, (0, chunk * rows - n))
    if name in SCALED:
        out = scaled(name, row, block)[2]
    elif name == "topk":
        out = topk_rows(row, rows, keep)
    elif name in CHUNKED:
        out = chunk_topk_roundtrip(row, block, kept(keep, block))
    else:
        raise ValueError(f"tests/quantise.py has no {name!r}")
    return out[:n].view_as(x)
