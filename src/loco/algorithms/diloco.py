"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

Each worker m runs H inner optimizer steps (AdamW) on its own data, then every worker:

1. forms the pseudo-gradient  Δ_m = θ^g − θ_m   (old global minus new local);
2. averages it in fp32:       Δ̄ = mean_m Δ_m;
3. takes an outer step:       θ^g ← OuterOpt(θ^g, Δ̄)   (SGD with Nesterov momentum);
4. restarts from it:          θ_m ← θ^g.

The inner optimizer state is kept across rounds. The round runs through the outer loop of
the methods with a global copy ([`GlobalCopy`][loco.algorithms.global_copy.GlobalCopy]) with
one fragment, no overlap (τ = 0: training waits for the average) and α = 0 (the replica takes
the global copy): ``step()`` is ``inner_update()``, then at every H-th step
``pseudo_gradient``, the all-reduce, the outer step and ``merge``.

DiLoCo's options are the global copy's place, the pseudo-gradients' wire format and its error
feedback, and eager updates (Streaming DiLoCo and SparseLoCo take them too), and the outer
rule; their checks and report words are at the end of this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loco.algorithms.asynchronous import check_whole_model
from loco.algorithms.delayed_nesterov import (OuterRuleOptions, check_outer_rule, pending_state,
                                              rule_kwargs, rule_setting, use_delayed_nesterov)
from loco.algorithms.global_copy import GlobalCopy
from loco.algorithms.method import PaperClaim, leftover_steps
from loco.algorithms.sparse_wire import SPARSE_KEYS, sparse_choice
from loco.comm import Comm
from loco.comm.codecs.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES, SPARSE_LAYOUTS,
                               SPARSE_MEANS, SPARSE_VALUES)
