"""Shard one worker's model over its ranks with FSDP2 (``--worker-parallel fsdp``).

A worker of R ranks (``launch(..., shards=R)``) holds one replica of the model. Under
``ddp`` every rank keeps all of it; under ``fsdp``
[`shard_worker`][loco.runtime.fsdp.shard_worker] hands it to
``torch.distributed.fsdp.fully_shard`` over the worker's own ranks (the ``"shard"`` dimension
of ``ctx.device_mesh``), so that each rank keeps about 1/R of every parameter, of its
gradient and of the inner optimizer's state. What runs where:

* inside a worker (the fast link): FSDP2 all-gathers each block's parameters before its
  forward and backward, frees them after, and reduce-scatters the gradients, so each rank
  ends the backward with the mean gradient of the worker's R batches for its own shard;
* across workers (the slow link): the outer algorithm (``inner=ctx.inner``) syncs rank r's
  local shards with rank r of the other workers; FSDP2 never talks across workers.

One FSDP unit per block (see [`find_blocks`][loco.algorithms.fragments.find_blocks]) and one
for the rest at the root (embedding, final norm, the tied head), so that only one block is
gathered at a time. The parameters become DTensors sharded on dimension 0;
``p.to_local()`` is this rank's shard, ``p.full_tensor()`` gathers the whole (a collective).

It needs a ``torch.distributed`` process group per rank, hence the processes launcher or
torchrun; the threads launcher has no ``DeviceMesh``. The mesh has the ranks' device type,
and ``fully_shard`` moves the parameters onto it, so a CPU model lands on the rank's GPU.
A model built on the meta device stays there, sharded: ``loco.model.materialise`` then
allocates and draws each rank's shard alone (what ``loco train`` does, so that no rank ever
holds the whole model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from loco.runtime.context import RankContext

NO_MESH_ERROR = ("--worker-parallel fsdp needs a torch.distributed process group per rank: "
                 "use --launcher processes or torchrun (the threads launcher has none)")


def shard_worker(model: nn.Module, ctx: RankContext,
                 mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard ``model`` over the ranks of this rank's worker with FSDP2, in place.

    Every rank of the worker must call it on the same model, before building the inner
    optimizer (the optimizer must see the sharded parameters): either built on the meta
    device, to be materialised after (``loco.model.materialise``: each rank allocates and
    draws only its shard, the unsharded model's rows bit for bit), or with the same weights
    on every rank.

    Args:
        model: the worker's model, with its repeated blocks in an ``nn.ModuleList`` (see
            [`find_blocks`][loco.algorithms.fragments.find_blocks]), on the meta device or
            real.
        ctx: this rank's [`RankContext`][loco.runtime.context.RankContext]; its
            ``device_mesh["shard"]`` is the group the model is sharded over.
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (parameter, reduction and output
            dtypes) for every unit; default None, FSDP2's default (everything in the
            parameters' dtype).

    Returns:
        ``model`` itself, its parameters now DTensors sharded across the worker's
            ranks; unchanged when the worker has one rank (``ctx.inner`` is None).

    Raises:
        ValueError: ``ctx`` has no ``device_mesh`` (the threads launcher).
    """
    if ctx.device_mesh is None:
        raise ValueError(NO_MESH_ERROR)
    if ctx.inner is None:  # one rank per worker: nothing to shard
        return model
    from torch.distributed.fsdp import fully_shard

    from loco.algorithms.fragments import find_blocks

    mesh = ctx.device_mesh["shard"]
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    units = [fully_shard(block, mesh=mesh, **kw) for block in find_blocks(model)]
    units.append(fully_shard(model, mesh=mesh, **kw))
    gather, scatter = _counted_collectives(ctx.inner)
    for unit in units:  # FSDP2's own collectives, counted as the worker's fast-link bytes
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)
    return model


def _counted_collectives(comm):
    """FSDP2's default all-gather and reduce-scatter, unchanged, that also count their bytes
    on ``comm`` (the worker's fast-link Comm, over the same ranks) with loco's convention
    for a collective of R ranks: each sends and receives R − 1 shards."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    class Gather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            shard = (comm.size - 1) * nbytes(input_tensor)
            comm.account("fsdp_all_gather", nbytes(output_tensor), shard, shard)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class Scatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            shard = (comm.size - 1) * nbytes(output_tensor)
            comm.account("fsdp_reduce_scatter", nbytes(input_tensor), shard, shard)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return Gather(), Scatter()
