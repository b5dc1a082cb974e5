"""Asynchronous outer steps for the methods with a global copy: no worker waits for the
slowest, and a slow worker's pseudo-gradient is applied when it arrives, at most S outer
steps old.

With speed-aware local steps every round of H ticks ends at the same wall time for every
worker: a worker of speed s trains about s·H of its ticks (``loco.training.speed``). Without
asynchrony each worker sends those s·H steps at every sync. With it (``max_staleness`` S
> 0) a worker's *block* spans rounds: it keeps training its replica past a sync until the
block holds H steps, or S + 1 rounds, or the run's last full round comes (Async Local-SGD's
workers of H local steps each, Liu et al. 2024, arXiv 2401.09135). At the syncs a block
spans the worker sends zeros (the all-reduce needs every worker: the same bytes); at the
sync that ends it, it sends

    Δ_m = θ^g(block start) − θ_m

its progress since the global copy it started from, which the global copy has meanwhile
left by as many outer steps as the block spanned rounds, less one (its staleness, at most S).
The sync's average weighs the workers that send by the steps behind them and ignores those
that do not (a token-weighted merge of the contributions that arrived, Decoupled DiLoCo's,
arXiv 2604.21428):

    Δ̄ = Σ_m n_m Δ_m / Σ_m n_m     (n_m: steps of m's block ending here, 0 if none)

and the outer optimizer (Nesterov) steps on it as at any sync; then the workers whose block
ended restart from the new global copy, and the others go on. Every worker knows every
block from the agreed rounds alone, so no word is spent on who sends; the global copy stays
the same on every worker.
"""

from __future__ import annotations

from typing import Any

import torch


class BlockStarts:
    """Each fragment's global copy when this worker's block began (what its pseudo-gradient
    is taken from).

    Args:
        fragments: the method's fragments (each with ``global_flat``).
    """

    def __init__(self, fragments: list):
        self.start = [f.global_flat.clone() for f in fragments]
        """Per fragment: θ^g at the start of this worker's block (this rank's share)."""

    def of(self, fragment: Any) -> torch.Tensor:
        """The global copy a fragment's block started from (flat, this rank's share).

        Args:
            fragment: one of the method's fragments.
        """
        return self.start[fragment.index]

    def begin(self, fragment: Any) -> None:
        """A new block of a fragment starts from its global copy as it is now.

        Args:
            fragment: one of the method's fragments.
        """
        self.start[fragment.index].copy_(fragment.global_flat)


__all__ = ["BlockStarts"]
