"""SPARTA: sparse parameter averaging after every inner step (as in EXO Gym), alone and
inside DiLoCo.

After inner step t every worker m:

1. draws the same k = max(1, round(s · N)) distinct indices I_t out of the N trainable
   values of the model (a flat view over its parameters, in ``model.parameters()`` order),
   from a ``torch.Generator`` seeded with (run seed, t): no message is needed to agree on
   them, and they are fresh every step;
2. averages those values over the M workers in fp32:  v̄ = mean_m θ_m[I_t];
3. replaces its own:  θ_m[I_t] ← v̄.

Each worker sends 2 (M − 1) · ceil(k / M) · 4 bytes per step (one fp32 mean all-reduce of k
values). ``Sparta`` is that after every inner step, the replicas otherwise drifting apart as
in Local training; ``SpartaDiLoCo`` adds DiLoCo's outer step every H inner steps.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.diloco import DiLoCo
from loco.algorithms.method import PaperClaim
from loco.comm import Comm
from loco.comm.hostreads import allowed, device_path
from loco.options import ConfigError, need, opt

#: The share's published range (EXO Gym's SPARTA): 0.05 % to 0.5 % of the values per step.
PUBLISHED = (0.0005, 0.005)


@dataclass
class SpartaOptions:
    """SPARTA's own option: the share of the parameter values averaged every step."""

    sparta_share: float = opt(0.005, "s (sparta, sparta_diloco): share of the parameter values "
                              "averaged over all workers after every inner step, the same "
                              "random indices on every worker, fresh each step; in (0, 1] "
                              "(published range 0.0005 to 0.005). Bytes grow with it")


@dataclass
class SpartaDiLoCoOptions(DiLoCo.options, SpartaOptions):
    """SPARTA + DiLoCo's options: DiLoCo's own (whatever it declares) and the share s."""


def draw_seed(seed: int, step: int) -> int:
    """The generator's seed for step ``step`` of a run seeded ``seed``:
    ``(seed · 1000003 + step) mod 2³²`` (a CPU generator keeps 32 bits of its seed), distinct
    for the first 2³² steps of a run.

    Args:
        seed: the run's seed (any integer).
        step: the inner step, >= 1.
    """
    return (seed * 1_000_003 + step) % 2 ** 32


def sparse_indices(seed: int, step: int, numel: int, count: int) -> torch.Tensor:
    """The indices averaged after inner step ``step``: ``count`` distinct values of
    [0, ``numel``), a uniformly random subset (every subset of that size equally likely),
    sorted. A pure function of its arguments (a CPU ``torch.Generator`` seeded with
    [`draw_seed`][loco.algorithms.sparta.draw_seed]; the global RNG is never touched), so every worker draws the same
    subset without a message.

    Where ``count`` <= ``numel`` / 4 it costs O(count log count) rather than randperm's
    O(numel): the first ``count`` distinct values of a sequence of independent uniform
    draws (``torch.randint``, extended until there are enough), which is a uniformly random
    subset because the sequence's law is the same under any relabelling of [0, ``numel``).
    (Not "``count`` draws with replacement, then unique": that gives fewer values.) Above,
    ``torch.randperm(numel)[:count]``.

    Args:
        seed: the run's seed (any integer).
        step: the inner step, >= 1.
        numel: N, the values to choose from, >= 1.
        count: k, how many, in [1, N].

    Returns:
        A sorted int64 CPU tensor of ``count`` distinct indices.
    """
    g = torch.Generator().manual_seed(draw_seed(seed, step))
    if 4 * count > numel:
        return torch.randperm(numel, generator=g)[:count].sort().values
    draws = torch.empty(0, dtype=torch.int64)
    distinct = torch.empty(0, dtype=torch.int64)
    while distinct.numel() < count:
        more = 2 * (count - distinct.numel()) + count * count // numel + 8
        draws = torch.cat([draws, torch.randint(numel, (more,), generator=g)])
        distinct, inverse = torch.unique(draws, return_inverse=True)
    first = torch.full((distinct.numel(),), draws.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(draws.numel()), "amin")
    return distinct[first.argsort()[:count]].sort().values


