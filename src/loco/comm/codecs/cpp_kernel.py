"""A hand-written C++ kernel for the scaled codecs' eager path on the CPU: FP4 (``fp4_e3m0``,
``fp4_e2m1``) and ``int2``, one pass per block.

Encoding reads each block once for its largest magnitude (the largest of the values' bits
with the sign cleared), makes the scale byte by ``ScaledCodec._scales``'s integer formula,
divides the values by the power of two (the same IEEE division as eager, so the same
flushing of denormals), looks each code up in the codec's own ``codes`` table by the key of
``ScaledCodec._codes``, and packs the codes into the wire buffer. Decoding gathers each
byte's values from the codec's own ``pairs`` (``quads``) table, multiplies by the block's
scale, clamps to fp32's range and writes the one quiet NaN throughout a ``NONFINITE_SCALE``
block, as ``ScaledCodec._finish``. The bytes and the decoded bits are eager's
(``tests/test_cpu_kernels.py``), including under ``torch.set_flush_denormal(True)``, whose
flags the kernel reads on the calling thread.

The source includes no torch header: it compiles in about a second, into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``), named by a hash of the
source and the compiler command, so a machine compiles it once and later processes load it
in milliseconds. It is called through ``ctypes``, which releases the GIL. It is loaded at
the first CPU use of one of these codecs in a process (or by ``get_codec(device="cpu")`` and
``Codec.prepare`` on the CPU, before training), under a lock of its own, which a thread that
finds it taken does not wait for: it runs the eager path meanwhile. No compiler, or a failed
compile: one warning, and the eager path. ``LOCO_CPU_KERNEL=0`` turns the kernel off. See
"The eager path" in ``docs/codecs.md``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

import torch

ENV = "LOCO_CPU_KERNEL"
"""The environment variable that turns the C++ kernel off (``0``); unset or anything else:
on where it compiled. Read at every call."""
SPECS = {"fp4_e3m0": (2, "pairs"), "fp4_e2m1": (2, "pairs"), "int2": (4, "quads")}
"""The codecs the kernel runs: name -> (values per byte, the codec's decoding table)."""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Whether denormal inputs count as zero on this thread (x86 MXCSR.DAZ, which
   torch.set_flush_denormal(True) sets with FTZ). */
static int daz(void) {
#if defined(__x86_64__) || defined(__i386__)
    return (_mm_getcsr() & 0x40) != 0;
#else
    return 0;
#endif
}

enum { PIECE = 64 };

/* The codes of n <= PIECE values x / d (n a multiple of per), packed into n / per bytes of q,
   element per*i + j at bits j*(8/per): the table keys in one pass (vectorized), then the
   lookups, each byte's codes combined in registers. */
static inline void encode_piece(const float *x, float d, int n, int per, const uint8_t *table,
                                uint8_t *q) {
    int32_t key[PIECE];
    for (int i = 0; i < n; i++) {
        int32_t u = (int32_t)fbits(x[i] / d);
        int32_t up = (int32_t)((uint32_t)u + 0x1FFFFFu);
        key[i] = ((u >> 21) + (up >> 21) + 2048) & 4095;
    }
    if (per == 2) {
        for (int i = 0; i < n / 2; i++)
            q[i] = (uint8_t)(table[key[2 * i]] | table[key[2 * i + 1]] << 4);
    } else {
        for (int i = 0; i < n / 4; i++)
            q[i] = (uint8_t)(table[key[4 * i]] | table[key[4 * i + 1]] << 2
                             | table[key[4 * i + 2]] << 4 | table[key[4 * i + 3]] << 6);
    }
}

