"""The eager path's C++ kernel (``loco.comm.codecs.cpp_kernel``) gives eager's bytes and
decoded bits for FP4 and int2 on every kind of input, and falls back to eager where it cannot
run."""

from __future__ import annotations

import threading

import pytest
import torch

from loco.comm.codecs import cpp_kernel
from loco.comm.codecs import get_codec

NAMES = sorted(cpp_kernel.SPECS)
F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="module")
def lib():
    """The loaded kernel; the module's tests skip where it cannot be compiled."""
    if cpp_kernel._library(wait=True) is None:
        pytest.skip("the C++ kernel did not compile here (no compiler?)")
    return cpp_kernel._STATE["lib"]


def _both(monkeypatch, fn):
    """``fn()`` with the kernel off (eager), then on; each result cloned."""
    monkeypatch.setenv(cpp_kernel.ENV, "0")
    eager = fn().clone()
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    return eager, fn().clone()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def _check(monkeypatch, codec, x: torch.Tensor) -> None:
    """Encoding ``x`` (rows, c) and decoding the result give the same bits both ways,
    into new tensors and into ``out`` buffers."""
    c = x.shape[1]
    q0, q1 = _both(monkeypatch, lambda: codec.encode_rows(x))
    assert _same_bits(q0, q1), codec
    out = torch.empty_like(q0)
    q2 = _both(monkeypatch, lambda: codec.encode_rows(x, out=out))
    assert _same_bits(q0, q2[0]) and _same_bits(q0, q2[1]), codec
    d0, d1 = _both(monkeypatch, lambda: codec.decode_rows(q0, c))
    assert _same_bits(d0, d1), codec
    into = torch.empty(x.shape, dtype=torch.float32)
    d2 = _both(monkeypatch, lambda: codec.decode_rows(q0, c, out=into))
    assert _same_bits(d0, d2[0]) and _same_bits(d0, d2[1]), codec


