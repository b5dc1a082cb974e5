"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512); DiLoCo is its special case.

The model is split into P fragments, each with its own global copy θ^g_p and outer optimizer.
Every worker m runs inner steps (AdamW) on its own data and, after inner step t:

1. if ``t % H == ((p + 1) H / P) % H``, sends fragment p: the pseudo-gradient
   ``Δ_{m,p} = θ^g_p − θ_{m,p}(t)`` (old global minus new local) is encoded with the codec
   (4-bit E3M0 by default) and its mean over workers ``Δ̄_p`` is *started* asynchronously;
2. at ``t + τ`` (τ inner steps of compute later, τ < H / P so one fragment is in flight at a
   time) waits for ``Δ̄_p``, steps ``θ^g_p ← OuterOpt_p(θ^g_p, Δ̄_p)`` (Nesterov SGD, fp32)
   and merges it into the working copy, which has moved on meanwhile:
   ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``.

With P = 1, τ = 0, α = 0 and fp32 this is DiLoCo (:class:`loco.DiLoCo`). Its parts: the
schedule (which fragment syncs when, τ: ``loco.algorithms.schedule``), the fragments and
their state (global copy and outer optimizer per fragment: ``loco.algorithms.fragments``),
the merge (α: ``loco.algorithms.merge``), and the outer loop that runs them, shared with
DiLoCo (``loco.algorithms.global_copy``). This file holds the method: its options and their
checks, how a configuration builds it, and what the report says of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loco.algorithms.diloco import (GlobalCopyOptions, WireOptions, check_wire, outer_kwargs,
                                    wire_setting, wire_warnings)
from loco.algorithms.fragments import PATTERNS, split_fragments
from loco.algorithms.fragments import flat_outer_state as _flat_outer_state  # noqa: F401
from loco.algorithms.global_copy import GlobalCopy
from loco.algorithms.method import PaperClaim
from loco.algorithms.schedule import send_offsets
from loco.comm import Comm
from loco.lazy import renamed_arguments
from loco.options import ConfigError, need, opt


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
        values = [int(v) for v in str(cfg.method.overlap).split(",")]
    except ValueError:
        raise ConfigError("overlap", f"expected an integer or one per worker such as 1,1,2,5 "
                          f"(got {cfg.method.overlap!r})") from None
    if len(values) == 1:
        return values * cfg.runtime.workers
    if len(values) != cfg.runtime.workers:
        raise ConfigError("overlap", f"gives {len(values)} values but there are {cfg.runtime.workers} "
                          f"workers; give one integer, or one per worker")
    return values


def _fragment_spec(cfg, model: nn.Module, tied: bool) -> int | list:
    """P (``fragments``), or for a pipeline stage that holds a copy of the tied embedding,
    name lists with it in fragment 0: its two copies (first and last stage) must be synced
    at the same steps to stay identical."""
    if not tied:
        return cfg.method.fragments
    names = split_fragments(model, cfg.method.fragments, cfg.method.fragment_pattern)
    fragments = [[n for n in group if n != "embed.weight"] for group in names]
    fragments[0].append("embed.weight")
    return fragments