/* The block's largest magnitude, as bits (>= 0x7F800000: a NaN or an infinity). */
static inline uint32_t absmax_bits(const float *x, int64_t block) {
    uint32_t m = 0;
    for (int64_t i = 0; i < block; i++) {
        uint32_t a = fbits(x[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* Encode one block of x into q (block / per bytes); returns the scale byte sent. B > 0: the
   block size, known to the compiler (its loops unrolled and vectorized whole). */
template <int B>
static inline uint8_t encode_block(const float *x, int64_t n_block, int per,
                                   const uint8_t *table, int32_t F, uint32_t M,
                                   int zero_blocks, int flush, uint8_t *q) {
    const int64_t block = B ? B : n_block;
    uint32_t m = absmax_bits(x, block);
    if (m >= 0x7F800000u) {  /* a NaN or an infinity: divided as zeros, +0's code */
        uint8_t z = table[2048], byte = per == 2 ? (uint8_t)(z | z << 4)
                                                 : (uint8_t)(z | z << 2 | z << 4 | z << 6);
        memset(q, byte, (size_t)(block / per));
        return 255;
    }
    int32_t e = (int32_t)(m >> 23) - (126 + F) + ((m & 0x7FFFFFu) > M);
    e = e < -126 ? -126 : (e > 127 ? 127 : e);
    float d = bitsf((uint32_t)(e + 127) << 23);
    for (int64_t j = 0; j < block; j += PIECE) {
        int n = block - j < PIECE ? (int)(block - j) : PIECE;
        encode_piece(x + j, d, n, per, table, q + j / per);
    }
    if (zero_blocks && (m == 0 || (flush && m < 0x800000u))) return 0;  /* absmax == 0 */
    return (uint8_t)(e + 127);
}

extern "C" CLONES void loco_encode(const float *x, int64_t x_stride, uint8_t *out, int64_t out_stride,
                        int64_t rows, int64_t c, int64_t block, int32_t per,
                        const uint8_t *table, int32_t F, uint32_t M, int32_t zero_blocks) {
    int64_t blocks = c / block, nv = c / per;
    int flush = daz();
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        uint8_t *qr = out + r * out_stride;
        for (int64_t b = 0; b < blocks; b++)
            qr[nv + b] = block == 32 && per == 2
                ? encode_block<32>(xr + b * 32, 32, 2, table, F, M, 0, flush, qr + b * 16)
                : encode_block<0>(xr + b * block, block, per, table, F, M, zero_blocks,
                                  flush, qr + b * (block / per));
    }
}

/* Decode one block: the values of its bytes (per of them, as one 8- or 16-byte word) times
   2^(s - 127), clamped to fp32's range where that can be passed (s > 254 - F); the one quiet
   NaN throughout a block sent under scale byte 255. */
template <int B>
static inline void decode_block(const uint8_t *q, uint8_t s, int64_t n_block, int per,
                                const uint64_t *words, int32_t F, float *out) {
    const int64_t block = B ? B : n_block;
    if (s == 255) {
        float nan = bitsf(0x7FC00000u);
        for (int64_t i = 0; i < block; i++) out[i] = nan;
        return;
    }
    uint64_t *o = (uint64_t *)out;
    if (per == 2) {
        for (int64_t i = 0; i < block / 2; i++) o[i] = words[q[i]];
    } else {
        for (int64_t i = 0; i < block / 4; i++) {
            o[2 * i] = words[2 * q[i]];
            o[2 * i + 1] = words[2 * q[i] + 1];
        }
    }
    const float big = 3.4028234663852886e38f, scale = bitsf((uint32_t)s << 23);
    if (s > 254 - F) {
        for (int64_t i = 0; i < block; i++) {
            float y = out[i] * scale;
            out[i] = y > big ? big : (y < -big ? -big : y);
        }
    } else {
        for (int64_t i = 0; i < block; i++) out[i] *= scale;
    }
}

extern "C" CLONES void loco_decode(const uint8_t *buf, int64_t buf_stride, float *out,
                        int64_t out_stride, int64_t rows, int64_t c, int64_t block,
                        int32_t per, const uint64_t *words, int32_t F) {
    int64_t blocks = c / block, nv = c / per;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *qr = buf + r * buf_stride;
        float *outr = out + r * out_stride;
        for (int64_t b = 0; b < blocks; b++)
            if (block == 32 && per == 2)
                decode_block<32>(qr + b * 16, qr[nv + b], 32, 2, words, F, outr + b * 32);
            else
                decode_block<0>(qr + b * (block / per), qr[nv + b], block, per, words, F,
                                outr + b * block);
    }
}

/* out (c values) = the rows' decoded values added in rank order, ((r0 + r1) + r2) + ...,
   then divided by d: the bits of decoding every row, torch.add, add_ and div_, block by
   block, the partial sums kept in the cache. rows >= 2; blocks of at most 256 values. */
extern "C" CLONES void loco_decode_mean(const uint8_t *buf, int64_t buf_stride, float *out,
                        int64_t rows, int64_t c, int64_t block, int32_t per,
                        const uint64_t *words, int32_t F, float d) {
    int64_t blocks = c / block, nv = c / per, bb = block / per;
    float tmp[256];
    for (int64_t b = 0; b < blocks; b++) {
        float *o = out + b * block;
        decode_block<0>(buf + b * bb, buf[nv + b], block, per, words, F, o);
        for (int64_t r = 1; r < rows; r++) {
            const uint8_t *qr = buf + r * buf_stride;
            decode_block<0>(qr + b * bb, qr[nv + b], block, per, words, F, tmp);
            for (int64_t i = 0; i < block; i++) o[i] = o[i] + tmp[i];
        }
        for (int64_t i = 0; i < block; i++) o[i] = o[i] / d;
    }
}
"""

FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-x", "c++"]
"""The compiler's flags: no contraction into fused multiply-adds, no fast math (every
operation is the IEEE one eager runs)."""

_LOCK = threading.Lock()
_STATE: dict = {}  # "lib": the loaded library, or None after a failure (warned once)


def enabled() -> bool:
    """Whether ``LOCO_CPU_KERNEL`` leaves the kernel on (anything but ``0``, ``off``,
    ``false``, ``no``)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "false", "no")


