"""Fused kernels for the codecs: ``torch.compile`` of a codec's one definition of encoding and
decoding, compiled once per input shape and shared by every codec of the same class, name and
block in the process, and the choice between them and the eager reference.

A kernel is cached per input key (shapes, strides, dtypes, device, and ``c`` for decoding),
each a compile of its own copy of the method's code. The first call of a key (the one that
compiles) runs under a module lock, as TorchDynamo must not compile from several threads at
once; later calls of that key take no lock. See "Fused kernels" in ``docs/codecs.md``.
"""

from __future__ import annotations

import os
import threading
import types
import warnings
from typing import Any

import torch

from loco.comm.codecs import cpp_kernel
from loco.comm.codecs.formats import CAST_CODEC_NAMES, FUSED_CODEC_NAMES
from loco.comm.reduce import Buffers, layout, reduce_mean

KERNELS = ("auto", "eager", "fused")
"""The choices of ``get_codec(kernel=...)``: ``"fused"`` compiles each codec's encode and decode
(``torch.compile`` of the eager code: C++ on CPU, Triton on GPU) for every input shape, at
[`prepare`][loco.comm.codecs.contract.Codec.prepare] or else at its first call; ``"eager"`` runs the
reference; ``"auto"`` (the default) is fused for the all-reduces that ``prepare`` is told of
with at least ``FUSED_MIN_NUMEL`` values, where ``torch.compile`` can run, and eager for all
else (the casts, smaller all-reduces, a codec never prepared): it never compiles during
training."""
KERNEL_ENV = "LOCO_CODEC_KERNEL"
"""The environment variable that gives the default of ``get_codec(kernel=...)``; unset: auto."""
FUSED_MIN_NUMEL = 1 << 22
"""``"auto"``: the fewest values (4,194,304) of an all-reduce that
[`prepare`][loco.comm.codecs.contract.Codec.prepare] compiles fused kernels for; smaller ones run
eager (why this size: "Fused kernels" in ``docs/codecs.md``)."""

_COMPILE_LOCK = threading.Lock()
_KERNELS: dict = {}  # (class, name, block, op, input key) -> compiled callable
_FAILED: dict = {}  # (class, name, block) -> why compiling failed (warned once)
_COMPILES = [0]  # kernels compiled in this process


def compile_count() -> int:
    """How many fused kernels this process has compiled (one per codec, operation and input
    shape): a second call with the same shape must not change it."""
    return _COMPILES[0]


def kernel_in_use(codec: Any) -> str:
    """``"fused"`` or ``"eager"``: how ``codec`` encodes and decodes now (it can turn from fused
    to eager, once, when compiling fails; ``codec.kernel_reason`` says why), for the run to
    print and record.

    Args:
        codec: a codec from [`get_codec`][loco.comm.codecs.catalog.get_codec].
    """
    return codec.kernel


