"""Fused codec kernels (torch.compile of the eager code): the same bytes and the same values
as the eager reference, bit for bit (tolerance: exact, NaN payloads included, compared as
integers) on the adversarial tensors of test_codecs.py and on random bit patterns; compiled
once per shape; a failed compile falls back to eager with one warning; safe from threads.

Compiling costs about a second per codec, operation and shape, so every kernel here is
compiled for few shapes (ROWS x C below, and a handful more in the recompile and thread
tests), shared by all tests through the module-level kernel cache."""

import os
import threading

import pytest
import torch

from loco.comm.codecs import fused as kernels
from loco.comm.codecs import get_codec
from loco.comm.codecs.formats import FUSED_CODEC_NAMES, SPARSE_CODEC_NAMES
from loco.comm.codecs.fused import KERNEL_ENV, compile_count, kernel_in_use
from test_codecs import F32_MAX, FMT_MAX, GRID, normal, wide

B = 32
C = 16 * B  # values per row: 16 blocks
SCALED = ("fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1")
NAN_PAYLOADS = (0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF)


def bits(*words):
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


def fit(x):
    """x (1-D) repeated or cut to one row of C values."""
    return x.repeat(-(-C // x.numel()))[:C]


def representable(name):
    """The format's non-negative values up to fmt_max, at scale 1."""
    if name in GRID:
        return torch.tensor(GRID[name], dtype=torch.float32)
    if name == "int8":
        return torch.arange(128, dtype=torch.float32)
    v = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)].unique()


def ties(name):
    """Blocks holding fmt_max (so the scale is 1) and every midpoint of the grid, +-."""
    v = representable(name)
    mids = (v[:-1] + v[1:]) / 2  # exact in fp32
    vals = torch.cat([mids, -mids, v, -v])
    rows = []
    for i in range(0, vals.numel(), B - 1):
        rows.append(torch.cat([torch.tensor([FMT_MAX.get(name, 1.0)]), vals[i:i + B - 1]]))
    x = torch.cat(rows)
    return fit(torch.cat([x, torch.zeros(-x.numel() % B)]))


def adversarial(name, seed=0):
    """ROWS rows of C values: one case of test_codecs.py's edge cases per row."""
    g = torch.Generator().manual_seed(seed)
    fmax = FMT_MAX.get(name, 16.0)
    huge = torch.tensor([F32_MAX, -3.3e38, 1e38, 2e37, -F32_MAX, 3.39e38, 2e38, 0.0])
    nonfinite = normal(C, seed + 1)
    nonfinite[[3, 40, 77, 200, 201, 300, 301, 302, 450]] = bits(
        0x7FC00000, 0x7F800000, 0xFF800000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF,
        0x7FFFFFFF, 0x7F800000)
    zero_huge = torch.cat([torch.zeros(B), 3e38 * normal(B, seed).clamp(-1, 1), -torch.zeros(B),
                           torch.full((B,), -0.0), normal(C - 4 * B, seed + 2)])
    boundary = fmax * 2.0 ** torch.randint(-130, 128, (C,), generator=g).float()
    boundary = torch.where(torch.arange(C) % 3 == 1, torch.nextafter(boundary, boundary * 2),
                           boundary)
    tiny = torch.cat([1e-30 * normal(B, seed), 1e-38 * normal(B, seed + 1),
                      1e-40 * normal(B, seed + 2), 1e-44 * normal(B, seed + 3),
                      torch.full((B,), 1e-45), torch.full((B,), -2**-149),
                      1e-37 * normal(C - 6 * B, seed + 4)])
    random_bits = torch.randint(-2**31, 2**31, (C,), generator=g).to(torch.int32)
    finite_bits = random_bits.view(torch.float32).clone()
    finite_bits[~torch.isfinite(finite_bits)] = 1.0
    rows = [normal(C, seed), wide(C, seed), fit(huge), nonfinite, zero_huge, boundary, tiny,
            random_bits.view(torch.float32), finite_bits, torch.zeros(C)]
    if name in SCALED:
        rows.append(ties(name))
    else:  # bf16: ties of its own rounding (half-way between two bf16 values)
        rows.append(fit(bits(*[0x3F808000 + (i << 16) for i in range(64)])))
    rows.append(fit(bits(*NAN_PAYLOADS, 0x00000001, 0x80000001, 0x007FFFFF, 0x80800000)))
    return torch.stack(rows)


