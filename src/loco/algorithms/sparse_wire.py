"""The chunked top-k's settings as a method with fragments applies them: the mean, and the
layout (one tiled codec per fragment, made from its tensors' shapes)."""

from __future__ import annotations

from typing import Any

from loco.comm.codecs.chunk_topk import ChunkTopKCodec
from loco.comm.codecs.formats import SPARSE_LAYOUTS, SPARSE_MEANS, SPARSE_VALUES
from loco.comm.codecs.tiles import tiled_codec

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
    whole = all(s.inner is None for s in shares)
    layout, values, codec.mean = sparse_choice(sparse_layout, sparse_values, sparse_mean,
                                               defaults, whole)
    if layout == "runs":
        if values == "stat":
            raise ValueError("sparse_values='stat' bins each tensor's values: it needs "
                             "sparse_layout='tiles'")
        return [codec] * len(shares)
    if not whole:
        raise ValueError("sparse_layout='tiles' cuts whole tensors: a worker of several "
                         "ranks needs them sharded whole (FSDP), not in ranges")
    return [tiled_codec(codec, [v.shape for v in s.views], values) for s in shares]


def sparse_choice(layout: str | None, values: str | None, mean: str | None,
                  defaults: dict | None, whole: bool) -> tuple[str, str, str]:
    """The layout, values and mean a chunked top-k runs with: each as given, else the
    method's ``defaults`` where it applies (tiles only on ``whole`` tensors, the values only
    with tiles), else runs, split, the mean over all.

    Args:
        layout: ``sparse_layout`` as given, or None.
        values: ``sparse_values`` as given, or None.
        mean: ``sparse_mean`` as given, or None.
        defaults: the method's choice of the three (SparseLoCo's), or None.
        whole: whether the worker's shares are whole tensors (one rank, or FSDP), not
            ranges of flat values (several ranks under DDP).
    """
    defaults = defaults or {}
    if layout is None and whole:
        layout = defaults.get("sparse_layout")
    layout = layout or "runs"
    if values is None and layout == "tiles":
        values = defaults.get("sparse_values")
    return layout, values or "split", mean or defaults.get("sparse_mean") or "all"


__all__ = ["SPARSE_KEYS", "fragment_codecs", "sparse_choice"]
