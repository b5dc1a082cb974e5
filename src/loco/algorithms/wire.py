"""The options of the methods that keep a global copy (DiLoCo and its kin): the copy's place,
the pseudo-gradients' wire format and its error feedback, eager updates, Streaming DiLoCo's
fragments, overlap and mixing, their checks and report words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loco.algorithms.fragments import PATTERNS
from loco.algorithms.sparse_wire import SPARSE_KEYS, sparse_choice
from loco.comm.codecs.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, SPARSE_LAYOUTS,
                                      SPARSE_MEANS, SPARSE_VALUES)
from loco.options import ConfigError, need, opt


@dataclass
class GlobalCopyOptions:
    """The options of a method that keeps a global copy apart from the replicas (DiLoCo)."""

    eval_replicas: bool = opt(False, "diloco, streaming: at the end also evaluate every "
                              "replica and the replicas' average, next to the global model "
                              "(the Streaming DiLoCo paper's Table 3); every worker evaluates "
                              "(noloco and local always do)")
    offload: bool = opt(False, "keep the global copy and outer optimizer state in CPU memory "
                        "(diloco, streaming)")
    eager: bool = opt(False, "eager updates (diloco, streaming; Kale et al. 2025): when a "
                      "sync is sent, take the outer step at once, with this worker's fresh "
                      "pseudo-gradient as its share of the average and the others' from an "
                      "earlier sync, on the worker's own global copy (diloco: the average "
                      "overlaps the whole round)")
    eager_variant: str | None = opt(None, "with --eager: 1-outer-step (the others' share "
                                    "from the fragment's previous sync, the paper's method; "
                                    "the default) or 2-outer-steps (from the one before)",
                                    ("1-outer-step", "2-outer-steps"))


@dataclass
class WireOptions(GlobalCopyOptions):
    """The wire format of a method that all-reduces pseudo-gradients (DiLoCo, Streaming
    DiLoCo, SparseLoCo), and its error feedback."""

    codec: str | None = opt(None, "wire format of the pseudo-gradients (diloco, streaming, "
                            "sparseloco); the reduction itself is fp32 (default: the "
                            "method's: diloco fp32, streaming fp4_e3m0, sparseloco topk_2bit)",
                            CODEC_NAMES)
    codec_keep: float | None = opt(None, "share of the values the sparse codecs send, in "
                                   "(0, 1]: of each row for topk, dare, random_drop (default "
                                   "1/8, the bytes of 4 bits per value), of each chunk for "
                                   "topk_2bit (default 1/64: 64 of 4096, SparseLoCo's)")
    codec_block: int | None = opt(None, "values per power-of-two scale of the 8-, 4- and 2-bit "
                                  "codecs (default 32; larger blocks send fewer scale bytes "
                                  "but clip less evenly), or per chunk of topk_2bit (default "
                                  "4096)")
    error_feedback: float | None = opt(None, "beta of the error feedback (diloco, streaming, "
                                       "sparseloco), in [0, 1): each worker keeps what its "
                                       "codec did not send, e <- beta e + delta, sends C(e) "
                                       "and keeps e - D(C(e)); 0: none (default: the "
                                       "method's: diloco and streaming 0, sparseloco 0.95)")
    sparse_layout: str | None = opt(None, "where topk_2bit's chunks lie: runs of --codec-block "
                                    "values of the flat fragment, or tiles: 2-D tiles of "
                                    "each tensor, sides the largest divisors <= 64, 1-D "
                                    "tensors sent whole (SparseLoCo's reference code) "
                                    "(default: the method's)", SPARSE_LAYOUTS)
    sparse_values: str | None = opt(None, "how topk_2bit codes its kept values: split (per "
                                    "chunk, sign and half) or stat (per tensor, 4 bins of "
                                    "1.5 sigma, the reference code's; needs --sparse-layout "
                                    "tiles) (default: the method's)", SPARSE_VALUES)
    sparse_mean: str | None = opt(None, "how topk_2bit's messages are averaged: all (over "
                                  "the M workers, the paper's box) or senders (each "
                                  "position over the workers that sent it, the reference "
                                  "code's) (default: the method's)", SPARSE_MEANS)


@dataclass
class StreamingOptions(WireOptions):
    """Streaming DiLoCo's own options: P, the pattern, τ and α."""

    fragments: int = opt(2, "P (streaming): fragments the model's blocks are split into, each "
                         "synced once every H steps: fragment p at step floor((p + 1) H / P) of "
                         "each round, so any P <= H works; the peak bytes of a sync are those "
                         "of the largest fragment")
    fragment_pattern: str = opt("strided", "how blocks are dealt to fragments (streaming): "
                                "strided (block i to fragment i mod P) or sequential",
                                PATTERNS)
    overlap: str = opt("1", "tau (streaming): inner steps a sync stays in flight while training "
                       "goes on, 0 <= tau < floor(H/P) (the smallest gap between two sends); "
                       "hides the transfer time. One integer for every worker, or one per "
                       "worker: 1,1,2,5")
    mixing: float = opt(0.5, "mixing factor alpha (streaming): share of the local parameters "
                        "kept when a synced fragment is merged back, in [0, 1]; 0 replaces "
                        "them (old name: --alpha)")


