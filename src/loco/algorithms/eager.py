"""Eager updates (Kale, Douillard and Donchev 2025, arXiv 2502.12996) for the methods with a
global copy: the replicas move on with an estimate of a sync's outer step as soon as it is
sent, and are corrected when its average arrives.

Without eager updates a worker keeps training on its own for the τ steps a sync is in
flight, then merges the new global copy. With them, when fragment p is sent, worker m takes
a *proxy* outer step from the global copy (and its momentum) with

    Δ̃_m = (1/M) · Δ_m  +  ((M − 1)/M) · Δ̄_{−m}'

its own fresh pseudo-gradient ``Δ_m`` in place of its share of the average, and the other
workers' mean ``Δ̄_{−m}'`` from the fragment's *previous* sync (zero before the first), and
merges the result ``θ̃`` into its replica at once (α). When the average ``Δ̄`` lands τ steps
later, the true outer step is taken on the global copy, exactly as without eager updates,
and the replica is corrected by what the proxy missed: ``θ_m += (1 − α)(θ^g − θ̃)``. The
worker then keeps the others' share of ``Δ̄``, ``Δ̄ − Δ_m / M``, for the fragment's next
proxy.

The global copy is the same on every worker; the replica ends every sync where it would have
without eager updates, plus its τ steps of progress made from a better start (whole, not
scaled by α). The own term is the pseudo-gradient before the codec (with error feedback, the
error-fed one): the bytes sent are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from loco.algorithms.outer_thread import momentum_of


class Eager:
    """The eager updates' state of a method with fragments (Streaming DiLoCo, DiLoCo).

    Args:
        fragments: the method's fragments (each with ``delta``, ``global_flat`` and its
            outer SGD).
        workers: M, the workers that average (``comm.size``).
    """

    def __init__(self, fragments: list, workers: int):
        self.workers = workers
        self.others = [torch.zeros_like(f.global_flat) for f in fragments]
        """Per fragment: the other workers' share of its latest average,
        ``Δ̄ − Δ_m / M`` (= ``((M − 1)/M) · Δ̄_{−m}``)."""
        biggest = max(f.delta.numel() for f in fragments)
        self.own = torch.zeros(biggest, dtype=torch.float32, device=fragments[0].delta.device)
        """This worker's pseudo-gradient of the sync in flight (its first ``numel``)."""
        self.ahead = torch.zeros(biggest, dtype=torch.float32,
                                 device=fragments[0].global_flat.device)
        """The proxy step's global copy ``θ̃`` of the sync in flight (its first ``numel``)."""

    def keep_own(self, fragment: Any) -> None:
        """At a send, before the all-reduce takes ``fragment.delta``: keep this worker's
        pseudo-gradient.

        Args:
            fragment: the fragment sent, its pseudo-gradient in ``delta``.
        """
        self.own[:fragment.delta.numel()].copy_(fragment.delta)

    @torch.no_grad()
    def proxy(self, fragment: Any) -> torch.Tensor:
        """The proxy step: ``θ̃``, the global copy after an outer step (the fragment's SGD:
        its lr, momentum and Nesterov, from its momentum as it is) with ``Δ̃_m``; neither
        the global copy nor the momentum is changed. ``Δ̃_m`` is left in ``fragment.grad``.

        Args:
            fragment: the fragment sent (after ``keep_own``).

        Returns:
            ``θ̃`` (a view of ``ahead``).
        """
        n = fragment.global_flat.numel()
        grad = fragment.grad
        grad.copy_(self.own[:n]).div_(self.workers)  # (offloaded: a copy to the host)
        grad.add_(self.others[fragment.index])
        group = fragment.outer_optimizer.param_groups[0]
        lr, mu = group["lr"], group["momentum"]
        out = self.ahead[:n]
        buf = momentum_of(fragment)
        if mu and buf is not None:
            torch.mul(buf, mu, out=out).add_(grad)  # the momentum after this step
        else:
            out.copy_(grad)
        if mu and group["nesterov"]:
            torch.add(grad, out, alpha=mu, out=out)
        return torch.sub(fragment.global_flat, out, alpha=lr, out=out)

    def landed(self, fragment: Any) -> None:
        """The sync's average has arrived and is in ``fragment.grad`` (beside the global
        copy): keep the others' share of it, ``Δ̄ − Δ_m / M``, for the fragment's next proxy
        step.

        Args:
            fragment: the fragment whose sync landed.
        """
        others = self.others[fragment.index]
        others.copy_(self.own[:fragment.delta.numel()]).div_(self.workers)
        torch.sub(fragment.grad, others, out=others)

    def missed(self, fragment: Any) -> torch.Tensor:
        """After the true outer step: what the proxy missed, ``θ^g − θ̃`` (in ``ahead``).

        Args:
            fragment: the fragment whose sync landed and was stepped.
        """
        out = self.ahead[:fragment.global_flat.numel()]
        return torch.sub(fragment.global_flat, out, out=out)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds, for the memory report."""
        return [*self.others, self.own, self.ahead]

    def load_others(self, others: list[torch.Tensor]) -> None:
        """Restore ``others`` from a checkpoint.

        Args:
            others: one vector per fragment, as ``others`` holds them.
        """
        for t, saved in zip(self.others, others):
            t.copy_(saved)


__all__ = ["Eager"]