def _from_bits(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _every_key(codec) -> torch.Tensor:
    """Blocks holding every fp32 value of every table key up to the format's largest (and
    its neighbours), each block with the largest, so that its scale is 2^0."""
    keys = torch.arange(2048, dtype=torch.int64)
    bits = (keys >> 1 << 21) + (keys & 1)
    near = torch.cat([bits, bits - 1, bits + 1, bits + 0x1FFFFF]).clamp(min=0)
    v = _from_bits(near)
    v = v[v <= codec.fmt_max]
    v = torch.cat([v, -v])
    per = codec.block - 1
    v = torch.cat([v, torch.zeros(-len(v) % per)]).view(-1, per)
    full = torch.cat([torch.full((len(v), 1), codec.fmt_max), v], dim=1)
    return full.view(1, -1)


@pytest.mark.parametrize("name", NAMES)
def test_every_key_and_tie(lib, monkeypatch, name):
    codec = get_codec(name, kernel="eager")
    _check(monkeypatch, codec, _every_key(codec))


def _special_rows(block: int, g: torch.Generator) -> torch.Tensor:
    """Rows of blocks at every scale, with zeros, -0, denormals, NaN and infinities,
    values at and near fp32's largest, and random bit patterns."""
    n = 64 * block
    x = torch.randn(8, n, generator=g)
    x *= torch.exp2(torch.randint(-160, 128, (8, n // block, 1), generator=g)
                    ).repeat_interleave(block, dim=1).view(8, n)
    x[0, :block] = 0.0
    x[0, block:2 * block] = -0.0
    x[0, 2 * block:3 * block] = _from_bits(torch.randint(1, 1 << 23, (block,), generator=g))
    x[0, 3 * block] = float("nan")
    x[0, 4 * block + 1] = float("inf")
    x[0, 5 * block + 2] = -float("inf")
    x[0, 6 * block:7 * block] = F32_MAX
    x[0, 7 * block:8 * block:2] = -F32_MAX
    x[0, 8 * block:9 * block] = _from_bits(torch.randint(0x7F000000, 0x7F800000, (block,),
                                                         generator=g))
    x[1] = _from_bits(torch.randint(0, 1 << 32, (n,), generator=g))  # NaN payloads too
    x[2, ::3] = _from_bits(torch.randint(0, 1 << 23, (len(x[2, ::3]),), generator=g))
    x[3, 1::2] = -0.0
    return x


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block", [32, 2, 4, 8, 48, 256])
def test_special_values(lib, monkeypatch, name, block):
    if block % cpp_kernel.SPECS[name][0]:
        pytest.skip("block not a multiple of the values per byte")
    codec = get_codec(name, block, kernel="eager")
    _check(monkeypatch, codec, _special_rows(block, torch.Generator().manual_seed(block)))


@pytest.mark.parametrize("name", NAMES)
def test_flushed_denormals(lib, monkeypatch, name):
    """Under torch.set_flush_denormal(True) (the calling thread's flags), the same bits."""
    codec = get_codec(name, kernel="eager")
    x = _special_rows(codec.block, torch.Generator().manual_seed(7))
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        torch.set_num_threads(1)  # eager's passes then run on this thread, under its flags
        _check(monkeypatch, codec, x)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_every_byte_and_scale(lib, monkeypatch, name):
    """Decoding every value byte under every scale byte, 255 (non-finite) and 0 included."""
    codec = get_codec(name, kernel="eager")
    per = cpp_kernel.SPECS[name][0]
    nv = codec.block // per
    values = torch.arange(256, dtype=torch.uint8).view(-1, nv)
    scales = torch.arange(256, dtype=torch.uint8)
    v = values.repeat(256, 1).view(256, -1)  # a row per scale byte
    buf = torch.cat([v, scales.view(-1, 1).expand(256, v.shape[1] // nv)], dim=1)
    c = v.shape[1] * per
    d0, d1 = _both(monkeypatch, lambda: codec.decode_rows(buf, c))
    assert _same_bits(d0, d1)


@pytest.mark.parametrize("name", NAMES)
def test_rows_of_a_wider_tensor(lib, monkeypatch, name):
    """Rows that are slices (row stride > c), to encode and to decode."""
    codec = get_codec(name, kernel="eager")
    wide = torch.randn(3, 5 * codec.block, generator=torch.Generator().manual_seed(3))
    x = wide[:, codec.block:4 * codec.block]
    assert not x.is_contiguous()
    _check(monkeypatch, codec, x)
    q = codec.encode_rows(x)
    message = torch.cat([q, torch.randint(0, 256, (3, 5), dtype=torch.uint8)], dim=1)
    rows = message[:, :q.shape[1]]  # rows of a wider message: row stride > row bytes
    d0, d1 = _both(monkeypatch, lambda: codec.decode_rows(rows, x.shape[1]))
    assert _same_bits(d0, d1) and _same_bits(d0, codec.decode_rows(q, x.shape[1]))


def test_empty(lib, monkeypatch):
    codec = get_codec("fp4_e3m0", kernel="eager")
    for x in (torch.zeros(3, 0),):  # (eager cannot take 0 rows: a reshape fails)
        q0, q1 = _both(monkeypatch, lambda: codec.encode_rows(x))
        assert _same_bits(q0, q1)
        d0, d1 = _both(monkeypatch, lambda: codec.decode_rows(q0, x.shape[1]))
        assert _same_bits(d0, d1)


def test_used_on_the_cpu(lib, monkeypatch):
    """With the kernel on, the eager path calls it; off, it does not."""
    codec = get_codec("fp4_e2m1", kernel="eager")
    x = torch.randn(2, 64)
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    assert cpp_kernel.encode_into(codec, x, torch.empty(2, codec.row_bytes(64),
                                                         dtype=torch.uint8))
    monkeypatch.setenv(cpp_kernel.ENV, "0")
    assert not cpp_kernel.encode_into(codec, x, torch.empty(2, codec.row_bytes(64),
                                                             dtype=torch.uint8))
    assert not cpp_kernel.supports(get_codec("int8", kernel="eager"))


def test_no_compiler_warns_once_and_runs_eager(lib, monkeypatch):
    codec = get_codec("fp4_e3m0", kernel="eager")
    x = torch.randn(2, 128)
    monkeypatch.setenv(cpp_kernel.ENV, "0")
    want = codec.encode_rows(x)
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    monkeypatch.setattr(cpp_kernel, "_STATE", {})
    monkeypatch.setattr(cpp_kernel, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ kernel"):
        got = codec.encode_rows(x)
    assert torch.equal(got, want) and cpp_kernel._STATE["lib"] is None
    assert torch.equal(codec.encode_rows(x), want)  # no second warning (pytest: errors)


def test_no_wait_while_another_thread_loads(lib, monkeypatch):
    """A thread that finds the kernel being loaded runs eager rather than wait."""
    codec = get_codec("fp4_e3m0", kernel="eager")
    x = torch.randn(1, 64)
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    monkeypatch.setattr(cpp_kernel, "_STATE", {})
    monkeypatch.setattr(cpp_kernel, "_LOCK", threading.Lock())
    with cpp_kernel._LOCK:  # as if another thread were compiling
        out = torch.empty(1, codec.row_bytes(64), dtype=torch.uint8)
        assert not cpp_kernel.encode_into(codec, x, out)
    assert cpp_kernel.encode_into(codec, x, out)


def test_prepare_loads_it(lib, monkeypatch):
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    monkeypatch.setattr(cpp_kernel, "_STATE", {})
    get_codec("int2", kernel="eager").prepare(1 << 10, 2)
    assert cpp_kernel._STATE["lib"] is not None


def test_cached_library_name(lib):
    """The library lives in torch's extension cache, named by source and command."""
    from torch.utils.cpp_extension import get_default_build_root

    path = cpp_kernel.library_path(cpp_kernel._compiler())
    assert path.startswith(get_default_build_root()) and path.endswith(".so")


@pytest.mark.numerics
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [2, 3, 5])
def test_decode_mean_is_decode_sum_divide(lib, monkeypatch, name, rows):
    """The owner's step of a reduction in one pass (``decode_mean_rows``): the bits of
    decoding every row, ``torch.add`` of rows 0 and 1, ``add_`` of the later rows in rank
    order and ``div_(divisor)``, for divisors that divide exactly (2, 4) and that round
    (3, 5, 7), with blocks sent non-finite, huge scales that clamp, and zeros."""
    codec = get_codec(name, kernel="eager")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64 * codec.block, generator=g)
    x[:, :codec.block] *= 1e38  # scales that clamp (and sums that overflow to inf)
    x[1, codec.block:2 * codec.block] = float("nan")  # one row's block sent non-finite
    x[:, 2 * codec.block:3 * codec.block] = 0.0
    buf = codec.encode_rows(x)
    c = x.shape[1]
    for divisor in (2, 3, 4, 5, 7):
        decoded = codec.decode_rows(buf, c)
        want = torch.add(decoded[0], decoded[1])
        for row in decoded[2:]:
            want.add_(row)
        want.div_(divisor)
        out = torch.full((1, c), 1.5)
        assert codec.decode_mean_rows(buf, c, out, divisor)
        assert _same_bits(out[0], want), (name, rows, divisor)
    monkeypatch.setenv(cpp_kernel.ENV, "0")  # off: nothing written, the caller decodes
    out = torch.full((1, c), 1.5)
    assert not codec.decode_mean_rows(buf, c, out, 2) and bool((out == 1.5).all())


def _fp4_mean(ctx, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank)) * (ctx.rank + 1)
    ctx.comm.all_reduce_mean(x, codec=get_codec("fp4_e3m0", kernel="eager")).wait()
    return x


def test_an_fp4_all_reduce_gives_the_same_bits_with_the_kernel(lib, monkeypatch):
    """Three workers' FP4 mean all-reduce (encode, the owner's one-pass decode-sum-divide,
    decode) gives every worker the bits of the PyTorch ops' reduction."""
    import loco
    monkeypatch.setenv(cpp_kernel.ENV, "0")
    eager = loco.launch(_fp4_mean, 3, launcher="threads", args=(10_000,))
    monkeypatch.setenv(cpp_kernel.ENV, "1")
    fast = loco.launch(_fp4_mean, 3, launcher="threads", args=(10_000,))
    for a, b in zip(eager, fast, strict=True):
        assert _same_bits(a, b) and _same_bits(a, fast[0])
