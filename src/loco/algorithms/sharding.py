"""What one rank of a worker owns of the outer algorithm's state.

A worker may be R ranks joined by a fast link (``ctx.inner``). The outer algorithm's state
(the global copy, the outer momentum, NoLoCo's slow weights) and its slow-link traffic are
then split so that each rank holds and sends 1/R of it, and rank r of every worker meets
only rank r of the others (the hybrid-sharded layout):

- **one rank** (``inner`` None): the rank owns every parameter;
- **data-parallel inside** (every rank holds the whole model): rank r owns the r-th of R
  equal ranges of the parameters flattened in order; after it writes its range, the worker
  all-gathers the ranges over the fast link so every rank holds the whole model again;
- **FSDP2 inside** (the parameters are ``DTensor`` shards): a rank owns its local shards,
  nothing to gather.

A [`Share`][loco.algorithms.sharding.Share] gives the owned values as flat 1-D views of the
parameters, so the algorithms read, step and write them in one code path for all three.
Every algorithm holds a [`WorkerRanks`][loco.algorithms.sharding.WorkerRanks]
(``algo.ranks``): what its rank does with the other ranks of its worker (the gradients'
average before an inner step, the shards of a buffer, a verdict they agree on).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from loco.algorithms.buckets import GradientBuckets
from loco.comm import Comm


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (sharing its storage), else
    ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_sharded(params) -> bool:
    """Whether the parameters are FSDP2 shards (``DTensor``)."""
    return any(isinstance(p, DTensor) for p in params)


def flatten_fp32(tensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate tensors into one fp32 vector (a single message instead of many).

    Args:
        tensors: a non-empty list of tensors on one device.
        out: where to write (``sum numel`` values); default a new tensor.
    """
    total = sum(t.numel() for t in tensors)
    if out is None:
        out = torch.empty(total, dtype=torch.float32, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return out


def unflatten_views(flat: torch.Tensor, like) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each tensor of ``like``.

    Args:
        flat: a 1-D tensor of at least ``sum numel`` values.
        like: the tensors whose shapes to take.
    """
    views, offset = [], 0
    for t in like:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


class Share:
    """This rank's share of a list of parameters (see the module's description).

    Args:
        params: the parameters, in an order every rank shares.
        inner: the worker's fast-link Comm (None for a worker of one rank).

    Attributes:
        views: views of the parameters' storage holding what this rank owns, in order: the
            (local) tensors themselves, or 1-D slices of them for a range.
        numel: the number of owned values.
    """

    def __init__(self, params: list[torch.Tensor], inner: Comm | None):
        self.params = list(params)
        self.sharded = is_sharded(self.params)
        self.inner = None if self.sharded else inner
        self.total = sum(local(p).numel() for p in self.params)
        if self.inner is None:  # the whole (local) tensors, in their shapes
            self.views, self.width = [local(p).detach() for p in self.params], self.total
        else:
            self.width = -(-self.total // self.inner.size)  # the padded size of one range
            start = self.inner.rank * self.width
            self.views = _slice([p.detach().view(-1) for p in self.params], start,
                                min(start + self.width, self.total))
        self.numel = sum(v.numel() for v in self.views)

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The owned values as one fp32 vector.

        Args:
            out: where to write (``numel`` values); default a new tensor.
        """
        if not self.views:
            return torch.zeros(0, device=local(self.params[0]).device) if out is None else out
        return flatten_fp32(self.views, out)

    def gather(self) -> None:
        """Make every rank of the worker hold every parameter again after each wrote its
        range (data-parallel inside: an all-gather over the fast link, its result copied
        into the parameters from the gather's own buffer; both buffers are the fast-link
        Comm's, kept and counted, so a merge allocates nothing; otherwise nothing)."""
        if self.inner is None:
            return
        padded = self.inner.buffer("share_gather", (self.width,), torch.float32)
        padded[self.numel:].zero_()
        self.read(out=padded[:self.numel])
        full = self._gathered(padded, "train", keep=True)
        flat = [p.detach().view(-1) for p in self.params]
        torch._foreach_copy_(flat, [f.to(p.dtype) for f, p in zip(
            unflatten_views(full, flat), flat)])

    def full(self, owned: torch.Tensor, tag: str = "train") -> list[torch.Tensor]:
        """Whole tensors shaped like the parameters from every rank's owned values
        (``owned`` here, ``numel`` of them, fp32): for one rank, views of ``owned``; for
        data-parallel inside, an all-gather over the fast link (collective: every rank of
        the worker calls it at once); for FSDP2, DTensors with the parameters' placements.

        Args:
            owned: this rank's values, in the order of ``views``.
            tag: what the gather's bytes are counted as; default ``"train"``.
        """
        if self.sharded:
            return [DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                       stride=p.stride(), run_check=False)
                    for v, p in zip(unflatten_views(owned, [local(p) for p in self.params]),
                                    self.params)]
        if self.inner is None:
            return unflatten_views(owned, self.params)
        padded = torch.zeros(self.width, dtype=torch.float32, device=owned.device)
        padded[:owned.numel()] = owned
        return unflatten_views(self._gathered(padded, tag), self.params)

    def _gathered(self, padded: torch.Tensor, tag: str, keep: bool = False) -> torch.Tensor:
        """Every rank's ``padded`` range, all-gathered over the fast link, as one flat
        tensor: the gather's own buffer when its rows lie one after another in it (no
        second copy), else their concatenation; ``keep``: the Comm's kept buffer."""
        rows = self.inner.all_gather(padded, tag=tag, keep=keep).wait()
        first = rows[0]
        if all(r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and r.storage_offset() == first.storage_offset() + i * self.width
               and r.is_contiguous() for i, r in enumerate(rows)):
            return first.as_strided((len(rows) * self.width,), (1,), first.storage_offset())
        return torch.cat(rows)

    def logical(self, owned: torch.Tensor, mesh: DeviceMesh | None = None
                ) -> dict[str, torch.Tensor]:
        """``owned`` as the whole tensors it is a share of, for
        ``torch.distributed.checkpoint`` (DCP), which saves and loads each rank's part of
        them and reshards to another R. No copy, no message: the tensors alias ``owned``,
        so loading into them fills it.

        - one rank: ``{"": owned}``, the flattened parameters themselves;
        - data-parallel inside: ``{"": DTensor}``, the flattened parameters sharded on
          dimension 0 over ``mesh``: rank r's range is ``torch.chunk``'s r-th, as here;
        - FSDP2: ``{"0": DTensor, "1": ...}``, one per parameter with its placements.

        Args:
            owned: this rank's values (``numel`` of them, fp32), in the order of ``views``.
            mesh: the worker's ``DeviceMesh`` of its R ranks (``ctx.device_mesh["shard"]``);
                needed for data-parallel inside only.
        """
        if self.sharded:
            return {str(i): t for i, t in enumerate(self.full(owned))}
        if self.inner is None:
            return {"": owned}
        if mesh is None:
            raise ValueError("a worker of several ranks needs its DeviceMesh to checkpoint "
                             "through torch.distributed.checkpoint")
        return {"": DTensor.from_local(owned, mesh, [Shard(0)], shape=(self.total,),
                                       stride=(1,), run_check=False)}


