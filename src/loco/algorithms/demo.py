"""DeMo, Decoupled Momentum optimization (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870).

DeMo replaces the inner optimizer: every inner step each worker m, for every parameter p
(lr and weight decay wd from the inner optimizer's parameter group, so a learning-rate
schedule still applies; the inner optimizer itself is never stepped):

1. ``p ← p · (1 − lr·wd)``;
2. ``m_m ← β·m_m + lr·g_m`` (its own momentum, its own clipped gradient);
3. the orthonormal DCT-II of ``m_m`` chunk by chunk (n1 × n2 chunks of a matrix);
4. keeps the top-k coefficients of each chunk by magnitude: its message;
5. ``m_m ← m_m − IDCT(kept)`` (what is sent leaves the momentum);
6. all-gathers every worker's message (one all-gather per step, the whole model's packed
   bytes), sums the coefficients per index in rank order and takes the IDCT;
7. ``p ← p − lr · sign(that)`` (sign-SGD).

Every worker applies the same update from the same gathered bytes, so the replicas stay
identical. The reference code is bloc97/DeMo ``demo.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from loco.algorithms.base import Algorithm
from loco.algorithms.method import PaperClaim
from loco.algorithms.sharding import Share
from loco.comm import Comm
from loco.comm.attacks import VALUE_KINDS, parse_attacks
from loco.comm.codecs.bitpack import pack, packed_bytes, unpack
from loco.comm.guard import COORDINATEWISE
from loco.options import ConfigError, need, opt

VALUE_FORMATS = ("sign", "bf16", "fp32")
"""Wire formats of the kept coefficients' values: 1 bit (the sign), bf16 or fp32."""