def fused_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``torch.compile`` can be expected to build fused kernels for ``device``
    (default: the CPU), and if not, why. It checks the prerequisites (Dynamo supports this
    Python, a C++ compiler for the CPU, Triton for GPUs); a compile that still fails falls
    back to eager with a warning.

    Args:
        device: the device the codec will run on; default None (the CPU).
    """
    dev = torch.device("cpu" if device is None else device)
    if dev.type not in _SUPPORTED:  # once per device type: finding a compiler runs it
        _SUPPORTED[dev.type] = _fused_supported(dev)
    return _SUPPORTED[dev.type]


_SUPPORTED: dict = {}  # device type -> fused_supported's answer


def _fused_supported(dev: torch.device) -> tuple[bool, str]:
    try:
        from torch import _dynamo

        if not _dynamo.is_dynamo_supported():
            return False, "torch.compile does not support this Python"
        if dev.type == "cpu":
            from torch._inductor import cpp_builder

            cxx = cpp_builder.get_cpp_compiler()
            if not cxx:
                return False, "no C++ compiler for the CPU"
        elif dev.type in ("cuda", "xpu"):
            from torch.utils._triton import has_triton

            if not has_triton():
                return False, f"no Triton for {dev.type}"
        else:
            return False, f"no fused kernels for device type {dev.type}"
    except Exception as err:  # no compiler found, inductor import failed, ...
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def choose_kernel(codec: Any, kernel: str | None, device) -> Any:
    """Set how ``codec`` runs: its ``kernel`` and ``kernel_reason`` as ``get_codec(kernel=...)``
    asks (see [`get_codec`][loco.comm.codecs.catalog.get_codec]).

    Args:
        codec: a codec just made.
        kernel: one of ``KERNELS``, or None: ``LOCO_CODEC_KERNEL``, else ``"auto"``.
        device: where it will run (for ``"auto"``: can ``torch.compile`` run there?).

    Returns:
        ``codec``.

    Raises:
        ValueError: a ``kernel`` not in ``KERNELS``.
    """
    if kernel is None and not os.environ.get(KERNEL_ENV, "").strip():
        kernel, source = "auto", f"{KERNEL_ENV} unset: auto"
    elif kernel is None:
        kernel = os.environ[KERNEL_ENV].strip().lower()
        source = f"{KERNEL_ENV}={kernel}"
    else:
        source = f"kernel={kernel!r}"
    if kernel not in KERNELS:
        raise ValueError(f"codec {codec.name}: {source} is not one of {', '.join(KERNELS)}")
    codec._mode, codec._source, codec._small = kernel, source, []
    mode, reason = kernel, source
    if codec.name not in FUSED_CODEC_NAMES:
        mode, reason = "eager", "the dropping codecs have no fused kernel"
    elif kernel != "eager" and (failed := _FAILED.get(_spec(codec))) is not None:
        mode, reason = "eager", failed
    elif kernel == "auto" and codec.name in CAST_CODEC_NAMES:  # one ATen kernel already
        mode, reason = "eager", f"{source}: a cast is one kernel eager (fused is not faster)"
    elif kernel == "auto":
        ok, why = fused_supported(device)
        mode = "auto" if ok else "eager"
        reason = f"{source}: " + (f"eager until prepare() compiles fused kernels (all-reduces "
                                  f"of at least {FUSED_MIN_NUMEL} values)" if ok else why)
    codec._mode, codec.kernel_reason = mode, reason
    codec.kernel = "fused" if mode == "fused" else "eager"
    return codec


def prepare(codec: Any, numel: int, parts: int, device) -> str:
    """[`Codec.prepare`][loco.comm.codecs.contract.Codec.prepare]: compile, now, the fused
    kernels of an all-reduce of ``numel`` values over ``parts`` workers, by running
    [`reduce_mean`][loco.comm.reduce.reduce_mean] on zeros over a loopback; and load the
    eager path's C++ kernel where the codec uses it (``loco.comm.codecs.cpp_kernel``).

    Args:
        codec: the codec.
        numel: values of the tensor, an int >= 0.
        parts: workers, an int >= 1.
        device: where the all-reduce runs; None: the CPU.

    Returns:
        ``"fused"`` or ``"eager"``, as ``Codec.prepare``.

    Raises:
        ValueError: ``numel`` or ``parts`` is not an int in range.
    """
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"{codec}: prepare: numel must be an int >= 0, got {numel!r}")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"{codec}: prepare: parts must be an int >= 1, got {parts!r}")
    dev = torch.device("cpu" if device is None else device)
    if numel:  # the eager path's C++ kernel (FP4, int2 on the CPU): loaded now, not mid-sync
        cpp_kernel.warm(codec, dev)
    if codec._mode == "eager" or numel == 0:
        return "eager"
    if codec._mode == "auto":
        ok, why = fused_supported(dev)
        if not ok:
            codec._mode, codec.kernel = "eager", "eager"
            codec.kernel_reason = f"{codec._source}: {why}"
            return "eager"
        if numel < FUSED_MIN_NUMEL:
            if (numel, parts) not in codec._small:
                codec._small = [*codec._small, (numel, parts)]
                _say_auto(codec)
            return "eager"
    plan = _spec(codec) + (numel, parts, dev)
    if not _PLANS.get(plan, {None}) <= _KERNELS.keys():
        codec.kernel = "fused"  # what _compile_and_run turns back on failure
        _PLANS[plan] = _loopback(codec, numel, parts, dev)
        if codec._mode == "eager":  # compiling failed (warned)
            return "eager"
    if codec._mode == "auto":
        codec.kernel = "fused"
        _say_auto(codec)
    return "fused"


_PLANS: dict = {}  # (class, name, block, numel, parts, device) -> the kernel keys it runs
_PREPARING = threading.local()  # .keys: the keys run by this thread's prepare, else absent


def _loopback(codec: Any, numel: int, parts: int, dev: torch.device) -> frozenset:
    """Run the all-reduce's codec calls on zeros, every worker's data being this one's,
    compiling every kernel missing; the keys of the kernels it ran."""
    chunk, _ = layout(numel, parts, codec, 4)
    flat = torch.zeros(numel, dtype=torch.float32, device=dev)
    _PREPARING.keys = set()
    try:
        reduce_mean(flat, chunk, codec, parts, parts, Buffers(dev),
                    lambda received, outgoing: received.copy_(outgoing),
                    lambda out, tensor: [o.copy_(tensor) for o in out])
        return frozenset(_PREPARING.keys)
    finally:
        del _PREPARING.keys


def _say_auto(codec: Any) -> None:
    small = ", ".join(f"{n} over {p}" for n, p in codec._small)
    if codec.kernel == "fused":
        codec.kernel_reason = (f"{codec._source}: fused kernels compiled by prepare() for "
                               f"all-reduces of at least {FUSED_MIN_NUMEL} values"
                               + (f"; eager for the smaller ones ({small})" if small else ""))
    else:
        codec.kernel_reason = (f"{codec._source}: eager, all-reduces below "
                               f"{FUSED_MIN_NUMEL} values ({small}) do not pay back "
                               f"compiling")



def _spec(codec: Any) -> tuple:
    return type(codec), codec.name, codec.block


def _key(a) -> tuple:
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.stride(), a.dtype, a.device
    return a


def _canonical(a):
    # What a fused kernel is compiled for and called with: contiguous tensors whose data
    # start 16-byte aligned (a slice of a bigger message, e.g. NoLoCo's payloads, is copied
    # first), so that a kernel's key is its shapes, dtypes and device alone and no alignment
    # or stride variant ever needs a compile of its own inside training.
    if isinstance(a, torch.Tensor) and (not a.is_contiguous()
                                        or a.storage_offset() * a.element_size() % 16):
        return a.clone(memory_format=torch.contiguous_format)
    return a


def is_canonical(t: torch.Tensor) -> bool:
    """Whether a fused kernel can take ``t`` as it is: contiguous, its data 16-byte aligned.

    Args:
        t: a tensor.
    """
    return t.is_contiguous() and t.storage_offset() * t.element_size() % 16 == 0


def _compiled(method):
    """torch.compile of a fresh copy of a bound method's code (its own Dynamo cache)."""
    f = method.__func__
    fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__,
                               f.__defaults__, f.__closure__)
    return torch.compile(types.MethodType(fresh, method.__self__), fullgraph=True,
                         dynamic=False)


