"""Every codec by its name: [`get_codec`][loco.comm.codecs.catalog.get_codec] makes it, its
block, keep and seed checked, its kernel chosen, and optionally tries it on a device first."""

from __future__ import annotations

import torch

from loco.comm.codecs.casts import CastCodec
from loco.comm.codecs.chunk_topk import ChunkTopKCodec
from loco.comm.codecs.contract import Codec
from loco.comm.codecs.dropping import RandomDropCodec, TopKCodec, check_sparse
from loco.comm.codecs.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, DEFAULT_CHUNK,
                                      DEFAULT_CHUNK_KEEP, DEFAULT_KEEP, SPARSE_CODEC_NAMES)
from loco.comm.codecs.fp4 import E2M1_GRID, E3M0_GRID, Fp4Codec
from loco.comm.codecs.fused import choose_kernel
from loco.comm.codecs.int2 import Int2Codec
from loco.comm.codecs.scaled import MAX_BLOCK, Fp8Codec, Int8Codec


def _make(name: str, block: int | None, keep: float | None = None, seed: int = 0) -> Codec:
    if name in SPARSE_CODEC_NAMES:
        keep = DEFAULT_KEEP if keep is None else keep
        check_sparse(name, keep, seed)
        return TopKCodec(keep) if name == "topk" else RandomDropCodec(name, keep, seed)
    if name == "fp32":
        return CastCodec(name, torch.float32)
    if name == "bf16":
        return CastCodec(name, torch.bfloat16)
    chunked = name in CHUNK_TOPK_CODEC_NAMES
    block = (DEFAULT_CHUNK if chunked else 32) if block is None else block
    per_byte = {"fp4_e3m0": 2, "fp4_e2m1": 2, "int2": 4}.get(name, 1)
    if (not isinstance(block, int) or isinstance(block, bool) or not 2 <= block <= MAX_BLOCK
            or block % per_byte):
        raise ValueError(f"codec {name}: block must be an int in [2, {MAX_BLOCK}]"
                         + (f" and a multiple of {per_byte} ({per_byte} values share a byte)"
                            if per_byte > 1 else "") + f", got {block!r}")
    if chunked:
        keep = DEFAULT_CHUNK_KEEP if keep is None else keep
        check_sparse(name, keep, 0)
        return ChunkTopKCodec(name, block, keep)
    if name == "fp8_e4m3":
        return Fp8Codec(name, block)
    if name == "int8":
        return Int8Codec(name, block)
    if name == "int2":
        return Int2Codec(name, block)
    return Fp4Codec(name, block, E3M0_GRID if name == "fp4_e3m0" else E2M1_GRID)


def get_codec(name: str, block: int | None = None, device: torch.device | str | None = None, *,
              keep: float | None = None, seed: int = 0, kernel: str | None = None) -> Codec:
    """The codec ``name`` (one of CODEC_NAMES).

    With ``device``, a round trip of exactly representable values runs there first, so a
    device that cannot run the format (e.g. no float8) fails now, not mid-training. For the
    dropping codecs the exact round trip is checked with every value kept, and the codec
    itself is run once.

    Args:
        name: one of [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES]: ``"fp32"``, ``"bf16"``,
            ``"fp8_e4m3"``, ``"int8"``, ``"fp4_e3m0"``, ``"fp4_e2m1"``, ``"topk"``,
            ``"dare"`` or ``"random_drop"``.
        block: values per power-of-two scale of the scaled codecs, an integer in
            [2, 65536], even for the 4-bit ones (two values share a byte), a multiple of 4
            for ``int2``; values per chunk of the chunked top-k codecs; default None: 32
            (scaled) or ``DEFAULT_CHUNK`` (4096, chunked); ignored by the casts and the
            dropping codecs.
        device: a device to try the codec on first; default None (no check).
        keep: the share of each row's values the dropping codecs send, and of each chunk's
            the chunked top-k codecs send, a number in (0, 1]; default None:
            ``DEFAULT_KEEP`` (1/8), or ``DEFAULT_CHUNK_KEEP`` (1/64, chunked); ignored by
            the other codecs.
        seed: keys the random draws of ``dare`` and ``random_drop``, an integer in
            [0, 2^64); default 0; ignored by the other codecs.
        kernel: ``"fused"`` (``torch.compile`` of the codec's code, compiled once per input
            shape, by [`prepare`][loco.comm.codecs.contract.Codec.prepare] or else at the shape's
            first call), ``"eager"`` (the reference) or ``"auto"`` (eager until ``prepare``
            is told of an all-reduce of at least ``FUSED_MIN_NUMEL`` values on a device
            where torch.compile can run, whose kernels it then compiles and runs fused;
            never compiles during training; eager for the casts ``fp32`` and ``bf16``, one
            kernel already); default None: the environment variable
            ``LOCO_CODEC_KERNEL``, else ``"auto"``. The dropping codecs always run
            eager. The codec's ``kernel`` attribute says which runs (``"fused"``: for
            every prepared all-reduce); a fused codec whose
            compilation fails warns once and runs eager from then on (``kernel`` becomes
            ``"eager"``, ``kernel_reason`` says why). Fused and eager give the same bits.

    Returns:
        The codec.

    Raises:
        ValueError: an unknown ``name``, a ``block`` out of range, a ``kernel`` not in
            `KERNELS`, or (dropping codecs) a ``keep`` or
            ``seed`` out of range.
        RuntimeError: the codec cannot run on ``device``.
    """
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    sparse = name in SPARSE_CODEC_NAMES + CHUNK_TOPK_CODEC_NAMES
    codec = _make(name, block, keep, seed) if sparse else _make(name, block)
    choose_kernel(codec, kernel, device)
    if device is not None:
        try:
            x = torch.tensor(codec.PROBE, device=device).repeat(codec.align)
            # the probe runs the eager reference: compiling a shape no run uses costs seconds
            exact = _make(name, block, 1.0, seed) if sparse else _make(name, block)
            want = torch.tensor(codec.PROBE_DECODED or codec.PROBE, device=device).repeat(
                codec.align)
            if not torch.equal(exact.decode(exact.encode(x), x.shape), want):
                raise ValueError("round trip of exactly representable values changed them")
            if sparse and codec.decode(codec.encode(x), x.shape).shape != x.shape:
                raise ValueError("decoding gave the wrong shape")
        except Exception as err:
            raise RuntimeError(f"codec {name} cannot run on {device}: {err}") from err
    return codec
