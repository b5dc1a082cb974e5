"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): outer steps by gossip, no collective.

Each worker i keeps private slow weights φ_i and an outer momentum δ_i (zero at start). Every
H inner steps:

1. all workers derive the same random groups of size n from (seed, outer step), with no
   message (:meth:`NoLoCo.groups`);
2. ``Δ_i = θ_i − φ_i`` (new minus old: the opposite sign to DiLoCo's);
3. inside its group only, point to point, a worker swaps Δ and φ with its partners and forms
   the group means in fp32, piece by piece (each at most ``PIECE_BYTES``, the group's
   messages together), so that no message is held whole;
4. ``δ_i ← α·δ_i + β·mean_G(Δ) − γ·(φ_i − mean_G(φ))``; ``φ_i ← φ_i + δ_i``; ``θ_i ← φ_i``.

The paper's printed Eq. 2 has a minus before β; its appendix and code use plus, as here.
Heavy-ball by default, as the official code; ``nesterov=True`` steps by ``α·δ_i + g`` instead
(the look-ahead). With one group of all M workers the γ term vanishes and this is DiLoCo's
outer step with heavy-ball momentum (α = μ, β = lr).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.buffers import PIECE_VALUES
from loco.algorithms.method import OUTER, PaperClaim, leftover_steps
from loco.algorithms.sharding import Share, flatten_fp32, unflatten_views
from loco.comm import Comm
from loco.comm.codecs.contract import Codec
from loco.comm.codecs import CastCodec, get_codec
from loco.comm.hostreads import allowed
from loco.comm.reduce import PIECE_BYTES
from loco.options import need, opt


@dataclass
class NoLoCoOptions:
    """NoLoCo's own options: the gossip groups' size n and the pull γ."""

    group_size: int = opt(2, "n (noloco): workers per random gossip group, redrawn every outer "
                          "step; must divide --workers")
    gamma: float = opt(0.7, "gamma (noloco): pull of each worker's slow weights towards its "
                       "group's mean")

SLOW_CODECS = ("fp32", "bf16")
"""Wire formats allowed for the slow weights φ: at least bf16."""


class NoLoCo(Algorithm):
    """NoLoCo outer loop around any inner optimizer.

    Every H inner steps each worker i swaps its pseudo-gradient ``Δ_i = θ_i − φ_i`` and its
    slow weights φ_i with the n − 1 other members of a random group G, point to point, forms
    the group means in fp32 and steps
    ``δ_i ← α·δ_i + β·mean_G(Δ) − γ·(φ_i − mean_G(φ))``, ``φ_i ← φ_i + δ_i``,
    ``θ_i ← φ_i``. No collective over all M workers: the replicas differ between groups
    (``replicas_identical`` is False), and each evaluates its own.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters (paper: AdamW).
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between outer steps; an integer >= 1, default 50 (the
            paper's).
        group_size: n, workers per gossip group; an integer >= 2 that divides the number of
            workers M (``comm.size``); default 2 (the paper's).
        outer_lr: β, the weight of the group's mean pseudo-gradient; a finite number >= 0,
            default 0.7 (the paper's).
        outer_momentum: α, the outer momentum, in [0, 1); default 0.5 (the paper's).
        gamma: γ, the pull towards the group's mean slow weights; a finite number >= 0,
            default 0.7 (as the official code).
        nesterov: add the Nesterov look-ahead to the heavy-ball step (default False, as the
            official code).
        codec: wire format of Δ, one of [`CODEC_NAMES`][loco.comm.codecs.formats.CODEC_NAMES];
            default ``"fp32"``.
        codec_block: values per power-of-two scale of the 8- and 4-bit codecs, an integer in
            [2, 65536] (even for the 4-bit ones); default 32; ignored for fp32 and bf16.
        codec_keep: share of the values the sparse codecs (``topk``, ``dare``,
            ``random_drop``) send, in (0, 1]; default None (their 1/8); ignored by the others.
        slow_codec: wire format of φ, ``"fp32"`` (default) or ``"bf16"``.
        seed: seed of the groups, the same on every worker; default 0.
        warn: warn (``UserWarning``) when (α, β, γ) leave the region where the paper's
            theory converges (see
            [`convergence_warnings`][loco.algorithms.noloco.convergence_warnings]); default
            True.
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``, ``inner`` (a worker of
            several ranks: ``ctx.inner``).

    Raises:
        ValueError: an argument outside the ranges above.
        RuntimeError: the codec cannot run on ``comm``'s device, or the workers' initial
            state differs.
    """

    name = "noloco"
    title = "NoLoCo"
    options = NoLoCoOptions
    shared = OUTER + ("spread_every", "final_average")
    defaults = {"sync_every": 50, "outer_lr": 0.7, "outer_momentum": 0.5, "nesterov": False}
    replicas_identical = False
    replicas_by_default = True
    # The paper's baseline is DiLoCo with heavy-ball outer momentum, where a run has it.
    claims = (PaperClaim("loss", "diloco", 3, want={"nesterov": False}),)
    piece_bytes = PIECE_BYTES
    """The most bytes one piece of the exchange holds, the group's n messages together:
    the Comm keeps one piece of this worker's message and n − 1 of the others'."""

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """n >= 2 dividing M; γ finite and >= 0."""
        need(cfg, cfg.method.group_size >= 2 and cfg.runtime.workers % cfg.method.group_size == 0, "group_size",
             f"must be an integer >= 2 that divides --workers ({cfg.runtime.workers})")
        need(cfg, math.isfinite(cfg.method.gamma) and cfg.method.gamma >= 0, "gamma", "must be a number >= 0")

    @classmethod
    def warnings(cls, cfg) -> list[str]:
        """(α, β, γ) outside the paper's convergence region; steps past the last sync."""
        return (convergence_warnings(cfg.method.outer_lr, cfg.method.outer_momentum, cfg.method.gamma,
                                     cfg.method.group_size) + leftover_steps(cfg))

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """H, n, β, α, γ, Nesterov and the seed of the groups."""
        return {"sync_every": cfg.method.sync_every, "group_size": cfg.method.group_size,
                "outer_lr": cfg.method.outer_lr, "outer_momentum": cfg.method.outer_momentum,
                "gamma": cfg.method.gamma, "nesterov": cfg.method.nesterov, "seed": cfg.run.seed, "warn": False}

    @classmethod
    def setting(cls, config: dict) -> str:
        """H, β, α, the groups' n and γ."""
        return (f"H={config['sync_every']}" + cls.outer_setting(config)
                + f", n={config['group_size']}, γ={config['gamma']}")

    @classmethod
    def outer_setting(cls, config: dict) -> str:
        """NoLoCo's β and α."""
        lr, mu = config.get("outer_lr"), config.get("outer_momentum")
        return "" if lr is None or mu is None else f", β={lr:g}, α={mu:g}"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sync_every: int = 50, group_size: int = 2,
                 outer_lr: float = 0.7, outer_momentum: float = 0.5, gamma: float = 0.7,
                 nesterov: bool = False, codec: str = "fp32", codec_block: int = 32,
                 codec_keep: float | None = None,
                 slow_codec: str = "fp32", seed: int = 0, warn: bool = True, **kwargs: Any):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1 (got {sync_every!r})")
        if not isinstance(group_size, int) or group_size < 2 or comm.workers % group_size:
            raise ValueError(f"group_size (n) must be an integer >= 2 that divides the number "
                             f"of workers, {comm.workers} (got {group_size!r})")
        if slow_codec not in SLOW_CODECS:
            raise ValueError(f"slow_codec must be one of {', '.join(SLOW_CODECS)}: the slow "
                             f"weights travel in at least bf16 (got {slow_codec!r})")
        for name, v in (("outer_lr", outer_lr), ("gamma", gamma)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0 (got {v!r})")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum (α) must be in [0, 1) (got {outer_momentum!r})")
        if warn:
            for message in convergence_warnings(outer_lr, outer_momentum, gamma, group_size):
                warnings.warn(message, stacklevel=2)
        self.codec = get_codec(codec, codec_block, device=comm.device, keep=codec_keep)
        self.slow_codec = get_codec(slow_codec, device=comm.device)
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.sync_every, self.group_size, self.seed = sync_every, group_size, seed
        self.beta, self.alpha, self.gamma, self.nesterov = outer_lr, outer_momentum, gamma, nesterov
        self.outer_steps = 0
        """Outer steps taken (or skipped) so far."""
        # With R ranks per worker each holds, swaps and steps 1/R of φ_i and δ_i.
        self.share = Share(self.params, self.inner)
        self.slow = self.share.read()  # φ_i, private to this worker
        self.slow_params = unflatten_views(self.slow, self.share.views)
        self.momentum = torch.zeros_like(self.slow)  # δ_i
        self.bounds = message_bounds(self.codec, self.slow_codec, self.slow.numel(),
                                     group_size, self.piece_bytes)
        """Where each piece of the message starts, and its end: ``[0, ..., numel]``."""
        for codec in (self.codec, self.slow_codec):  # compiled now, not in the first syncs
            for width in sorted({b - a for a, b in zip(self.bounds, self.bounds[1:])}):
                codec.prepare(width, 1, comm.device)

    def groups(self, outer_step: int) -> list[list[int]]:
        """The groups of outer step ``outer_step``: the same on every worker, no message.

        Args:
            outer_step: the outer step's index (0 for the first), >= 0.

        Returns:
            M / n groups of n worker ranks each, every rank in exactly one.
        """
        return gossip_groups(self.seed, outer_step, self.comm.size, self.group_size)

    def step(self) -> None:
        """One inner step; every H-th also takes the outer step with this worker's group,
        after it releases the gradients (spent by the inner step; ``zero_grad()`` with its
        default): the outer step's ``g`` (one fp32 value per value of φ) takes their room."""
        self.inner_update()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.zero_grad()
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Swap Δ and φ with this outer step's group, then update δ, φ and θ (see
        [`NoLoCo`][loco.algorithms.noloco.NoLoCo]). Called by [`step`][loco.algorithms.noloco.NoLoCo.step] every H inner
        steps; every member of the group must call it at the same outer step."""
        # elastic: a worker that was behind takes a peer's state and goes on from there
        if self.healing.begin(self.comm, ("outer", self.inner_steps)):
            return self._resume()
        self._exchange_and_step()

    def _resume(self) -> None:
        """After taking a live worker's φ and δ (elastic; θ = φ, so Δ = 0): take part in
        the outer step that worker was at."""
        self._exchange_and_step()

    def restart_from_global(self) -> None:
        """θ ← φ, the slow weights (taken from a live worker)."""
        torch._foreach_copy_(self.share.views, [s.to(v.dtype) for s, v in
                                                zip(self.slow_params, self.share.views)])
        self.share.gather()

    @torch.no_grad()
    def _exchange_and_step(self) -> None:
        # The profiler's ranges of an outer step (docs/profiling.md): pseudo_gradient,
        # encode, exchange, reduce (each piece, on the Comm's thread), wait, outer_step,
        # merge. Rank r of each member swaps its share with rank r of the others.
        step = torch.empty_like(self.slow)  # g: in the room of the released gradients
        ok = self._gossip(step)
        if ok is None:  # elastic: healed during a retry
            return self._resume()
        with allowed("sync"):  # both verdicts in one read
            delta_ok, slow_ok = ok.tolist()
        if (self.nonfinite.check(step, "pseudo-gradient", self.inner_steps, delta_ok)
                and self.nonfinite.check(step, "slow weights", self.inner_steps, slow_ok)):
            with record_function("loco/outer_step"):
                self._apply(step)
        del step
        with record_function("loco/merge"):
            self.restart_from_global()  # θ_i ← φ_i (skipped: back to the old φ_i)
        self.outer_steps += 1

    def _group(self) -> list[int]:
        """This outer step's group of this worker (its ranks)."""
        return next(g for g in self.groups(self.outer_steps) if self.comm.rank in g)

    def _gossip(self, step: torch.Tensor) -> torch.Tensor | None:
        """Swap Δ and φ with this outer step's group, piece by piece
        ([`Comm.exchange_pieces`][loco.comm.comm.Comm.exchange_pieces]), each piece's
        ``g = β·mean(Δ) − γ·(φ − mean φ)`` into ``step``; returns whether the means of Δ and
        of φ were finite (two bools on the device), or None when an elastic retry healed
        this worker. A retry forms the groups anew over the members then alive and swaps
        every piece again."""
        issued = {}

        def issue():
            ok = issued["ok"] = torch.ones(2, dtype=torch.bool, device=step.device)
            group = self._group()
            on_comm = step.device == self.comm.device
            return self.comm.exchange_pieces(
                self.piece_sizes(), group, self._build, functools.partial(self._consume, step, ok),
                tag="train", tensors=[step, ok, self.slow, *self.share.views] if on_comm else [])

        handle = issue()
        with record_function("loco/wait"):
            done = self.comm.settle(handle, issue)
        return None if done is None else issued["ok"]

    def piece_sizes(self) -> list[int]:
        """Bytes of each piece of this worker's message: piece k holds values
        ``bounds[k]:bounds[k + 1]`` of Δ, encoded, then of φ; together the bytes of the
        whole message (every piece but the last holds whole blocks of the codec)."""
        return [self.codec.encoded_nbytes(hi - lo) + self.slow_codec.encoded_nbytes(hi - lo)
                for lo, hi in zip(self.bounds, self.bounds[1:])]

    def _build(self, k: int, out: torch.Tensor) -> None:
        """Piece k of this worker's message into ``out``: ``Δ_i = θ_i − φ_i`` of its values,
        encoded, then φ_i's. A cast codec's bytes (fp32, bf16) are written straight into
        ``out``, Δ in fp32 formed there: no other copy of the piece is made."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        split, slow = self.codec.encoded_nbytes(hi - lo), self.slow[lo:hi]
        with record_function("loco/pseudo_gradient"):
            into = _values(self.codec, out[:split]) if out.device == slow.device else None
            delta = flatten_fp32(_within(self.share.views, lo, hi), into).sub_(slow)
            step = self.comm.shield.send(delta)  # an injected attack's, if any
        with record_function("loco/encode"):
            if into is None:
                out[:split].copy_(self.codec.encode(delta))
            _encode_into(self.slow_codec, slow, out[split:])
        flip = self.comm.shield.wire(step)
        if flip is not None:
            flip(out)

    def _consume(self, step: torch.Tensor, ok: torch.Tensor, k: int,
                 pieces: list[torch.Tensor]) -> None:
        """Piece k of every member's message (member order): the means of Δ and φ, the same
        bits on every member (each decodes the same bytes in the same order), in the first
        member's bytes where they are fp32 values; whether they are finite, and-ed into
        ``ok``; ``g = (mean φ − φ)·γ + β·mean Δ`` of its values into ``step``."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        split = self.codec.encoded_nbytes(hi - lo)
        pieces = [p.to(step.device) for p in pieces]  # staged: to the model's device
        with record_function("loco/reduce"):  # decoded and summed one member at a time
            mean_delta, mean_slow = self._means([p[:split] for p in pieces],
                                                [p[split:] for p in pieces], lo, hi)
            ok.logical_and_(torch.stack([torch.isfinite(mean_delta).all(),
                                         torch.isfinite(mean_slow).all()]))
            pull = torch.sub(mean_slow, self.slow[lo:hi], out=step[lo:hi]).mul_(self.gamma)
            pull.add_(mean_delta.mul_(self.beta))  # −γ (φ − mean φ) + β mean(Δ)

    def _means(self, deltas: list[torch.Tensor], slows: list[torch.Tensor], lo: int, hi: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's means of Δ and φ over values ``lo:hi`` (``_mean``; ``deltas`` and
        ``slows``: each member's encoded bytes), or what the guard makes of them. The guard
        judges each member by what its message does to this worker's step, the norm of
        ``β·Δ_j + γ·(φ_j − φ_i)`` (this worker's own: ``β·Δ_i``), so that a φ that is
        flipped or forged is caught as a Δ is: in a group of two each member judges the
        other by itself (a pair has no median), in a larger one by the median. A member
        left out or clipped counts in neither mean (a clipped Δ counts scaled); with a
        coordinate-wise aggregation φ is combined as Δ is."""
        n = hi - lo
        group = self._group()
        workers = self.comm.senders()  # (an elastic quorum's ranks are not its workers)
        guard = self.comm.shield.at(self.inner_steps, [workers[r] for r in group])
        if guard is None or len(deltas) < 2:
            return _mean(self.codec, deltas, n), _mean(self.slow_codec, slows, n)
        rows = torch.stack([_decoded(self.codec, m, n) for m in deltas])
        pulls = torch.stack([_decoded(self.slow_codec, m, n) for m in slows])
        pulls.sub_(self.slow[lo:hi]).mul_(self.gamma).add_(rows, alpha=self.beta)
        effects = torch.linalg.vector_norm(pulls, dim=1)
        del pulls
        trusted = group.index(self.comm.rank) if len(deltas) == 2 else None
        total = torch.empty((1, n), dtype=torch.float32, device=rows.device)
        mean = guard.combine(rows, len(deltas), total, trusted=trusted, effects=effects)[0]
        if guard.coordinatewise:  # φ as Δ: coordinate-wise over the members
            phis = torch.stack([_decoded(self.slow_codec, m, n) for m in slows])
            return mean, guard.coordinatewise_mean(phis, total.clone())[0]
        # a member clipped (its Δ scaled down) is not trusted with its φ either
        return mean, _mean(self.slow_codec, slows, n, guard.last_scales == 1)

    def _apply(self, step: torch.Tensor) -> None:
        """``δ ← α δ + g``, ``φ ← φ + δ`` (Nesterov: ``φ + α δ + g``), ``g`` in ``step``: in
        pieces of at most ``PIECE_VALUES`` (the look-ahead's temporary is one)."""
        for lo in range(0, step.numel(), PIECE_VALUES):
            at = slice(lo, lo + PIECE_VALUES)
            g, momentum = step[at], self.momentum[at].mul_(self.alpha).add_(step[at])
            self.slow[at].add_(torch.mul(momentum, self.alpha).add_(g) if self.nesterov
                               else momentum)

    def outer_tensors(self) -> list[torch.Tensor]:
        """This rank's share of the slow weights φ and the momentum δ."""
        return [self.slow, self.momentum]

    def state_dict(self, tensors: bool = True) -> dict:
        """The base state plus the outer step counter, the slow weights φ and the momentum δ.

        Args:
            tensors: include the tensors (default True); False: the counters only (see
                [`Algorithm.state_dict`][loco.algorithms.base.Algorithm.state_dict]).

        Returns:
            A dict for ``torch.save``, of the live tensors (copy it to keep it).
        """
        state = {**super().state_dict(tensors), "outer_steps": self.outer_steps}
        if tensors:
            state.update(slow=self.slow, momentum=self.momentum)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.noloco.NoLoCo.state_dict] saved.

        Args:
            state: a dict from ``state_dict()`` of a NoLoCo built the same way.
        """
        super().load_state_dict(state)
        self.outer_steps = int(state["outer_steps"])
        if "slow" in state:
            self.slow.copy_(state["slow"])
            self.momentum.copy_(state["momentum"])

    def outer_state(self) -> dict:
        """φ and δ: this rank's share of them (see
        [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        return {"slow": (self.share, self.slow), "momentum": (self.share, self.momentum)}


def message_bounds(codec: Codec, slow_codec: Codec, numel: int, members: int,
                   limit: int) -> list[int]:
    """Where the pieces of NoLoCo's message of ``numel`` values of Δ and of φ start, and
    its end: pieces of whole blocks of both codecs, each (Δ's bytes and φ's) at most
    ``limit / members`` bytes (at least one block), the last the rest; one piece for a
    codec whose blocks are not encoded on their own (the dropping ones), whose encoding
    depends on the whole; ``[0]`` (no piece) for no values.

    Args:
        codec: Δ's wire format.
        slow_codec: φ's (a cast).
        numel: values of Δ and of φ, >= 0.
        members: n, the group's size: its n messages' pieces share ``limit``.
        limit: bytes of the n pieces together, > 0.
    """
    if numel == 0:
        return [0]
    if not codec.blockwise:
        return [0, numel]
    align = math.lcm(codec.align, slow_codec.align)
    per_block = codec.encoded_nbytes(align) + slow_codec.encoded_nbytes(align)
    width = max(1, limit // members // per_block) * align
    return [*range(0, numel, width), numel]


def _within(views: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """The values [lo, hi) of the concatenation of ``views`` (flattened), as views where
    each is contiguous."""
    out, at = [], 0
    for v in views:
        a, b = max(lo - at, 0), min(hi - at, v.numel())
        if a < b:
            out.append(v.reshape(-1)[a:b])
        at += v.numel()
    return out


def _values(codec: Codec, buf: torch.Tensor) -> torch.Tensor | None:
    """``buf`` (encoded bytes) as the fp32 values they are, a view, where the codec sends
    fp32 values as they are and ``buf`` is aligned for them; else None."""
    if isinstance(codec, CastCodec) and codec.dtype == torch.float32 \
            and buf.storage_offset() % 4 == 0:
        return buf.view(torch.float32)
    return None


def _encode_into(codec: Codec, values: torch.Tensor, out: torch.Tensor) -> None:
    """``codec.encode(values)``'s bytes into ``out``: a cast codec's (fp32, bf16) cast
    straight from ``values``, where ``out`` is aligned for them; another's copied."""
    if isinstance(codec, CastCodec) and out.storage_offset() % (codec.bits // 8) == 0:
        out.view(codec.dtype).copy_(values)
    else:
        out.copy_(codec.encode(values))


def _decoded(codec: Codec, message: torch.Tensor, n: int) -> torch.Tensor:
    """A member's ``n`` values from its encoded bytes: the bytes themselves where they are
    fp32 values, else decoded."""
    v = _values(codec, message)
    return codec.decode(message, (n,)) if v is None else v


def _mean(codec: Codec, messages: list[torch.Tensor], n: int,
          kept: torch.Tensor | None = None) -> torch.Tensor:
    """The members' values (``messages``, each one's encoded bytes, in member order), summed
    in order and divided by their number, decoded one member at a time: into the first
    member's own bytes where they are fp32 values (the received buffers are this worker's
    to overwrite), else into the first one's decoded copy. ``kept`` (a bool per member, on
    the device): only those members, divided by their number (all kept: the same bits)."""
    total = _decoded(codec, messages[0], n)
    if kept is not None:
        total.masked_fill_(~kept[0], 0.0)
    for i, m in enumerate(messages[1:], start=1):
        v = _decoded(codec, m, n)
        total.add_(v if kept is None else v.masked_fill(~kept[i], 0.0))
    return total.div_(len(messages) if kept is None else kept.sum())


def gossip_groups(seed: int, outer_step: int, workers: int, size: int) -> list[list[int]]:
    """A random permutation of the workers drawn from (seed, outer step), cut into groups.

    A pure function of its arguments (a ``torch.Generator`` seeded from them), so every
    worker derives the same groups without a message.

    Args:
        seed: the run's seed of the groups.
        outer_step: the outer step's index, >= 0.
        workers: M, the number of workers.
        size: n, workers per group; should divide M (otherwise the last group is smaller).

    Returns:
        The groups, each a sorted list of ranks, every rank in exactly one.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + outer_step)
    with allowed("host"):  # a CPU tensor: no device is read
        order = torch.randperm(workers, generator=g).tolist()
    return [sorted(order[i:i + size]) for i in range(0, workers, size)]


def convergence_warnings(beta: float, alpha: float, gamma: float, n: int) -> list[str]:
    """Where (α, β, γ) leave the region in which the paper's theory guarantees convergence
    (noisy quadratic, SGD inner steps): β > α, and α·c < γ < c·√(2 + α²), c = √(n/(2(n−1))).

    Args:
        beta: β, the outer learning rate.
        alpha: α, the outer momentum.
        gamma: γ, the pull towards the group's mean slow weights.
        n: the group size, >= 2.

    Returns:
        One message per condition that fails; empty inside the region.
    """
    out = []
    if not beta > alpha:
        out.append(f"NoLoCo: outer_lr (β={beta}) <= outer_momentum (α={alpha}); the paper's "
                   "theory needs β > α for the expected weights to converge")
    c = math.sqrt(n / (2 * (n - 1)))
    low, high = alpha * c, c * math.sqrt(2 + alpha ** 2)
    if not low < gamma < high:
        out.append(f"NoLoCo: gamma (γ={gamma}) is outside ({low:.3f}, {high:.3f}), where the "
                   f"paper's theory bounds the spread between replicas for α={alpha}, n={n}")
    return out