def supports(codec, device=None) -> bool:
    """Whether the kernel can run ``codec``'s eager path on ``device`` (default: the CPU):
    one of ``SPECS``, on a little-endian CPU, with the kernel not turned off."""
    dev = torch.device("cpu" if device is None else device)
    return (codec.name in SPECS and dev.type == "cpu" and sys.byteorder == "little"
            and enabled())


def warm(codec, device=None) -> bool:
    """Compile (once per machine) and load the kernel now if ``codec`` would use it on
    ``device``, so that training does not; whether it is loaded. Blocks while another
    thread loads it."""
    return supports(codec, device) and _library(wait=True) is not None


def _library(wait: bool = False):
    """The loaded library, loading it first if no thread has tried; None when it failed,
    is off, or (``wait`` False) another thread is loading it now."""
    if "lib" in _STATE:
        return _STATE["lib"]
    if not _LOCK.acquire(blocking=wait):
        return None  # another thread compiles: run eager meanwhile, never wait mid-sync
    try:
        if "lib" not in _STATE:
            _STATE["lib"] = _load()
        return _STATE["lib"]
    finally:
        _LOCK.release()


def _compiler() -> str | None:
    """The C++ compiler: ``CXX``, else ``c++``, else ``g++``, as found on PATH."""
    for name in (os.environ.get("CXX", ""), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path(cxx: str) -> str:
    """Where the compiled library of ``SOURCE`` built by ``cxx`` with ``FLAGS`` lives, in
    torch's extension cache (a new source or command: a new name)."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256("\0".join([SOURCE, cxx, *FLAGS]).encode()).hexdigest()[:16]
    return os.path.join(get_default_build_root(), "loco_cpu_kernels", f"codecs_{digest}.so")


def _build(cxx: str, path: str) -> None:
    """Compile ``SOURCE`` into ``path``: into a temporary file beside it, then renamed, so
    that processes compiling at once never load a half-written library."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, "-", "-o", tmp], input=SOURCE.encode(), check=True,
                       capture_output=True, timeout=300)
        os.replace(tmp, path)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(err.stderr.decode(errors="replace").strip()[-400:]) from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load():
    """Load the library (compiling it first if the cache lacks it), its functions typed;
    None, with one warning, when that fails."""
    try:
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (CXX, c++ or g++) on PATH")
        path = library_path(cxx)
        if not os.path.exists(path):
            _build(cxx, path)
        return _typed(ctypes.CDLL(path))
    except Exception as err:  # no compiler, a failed compile, an unloadable library
        warnings.warn(f"loco: the C++ kernel of the FP4 and int2 codecs is unavailable, "
                      f"running their eager path ({type(err).__name__}: {err})",
                      RuntimeWarning, stacklevel=4)
        return None


