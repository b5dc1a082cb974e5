"""The outer step on a helper thread (``outer_thread=True``, loco.algorithms.outer_thread):
bit for bit the inline step, with and without offload, momentum, codecs, ranks per worker,
checkpoints taken while a sync is in flight; no buffer allocated per sync; and really on
the helper thread.

Equality, not closeness: the helper calls the same fused SGD on the same values as the
optimizer's own ``step()``, only on a shadow of the global copy that is swapped in later."""

import threading
from types import SimpleNamespace

import pytest
import torch

import loco
from loco.algorithms import outer_thread
from workers import (batch, make_model, make_optimizer, max_diff, once, resume_worker,
                     sharded_worker, slow_reduce, streaming_worker)

pytestmark = pytest.mark.numerics

H = 12


@pytest.fixture
def stepping_threads(monkeypatch) -> set[str]:
    """The names of the threads that ran the helper's SGD."""
    names: set[str] = set()
    real = outer_thread.sgd

    def spy(*args, **kwargs):
        names.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(outer_thread, "sgd", spy)
    return names


def schedule(out) -> list[tuple]:
    return [(s["step"], s["applied_step"], s["fragment"]) for s in out["syncs"]]


#: A covering design of the three options instead of their 12 combinations: every pair of
#: values of any two of them occurs (codec x layout: each layout with both codecs; layout x
#: offload: each layout with and without; codec x offload: all four).
COVERING = [("fp32", 2, 1, 0.9, False), ("fp4_e3m0", 2, 1, 0.9, True),
            ("fp32", 4, 2, 0.9, True), ("fp4_e3m0", 4, 2, 0.9, False),
            ("fp32", 3, 1, 0.0, True), ("fp4_e3m0", 3, 1, 0.0, False)]


@pytest.mark.parametrize("codec,fragments,overlap,momentum,offload", COVERING)
def test_matches_the_inline_outer_step(codec, fragments, overlap, momentum, offload,
                                       stepping_threads):
    steps = 2 * H + 7  # two rounds and a partial one that ends with a sync in flight
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, codec=codec,
              outer_momentum=momentum, offload=offload)
    inline = loco.launch(streaming_worker, 2, args=(steps,), kwargs={**kw, "outer_thread": False})
    assert not stepping_threads
    storages: dict[int, set[int]] = {}

    def watch(algo):  # which memory each global copy lives in, step by step
        for f in algo.fragment_list:
            storages.setdefault(algo.comm.rank, set()).add(f.global_flat.data_ptr())

    helper = loco.launch(streaming_worker, 2, args=(steps,),
                         kwargs={**kw, "outer_thread": True, "step_hook": watch})
    assert stepping_threads == {"loco-outer-step"}
    for a, b in zip(inline, helper):
        assert max_diff(a["params"], b["params"]) == 0
        assert schedule(a) == schedule(b) and len(schedule(a)) >= 2 * fragments
    # Double-buffered: the P global copies and one spare per distinct fragment size rotate;
    # nothing is allocated per sync.
    sizes = {s["elements"] for s in helper[0]["stats"]}
    for seen in storages.values():
        assert fragments < len(seen) <= fragments + len(sizes)


SPLITS = (13, 16, 18)  # mid-round, a sync in flight, just applied


@pytest.mark.parametrize("split", SPLITS)
def test_checkpoint_with_a_sync_in_flight_resumes_bit_identically(split):
    """state_dict waits for the helper, which never writes the committed outer state: the
    checkpoint is the one the inline step writes, and the resumed run ends alike. One
    straight run per mode checkpoints at every split (launched once for the three cases),
    each checkpoint resumed on its own."""
    kw = dict(fragments=4, overlap=2, alpha=0.5, layers=4)
    inline, helper = (once(loco.launch, resume_worker, 2, args=(2 * H, SPLITS, H, "streaming"),
                           kwargs={**kw, "outer_thread": thread}) for thread in (False, True))
    for (straight, resumed), (plain, _) in zip(helper, inline):
        assert max_diff(straight, resumed[SPLITS.index(split)]) == 0
        assert max_diff(straight, plain) == 0


def test_ranks_per_worker_agree_on_the_helper_s_verdict():
    """With R = 2 ranks per worker each rank's helper steps its own 1/R; the ranks combine
    their verdicts on the training thread, as without the helper."""
    kw = dict(sync_every=4, fragments=2, overlap=1, alpha=0.5, codec="fp32", layers=4)
    inline = loco.launch(sharded_worker, 4, worker_ranks=2, args=(9, "streaming"),
                         kwargs={**kw, "outer_thread": False})
    helper = loco.launch(sharded_worker, 4, worker_ranks=2, args=(9, "streaming"),
                         kwargs={**kw, "outer_thread": True})
    for a, b in zip(inline, helper):
        assert max_diff(a["params"], b["params"]) == 0


def test_waiting_for_the_helper_counts_as_the_sync_s_wait():
    """With a reduction made slow on purpose the training thread waits for the helper
    (which waits for the all-reduce) at t + τ: that time is the sync's ``seconds_waited``,
    as without the helper. The delay is long against the one inner step of the tiny model
    between the send and the wait (milliseconds, tenths of a second on a busy machine), so
    that most of it is waited whatever the CPU's load."""
    delay = 1.0

    def worker(ctx):
        slow_reduce(ctx.comm, delay)
        model = make_model(layers=4)
        algo = loco.StreamingDiLoCo(model, make_optimizer(model), ctx.comm, sync_every=4,
                                    fragments=2, overlap=1, codec="fp32", outer_thread=True)
        for t in range(1, 6):
            x, y = batch(ctx.rank, t)
            model(x, y).backward()
            algo.step()
            algo.zero_grad()
        return [s["seconds_waited"] for s in algo.sync_log], ctx.comm.totals().waited

    for waited, total in loco.launch(worker, 2):
        assert len(waited) == 2 and min(waited) > delay / 2
        assert total >= sum(waited)


def test_default_is_off_on_the_cpu_and_bad_values_are_refused():
    model = make_model(layers=4)
    comm = loco.Comm(None, 0, 1)
    try:
        for offload in (False, True):  # parameters on the CPU: the helper would only compete
            algo = loco.StreamingDiLoCo(model, make_optimizer(model), comm, sync_every=H,
                                        fragments=2, offload=offload)
            assert algo._outer is None
        with pytest.raises(ValueError, match="outer_thread must be None, True or False"):
            loco.StreamingDiLoCo(model, make_optimizer(model), comm, sync_every=H,
                                 outer_thread="yes")
    finally:
        comm.close()
    elastic = SimpleNamespace(elastic=True, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="outer_thread=True needs a fixed group"):
        loco.StreamingDiLoCo(model, make_optimizer(model), elastic, sync_every=H,
                             outer_thread=True)
