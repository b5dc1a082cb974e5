"""Eager updates (Kale, Douillard and Donchev 2025, arXiv 2502.12996, its Algorithm 3) for
the methods with a global copy: a worker takes its outer step as soon as it sends a sync,
with its own fresh pseudo-gradient for its share of the average and the other workers'
shares from an earlier sync, so the all-reduce overlaps the next inner steps.

The box, for worker m at the end of round t (H inner steps), with M workers:

    Δ_m^(t) = θ_m^(t−H) − θ_m^(t)                     (its pseudo-gradient, sent)
    Δ̃_m^(t) = (1/M) (Δ_m^(t) + Σ_{m'≠m} Δ_{m'}^(t−dH))
            = Δ̄^(t−dH) + (Δ_m^(t) − Δ_m^(t−dH)) / M   (Δ^(s) = 0 for s ≤ 0)
    θ_m^(t) ← OuterOpt_m(θ_m^(t−H), Δ̃_m^(t))

with d = 1 ("1-outer-step eager", the paper's method: the average of a round has the next
whole round to arrive) or d = 2 ("2-outer-steps eager", its Table 2: two rounds). Every
pseudo-gradient is applied once, this worker's own at once and the others' d rounds late.
Each worker steps its own copy of the global parameters and its own outer momentum, so the
copies differ between workers by their recent own shares (the momentum keeps them, decaying);
there is no correction when an average lands: it is kept for the fragment's outer step d
sends later.

Here, per fragment p of Streaming DiLoCo (DiLoCo: one fragment), ``others`` holds the
last d values of ``Δ̄_p − Δ_{m,p} / M`` (the others' share of an average, oldest first);
at a send the outer step takes ``Δ_{m,p} / M + others[0]`` and the replica is merged with
the new copy (α, as at any sync); when the average lands τ steps later (τ < H/P: one sync
in flight at a time) the oldest entry gives way to the new share. The own term is the
pseudo-gradient before the codec (with error feedback, the error-fed one): the bytes sent
are those without eager updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loco.algorithms.nonfinite import all_finite
from loco.comm.hostreads import allowed

VARIANTS = {"1-outer-step": 1, "2-outer-steps": 2}
"""The paper's eager variants by name: how many syncs of a fragment late the others' share
of the average is applied."""


def check_variant(eager: bool, variant: str | None) -> None:
    """``variant`` is one of ``VARIANTS`` (or None, the default: ``"1-outer-step"``), and
    only given with ``eager``.

    Args:
        eager: whether eager updates are on.
        variant: the variant asked for, or None.

    Raises:
        ValueError: naming ``eager_variant`` and its allowed values.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"eager_variant must be one of {', '.join(VARIANTS)} (got "
                         f"{variant!r})")
    if variant is not None and not eager:
        raise ValueError(f"eager_variant applies only with eager=True (got {variant!r})")


class Eager:
    """The eager updates' state of a method with fragments (Streaming DiLoCo, DiLoCo).

    Args:
        fragments: the method's fragments (each with ``delta``, ``grad``, ``global_flat``
            and its outer SGD over ``global_flat``).
        workers: M, the workers that average (``comm.size``).
        variant: a name of ``VARIANTS``; default None: ``"1-outer-step"``.
    """

    def __init__(self, fragments: list, workers: int, variant: str | None = None):
        self.workers = workers
        self.delay = VARIANTS[variant or "1-outer-step"]
        self.others = [[torch.zeros_like(f.global_flat) for _ in range(self.delay)]
                       for f in fragments]
        """Per fragment: the others' share, ``Δ̄ − Δ_m / M``, of its last ``delay``
        averages, oldest first (zeros before them)."""
        biggest = max(f.delta.numel() for f in fragments)
        self.own = torch.zeros(biggest, dtype=torch.float32, device=fragments[0].delta.device)
        """This worker's pseudo-gradient of the sync in flight (its first ``numel``)."""

    def keep_own(self, fragment: Any) -> None:
        """At a send, before the all-reduce takes ``fragment.delta``: keep this worker's
        pseudo-gradient.

        Args:
            fragment: the fragment sent, its pseudo-gradient in ``delta``.
        """
        self.own[:fragment.delta.numel()].copy_(fragment.delta)

    @torch.no_grad()
    def step(self, fragment: Any, agree: Callable[[bool], bool]) -> bool:
        """At a send (after ``keep_own``): the outer step of the box, on this worker's
        global copy and momentum, with ``Δ̃ = Δ_m / M + others[0]`` (left in
        ``fragment.grad``). Not taken where ``Δ̃`` is not finite: the average is not
        either, and its landing skips the sync on every worker.

        Args:
            fragment: the fragment sent.
            agree: whether a flag holds on every rank of this worker
                (``WorkerRanks.agree``).

        Returns:
            Whether the step was taken.
        """
        grad = fragment.grad
        grad.copy_(self.own[:grad.numel()]).div_(self.workers)  # (offloaded: to the host)
        grad.add_(self.others[fragment.index][0])
        with allowed("sync"):
            finite = agree(all_finite(grad))
        if finite:
            fragment.outer_optimizer.step()
        return finite

    @torch.no_grad()
    def landed(self, fragment: Any, finite: bool) -> None:
        """The sync's average ``Δ̄`` has arrived in ``fragment.delta``: it replaces the
        oldest share of the fragment's others with ``Δ̄ − Δ_m / M`` (zeros for a skipped,
        non-finite one: its contributions are lost, as without eager updates).

        Args:
            fragment: the fragment whose sync landed.
            finite: whether ``Δ̄`` is finite on every worker.
        """
        shares = self.others[fragment.index]
        newest = shares.pop(0)
        shares.append(newest)
        if not finite:
            newest.zero_()
            return
        fragment.grad.copy_(fragment.delta)  # (offloaded: Δ̄ to the host once)
        newest.copy_(self.own[:newest.numel()]).div_(self.workers)
        torch.sub(fragment.grad, newest, out=newest)

    def state_of(self, index: int) -> dict[str, torch.Tensor]:
        """Fragment ``index``'s others' shares by checkpoint name: ``eager_others`` (the
        oldest), then ``eager_others1``.

        Args:
            index: the fragment's index.
        """
        return {"eager_others" + (str(j) if j else ""): t
                for j, t in enumerate(self.others[index])}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds, for the memory report."""
        return [t for shares in self.others for t in shares] + [self.own]

    def load_others(self, others: list) -> None:
        """Restore ``others`` from a checkpoint.

        Args:
            others: per fragment, its ``delay`` vectors as ``others`` holds them.
        """
        for mine, saved in zip(self.others, others):
            for t, s in zip(mine, saved):
                t.copy_(s)


__all__ = ["VARIANTS", "Eager", "check_variant"]
