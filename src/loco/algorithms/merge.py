"""Where a fragment's global copy meets the replica: the pseudo-gradient that leaves it and
the merge that brings the synced global copy back.

- the pseudo-gradient ``Δ_{m,p} = θ^g_p − θ_{m,p}`` (old global minus new local);
- the merge ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``, α the share of the local values
  kept (Streaming DiLoCo's mixing; α = 0, DiLoCo's, copies the global values);
- the restart ``θ_{m,p} ← θ^g_p`` (a skipped sync, a worker that healed).

Each works on this rank's share of the fragment; after a write the worker's ranks gather the
whole fragment ([`Share.gather`][loco.algorithms.sharding.Share.gather]).
"""

from __future__ import annotations

import torch

from loco.algorithms.buffers import subtract_from
from loco.algorithms.fragments import Fragment
from loco.algorithms.sharding import unflatten_views


def pseudo_gradient(f: Fragment, start: torch.Tensor | None = None) -> None:
    """Δ = θ^g − θ_m into ``f.delta`` (θ^g: ``start``, flat like the global copy, where
    given): one pass per tensor where all three are on one device; offloaded, θ^g comes
    over in pieces.

    Args:
        f: the fragment.
        start: the global copy to take Δ from instead of ``f.global_flat`` (an asynchronous
            block's start); default None.
    """
    views = f.share.views
    base = f.global_flat if start is None else start
    if base.device == f.delta.device and all(v.device == f.delta.device for v in views):
        for g, v, d in zip(unflatten_views(base, views), views, unflatten_views(f.delta, views)):
            torch.sub(g, v, out=d)
        return
    f.share.read(out=f.delta)
    subtract_from(base, f.delta)


def merge(fragment: Fragment, alpha: float, toward: torch.Tensor | None = None) -> None:
    """θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p (α = 0 copies the global value), on this
    rank's share, or toward ``toward`` (flat: eager, the global copy itself, not staged
    through Δ's buffer); then the worker's ranks gather the whole fragment.

    Args:
        fragment: the fragment whose sync was applied.
        alpha: α, in [0, 1].
        toward: the flat values to merge toward instead of the global copy's views;
            default None.
    """
    views = fragment.share.views
    source = (fragment.global_params if toward is None
              else unflatten_views(toward, views))
    if (toward is None and views
            and fragment.global_flat.device != views[0].device == fragment.delta.device):
        # Offloaded: one copy of the fragment to the device, into Δ̄'s buffer (spent).
        staged = fragment.delta[:fragment.global_flat.numel()]
        staged.copy_(fragment.global_flat, non_blocking=True)
        source = unflatten_views(staged, views)
    global_params = [g.to(v.device, v.dtype, non_blocking=True)
                     for g, v in zip(source, views)]
    if alpha == 0:
        torch._foreach_copy_(views, global_params)
    else:
        torch._foreach_lerp_(views, global_params, 1 - alpha)
    fragment.share.gather()


def restart(fragment: Fragment) -> None:
    """θ_{m,p} ← θ^g_p on this rank's share; then the worker's ranks gather the fragment.

    Args:
        fragment: the fragment.
    """
    views = fragment.share.views
    torch._foreach_copy_(views, [g.to(v.device, v.dtype)
                                 for g, v in zip(fragment.global_params, views)])
    fragment.share.gather()


__all__ = ["merge", "pseudo_gradient", "restart"]