@dataclass
class DeMoOptions:
    """DeMo's own options: the momentum's decay, the top-k, the DCT chunk and the values'
    wire format."""

    demo_decay: float = opt(0.999, "beta (demo): decay of each worker's own momentum, in "
                            "[0, 1] (the paper: 0.999)")
    demo_topk: int = opt(32, "k (demo): DCT coefficients of largest magnitude each chunk "
                         "sends per step, >= 1, clamped to the chunk's size (the paper: 32)")
    demo_chunk: int = opt(64, "demo: the DCT chunk's side; a matrix is cut into n1 x n2 "
                          "chunks, n1 (n2) the largest divisor of its rows (columns) <= this "
                          "(the paper: 64)")
    demo_values: str = opt("bf16", "demo: wire format of the kept coefficients' values: sign "
                           "(1 bit, a majority vote), bf16 or fp32", VALUE_FORMATS)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` (>= 1) that is at most ``at_most`` (>= 1)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def dct_matrix(n: int, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n``, fp32: row k is
    ``s_k · cos(π (2i + 1) k / (2n))`` over i, ``s_0 = √(1/n)``, ``s_k = √(2/n)`` otherwise
    (built in fp64, rounded once). Its transpose is its inverse (the DCT-III).

    Args:
        n: the size, >= 1.
        device: where it lives; default the CPU.
    """
    i = torch.arange(n, dtype=torch.float64)
    c = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.to(torch.float32).to(device)


@dataclass
class Plan:
    """How one parameter is chunked and where its message lies in the step's payload.

    A parameter of ``numel`` values is viewed as a (rows, cols) matrix: a matrix as it is, a
    vector or scalar as one row, a tensor of more dimensions as (its first, the rest).

    Attributes:
        rows, cols: the matrix it is viewed as.
        n1, n2: the chunk's sides (largest divisors <= the chunk option).
        chunks: n1 × n2 chunks in the matrix, numbered row-major over the chunk grid.
        k: coefficients kept per chunk (the top-k, clamped to n1 · n2).
        bits: bits per in-chunk index, ``ceil(log2(n1 · n2))``.
        index_bytes, value_bytes: bytes per chunk of its indices and of its values.
        offset: where this parameter's bytes start in the payload: all its chunks' index
            rows, then all its chunks' value rows.
    """

    rows: int
    cols: int
    n1: int
    n2: int
    k: int
    bits: int
    index_bytes: int
    value_bytes: int
    offset: int

    @property
    def chunks(self) -> int:
        return (self.rows // self.n1) * (self.cols // self.n2)

    @property
    def nbytes(self) -> int:
        """This parameter's bytes of the payload."""
        return self.chunks * (self.index_bytes + self.value_bytes)


def value_bytes(k: int, values: str) -> int:
    """Bytes of one chunk's ``k`` values in the format ``values`` (1 bit, 2 or 4 bytes each,
    a chunk's sign bits rounded up to whole bytes)."""
    return packed_bytes(k, 1) if values == "sign" else k * (2 if values == "bf16" else 4)


def make_plan(shape: torch.Size, chunk: int, topk: int, values: str, offset: int) -> Plan:
    """The [`Plan`][loco.algorithms.demo.Plan] of a parameter of ``shape``.

    Args:
        shape: the parameter's shape.
        chunk: the DCT chunk's largest side, >= 1.
        topk: coefficients kept per chunk before clamping, >= 1.
        values: the values' wire format, one of ``VALUE_FORMATS``.
        offset: where its bytes start in the payload.
    """
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = numel // rows
    n1, n2 = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    k = min(topk, n1 * n2)
    bits = math.ceil(math.log2(n1 * n2))
    return Plan(rows, cols, n1, n2, k, bits, packed_bytes(k, bits), value_bytes(k, values),
                offset)


def payload_bytes(shapes, chunk: int = 64, topk: int = 32, values: str = "bf16") -> int:
    """Bytes of one worker's message per step: Σ over parameters of
    ``chunks · (packed_bytes(k, bits) + value bytes of k)``; each worker sends (M − 1) times
    this per step (an all-gather).

    Args:
        shapes: the trained parameters' shapes.
        chunk, topk, values: as for [`DeMo`][loco.algorithms.demo.DeMo].
    """
    plans = [make_plan(torch.Size(s), chunk, topk, values, 0) for s in shapes]
    return sum(p.nbytes for p in plans)


@dataclass
class Group:
    """Parameters of one shape, chunking and optimizer group, computed as one matrix: their
    momenta lie one after another in the momentum vector, so ``mom`` is a (G · rows, cols)
    view of them and ``plan`` chunks it as each member's own plan would (the chunks never
    straddle two members). The wire layout stays per parameter: ``index_at`` and
    ``value_at`` are where the group's index and value bytes go in the payload, member by
    member.

    Attributes:
        members: the members' positions in the parameter list.
        plan: the members' plan with ``rows`` times G.
        mom: the members' momenta as one matrix.
        opt_group: the index of the inner optimizer's parameter group they are in.
        index_at, value_at: payload positions (int64) of the group's packed index rows and
            value rows, flattened.
    """

    members: list[int]
    plan: Plan
    mom: torch.Tensor
    opt_group: int
    index_at: torch.Tensor
    value_at: torch.Tensor


def group_by_plan(params: list[torch.Tensor], plans: list[Plan], opt_groups: list[int],
                  momentum: torch.Tensor) -> tuple[list[Group], list[torch.Tensor]]:
    """Group the parameters whose plans and optimizer groups agree, and lay their momenta
    out in ``momentum`` group by group.

    Returns:
        The groups, and every parameter's momentum view in the parameters' order.
    """
    keys: dict[tuple, list[int]] = {}
    for i, (p, plan) in enumerate(zip(params, plans)):
        key = (plan.rows, plan.cols, plan.n1, plan.n2, plan.k, opt_groups[i], p.dtype)
        keys.setdefault(key, []).append(i)
    groups, moms, at = [], [None] * len(params), 0
    for members in keys.values():
        one = plans[members[0]]
        size = one.rows * one.cols
        mom = momentum[at:at + size * len(members)].view(one.rows * len(members), one.cols)
        for j, i in enumerate(members):
            moms[i] = mom[j * one.rows:(j + 1) * one.rows].view(params[i].shape)
        at += size * len(members)

        def positions(start: int, width: int) -> torch.Tensor:
            return torch.cat([torch.arange(plans[i].offset + start,
                                           plans[i].offset + start + plans[i].chunks * width)
                              for i in members]).to(momentum.device)

        n_idx = one.chunks * one.index_bytes
        groups.append(Group(members, Plan(one.rows * len(members), one.cols, one.n1, one.n2,
                                          one.k, one.bits, one.index_bytes, one.value_bytes,
                                          -1),
                            mom, opt_groups[members[0]], positions(0, one.index_bytes),
                            positions(n_idx, one.value_bytes)))
    return groups, moms


PIECE_VALUES = 1 << 22
"""The most values (4,194,304: 16 MB of fp32) DeMo encodes, decodes or applies at a time:
its temporaries (coefficients, their magnitudes, the sent and summed coefficients, the
inverse transform) are each one piece's, at most two of them alive at once, whatever the
model's size (a chunk-row of one parameter is never cut, so a piece holds at least one). A
group under this size is one piece. Cutting changes no bits where a chunk has several rows
(each chunk's transform is a matrix product of its own); chunks of one row (vectors) are cut
at ``VECTOR_PIECE_VALUES`` instead."""

VECTOR_PIECE_VALUES = 1 << 24
"""The piece of a group of vectors (chunks of one row, n1 = 1): there the rows computed at
once fold into one product, whose kernel and last bits depend on their number, so their cut
stays what it was (16M values; no model has that many values in vectors of one shape)."""


@dataclass
class Piece:
    """A run of whole chunk-rows of a group's matrix, computed at once.

    Attributes:
        group: the group it belongs to.
        rows: its rows of the group's matrix, ``[start, stop)``, multiples of ``n1``.
        plan: the group's plan with ``rows`` of the piece.
        mom: its rows of the group's momenta.
        index_at, value_at: payload positions of its chunks' index and value rows.
    """

    group: Group
    rows: tuple[int, int]
    plan: Plan
    mom: torch.Tensor
    index_at: torch.Tensor
    value_at: torch.Tensor


def cut_pieces(groups: list[Group], limit: int | None = None) -> list[Piece]:
    """Every group cut into pieces of whole chunk-rows, each of at most ``limit`` values
    (default ``PIECE_VALUES``; a group of vectors: at least ``VECTOR_PIECE_VALUES``), or one
    chunk-row if that is more. A group's chunks are numbered row-major over its stacked
    members, so a piece's chunks are a contiguous range of them, and so are their payload
    positions."""
    pieces = []
    for g in groups:
        plan = g.plan
        most = limit or PIECE_VALUES
        if plan.n1 == 1:
            most = max(most, VECTOR_PIECE_VALUES)
        step = max(1, most // (plan.n1 * plan.cols)) * plan.n1
        per_row_chunks = plan.cols // plan.n2
        for start in range(0, plan.rows, step):
            stop = min(plan.rows, start + step)
            c0, c1 = start // plan.n1 * per_row_chunks, stop // plan.n1 * per_row_chunks
            pieces.append(Piece(
                g, (start, stop),
                Plan(stop - start, plan.cols, plan.n1, plan.n2, plan.k, plan.bits,
                     plan.index_bytes, plan.value_bytes, -1),
                g.mom[start:stop], g.index_at[c0 * plan.index_bytes:c1 * plan.index_bytes],
                g.value_at[c0 * plan.value_bytes:c1 * plan.value_bytes]))
    return pieces


def dct_chunks(x: torch.Tensor, plan: Plan, c1: torch.Tensor, c2: torch.Tensor
               ) -> torch.Tensor:
    """The chunked 2-D DCT-II of ``x`` (``rows · cols`` values): ``C1 · X · C2ᵀ`` of each
    n1 × n2 chunk X, as (chunks, n1 · n2), each row the chunk's coefficients row-major."""
    a, b = plan.rows // plan.n1, plan.cols // plan.n2
    blocks = x.reshape(a, plan.n1, b, plan.n2).permute(0, 2, 1, 3)
    return (c1 @ blocks @ c2.T).reshape(a * b, plan.n1 * plan.n2)


def idct_chunks(coef: torch.Tensor, plan: Plan, c1: torch.Tensor, c2: torch.Tensor
                ) -> torch.Tensor:
    """The inverse of [`dct_chunks`][loco.algorithms.demo.dct_chunks]: ``C1ᵀ · Y · C2`` of
    each chunk, back as a (rows, cols) matrix."""
    a, b = plan.rows // plan.n1, plan.cols // plan.n2
    blocks = c1.T @ coef.reshape(a, b, plan.n1, plan.n2) @ c2
    return blocks.permute(0, 2, 1, 3).reshape(plan.rows, plan.cols)


def as_blocks(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The contiguous (rows, cols) matrix ``x`` seen, without a copy, as its n1 × n2 chunks
    (a, b, n1, n2), as [`dct_chunks`][loco.algorithms.demo.dct_chunks] cuts it: an inverse
    transform's blocks (``C1ᵀ · Y · C2``) are added to it in place, never permuted back into
    a copy."""
    a, b = x.shape[0] // plan.n1, plan.cols // plan.n2
    return x.view(a, plan.n1, b, plan.n2).permute(0, 2, 1, 3)


def as_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """M equal contiguous tensors as one (M, n) tensor: a view where they are consecutive
    rows of one buffer (as ``Comm.all_gather`` returns them), else a copy. Only their
    addresses are looked at (nothing is read from the device)."""
    first, n = tensors[0], tensors[0].numel()
    base = first.untyped_storage().data_ptr()
    if all(t.is_contiguous() and t.untyped_storage().data_ptr() == base
           and t.data_ptr() == first.data_ptr() + i * n * t.element_size()
           for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), n), (n, 1))
    return torch.stack([t.reshape(-1) for t in tensors])


def values_finite(raw: torch.Tensor, values: str) -> torch.Tensor:
    """Whether every value in the uint8 rows ``raw`` (bf16 or fp32 bytes, as
    [`encode_values`][loco.algorithms.demo.encode_values] wrote them) is finite, as a 0-d
    bool tensor, read from the exponent bits (not all ones) without decoding to fp32."""
    kind, mask = (torch.int16, 0x7F80) if values == "bf16" else (torch.int32, 0x7F800000)
    return (raw.contiguous().view(kind) & mask).ne_(mask).all()


def encode_values(vals: torch.Tensor, values: str) -> torch.Tensor:
    """The values (chunks, k) as uint8 rows: sign bits (1 for negative, so 0 reads +1), or
    bf16 or fp32 bytes."""
    if values == "sign":
        return pack((vals < 0).to(torch.int64), 1)
    dtype = torch.bfloat16 if values == "bf16" else torch.float32
    return vals.to(dtype).contiguous().view(torch.uint8)


def decode_values(buf: torch.Tensor, k: int, values: str) -> torch.Tensor:
    """The (chunks, k) fp32 values that [`encode_values`][loco.algorithms.demo.encode_values]
    wrote into the uint8 rows ``buf``: ±1 for signs."""
    if values == "sign":
        return 1.0 - 2.0 * unpack(buf, k, 1).to(torch.float32)
    dtype = torch.bfloat16 if values == "bf16" else torch.float32
    return buf.contiguous().view(dtype).to(torch.float32)


class DeMo(Algorithm):
    """DeMo: sign-SGD on the sum of every worker's top-k DCT coefficients of its own
    momentum, one all-gather per step (see the module's description for the update).

    The inner optimizer is not stepped: it only holds the parameter groups, whose ``lr`` and
    ``weight_decay`` DeMo reads every step (a scheduler on it still schedules DeMo's lr).
    The replicas stay identical (``replicas_identical``).

    Args:
        model: the worker's replica of the model (see
            [`Algorithm`][loco.algorithms.base.Algorithm]).
        inner_optimizer: an optimizer over ``model``'s parameters (e.g. AdamW), never
            stepped: its groups give lr and weight decay.
        comm: the communication among the M workers (``ctx.comm``); not elastic.
        decay: β, the momentum's decay, in [0, 1]; default 0.999 (the paper's).
        topk: k, coefficients kept per chunk, >= 1 (clamped to the chunk's size); default 32.
        chunk: the chunk's largest side, >= 1; default 64.
        values: the kept values' wire format, ``"sign"``, ``"bf16"`` (default) or ``"fp32"``.
        **kwargs: passed to [`Algorithm`][loco.algorithms.base.Algorithm]:
            ``max_grad_norm`` (the local gradient is clipped before it enters the momentum),
            ``init_sync``, ``on_nonfinite`` (a non-finite local gradient is, with
            ``"skip"``, zeroed in place for that step: the worker still takes part in the
            all-gather), ``inner`` (must be None or one rank).

    Raises:
        ValueError: an argument outside the ranges above, an elastic ``comm``, a worker of
            several ranks or an FSDP2-sharded model.
    """

    name = "demo"
    title = "DeMo"
    options = DeMoOptions
    claims = (PaperClaim("loss", "ddp", 5),
              PaperClaim("bytes", "ddp", 10))

    @classmethod
    def check(cls, cfg, layers: int) -> None:
        """β in [0, 1], k >= 1, chunk >= 1; one rank per worker, no pipeline stages, not
        elastic, the AdamW inner optimizer (DeMo replaces it)."""
        need(cfg, 0 <= cfg.method.demo_decay <= 1, "demo_decay", "must be in [0, 1]")
        need(cfg, cfg.method.demo_topk >= 1, "demo_topk", "must be an integer >= 1")
        need(cfg, cfg.method.demo_chunk >= 1, "demo_chunk", "must be an integer >= 1")
        inner = cfg.optim.inner_optimizer
        if inner != "adamw":
            raise ConfigError("inner_optimizer", f"DeMo is its own optimizer: leave it at "
                              f"adamw with --algorithm demo (got {inner!r})")
        for name, ok in (("worker_ranks", cfg.runtime.worker_ranks == 1), ("stages", cfg.runtime.stages == 1)):
            need(cfg, ok, name, "must be 1 with --algorithm demo (not supported yet)")
        need(cfg, not cfg.runtime.elastic, "elastic", "is not supported with --algorithm demo")
        need(cfg, cfg.method.demo_values != "sign" or not any(
            a.kind in VALUE_KINDS for a in parse_attacks(cfg.trust.inject)),
            "inject", "scale, noise, nan, zero and stale need values to change: not with "
            "--demo-values sign (bitflip changes its bytes)")
        need(cfg, cfg.trust.aggregation not in COORDINATEWISE, "aggregation",
             "must be drop, clip or mean with --algorithm demo (its messages are judged whole: "
             "no per-coordinate statistics yet)")

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline) -> dict[str, Any]:
        """β, k, the chunk and the values' wire format."""
        return {"decay": cfg.method.demo_decay, "topk": cfg.method.demo_topk, "chunk": cfg.method.demo_chunk,
                "values": cfg.method.demo_values}

    @classmethod
    def setting(cls, config: dict) -> str:
        """β, k of each chunk and the values' wire format."""
        return (f"β={config['demo_decay']:g}, top-{config['demo_topk']} of "
                f"{config['demo_chunk']}×{config['demo_chunk']} DCT chunks, sign-SGD")

    @classmethod
    def inner_name(cls, config: dict) -> str:
        """``sign-SGD``: DeMo is its own optimizer (its inner optimizer is never stepped),
        so no other method's run is its twin."""
        return "sign-SGD"

    @classmethod
    def wire(cls, config: dict) -> str | None:
        """The kept coefficients: their values' format and packed indices."""
        return f"top-k DCT, {config.get('demo_values', 'bf16')} values + packed indices"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Comm,
                 decay: float = 0.999, topk: int = 32, chunk: int = 64, values: str = "bf16",
                 **kwargs: Any):
        if not 0 <= decay <= 1:
            raise ValueError(f"decay (β) must be in [0, 1] (got {decay!r})")
        for name, v in (("topk", topk), ("chunk", chunk)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
        if values not in VALUE_FORMATS:
            raise ValueError(f"values must be one of {', '.join(VALUE_FORMATS)} (got "
                             f"{values!r})")
        if comm.elastic:
            raise ValueError("DeMo does not support an elastic Comm yet")
        if kwargs.get("aggregation") in COORDINATEWISE:
            raise ValueError(f"aggregation {kwargs['aggregation']!r} is not supported by DeMo "
                             "yet (its messages are judged whole): use drop, clip or mean")
        inner = kwargs.get("inner")
        if inner is not None and inner.size > 1:
            raise ValueError("DeMo does not support workers of several ranks yet")
        super().__init__(model, inner_optimizer, comm, **kwargs)
        if self.ranks.sharded:
            raise ValueError("DeMo does not support FSDP2-sharded models yet")
        self.decay, self.topk, self.chunk, self.values = decay, topk, chunk, values
        # Each parameter's group by index: load_state_dict replaces the group dicts.
        opt_group = {p: i for i, g in enumerate(inner_optimizer.param_groups)
                     for p in g["params"]}
        if any(p not in opt_group for p in self.params):
            raise ValueError("DeMo reads lr and weight decay from the inner optimizer's "
                             "groups: every trained parameter must be in one")
        self.plans, offset = [], 0
        for p in self.params:
            self.plans.append(make_plan(p.shape, chunk, topk, values, offset))
            offset += self.plans[-1].nbytes
        self.payload_bytes = offset
        """Bytes of this worker's message every step (``payload_bytes``)."""
        self.momentum = torch.zeros(sum(p.numel() for p in self.params),
                                    device=self.params[0].device)
        """Every parameter's momentum m (this worker's own), as one fp32 vector, laid out
        group by group (``groups``)."""
        self.groups, self.moms = group_by_plan(self.params, self.plans,
                                               [opt_group[p] for p in self.params],
                                               self.momentum)
        self.pieces = cut_pieces(self.groups)
        """The groups cut into pieces of at most ``PIECE_VALUES`` values, computed one at a
        time."""
        self.value_positions = torch.cat([g.value_at for g in self.groups])
        """Payload positions of every kept value, for the step's finiteness check."""
        self.share = Share([self.params[i] for g in self.groups for i in g.members], None)
        self._dct: dict[int, torch.Tensor] = {}
        for plan in self.plans:  # made now: copying one to a GPU mid-step would wait for it
            self._c(plan.n1), self._c(plan.n2)

    def _c(self, n: int) -> torch.Tensor:
        if n not in self._dct:
            self._dct[n] = dct_matrix(n, self.momentum.device)
        return self._dct[n]

    def _lr_wd(self, group: Group) -> tuple[float, float]:
        opt = self.inner_optimizer.param_groups[group.opt_group]
        return float(opt["lr"]), float(opt.get("weight_decay", 0.0))

    @torch.no_grad()
    def step(self) -> None:
        """One DeMo step (replaces ``optimizer.step()``): clip, momentum, encode, one
        all-gather of every worker's message, decode and sign-SGD. Collective: every worker
        calls it at every step. Nothing is read on the host: a non-finite gradient or
        update is skipped on the device and counted at the next logging step
        (``settle_nonfinite``)."""
        with record_function("loco/inner_step"):
            self._accumulate()
        with record_function("loco/encode"):
            payload = self._encode()
            self._attacked(payload)
        handle = self.comm.all_gather(payload, tag="train", judged=True)
        with record_function("loco/wait"):
            gathered = self.comm.settle(handle)
        self.inner_steps += 1
        # The inner optimizer is never stepped: tell a learning-rate scheduler on it that a
        # step was taken (torch's flag), so that it does not warn about the order.
        self.inner_optimizer._opt_called = True
        stacked = as_rows(gathered)  # the gathered buffer itself, not a copy
        del payload, gathered
        scales = self._judged(stacked)  # the same bytes everywhere: all decide alike
        ok = self._all_sent_finite(stacked, scales)
        self.nonfinite.skipped_on_device((~ok).to(torch.float32), "syncs",
                                         self.inner_steps + 1)
        with record_function("loco/outer_step"):
            for piece in self.pieces:
                self._apply(piece, stacked, ok, scales)

    def _accumulate(self) -> None:
        """``m ← β·m + lr·g`` with the clipped local gradient (zeros for a parameter without
        one, and for all of them when the gradient is not finite: that step is counted as
        skipped, on the device). The gradient is the step's to change, as clipping does: a
        non-finite one is zeroed in place (no temporary of a parameter's size)."""
        norm = self.clip_gradients()
        nonfinite = ~torch.isfinite(norm)
        self.nonfinite.skipped_on_device(nonfinite.to(torch.float32), "inner_steps",
                                         self.inner_steps + 1)
        self.momentum.mul_(self.decay)
        for group in self.groups:
            lr = self._lr_wd(group)[0]
            for i in group.members:
                grad = self.params[i].grad
                if grad is not None:
                    grad = grad.to(self.momentum.dtype).masked_fill_(nonfinite, 0.0)
                    self.moms[i].add_(grad, alpha=lr)

    def _encode(self) -> torch.Tensor:
        """This worker's message: every parameter's kept coefficients (indices packed at
        ``bits`` each, values in their format), chunk rows laid out as ``Plan`` says; the
        kept coefficients (at full precision) leave the momentum. Computed piece by piece."""
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=self.momentum.device)
        for piece in self.pieces:
            self._encode_piece(piece, payload)
        return payload

    def _encode_piece(self, piece: Piece, payload: torch.Tensor) -> None:
        """One piece of ``_encode``, with at most two of
        its temporaries alive at once: the transforms are ``idct_chunks``'s products, and
        their blocks are subtracted from the momentum through a view, not a copy."""
        plan, c1, c2 = piece.plan, self._c(piece.plan.n1), self._c(piece.plan.n2)
        coef = dct_chunks(piece.mom, plan, c1, c2)
        # In index order: a message does not depend on how topk lists its picks.
        idx = coef.abs().topk(plan.k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = coef.gather(1, idx)
        payload[piece.index_at] = pack(idx, plan.bits).reshape(-1)
        payload[piece.value_at] = encode_values(vals, self.values).reshape(-1)
        sent = coef.zero_().scatter_(1, idx, vals).view(-1, plan.cols // plan.n2, plan.n1,
                                                        plan.n2)
        del coef, idx, vals
        half = c1.T @ sent
        del sent
        as_blocks(piece.mom, plan).sub_(half @ c2)

    def _values(self, raw: torch.Tensor) -> torch.Tensor:
        """The kept values of uint8 ``raw`` (rows of ``value_positions``' bytes), fp32."""
        dtype = torch.bfloat16 if self.values == "bf16" else torch.float32
        return raw.contiguous().view(dtype).to(torch.float32)

    def _attacked(self, payload: torch.Tensor) -> None:
        """This worker's injected attacks (``--inject``) on its message: on its values, then
        on its bytes."""
        shield, step = self.comm.shield, self.inner_steps + 1  # (the step it is sent for)
        if shield.injector is None:
            return
        if self.values != "sign":  # (sign values have none to attack: DeMo.check)
            vals = self._values(payload[self.value_positions])
            shield.send(vals, step)
            dtype = torch.bfloat16 if self.values == "bf16" else torch.float32
            payload[self.value_positions] = vals.to(dtype).view(torch.uint8)
        flip = shield.wire(step)
        if flip is not None:
            flip(payload)

    def _judged(self, stacked: torch.Tensor) -> torch.Tensor | None:
        """The guard's scale of each worker's message (0: left out), judged by the norm and
        digest of its values (a message whose MAC failed, zeroed by the seal, is left
        out and named ``mac``); None without a guard. With sign values every message has
        the same norm: only a forged one is left out (None where there is none)."""
        guard = self.comm.shield.at(self.inner_steps, self.comm.senders())
        if guard is None:
            return None
        if self.values == "sign":
            if guard.forged_next is None:
                return None
            ones = torch.ones(stacked.shape[0], device=stacked.device)
            return guard.judge(ones, None, trusted=0)
        vals = self._values(stacked[:, self.value_positions])
        norms = torch.linalg.vector_norm(vals, dim=1)
        return guard.judge(norms, guard.digest(norms, vals.sum(dim=1), vals.shape[1]))

    def _all_sent_finite(self, stacked: torch.Tensor, scales: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """Whether every value in the M messages (those the guard keeps: ``scales`` > 0) is
        finite, as a 0-d bool tensor (no read): only then is the step applied. (A sum of
        finite values that overflows fp32, above 3.4e38, is not checked.)"""
        if self.values == "sign":
            return torch.ones((), dtype=torch.bool, device=stacked.device)
        raw = stacked[:, self.value_positions]
        if scales is None:
            return values_finite(raw, self.values)
        finite = torch.stack([values_finite(row, self.values) for row in raw])
        return (finite | (scales == 0)).all()

    def _decode(self, stacked: torch.Tensor, piece: Piece,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        """A piece's coefficients averaged per index over the messages that sent it
        (``stacked``, one row each; a message the guard left out sends none), as
        (chunks, n1 · n2) fp32, 0 where none did: worker 0's kept values scattered first,
        then worker 1's, ...: every index sums in rank order, on any device (the k indices
        of one worker's chunk are distinct, so no two additions of one ``scatter_add_``
        meet: no atomics decide the order), then is divided by its senders' number."""
        plan, m = piece.plan, stacked.shape[0]
        idx = unpack(stacked[:, piece.index_at].view(m * plan.chunks, -1), plan.k, plan.bits)
        idx.clamp_(max=plan.n1 * plan.n2 - 1)  # damaged bytes stay inside their chunk
        vals = decode_values(stacked[:, piece.value_at].view(m * plan.chunks, -1), plan.k,
                             self.values)
        idx, vals = idx.view(m, plan.chunks, plan.k), vals.view(m, plan.chunks, plan.k)
        total = torch.zeros(plan.chunks, plan.n1 * plan.n2, device=self.momentum.device)
        senders = torch.zeros_like(total)
        for w in range(m):  # (the guard's scale: times 1 is the same bits; 0 leaves it out)
            sent = torch.ones_like(vals[w]) if scales is None else (
                (scales[w] > 0).to(vals.dtype).expand_as(vals[w]))
            kept = vals[w] if scales is None else torch.where(  # (NaN × 0 is NaN)
                scales[w] > 0, vals[w] * scales[w], torch.zeros_like(vals[w]))
            total.scatter_add_(1, idx[w], kept)
            senders.scatter_add_(1, idx[w], sent)
        return total.div_(senders.clamp_(min=1))

    def _apply(self, piece: Piece, stacked: torch.Tensor, ok: torch.Tensor,
               scales: torch.Tensor | None = None) -> None:
        """``p ← p · (1 − lr·wd) − lr · sign(IDCT(total))`` for a piece's rows of every
        parameter, ``total`` the piece's ``_decode`` of
        the M messages ``stacked``, where ``ok`` (a 0-d bool tensor) holds; else nothing
        moves. At most two of the piece's temporaries are alive at once: the direction stays
        in chunk blocks, applied through a view of each parameter's rows."""
        g, plan = piece.group, piece.plan
        lr, wd = self._lr_wd(g)
        total = self._decode(stacked, piece, scales).view(-1, plan.cols // plan.n2, plan.n1,
                                                          plan.n2)
        half = self._c(plan.n1).T @ total  # idct_chunks's products, one at a time
        del total
        direction = (half @ self._c(plan.n2)).sign_().masked_fill_(~ok, 0.0)
        del half
        decay = torch.where(ok, 1 - lr * wd, 1.0) if wd else None
        rows = g.plan.rows // len(g.members)  # each member's
        start, stop = piece.rows
        for j, i in enumerate(g.members):
            lo, hi = max(start, j * rows), min(stop, (j + 1) * rows)
            if lo >= hi:
                continue
            p = self.params[i].view(rows, -1)[lo - j * rows:hi - j * rows]
            if decay is not None:
                p.mul_(decay)
            mine = direction[(lo - start) // plan.n1:(hi - start) // plan.n1]
            as_blocks(p, plan).sub_(mine.to(p.dtype), alpha=lr)

    # ------------------------------------------------------------------------- state
    def replicated_tensors(self) -> list[torch.Tensor]:
        """The parameters: every worker applies the same decoded update (the momenta are
        each worker's own)."""
        return Share(self.params, self.inner).views

    def outer_tensors(self) -> list[torch.Tensor]:
        """This worker's momenta (one fp32 vector), and what it keeps to build and read a
        payload: the payload positions of every group and piece, and the DCT matrices."""
        return [self.momentum, self.value_positions, *self._dct.values(),
                *(t for g in (*self.groups, *self.pieces) for t in (g.index_at, g.value_at))]

    def outer_state(self) -> dict:
        """The momenta (see
        [`Algorithm.outer_state`][loco.algorithms.base.Algorithm.outer_state])."""
        return {"momentum": (self.share, self.momentum)}

    def state_dict(self, tensors: bool = True) -> dict:
        """The base state plus the momenta, so a resumed run continues bit for bit.

        Args:
            tensors: include the tensors (default True); False: the counters only (see
                [`Algorithm.state_dict`][loco.algorithms.base.Algorithm.state_dict]).

        Returns:
            A dict for ``torch.save``, of the live tensors (copy it to keep it).
        """
        state = super().state_dict(tensors)
        if tensors:
            state["momentum"] = self.momentum
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.demo.DeMo.state_dict] saved.

        Args:
            state: a dict from ``state_dict()`` of a DeMo built the same way.
        """
        super().load_state_dict(state)
        if "momentum" in state:
            self.momentum.copy_(state["momentum"])


__all__ = ["VALUE_FORMATS", "DeMo", "DeMoOptions", "dct_matrix", "payload_bytes"]
