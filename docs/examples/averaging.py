"""A new method in one file: plain parameter averaging every H inner steps (FedAvg).

Run it as ``python docs/examples/averaging.py`` (a short job on the bundled corpus), or
import ``Averaging`` and ``register`` it before building a configuration.
"""

import sys

import torch

from loco.algorithms import Algorithm, PaperClaim, register
from loco.algorithms.sharding import flatten_fp32, unflatten_views


class Averaging(Algorithm):
    """Every H inner steps the workers replace their parameters by their mean.

    Args:
        model: the worker's replica of the model.
        inner_optimizer: the optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between two averages, >= 1; default 4.
        **kwargs: passed to ``Algorithm`` (``max_grad_norm``, ``on_nonfinite``, ...).
    """

    name = "avg"                                    # --algorithm avg
    title = "Plain averaging"                       # in reports and plots
    shared = ("sync_every",)                        # the shared options it reads (H)
    defaults = {"sync_every": 4}                    # H when --sync-every is not given
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),)

    def __init__(self, model, inner_optimizer, comm, sync_every: int = 4, **kwargs):
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.sync_every = sync_every

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline):
        """The constructor's arguments from a run's configuration."""
        return {"sync_every": cfg.sync_every}

    def step(self) -> None:
        """One inner step; every H steps, the mean of the workers' parameters."""
        self.inner_update()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            flat = flatten_fp32([p.detach() for p in self.params])
            self.comm.all_reduce_mean(flat).wait()
            with torch.no_grad():
                for p, mean in zip(self.params, unflatten_views(flat, self.params)):
                    p.copy_(mean)


if __name__ == "__main__":
    from loco.cli import main

    register(Averaging)
    sys.exit(main(["train", "--algorithm", "avg", "--model", "tiny", "--steps", "40",
                   *sys.argv[1:]]))