class StreamingDiLoCo(GlobalCopy):
    """Streaming DiLoCo outer loop around any inner optimizer.

    Fragment p of the P fragments is sent after inner step t when
    ``t % H == ((p + 1) H / P) % H``: its pseudo-gradient ``Δ_{m,p} = θ^g_p − θ_{m,p}`` is
    encoded with the codec and averaged over the M workers while training goes on. τ inner
    steps later the outer step ``θ^g_p ← OuterOpt_p(θ^g_p, Δ̄_p)`` (SGD, fp32) is applied and
    merged into the working copy: ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``. With P = 1,
    τ = 0, α = 0 and fp32 it is DiLoCo. The cycle is the outer loop of
    [`GlobalCopy`][loco.algorithms.global_copy.GlobalCopy], which also documents the
    arguments the two methods share.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters (paper: AdamW).
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between two syncs of the same fragment; an integer >= 1,
            default 100.
        fragments: P, the number of fragments the blocks are split into, an integer in
            [1, number of blocks] and <= H (default 1: the whole model at once); or an
            explicit list whose items are modules, parameter names, or lists of them (see
            [`split_fragments`][loco.algorithms.fragments.split_fragments]), of length <= H.
            Fragment p is sent at the steps of
            [`send_offsets`][loco.algorithms.schedule.send_offsets]; P need not divide H.
        fragment_pattern: how blocks are dealt out for an integer P > 1: ``"strided"``
            (default, the paper's: block i to fragment i mod P) or ``"sequential"``
            (contiguous runs). (``pattern=``, its old name, is read for one release.)
        overlap: τ, inner steps a sync stays in flight before it is applied; an integer with
            0 <= τ < floor(H / P), the smallest gap between two sends; default 1 (0: applied
            right after it was sent, no overlap). Workers may use different τ (the paper's
            robustness experiment): every worker sends at the same steps and applies τ later.
        mixing: α, the share of the local parameters kept when a synced fragment is merged
            back, 0 <= α <= 1; default 0.5 (0: replaced by the global value). (``alpha=``,
            its old name, is read for one release.)
        codec: wire format of the pseudo-gradients, one of
            [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES]; default ``"fp4_e3m0"`` (4-bit, the
            paper's). The reduction itself is fp32.
        codec_block: as for ``GlobalCopy``; default None: 32, or 4096 for ``topk_2bit``.
        codec_keep: as for ``GlobalCopy``; default None (the codec's own).
        error_feedback: β of the error feedback, in [0, 1), as for ``GlobalCopy``; default
            0 (none).
        outer_lr: learning rate of the outer SGD, > 0; default 0.4 (the paper's).
        outer_momentum: momentum of the outer SGD, in [0, 1); default 0.9 (the paper's).
        nesterov: Nesterov momentum (default True, the paper's) or heavy-ball (False);
            without effect when ``outer_momentum`` is 0.
        offload: keep the global copy θ^g and the outer optimizer state in CPU memory
            instead of on the parameters' device (default False).
        outer_thread: compute each outer step on a helper thread, as for ``GlobalCopy``;
            default None: when it pays (``offload`` from an accelerator and τ >= 1).
        eager: eager updates, as for ``GlobalCopy``; default False.
        eager_variant: as for ``GlobalCopy``; default None (``"1-outer-step"``).
        **kwargs: a chunked top-k's settings (``sparse_layout``, ``sparse_values``,
            ``sparse_mean``) as for ``GlobalCopy``; the rest passed to
            [`Algorithm`][loco.algorithms.base.Algorithm]: ``max_grad_norm``,
            ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of several ranks:
            ``ctx.inner``).

    Raises:
        ValueError: an argument outside the ranges above (also from
            [`split_fragments`][loco.algorithms.fragments.split_fragments] for a bad
            ``fragments`` or ``fragment_pattern``, and from
            [`get_codec`][loco.comm.codecs.catalog.get_codec] for a bad ``codec`` or
            ``codec_block``).
        RuntimeError: the codec cannot run on ``comm``'s device, or the workers' initial
            state differs.
    """

    name = "streaming"
    title = "Streaming DiLoCo"
    options = StreamingOptions
    # H = 50, not the paper's 100, for loco train: its default job (400 steps) then has 8
    # rounds, where its loss is within 2% of DiLoCo's (docs/getting-started.md); the class's
    # own default stays the paper's.
    defaults = {"sync_every": 50, "outer_lr": 0.4, "outer_momentum": 0.9, "nesterov": True,
                "codec": "fp4_e3m0", "error_feedback": 0.0}
    claims = (
        PaperClaim("loss", "twin", 1, want={"codec": "fp32"}, free=("codec_block", "codec_chunk", "codec_keep")),
        PaperClaim("loss", "diloco", 2),
        PaperClaim("bytes", "ddp", 100),
        PaperClaim("peak", "diloco"),
        PaperClaim("loss", "twin", 0, want={"eager": False},
                   text="no worse than {ref}'s (the same τ without eager updates)"),
        PaperClaim("loss", "twin", 0, want={"eager": False, "overlap": "1"}, free=("overlap",),
                   text="no worse than {ref}'s (τ = 1 without eager updates)"),
    )

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """P within the smallest stage's blocks and H, every τ below floor(H/P), α in
        [0, 1], the sparse codecs' keep in (0, 1], an even codec block in [2, 65536]."""
        blocks = layers // cfg.runtime.stages  # the smallest stage's blocks
        need(cfg, 1 <= cfg.method.fragments <= blocks, "fragments",
             f"must be in [1, {blocks}], the number of blocks of the {cfg.model.name} model"
             + (f" in its smallest of {cfg.runtime.stages} pipeline stages" if cfg.runtime.stages > 1 else ""))
        need(cfg, cfg.method.fragments <= cfg.method.sync_every, "fragments",
             f"must be <= --sync-every ({cfg.method.sync_every}): at most one fragment per step")
        gap = cfg.method.sync_every // cfg.method.fragments  # the smallest gap between two sends
        need(cfg, all(0 <= t < gap for t in overlaps(cfg)), "overlap",
             f"every value must be in [0, floor(H/P)) = [0, {gap}), the smallest gap between "
             f"two sends, with --sync-every {cfg.method.sync_every} and --fragments {cfg.method.fragments}")
        need(cfg, 0 <= cfg.method.mixing <= 1, "mixing", "must be in [0, 1]")
        check_wire(cfg)

    @classmethod
    def warnings(cls, cfg) -> list[str]:
        """Fewer inner steps than H: some fragments never sync; the wire's warnings."""
        if cfg.run.steps < cfg.method.sync_every:
            return [f"--steps {cfg.run.steps} is less than --sync-every {cfg.method.sync_every}: some "
                    "fragments never sync"] + wire_warnings(cfg)
        return wire_warnings(cfg)

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """H, the outer optimizer, the wire, P (with a tied embedding's copies in fragment
        0), the pattern, this replica's τ and α."""
        tied = pipeline is not None and pipeline.module.tied is not None
        return {**outer_kwargs(cfg), "fragments": _fragment_spec(cfg, model, tied),
                "fragment_pattern": cfg.method.fragment_pattern,
                "overlap": overlaps(cfg)[comm.rank],  # the outer Comm's rank: the replica
                "mixing": cfg.method.mixing}

    @classmethod
    def setting(cls, config: dict) -> str:
        """H, the outer optimizer, P, τ, α and the codec."""
        mixing = config.get("mixing", config.get("alpha"))  # runs saved before the rename
        return (super().setting(config) + f", P={config['fragments']}, "
                f"τ={config['overlap']}, α={mixing}" + wire_setting(config, cls.sparse_defaults))

    @classmethod
    def checkpoint_delay(cls, cfg) -> int:
        """The largest τ: a fragment sent at a round's end is applied τ steps later."""
        return max(overlaps(cfg))

    @classmethod
    def fragment_names(cls, cfg, module, tied: bool) -> list[list[str]]:
        """The fragments as ``kwargs`` builds them (a tied embedding's copy in fragment 0)."""
        return split_fragments(module, _fragment_spec(cfg, module, tied), cfg.method.fragment_pattern)

    @renamed_arguments("StreamingDiLoCo", {"alpha": "mixing", "pattern": "fragment_pattern"})
    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sync_every: int = 100, fragments: int | Sequence = 1,
                 fragment_pattern: str = "strided", overlap: int = 1,
                 mixing: float = 0.5, codec: str = "fp4_e3m0", codec_block: int | None = None,
                 codec_keep: float | None = None, error_feedback: float = 0.0,
                 outer_lr: float = 0.4, outer_momentum: float = 0.9, nesterov: bool = True,
                 offload: bool = False, outer_thread: bool | None = None, eager: bool = False,
                 eager_variant: str | None = None, **kwargs: Any):
        super().__init__(model, inner_optimizer, comm, sync_every=sync_every,
                         fragments=fragments, pattern=fragment_pattern, overlap=overlap,
                         alpha=mixing,
                         codec=codec, codec_block=codec_block, codec_keep=codec_keep,
                         error_feedback=error_feedback, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, nesterov=nesterov, offload=offload,
                         outer_thread=outer_thread, eager=eager, eager_variant=eager_variant,
                         **kwargs)
        self.fragment_pattern = fragment_pattern


__all__ = ["PATTERNS", "GlobalCopyOptions", "StreamingDiLoCo", "StreamingOptions", "WireOptions",
           "check_wire", "overlaps", "send_offsets", "wire_setting", "wire_warnings"]