from loco.options import need, opt


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
                                  "but clip less evenly); with topk_2bit read as --codec-chunk "
                                  "for one release, with a deprecation line")
    codec_chunk: int | None = opt(None, "values per chunk of topk_2bit and topk_2bit_packed, "
                                  "each keeping its top --codec-keep share, in [2, 65536] "
                                  "(default 4096, SparseLoCo's)")
    error_feedback: float | None = opt(None, "beta of the error feedback (diloco, streaming, "
                                       "sparseloco), in [0, 1): each worker keeps what its "
                                       "codec did not send, e <- beta e + delta, sends C(e) "
                                       "and keeps e - D(C(e)); 0: none (default: the "
                                       "method's: diloco and streaming 0, sparseloco 0.95)")
    sparse_layout: str | None = opt(None, "where topk_2bit's chunks lie: runs of --codec-chunk "
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
class DiLoCoOptions(WireOptions, OuterRuleOptions):
    """DiLoCo's own options: the wire (Streaming DiLoCo's P, τ and α do not apply) and
    the outer rule."""


class DiLoCo(GlobalCopy):
    """DiLoCo outer loop around any inner optimizer.

    Every H inner steps the whole model is synchronized, and training waits for it (the
    outer loop of [`GlobalCopy`][loco.algorithms.global_copy.GlobalCopy] with one fragment,
    τ = 0 and α = 0). The pseudo-gradients travel in fp32 by default (the paper's); a lossy
    ``codec`` may be given, with error feedback.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters (paper: AdamW).
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between outer steps; an integer >= 1, default 500 (the
            paper's).
        outer_lr: outer learning rate, > 0; default 0.7 (the paper's).
        outer_momentum: outer momentum μ, in [0, 1); default 0.9 (the paper's).
        nesterov: Nesterov momentum (default True, the paper's) or heavy-ball (False).
        offload: keep the global copy and the outer momentum in CPU memory (default False).
        codec: wire format of the pseudo-gradients (default ``"fp32"``, the paper's); see
            [`GlobalCopy`][loco.algorithms.global_copy.GlobalCopy] for it, ``codec_block``
            and ``codec_keep``.
        codec_block: as for ``GlobalCopy``; default None (the codec's).
        codec_keep: as for ``GlobalCopy``; default None (the codec's).
        error_feedback: β of the error feedback, in [0, 1), as for ``GlobalCopy``;
            default 0 (none).
        eager: eager updates (see [`Eager`][loco.algorithms.eager.Eager]): the worker
            takes its outer step when it sends its pseudo-gradient, with it for its share
            and the others' from an earlier round, and the average overlaps the whole next
            round (it is waited for at the step before the next sync, τ = H − 1); default
            False.
        eager_variant: ``"1-outer-step"`` (the others' share from the previous round) or
            ``"2-outer-steps"`` (from the one before); default None: the first. Only with
            ``eager``.
        outer_rule: ``"nesterov"`` (default: SGD with momentum, Nesterov's or heavy-ball
            by ``nesterov``) or ``"delayed-nesterov"`` (Async Local-SGD's, see
            ``loco.algorithms.delayed_nesterov.DelayedNesterov``; not
            with ``eager``).
        momentum_every: N of delayed Nesterov, an integer >= 1; default 1.
        outer_thread: the outer step on a helper thread, as for ``GlobalCopy``; default
            None (when it pays; never here, since τ = 0 but with ``eager``).
        **kwargs: the chunked top-k's settings (``sparse_layout``, ...) as for
            ``GlobalCopy``; the rest passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks: ``ctx.inner``).

    Raises:
        ValueError: an argument outside the ranges above.
    """

    name = "diloco"
    title = "DiLoCo"
    options = DiLoCoOptions
    defaults = {"sync_every": 100, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                "codec": "fp32", "error_feedback": 0.0}
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),
              PaperClaim("loss", "ddp", 5),
              PaperClaim("loss", "twin", 0, want={"error_feedback": 0.0},
                         text="at least as good as without error feedback ({ref})"),
              PaperClaim("loss", "twin", 0, want={"inner_optimizer": "adamw"},
                         free=("codec", "codec_block", "codec_chunk", "codec_keep", "error_feedback", "lr"),
                         text="with Muon inside at least as good as {ref} (AdamW inside)"),
              # Workers of unequal speed (docs/unequal.md): speed-aware local steps and
              # asynchronous outer steps against the synchronous barrier, and against
              # workers of equal speed at equal tokens.
              PaperClaim("goodput", "twin", 0.95, want={"local_steps": "fixed"},
                         free=("max_staleness",)),
              PaperClaim("wallclock", "twin", 0, want={"local_steps": "fixed"},
                         free=("max_staleness",), text="below {ref}'s"),
              PaperClaim("tokens", "twin", 2, want={"worker_speed": None,
                                                    "local_steps": "fixed"},
                         free=("max_staleness",)))

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """The wire's options and the outer rule's (Streaming DiLoCo's own do not
        apply)."""
        check_wire(cfg)
        check_outer_rule(cfg)

    @classmethod
    def setting(cls, config: dict) -> str:
        """H, the outer optimizer, and the wire where it is not fp32."""
        wire = wire_setting(config, cls.sparse_defaults)
        return (f"H={config['sync_every']}" + cls.outer_setting(config) + rule_setting(config)
                + ("" if wire == ", fp32" else wire))

    @classmethod
    def checkpoint_delay(cls, cfg) -> int:
        """0: a sync is applied within the step that sends it; eager: H − 1, the sync
        overlaps the round."""
        return cfg.method.sync_every - 1 if cfg.method.eager else 0

    @classmethod
    def warnings(cls, cfg) -> list[str]:
        """Inner steps past the last sync; the wire's warnings."""
        return leftover_steps(cfg) + wire_warnings(cfg)

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """H, the outer optimizer and its rule, ``offload`` and the wire."""
        return {**outer_kwargs(cfg), **rule_kwargs(cfg)}

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sync_every: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 offload: bool = False, codec: str = "fp32", codec_block: int | None = None,
                 codec_keep: float | None = None, error_feedback: float = 0.0,
                 outer_rule: str = "nesterov", momentum_every: int = 1,
                 eager: bool = False, eager_variant: str | None = None,
                 outer_thread: bool | None = None, **kwargs: Any):
        if outer_rule not in ("nesterov", "delayed-nesterov") or outer_rule != "nesterov" and (
                eager or outer_thread):
            raise ValueError(f"outer_rule must be nesterov or delayed-nesterov, and nesterov "
                             f"with eager updates or an outer thread (got {outer_rule!r})")
        # One fragment, the whole model; eager: the average overlaps the round (τ = H − 1).
        super().__init__(model, inner_optimizer, comm, sync_every=sync_every, fragments=1,
                         pattern="strided", overlap=sync_every - 1 if eager else 0, alpha=0.0,
                         codec=codec, codec_block=codec_block, codec_keep=codec_keep,
                         error_feedback=error_feedback, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, nesterov=nesterov, offload=offload,
                         outer_thread=outer_thread, eager=eager, eager_variant=eager_variant,
                         **kwargs)
        if outer_rule == "delayed-nesterov":
            use_delayed_nesterov(self.fragment_list, outer_lr, outer_momentum, momentum_every)

    def outer_state(self) -> dict:
        """The global copy's outer state, and delayed Nesterov's buffers (see
        [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        return {**super().outer_state(), **pending_state(self.fragment_list)}

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The global copy and outer momentum, and delayed Nesterov's buffers."""
        return super().replicated_tensors() + self._pending()

    def outer_tensors(self) -> list[torch.Tensor]:
        """The global copy's, and delayed Nesterov's buffers (the memory report)."""
        return super().outer_tensors() + self._pending()

    def _pending(self) -> list[torch.Tensor]:
        return [t for _, t in pending_state(self.fragment_list).values()]


def outer_kwargs(cfg) -> dict[str, Any]:
    """H, the outer optimizer, ``offload`` and the wire (codec, its block and keep, error
    feedback), as a method with a global copy takes them."""
    return {"sync_every": cfg.method.sync_every, "outer_lr": cfg.method.outer_lr,
            "outer_momentum": cfg.method.outer_momentum, "nesterov": cfg.method.nesterov,
            "offload": cfg.method.offload, "codec": cfg.method.codec, "codec_block": wire_block(cfg),
            "codec_keep": cfg.method.codec_keep, "error_feedback": cfg.method.error_feedback or 0.0,
            "eager": cfg.method.eager, "eager_variant": cfg.method.eager_variant,
            "sparse_layout": cfg.method.sparse_layout,
            "sparse_values": cfg.method.sparse_values, "sparse_mean": cfg.method.sparse_mean}


