"""No inner step reads the device on the host (on a GPU such a read makes the CPU wait for
every queued kernel, and the GPU idles): every method, with AdamW and with Muon inside, with
workers of one rank, and with workers of two ranks (DDP-style and FSDP2 inside) every pair
of method, optimizer and parallel (``TWO_RANK_CASES``, one launch), built as ``loco train``
builds it (``Method.from_config``), on the GPU's code path (``LOCO_HOST_READS=count`` takes it
on the CPU too) and counted by ``loco.comm.hostreads.HostReadCounter`` around every step:
forward, backward, the algorithm's step. Reads are allowed only at a sync (``allowed("sync")``),
and there at most ``SYNC_READS``. Also: the counter itself, and ``loco train``'s summary
fields."""

from __future__ import annotations

import json

import pytest
import torch
from workers import batch, make_model

import loco
from loco.comm import hostreads

METHODS = ("diloco", "streaming", "sparseloco", "noloco", "demo", "sparta", "sparta_diloco",
           "ddp", "local")
SEVERAL_RANKS = ("diloco", "streaming", "sparseloco", "noloco", "ddp", "local")
"""The methods that take workers of several ranks (DeMo and SPARTA refuse them)."""
H, STEPS = 2, 4
"""Each case's schedule: every kind of step once, in order: an inner step before any sync
(1), the first sync (2), an inner step after a sync (3), a sync on the steady path, with the
outer state in place (4)."""
SCHEDULE = {"streaming": (4, 7)}
"""(H, steps) where the default does not fit: Streaming DiLoCo's two fragments with tau = 1
need H = 4 (tau < H / P): fragment 0 sent at steps 2 and 6 and landed at 3 and 7, fragment 1
sent at 4 and landed at 5."""
SYNC_READS = 5
"""The most reads one sync step may make: the skips counted on the device since the last
(one read of both counts), and whether the averaged pseudo-gradient is finite (one read;
with several ranks per worker one more, their verdicts combined); NoLoCo checks its two
averages (pseudo-gradients and slow weights): 1 + 2 x 2. Measured: 2 (DiLoCo, Streaming
DiLoCo at each fragment's landing, SparseLoCo, SPARTA + DiLoCo), 3 (NoLoCo), one more per
check with two ranks per worker; 0 for DeMo, SPARTA, DataParallel and Local."""


def cases(names, parallel="ddp"):
    """Every (method, inner optimizer, parallel) of ``names`` with both optimizers."""
    return [(name, opt, parallel) for name in names for opt in ("adamw", "muon")
            if not (name == "demo" and opt == "muon")]  # DeMo is its own optimizer


TWO_RANK_CASES = [(name, opt, parallel) for name in SEVERAL_RANKS
                  for opt, parallel in ((("muon", "fsdp"), ("adamw", "ddp")) if name == "noloco"
                                        else (("muon", "ddp"), ("adamw", "fsdp")))]
"""Workers of two ranks: a covering design of the pairs, not the whole grid (one launch
serves both): every method under DDP-style averaging and under FSDP2, every method with
AdamW and with Muon, and both optimizers under each (Muon under FSDP2 with NoLoCo, whose
sync checks the most, and AdamW under DDP-style averaging with NoLoCo; the other methods
Muon under DDP-style averaging and AdamW under FSDP2). Muon under FSDP2 runs Newton-Schulz
on sharded matrices, a collective per matrix product: 0.7 to 1.3 s of CPU a rank per
case, where the others take 0.1 to 0.4 s."""


def count_worker(ctx, cases):
    """Every (method, inner optimizer, parallel) of ``cases`` in turn, on its schedule
    (``SCHEDULE``, else ``H`` and ``STEPS``), the host reads of every step by reason."""
    from loco.config import TrainConfig, resolve
    from loco.runtime.fsdp import shard_worker
    from loco.training.build import make_optimizer

    out = {}
    for name, opt, parallel in cases:
        h, n = SCHEDULE.get(name, (H, STEPS))
        cfg = resolve(TrainConfig(algorithm=name, inner_optimizer=opt, model="tiny",
                                  workers=ctx.workers, worker_ranks=ctx.worker_ranks,
                                  worker_parallel=parallel, sync_every=h, steps=n))
        model = make_model()
        if parallel == "fsdp":
            shard_worker(model, ctx)
        algo = cfg.method_class.from_config(cfg, model, make_optimizer(model, cfg), ctx.comm, None,
                                      ctx.inner)
        steps = []
        with hostreads.HostReadCounter() as counter:
            for t in range(n):
                x, y = batch(ctx.worker * ctx.worker_ranks + ctx.worker_rank, t)
                model(x, y).backward()
                algo.step()
                algo.zero_grad()
                steps.append(dict(counter.take()))
        algo.flush()
        out[name, opt, parallel] = steps
    return out