def overlaps(cfg) -> list[int]:
    """τ of every worker, from ``overlap`` (one integer for all, or one per worker).

    Args:
        cfg: the configuration (``overlap`` and ``workers``).

    Raises:
        ConfigError: not integers, or a list whose length is not ``workers``.
    """
    try:
        values = [int(v) for v in str(cfg.overlap).split(",")]
    except ValueError:
        raise ConfigError("overlap", f"expected an integer or one per worker such as 1,1,2,5 "
                          f"(got {cfg.overlap!r})") from None
    if len(values) == 1:
        return values * cfg.workers
    if len(values) != cfg.workers:
        raise ConfigError("overlap", f"gives {len(values)} values but there are {cfg.workers} "
                          f"workers; give one integer, or one per worker")
    return values


def outer_kwargs(cfg) -> dict[str, Any]:
    """H, the outer optimizer, ``offload`` and the wire (codec, its block and keep, error
    feedback), as a method with a global copy takes them."""
    return {"sync_every": cfg.sync_every, "outer_lr": cfg.outer_lr,
            "outer_momentum": cfg.outer_momentum, "nesterov": cfg.nesterov,
            "offload": cfg.offload, "codec": cfg.codec, "codec_block": cfg.codec_block,
            "codec_keep": cfg.codec_keep, "error_feedback": cfg.error_feedback or 0.0,
            "eager": cfg.eager, "eager_variant": cfg.eager_variant,
            "sparse_layout": cfg.sparse_layout,
            "sparse_values": cfg.sparse_values, "sparse_mean": cfg.sparse_mean}


def check_wire(cfg) -> None:
    """The wire options' ranges: keep in (0, 1], the block in [2, 65536] (even for 4 bits,
    a multiple of 4 for int2), error feedback's beta in [0, 1); eager updates not elastic.

    Raises:
        ConfigError: naming the first option out of range.
    """
    if cfg.codec_keep is not None:
        need(cfg, 0 < cfg.codec_keep <= 1, "codec_keep", "must be in (0, 1]")
    if cfg.codec_block is not None:
        per_byte = {"fp4_e3m0": 2, "fp4_e2m1": 2, "int2": 4}.get(cfg.codec, 1)
        need(cfg, 2 <= cfg.codec_block <= 65536 and cfg.codec_block % per_byte == 0,
             "codec_block", "must be an integer in [2, 65536]"
             + (f" and a multiple of {per_byte} with --codec {cfg.codec}" if per_byte > 1
                else ""))
    need(cfg, 0 <= cfg.error_feedback < 1, "error_feedback", "must be in [0, 1) (0: none)")
    for option in ("sparse_layout", "sparse_values", "sparse_mean"):
        need(cfg, getattr(cfg, option) is None or cfg.codec in CHUNK_TOPK_CODEC_NAMES, option,
             f"applies to --codec {' or '.join(CHUNK_TOPK_CODEC_NAMES)} (got --codec "
             f"{cfg.codec})")
    need(cfg, cfg.sparse_values != "stat" or cfg.sparse_layout == "tiles", "sparse_values",
         "stat bins each tensor's values: it needs --sparse-layout tiles")
    need(cfg, cfg.sparse_layout != "tiles" or cfg.worker_ranks == 1
         or cfg.worker_parallel == "fsdp",
         "sparse_layout", "tiles cut whole tensors: with --worker-ranks > 1 they need --fsdp "
         "(each rank tiles its own shards)")
    need(cfg, not (cfg.eager and cfg.elastic), "eager", "needs a fixed group of workers (a "
         "worker's share is 1/M): leave out --elastic")
    need(cfg, cfg.eager or cfg.eager_variant is None, "eager_variant", "applies only with "
         "--eager")


