"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

Each worker m runs H inner optimizer steps (AdamW) on its own data, then every worker:

1. forms the pseudo-gradient  Δ_m = θ^g − θ_m   (old global minus new local);
2. averages it in fp32:       Δ̄ = mean_m Δ_m;
3. takes an outer step:       θ^g ← OuterOpt(θ^g, Δ̄)   (SGD with Nesterov momentum);
4. restarts from it:          θ_m ← θ^g.

The inner optimizer state is kept across rounds. With outer lr 1 and momentum 0 the result is
exactly the average of the workers' parameters (FedAvg), which pins the sign of Δ.
"""

from __future__ import annotations

import torch

from loco.algorithms.base import Algorithm, flatten_fp32, unflatten_views


class DiLoCo(Algorithm):
    """DiLoCo outer loop around any inner optimizer.

    Args:
        sync_every: H, inner steps between outer steps.
        outer_lr: outer learning rate (paper: 0.7).
        outer_momentum: outer momentum μ (paper: 0.9).
        nesterov: Nesterov momentum (paper) or heavy-ball.
    """

    def __init__(self, model, inner_optimizer, comm, sync_every: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 **kwargs):
        if sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1 (got {sync_every})")
        if outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0 (got {outer_lr})")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1) (got {outer_momentum})")
        if nesterov and outer_momentum == 0:
            nesterov = False  # torch's SGD rejects Nesterov without momentum; identical maths
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.sync_every = sync_every
        self.outer_steps = 0
        # θ^g and Δ live in flat fp32 buffers: one message per sync, fp32 outer arithmetic.
        self._global_flat = flatten_fp32(self.params)
        self.global_params = unflatten_views(self._global_flat, self.params)
        self._delta = torch.zeros_like(self._global_flat)
        for g, d in zip(self.global_params, unflatten_views(self._delta, self.params)):
            g.grad = d
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=outer_lr,
                                               momentum=outer_momentum, nesterov=nesterov)

    def step(self) -> None:
        self.clip_gradients()
        self.inner_optimizer.step()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        flatten_fp32(self.params, out=self._delta)
        torch.sub(self._global_flat, self._delta, out=self._delta)  # Δ_m = θ^g − θ_m
        self.comm.all_reduce_mean(self._delta, tag="train").wait()  # Δ̄, in fp32
        self.outer_optimizer.step()  # .grad of every global parameter is a view of Δ̄
        torch._foreach_copy_(self.params, self.global_params)  # θ_m ← θ^g
        self.outer_steps += 1

    def global_parameters(self) -> dict[str, torch.Tensor]:
        by_id = {id(p): g for p, g in zip(self.params, self.global_params)}
        return {n: by_id.get(id(p), p) for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer_steps": self.outer_steps,
                "global_params": self._global_flat.clone(),
                "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer_steps = int(state["outer_steps"])
        self._global_flat.copy_(state["global_params"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