def check(results, parallel="ddp"):
    """No read outside a sync, at most SYNC_READS at one, on every rank, in every case run
    with ``parallel``."""
    ran = 0
    for rank in results:
        for (name, opt, how), steps in rank.items():
            if how != parallel:
                continue
            ran += 1
            outside = [t + 1 for t, reads in enumerate(steps) if reads.get("step")]
            assert not outside, f"{name} with {opt}: host reads at steps {outside}"
            assert max(r.get("sync", 0) for r in steps) <= SYNC_READS, (name, opt, steps)
            assert set().union(*steps) <= {"sync", "host"}, (name, opt, steps)
    assert ran, parallel


def test_no_inner_step_reads_the_device_with_workers_of_one_rank(monkeypatch):
    monkeypatch.setenv(hostreads.MODE_ENV, "count")
    check(loco.launch(count_worker, 2, args=(cases(METHODS),)))


@pytest.fixture(scope="module")
def two_rank_reads():
    """The reads of TWO_RANK_CASES: two workers of two ranks each, as processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(hostreads.MODE_ENV, "count")
        return loco.launch(count_worker, launcher="processes", mesh=loco.Mesh(2, 1, 2),
                           args=(TWO_RANK_CASES,))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_no_inner_step_reads_the_device_with_workers_of_two_ranks(parallel, two_rank_reads):
    check(two_rank_reads, parallel)
    assert len(two_rank_reads) == 4


def test_the_counter_sees_each_kind_of_read_and_files_it_by_region():
    x = torch.randn(64)
    with hostreads.HostReadCounter() as counter:
        bool(x.sum() > 0)
        x[x > 0]
        torch.unique(x)
        x.nonzero()
        x.repeat_interleave(torch.ones(64, dtype=torch.int64))
        x[torch.arange(3)]  # integer indices: no read
        x.add_(1).mul_(2)
        with hostreads.allowed("sync"):
            x.sum().item()
            with hostreads.allowed("log"):
                float(x.max())
    assert counter.counts == {"step": 5, "sync": 1, "log": 1}


def test_the_device_path_is_taken_on_the_cpu_only_when_counting(monkeypatch):
    monkeypatch.delenv(hostreads.MODE_ENV, raising=False)
    assert not hostreads.device_path("cpu") and hostreads.device_path("cuda")
    monkeypatch.setenv(hostreads.MODE_ENV, "count")
    assert hostreads.device_path("cpu")
    monkeypatch.setenv(hostreads.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="LOCO_HOST_READS must be one of count, warn, error"):
        hostreads.mode()


def test_the_guard_relaxes_cuda_sync_debug_mode_inside_allowed_regions(monkeypatch):
    """``Guard``: CUDA's sync-debug mode "error" outside the allowed regions, 0 inside and
    after (a stand-in records what ``torch.cuda.set_sync_debug_mode`` is given)."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with hostreads.Guard("error"):
        assert modes[-1] == "error"
        with hostreads.allowed("sync"):
            assert modes[-1] == 0
        assert modes[-1] == "error"
    assert modes[-1] == 0
    with hostreads.allowed("sync"):  # no guard: nothing to relax
        pass
    assert modes == ["error", 0, "error", 0]


def test_loco_train_records_the_reads_per_step_and_per_sync(corpus, tmp_path, monkeypatch):
    from test_cli import small_run

    from loco.cli import main

    monkeypatch.setenv(hostreads.MODE_ENV, "count")
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--algorithm", "diloco", "--steps", "8")) == 0
    summary = json.loads((out / "summary.json").read_text())
    for rank in summary["per_worker"]:
        assert rank["host_reads_per_step"] == 0 and 0 < rank["host_reads_per_sync"] <= 2
