"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706).

Each worker m runs H inner steps (AdamW) on its own data, then every worker:

1. forms the pseudo-gradient          Δ_m = θ^g − θ_m;
2. accumulates it with error feedback  e_m ← β·e_m + Δ_m          (β = 0.95);
3. compresses it                       Δ̂_m = Q(TopK(e_m)): in each 2-D tile of each tensor
                                       (sides the largest divisors <= 64) the 64 largest
                                       magnitudes, each in 2 bits;
4. keeps what was not sent             e_m ← e_m − Δ̂_m;
5. all-gathers and averages            Δ̄_i = mean of Δ̂_{m,i} over the workers m that sent
                                       position i  (top-k sets differ per worker);
6. steps                               θ^g ← θ^g − α·Δ̄   (α = 1, no momentum: the error
                                       feedback stands in for DiLoCo's outer momentum);
7. restarts from it                    θ_m ← θ^g.

This is DiLoCo with the ``topk_2bit`` wire format, error feedback β = 0.95 and outer lr 1
without momentum, and it runs through the same code; the format and the error feedback also
work with Streaming DiLoCo's fragments and overlap (``--algorithm streaming --codec
topk_2bit --error-feedback 0.95``). Step 4 here subtracts the kept values from the message's
bytes, kept until the sync lands, rather than a dense decode of it (Streaming DiLoCo's way):
the same bits, without a model-sized buffer (``SyncBuffers.keep_message``).

Steps 3 and 5 are the reference code's tiles and mean (tplr-ai/templar ``compress.py``),
with loco's 2 bits per tile (sign and half, two magnitudes): the sweep of docs/frontier.md
found them 1-2% ahead of the reference's per-tensor bins (``sparse_values="stat"``) on both
jobs. ``sparse_mean="all"`` is the paper's box (1/M), ``sparse_layout="runs"`` loco's first
layout (chunks of 4096 of the flattened fragment); a worker of several ranks that holds
ranges of flat values (DDP inside) runs it, tiles needing whole tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from loco.algorithms.buffers import feed_back_message
from loco.algorithms.diloco import DiLoCo
from loco.algorithms.method import PaperClaim


class SparseLoCo(DiLoCo):
    """SparseLoCo: DiLoCo whose pseudo-gradients are accumulated with error feedback and sent
    as the chunked top-k in 2 bits, averaged after an all-gather, applied with outer lr 1 and
    no momentum.

    Takes [`DiLoCo`][loco.algorithms.diloco.DiLoCo]'s arguments, with the paper's defaults.

    Args:
        *args: ``model``, ``inner_optimizer``, ``comm``, as for ``DiLoCo``.
        sync_every: H, inner steps between syncs, >= 1; default 30 (the paper's range is
            15-100).
        outer_lr: the outer step's learning rate α, > 0; default 1 (the paper's).
        outer_momentum: default 0 (the paper's: the error feedback stands in for it).
        codec: the wire format; default ``"topk_2bit"`` (64 of every 4096 values, 2 bits
            each, positions Elias-Fano coded); ``"topk_2bit_packed"`` packs the positions in
            12 bits as the peers do; any other codec of ``DiLoCo`` is allowed.
        error_feedback: β, in [0, 1); default 0.95 (the paper's).
        **kwargs: the rest of ``DiLoCo``'s arguments (``codec_block``, ``codec_keep``,
            ``nesterov``, ``offload``, ``max_grad_norm``, ...), and ``sparse_layout``,
            ``sparse_values``, ``sparse_mean`` (default ``sparse_defaults``: tiles, split,
            senders;
            see [`fragment_codecs`][loco.algorithms.sparse_wire.fragment_codecs]).
    """

    name = "sparseloco"
    title = "SparseLoCo"
    defaults = {"sync_every": 30, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": True,
                "codec": "topk_2bit", "error_feedback": 0.95}
    sparse_defaults = {"sparse_layout": "tiles", "sparse_values": "split",
                       "sparse_mean": "senders"}
    claims = (PaperClaim("loss", "diloco", 0, text="below {ref}'s at the same H"),
              PaperClaim("bytes", "streaming", 8,
                         text="at least 8x fewer bytes per worker than {ref}'s (FP4)"))

    def __init__(self, *args: Any, sync_every: int = 30, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, codec: str = "topk_2bit",
                 error_feedback: float = 0.95, **kwargs: Any):
        super().__init__(*args, sync_every=sync_every, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, codec=codec,
                         error_feedback=error_feedback, **kwargs)
        self._keeps_message = self.buffers.keep_message(self.codecs)
        """Whether the error feedback keeps ``C(e)``'s bytes rather than a dense
        ``D(C(e))`` (the chunked top-k: ``SyncBuffers.keep_message``)."""
        self._sent = self.buffers.sent
        self._errors_restarted = False  # elastic: e restarted at 0 under the sync in flight

    def _feed_back(self, flight) -> None:
        """e ← e − D(C(e)), from ``C(e)``'s bytes where they are kept
        (``feed_back_message``: the same bits as the dense subtraction); after ``_resume``,
        whose errors restart at 0 and whose ``D(C(e))`` is 0, nothing."""
        if not self._keeps_message:
            return super()._feed_back(flight)
        fragment = flight.fragment
        if fragment.error is None or not flight.contributes:
            return
        if self._errors_restarted:  # 0 − 0: e stays 0
            self._errors_restarted = False
            return
        feed_back_message(fragment.error, self.codecs[fragment.index], self._sent)

    def _resume(self) -> None:
        """As the global copy's outer loop; the errors restart at 0, so the sync in flight feeds
        nothing back."""
        self._errors_restarted = self._keeps_message
        super()._resume()

    def outer_state(self) -> dict:
        """The global copy's, less the sync in flight's ``C(e)`` where its bytes are kept
        (not a vector of the share's values): ``load_outer_state`` encodes e again."""
        state = super().outer_state()
        if self._keeps_message:
            state.pop("in_flight.sent", None)
        return state

    def load_outer_state(self, values: dict[str, torch.Tensor]) -> None:
        """The global copy's; then, with a sync in flight whose ``C(e)`` is kept as bytes,
        those bytes made again from the loaded e (the encoding is a function of e: the
        same bytes the Comm sent).

        Args:
            values: a vector for every name of ``outer_state()``.
        """
        super().load_outer_state(values)
        flight = self._in_flight
        if self._keeps_message and flight is not None and flight.fragment.error is not None:
            self.codecs[flight.fragment.index].encode_flat(flight.fragment.error, self._sent)


__all__ = ["SparseLoCo"]