def sparse_count(share: float, numel: int) -> int:
    """k = max(1, round(s · N)): the values averaged per step.

    Args:
        share: s, in (0, 1].
        numel: N, the trainable values, >= 1.
    """
    return min(numel, max(1, round(share * numel)))


def sparse_bytes(count: int, workers: int) -> int:
    """Bytes one worker sends (and receives) per step: an fp32 mean all-reduce of ``count``
    values over ``workers`` workers, 2 (M − 1) · ceil(k / M) · 4.

    Args:
        count: k, >= 1.
        workers: M, >= 1.
    """
    return 2 * (workers - 1) * math.ceil(count / workers) * 4


@dataclass
class Draw:
    """Step t's indices, ready to use: ``where`` holds each drawn index's position in its
    parameter (parameter by parameter, in the parameters' order; pinned host memory for a
    GPU), ``bounds`` where each parameter's positions start and end in it."""

    where: torch.Tensor
    bounds: list[int]


class SparseAverage:
    """The per-step sparse average of a replica's parameters with the other workers'.

    Step t's indices are drawn on the CPU (``sparse_indices``). On a GPU (``device_path``)
    a helper thread draws step t + 1's while step t trains, into page-locked memory, and
    the step copies them to the GPU in one non-blocking copy: no step waits for a draw, and
    none reads the device on the host.

    Args:
        params: the trainable parameters, in the same order on every worker (each
            contiguous, not sharded).
        comm: the communication among the M workers.
        share: s, the share of the values averaged per step, in (0, 1].
        seed: the run's seed, the same on every worker.

    Raises:
        ValueError: ``share`` outside (0, 1], no parameters, or a non-contiguous one.
    """

    def __init__(self, params: list[torch.Tensor], comm: Comm, share: float, seed: int):
        if not 0 < share <= 1:
            raise ValueError(f"sparta_share must be in (0, 1] (got {share!r})")
        if not params or not all(p.is_contiguous() for p in params):
            raise ValueError("SPARTA needs at least one parameter, each contiguous")
        self.params, self.comm, self.share, self.seed = params, comm, share, seed
        sizes = [p.numel() for p in params]
        self.numel = sum(sizes)
        """N, the trainable values."""
        self.count = sparse_count(share, self.numel)
        """k, the values averaged per step."""
        self.offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        self.values = torch.empty(self.count, dtype=torch.float32, device=comm.device)
        self._ahead: tuple[int, Future] | None = None
        self._pool = ThreadPoolExecutor(1, "loco-sparta") if device_path(comm.device) else None
        if self._pool is not None:  # the first step's (a resumed run draws its first inline)
            self._ahead = (1, self._pool.submit(self.draw, 1))

    def indices(self, step: int) -> torch.Tensor:
        """The flat indices averaged after inner step ``step`` (see
        [`sparse_indices`][loco.algorithms.sparta.sparse_indices])."""
        return sparse_indices(self.seed, step, self.numel, self.count)

    def draw(self, step: int) -> Draw:
        """Step ``step``'s indices as positions in their parameters (on the CPU; pinned
        for a GPU). CPU tensors only: it reads nothing from a device."""
        with allowed("host"):
            idx = self.indices(step)
            bounds = torch.searchsorted(idx, self.offsets).tolist()
            for start, a, b in zip(self.offsets.tolist(), bounds, bounds[1:]):
                idx[a:b] -= start
        if self.values.is_cuda:
            idx = idx.pin_memory()
        return Draw(idx, bounds)

    def _take(self, step: int) -> Draw:
        """Step ``step``'s draw (prefetched, where a helper thread draws), and step
        ``step + 1``'s set going."""
        ahead, self._ahead = self._ahead, None
        drawn = ahead[1].result() if ahead is not None and ahead[0] == step else None
        if self._pool is not None:
            self._ahead = (step + 1, self._pool.submit(self.draw, step + 1))
        return drawn if drawn is not None else self.draw(step)

    @torch.no_grad()
    def __call__(self, step: int) -> None:
        """Average the values of this step's indices with every worker, in fp32, and
        replace this replica's by the mean. Collective: every worker calls it with the
        same ``step``.

        Args:
            step: the inner step just taken, >= 1.
        """
        drawn = self._take(step)
        where = drawn.where.to(self.values.device, non_blocking=True)
        parts = []
        with record_function("loco/sparse_gather"):
            for p, a, b in zip(self.params, drawn.bounds, drawn.bounds[1:]):
                if a == b:
                    continue
                flat = p.detach().view(-1)
                self.values[a:b].copy_(flat[where[a:b]])
                parts.append((flat, where[a:b], a, b))
        self.comm.all_reduce_mean(self.values, tag="train").wait()
        with record_function("loco/sparse_scatter"):
            for flat, at, a, b in parts:
                flat.index_copy_(0, at, self.values[a:b].to(flat.device, flat.dtype))


