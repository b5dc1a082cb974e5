"""The sync buffers of the methods with a global copy (Streaming DiLoCo, DiLoCo, SparseLoCo),
each sized to what one sync needs, and the arithmetic that crosses between the model's
device and an offloaded global copy without a copy of the model on either side.

**One sync in flight.** Fragment p's sync is applied τ < floor(H/P) steps after it was sent,
before the next fragment is sent (``GlobalCopy`` asserts it), so each worker has exactly
one sync in flight at a time. One pseudo-gradient buffer Δ (on the wire's device), one buffer
for what the codec sent (error feedback) and, where the outer optimizer reads Δ̄ elsewhere
(offloaded, or eager updates' proxy step), one host buffer for it serve every fragment: each
is sized to the largest fragment, and a fragment's are views of its beginning. With the
chunked top-k codec (SparseLoCo) the error feedback keeps ``C(e)``'s bytes, a few per chunk,
rather than a dense ``D(C(e))`` (`SyncBuffers.keep_message`, `feed_back_message`).

**Offloaded.** The global copy, its momentum and the error feedback live in (page-locked)
host memory; what meets the model's values there moves in pieces of at most
``PIECE_VALUES``, so no copy of a fragment is made on the model's device.
"""

from __future__ import annotations

import torch

from loco.comm.hostreads import allowed