def wire_warnings(cfg) -> list[str]:
    """Error feedback on a lossless wire, or a top-k chunk format without it."""
    if cfg.error_feedback and cfg.codec == "fp32":
        return ["--error-feedback has nothing to feed back with --codec fp32 (lossless)"]
    if not cfg.error_feedback and cfg.codec in CHUNK_TOPK_CODEC_NAMES:
        return [f"--codec {cfg.codec} without --error-feedback: the values it does not send "
                "are lost (SparseLoCo keeps them, beta 0.95)"]
    return []


def wire_setting(config: dict, sparse: dict | None = None) -> str:
    """The report's words for the codec and the error feedback, ``", ..."``; a chunked top-k
    says its layout, values and mean: given, else the method's ``sparse`` defaults where
    they apply (as ``fragment_codecs`` chooses: tiles need whole tensors, which a worker of
    several ranks under DDP does not hold), else runs, split, the mean over all."""
    codec = config.get("codec") or "fp32"
    text = f", {codec}"
    if codec in CHUNK_TOPK_CODEC_NAMES:
        ranges = (config.get("worker_ranks") or 1) > 1 and config.get("worker_parallel") != "fsdp"
        layout, values, mean = sparse_choice(*(config.get(k) for k in SPARSE_KEYS), sparse,
                                             whole=not ranges)
        text += f" ({layout}, {values}, mean over {'the senders' if mean == 'senders' else 'all'})"
    beta = config.get("error_feedback") or 0
    return text + (f", error feedback β={beta:g}" if beta else "")


def check_arguments(sync_every: int, count: int, overlap: Any, alpha: float, outer_lr: float,
                     outer_momentum: float, outer_thread: Any, elastic: bool,
                     eager: bool = False, error_feedback: float = 0.0) -> None:
    """Streaming DiLoCo's constructor's ranges (see ``StreamingDiLoCo``).

    Raises:
        ValueError: naming the first argument out of range.
    """
    if count > sync_every:
        raise ValueError(f"fragments (P={count}) must be <= sync_every (H={sync_every}): "
                         "at most one fragment is sent per step")
    if not isinstance(overlap, int) or not 0 <= overlap < sync_every // count:
        raise ValueError(f"overlap (tau) must be an integer in [0, floor(H/P)) = "
                         f"[0, {sync_every // count}), the smallest gap between two sends "
                         f"(got {overlap!r})")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha!r})")
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0 (got {outer_lr!r})")
    if not 0 <= error_feedback < 1:
        raise ValueError(f"error_feedback (beta) must be in [0, 1) (got {error_feedback!r})")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1) (got {outer_momentum!r})")
    if outer_thread not in (None, True, False):
        raise ValueError(f"outer_thread must be None, True or False (got {outer_thread!r})")
    if outer_thread and elastic:
        raise ValueError("outer_thread=True needs a fixed group: an elastic comm retries "
                         "a sync on the training thread")
    if eager and (elastic or outer_thread):
        raise ValueError("eager updates need a fixed group of workers (their share is 1/M) "
                         "and step when a sync is sent, not on the outer thread (got "
                         f"elastic={elastic}, outer_thread={outer_thread})")


__all__ = ["GlobalCopyOptions", "StreamingOptions", "WireOptions", "check_arguments",
           "check_wire", "outer_kwargs", "overlaps", "wire_setting", "wire_warnings"]
