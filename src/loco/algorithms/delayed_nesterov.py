"""Delayed Nesterov: the outer rule of Async Local-SGD (Liu et al. 2024, arXiv 2401.09135,
Algorithm 3, with its momentum activation c = 0, the paper's default).

Asynchronous outer steps apply many updates to the global copy, several of them stale; a
momentum that compounds each one runs ahead of where the workers are. Delayed Nesterov
keeps the momentum still for N updates at a time: every update g_t (t = 1, 2, ...) joins a
buffer Δ, and

    t mod N = 0:   m ← β·m + Δ/N;   θ ← θ − η·(β·m + g_t/N);   Δ ← 0
    otherwise:     θ ← θ − η·g_t/N          (m unchanged: plain gradient steps)

so that over N updates θ moves by η times their average plus one Nesterov step of the
momentum, as one synchronous outer step of N workers would. N = 1 is Nesterov SGD. In loco
an update is an outer step: the token-weighted merge of the blocks that reached one sync
(docs/unequal.md#delayed-nesterov).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loco.options import ConfigError, need, opt

OUTER_RULES = ("nesterov", "delayed-nesterov")
"""``outer_rule``: SGD with momentum at every outer step (Nesterov, or heavy-ball with
``--no-nesterov``), or Async Local-SGD's delayed Nesterov."""


@dataclass
class OuterRuleOptions:
    """The outer rule of DiLoCo and the methods built on it (SparseLoCo, SPARTA-DiLoCo)."""

    outer_rule: str = opt("nesterov", "the outer optimizer's rule (diloco, sparseloco, "
                          "sparta_diloco): "
                          "nesterov (SGD with momentum at every outer step; heavy-ball with "
                          "--no-nesterov) or delayed-nesterov (Async Local-SGD's: the "
                          "momentum steps once every --momentum-every outer steps, on their "
                          "average, and plain gradient steps of 1/N go between; for "
                          "asynchronous outer steps, whose stale updates a momentum at every "
                          "step compounds)", OUTER_RULES)
    momentum_every: int | None = opt(None, "N of --outer-rule delayed-nesterov: outer steps "
                                     "per momentum step, >= 1 (1: Nesterov) (default: "
                                     "--max-staleness + 1, the rounds a block may span, so "
                                     "that every worker's block is in the average)")


def check_outer_rule(cfg: Any) -> None:
    """``momentum_every`` only with delayed Nesterov, an integer >= 1; delayed Nesterov not
    with heavy-ball (``--no-nesterov``) or eager updates (whose proxy step is SGD's).

    Raises:
        ConfigError: naming the option and what it allows.
    """
    if cfg.method.outer_rule != "delayed-nesterov":
        if cfg.method.momentum_every is not None:
            raise ConfigError("momentum_every", "only means something with --outer-rule "
                              f"delayed-nesterov (got {cfg.method.momentum_every} with --outer-rule "
                              f"{cfg.method.outer_rule})")
        return
    if cfg.method.momentum_every is not None:
        need(cfg, cfg.method.momentum_every >= 1, "momentum_every", "must be an integer >= 1")
    for name, bad in (("nesterov", cfg.method.nesterov is False), ("eager", cfg.method.eager)):
        if bad:
            raise ConfigError("outer_rule", f"delayed-nesterov is Nesterov's rule: not with "
                              f"--{'no-nesterov' if name == 'nesterov' else name} (use "
                              "--outer-rule nesterov)")


def rule_kwargs(cfg: Any) -> dict[str, Any]:
    """The constructor's ``outer_rule`` and ``momentum_every`` (N: ``--max-staleness`` + 1
    unless given)."""
    every = cfg.method.momentum_every or cfg.runtime.max_staleness + 1
    return {"outer_rule": cfg.method.outer_rule, "momentum_every": every}


def rule_setting(config: dict) -> str:
    """The report's words for delayed Nesterov (``", delayed Nesterov N=2"``); empty for
    the default rule or a run that predates the option."""
    if config.get("outer_rule") != "delayed-nesterov":
        return ""
    every = config.get("momentum_every") or (config.get("max_staleness") or 0) + 1
    return f", delayed Nesterov N={every}"


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov on flat fp32 tensors (a fragment's global copy), see the module.

    Its state per tensor is the momentum m (``momentum_buffer``, as SGD names it) and the
    buffer Δ (``pending``), both made at once, zeros. The update's index t comes from
    ``clock`` (the updates taken before it), so that the phase of the N-update cycle is
    the caller's counter, saved and handed to a joining worker with it. No host read.

    Args:
        params: the tensors, each with ``.grad`` holding the update g_t at ``step``.
        lr: η, the outer learning rate, > 0.
        momentum: β, in [0, 1).
        every: N, updates per momentum step, an integer >= 1.
        clock: returns how many updates were taken before this one (t − 1).

    Raises:
        ValueError: an argument outside those ranges.
    """

    def __init__(self, params: Any, lr: float, momentum: float, every: int,
                 clock: Callable[[], int]):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every (N) must be an integer >= 1 (got {every!r})")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"lr must be > 0 and momentum in [0, 1) (got {lr}, {momentum})")
        super().__init__(params, {"lr": lr, "momentum": momentum, "every": every})
        self.clock = clock
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p),
                                 "pending": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Take update t = ``clock() + 1`` of every tensor (its ``.grad``)."""
        t = self.clock() + 1
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["every"]
            for p in group["params"]:
                state = self.state[p]
                pending, m = state["pending"], state["momentum_buffer"]
                pending.add_(p.grad)
                if t % n:
                    p.add_(p.grad, alpha=-lr / n)
                    continue
                m.mul_(beta).add_(pending.div_(n))
                p.add_(p.grad.div(n).add_(m, alpha=beta), alpha=-lr)
                pending.zero_()


def use_delayed_nesterov(fragments: list, lr: float, momentum: float, every: int) -> None:
    """Give every fragment a delayed-Nesterov outer optimizer in place of its SGD, its
    update's index counted by the fragment's applied syncs.

    Args:
        fragments: a global copy's fragments (``global_flat``, ``syncs``).
        lr: η, > 0.
        momentum: β, in [0, 1).
        every: N, >= 1.
    """
    for f in fragments:
        f.outer_optimizer = DelayedNesterov([f.global_flat], lr, momentum, every,
                                            clock=lambda f=f: f.syncs)


def pending_state(fragments: list) -> dict:
    """Each delayed-Nesterov fragment's buffer Δ by name, ``(share, tensor)``, for
    ``outer_state`` (a joining worker and a resharded checkpoint take it)."""
    return {f"fragment{f.index}.pending": (f.share, f.outer_optimizer.state[f.global_flat]
                                           ["pending"])
            for f in fragments if isinstance(f.outer_optimizer, DelayedNesterov)}


__all__ = ["OUTER_RULES", "DelayedNesterov", "OuterRuleOptions", "check_outer_rule",
           "pending_state", "rule_kwargs", "rule_setting", "use_delayed_nesterov"]
