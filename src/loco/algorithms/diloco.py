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

from loco.algorithms.streaming_diloco import StreamingDiLoCo


class DiLoCo(StreamingDiLoCo):
    """DiLoCo outer loop around any inner optimizer.

    Args:
        sync_every: H, inner steps between outer steps.
        outer_lr: outer learning rate (paper: 0.7).
        outer_momentum: outer momentum μ (paper: 0.9).
        nesterov: Nesterov momentum (paper) or heavy-ball.
        offload: keep the global copy and the outer momentum in CPU memory.
    """

    def __init__(self, model, inner_optimizer, comm, sync_every: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 offload: bool = False, **kwargs):
        super().__init__(model, inner_optimizer, comm, sync_every=sync_every, fragments=1,
                         overlap=0, alpha=0.0, codec="fp32", outer_lr=outer_lr,
                         outer_momentum=outer_momentum, nesterov=nesterov, offload=offload,
                         **kwargs)