def _first_lines(err: Exception, limit: int = 240) -> str:
    """The start of an error's message on one line (Dynamo's run to pages)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_kernel(codec: Any, op: str, fn, *args):
    """Run ``fn(*args)`` (the codec's one definition of ``op``) eagerly or as its fused kernel.
    A forced fused codec compiles a new input key once, under the lock; an ``auto`` one
    compiles only inside [`prepare`][loco.comm.codecs.contract.Codec.prepare] and runs eager
    for a key it did not prepare. A failed compile falls back to eager, with one warning.

    Args:
        codec: the codec whose kernel runs.
        op: ``"encode"``, ``"decode"``, ``"encode_into"`` or ``"decode_into"``.
        fn: the codec's bound method that defines ``op``.
        *args: its arguments (tensors and ints).
    """
    if codec.kernel != "fused":
        return fn(*args)
    args = tuple(_canonical(a) for a in args)
    key = _spec(codec) + (op,) + tuple(_key(a) for a in args)
    preparing = getattr(_PREPARING, "keys", None)
    if preparing is not None:
        preparing.add(key)
    kernel = _KERNELS.get(key)
    if kernel is not None:  # the steady state: no lock
        with torch.no_grad():  # grad mode is thread-local, and a compiled kernel guards on it
            return kernel(*args)
    if codec._mode == "auto" and preparing is None:  # not prepared: eager
        return fn(*args)
    return _compile_and_run(codec, key, fn, args, stacklevel=4)


def _compile_and_run(codec: Any, key: tuple, fn, args: tuple, stacklevel: int = 3):
    """Compile ``fn`` for ``key`` (unless a kernel or a failure is there already), under the
    lock, and run it on ``args``; on failure warn once, turn ``codec`` eager and run eager."""
    spec = key[:3]
    with _COMPILE_LOCK, torch.no_grad():
        kernel = _KERNELS.get(key)
        if kernel is not None:  # another thread compiled it meanwhile
            return kernel(*args)
        if spec in _FAILED:  # another codec of this kind failed meanwhile
            codec.kernel, codec.kernel_reason, codec._mode = "eager", _FAILED[spec], "eager"
            return fn(*args)
        try:
            kernel = _compiled(fn)
            out = kernel(*args)  # compiles now
        except Exception as err:
            why = f"compiling failed: {type(err).__name__}: {_first_lines(err)}"
            _FAILED[spec] = why
            codec.kernel, codec.kernel_reason, codec._mode = "eager", why, "eager"
            warnings.warn(f"codec {codec!r}: fused kernel unavailable, running eager ({why})",
                          RuntimeWarning, stacklevel=stacklevel)
            return fn(*args)
        _KERNELS[key] = kernel
        _COMPILES[0] += 1
        return out
