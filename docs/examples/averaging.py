"""A new method in one file: plain parameter averaging every H inner steps (FedAvg), with
one option of its own (how far each replica moves towards the mean).

Run it as ``python docs/examples/averaging.py`` (a short job on the bundled corpus; add
``--average-mix 0.5``), or import ``Averaging`` and ``register`` it, at any time before the
command line is parsed.
"""

import sys
from dataclasses import dataclass

import torch

from loco.algorithms import Algorithm, PaperClaim, register
from loco.algorithms.sharding import flatten_fp32, unflatten_views
from loco.options import need, opt


@dataclass
class AveragingOptions:
    """Plain averaging's own options: flags, YAML keys under ``method:``, ``cfg.method.*``."""

    average_mix: float = opt(1.0, "avg: at each average, move every replica this far towards "
                             "the workers' mean, in (0, 1] (1: replace it by the mean)")


class Averaging(Algorithm):
    """Every H inner steps the workers move their parameters towards their mean (by
    default onto it).

    Args:
        model: the worker's replica of the model.
        inner_optimizer: the optimizer over ``model``'s parameters.
        comm: the communication among the M workers (``ctx.comm``).
        sync_every: H, inner steps between two averages, >= 1; default 4.
        mix: how far each replica moves towards the mean, in (0, 1]; default 1 (onto it).
        **kwargs: passed to ``Algorithm`` (``max_grad_norm``, ``on_nonfinite``, ...).
    """

    name = "avg"                                    # --algorithm avg
    title = "Plain averaging"                       # in reports and plots
    options = AveragingOptions                      # its own: --average-mix
    shared = ("sync_every",)                        # the shared options it reads (H)
    defaults = {"sync_every": 4}                    # H when --sync-every is not given
    claims = (PaperClaim("loss", "local", 0, text="below {ref}'s (no communication)"),)

    def __init__(self, model, inner_optimizer, comm, sync_every: int = 4, mix: float = 1.0,
                 **kwargs):
        super().__init__(model, inner_optimizer, comm, **kwargs)
        self.sync_every, self.mix = sync_every, mix

    @classmethod
    def check(cls, cfg, layers):
        """``--average-mix`` in (0, 1]."""
        need(cfg, 0 < cfg.method.average_mix <= 1, "average_mix", "must be in (0, 1]")

    @classmethod
    def kwargs(cls, cfg, model, comm, pipeline):
        """The constructor's arguments from a run's configuration (``cfg.method``: the shared
        options and this method's own)."""
        return {"sync_every": cfg.method.sync_every, "mix": cfg.method.average_mix}

    def step(self) -> None:
        """One inner step; every H steps, the mean of the workers' parameters."""
        self.inner_update()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            flat = flatten_fp32([p.detach() for p in self.params])
            self.comm.all_reduce_mean(flat).wait()
            with torch.no_grad():
                for p, mean in zip(self.params, unflatten_views(flat, self.params)):
                    if self.mix == 1:
                        p.copy_(mean)
                    else:
                        p.lerp_(mean, self.mix)


if __name__ == "__main__":
    from loco.cli import main

    register(Averaging)
    sys.exit(main(["train", "--algorithm", "avg", "--model", "tiny", "--steps", "40",
                   *sys.argv[1:]]))
