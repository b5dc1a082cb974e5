"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

Each worker m runs H inner optimizer steps (AdamW) on its own data, then every worker:

1. forms the pseudo-gradient  Δ_m = θ^g − θ_m   (old global minus new local);
2. averages it in fp32:       Δ̄ = mean_m Δ_m;
3. takes an outer step:       θ^g ← OuterOpt(θ^g, Δ̄)   (SGD with Nesterov momentum);
4. restarts from it:          θ_m ← θ^g.

The inner optimizer state is kept across rounds. This is Streaming DiLoCo with one fragment,
no overlap, full precision and α = 0, and it runs through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loco.algorithms.delayed_nesterov import (OuterRuleOptions, check_outer_rule, pending_state,
                                              rule_kwargs, rule_setting, use_delayed_nesterov)
from loco.algorithms.method import Method, PaperClaim, leftover_steps
from loco.algorithms.streaming_diloco import StreamingDiLoCo, outer_kwargs
from loco.algorithms.wire import WireOptions, check_wire, wire_setting, wire_warnings
from loco.comm import Comm


@dataclass
class DiLoCoOptions(WireOptions, OuterRuleOptions):
    """DiLoCo's own options: the wire (Streaming DiLoCo's P, τ and α do not apply) and
    the outer rule."""


class DiLoCo(StreamingDiLoCo):
    """DiLoCo outer loop around any inner optimizer.

    Streaming DiLoCo with one fragment, no overlap and α = 0: every H inner steps the whole
    model is synchronized, and training waits for it. The pseudo-gradients travel in fp32 by
    default (the paper's); a lossy ``codec`` may be given, with error feedback.

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
            [`StreamingDiLoCo`][loco.algorithms.streaming_diloco.StreamingDiLoCo] for it,
            ``codec_block`` and ``codec_keep``.
        codec_block: as for ``StreamingDiLoCo``; default None (the codec's).
        codec_keep: as for ``StreamingDiLoCo``; default None (the codec's).
        error_feedback: β of the error feedback, in [0, 1), as for ``StreamingDiLoCo``;
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
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks: ``ctx.inner``).

    Raises:
        ValueError: an argument outside the ranges above.
    """

    name = "diloco"
    title = "DiLoCo"
    options = DiLoCoOptions  # none of Streaming DiLoCo's own: P = 1, τ = 0, α = 0
    defaults = {"sync_every": 100, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                "codec": "fp32", "error_feedback": 0.0}
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),
              PaperClaim("loss", "ddp", 5),
              PaperClaim("loss", "twin", 0, want={"error_feedback": 0.0},
                         text="at least as good as without error feedback ({ref})"),
              PaperClaim("loss", "twin", 0, want={"inner_optimizer": "adamw"},
                         free=("codec", "codec_block", "codec_keep", "error_feedback", "lr"),
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
        return cfg.sync_every - 1 if cfg.eager else 0

    @classmethod
    def fragment_names(cls, cfg, module, tied: bool) -> list[list[str]]:
        """One fragment: the whole model."""
        return Method.fragment_names(cfg, module, tied)

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
                 eager: bool = False, eager_variant: str | None = None, **kwargs: Any):
        if outer_rule not in ("nesterov", "delayed-nesterov") or outer_rule != "nesterov" and (
                eager or kwargs.get("outer_thread")):
            raise ValueError(f"outer_rule must be nesterov or delayed-nesterov, and nesterov "
                             f"with eager updates or an outer thread (got {outer_rule!r})")
        super().__init__(model, inner_optimizer, comm, sync_every=sync_every, fragments=1,
                         overlap=sync_every - 1 if eager else 0, alpha=0.0, eager=eager,
                         eager_variant=eager_variant,
                         codec=codec, codec_block=codec_block,
                         codec_keep=codec_keep, error_feedback=error_feedback,
                         outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                         offload=offload, **kwargs)
        if outer_rule == "delayed-nesterov":
            use_delayed_nesterov(self.fragment_list, outer_lr, outer_momentum, momentum_every)

    def outer_state(self) -> dict:
        """Streaming DiLoCo's outer state, and delayed Nesterov's buffers (see
        [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        return {**super().outer_state(), **pending_state(self.fragment_list)}

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The global copy and outer momentum, and delayed Nesterov's buffers."""
        return super().replicated_tensors() + self._pending()

    def outer_tensors(self) -> list[torch.Tensor]:
        """Streaming DiLoCo's, and delayed Nesterov's buffers (the memory report)."""
        return super().outer_tensors() + self._pending()

    def _pending(self) -> list[torch.Tensor]:
        return [t for _, t in pending_state(self.fragment_list).values()]