def check_sparta(cfg: Any) -> None:
    """The share in (0, 1]; workers of one rank, one pipeline stage, a fixed group.

    Raises:
        ConfigError: naming the first option out of range.
    """
    need(cfg, 0 < cfg.method.sparta_share <= 1, "sparta_share",
         f"must be in (0, 1], the share of the values averaged every step (published: "
         f"{PUBLISHED[0]:g} to {PUBLISHED[1]:g})")
    if cfg.runtime.worker_ranks != 1:
        raise ConfigError("worker_ranks", f"{cfg.method.algorithm} supports workers of one rank only; "
                          f"use --worker-ranks 1 (got {cfg.runtime.worker_ranks})")
    if cfg.runtime.stages != 1:
        raise ConfigError("stages", f"{cfg.method.algorithm} supports one pipeline stage only (a tied "
                          f"embedding's two copies would drift apart); use --stages 1 (got "
                          f"{cfg.runtime.stages})")
    if cfg.runtime.elastic:
        raise ConfigError("elastic", f"{cfg.method.algorithm} needs a fixed group of workers (it "
                          "averages with all of them every step); leave out --elastic")


def _refuse_layouts(comm: Comm, inner: Comm | None) -> None:
    """The constructor's refusals: an elastic ``comm``, a worker of several ranks."""
    if comm.elastic:
        raise ValueError("SPARTA needs a fixed group of workers, not an elastic comm")
    if inner is not None and inner.size > 1:
        raise ValueError("SPARTA supports workers of one rank only (inner must be None)")


class Sparta(Algorithm):
    """SPARTA: after every inner step, a random share s of the parameter values (the same
    indices on every worker, fresh each step) is averaged over all workers in fp32 and
    replaces the local values. Otherwise the replicas train alone, as in Local training:
    they differ (``replicas_identical`` is False) and each evaluates its own.

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``); a fixed group.
        sparta_share: s, the share of the N trainable values averaged per step, in (0, 1];
            k = max(1, round(s · N)); default 0.005 (EXO Gym's).
        seed: the seed of the indices, the same on every worker; default 0.
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm``, ``init_sync``, ``on_nonfinite``; ``inner`` only None.

    Raises:
        ValueError: ``sparta_share`` outside (0, 1], an elastic ``comm``, a worker of
            several ranks (``inner``) or an FSDP2-sharded model.
    """

    name = "sparta"
    title = "SPARTA"
    options = SpartaOptions
    shared = ("spread_every", "final_average")
    replicas_identical = False
    """Replicas share only the values averaged; each worker evaluates its own."""
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),)

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """The share in (0, 1]; no worker of several ranks, pipeline stages or elastic."""
        check_sparta(cfg)

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """The share and the run's seed."""
        return {"sparta_share": cfg.method.sparta_share, "seed": cfg.run.seed}

    @classmethod
    def setting(cls, config: dict) -> str:
        """The share."""
        return f"s={config['sparta_share']:g} every step"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sparta_share: float = 0.005, seed: int = 0, **kwargs: Any):
        _refuse_layouts(comm, kwargs.get("inner"))
        super().__init__(model, inner_optimizer, comm, **kwargs)
        if self.ranks.sharded:
            raise ValueError("SPARTA does not support an FSDP2-sharded model")
        self.averager = SparseAverage(self.params, comm, sparta_share, seed)
        """The per-step sparse average (its ``count`` is k, its ``indices(t)`` step t's)."""

    def step(self) -> None:
        """One inner step, then the sparse average of step t's indices with every worker
        (also after a skipped step: the workers meet by the step counter)."""
        self.inner_update()
        self.inner_steps += 1
        self.averager(self.inner_steps)

    def outer_tensors(self) -> list[torch.Tensor]:
        """The sparse average's buffer of k values and the parameters' offsets."""
        return [self.averager.values, self.averager.offsets]