def _typed(lib):
    """``lib`` with its functions' arguments typed (a missing one raises)."""
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32
    lib.loco_encode.argtypes = [p, i64, p, i64, i64, i64, i64, i32, p, i32, u32, i32]
    lib.loco_decode.argtypes = [p, i64, p, i64, i64, i64, i64, i32, p, i32]
    lib.loco_decode_mean.argtypes = [p, i64, p, i64, i64, i64, i32, p, i32, ctypes.c_float]
    lib.loco_encode.restype = lib.loco_decode.restype = lib.loco_decode_mean.restype = None
    return lib


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """2-D CPU tensors with unit stride along the row, each row in place."""
    return all(t.device.type == "cpu" and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)
               for t in tensors)


def _ready(codec, fp32: torch.Tensor, *others: torch.Tensor, extra: bool = True):
    """The loaded library where the kernel can take ``codec`` on these tensors (``fp32`` the
    float32 side; every one a row-major CPU tensor; ``extra`` the caller's own condition),
    else None."""
    if not (extra and supports(codec, fp32.device) and _rows_ok(fp32, *others)
            and fp32.dtype == torch.float32):
        return None
    return _library()


def encode_into(codec, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Encode the fp32 rows ``x`` (rows, c) into ``out`` (rows, ``row_bytes(c)``) with the
    kernel, exactly as ``ScaledCodec._encode_rows_into``'s eager path; False (nothing
    written) where it cannot: a codec not in ``SPECS``, off the CPU, rows not of unit
    stride, the kernel off or not loaded."""
    if (lib := _ready(codec, x, out)) is None:
        return False
    if x.numel():
        per, _ = SPECS[codec.name]
        table = codec._table("codes", x.device)
        lib.loco_encode(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0],
                        x.shape[1], codec.block, per, table.data_ptr(), codec._F, codec._M,
                        int(codec.name == "int2"))
    return True


def decode_into(codec, buf: torch.Tensor, c: int, out: torch.Tensor) -> bool:
    """Decode the rows ``buf`` (rows, ``row_bytes(c)``) into the fp32 ``out`` (rows, c)
    with the kernel, exactly as ``ScaledCodec._decode_rows_into``'s eager path; False
    (nothing written) where it cannot, as for ``encode_into``."""
    if (lib := _ready(codec, out, buf)) is None:
        return False
    if out.numel():
        per, kind = SPECS[codec.name]
        values = codec._table(kind, out.device)  # per float32 values per byte, contiguous
        lib.loco_decode(buf.data_ptr(), buf.stride(0), out.data_ptr(), out.stride(0),
                        out.shape[0], c, codec.block, per, values.data_ptr(), codec._F)
    return True


def decode_mean_into(codec, buf: torch.Tensor, c: int, out: torch.Tensor,
                     divisor: int) -> bool:
    """``out`` (1, c) = the rows of ``buf`` (rows >= 2, ``row_bytes(c)`` each) decoded,
    added in rank order and divided by ``divisor``, in one pass: the bits of
    ``decode_into``, then ``torch.add`` of rows 0 and 1, ``add_`` of each later row and
    ``div_(divisor)``; False (nothing written) where it cannot, as for ``encode_into``, and
    for fewer than two rows or blocks over 256 values."""
    one_row = buf.shape[0] >= 2 and out.shape[0] == 1 and out.is_contiguous()
    if (lib := _ready(codec, out, buf, extra=one_row and codec.block <= 256)) is None:
        return False
    if out.numel():
        per, kind = SPECS[codec.name]
        values = codec._table(kind, out.device)
        lib.loco_decode_mean(buf.data_ptr(), buf.stride(0), out.data_ptr(), buf.shape[0], c,
                             codec.block, per, values.data_ptr(), codec._F, float(divisor))
    return True
