"""Eager updates (Kale, Douillard and Donchev 2025, arXiv 2502.12996) for the methods with a
global copy: the outer step of a sync is taken when the sync is *sent*, not when its
average arrives.

Without eager updates a worker waits (τ steps later) for the average ``Δ̄`` of the M
workers' pseudo-gradients before it steps. With them, worker m steps at once with

    Δ̃_m = (1/M) · Δ_m  +  ((M − 1)/M) · Δ̄_{−m}'

its own fresh pseudo-gradient ``Δ_m`` in place of its share of the average, and the other
workers' mean ``Δ̄_{−m}'`` from the same fragment's *previous* sync, which has arrived
meanwhile (zero before the first). When this sync's average lands, worker m keeps its
others' part, ``Δ̄ − Δ_m / M``, for the fragment's next step: every pseudo-gradient enters
every worker's global copy exactly once, a worker's own at once, the others' one sync later.
The outer step never waits for the network, whatever τ.

Every worker keeps its own global copy (it differs from the others' by its own latest
pseudo-gradients, ``1/M`` of a sync's); at the end each worker takes one more outer step
with the others' part of every fragment's last sync, so that none is left out of the model
that is evaluated (worker 0's). The own term is the pseudo-gradient before the codec (the
codec's error feedback, if any, included): what the codec sends approximates it.
"""

from __future__ import annotations

from typing import Any

import torch


class Eager:
    """The eager updates' state of a method with fragments (Streaming DiLoCo, DiLoCo).

    Args:
        fragments: the method's fragments (each with ``delta`` and ``global_flat``).
        workers: M, the workers that average (``comm.size``).
    """

    def __init__(self, fragments: list, workers: int):
        self.workers = workers
        self.others = [torch.zeros_like(f.global_flat) for f in fragments]
        """Per fragment: the other workers' share of its latest average,
        ``Δ̄ − Δ_m / M`` (= ``((M − 1)/M) · Δ̄_{−m}``), not yet stepped with."""
        self.pending = [False] * len(fragments)
        """Per fragment: whether ``others`` holds an average no step has used yet."""
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

    def step_gradient(self, fragment: Any) -> torch.Tensor:
        """The eager step's gradient of ``fragment``, written into ``fragment.grad``:
        ``Δ_m / M`` plus the others' share of its previous sync.

        Args:
            fragment: the fragment sent (after ``keep_own``).
        """
        own = self.own[:fragment.delta.numel()]
        grad = fragment.grad
        grad.copy_(own).div_(self.workers)  # (offloaded: a copy to the host, waited for)
        grad.add_(self.others[fragment.index])
        self.pending[fragment.index] = False
        return grad

    def landed(self, fragment: Any) -> None:
        """The sync's average has arrived in ``fragment.delta``: keep the others' share of
        it, ``Δ̄ − Δ_m / M``.

        Args:
            fragment: the fragment whose sync landed.
        """
        others = self.others[fragment.index]
        others.copy_(self.own[:fragment.delta.numel()]).div_(self.workers)
        torch.sub(fragment.delta.to(others.device), others, out=others)
        self.pending[fragment.index] = True

    def dropped(self, fragment: Any) -> None:
        """The sync's average was not finite (skipped): nothing of it is kept.

        Args:
            fragment: the fragment whose sync was skipped.
        """
        self.others[fragment.index].zero_()
        self.pending[fragment.index] = False

    def last_gradient(self, fragment: Any) -> torch.Tensor | None:
        """At the end: the others' share of the fragment's last sync as the gradient of one
        more outer step (written into ``fragment.grad``); None when there is none.

        Args:
            fragment: a fragment of the method.
        """
        if not self.pending[fragment.index]:
            return None
        self.pending[fragment.index] = False
        return fragment.grad.copy_(self.others[fragment.index])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds, for the memory report."""
        return [*self.others, self.own]

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved.

        Args:
            state: a dict from ``state_dict()``.
        """
        for t, saved in zip(self.others, state.get("others", ())):  # (or load_outer_state)
            t.copy_(saved)
        self.pending = [bool(p) for p in state["pending"]]


__all__ = ["Eager"]
