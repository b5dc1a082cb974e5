"""The outer loop of the methods that keep a global copy θ^g apart from the replicas: DiLoCo,
Streaming DiLoCo and the methods built on them (SparseLoCo, SPARTA-DiLoCo).

The trained parameters are split into P fragments (P = 1: DiLoCo), each with its own global
copy θ^g_p and outer optimizer (a ``Fragment``, ``loco.algorithms.fragments``). Every
worker m runs inner steps on its own data and, after inner step t:

1. if fragment p is due ([`Schedule`][loco.algorithms.schedule.Schedule]), sends it: the
   pseudo-gradient ``Δ_{m,p} = θ^g_p − θ_{m,p}(t)``
   ([`pseudo_gradient`][loco.algorithms.merge.pseudo_gradient]) is encoded with the codec and
   its mean over the workers ``Δ̄_p`` is *started* asynchronously;
2. at ``t + τ`` (τ = 0: at once, and training waits) waits for ``Δ̄_p``, steps
   ``θ^g_p ← OuterOpt_p(θ^g_p, Δ̄_p)`` (SGD, fp32) and merges the result into the working copy
   ([`merge`][loco.algorithms.merge.merge]): ``θ_{m,p} ← α · θ_{m,p} + (1 − α) · θ^g_p``.

Each around this cycle is optional and kept apart: error feedback (``loco.algorithms.buffers``),
eager updates ([`Eager`][loco.algorithms.eager.Eager]), the outer step on a helper thread
([`OuterThread`][loco.algorithms.outer_thread.OuterThread]), asynchronous outer steps
([`BlockStarts`][loco.algorithms.asynchronous.BlockStarts]).
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

from loco.algorithms.asynchronous import BlockStarts
from loco.algorithms.base import Algorithm
from loco.algorithms.buffers import SyncBuffers, error_feedback, feed_back, swap
from loco.algorithms.eager import Eager, check_variant
from loco.algorithms.fragments import (Fragment, build_fragment, fragment_outer_state,
                                       load_fragment, make_momentum, momentum_of,
                                       save_fragment, split_fragments)
from loco.algorithms.merge import merge, pseudo_gradient, restart
from loco.algorithms.method import OUTER
from loco.algorithms.outer_thread import OuterThread
from loco.algorithms.schedule import Schedule
from loco.algorithms.sharding import Share, local
from loco.algorithms.sparse_wire import SPARSE_KEYS, fragment_codecs
from loco.comm import Comm, Handle
from loco.comm.codecs import get_codec
from loco.comm.hostreads import allowed


@dataclass
class _InFlight:
    fragment: Fragment
    handle: Handle | None  # None once the result is known (restored from a checkpoint)
    sent_at: int
    record: dict | None = None  # the operation's counters, when restored from a checkpoint
    stepped: Future | None = None  # the outer step computed on the OuterThread, if used
    contributes: bool = True  # False: this worker sent zeros (its asynchronous block goes on)


class GlobalCopy(Algorithm):
    """The outer loop shared by the methods with a global copy (see the module's
    description); a method sets its arguments: DiLoCo one fragment, τ = 0 and α = 0.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between two syncs of the same fragment, an integer >= 1.
        fragments: P, an integer, or an explicit list of fragments (see
            [`split_fragments`][loco.algorithms.fragments.split_fragments]); at most H.
        pattern: how blocks are dealt out for an integer P > 1 (``"strided"`` or
            ``"sequential"``).
        overlap: τ, inner steps a sync stays in flight before it is applied, an integer with
            0 <= τ < floor(H / P).
        alpha: α, the share of the local parameters kept at a merge, in [0, 1].
        codec: wire format of the pseudo-gradients, one of
            [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES]; the reduction itself is fp32.
        codec_block: values per power-of-two scale of the 8-, 4- and 2-bit codecs, an
            integer in [2, 65536] (even for the 4-bit ones, a multiple of 4 for ``int2``), or
            values per chunk of ``topk_2bit``; None: 32, or 4096 for ``topk_2bit``; ignored
            for fp32 and bf16.
        codec_keep: share of the values the sparse codecs send, in (0, 1]; None: their own
            (1/8 for ``topk``, ``dare``, ``random_drop``, 1/64 per chunk for ``topk_2bit``).
        error_feedback: β of the error feedback, in [0, 1) (0: none). Each worker keeps,
            per fragment, what its codec has not sent yet: before a send
            ``e ← β·e + Δ``, the codec sends ``C(e)`` and the worker keeps
            ``e ← e − D(C(e))``, where ``D(C(e))`` is exactly what its own chunks became on
            the wire (the mean's second encoding, shared by all, is not fed back).
        outer_lr: learning rate of the outer SGD, > 0.
        outer_momentum: momentum of the outer SGD, in [0, 1).
        nesterov: Nesterov momentum or heavy-ball (False); without effect when
            ``outer_momentum`` is 0.
        offload: keep the global copy θ^g and the outer optimizer state in CPU memory
            instead of on the parameters' device.
        outer_thread: compute each outer step on a helper thread as soon as Δ̄_p arrives,
            during the τ overlapped steps (see
            [`OuterThread`][loco.algorithms.outer_thread.OuterThread]); bit for bit the
            same results. None: when it pays, i.e. with ``offload`` from an accelerator and
            τ >= 1. Not with an elastic ``comm`` (its syncs may be retried on the training
            thread).
        eager: eager updates (see [`Eager`][loco.algorithms.eager.Eager]): when a fragment
            is sent this worker takes its outer step at once, with its own pseudo-gradient
            for its share and the others' from an earlier sync of the fragment, on its own
            global copy (which then differs between workers). Not with an elastic ``comm``
            or ``outer_thread``.
        eager_variant: ``"1-outer-step"`` (the others' share from the previous sync) or
            ``"2-outer-steps"`` (from the one before); None: the first. Only with ``eager``.
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

    shared = OUTER
    global_copy = True
    sparse_defaults: dict = {}  # a chunked top-k's layout, values and mean where not given

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm, *,
                 sync_every: int, fragments: int | Sequence, pattern: str, overlap: int,
                 alpha: float, codec: str, codec_block: int | None, codec_keep: float | None,
                 error_feedback: float, outer_lr: float, outer_momentum: float,
                 nesterov: bool, offload: bool, outer_thread: bool | None, eager: bool,
                 eager_variant: str | None, **kwargs: Any):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1 (got {sync_every!r})")
        names = split_fragments(model, fragments, pattern)
        self.schedule = Schedule(sync_every, len(names), overlap)
        """When each fragment is sent and applied (``loco.algorithms.schedule``)."""
        _check_arguments(alpha, outer_lr, outer_momentum, outer_thread, comm.elastic, eager,
                         error_feedback)
        check_variant(eager, eager_variant)
        self.error_feedback = error_feedback
        self.codec = get_codec(codec, codec_block, device=comm.device, keep=codec_keep)
        sparse = {k: kwargs.pop(k) for k in SPARSE_KEYS if k in kwargs}
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.alpha, self.offload = alpha, offload
        self.outer_steps = 0
        """Syncs applied (or skipped) so far, over all fragments."""
        self.sync_log: list[dict] = []
        """One record per applied sync, for the caller to drain: ``step`` (when it was
        sent), ``applied_step``, ``fragment``, ``raw_bytes``, ``wire_bytes``,
        ``received_bytes``, ``seconds_in_flight`` and ``seconds_waited``."""
        self._in_flight: _InFlight | None = None
        self._build(names, sparse, {"lr": outer_lr, "momentum": outer_momentum,
                                    "nesterov": nesterov and outer_momentum > 0}, eager)
        self.eager = Eager(self.fragment_list, comm.size, eager_variant) if eager else None
        """The eager updates' state (``eager=True``), or None."""
        self.blocks: BlockStarts | None = None
        """Asynchronous outer steps' block starts (``keep_block_starts``), or None."""
        if outer_thread is None:  # it pays where the CPU is idle while the device computes
            outer_thread = (offload and self.params[0].device.type != "cpu" and overlap > 0
                            and not comm.elastic and not eager)
        self._outer = (OuterThread(self.outer_device, self.params[0].device) if outer_thread
                       else None)

    def _build(self, names: list[list[str]], sparse: dict, sgd: dict, eager: bool) -> None:
        """The fragments (``fragment_list``), their codecs and the sync buffers."""
        self.outer_device = torch.device("cpu") if self.offload else self.params[0].device
        """Where the global copies and outer optimizers live."""
        by_name = dict(self.model.named_parameters())
        # With R ranks per worker each holds and syncs 1/R: no worker sends R copies.
        shares = [Share([by_name[n] for n in group], self.inner) for group in names]
        self.codecs = fragment_codecs(self.codec, shares, **sparse,  # one per fragment
                                      defaults=self.sparse_defaults)
        # Δ lives where the Comm takes it: its device, or the global copy's when the Comm
        # stages (an elastic worker's gloo group, its model on a GPU). One sync is in flight
        # at a time: one Δ (and one D(C(e))) for all fragments, sized to the largest.
        wire = self.outer_device if self.comm.stage_from is not None else self.comm.device
        self.buffers = SyncBuffers([s.numel for s in shares], wire, self.outer_device,
                                   self.params[0].device,
                                   separate_grad=wire != self.outer_device or eager,
                                   sent=bool(self.error_feedback))
        """The buffers of the sync in flight (``loco.algorithms.buffers.SyncBuffers``)."""
        self._sent = self.buffers.sent  # D(C(e)) of the fragment in flight
        self.fragment_list = [
            build_fragment(p, group, share, self.buffers, self.outer_device,
                           self.params[0].device, sgd, self.offload, bool(self.error_feedback))
            for p, (group, share) in enumerate(zip(names, shares))]
        """Every fragment and its state (this rank's share)."""
        for fragment in self.fragment_list:  # compiled now, not inside the first syncs
            self.codecs[fragment.index].prepare(fragment.delta.numel(), self.comm.size,
                                                self.comm.device)

    @property
    def sync_every(self) -> int:
        """H, inner steps between two syncs of the same fragment (the schedule's)."""
        return self.schedule.sync_every

    @property
    def overlap(self) -> int:
        """τ, inner steps a sync stays in flight (the schedule's)."""
        return self.schedule.overlap

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
        """Advance the schedule by one inner step without training (a worker that trains
        fewer steps per round: speed-aware local steps, ``loco.algorithms.pacing``): the
        syncs due at it are sent and applied as at any step."""
        self.inner_steps += 1
        t = self.inner_steps
        index = self.schedule.due(t)
        if index is not None and not self.pacing.held(t):
            self._send(self.fragment_list[index], t)
        if self._in_flight is not None and self.schedule.applies(self._in_flight.sent_at, t):
            self._apply()

    def keep_block_starts(self) -> None:
        """Asynchronous outer steps: a sync this worker's weight is 0 in
        (``pacing.weight_of``) gets zeros from it and leaves its replica training; the
        pseudo-gradient it sends at the end of such a block is taken from the global copy
        the block started from (see ``loco.algorithms.asynchronous``)."""
        self.blocks = BlockStarts(self.fragment_list)

    def flush(self) -> None:
        """Apply a sync still in flight now. Call it after the last inner step, so that the
        last fragment sent reaches the global parameters that are evaluated."""
        if self._in_flight is not None:
            self._apply()

    # ----------------------------------------------------------------------------- a send
    @torch.no_grad()
    def _send(self, fragment: Fragment, t: int) -> None:
        """Fragment p is due at inner step ``t``: open the sync's quorum, then issue it (or,
        elastic, go on with the sync a live worker's state was at)."""
        assert self._in_flight is None, "tau < H/P leaves one fragment in flight at a time"
        # elastic: a worker that was behind takes a peer's state and goes on from there
        if self.healing.begin(self.comm, (fragment.index, t)):
            self._resume()
        else:
            self._issue(fragment, t)

    def _issue(self, fragment: Fragment, t: int, joins: bool = False) -> None:
        """Form Δ_{m,p} (weighed by this worker's pace), feed back the error, start its mean
        over the workers and, eager, take the outer step now; ``joins``: this worker joined
        the sync late (elastic) and contributes zeros."""
        # The profiler's ranges of a sync (docs/profiling.md): pseudo_gradient here; encode,
        # all_to_all, reduce, all_gather and decode on the communication thread; wait,
        # outer_step and merge in _apply.
        weight = self.pacing.weight(t, self.sync_every)
        with record_function("loco/pseudo_gradient"):
            if weight == 0:  # asynchronous: this worker's block goes on; it sends zeros
                fragment.delta.zero_()
            else:
                pseudo_gradient(fragment, None if self.blocks is None
                                else self.blocks.of(fragment))
        # weighed by the steps behind it: by the Comm (an elastic retry weighs it anew), or
        # here, before the error feedback or the eager update takes it
        scale = weight if self.pacing.weighed else None
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
                stepped = self.eager.step(fragment, self.ranks.agree)
            if stepped:  # (Δ's buffer is in flight: the copy is not staged through it)
                with record_function("loco/merge"):
                    merge(fragment, self.alpha, fragment.global_flat)
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
        index, sent_at = self.healing.syncing
        self._issue(self.fragment_list[index], sent_at, joins=True)
        for fragment in self.fragment_list:  # a peer's errors are its own: this one has none
            if fragment.error is not None:
                fragment.error.zero_()
        self._sent.zero_()
        if self.schedule.applies(sent_at, self.inner_steps):
            self._apply()

    def restart_from_global(self) -> None:
        """Set every fragment of the replica to its global copy (a new asynchronous block
        starts there)."""
        for fragment in self.fragment_list:
            restart(fragment)
            if self.blocks is not None:
                self.blocks.begin(fragment)

    # ---------------------------------------------------------------------- a sync applied
    @torch.no_grad()
    def _apply(self) -> None:
        """The sync in flight is due: wait for Δ̄_p, check it is finite, step the fragment's
        outer optimizer (or take the step the helper thread computed) and merge; eager
        updates keep the others' share instead (``_landed``)."""
        flight, self._in_flight = self._in_flight, None
        fragment = flight.fragment
        if self.eager is not None:
            return self._landed(flight)
        what = f"pseudo-gradient (fragment {fragment.index})"
        if flight.stepped is not None:  # stepped on the OuterThread: swap the result in
            stepped = self._outer.wait(flight.stepped, flight.handle)
            self._feed_back(flight)
            if not self.nonfinite.check(fragment.grad, what, self.inner_steps, stepped.finite):
                return self._skip(fragment, flight)
            self._outer.commit(fragment, stepped)
            return self._merged(fragment, flight)
        if flight.handle is not None:
            with record_function("loco/wait"):
                healed = self.comm.settle(flight.handle, self._reweighed(flight)) is None
            if healed:
                return self._resume()  # elastic: healed during a retry, go on from that state
        self._feed_back(flight)
        if not self.nonfinite.check(fragment.delta, what, self.inner_steps):
            return self._skip(fragment, flight)
        with record_function("loco/outer_step"):
            if fragment.grad is not fragment.delta:  # offloaded: Δ̄ comes to the CPU, which
                with allowed("sync"):  # steps it at once: a read of the device, at a sync
                    fragment.grad.copy_(fragment.delta)
            fragment.outer_optimizer.step()
        self._merged(fragment, flight)

    def _landed(self, flight: _InFlight) -> None:
        """Eager: the sync's average has arrived; the others' share of it is kept for the
        fragment's outer step at a later send (its own step was taken at this one's)."""
        fragment = flight.fragment
        if flight.handle is not None:
            with record_function("loco/wait"):
                self.comm.settle(flight.handle)
        self._feed_back(flight)
        finite = self.nonfinite.check(fragment.delta,
                                      f"pseudo-gradient (fragment {fragment.index})",
                                      self.inner_steps)
        self.eager.landed(fragment, finite)
        if not finite:
            return self._skip(fragment, flight)
        fragment.syncs += 1
        self.outer_steps += 1
        self._log(fragment, flight)

    def _reweighed(self, flight: _InFlight) -> Callable[[], Handle] | None:
        """Elastic, weighed by steps: a retry of the sync issues the same pseudo-gradient
        weighed for the new contributors (None: the same input again)."""
        if not self.pacing.weighed:
            return None
        handle = flight.handle

        def reissue() -> Handle:
            nonlocal handle
            handle = handle.reissue(self.pacing.weight(flight.sent_at, self.sync_every))
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
        restart(fragment)
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
                merge(fragment, self.alpha)
            if self.blocks is not None:
                self.blocks.begin(fragment)
        fragment.syncs += 1
        self.outer_steps += 1
        self._log(fragment, flight)

    def _log(self, fragment: Fragment, flight: _InFlight) -> None:
        """Count the sync's bytes in the fragment's stats and append its record to
        ``sync_log`` (nothing where its counters are unknown)."""
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
        if not ((self.offload or self.ranks.sharded)
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
        in_flight = None if self._in_flight is None else self._flight_state(tensors)
        fragments = [save_fragment(f, tensors, None if self.blocks is None else self.blocks.of(f))
                     for f in self.fragment_list]
        eager = ({"others": [list(q) for q in self.eager.others]} if tensors and self.eager
                 else None)
        return {**super().state_dict(tensors), "outer_steps": self.outer_steps,
                "fragments": fragments, "in_flight": in_flight, "eager": eager}

    def _flight_state(self, tensors: bool) -> dict:
        """The sync in flight, waited for (its result is fixed once sent): which fragment,
        when it was sent, its counters and, with ``tensors``, Δ̄ (and what eager updates
        and error feedback keep of it)."""
        flight = self._in_flight
        self._wait(flight)
        rec = flight.handle.record if flight.handle is not None else None
        state = {"fragment": flight.fragment.index, "sent_at": flight.sent_at,
                 "record": flight.record if rec is None else {
                     k: getattr(rec, k) for k in ("raw_bytes", "sent_bytes",
                                                  "recv_bytes", "seconds", "waited")}}
        if tensors:
            state["delta"] = flight.fragment.delta
            if self.eager is not None:
                n = flight.fragment.delta.numel()
                state["own"] = self.eager.own[:n]
            if flight.fragment.error is not None:
                state["sent"] = self._sent[:flight.fragment.delta.numel()]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.global_copy.GlobalCopy.state_dict]
        saved, including the sync in flight, so the run continues exactly.

        Args:
            state: a dict from ``state_dict()`` of an algorithm built the same way.

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
            load_fragment(f, s, None if self.blocks is None else self.blocks.of(f))
        self._in_flight = None
        if state["in_flight"] is not None:
            self._load_flight(state["in_flight"])

    def _load_flight(self, saved: dict) -> None:
        """Restore the sync in flight that ``_flight_state`` saved (its result, known)."""
        fragment = self.fragment_list[saved["fragment"]]
        if "delta" in saved:
            fragment.delta.copy_(saved["delta"])
        if "sent" in saved:
            self._sent[:fragment.delta.numel()].copy_(saved["sent"])
        if "own" in saved and self.eager is not None:
            n = fragment.delta.numel()
            self.eager.own[:n].copy_(saved["own"])
        self._in_flight = _InFlight(fragment, None, int(saved["sent_at"]), saved.get("record"))

    def outer_state(self) -> dict:
        """Every fragment's global copy and outer momentum and the pseudo-gradient in
        flight, this rank's share of each
        (see [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        state = {}
        for f in self.fragment_list:
            state.update(fragment_outer_state(f))
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
                make_momentum(f)
        super().load_outer_state(values)


def _check_arguments(alpha: float, outer_lr: float, outer_momentum: float, outer_thread: Any,
                     elastic: bool, eager: bool, error_feedback: float) -> None:
    """The outer loop's ranges past the schedule's (see ``GlobalCopy``).

    Raises:
        ValueError: naming the first argument out of range.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha!r})")
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0 (got {outer_lr!r})")
    if not 0 <= error_feedback < 1:
        raise ValueError(f"error_feedback (beta) must be in [0, 1) (got {error_feedback!r})")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1) (got {outer_momentum!r})")
    if outer_thread not in (None, True, False):
        raise ValueError(f"outer_thread must be None, True or False (got {outer_thread!r})")
    if outer_thread and elastic:
        raise ValueError("outer_thread=True needs a fixed group: an elastic comm retries "
                         "a sync on the training thread")
    if eager and (elastic or outer_thread):
        raise ValueError("eager updates need a fixed group of workers (their share is 1/M) "
                         "and step when a sync is sent, not on the outer thread (got "
                         f"elastic={elastic}, outer_thread={outer_thread})")


__all__ = ["GlobalCopy"]
