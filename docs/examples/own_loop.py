"""Streaming DiLoCo in a plain PyTorch training loop, complete: 4 workers (threads of this
process) each train a small next-token model on their own data, and sync every 20 steps.

    python docs/examples/own_loop.py        # a few seconds on a laptop CPU

The two lines that differ from plain PyTorch are marked "was:". The data are counting
sequences (each token is the previous one plus 1, modulo the vocabulary), so the loss falls
from about log(64) = 4.16 towards 0 within 60 steps.
"""

import math

import torch
from torch import nn

import loco

VOCAB, SEQ, BATCH = 64, 16, 8


class TinyLM(nn.Module):
    """A next-token model: ``model(x, y)`` is the mean cross-entropy of predicting ``y``.
    Its residual blocks sit in an ``nn.ModuleList``, which Streaming DiLoCo splits into
    fragments."""

    def __init__(self, width: int = 64, blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(blocks))
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def my_batches(rank: int, world_size: int, steps: int, seed: int = 0):
    """This worker's batches: (inputs, targets) of shape (BATCH, SEQ). Each worker draws from
    its own generator (the threads share torch's global one)."""
    g = torch.Generator().manual_seed(seed * world_size + rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def worker(ctx, steps=60):                         # runs on every worker
    model = TinyLM()                               # your model: model(x, y) is the loss
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    algo = loco.StreamingDiLoCo(model, opt, ctx.comm, sync_every=20, fragments=4,
                                overlap=1, alpha=0.5, codec="fp4_e3m0")
    for x, y in my_batches(rank=ctx.rank, world_size=ctx.world_size, steps=steps):
        loss = model(x, y)
        loss.backward()
        algo.step()                                # was: opt.step()
        algo.zero_grad()                           # was: opt.zero_grad()
    algo.flush()                                   # apply the sync still in flight, if any
    return algo.global_parameters()                # name -> tensor: the model to evaluate


def main(steps: int = 60, workers: int = 4) -> float:
    """Train, then evaluate the global model on held-out batches; returns its loss."""
    results = loco.launch(worker, workers, launcher="threads", kwargs={"steps": steps})
    model = TinyLM()
    model.load_state_dict(results[0])              # the same on every worker
    with torch.no_grad():
        loss = sum(model(x, y).item() for x, y in my_batches(0, 1, steps=4, seed=1000)) / 4
    print(f"eval loss of the global model {loss:.3f} (uniform guess: {math.log(VOCAB):.3f})")
    return loss


if __name__ == "__main__":
    main()
