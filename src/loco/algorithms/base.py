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

import math

import torch
from torch import nn

from loco.comm import Comm

INIT_SYNC_MODES = ("broadcast", "verify")
#: What to do with a non-finite gradient or pseudo-gradient: raise NonFiniteError, or skip
#: that inner step or sync (and count it).
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(ArithmeticError):
    """A non-finite gradient or pseudo-gradient, caught before it reached any parameter."""


class Algorithm:
    """Base class: the model, its inner optimizer, the communication and the step counter."""

    #: Whether every worker holds the same global parameters (so one worker may evaluate).
    replicas_identical = True

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm, *,
                 max_grad_norm: float | None = None, init_sync: str = "broadcast",
                 on_nonfinite: str = "stop"):
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES} "
                             f"(got {on_nonfinite!r})")
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
        self.on_nonfinite = on_nonfinite
        #: Inner steps and syncs skipped because of non-finite values (``on_nonfinite="skip"``).
        self.skipped = {"inner_steps": 0, "syncs": 0}
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
    def clip_gradients(self) -> float:
        """Clip the gradient to ``max_grad_norm`` (if set); return its norm before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_norm_fn is not None:  # the norm over all pipeline stages
            norm = self.grad_norm_fn(self.params)
        elif self.max_grad_norm is not None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.max_grad_norm is not None and grads:  # as clip_grad_norm_ does
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return float(norm)

    def inner_update(self) -> bool:
        """Clip and apply the inner optimizer, unless the gradient is non-finite (then raise
        or, with ``on_nonfinite="skip"``, leave the parameters as they are). Every worker
        that sees the same gradient (data-parallel, pipeline stages) decides the same."""
        if not math.isfinite(self.clip_gradients()):
            self.nonfinite("gradient", "inner_steps", self.inner_steps + 1)
            return False
        self.inner_optimizer.step()
        return True

    def finite(self, tensor: torch.Tensor, what: str) -> bool:
        """Whether a reduced pseudo-gradient is finite; if not, raise or count a skipped
        sync. The reduced value is the same on every worker of the sync, and so is the
        decision."""
        if bool(torch.isfinite(tensor).all()):
            return True
        self.nonfinite(what, "syncs", self.inner_steps)
        return False

    def nonfinite(self, what: str, counter: str, step: int) -> None:
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite {what} at step {step}, caught before it reached "
                                 "the parameters (--on-nonfinite stop)")
        self.skipped[counter] += 1

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
                "inner_steps": self.inner_steps, "skipped": dict(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.skipped = {k: int(v) for k, v in state.get("skipped", self.skipped).items()}


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