def _slice(flat: list[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """The parts of the concatenation of ``flat`` in [start, stop), as views."""
    views, offset = [], 0
    for t in flat:
        a, b = max(start - offset, 0), min(stop - offset, t.numel())
        if a < b:
            views.append(t[a:b])
        offset += t.numel()
    return views


def local_tree(state):
    """``state`` (dicts and lists of tensors) with every DTensor replaced by its local shard
    (what this rank saves)."""
    if isinstance(state, dict):
        return {k: local_tree(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_tree(v) for v in state]
    return local(state) if isinstance(state, torch.Tensor) else state


def load_local(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
               optimizer_state: dict, sharded: bool) -> None:
    """Load a model's and its optimizer's state as ``local_tree`` saved it: under FSDP2
    this rank's shards, into the DTensors' local tensors; otherwise the whole tensors.

    Args:
        model: the model to load into.
        optimizer: its optimizer.
        model_state: the model's saved state.
        optimizer_state: the optimizer's saved state.
        sharded: whether the model is FSDP2-sharded (``WorkerRanks.sharded``).
    """
    if not sharded:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    with torch.no_grad():
        for name, t in model.state_dict().items():
            local(t).copy_(model_state[name])
    optimizer.load_state_dict(optimizer_state)
    _redistribute_state(optimizer)


def logical_state(outer: dict, mesh: DeviceMesh | None = None) -> dict[str, torch.Tensor]:
    """An algorithm's ``outer_state()`` as the worker's whole tensors by name, for
    ``torch.distributed.checkpoint`` (each share as
    [`Share.logical`][loco.algorithms.sharding.Share.logical] gives it; no copy).

    Args:
        outer: ``{name: (share, flat)}``, this rank's values of each.
        mesh: the worker's ``DeviceMesh`` of its R ranks; None for a worker of one rank.
    """
    return {_join(name, key): t for name, (share, flat) in outer.items()
            for key, t in share.logical(flat, mesh).items()}


def from_logical(outer: dict, tensors: dict, mesh: DeviceMesh | None = None
                 ) -> dict[str, torch.Tensor]:
    """This rank's values of each tensor of ``outer`` (as ``outer_state()`` gives them),
    read from a ``logical_state`` dict that ``dcp.load`` filled.

    Args:
        outer: ``{name: (share, flat)}``, to take the layout from.
        tensors: the loaded dict.
        mesh: as for ``logical_state``.
    """
    values = {}
    for name, (share, flat) in outer.items():
        keys = share.logical(flat, mesh)
        values[name] = flatten_fp32([local(tensors[_join(name, k)]) for k in keys],
                                    out=torch.empty_like(flat))
    return values


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if key else name


def _redistribute_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading local shards into an optimizer over DTensors: make each state tensor a
    DTensor again, with its parameter's placements."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if (isinstance(p, DTensor) and isinstance(v, torch.Tensor)
                        and not isinstance(v, DTensor) and v.shape == local(p).shape):
                    optimizer.state[p][k] = DTensor.from_local(
                        v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                        run_check=False)


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor (a DTensor's over all its shards)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class WorkerRanks:
    """What this rank does with the other ranks of its worker, R ranks joined by a fast
    link: average the gradients before an inner step, split a buffer into R shards and
    gather them, agree on a verdict. For a worker of one rank each of these does nothing.

    Args:
        params: the trained parameters, in the model's order.
        inner: the worker's fast-link Comm (``ctx.inner``); None, or one of size 1, for a
            worker of one rank.

    Attributes:
        inner: the fast-link Comm, None for a worker of one rank.
        sharded: whether the model is FSDP2-sharded over the worker's ranks (its parameters
            are DTensors): the algorithm then works on each rank's local shards, and FSDP2
            averages the gradients inside the worker.
    """

    def __init__(self, params: list[torch.Tensor], inner: Comm | None):
        self.params = params
        self.inner = inner if inner is not None and inner.size > 1 else None
        self.sharded = is_sharded(params)
        self.average_before_step = True
        """Whether ``before_step`` averages the gradients over ``inner`` (a method that
        reduces them itself turns it off)."""
        self.buckets: GradientBuckets | None = None
        """The gradients' buckets reduced over ``inner`` during the backward pass (a worker
        of several ranks holding the whole model), made at the first average."""

    def before_step(self) -> None:
        """Average the gradients over the worker's ranks before the inner step, where they
        hold the whole model (FSDP2 has averaged them itself) and the method leaves it
        here (``average_before_step``)."""
        if self.inner is not None and self.average_before_step and not self.sharded:
            self.average_gradients()

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average the gradients over the ranks of this worker (``inner``, the fast link), in
        fp32, as data-parallel training does; every rank of the worker then steps alike.
        From the second backward pass on, the buckets are reduced while it runs
        ([`GradientBuckets`][loco.algorithms.buckets.GradientBuckets], hooks registered at
        the first call); this waits for them (a parameter that got no gradient contributes
        zeros)."""
        if self.buckets is None:
            self.buckets = GradientBuckets(self.params, self.inner)
        self.buckets.finish()

    def buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """A zeroed fp32 buffer for ``n`` values, padded to R equal shards (no padding for
        one rank). Its first ``n`` values are the data.

        Args:
            n: the values, >= 0.
            device: where it lives.
        """
        r = self.inner.size if self.inner is not None else 1
        return torch.zeros(-(-n // r) * r, dtype=torch.float32, device=device)

    def own(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's 1/R of a ``buffer`` (all of it for one rank): what it sends over the
        slow link, with the same shard of every other worker.

        Args:
            buffer: a buffer from ``buffer``.
        """
        if self.inner is None:
            return buffer
        size = buffer.numel() // self.inner.size
        return buffer[self.inner.rank * size:(self.inner.rank + 1) * size]

    def gather(self, buffer: torch.Tensor) -> None:
        """Fill ``buffer`` with every rank's shard, over the worker's fast link (nothing to
        do for one rank).

        Args:
            buffer: a buffer from ``buffer``, this rank's shard up to date.
        """
        if self.inner is not None:
            torch.cat(self.inner.all_gather(self.own(buffer), tag="train").wait(),
                      out=buffer)

    def buffer_bytes(self) -> int:
        """Bytes the worker's fast link keeps between operations (``Comm.buffer_bytes`` of
        ``inner``) and the buffer the gradients are averaged in (``buckets``); 0 for a
        worker of one rank."""
        kept = self.inner.buffer_bytes() if hasattr(self.inner, "buffer_bytes") else 0
        if self.buckets is not None:
            kept += self.buckets.flat.numel() * self.buckets.flat.element_size()
        return kept

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of this worker: each rank of a worker of R
        ranks checks only its own shard, so they combine their verdicts (one value over the
        fast link) and decide alike.

        Args:
            flag: this rank's verdict.
        """
        if self.inner is None:
            return flag
        bad = torch.tensor([0.0 if flag else 1.0], device=self.inner.device)
        self.inner.all_reduce_mean(bad, tag="train").wait()
        return float(bad) == 0.0
