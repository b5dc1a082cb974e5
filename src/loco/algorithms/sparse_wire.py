"""The chunked top-k's settings as a method with fragments applies them: the mean, and the
layout (one tiled codec per fragment, made from its tensors' shapes)."""

from __future__ import annotations

from typing import Any

from loco.comm.chunked import ChunkTopKCodec
from loco.comm.formats import SPARSE_LAYOUTS, SPARSE_MEANS, SPARSE_VALUES
from loco.comm.tiles import tiled_codec

SPARSE_KEYS = ("sparse_layout", "sparse_values", "sparse_mean")
"""The constructor arguments of the methods with fragments that set a chunked top-k."""


def fragment_codecs(codec: Any, shares: list, sparse_layout: str | None = None,
                    sparse_values: str | None = None, sparse_mean: str | None = None,
                    defaults: dict | None = None) -> list:
    """Each fragment's codec: ``codec`` itself, or its tiled twin for the fragment.

    Args:
        codec: the method's codec (from ``get_codec``).
        shares: each fragment's [`Share`][loco.algorithms.sharding.Share] (its ``views``,
            the tensors in the flat order).
        sparse_layout: ``"runs"`` or ``"tiles"``; default None: the method's.
        sparse_values: ``"split"`` or ``"stat"`` (tiles only); default None: the method's.
        sparse_mean: ``"all"`` or ``"senders"``, set on ``codec``; default None: the
            method's.
        defaults: the method's choice of the three where not given (SparseLoCo's); each
            applies where it can: with a chunked top-k codec, tiles on whole tensors, stat
            with tiles; default None: runs, split, all.

    Raises:
        ValueError: a setting out of range, one given for a codec that is not a chunked
            top-k, ``"stat"`` without tiles, or tiles over ranges of flat values (a worker
            of several ranks that does not shard whole tensors).
    """
    given = {"sparse_layout": (sparse_layout, SPARSE_LAYOUTS),
             "sparse_values": (sparse_values, SPARSE_VALUES),
             "sparse_mean": (sparse_mean, SPARSE_MEANS)}
    for name, (value, allowed) in given.items():
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)} (got {value!r})")
        if value is not None and not isinstance(codec, ChunkTopKCodec):
            raise ValueError(f"{name} applies to the chunked top-k codecs (got {codec.name})")
    if not isinstance(codec, ChunkTopKCodec):
        return [codec] * len(shares)
    defaults = defaults or {}
    whole = all(s.inner is None for s in shares)
    if sparse_layout is None and whole:
        sparse_layout = defaults.get("sparse_layout")
    if sparse_values is None and sparse_layout == "tiles":
        sparse_values = defaults.get("sparse_values")
    codec.mean = sparse_mean or defaults.get("sparse_mean") or "all"
    if (sparse_layout or "runs") == "runs":
        if sparse_values == "stat":
            raise ValueError("sparse_values='stat' bins each tensor's values: it needs "
                             "sparse_layout='tiles'")
        return [codec] * len(shares)
    if any(s.inner is not None for s in shares):
        raise ValueError("sparse_layout='tiles' cuts whole tensors: a worker of several "
                         "ranks needs them sharded whole (FSDP), not in ranges")
    return [tiled_codec(codec, [v.shape for v in s.views], sparse_values or "split")
            for s in shares]


__all__ = ["SPARSE_KEYS", "fragment_codecs"]