ROWS = adversarial("int8").shape[0]


def ints(t):
    """The bits of t, as integers, so that NaN payloads and -0 compare too."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.fixture(params=[False, True], ids=["denormals", "flush_denormal"])
def flush(request):
    torch.set_flush_denormal(request.param)
    yield request.param
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module", autouse=True)
def inductor_cache_per_capability(tmp_path_factory):
    """Under ATEN_CPU_CAPABILITY (CI's second numerics run), compile into a cache of its
    own: torch 2.13 reuses the code an AVX run cached and fails to build it without the
    vector headers (the codec then falls back to eager, warning, and these tests fail)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        yield
        return
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp(f"inductor_{capability}"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def pair():
    """name -> (fused codec, eager codec): one compiled kernel per codec, op and shape."""
    return {n: (get_codec(n, B, kernel="fused"), get_codec(n, B, kernel="eager"))
            for n in FUSED_CODEC_NAMES}


# ------------------------------------------------------------------------- bit identity
@pytest.mark.numerics
@pytest.mark.parametrize("name", FUSED_CODEC_NAMES)
def test_fused_is_bit_identical_to_eager(name, pair, flush):
    """Tolerance: none. Encoded bytes equal, decoded fp32 bits equal (NaN payloads, -0)."""
    fused, eager = pair[name]
    for seed in (0, 1):
        x = adversarial(name, seed)
        buf = eager.encode_rows(x)
        assert torch.equal(fused.encode_rows(x), buf), name
        assert torch.equal(ints(fused.decode_rows(buf, C)), ints(eager.decode_rows(buf, C)))
    # decoding any bytes at all: every code, scale bytes 0 and 255, NaN bit patterns
    g = torch.Generator().manual_seed(2)
    junk = torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8)
    if name in SCALED:
        junk[:2, -(C // B):] = torch.tensor([0, 255, 1, 254, 127, 128, 200, 50] * (C // B // 8))
    assert torch.equal(ints(fused.decode_rows(junk, C)), ints(eager.decode_rows(junk, C)))
    assert kernel_in_use(fused) == "fused" and kernel_in_use(eager) == "eager"


@pytest.mark.numerics
@pytest.mark.parametrize("name", [*FUSED_CODEC_NAMES, *SPARSE_CODEC_NAMES])
def test_into_a_kept_buffer_gives_the_same_bits(name, pair):
    """encode_rows/decode_rows with ``out`` (what the all-reduce does, into buffers it keeps):
    the bytes and fp32 bits of the plain calls, written into ``out`` itself, fused and eager;
    an ``out`` a kernel cannot take as it is (a strided view) still gets them; a wrong
    ``out`` is refused. Tolerance: exact."""
    codecs_ = pair[name] if name in pair else (get_codec(name, B, kernel="eager"),) * 2
    x = adversarial("int8" if name in SPARSE_CODEC_NAMES else name, 0)
    for codec in codecs_:  # straight into out: all but the dropping codecs (eager)
        assert codec.writes_into == (name not in SPARSE_CODEC_NAMES)
        buf = codec.encode_rows(x)
        want = ints(codec.decode_rows(buf, C))
        out = torch.empty_like(buf)
        got = codec.encode_rows(x, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, buf)
        values = torch.full(x.shape, 7.0)
        got = codec.decode_rows(buf, C, out=values)
        assert got.data_ptr() == values.data_ptr() and torch.equal(ints(values), want)
        wide_ = torch.full((x.shape[0], 2 * C), 7.0)
        codec.decode_rows(buf, C, out=wide_[:, :C])
        assert torch.equal(ints(wide_[:, :C]), want) and (wide_[:, C:] == 7).all()
        with pytest.raises(ValueError, match="out must be torch.float32"):
            codec.decode_rows(buf, C, out=torch.empty(x.shape[0], C + 1))
        with pytest.raises(ValueError, match="out must be torch.uint8"):
            codec.encode_rows(x, out=torch.empty(buf.shape))


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["int8", "fp4_e3m0"])
def test_fused_flat_api_and_round_trip(name, pair):
    """encode/decode (one row, padded) go through the same kernels; values keep the
    eager round trip's bits. Tolerance: exact."""
    fused, eager = pair[name]
    x = adversarial(name)[:, :C].reshape(-1)[:ROWS * C - 5]  # padded to whole blocks
    buf = fused.encode(x)
    assert torch.equal(buf, eager.encode(x))
    assert torch.equal(ints(fused.decode(buf, x.shape)), ints(eager.decode(buf, x.shape)))


# ------------------------------------------------------------------------- compile once
def test_same_shape_does_not_recompile(pair):
    from torch._dynamo.utils import counters

    fused, _ = pair["fp4_e3m0"]
    x = normal(ROWS * C).view(ROWS, C)
    buf = fused.encode_rows(x)  # compiled already by the tests above, or now
    fused.decode_rows(buf, C)
    before, graphs = compile_count(), counters["stats"]["unique_graphs"]
    for _ in range(3):
        buf = fused.encode_rows(x + 1)
        fused.decode_rows(buf, C)
    again = get_codec("fp4_e3m0", B, kernel="fused")  # another worker's codec shares them
    again.decode_rows(again.encode_rows(x), C)
    assert compile_count() == before and counters["stats"]["unique_graphs"] == graphs
    # a new shape compiles once, for the operation that sees it
    fused.encode_rows(normal(2 * C).view(2, C))
    assert compile_count() == before + 1
    fused.encode_rows(normal(2 * C, 1).view(2, C))
    assert compile_count() == before + 1


# ------------------------------------------------------------------------- threads
def test_threads_compile_once_and_agree(pair):
    """Worker threads encode different shapes at once (some new, one cached), each with its
    own codec as the threads launcher does: every kernel compiles once and all bytes match
    eager."""
    _, eager = pair["fp4_e3m0"]
    shapes = [(ROWS, C), (1, 3 * C), (3, C), (1, 3 * C), (3, C), (ROWS, C)]
    inputs = [normal(r * c, i).view(r, c) for i, (r, c) in enumerate(shapes)]
    new = {s for s in set(shapes)
           if not any(k[3] == "encode" and k[4][0] == s for k in kernels._KERNELS
                      if k[1] == "fp4_e3m0" and k[2] == B)}
    before = compile_count()
    start, results, errors = threading.Barrier(len(shapes)), [None] * len(shapes), []

    def work(i):
        try:
            codec = get_codec("fp4_e3m0", B, kernel="fused")
            start.wait()
            results[i] = [codec.encode_rows(inputs[i]) for _ in range(3)]
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shapes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert compile_count() == before + len(new)
    for x, outs in zip(inputs, results):
        for out in outs:
            assert torch.equal(out, eager.encode_rows(x))


def test_cached_kernels_take_no_lock(pair):
    """The steady state does not serialize: a cached shape runs while the compile lock is
    held elsewhere."""
    fused, eager = pair["int8"]
    x = normal(ROWS * C).view(ROWS, C)
    fused.encode_rows(x)  # cached
    done = threading.Event()
    out = []

    def work():
        out.append(fused.encode_rows(x))
        done.set()

    with kernels._COMPILE_LOCK:
        t = threading.Thread(target=work)
        t.start()
        assert done.wait(60), "a cached kernel waited for the compile lock"
    t.join()
    assert torch.equal(out[0], eager.encode_rows(x))


# ------------------------------------------------------------------------- fallback
def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    monkeypatch.setattr(kernels, "_FAILED", {})

    def broken(method):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(kernels, "_compiled", broken)
    codec = get_codec("int8", block=4, kernel="fused")  # a block no other test compiles
    assert codec.kernel == "fused"
    x = normal(8 * 4).view(2, 16)
    expect = get_codec("int8", block=4, kernel="eager").encode_rows(x)
    with pytest.warns(RuntimeWarning) as caught:
        assert torch.equal(codec.encode_rows(x), expect)
        assert torch.equal(codec.encode_rows(x), expect)
        codec.decode_rows(expect, 16)
        other = get_codec("int8", block=4, kernel="fused")  # another worker's codec
        assert torch.equal(other.encode_rows(x), expect)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "Codec(int8, block=4)" in msg and "no C++ compiler found" in msg
    assert "\n" not in msg  # one line
    for c in (codec, other):
        assert kernel_in_use(c) == "eager" and "no C++ compiler found" in c.kernel_reason


def test_failure_inside_the_compiled_call_falls_back(monkeypatch):
    monkeypatch.setattr(kernels, "_FAILED", {})

    def unsupported(method):
        def run(*args):
            raise NotImplementedError("op not supported by the backend")
        return run

    monkeypatch.setattr(kernels, "_compiled", unsupported)
    codec = get_codec("fp8_e4m3", block=4, kernel="fused")
    x = normal(16).view(2, 8)
    with pytest.warns(RuntimeWarning, match="op not supported"):
        out = codec.encode_rows(x)
    assert torch.equal(out, get_codec("fp8_e4m3", block=4, kernel="eager").encode_rows(x))
    assert codec.kernel == "eager"


# ------------------------------------------------------------------------- choosing
def test_kernel_choice(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "fused_supported", lambda device=None: (True, ""))
    codec = get_codec("fp4_e3m0")  # unset: auto, eager until prepare() compiles
    assert codec.kernel == "eager" and f"{KERNEL_ENV} unset: auto" in codec.kernel_reason
    assert "prepare()" in codec.kernel_reason
    assert get_codec("fp4_e3m0", kernel="auto").kernel == "eager"
    for name in ("fp32", "bf16"):  # auto: a cast is one kernel eager already
        codec = get_codec(name, kernel="auto")
        assert codec.kernel == "eager" and "cast" in codec.kernel_reason
        assert codec.prepare(kernels.FUSED_MIN_NUMEL, 2) == "eager" and codec.kernel == "eager"
        assert get_codec(name, kernel="fused").kernel == "fused"
    monkeypatch.setattr(kernels, "fused_supported", lambda device=None: (False, "no compiler"))
    codec = get_codec("fp4_e3m0", kernel="auto")
    assert codec.kernel == "eager" and "no compiler" in codec.kernel_reason
    assert codec.prepare(kernels.FUSED_MIN_NUMEL, 2) == "eager" and codec.kernel == "eager"
    monkeypatch.setenv(KERNEL_ENV, "fused")
    assert get_codec("int8").kernel == "fused"
    assert get_codec("int8", kernel="eager").kernel == "eager"  # the argument wins
    monkeypatch.setenv(KERNEL_ENV, "eager")
    assert get_codec("int8").kernel_reason == f"{KERNEL_ENV}=eager"
    assert get_codec("int8", kernel="fused").kernel == "fused"
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert get_codec("int8").kernel == "eager"
    for name in SPARSE_CODEC_NAMES:  # no fused kernel: always eager, and says so
        codec = get_codec(name, kernel="fused")
        assert kernel_in_use(codec) == "eager" and "no fused kernel" in codec.kernel_reason
    monkeypatch.setenv(KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="LOCO_CODEC_KERNEL=triton"):
        get_codec("int8")
    with pytest.raises(ValueError, match="kernel='jit'"):
        get_codec("int8", kernel="jit")


def test_device_probe_does_not_compile():
    before = compile_count()
    codec = get_codec("fp4_e2m1", block=8, device="cpu", kernel="fused")
    assert codec.kernel == "fused" and compile_count() == before


def test_fused_supported_on_cpu_here():
    ok, why = kernels.fused_supported("cpu")
    assert ok, why  # this machine has a C++ compiler; the numbers were taken on it
    assert kernels.fused_supported("meta")[0] is False


def test_the_run_says_which_kernel_ran(corpus, tmp_path, capsys):
    """loco train records the codec's kernel in summary.json and prints it."""
    import json

    from loco.cli import main
    from test_cli import small_run

    assert main(small_run(corpus, tmp_path)) == 0  # the suite's default: LOCO_CODEC_KERNEL=eager
    kernel = json.loads((tmp_path / "summary.json").read_text())["codec_kernel"]
    assert kernel == {"codec": "fp4_e3m0", "kernel": "eager",
                      "reason": f"{KERNEL_ENV}=eager"}
    assert "codec fp4_e3m0: eager kernels (LOCO_CODEC_KERNEL=eager)" in capsys.readouterr().out


# ------------------------------------------------------------------------- prepare
# Shapes shared with the tests above (chunk C; the bit-identity tests compile (ROWS, C), the
# recompile test (2, C)), so that these compile at most a few new kernels.
PARTS = 2
NUMEL = PARTS * C - 5  # chunk = padded(ceil(NUMEL / PARTS)) = C


def reduce_worker(ctx, name, kernel, numel, prepare):
    codec = get_codec(name, B, kernel=kernel)
    if prepare:
        with torch.no_grad():  # another grad mode than the communication thread's
            codec.prepare(numel, ctx.comm.size)
    x = normal(numel, ctx.rank)
    return ctx.comm.all_reduce_mean(x, codec=codec).wait().clone(), codec.kernel


def needed(name, numel, parts):
    """The kernel keys an all-reduce of numel values over parts > 1 workers runs: encoding
    (parts, chunk) and (1, chunk) and decoding (parts, row_bytes(chunk)), into buffers."""
    codec = get_codec(name, B, kernel="fused")
    chunk = codec.padded(-(-numel // parts))
    f32 = lambda rows: torch.empty(rows, chunk)  # noqa: E731
    u8 = lambda rows: torch.empty(rows, codec.row_bytes(chunk), dtype=torch.uint8)  # noqa: E731
    calls = [("encode_into", (f32(parts), u8(parts))), ("encode_into", (f32(1), u8(1))),
             ("decode_into", (u8(parts), chunk, f32(parts)))]
    return {kernels._spec(codec) + (op,) + tuple(kernels._key(a) for a in args)
            for op, args in calls}


def test_prepare_compiles_each_needed_kernel_once_and_training_none():
    """prepare compiles exactly the all-reduce's missing kernels, once; a second prepare
    (another worker's codec) compiles nothing; the all-reduce itself then compiles nothing,
    not even a Dynamo recompile, and gives eager's bits."""
    import loco
    from torch._dynamo.utils import counters

    keys = needed("fp4_e3m0", NUMEL, PARTS)
    assert len(keys) == 3  # encode (2, C) and (1, C), decode (2, row_bytes(C)), into buffers
    missing = keys - set(kernels._KERNELS)
    before = compile_count()
    codec = get_codec("fp4_e3m0", B, kernel="fused")
    assert codec.prepare(NUMEL, PARTS) == "fused"
    assert compile_count() == before + len(missing) and keys <= set(kernels._KERNELS)
    assert get_codec("fp4_e3m0", B, kernel="fused").prepare(NUMEL, PARTS) == "fused"
    assert compile_count() == before + len(missing)
    compiled, graphs = compile_count(), counters["stats"]["unique_graphs"]
    fused = loco.launch(reduce_worker, PARTS, args=("fp4_e3m0", "fused", NUMEL, True))
    assert compile_count() == compiled and counters["stats"]["unique_graphs"] == graphs
    eager = loco.launch(reduce_worker, PARTS, args=("fp4_e3m0", "eager", NUMEL, False))
    for (got, kernel), (want, _) in zip(fused, eager):
        assert kernel == "fused" and torch.equal(ints(got), ints(want))


def test_prepare_one_part_covers_encode_and_decode():
    """parts=1: the one-worker all-reduce and whole-tensor encode/decode (NoLoCo), also of a
    buffer sliced at an odd offset out of a bigger message."""
    codec, eager = get_codec("int8", B, kernel="fused"), get_codec("int8", B, kernel="eager")
    n = ROWS * C - 7  # encode (1, ROWS * C), decode (1, row_bytes(ROWS * C))
    codec.prepare(n)
    before = compile_count()
    x = adversarial("int8").view(-1)[:n]
    buf = codec.encode(x)
    assert torch.equal(buf, eager.encode(x))
    message = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])
    got = codec.decode(message[3:], x.shape)
    assert torch.equal(ints(got), ints(eager.decode(buf, x.shape)))
    assert compile_count() == before


def test_auto_is_fused_from_the_threshold_and_never_compiles_in_training(monkeypatch):
    """The default: eager until prepare sees an all-reduce of FUSED_MIN_NUMEL values or
    more; fused for those; eager (and no compile) for smaller or unprepared ones."""
    assert kernels.FUSED_MIN_NUMEL == 1 << 22  # docs/codecs.md gives the reasoning
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "FUSED_MIN_NUMEL", NUMEL)  # reuse the compiled shapes
    codec, eager = get_codec("fp4_e3m0", B), get_codec("fp4_e3m0", B, kernel="eager")
    assert codec.kernel == "eager"
    before = compile_count()
    assert codec.prepare(NUMEL - 1, PARTS) == "eager"  # below: nothing compiled
    assert codec.kernel == "eager" and f"({NUMEL - 1} over {PARTS})" in codec.kernel_reason
    assert compile_count() == before
    codec.prepare(NUMEL, PARTS)  # compiles what the test above did not (run alone)
    assert codec.kernel == "fused" and kernel_in_use(codec) == "fused"
    assert "eager for the smaller ones" in codec.kernel_reason
    compiled = compile_count()
    x = normal(5 * C).view(1, 5 * C)  # a shape never prepared: eager, no compile
    assert torch.equal(codec.encode_rows(x), eager.encode_rows(x))
    x = normal(PARTS * C).view(PARTS, C)  # a prepared one
    assert torch.equal(codec.encode_rows(x), eager.encode_rows(x))
    assert compile_count() == compiled
    assert get_codec("fp4_e3m0", B).prepare(NUMEL, PARTS) == "fused"  # cheap, shared
    assert compile_count() == compiled


def test_prepare_is_a_no_op_where_nothing_is_fused():
    before = compile_count()
    for codec in (get_codec("fp4_e3m0", B, kernel="eager"), get_codec("topk", kernel="fused"),
                  get_codec("dare", kernel="auto")):
        assert codec.prepare(1 << 24, 4) == "eager" and codec.kernel == "eager"
    assert get_codec("int8", B, kernel="fused").prepare(0, 3) == "eager"
    assert compile_count() == before


def test_prepare_failure_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(kernels, "_FAILED", {})
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(kernels, "FUSED_MIN_NUMEL", 8)
    monkeypatch.delenv(KERNEL_ENV, raising=False)

    def broken(method):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(kernels, "_compiled", broken)
    codec = get_codec("int8", block=4)
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler found") as caught:
        assert codec.prepare(64, 2) == "eager"
        assert get_codec("int8", block=4).prepare(64, 2) == "eager"
    assert len(caught) == 1
    assert codec.kernel == "eager" and "no C++ compiler found" in codec.kernel_reason


@pytest.mark.parametrize("args,match", [((-1,), "numel"), ((1.5,), "numel"), ((True,), "numel"),
                                        ((10, 0), "parts"), ((10, 2.0), "parts")])
def test_prepare_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        get_codec("int8", B, kernel="fused").prepare(*args)
