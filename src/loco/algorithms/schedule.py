"""When each fragment is sent and when its sync is applied: Streaming DiLoCo's schedule, of
which DiLoCo's is the case of one fragment.

Fragment p of P is sent after inner step t when ``t % H == floor((p + 1) · H / P) % H``, and
its sync is applied τ inner steps later. With τ < floor(H / P), the smallest gap between two
sends, one sync is in flight at a time. Every worker derives the schedule from the same step
counter, so the same fragment is reduced everywhere without a word, whatever τ each worker
chose.
"""

from __future__ import annotations


def send_offsets(sync_every: int, fragments: int) -> list[int]:
    """When each fragment is sent: fragment p at the inner steps t with
    ``t % H == floor((p + 1) · H / P) % H``.

    Consecutive sends are ``floor(H/P)`` or ``ceil(H/P)`` steps apart, the last fragment at
    the round's end (t % H == 0); e.g. H = 100, P = 8: steps 12, 25, 37, 50, 62, 75, 87, 100.

    Args:
        sync_every: H, >= 1.
        fragments: P, in [1, H].

    Returns:
        The P values of ``t % H``, fragment 0 first (distinct).
    """
    return [((p + 1) * sync_every // fragments) % sync_every for p in range(fragments)]


class Schedule:
    """Which fragment is sent after an inner step, and when a sync sent is applied.

    Args:
        sync_every: H, inner steps between two syncs of the same fragment, >= 1.
        fragments: P, the number of fragments, in [1, H].
        overlap: τ, inner steps a sync stays in flight before it is applied, an integer
            with 0 <= τ < floor(H / P).

    Raises:
        ValueError: ``fragments`` > ``sync_every``, or ``overlap`` outside its range.
    """

    def __init__(self, sync_every: int, fragments: int, overlap: int):
        if fragments > sync_every:
            raise ValueError(f"fragments (P={fragments}) must be <= sync_every "
                             f"(H={sync_every}): at most one fragment is sent per step")
        if not isinstance(overlap, int) or not 0 <= overlap < sync_every // fragments:
            raise ValueError(f"overlap (tau) must be an integer in [0, floor(H/P)) = "
                             f"[0, {sync_every // fragments}), the smallest gap between two "
                             f"sends (got {overlap!r})")
        self.sync_every, self.fragments, self.overlap = sync_every, fragments, overlap
        self._due = {offset: p for p, offset in enumerate(send_offsets(sync_every, fragments))}

    def due(self, t: int) -> int | None:
        """The fragment sent after inner step ``t``, or None.

        Args:
            t: the inner step just taken, >= 1.
        """
        return self._due.get(t % self.sync_every)

    def applies(self, sent_at: int, t: int) -> bool:
        """Whether the sync sent after inner step ``sent_at`` is applied after step ``t``.

        Args:
            sent_at: the inner step it was sent at.
            t: the inner step just taken.
        """
        return sent_at + self.overlap == t


__all__ = ["Schedule", "send_offsets"]
