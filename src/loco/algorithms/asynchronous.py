"""Asynchronous outer steps for the methods with a global copy: no worker waits for the
slowest, and a slow worker's pseudo-gradient is applied when it arrives, at most S outer
steps old.

With speed-aware local steps every round of H ticks ends at the same wall time for every
worker: a worker of speed s trains about s·H of its ticks (``loco.training.local_steps``).
Without asynchrony each worker sends those s·H steps at every sync. With it (``max_staleness``
S > 0) a worker's *block* spans rounds: it keeps training its replica past a sync until the
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

**Quorum and grace window** (Decoupled DiLoCo's syncer, arXiv 2604.21428; ``--quorum Q``,
``--grace SECONDS``). A block is *ready* at a sync when it holds H steps, or is *due*: it
has seen S outer steps since it began (its staleness bound) or the run's last full round
ends. Its *arrival* is when it became ready, in seconds from the moment its worker reached
the sync, on that worker's clock (<= 0); a block not ready arrives at its projected
completion, its missing steps times its worker's step time (> 0). The workers agree on the
arrivals with one small all-gather (one float each), then every worker applies the same
rule (``admit``):

- fewer than Q blocks ready: the sync is held: nothing is sent and no outer step is taken
  (the syncer waits for its quorum; no worker does: every block goes on), except at the
  run's last round;
- otherwise the sync merges every ready block, and every other block that arrives by
  T_Q + grace (T_Q: the Q-th earliest arrival among the ready ones), with the steps it
  holds: Decoupled DiLoCo's syncer would wait that long for it; loco does not hold the
  others, it takes the block as it is, token-weighted by its steps.

The blocks left out go on and merge at a later sync. Q = 1 without grace is the rule above
whenever every sync has a ready block. A block's staleness is then the outer steps taken
since it began (a held sync takes none), at most S.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loco.options import ConfigError, need


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


def admit(held: list[int], stale: list[int], arrivals: list[float], quorum: int,
          grace: float, sync_every: int, max_staleness: int, last: bool = False
          ) -> list[int] | None:
    """The workers whose blocks a sync merges, by Decoupled DiLoCo's quorum and grace window
    (see the module); None: the sync is held (fewer than ``quorum`` blocks are ready).

    Args:
        held: every worker's steps in its block so far, by worker (0: none).
        stale: every worker's outer steps since its block began.
        arrivals: every worker's arrival in seconds from the sync (<= 0: ready when it
            came; > 0: its projected completion, ``inf`` where unknown).
        quorum: Q, the fewest ready blocks a sync merges, in [1, M].
        grace: seconds after the Q-th ready arrival within which a block not ready yet is
            merged too, >= 0.
        sync_every: H, the steps of a complete block.
        max_staleness: S >= 1: a block that has seen S outer steps is due.
        last: the run's last full round: every block with steps is due, and the sync is
            not held.

    Returns:
        The merged workers, in order, or None.
    """
    due = [h > 0 and (last or s >= max_staleness) for h, s in zip(held, stale)]
    ready = [h >= sync_every or d for h, d in zip(held, due)]
    times = sorted(min(a, 0.0) for a, r in zip(arrivals, ready) if r)
    if not times or (len(times) < quorum and not last):
        return None
    close = times[min(quorum, len(times)) - 1] + grace
    return [m for m, (r, h, a) in enumerate(zip(ready, held, arrivals))
            if r or (h > 0 and a <= close)]


def check_whole_model(cfg: Any) -> None:
    """What asynchronous outer steps and proportional local steps ask of a method's own
    options: asynchronous steps (``max_staleness`` > 0) end a block at a whole-model sync
    that nothing overlaps (one fragment, no overlap, no eager updates); an elastic run with
    proportional steps weighs a retried sync for its new members, which an error-fed
    pseudo-gradient does not allow.

    Args:
        cfg: the configuration; options its method does not have read as unset.

    Raises:
        ConfigError: naming ``max_staleness`` or ``local_steps`` and what it needs.
    """
    own = cfg.method
    if cfg.runtime.max_staleness:
        for name, ok in (("fragments", getattr(own, "fragments", 1) == 1),
                         ("overlap", str(getattr(own, "overlap", 0)) == "0"),
                         ("eager", not getattr(own, "eager", False))):
            if not ok:
                raise ConfigError("max_staleness", "asynchronous outer steps sync the whole "
                                  f"model at a round's end, nothing in flight: not with --{name}"
                                  f" {getattr(own, name)} (use diloco or sparseloco, or "
                                  "streaming with --fragments 1 --overlap 0)")
    feedback = getattr(own, "error_feedback", 0)
    if cfg.runtime.local_steps == "proportional" and cfg.runtime.elastic and feedback:
        raise ConfigError("local_steps", "proportional with --elastic weighs a retried sync "
                          "for its new members, which an error-fed pseudo-gradient does not "
                          f"allow: not with --error-feedback (got {feedback})")


def check_quorum(cfg: Any) -> None:
    """``quorum`` only with asynchronous outer steps (``max_staleness`` >= 1), in [1, M],
    not elastic; ``grace`` only with it, a finite number >= 0.

    Raises:
        ConfigError: naming the option and what it allows.
    """
    if cfg.runtime.quorum is None:
        if cfg.runtime.grace is not None:
            raise ConfigError("grace", f"only means something with --quorum (got {cfg.runtime.grace})")
        return
    if not cfg.runtime.max_staleness:
        raise ConfigError("quorum", "decides the syncs of asynchronous outer steps: add "
                          f"--max-staleness S >= 1 (got --quorum {cfg.runtime.quorum} with "
                          "--max-staleness 0)")
    need(cfg, 1 <= cfg.runtime.quorum <= cfg.runtime.workers, "quorum",
         f"must be an integer in [1, --workers {cfg.runtime.workers}]")
    need(cfg, not cfg.runtime.elastic, "quorum", "is not supported with --elastic yet (its quorum is "
         "--min-workers)")
    if cfg.runtime.grace is not None:
        need(cfg, math.isfinite(cfg.runtime.grace) and cfg.runtime.grace >= 0, "grace",
             "must be a number of seconds >= 0")


__all__ = ["BlockStarts", "admit", "check_quorum"]