def wire_block(cfg) -> int | None:
    """The codec's block: ``codec_chunk`` for a chunked top-k codec (``codec_block`` there, an
    older release's spelling, for one more), else ``codec_block`` (None: the codec's own)."""
    if cfg.method.codec not in CHUNK_TOPK_CODEC_NAMES:
        return cfg.method.codec_block
    return cfg.method.codec_chunk if cfg.method.codec_chunk is not None else cfg.method.codec_block


def check_wire(cfg) -> None:
    """The wire options' ranges: keep in (0, 1], the block in [2, 65536] (even for 4 bits,
    a multiple of 4 for int2), error feedback's beta in [0, 1); eager updates and the replicas' evaluation not elastic.

    Raises:
        ConfigError: naming the first option out of range.
    """
    if cfg.method.codec_keep is not None:
        need(cfg, 0 < cfg.method.codec_keep <= 1, "codec_keep", "must be in (0, 1]")
    if cfg.method.codec_block is not None:
        per_byte = {"fp4_e3m0": 2, "fp4_e2m1": 2, "int2": 4}.get(cfg.method.codec, 1)
        need(cfg, 2 <= cfg.method.codec_block <= 65536 and cfg.method.codec_block % per_byte == 0,
             "codec_block", "must be an integer in [2, 65536]"
             + (f" and a multiple of {per_byte} with --codec {cfg.method.codec}" if per_byte > 1
                else ""))
    if cfg.method.codec_chunk is not None:
        need(cfg, cfg.method.codec in CHUNK_TOPK_CODEC_NAMES, "codec_chunk",
             f"applies to --codec {' or '.join(CHUNK_TOPK_CODEC_NAMES)} (the scaled codecs' "
             f"blocks are --codec-block; got --codec {cfg.method.codec})")
        need(cfg, 2 <= cfg.method.codec_chunk <= 65536, "codec_chunk",
             "must be an integer in [2, 65536]")
        need(cfg, cfg.method.codec_block is None, "codec_chunk", "give --codec-chunk alone: "
             "--codec-block is the scaled codecs' block")
    need(cfg, 0 <= cfg.method.error_feedback < 1, "error_feedback", "must be in [0, 1) (0: none)")
    for option in ("sparse_layout", "sparse_values", "sparse_mean"):
        need(cfg, getattr(cfg.method, option) is None or cfg.method.codec in CHUNK_TOPK_CODEC_NAMES, option,
             f"applies to --codec {' or '.join(CHUNK_TOPK_CODEC_NAMES)} (got --codec "
             f"{cfg.method.codec})")
    need(cfg, cfg.method.sparse_values != "stat" or cfg.method.sparse_layout == "tiles", "sparse_values",
         "stat bins each tensor's values: it needs --sparse-layout tiles")
    need(cfg, cfg.method.sparse_layout != "tiles" or cfg.runtime.worker_ranks == 1
         or cfg.runtime.worker_parallel == "fsdp",
         "sparse_layout", "tiles cut whole tensors: with --worker-ranks > 1 they need --fsdp "
         "(each rank tiles its own shards)")
    need(cfg, not (cfg.method.eval_replicas and cfg.runtime.elastic), "eval_replicas",
         "is a collective outside the syncs, which an elastic run does not make; leave it "
         "out with --elastic")
    need(cfg, not (cfg.method.eager and cfg.runtime.elastic), "eager", "needs a fixed group of workers (a "
         "worker's share is 1/M): leave out --elastic")
    need(cfg, cfg.method.eager or cfg.method.eager_variant is None, "eager_variant", "applies only with "
         "--eager")
    check_whole_model(cfg)


def wire_warnings(cfg) -> list[str]:
    """``codec_block`` for a top-k chunk (deprecated), error feedback on a lossless wire, or a
    top-k chunk format without it."""
    if cfg.method.codec in CHUNK_TOPK_CODEC_NAMES and cfg.method.codec_block is not None:
        return [f"--codec-block with --codec {cfg.method.codec} is deprecated: it is read as "
                f"--codec-chunk {cfg.method.codec_block} for this release; give --codec-chunk"]
    if cfg.method.error_feedback and cfg.method.codec == "fp32":
        return ["--error-feedback has nothing to feed back with --codec fp32 (lossless)"]
    if not cfg.method.error_feedback and cfg.method.codec in CHUNK_TOPK_CODEC_NAMES:
        return [f"--codec {cfg.method.codec} without --error-feedback: the values it does not send "
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


__all__ = ["DiLoCo", "DiLoCoOptions", "GlobalCopyOptions", "WireOptions", "check_wire",
           "outer_kwargs", "wire_setting", "wire_warnings"]
