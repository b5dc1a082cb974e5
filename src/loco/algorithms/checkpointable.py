"""What an algorithm saves and restores: its state for ``torch.save`` (``state_dict``), its
outer state as named fp32 vectors (``outer_state``), and every tensor as the worker's whole
tensors for ``torch.distributed.checkpoint`` (``checkpoint_tensors``).

``Checkpointable`` is a base of every
[`Algorithm`][loco.algorithms.base.Algorithm]; a method with outer state overrides
``state_dict``, ``load_state_dict`` and ``outer_state`` and calls the base's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from loco.algorithms.sharding import Share, from_logical, load_local, local_tree, logical_state


class Checkpointable:
    """An algorithm's checkpoint methods (a base of
    [`Algorithm`][loco.algorithms.base.Algorithm], which sets what they read: ``model``,
    ``inner_optimizer``, ``ranks``, ``inner_steps`` and ``nonfinite``)."""

    def state_dict(self, tensors: bool = True) -> dict:
        """Everything needed to continue: model, inner optimizer, counters, outer state.

        Args:
            tensors: include the tensors of the model, the optimizers and the outer state
                (default True); False: only the rest (counters, the schedule's position),
                for a checkpoint that saves the tensors through
                [`checkpoint_tensors`][loco.algorithms.base.Algorithm.checkpoint_tensors].

        Returns:
            A dict of tensors and numbers for ``torch.save``; each rank saves its own (under
            FSDP2 its local shards, with R ranks per worker its share of the outer state).
        """
        self.settle_nonfinite()
        state = {"inner_steps": self.inner_steps, "skipped": dict(self.skipped)}
        if tensors:
            state.update(model=local_tree(self.model.state_dict()),
                         inner_optimizer=local_tree(self.inner_optimizer.state_dict()))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what [`state_dict`][loco.algorithms.base.Algorithm.state_dict] saved, so
        training continues exactly (without tensors: load them next with
        [`load_checkpoint_tensors`][loco.algorithms.base.Algorithm.load_checkpoint_tensors]).

        Args:
            state: a dict from ``state_dict()`` of an algorithm built the same way.
        """
        if "model" in state:
            load_local(self.model, self.inner_optimizer, state["model"],
                       state["inner_optimizer"], self.ranks.sharded)
        self.inner_steps = int(state["inner_steps"])
        self.nonfinite.skipped = {k: int(v) for k, v in state.get("skipped",
                                                                  self.skipped).items()}

    def outer_state(self) -> dict[str, tuple[Share, torch.Tensor]]:
        """The outer algorithm's tensors by name, each as (the
        [`Share`][loco.algorithms.sharding.Share] it holds values of, this rank's values as
        one fp32 vector); none here. A vector may be a copy:
        [`load_outer_state`][loco.algorithms.base.Algorithm.load_outer_state] puts values
        back."""
        return {}

    def load_outer_state(self, values: dict[str, torch.Tensor]) -> None:
        """Set the outer state from vectors shaped like those of
        [`outer_state`][loco.algorithms.base.Algorithm.outer_state].

        Args:
            values: a vector for every name of ``outer_state()``.
        """
        for name, (_, flat) in self.outer_state().items():
            flat.copy_(values[name])

    def checkpoint_tensors(self, mesh: DeviceMesh | None = None) -> dict:
        """Every tensor of this rank's state as the worker's whole tensors, for
        ``torch.distributed.checkpoint`` (DCP): the model and inner optimizer from
        ``torch.distributed.checkpoint.state_dict`` (FSDP2's DTensors as they are), the outer
        state as [`Share.logical`][loco.algorithms.sharding.Share.logical] gives it. DCP
        saves each rank's part once and loads any layout of R ranks from it. No message.

        Args:
            mesh: the worker's ``DeviceMesh`` of its R ranks (``ctx.device_mesh["shard"]``);
                None for a worker of one rank.

        Returns:
            ``{"model": ..., "inner_optimizer": ..., "outer": {name: tensor}}``; the model's
            tensors alias its parameters, so ``dcp.load`` into a fresh algorithm's dict
            fills them (then call ``load_checkpoint_tensors``).
        """
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)

        return {"model": get_model_state_dict(self.model),
                "inner_optimizer": get_optimizer_state_dict(self.model, self.inner_optimizer),
                "outer": logical_state(self.outer_state(), mesh)}

    def load_checkpoint_tensors(self, tensors: dict, mesh: DeviceMesh | None = None) -> None:
        """Take the state from a ``checkpoint_tensors()`` dict that ``dcp.load`` filled.

        Args:
            tensors: the dict, loaded.
            mesh: as for ``checkpoint_tensors``.
        """
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(self.model, tensors["model"])
        set_optimizer_state_dict(self.model, self.inner_optimizer, tensors["inner_optimizer"])
        self.load_outer_state(from_logical(self.outer_state(), tensors["outer"], mesh))


__all__ = ["Checkpointable"]
