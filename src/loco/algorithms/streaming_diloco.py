"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512); DiLoCo is its special case.

The model is split into P fragments, each with its own global copy θ^g_p and outer optimizer.
Every worker m runs inner steps (AdamW) on its own data and, after inner step t:

1. if ``t % H == ((p + 1) H / P) % H``, sends fragment p: the pseudo-gradient
   ``Δ_{m,p} = θ^g_p − θ_{m,p}(t)`` (old global minus new local) is encoded with the codec
   (4-bit E3M0 by default) and its mean over workers ``Δ̄_p`` is *started* asynchronously;
2. at ``t + τ`` (τ inner steps of compute later, τ < H / P so one fragment is in flight at a
   time) waits for ``Δ̄_p``, steps ``θ^g_p ← OuterOpt_p(θ^g_p, Δ̄_p)`` (Nesterov SGD, fp32)
   and merges it into the working copy, which has moved on meanwhile:
   ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``.

With P = 1, τ = 0, α = 0 and fp32 this is DiLoCo (:class:`loco.DiLoCo`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.asynchronous import BlockStarts
from loco.algorithms.buffers import (SyncBuffers, error_feedback, feed_back, pinned,
                                     subtract_from, swap)
from loco.algorithms.eager import Eager, check_variant
from loco.algorithms.fragments import PATTERNS, Fragment, split_fragments
from loco.algorithms.fragments import flat_outer_state as _flat_outer_state
from loco.algorithms.method import OUTER, PaperClaim
from loco.algorithms.outer_thread import OuterThread, momentum_of
from loco.algorithms.sharding import Share, local, unflatten_views
from loco.algorithms.sparse_wire import SPARSE_KEYS, fragment_codecs
from loco.algorithms.wire import (
    GlobalCopyOptions,
    StreamingOptions,
    WireOptions,
    check_arguments,
    check_wire,
    outer_kwargs,
    overlaps,
    wire_setting,
    wire_warnings,
)
from loco.comm import Comm, Handle
from loco.comm.codecs import get_codec
from loco.comm.hostreads import allowed
from loco.options import need


def _fragment_spec(cfg, model: nn.Module, tied: bool) -> int | list:
    """P (``fragments``), or for a pipeline stage that holds a copy of the tied embedding,
    name lists with it in fragment 0: its two copies (first and last stage) must be synced
    at the same steps to stay identical."""
    if not tied:
        return cfg.fragments
    names = split_fragments(model, cfg.fragments, cfg.fragment_pattern)
    fragments = [[n for n in group if n != "embed.weight"] for group in names]
    fragments[0].append("embed.weight")
    return fragments


@dataclass
class _InFlight:
    fragment: Fragment
    handle: Handle | None  # None once the result is known (restored from a checkpoint)
    sent_at: int
    record: dict | None = None  # the operation's counters, when restored from a checkpoint
    stepped: Future | None = None  # the outer step computed on the OuterThread, if used
    contributes: bool = True  # False: this worker sent zeros (its asynchronous block goes on)


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


class StreamingDiLoCo(Algorithm):
    """Streaming DiLoCo outer loop around any inner optimizer.

    Fragment p of the P fragments is sent after inner step t when
    ``t % H == ((p + 1) H / P) % H``: its pseudo-gradient ``Δ_{m,p} = θ^g_p − θ_{m,p}`` is
    encoded with the codec and averaged over the M workers while training goes on. τ inner
    steps later the outer step ``θ^g_p ← OuterOpt_p(θ^g_p, Δ̄_p)`` (SGD, fp32) is applied and
    merged into the working copy: ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``. With P = 1,
    τ = 0, α = 0 and fp32 it is DiLoCo.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters (paper: AdamW).
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between two syncs of the same fragment; an integer >= 1,
            default 100.
        fragments: P, the number of fragments the blocks are split into, an integer in
            [1, number of blocks] and <= H (default 1: the whole model at once); or an
            explicit list whose items are modules, parameter names, or lists of them (see
            [`split_fragments`][loco.algorithms.fragments.split_fragments]), of length <= H.
            Fragment p is sent at the steps of
            [`send_offsets`][loco.algorithms.streaming_diloco.send_offsets]; P need not
            divide H.
        pattern: how blocks are dealt out for an integer P > 1: ``"strided"`` (default, the
            paper's: block i to fragment i mod P) or ``"sequential"`` (contiguous runs).
        overlap: τ, inner steps a sync stays in flight before it is applied; an integer with
            0 <= τ < floor(H / P), the smallest gap between two sends; default 1 (0: applied
            right after it was sent, no overlap). Workers may use different τ (the paper's
            robustness experiment): every worker sends at the same steps and applies τ later.
        alpha: α, the share of the local parameters kept when a synced fragment is merged
            back, 0 <= α <= 1; default 0.5 (0: replaced by the global value).
        codec: wire format of the pseudo-gradients, one of
            [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES]; default ``"fp4_e3m0"``
            (4-bit, the paper's). The reduction itself is fp32.
        codec_block: values per power-of-two scale of the 8-, 4- and 2-bit codecs, an
            integer in [2, 65536] (even for the 4-bit ones, a multiple of 4 for ``int2``), or
            values per chunk of ``topk_2bit``; default None: 32, or 4096 for ``topk_2bit``;
            ignored for fp32 and bf16.
        codec_keep: share of the values the sparse codecs send, in (0, 1]; default None
            (their own: 1/8 for ``topk``, ``dare``, ``random_drop``, 1/64 per chunk for
            ``topk_2bit``); ignored by the others.
        error_feedback: β of the error feedback, in [0, 1); default 0 (none). Each worker
            keeps, per fragment, what its codec has not sent yet: before a send
            ``e ← β·e + Δ``, the codec sends ``C(e)`` and the worker keeps
            ``e ← e − D(C(e))``, where ``D(C(e))`` is exactly what its own chunks became on
            the wire (the mean's second encoding, shared by all, is not fed back).
        outer_lr: learning rate of the outer SGD, > 0; default 0.4 (the paper's).
        outer_momentum: momentum of the outer SGD, in [0, 1); default 0.9 (the paper's).
        nesterov: Nesterov momentum (default True, the paper's) or heavy-ball (False);
            without effect when ``outer_momentum`` is 0.
        offload: keep the global copy θ^g and the outer optimizer state in CPU memory
            instead of on the parameters' device (default False).
        outer_thread: compute each outer step on a helper thread as soon as Δ̄_p arrives,
            during the τ overlapped steps (see
            [`OuterThread`][loco.algorithms.outer_thread.OuterThread]); bit for bit the
            same results. Default None: when it pays, i.e. with ``offload`` from an
            accelerator and τ >= 1. Not with an elastic ``comm`` (its syncs may be retried
            on the training thread).
        eager: eager updates (see [`Eager`][loco.algorithms.eager.Eager]): when a fragment
            is sent this worker takes its outer step at once, with its own pseudo-gradient
            for its share and the others' from an earlier sync of the fragment, on its own
            global copy (which then differs between workers). Default False. Not with an
            elastic ``comm`` or ``outer_thread``.
        eager_variant: ``"1-outer-step"`` (the others' share from the previous sync) or
            ``"2-outer-steps"`` (from the one before); default None: the first. Only with
            ``eager``.
        **kwargs: ``sparse_layout``, ``sparse_values``, ``sparse_mean``, a chunked
            top-k's settings ([`fragment_codecs`][loco.algorithms.sparse_wire.fragment_codecs]);
            the rest passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks: ``ctx.inner``).

    Raises:
        ValueError: an argument outside the ranges above (also from
            [`split_fragments`][loco.algorithms.fragments.split_fragments] for a bad
            ``fragments`` or ``pattern``, and from
            [`get_codec`][loco.comm.codecs.catalog.get_codec] for a bad ``codec`` or
            ``codec_block``).
        RuntimeError: the codec cannot run on ``comm``'s device, or the workers' initial
            state differs.
    """

    name = "streaming"
    title = "Streaming DiLoCo"
    sparse_defaults: dict = {}  # a chunked top-k's layout, values and mean where not given
    options = StreamingOptions
    shared = OUTER
    # H = 50, not the paper's 100, for loco train: its default job (400 steps) then has 8
    # rounds, where its loss is within 2% of DiLoCo's (docs/getting-started.md); the class's
    # own default stays the paper's.
    defaults = {"sync_every": 50, "outer_lr": 0.4, "outer_momentum": 0.9, "nesterov": True,
                "codec": "fp4_e3m0", "error_feedback": 0.0}
    global_copy = True
    claims = (
        PaperClaim("loss", "twin", 1, want={"codec": "fp32"}, free=("codec_block", "codec_keep")),
        PaperClaim("loss", "diloco", 2),
        PaperClaim("bytes", "ddp", 100),
        PaperClaim("peak", "diloco"),
        PaperClaim("loss", "twin", 0, want={"eager": False},
                   text="no worse than {ref}'s (the same τ without eager updates)"),
        PaperClaim("loss", "twin", 0, want={"eager": False, "overlap": "1"}, free=("overlap",),
                   text="no worse than {ref}'s (τ = 1 without eager updates)"),
    )

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """P within the smallest stage's blocks and H, every τ below floor(H/P), α in
        [0, 1], the sparse codecs' keep in (0, 1], an even codec block in [2, 65536]."""
        blocks = layers // cfg.stages  # the smallest stage's blocks
        need(cfg, 1 <= cfg.fragments <= blocks, "fragments",
             f"must be in [1, {blocks}], the number of blocks of the {cfg.model} model"
             + (f" in its smallest of {cfg.stages} pipeline stages" if cfg.stages > 1 else ""))
        need(cfg, cfg.fragments <= cfg.sync_every, "fragments",
             f"must be <= --sync-every ({cfg.sync_every}): at most one fragment per step")
        gap = cfg.sync_every // cfg.fragments  # the smallest gap between two sends
        need(cfg, all(0 <= t < gap for t in overlaps(cfg)), "overlap",
             f"every value must be in [0, floor(H/P)) = [0, {gap}), the smallest gap between "
             f"two sends, with --sync-every {cfg.sync_every} and --fragments {cfg.fragments}")
        need(cfg, 0 <= cfg.mixing <= 1, "mixing", "must be in [0, 1]")
        check_wire(cfg)

    @classmethod
    def warnings(cls, cfg) -> list[str]:
        """Fewer inner steps than H: some fragments never sync; the wire's warnings."""
        if cfg.steps < cfg.sync_every:
            return [f"--steps {cfg.steps} is less than --sync-every {cfg.sync_every}: some "
                    "fragments never sync"] + wire_warnings(cfg)
        return wire_warnings(cfg)

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """H, the outer optimizer, the wire, P (with a tied embedding's copies in fragment
        0), the pattern, this replica's τ and α."""
        tied = pipeline is not None and pipeline.module.tied is not None
        return {**outer_kwargs(cfg), "fragments": _fragment_spec(cfg, model, tied),
                "pattern": cfg.fragment_pattern,
                "overlap": overlaps(cfg)[comm.rank],  # the outer Comm's rank: the replica
                "alpha": cfg.mixing}

    @classmethod
    def setting(cls, config: dict) -> str:
        """H, the outer optimizer, P, τ, α and the codec."""
        mixing = config.get("mixing", config.get("alpha"))  # runs saved before the rename
        return (super().setting(config) + f", P={config['fragments']}, "
                f"τ={config['overlap']}, α={mixing}" + wire_setting(config, cls.sparse_defaults))

    @classmethod
    def checkpoint_delay(cls, cfg) -> int:
        """The largest τ: a fragment sent at a round's end is applied τ steps later."""
        return max(overlaps(cfg))

    @classmethod
    def fragment_names(cls, cfg, module, tied: bool) -> list[list[str]]:
        """The fragments as ``kwargs`` builds them (a tied embedding's copy in fragment 0)."""
        return split_fragments(module, _fragment_spec(cfg, module, tied), cfg.fragment_pattern)

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sync_every: int = 100,
                 fragments: int | Sequence = 1, pattern: str = "strided", overlap: int = 1,
                 alpha: float = 0.5, codec: str = "fp4_e3m0", codec_block: int | None = None,
                 codec_keep: float | None = None, error_feedback: float = 0.0,
                 outer_lr: float = 0.4, outer_momentum: float = 0.9, nesterov: bool = True,
                 offload: bool = False, outer_thread: bool | None = None, eager: bool = False,
                 eager_variant: str | None = None, **kwargs: Any):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1 (got {sync_every!r})")
        names = split_fragments(model, fragments, pattern)
        count = len(names)
        check_arguments(sync_every, count, overlap, alpha, outer_lr, outer_momentum,
                        outer_thread, comm.elastic, eager, error_feedback)
        check_variant(eager, eager_variant)
        self.error_feedback = error_feedback
        self.codec = get_codec(codec, codec_block, device=comm.device, keep=codec_keep)
        sparse = {k: kwargs.pop(k) for k in SPARSE_KEYS if k in kwargs}
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.sync_every, self.overlap, self.alpha = sync_every, overlap, alpha
        self.pattern, self.offload = pattern, offload
        self.outer_steps = 0
        """Syncs applied (or skipped) so far, over all fragments."""
        self.sync_log: list[dict] = []
        """One record per applied sync, for the caller to drain: ``step`` (when it was
        sent), ``applied_step``, ``fragment``, ``raw_bytes``, ``wire_bytes``,
        ``received_bytes``, ``seconds_in_flight`` and ``seconds_waited``."""
        self._in_flight: _InFlight | None = None
        outer_device = torch.device("cpu") if offload else self.params[0].device
        by_name = dict(model.named_parameters())
        sgd = {"lr": outer_lr, "momentum": outer_momentum,
               "nesterov": nesterov and outer_momentum > 0}
        # With R ranks per worker each holds and syncs 1/R: no worker sends R copies.
        shares = [Share([by_name[n] for n in group], self.inner) for group in names]
        self.codecs = fragment_codecs(self.codec, shares, **sparse,  # one per fragment
                                      defaults=self.sparse_defaults)
        # Δ lives where the Comm takes it: its device, or the global copy's when the Comm
        # stages (an elastic worker's gloo group, its model on a GPU). One sync is in flight
        # at a time: one Δ (and one D(C(e))) for all fragments, sized to the largest.
        wire = outer_device if comm.stage_from is not None else comm.device
        self.buffers = SyncBuffers([s.numel for s in shares], wire, outer_device,
                                   self.params[0].device,
                                   separate_grad=wire != outer_device or eager,
                                   sent=bool(error_feedback))
        """The buffers of the sync in flight (``loco.algorithms.buffers.SyncBuffers``)."""
        self._sent = self.buffers.sent  # D(C(e)) of the fragment in flight
        self.fragment_list = [self._fragment(p, group, share, outer_device, sgd)
                              for p, (group, share) in enumerate(zip(names, shares))]
        for fragment in self.fragment_list:  # compiled now, not inside the first syncs
            self.codecs[fragment.index].prepare(fragment.delta.numel(), comm.size, comm.device)
        self.eager = Eager(self.fragment_list, comm.size, eager_variant) if eager else None
        """The eager updates' state (``eager=True``), or None."""
        self.blocks: BlockStarts | None = None
        """Asynchronous outer steps' block starts (``keep_block_starts``), or None."""
        if outer_thread is None:  # it pays where the CPU is idle while the device computes
            outer_thread = (offload and self.params[0].device.type != "cpu" and overlap > 0
                            and not comm.elastic and not eager)
        self._outer = OuterThread(outer_device, self.params[0].device) if outer_thread else None
        # Every worker derives the schedule from the same step counter, so the same fragment
        # is reduced everywhere without a word.
        self._due = dict(zip(send_offsets(sync_every, count), self.fragment_list))

    def _fragment(self, p: int, names: list[str], share: Share, outer_device: torch.device,
                  sgd: dict) -> Fragment:
        """Fragment ``p``: its parameters, this rank's share, the global copy (and error
        feedback) on ``outer_device``, its views of the sync buffers and its outer SGD
        (``sgd``: lr, momentum, Nesterov)."""
        global_flat = share.read().to(outer_device)
        if self.offload:
            global_flat = pinned(global_flat, self.params[0].device)
        delta, grad = self.buffers.of(share.numel)
        global_flat.grad = grad  # the outer optimizer reads Δ̄ as the global copy's gradient
        # One flat tensor: one fused kernel per outer step, no loop over parameters.
        optimizer = torch.optim.SGD([global_flat], **sgd,
                                    fused=outer_device.type in ("cpu", "cuda"))
        error = (pinned(torch.zeros_like(global_flat), self.params[0].device)
                 if self.error_feedback else None)
        return Fragment(p, names, share.params, share, global_flat,
                        unflatten_views(global_flat, share.views), delta, grad, optimizer, error)

    # ----------------------------------------------------------------------------- the loop
    @property
    def sync_in_flight(self) -> bool:
        """Whether a fragment was sent and its sync is not applied yet (for τ steps)."""
        return self._in_flight is not None

    def step(self) -> None:
        """One inner step; then, if a fragment is due, start its sync, and apply the sync
        sent τ steps ago (waiting for it only if it has not arrived yet)."""
        self.inner_update()
        self.idle_step()

    def idle_step(self) -> None:
        """A step of the schedule without an inner update (see
        [`Algorithm.idle_step`][loco.algorithms.base.Algorithm.idle_step]): the syncs due
        at it are sent and applied as at any step."""
        self.inner_steps += 1
        t = self.inner_steps
        fragment = self._due.get(t % self.sync_every)
        if fragment is not None and not (self.sync_held and self.sync_held(t)):
            self._send(fragment, t)
        if self._in_flight is not None and self._in_flight.sent_at + self.overlap == t:
            self._apply()

    def keep_block_starts(self) -> None:
        """Asynchronous outer steps (see
        [`Algorithm.keep_block_starts`][loco.algorithms.base.Algorithm.keep_block_starts])."""
        self.blocks = BlockStarts(self.fragment_list)

    def flush(self) -> None:
        """Apply a sync still in flight now. Call it after the last inner step, so that the
        last fragment sent reaches the global parameters that are evaluated."""
        if self._in_flight is not None:
            self._apply()

    @torch.no_grad()
    def _send(self, fragment: Fragment, t: int) -> None:
        assert self._in_flight is None, "tau < H/P leaves one fragment in flight at a time"
        self._syncing = (fragment.index, t)
        if self.comm.begin():  # elastic: this worker was behind and took a peer's state
            self._resume()
        else:
            self._issue(fragment, t)

    def _issue(self, fragment: Fragment, t: int, joins: bool = False) -> None:
        # The profiler's ranges of a sync (docs/profiling.md): pseudo_gradient here; encode,
        # all_to_all, reduce, all_gather and decode on the communication thread; wait,
        # outer_step and merge in _apply.
        weight = 1.0 if self.weight_of is None else self.weight_of(t, self.sync_every)
        with record_function("loco/pseudo_gradient"):
            if weight == 0:  # asynchronous: this worker's block goes on; it sends zeros
                fragment.delta.zero_()
            else:
                _pseudo_gradient(fragment, None if self.blocks is None
                                 else self.blocks.of(fragment))
        # weighed by the steps behind it: by the Comm (an elastic retry weighs it anew), or
        # here, before the error feedback or the eager update takes it
        scale = weight if self.weight_of is not None else None
        if scale is not None and (fragment.error is not None or self.eager is not None):
            fragment.delta.mul_(scale)
            scale = None
        sent = None
        if fragment.error is not None and weight:  # e ← β·e + Δ; what is sent is C(e)
            error_feedback(fragment.error, fragment.delta, self.error_feedback,
                           self._staging(fragment))
            sent = self._sent[:fragment.delta.numel()]
        if self.eager is not None:
            self.eager.keep_own(fragment)
        handle = self.comm.all_reduce_mean(fragment.delta, tag="train",
                                           codec=self.codecs[fragment.index],
                                           sent=sent, weight=scale)
        # (a worker that joins sends zeros, and takes the new global copy like any other)
        self._in_flight = _InFlight(fragment, handle, t, contributes=weight != 0 or joins)
        if self.eager is not None:  # the outer step now, with this worker's own Δ
            with record_function("loco/outer_step"):
                stepped = self.eager.step(fragment, self.agree)
            if stepped:  # (Δ's buffer is in flight: the copy is not staged through it)
                with record_function("loco/merge"):
                    self._merge(fragment, fragment.global_flat)
        elif self._outer is not None:
            self._in_flight.stepped = self._outer.start(fragment, handle)

    @staticmethod
    def _wait(flight: _InFlight) -> None:
        """Wait for Δ̄_p (this rank's share of it, decoded, in fp32), and for its outer step
        on the helper thread, if any (which writes only its shadows)."""
        if flight.stepped is not None:
            flight.stepped.result()
        if flight.handle is not None:
            with record_function("loco/wait"):
                flight.handle.wait()

    def _resume(self) -> None:
        """After taking a live worker's state (elastic): issue the sync it was at (this
        worker contributes zeros) and apply it if it is due now, as that worker does."""
        index, sent_at = self._syncing
        self._issue(self.fragment_list[index], sent_at, joins=True)
        for fragment in self.fragment_list:  # a peer's errors are its own: this one has none
            if fragment.error is not None:
                fragment.error.zero_()
        self._sent.zero_()
        if sent_at + self.overlap == self.inner_steps:
            self._apply()

    def restart_from_global(self) -> None:
        """Set every fragment of the replica to its global copy (a new asynchronous block
        starts there)."""
        for fragment in self.fragment_list:
            self._restart(fragment)
            if self.blocks is not None:
                self.blocks.begin(fragment)

    @staticmethod
    def _restart(fragment: Fragment) -> None:
        views = fragment.share.views
        torch._foreach_copy_(views, [g.to(v.device, v.dtype)
                                     for g, v in zip(fragment.global_params, views)])
        fragment.share.gather()

    def _landed(self, flight: _InFlight) -> None:
        """Eager: the sync's average has arrived; the others' share of it is kept for the
        fragment's outer step at a later send (its own step was taken at this one's)."""
        fragment = flight.fragment
        if flight.handle is not None:
            with record_function("loco/wait"):
                self.comm.settle(flight.handle)
        self._feed_back(flight)
        finite = self.finite(fragment.delta, f"pseudo-gradient (fragment {fragment.index})")
        self.eager.landed(fragment, finite)
        if not finite:
            return self._skip(fragment, flight)
        fragment.syncs += 1
        self.outer_steps += 1
        self._log(fragment, flight)

    @torch.no_grad()
    def _apply(self) -> None:
        flight, self._in_flight = self._in_flight, None
        fragment = flight.fragment
        if self.eager is not None:
            return self._landed(flight)
        what = f"pseudo-gradient (fragment {fragment.index})"
        if flight.stepped is not None:  # stepped on the OuterThread: swap the result in
            stepped = self._outer.wait(flight.stepped, flight.handle)
            self._feed_back(flight)
            if not self.finite(fragment.grad, what, verdict=stepped.finite):
                return self._skip(fragment, flight)
            self._outer.commit(fragment, stepped)
            return self._merged(fragment, flight)
        if flight.handle is not None:
            with record_function("loco/wait"):
                healed = self.comm.settle(flight.handle, self._reweighed(flight)) is None
            if healed:
                return self._resume()  # elastic: healed during a retry, go on from that state
        self._feed_back(flight)
        if not self.finite(fragment.delta, what):
            return self._skip(fragment, flight)
        with record_function("loco/outer_step"):
            if fragment.grad is not fragment.delta:  # offloaded: Δ̄ comes to the CPU, which
                with allowed("sync"):  # steps it at once: a read of the device, at a sync
                    fragment.grad.copy_(fragment.delta)
            fragment.outer_optimizer.step()
        self._merged(fragment, flight)

    def _reweighed(self, flight: _InFlight) -> Callable[[], Handle] | None:
        """Elastic, weighed by steps: a retry of the sync issues the same pseudo-gradient
        weighed for the new contributors (None: the same input again)."""
        if self.weight_of is None:
            return None
        handle = flight.handle

        def reissue() -> Handle:
            nonlocal handle
            handle = handle.reissue(self.weight_of(flight.sent_at, self.sync_every))
            return handle
        return reissue

    def _feed_back(self, flight: _InFlight) -> None:
        """e ← e − D(C(e)): keep what the codec did not send (error feedback; not when
        this worker sent zeros)."""
        fragment = flight.fragment
        if fragment.error is not None and flight.contributes:
            feed_back(fragment.error, self._sent, self._staging(fragment))

    @staticmethod
    def _staging(fragment: Fragment) -> torch.Tensor | None:
        """Where an offloaded error feedback meets Δ on the host: Δ̄'s host buffer, free
        at a send and before an outer step; None when both are on one device."""
        return None if fragment.error.device == fragment.delta.device else fragment.grad

    def _skip(self, fragment: Fragment, flight: _InFlight) -> None:
        """A non-finite Δ̄_p: the global fragment stays; the replicas restart from it, and
        its error feedback starts over (it may hold the non-finite values)."""
        if fragment.error is not None:
            fragment.error.zero_()
        self._restart(fragment)
        if self.blocks is not None:
            self.blocks.begin(fragment)
        self.outer_steps += 1
        self._log(fragment, flight)

    def _merged(self, fragment: Fragment, flight: _InFlight) -> None:
        """After the outer step: merge (asynchronous: only where this worker's block
        ended, a new one starting from the new global copy; synchronous: every worker, one
        with no steps behind the sync too), and count the sync."""
        if flight.contributes or self.blocks is None:
            with record_function("loco/merge"):
                self._merge(fragment)
            if self.blocks is not None:
                self.blocks.begin(fragment)
        fragment.syncs += 1
        self.outer_steps += 1
        self._log(fragment, flight)

    def _merge(self, fragment: Fragment, toward: torch.Tensor | None = None) -> None:
        """θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p (α = 0 copies the global value), on this
        rank's share, or toward ``toward`` (flat: eager, the global copy itself, not staged
        through Δ's buffer); then the worker's ranks gather the whole fragment."""
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
        if self.alpha == 0:
            torch._foreach_copy_(views, global_params)
        else:
            torch._foreach_lerp_(views, global_params, 1 - self.alpha)
        fragment.share.gather()

    def _log(self, fragment: Fragment, flight: _InFlight) -> None:
        if flight.handle is None and flight.record is None:
            return
        rec = (flight.handle.record if flight.handle is not None
               else SimpleNamespace(**flight.record))
        stats = fragment.stats
        stats["raw_bytes"] += rec.raw_bytes
        stats["bytes_sent"] += rec.sent_bytes
        stats["bytes_received"] += rec.recv_bytes
        stats["peak_bytes"] = max(stats["peak_bytes"], rec.sent_bytes)
        self.sync_log.append({
            "step": flight.sent_at, "applied_step": self.inner_steps, "fragment": fragment.index,
            "raw_bytes": rec.raw_bytes, "wire_bytes": rec.sent_bytes,
            "received_bytes": rec.recv_bytes, "seconds_in_flight": rec.seconds,
            "seconds_waited": rec.waited})

    # -------------------------------------------------------------------------- reporting
    def fragments(self) -> list[list[str]]:
        """The parameter names of each fragment, in the order they are flattened."""
        return [list(f.names) for f in self.fragment_list]

    def fragment_stats(self) -> list[dict]:
        """Per fragment: size, syncs applied and the bytes this worker moved for it."""
        return [{"fragment": f.index, "tensors": len(f.names), "elements": f.share.total,
                 "syncs": f.syncs, **f.stats} for f in self.fragment_list]

    def outer_tensors(self) -> list[torch.Tensor]:
        """This rank's share of every fragment's global copy, outer momentum, error feedback
        and asynchronous block start; the sync buffers (Δ, Δ̄'s host buffer, D(C(e)));
        the eager updates' state and the outer thread's spare shadows."""
        return [t for f in self.fragment_list for t in (
            f.global_flat, *([] if momentum_of(f) is None else [momentum_of(f)]),
            *([] if f.error is None else [f.error]),
            *([] if self.blocks is None else [self.blocks.of(f)]))] + self.buffers.tensors() + (
                [] if self.eager is None else self.eager.tensors()) + (
                [] if self._outer is None else self._outer.tensors())

    @contextmanager
    def global_in_model(self) -> Iterator[dict[str, torch.Tensor]]:
        """The global parameters by name, to evaluate inside the block. Offloaded or
        FSDP2-sharded, the model's own parameters hold θ^g there: their values and the
        global copy's are swapped piece by piece (no copy of the model on its device) and
        swapped back after, exactly; a sync's outer step on the helper thread is waited for
        first (it reads the global copy). Otherwise (or a worker of several ranks holding
        the whole model, or parameters not in fp32) ``global_parameters()``."""
        views = [(v, g) for f in self.fragment_list for v, g in zip(f.share.views,
                                                                     f.global_params)]
        if not ((self.offload or self.sharded)
                and all(f.share.inner is None for f in self.fragment_list)
                and all(v.dtype == g.dtype for v, g in views)):
            yield self.global_parameters()
            return
        if self._in_flight is not None and self._in_flight.stepped is not None:
            wait_for([self._in_flight.stepped])
        mine, theirs = [v for v, _ in views], [g for _, g in views]
        swap(mine, theirs)
        try:
            yield dict(self.model.named_parameters())
        finally:
            swap(mine, theirs)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global copy θ^g of every synced parameter, on the parameters' device, by name
        (the same on every worker; eager: this worker's own); a parameter in no fragment
        (frozen) is the model's own.
        With R ranks per worker it is collective over the worker's ranks (each holds 1/R):
        every rank of the worker calls it at once (its bytes count as ``"report"``, not
        training); under FSDP2 the values are DTensors."""
        by_id = {id(p): g for f in self.fragment_list for p, g in
                 zip(f.params, f.share.full(f.global_flat.to(local(f.params[0]).device),
                                            tag="report"))}
        return {n: by_id[id(p)].to(p.device) if id(p) in by_id else p
                for n, p in self.model.named_parameters()}

    def replicated_tensors(self) -> list[torch.Tensor]:
        """This rank's share of every fragment's global copy and outer momentum; none with
        eager updates (each worker steps its own)."""
        return [] if self.eager is not None else [
            t for f in self.fragment_list for t in (f.global_flat, momentum_of(f)) if t is not None]

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self, tensors: bool = True) -> dict:
        """The base state plus every fragment's global copy and outer optimizer, and the
        sync in flight, if any (waited for: its result is fixed once sent).

        Args:
            tensors: include the tensors (default True); False: the counters only, and
                which outer momenta exist (see
                [`Algorithm.state_dict`][loco.algorithms.base.Algorithm.state_dict]).

        Returns:
            A dict for ``torch.save``, of the live tensors (copy it to keep it).
        """
        in_flight = None
        if self._in_flight is not None:  # its result is fixed once sent: store it
            flight = self._in_flight
            self._wait(flight)
            rec = flight.handle.record if flight.handle is not None else None
            in_flight = {"fragment": flight.fragment.index, "sent_at": flight.sent_at,
                         "record": flight.record if rec is None else {
                             k: getattr(rec, k) for k in ("raw_bytes", "sent_bytes",
                                                          "recv_bytes", "seconds", "waited")}}
            if tensors:
                in_flight["delta"] = flight.fragment.delta
                if self.eager is not None:
                    n = flight.fragment.delta.numel()
                    in_flight["own"] = self.eager.own[:n]
                if flight.fragment.error is not None:
                    in_flight["sent"] = self._sent[:flight.fragment.delta.numel()]
        fragments = [{"syncs": f.syncs, "stats": dict(f.stats)} for f in self.fragment_list]
        for f, s in zip(self.fragment_list, fragments):
            if tensors:
                s.update(global_params=f.global_flat,
                         outer_optimizer=f.outer_optimizer.state_dict())
                if f.error is not None:
                    s["error"] = f.error
                if self.blocks is not None:
                    s["block_start"] = self.blocks.of(f)
            else:
                s["momentum"] = momentum_of(f) is not None
        eager = ({"others": [list(q) for q in self.eager.others]} if tensors and self.eager
                 else None)
        return {**super().state_dict(tensors), "outer_steps": self.outer_steps,
                "fragments": fragments, "in_flight": in_flight, "eager": eager}

    def load_state_dict(self, state: dict) -> None:
        """Restore what
        [`state_dict`][loco.algorithms.streaming_diloco.StreamingDiLoCo.state_dict] saved,
        including the sync in flight, so the run continues exactly.

        Args:
            state: a dict from ``state_dict()`` of a StreamingDiLoCo built the same way.

        Raises:
            ValueError: the checkpoint has a different number of fragments.
        """
        super().load_state_dict(state)
        if len(state["fragments"]) != len(self.fragment_list):
            raise ValueError(f"checkpoint has {len(state['fragments'])} fragments, this run "
                             f"{len(self.fragment_list)}")
        self.outer_steps = int(state["outer_steps"])
        if self.eager is not None and state.get("eager") is not None:
            self.eager.load_others(state["eager"]["others"])
        for f, s in zip(self.fragment_list, state["fragments"]):
            if "global_params" in s:
                f.global_flat.copy_(s["global_params"])
                f.outer_optimizer.load_state_dict(_flat_outer_state(s["outer_optimizer"]))
            elif s.get("momentum"):  # its values come with load_outer_state
                f.outer_optimizer.state[f.global_flat]["momentum_buffer"] = torch.zeros_like(
                    f.global_flat)
            if "error" in s and f.error is not None:
                f.error.copy_(s["error"])
            if "block_start" in s and self.blocks is not None:
                self.blocks.of(f).copy_(s["block_start"])
            f.syncs = int(s["syncs"])
            f.stats.update({k: int(v) for k, v in s.get("stats", {}).items()})
        self._in_flight = None
        if state["in_flight"] is not None:
            fragment = self.fragment_list[state["in_flight"]["fragment"]]
            if "delta" in state["in_flight"]:
                fragment.delta.copy_(state["in_flight"]["delta"])
            if "sent" in state["in_flight"]:
                self._sent[:fragment.delta.numel()].copy_(state["in_flight"]["sent"])
            if "own" in state["in_flight"] and self.eager is not None:
                n = fragment.delta.numel()
                self.eager.own[:n].copy_(state["in_flight"]["own"])
            self._in_flight = _InFlight(fragment, None, int(state["in_flight"]["sent_at"]),
                                        state["in_flight"].get("record"))

    def outer_state(self) -> dict:
        """Every fragment's global copy and outer momentum and the pseudo-gradient in
        flight, this rank's share of each
        (see [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        state = {}
        for f in self.fragment_list:
            state[f"fragment{f.index}.global"] = (f.share, f.global_flat)
            momentum = momentum_of(f)
            if momentum is not None:
                state[f"fragment{f.index}.momentum"] = (f.share, momentum)
            if f.error is not None:
                state[f"fragment{f.index}.error"] = (f.share, f.error)
            if self.eager is not None:
                state.update({f"fragment{f.index}.{k}": (f.share, t)
                              for k, t in self.eager.state_of(f.index).items()})
            if self.blocks is not None:
                state[f"fragment{f.index}.block_start"] = (f.share, self.blocks.of(f))
        if self._in_flight is not None:
            flight = self._in_flight.fragment
            state["in_flight.delta"] = (flight.share, flight.delta)
            if self.eager is not None:
                n = flight.delta.numel()
                state["in_flight.own"] = (flight.share, self.eager.own[:n])
            if flight.error is not None:
                state["in_flight.sent"] = (flight.share, self._sent[:flight.delta.numel()])
        return state

    def load_outer_state(self, values: dict[str, torch.Tensor]) -> None:
        """Set the global copies, outer momenta and pseudo-gradient in flight (see
        [`Algorithm.load_outer_state`][loco.algorithms.base.Algorithm.load_outer_state]).

        Args:
            values: a vector for every name of ``outer_state()``.
        """
        for f in self.fragment_list:  # a momentum is created by the first outer step
            if f"fragment{f.index}.momentum" in values and momentum_of(f) is None:
                f.outer_optimizer.state[f.global_flat]["momentum_buffer"] = torch.zeros_like(
                    f.global_flat)
        super().load_outer_state(values)


def _pseudo_gradient(f: Fragment, start: torch.Tensor | None = None) -> None:
    """Δ = θ^g − θ_m into ``f.delta`` (θ^g: ``start``, flat like the global copy, where
    given): one pass per tensor where all three are on one device; offloaded, θ^g comes
    over in pieces."""
    views = f.share.views
    base = f.global_flat if start is None else start
    if base.device == f.delta.device and all(v.device == f.delta.device for v in views):
        for g, v, d in zip(unflatten_views(base, views), views, unflatten_views(f.delta, views)):
            torch.sub(g, v, out=d)
        return
    f.share.read(out=f.delta)
    subtract_from(base, f.delta)


__all__ = ["PATTERNS", "GlobalCopyOptions", "StreamingDiLoCo", "StreamingOptions", "WireOptions",
           "check_wire", "overlaps", "wire_setting", "wire_warnings"]