class SpartaDiLoCo(DiLoCo):
    """SPARTA + DiLoCo (EXO Gym's SPARTA-DiLoCo): DiLoCo whose replicas also average a
    random share s of their values after every inner step, before the outer step every H
    steps (EXO Gym's order: the sparse average, then DiLoCo's sync).

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: the inner optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``); a fixed group.
        sync_every: H, inner steps between outer steps, >= 1; default 200 (twice DiLoCo's
            100: with s = 0.005 a round of 200 steps sends two full models, as DiLoCo's
            two rounds of 100 do).
        sparta_share: s, in (0, 1]; default 0.005.
        seed: the seed of the indices, the same on every worker; default 0.
        **kwargs: passed to [`DiLoCo`][loco.algorithms.diloco.DiLoCo] (the outer
            optimizer, ``offload``, ``max_grad_norm``, ...); ``inner`` only None.

    Raises:
        ValueError: as for ``DiLoCo`` and ``Sparta``.
    """

    name = "sparta_diloco"
    title = "SPARTA + DiLoCo"
    options = SpartaDiLoCoOptions
    defaults: ClassVar[dict[str, Any]] = {**DiLoCo.defaults, "sync_every": 200}
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),)

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """DiLoCo's checks and SPARTA's."""
        super().check(cfg, layers)
        check_sparta(cfg)

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """DiLoCo's, the share and the run's seed."""
        return {**super().kwargs(cfg, model, comm, pipeline),
                "sparta_share": cfg.method.sparta_share, "seed": cfg.run.seed}

    @classmethod
    def setting(cls, config: dict) -> str:
        """DiLoCo's (H and the outer optimizer) and the share."""
        return super().setting(config) + f", s={config['sparta_share']:g} every step"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 sync_every: int = 200, sparta_share: float = 0.005, seed: int = 0,
                 **kwargs: Any):
        _refuse_layouts(comm, kwargs.get("inner"))
        super().__init__(model, inner_optimizer, comm, sync_every=sync_every, **kwargs)
        if self.ranks.sharded:
            raise ValueError("SPARTA does not support an FSDP2-sharded model")
        self.averager = SparseAverage(self.params, comm, sparta_share, seed)
        """The per-step sparse average (its ``count`` is k, its ``indices(t)`` step t's)."""

    def inner_update(self) -> bool:
        """DiLoCo's inner step, then the sparse average of this step's indices (step
        ``inner_steps + 1``: DiLoCo counts the step after it), before any outer step."""
        stepped = super().inner_update()
        self.averager(self.inner_steps + 1)
        return stepped

    def outer_tensors(self) -> list[torch.Tensor]:
        """DiLoCo's, and the sparse average's buffer and offsets."""
        return [*super().outer_tensors(), self.averager.values, self.averager.offsets]


__all__ = [
    "SparseAverage",
    "Sparta",
    "SpartaDiLoCo",
    "SpartaOptions",
    "draw_seed",
    "sparse_bytes",
    "sparse_indices",
]
