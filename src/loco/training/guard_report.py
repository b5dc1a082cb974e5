"""What the guard saw in a run, for its summary: every rank's guard counters gathered and
combined (``loco.comm.guard``), with the attacks that were injected."""

from __future__ import annotations

import torch

from loco.comm.attacks import parse_attacks
from loco.comm.guard import named
from loco.training.worker import Rank

#: What each aggregation does with a row named for each sign.
ACTIONS = {"drop": {"high": "left out", "low": "left out (named only in a weighed merge)"},
           "clip": {"high": "clipped", "low": "named"},
           "trimmed": {"*": "trimmed coordinate-wise"},
           "median": {"*": "outvoted coordinate-wise"}}


def action(aggregation: str, sign: str) -> str:
    """What ``aggregation`` did with a row named for ``sign`` (a claimed speed named
    ``tokens`` counts as the median's, whatever the aggregation)."""
    if sign == "tokens":
        return "claim counted as the median's"
    by_sign = ACTIONS.get(aggregation, {})
    return by_sign.get("*") or by_sign.get(sign, "left out")


def guard_summary(w: Rank) -> dict | None:
    """The summary's ``guard``: ``aggregation``, ``factor``, ``injected`` (the ``--inject``
    entries), ``detected`` (by worker and sign: ``rows`` named over every reducer,
    ``first_step``, ``last_step`` and the ``action`` taken) and ``peak_ratio`` (by worker:
    the largest ratio of its contribution's norm to the median it was judged by). Collective (a gather of a few
    numbers per rank, tag ``report``); None when the run's algorithm has no guard.

    Args:
        w: this rank's worker.
    """
    guard = w.ctx.comm.shield.guard
    if guard is None:
        return None
    m, k = guard.counts.shape
    mine = torch.cat([guard.counts, guard.first, guard.last,
                      guard.peak[:, None].expand(m, k)], dim=1).to(torch.float64)
    every = torch.stack([r.view(m, 4, k) for r in w.gather_all(mine.flatten())])
    peak = every[:, :, 3, 0].max(dim=0).values  # (ranks, workers, 4, signs)
    counts = every[:, :, 0].sum(dim=0)
    first = torch.where(every[:, :, 1] < 0, torch.inf, every[:, :, 1]).min(dim=0).values
    last = every[:, :, 2].max(dim=0).values
    detected = [{**row, "action": action(guard.aggregation, row["sign"])}
                for row in named(counts, first.nan_to_num(posinf=-1), last)]
    return {"aggregation": guard.aggregation, "factor": guard.factor,
            "injected": [str(a) for a in parse_attacks(w.cfg.trust.inject)], "detected": detected,
            "peak_ratio": [round(float(p), 4) for p in peak]}
