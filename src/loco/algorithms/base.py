"""What every algorithm shares: it wraps the user's model and inner optimizer and replaces
``optimizer.step()`` with ``algo.step()`` in an otherwise plain PyTorch loop::

    algo = loco.DiLoCo(model, torch.optim.AdamW(model.parameters()), ctx.comm, sync_every=50)
    for x, y in batches:
        model(x, y).backward()
        algo.step()          # was: optimizer.step()
        algo.zero_grad()     # was: optimizer.zero_grad()

Gradient clipping belongs to the algorithm (``max_grad_norm``) rather than the loop, so that
data-parallel training clips the averaged gradient, as DDP does.
"""

from __future__ import annotations

import torch
from torch import nn

from loco.comm import Comm

INIT_SYNC_MODES = ("broadcast", "verify")


class Algorithm:
    """Base class: the model, its inner optimizer, the communication and the step counter."""

    #: Whether every worker holds the same global parameters (so one worker may evaluate).
    replicas_identical = True

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm, *,
                 max_grad_norm: float | None = None, init_sync: str = "broadcast"):
        if init_sync not in INIT_SYNC_MODES:
            raise ValueError(f"init_sync must be one of {INIT_SYNC_MODES} (got {init_sync!r})")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (got {max_grad_norm})")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.comm = comm
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_steps = 0
        #: How the gradient norm for clipping is measured: None for the norm of this
        #: worker's parameters; a pipeline stage sets it to the norm over all its stages.
        self.grad_norm_fn = None
        self._sync_initial_state(init_sync)

    # ----------------------------------------------------------------------- initial state
    def _sync_initial_state(self, mode: str) -> None:
        """Broadcast parameters and buffers from worker 0, then verify checksums.

        Workers that silently start from different weights was a real bug in a public
        DiLoCo implementation; the checksum makes it impossible to miss.
        """
        state = [t for t in self.model.state_dict(keep_vars=True).values()
                 if isinstance(t, torch.Tensor)]
        if mode == "broadcast":
            with torch.no_grad():
                for dtype in sorted({t.dtype for t in state}, key=str):
                    same = [t for t in state if t.dtype == dtype]
                    flat = torch.cat([t.detach().reshape(-1) for t in same])
                    self.comm.broadcast(flat, src=0, tag="setup").wait()
                    offset = 0
                    for t in same:
                        t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
        self.comm.verify_identical(state, what="initial weights")

    # ----------------------------------------------------------------------------- the loop
    def clip_gradients(self) -> None:
        if self.max_grad_norm is None:
            return
        if self.grad_norm_fn is None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            return
        # As clip_grad_norm_ does, with the norm measured by grad_norm_fn.
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = self.grad_norm_fn(self.params)
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device) if grads else coef)

    def step(self) -> None:
        """One inner step (replaces ``optimizer.step()``); communicates when its turn comes."""
        raise NotImplementedError

    def flush(self) -> None:
        """Finish communication still in flight; call it after the last step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters to evaluate, by name (usable with ``torch.func.functional_call``)."""
        return dict(self.model.named_parameters())

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue: model, inner optimizer, counters, outer state."""
        return {"model": self.model.state_dict(),
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "inner_steps": self.inner_steps}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_steps = int(state["inner_steps"])


def flatten_fp32(tensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate tensors into one fp32 vector (a single message instead of many)."""
    total = sum(t.numel() for t in tensors)
    if out is None:
        out = torch.empty(total, dtype=torch.float32, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return out


def unflatten_views(flat: torch.Tensor, like) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each tensor of ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views
