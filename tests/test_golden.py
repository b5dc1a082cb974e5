"""Golden histories: every parameter, after every inner step, of a tiny Streaming DiLoCo run
whose arithmetic is exact, stored as readable JSON. They guard against silent numeric drift
anywhere in the algorithm's path (fragments, schedule, codec, reduction, outer step, merge)
and hold bit for bit on every CPU.

Why bit for bit on every CPU. Results differ between instruction sets (generic, AVX2,
AVX-512, NEON) for two reasons only: a reduction sums in another order, or a multiply-add is
fused into one rounding (FMA) in one build and rounded twice in another. So the run avoids
both:

* the model's forward and backward are exact: parameters and data lie on a power-of-two grid,
  and the loss ``sum(c * |w - t|)`` has the gradient ``c * sign(w - t)``, exact with no
  reduction over the data;
* every multiplier of a fused multiply-add is a power of two (inner lr 1/16, inner momentum
  1/2, outer lr 1/2, outer Nesterov momentum 1/2, merge weights 1/2), so its product is exact
  and FMA and separate rounding agree. Sums may round: one IEEE addition is the same
  everywhere;
* the reduction sums the workers' contributions in rank order, the same on every build, and
  divides by M = 2, exactly; the codecs round by comparisons, frexp and exact scaling.

So any difference from the fixture is a change of what the algorithm computes, never of the
CPU: the comparison is exact, with no tolerance. The real model and AdamW are covered by the
reference tests (``test_streaming.py``), which run both sides on the same CPU.

Regenerate after an intended change of the numbers with:

    LOCO_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import loco

pytestmark = pytest.mark.numerics

FIXTURE = Path(__file__).parent / "fixtures" / "streaming_golden.json"
REGENERATE = os.environ.get("LOCO_REGENERATE_GOLDEN") == "1"
H, STEPS, WORKERS = 12, 24, 2
BLOCKS, WIDTH = 4, 6
SETTINGS = {  # name: (P, τ, α, codec)
    "diloco": (1, 0, 0.0, "fp32"),
    "P2-tau1-alpha0.5": (2, 1, 0.5, "fp32"),
    "P4-tau2-alpha0": (4, 2, 0.0, "fp32"),
    "P4-tau1-alpha0.5-bf16": (4, 1, 0.5, "bf16"),
    "P2-tau1-alpha0.5-fp4": (2, 1, 0.5, "fp4_e3m0"),
}


def grid(rng: random.Random, n: int, scale: int) -> torch.Tensor:
    """n values k / scale, k a whole number in [-scale, scale]: exact in fp32."""
    return torch.tensor([rng.randint(-scale, scale) / scale for _ in range(n)])


class GridBlock(nn.Module):
    def __init__(self, rng: random.Random):
        super().__init__()
        self.weight = nn.Parameter(grid(rng, WIDTH, 64))
        self.bias = nn.Parameter(grid(rng, 2, 64))


class GridModel(nn.Module):
    """Blocks to split into fragments, and an embedding outside them, as a transformer has;
    ``loss(worker, step)`` is ``sum(c * |w - t|)`` with c and t drawn for (worker, step)."""

    def __init__(self):
        super().__init__()
        rng = random.Random(0)
        self.embed = nn.Parameter(grid(rng, 8, 64))
        self.blocks = nn.ModuleList(GridBlock(rng) for _ in range(BLOCKS))

    def draws(self, worker: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(c, t) for every parameter: c in eighths, t in sixteenths of [-1, 1]."""
        rng = random.Random(1000 * worker + step)
        return [(grid(rng, p.numel(), 8), grid(rng, p.numel(), 16)) for p in self.parameters()]

    def loss(self, worker: int, step: int) -> torch.Tensor:
        return sum((c * (p - t).abs()).sum()
                   for p, (c, t) in zip(self.parameters(), self.draws(worker, step)))


def history_worker(ctx, fragments, overlap, alpha, codec):
    """After every inner step: per fragment, the global copy, and this worker's parameters."""
    model = GridModel()
    opt = torch.optim.SGD(model.parameters(), lr=1 / 16, momentum=0.5)
    algo = loco.StreamingDiLoCo(model, opt, ctx.comm, sync_every=H, fragments=fragments,
                                overlap=overlap, alpha=alpha, codec=codec, outer_lr=0.5,
                                outer_momentum=0.5, nesterov=True)
    rows = []
    for step in range(STEPS):
        model.loss(ctx.rank, step).backward()
        algo.step()
        algo.zero_grad()
        rows.append({"step": algo.inner_steps,
                     "global": [f.global_flat.tolist() for f in algo.fragment_list],
                     "local": torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                                        ).tolist()})
    algo.flush()
    return rows


def run(setting):
    return loco.launch(history_worker, WORKERS, args=SETTINGS[setting])[0]


def test_regenerate_or_fixture_is_complete():
    if REGENERATE:
        settings = [f' "{name}": [\n' + ",\n".join("  " + json.dumps(row) for row in run(name))
                    + "\n ]" for name in SETTINGS]  # one step per line, easy to diff
        FIXTURE.write_text("{\n" + ",\n".join(settings) + "\n}\n")
    stored = json.loads(FIXTURE.read_text())
    assert sorted(stored) == sorted(SETTINGS), "regenerate: LOCO_REGENERATE_GOLDEN=1"
    assert all(len(rows) == STEPS for rows in stored.values())


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_history_matches_golden_bit_for_bit(setting):
    expected = json.loads(FIXTURE.read_text())[setting]
    got = run(setting)
    for want, have in zip(expected, got, strict=True):
        assert have == want, f"{setting}: first difference after inner step {want['step']}"
    # the histories really move: the global copy changes at the syncs
    assert got[0]["global"] != got[-1]["global"]


def test_the_grid_run_is_exact():
    """The premise of bit-for-bit fixtures: the model's gradient is exactly c * sign(w - t),
    and an inner step moves a parameter by a multiple of 1/128 (lr 1/16 times gradients in
    eighths), with nothing rounded away."""
    model = GridModel()
    model.loss(1, 3).backward()
    for p, (c, t) in zip(model.parameters(), model.draws(1, 3)):
        assert torch.equal(p.grad, c * torch.sign(p.detach() - t))
        assert torch.equal(p.grad * 8, (p.grad * 8).round())


def test_settings_are_told_apart():
    """Each setting leaves its own trace: the fixtures would catch a codec, τ or α that
    silently did nothing."""
    stored = json.loads(FIXTURE.read_text())
    finals = {name: json.dumps(rows[-1]["local"]) for name, rows in stored.items()}
    assert len(set(finals.values())) == len(finals)
    fp32, fp4 = stored["P2-tau1-alpha0.5"], stored["P2-tau1-alpha0.5-fp4"]
    assert fp32[H - 1] != fp4[H - 1]  # the first fragment's sync, rounded to E3M0