PIECE_VALUES = 1 << 24
"""The most values one piece of a transfer between the model's device and the host holds
(64 MiB of fp32): the bound on the temporaries an offloaded pseudo-gradient or an
evaluation's swap allocates on the model's device."""


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) in page-locked memory when the run trains on a GPU (``device``,
    the model's), which then copies from it asynchronously; else ``t`` itself. A CPU run on
    a machine that has a GPU pins nothing and opens no CUDA context.

    Args:
        t: the tensor.
        device: the model's device.
    """
    return t.pin_memory() if t.device.type == "cpu" and device.type == "cuda" else t


class SyncBuffers:
    """The buffers of the one sync in flight, each sized to the largest fragment.

    Args:
        sizes: every fragment's values on this rank (its share's ``numel``), at least one.
        wire: the device the Comm takes Δ on.
        outer: the device of the global copy (the CPU when offloaded).
        compute: the model's device (to pin host buffers for a GPU).
        separate_grad: whether the outer optimizer reads Δ̄ from a buffer of its own on
            ``outer`` (offloaded from another device, or eager updates) rather than from Δ.
        sent: whether to keep the codec's ``D(C(e))`` (error feedback).

    Attributes:
        delta: Δ_p, then Δ̄_p, of the fragment in flight (its first ``numel`` values).
        grad: Δ̄_p where the outer optimizer reads it, or None (it reads ``delta``).
        sent: what this worker's pseudo-gradient became on the wire (empty without error
            feedback): ``D(C(e))``, fp32; or, after `keep_message`, ``C(e)``'s bytes.
    """

    def __init__(self, sizes: list[int], wire: torch.device, outer: torch.device,
                 compute: torch.device, separate_grad: bool, sent: bool):
        n = max(sizes)
        self.sizes = list(sizes)
        self.delta = torch.zeros(n, dtype=torch.float32, device=wire)
        self.grad = (pinned(torch.zeros(n, dtype=torch.float32, device=outer), compute)
                     if separate_grad else None)
        self.sent = torch.zeros(n if sent else 0, dtype=torch.float32, device=wire)

    def of(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fragment of ``numel`` values: its views of ``delta`` and of the buffer its outer
        optimizer reads Δ̄ from (``delta``'s view itself unless ``grad`` is kept)."""
        delta = self.delta[:numel]
        return delta, delta if self.grad is None else self.grad[:numel]

    def keep_message(self, codecs: list) -> bool:
        """Keep the error feedback's ``C(e)``, the encoded bytes (a few per chunk), in
        ``sent`` instead of the dense ``D(C(e))``, where the codec can subtract its kept values
        from them ([`feed_back_message`][loco.algorithms.buffers.feed_back_message]): one
        that ``gathers`` (the chunked top-k), every fragment's bytes no more than its values
        (so a fragment's ``sent[:numel]`` holds them). Else nothing changes.

        Args:
            codecs: each fragment's codec, in the order of ``sizes``.

        Returns:
            Whether ``sent`` now holds bytes.
        """
        nbytes = [codec.encoded_nbytes(n) for codec, n in zip(codecs, self.sizes)]
        if not self.sent.numel() or not all(c.gathers for c in codecs) or any(
                b > n for b, n in zip(nbytes, self.sizes)):
            return False
        self.sent = torch.zeros(max(nbytes), dtype=torch.uint8, device=self.sent.device)
        return True

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer held, for the memory report."""
        return [self.delta, self.sent, *([] if self.grad is None else [self.grad])]


def error_feedback(error: torch.Tensor, delta: torch.Tensor, beta: float,
                   staging: torch.Tensor | None = None) -> None:
    """``e ← β·e + Δ``, then Δ ← e (what the codec sends is C(e)). With ``staging`` (the
    error offloaded to the host, Δ on the model's device) Δ comes to the host through it
    and e goes back in one copy each; the arithmetic is the same, so the bits are too.

    Args:
        error: e, fp32, as many values as ``delta``.
        delta: Δ, fp32, overwritten with the new e.
        beta: β, in [0, 1).
        staging: a free fp32 buffer on ``error``'s device, at least as long; default None
            (both on one device).
    """
    if staging is None:
        error.mul_(beta).add_(delta)
        delta.copy_(error)
        return
    here = staging[:delta.numel()]
    with allowed("sync"):  # the host reads Δ: at a sync
        here.copy_(delta)
    error.mul_(beta).add_(here)
    delta.copy_(error, non_blocking=True)


def feed_back(error: torch.Tensor, sent: torch.Tensor,
              staging: torch.Tensor | None = None) -> None:
    """``e ← e − D(C(e))``: keep what the codec did not send; through ``staging`` when e is
    offloaded to the host and ``sent`` is on the model's device (as for
    [`error_feedback`][loco.algorithms.buffers.error_feedback]).

    Args:
        error: e, fp32.
        sent: ``D(C(e))``, at least as many values (its first are used).
        staging: a free fp32 buffer on ``error``'s device, or None.
    """
    sent = sent[:error.numel()]
    if staging is not None:
        here = staging[:error.numel()]
        with allowed("sync"):
            here.copy_(sent)
        sent = here
    error.sub_(sent)


def feed_back_message(error: torch.Tensor, codec, message: torch.Tensor) -> None:
    """``e ← e − D(C(e))`` from ``C(e)``'s bytes (`SyncBuffers.keep_message`): the codec's
    kept values subtracted where they go, with no dense ``D(C(e))`` (``subtract_flat``); the
    same bits as [`feed_back`][loco.algorithms.buffers.feed_back] with the decoded vector.

    Args:
        error: e, contiguous fp32.
        codec: the chunked top-k codec that made ``message``.
        message: ``C(e)``, uint8, at least ``codec.encoded_nbytes(e.numel())`` bytes (its
            first are used), on any device: a few bytes per chunk come to ``error``'s.
    """
    message = message[:codec.encoded_nbytes(error.numel())]
    if message.device != error.device:
        with allowed("sync"):  # the host reads the message: at a sync
            message = message.to(error.device)
    codec.subtract_flat(message, error)


def subtract_from(base: torch.Tensor, out: torch.Tensor) -> None:
    """``out ← base − out`` (θ^g − θ_m, ``out`` holding θ_m), ``base`` on another device
    (the offloaded global copy): brought over in pieces of at most ``PIECE_VALUES``, so the
    model's device holds one piece of it at a time. Elementwise: the same bits as in one go.

    Args:
        base: θ^g, flat, as many values as ``out``.
        out: θ_m, flat, on the model's device; overwritten.
    """
    for start in range(0, out.numel(), PIECE_VALUES):
        stop = min(start + PIECE_VALUES, out.numel())
        piece = base[start:stop].to(out.device, non_blocking=True)
        torch.sub(piece, out[start:stop], out=out[start:stop])


@torch.no_grad()
def swap(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Exchange the values of each pair of equally shaped tensors (the model's and the
    global copy's), in pieces of at most ``PIECE_VALUES`` through a temporary on ``mine``'s
    device; doing it twice restores both exactly. The host waits for each piece's copy back
    (it may read ``theirs`` at once).

    Args:
        mine: tensors (the model's views), one dtype with ``theirs``.
        theirs: tensors shaped like ``mine``, on any device.
    """
    for a, b in zip(mine, theirs):
        a, b = a.view(-1), b.view(-1)
        for start in range(0, a.numel(), PIECE_VALUES):
            stop = min(start + PIECE_VALUES, a.numel())
            kept = a[start:stop].clone()
            a[start:stop].copy_(b[start:stop], non_blocking=True)
            b[start:stop].copy_(kept)


__all__ = ["PIECE_VALUES", "SyncBuffers", "error_feedback", "feed_back", "feed_back_message",
           "pinned", "subtract_from", "swap"]
