"""What the rest of loco reads of an algorithm beside its step: the parameters to evaluate,
the state the replica check compares, and the bytes each part of its state holds.

``Reporting`` is a base of every
[`Algorithm`][loco.algorithms.base.Algorithm]; a method overrides what differs
(``global_parameters`` where it keeps a global copy, ``replicated_tensors`` and
``outer_tensors`` where it holds outer state).
"""

from __future__ import annotations

import torch

from loco.algorithms.sharding import local


class Reporting:
    """An algorithm's report methods (a base of
    [`Algorithm`][loco.algorithms.base.Algorithm], which sets what they read: ``model``,
    ``inner_optimizer``, ``comm`` and ``ranks``)."""

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters to evaluate, by name (usable with ``torch.func.functional_call``).

        Here the model's own parameters; outer algorithms return their global copy.
        """
        return dict(self.model.named_parameters())

    def replicated_tensors(self) -> list[torch.Tensor]:
        """This rank's share of the state that must be bit-identical on every worker, which
        the replica check compares and heals (``loco.algorithms.replicas``); none here:
        nothing is checked (the replicas differ by design, or hold no common state)."""
        return []

    def outer_tensors(self) -> list[torch.Tensor]:
        """The tensors of the outer algorithm this rank holds between steps: its state,
        its sync buffers and any spare copies (for ``memory_bytes``); none here."""
        return []

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by part: ``model`` (parameters and
        buffers, its shards under FSDP2), ``gradients`` (one per trained parameter, held
        from the backward pass to the inner step), ``inner_optimizer`` (its state),
        ``outer`` (the outer algorithm's state, sync buffers and spare copies,
        ``outer_tensors``: each storage once, whole, as views of one buffer share it) and
        ``comm`` (the buffers the algorithm's Comms keep between operations,
        ``Comm.buffer_bytes``, and ``WorkerRanks.buffer_bytes`` for a worker of several
        ranks)."""
        def size(tensors) -> int:
            return sum(local(t).numel() * t.element_size() for t in tensors)
        model = size(t for t in self.model.state_dict().values() if isinstance(t, torch.Tensor))
        inner = size(v for s in self.inner_optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        grads = size(p for p in self.model.parameters() if p.requires_grad)
        storages = {}
        for t in self.outer_tensors():
            storage = local(t).untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # (meta tensors' data_ptr is 0)
        comm = self.comm.buffer_bytes() if hasattr(self.comm, "buffer_bytes") else 0
        return {"model": model, "gradients": grads, "inner_optimizer": inner,
                "outer": sum(storages.values()), "comm": comm + self.ranks.buffer_bytes()}


__all__ = ["Reporting"]
