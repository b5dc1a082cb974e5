"""Streaming DiLoCo against a plain single-process reference of the paper's algorithm, on real
gloo process groups: fragments, the staggered schedule, overlap, mixing, codecs, bytes.

The reference is written by hand but with the same tensor operations, in the same order, as
the library: the workers' pseudo-gradients summed in rank order, then divided by M; the
outer Nesterov step as torch's SGD computes it (mul_, add_, add with alpha, so the same
fused multiply-adds); the merge by lerp. On any one CPU the two therefore agree bit for bit,
whatever its instruction set: the tests assert equality, not closeness. The Comm's unencoded
mean (``fp32``) is the group's own all-reduce, which groups a sum of M >= 3 otherwise than
rank order (two workers: one addition, the same bits); the comparisons with M >= 3 workers
ask it for the rank-order sum (``rank_order``, the ``rank_order`` fixture), see
docs/bytes.md."""

import math
import time
from collections import deque

import pytest
import torch

import loco
from loco.algorithms.fragments import split_fragments
from workers import (FRAGMENTS, SEND_OFFSETS, batch, diloco_worker, fragment_names, make_model,
                     make_optimizer, max_diff, once, params_of, planned_worker,
                     reference_streaming, resume_worker, slow_reduce, streaming_worker)

pytestmark = pytest.mark.numerics

H = 12  # divisible by every P in the grid, and H/P = 3 > every τ


@pytest.fixture
def rank_order(monkeypatch):
    """Every Comm sums the unencoded mean in rank order, as the references do (only M >= 3
    differs: the group's all-reduce groups the sum otherwise, a few ulps of the mean that
    the inner AdamW steps carry on to ~10 ulps of the parameters)."""
    from loco.comm.comm import Comm

    monkeypatch.setattr(Comm, "rank_order", True)


# Every (P, τ) pair once, with α and M chosen so that every pair of values of any two of the
# four options occurs (a covering design: 9 runs in place of the full grid's 36, each of which
# is a few seconds of real process groups); the hardest case (P = 4, τ = 2, α = 0.5, M = 4)
# is one of them. The pairs besides (P, τ): (P, α) 1-0 1-.5 2-0 2-.5 4-0 4-.5; (P, M) 1-2 1-4
# 2-2 2-4 4-2 4-4; (τ, α) 0-0 0-.5 1-0 1-.5 2-0 2-.5; (τ, M) 0-2 0-4 1-2 1-4 2-2 2-4; (α, M)
# 0-2 0-4 .5-2 .5-4. Its runs with α = 0.5 at (P, τ, M) = (1, 0, 2), (2, 1, 2), (4, 2, 4) are
# the fp32 references test_quantized_matches_reference_with_same_codec compares with, and at
# (2, 1, 2), (2, 0, 4) those of test_a_different_tau_per_worker_matches_the_reference
# (computed once: the three tests run the same steps).
STEPS = 2 * H  # two full rounds; with τ > 0 the last sync (sent at the last step) is in
# flight at the end, applied by flush()


@pytest.mark.parametrize("fragments,overlap,alpha,workers", [
    (1, 0, 0.5, 2), (1, 1, 0.0, 4), (1, 2, 0.5, 2), (2, 0, 0.5, 4), (2, 1, 0.5, 2),
    (2, 2, 0.0, 2), (4, 0, 0.0, 2), (4, 1, 0.5, 2), (4, 2, 0.5, 4)])
@pytest.mark.usefixtures("rank_order")
def test_matches_reference_fp32(fragments, overlap, alpha, workers):
    steps = STEPS
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, alpha=alpha, codec="fp32")
    out = loco.launch(streaming_worker, workers, args=(steps,), kwargs=kw)
    ref = once(reference_streaming, workers, steps, H, fragments, overlap, alpha)
    for r in out:
        assert max_diff(r["params"], ref) == 0
    assert all(max_diff(r["params"], out[0]["params"]) == 0 for r in out)


@pytest.mark.parametrize("sync_every,fragments,overlap", [
    (10, 4, 1),   # sends at steps 2, 5, 7, 10 of each round: gaps 2, 3, 2, 3
    (10, 3, 2),   # steps 3, 6, 10: gaps 3, 3, 4
    (7, 2, 2),    # steps 3, 7
])
def test_fragments_that_do_not_divide_h_match_the_reference(sync_every, fragments, overlap):
    """The paper's 3-layer fragments need P that does not divide H (a 24-layer model has
    P = 8 with H = 100 or 30): fragment p goes at floor((p + 1) H / P) of each round (the
    steps by hand: ``SEND_OFFSETS``, as the comments above)."""
    from loco.algorithms.streaming_diloco import send_offsets

    steps = 2 * sync_every + 3
    kw = dict(sync_every=sync_every, fragments=fragments, overlap=overlap, alpha=0.5,
              codec="fp32")
    out = loco.launch(streaming_worker, 2, args=(steps,), kwargs=kw)
    ref = reference_streaming(2, steps, sync_every, fragments, overlap, 0.5)
    for r in out:
        assert max_diff(r["params"], ref) == 0
    sent = [s["step"] % sync_every for s in out[0]["syncs"]]
    assert sent[:fragments] == SEND_OFFSETS[sync_every, fragments]
    assert len(set(sent[:fragments])) == fragments
    assert send_offsets(100, 8) == [12, 25, 37, 50, 62, 75, 87, 0]


@pytest.mark.parametrize("overlaps", [[1, 3], [0, 3, 1, 5]])
@pytest.mark.usefixtures("rank_order")
def test_a_different_tau_per_worker_matches_the_reference(overlaps):
    """The paper's robustness experiment: each worker applies the sync tau_m steps after it
    was sent; the global copies stay identical on every worker."""
    steps = STEPS
    kw = dict(sync_every=H, fragments=2, overlap=overlaps, alpha=0.5, codec="fp32")
    out = loco.launch(streaming_worker, len(overlaps), args=(steps,), kwargs=kw)
    ref = reference_streaming(len(overlaps), steps, H, 2, overlaps, 0.5)
    for r in out:
        assert max_diff(r["params"], ref) == 0
    same = once(reference_streaming, len(overlaps), steps, H, 2, overlaps[0], 0.5)
    # the per-worker taus really changed the run: measured 0.012 and 0.0087, ulps ~1e-7
    assert max_diff(ref, same) > 1e-3


def quantized_run(codec, fragments, overlap, workers):
    """The run of ``STEPS`` steps, α = 0.5, of a codec and layout, launched once for the
    tests that read it (test_quantized_matches_reference_with_same_codec and
    test_schedule_and_wire_bytes_of_every_sync)."""
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, alpha=0.5, codec=codec)
    return once(loco.launch, streaming_worker, workers, args=(STEPS,), kwargs=kw)


# The paper's codec in every layout; the others each in one (the codec and the layout meet
# only in which rows a worker encodes, which the FP4 cases already cover).
@pytest.mark.parametrize("codec,fragments,overlap,workers", [
    ("fp4_e3m0", 1, 0, 2), ("fp4_e3m0", 2, 1, 2), ("fp4_e3m0", 4, 2, 4),
    ("fp4_e2m1", 2, 1, 2), ("int8", 4, 2, 4)])
def test_quantized_matches_reference_with_same_codec(codec, fragments, overlap, workers):
    steps = STEPS
    out = quantized_run(codec, fragments, overlap, workers)
    ref = reference_streaming(workers, steps, H, fragments, overlap, 0.5, codec)
    fp32 = once(reference_streaming, workers, steps, H, fragments, overlap, 0.5)
    for r in out:
        assert max_diff(r["params"], ref) == 0
    assert max_diff(ref, fp32) > 1e-5  # the codec really changed the numbers


def test_diloco_is_streaming_with_one_fragment_no_overlap_fp32_alpha_zero():
    steps, args = 2 * H, (0.7, 0.9)
    dil = loco.launch(diloco_worker, 2, args=(steps, H, *args))
    kw = dict(sync_every=H, fragments=1, overlap=0, alpha=0.0, codec="fp32", outer_lr=0.7,
              outer_momentum=0.9, layers=2)
    stream = loco.launch(streaming_worker, 2, args=(steps,), kwargs=kw)
    assert max_diff(dil[0]["params"], stream[0]["params"]) == 0
    assert dil[0]["sent"] == stream[0]["sent"]


@pytest.mark.parametrize("fragments,overlap,M", [(1, 0, 2), (2, 1, 2), (4, 2, 4), (3, 0, 3)])
def test_schedule_and_wire_bytes_of_every_sync(fragments, overlap, M):
    """Fragment p is sent when t % H == ((p+1)·H/P) % H, applied τ steps later, and each
    sync moves exactly 2(M-1)·(c/2 + c/32) bytes, c = ceil(n/M) rounded up to whole blocks.
    Two rounds: every fragment sent in each, the run's last sync at its last step. The FP4
    runs (α = 0.5) of test_quantized_matches_reference_with_same_codec, read again (M = 2, 2,
    4; c is rounded up in each); P = 3 on M = 3 workers, a run of its own."""
    steps = STEPS
    out = quantized_run("fp4_e3m0", fragments, overlap, M)
    syncs = out[0]["syncs"]
    offsets = SEND_OFFSETS[1 if fragments == 1 else H, fragments]  # by hand, not the formula
    expected = [(t, p) for t in range(1, steps + 1) for p in range(fragments)
                if t % H == offsets[p]]
    assert [(s["step"], s["fragment"]) for s in syncs] == expected
    # the last sync of the run is applied by flush() when τ > 0 would carry it past the end
    assert all(s["applied_step"] == min(s["step"] + overlap, steps) for s in syncs)
    model = make_model(layers=4)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for s in syncs:
        n = sum(sizes[name] for name in out[0]["fragments"][s["fragment"]])
        c = math.ceil(math.ceil(n / M) / 32) * 32
        assert s["raw_bytes"] == 4 * n
        assert s["wire_bytes"] == s["received_bytes"] == 2 * (M - 1) * (c // 2 + c // 32)
    stats = out[0]["stats"]
    assert sum(f["bytes_sent"] for f in stats) == out[0]["sent"]
    assert [f["syncs"] for f in stats] == [sum(1 for s in syncs if s["fragment"] == p)
                                           for p in range(fragments)]


def test_fp4_sends_7x_fewer_bytes_and_peak_falls_by_about_P():
    """Over one round (H steps): DiLoCo's one sync of the whole model against P = 4
    fragments' syncs, in fp32 and FP4."""
    M, steps, P = 2, H, 4
    diloco = dict(sync_every=H, fragments=1, overlap=0, alpha=0.0, codec="fp32")
    dil = loco.launch(streaming_worker, M, args=(steps,), kwargs=diloco)
    stream = loco.launch(streaming_worker, M, args=(steps,),
                         kwargs={**diloco, "fragments": P})
    fp4 = loco.launch(streaming_worker, M, args=(steps,), kwargs=dict(sync_every=H, fragments=P))
    # every parameter still travels once per H steps (to within the padding of P messages)
    assert abs(stream[0]["sent"] / dil[0]["sent"] - 1) < 0.01
    assert dil[0]["sent"] / fp4[0]["sent"] > 7
    # the test model's embedding is small, so its fragments are nearly equal
    assert 1 / P <= stream[0]["peak"] / dil[0]["peak"] < 1.3 / P


def test_overlap_is_real():
    """With a reduction made slow on purpose, the τ inner steps after a send compute while it
    is in flight, and the worker waits for it only at t + τ. The delay is long against two
    inner steps of the test model (milliseconds) so that a loaded CI machine still shows it.
    Two fragments in a round of 6 (sends 3 steps apart, each slow reduction waited for once:
    the run lasts about two delays)."""
    delay, tau, rounds = 1.0, 2, 6

    def worker(ctx):
        slow_reduce(ctx.comm, delay)
        model = make_model(layers=4)
        algo = loco.StreamingDiLoCo(model, make_optimizer(model), ctx.comm, sync_every=rounds,
                                    fragments=2, overlap=tau, codec="fp32")
        computed, ends = {}, {}
        for t in range(1, rounds + tau + 1):
            x, y = batch(ctx.rank, t)
            model(x, y).backward()
            computed[t] = time.perf_counter()  # forward and backward of step t are done
            algo.step()
            algo.zero_grad()
            ends[t] = time.perf_counter()
        issued = [r.issued_at for r in ctx.comm.records if r.tag == "train"]
        return algo.sync_log, issued, computed, ends

    for syncs, issued, computed, ends in loco.launch(worker, 2):
        assert [s["step"] for s in syncs] == [3, 6]
        for s, start in zip(syncs, issued):
            t, done = s["step"], start + s["seconds_in_flight"]
            assert s["applied_step"] == t + tau
            # the τ steps after the send computed while the reduction was in flight ...
            assert all(start < computed[t + k] < done for k in range(1, tau + 1))
            assert all(ends[t + k] < done for k in range(1, tau))
            # ... and the worker waited for the rest of it in step t + τ, not before
            assert ends[t + tau] >= done
            assert delay / 4 < s["seconds_waited"] <= ends[t + tau] - computed[t + tau]


def test_fragments_strided_sequential_and_outside_parameters():
    model = make_model(layers=4)
    names = [n for n, _ in model.named_parameters()]
    for pattern, owner in (("strided", lambda i: i % 2), ("sequential", lambda i: i // 2)):
        frags = split_fragments(model, 2, pattern)
        assert sorted(n for f in frags for n in f) == sorted(names)  # each exactly once
        for i in range(4):
            assert all(n in frags[owner(i)] for n in names if n.startswith(f"blocks.{i}."))
    # outside the blocks: the (tied) embedding goes to one fragment, the final norm to the
    # one that is then smaller
    frags = split_fragments(model, 2, "strided")
    assert "embed.weight" in frags[0] and "norm.weight" in frags[1]
    assert split_fragments(model, 1) == [names]


def test_explicit_fragments():
    model = make_model(layers=4)
    b = model.blocks
    frags = split_fragments(model, [[model.embed, b[0], b[1]], [b[2], b[3], model.norm]])
    assert "embed.weight" in frags[0] and "blocks.2.attn.qkv.weight" in frags[1]
    with pytest.raises(ValueError, match="in no fragment"):
        split_fragments(model, [[b[0], b[1]], [b[2], b[3]]])
    with pytest.raises(ValueError, match="exactly one"):
        split_fragments(model, [[model.embed, b[0], b[1]], [b[1], b[2], b[3], model.norm]])
    # parameter names mix with modules (how a pipeline stage pins its tied embedding)
    assert split_fragments(model, [[b[0], b[1], "norm.weight"], [b[2], b[3], "embed.weight"]]
                           )[1][0] == "embed.weight"
    with pytest.raises(ValueError, match="'head.weight' is not a trainable parameter"):
        split_fragments(model, [[model.embed, b[0], b[1]], [b[2], b[3], "head.weight"]])


def test_blocks_held_in_a_module_dict_are_found():
    """A pipeline stage holds its share of the blocks in an nn.ModuleDict."""
    from loco.runtime import split_stages

    last = split_stages(make_model(layers=4), 2)[1]
    frags = split_fragments(last, 2, "strided")
    assert all(n.startswith("blocks.2.") for n in frags[0] if n.startswith("blocks."))
    assert all(n.startswith("blocks.3.") for n in frags[1] if n.startswith("blocks."))


@pytest.mark.parametrize("kw,message", [
    (dict(fragments=5), r"at most the number of blocks, 4"),
    (dict(fragments=0), r"fragments \(P\) must be >= 1"),
    (dict(fragments=5, sync_every=10), r"at most the number of blocks"),
    (dict(fragments=4, sync_every=3), r"must be <= sync_every \(H=3\)"),
    (dict(fragments=3, sync_every=8, overlap=2), r"\[0, 2\), the smallest gap"),
    (dict(fragments=2, sync_every=8, overlap=4), r"\[0, 4\)"),
    (dict(overlap=-1), r"overlap"),
    (dict(alpha=1.5), r"alpha must be in \[0, 1\]"),
    (dict(codec="fp5"), r"fp4_e3m0"),
    (dict(codec="fp4_e3m0", codec_block=3), r"block"),
    (dict(fragments=2, pattern="random"), r"strided, sequential"),
    (dict(outer_lr=0), r"outer_lr"),
])
def test_bad_arguments_raise_clear_errors(kw, message):
    model = make_model(layers=4)
    comm = loco.Comm(None, 0, 1)
    try:
        with pytest.raises(ValueError, match=message):
            loco.StreamingDiLoCo(model, make_optimizer(model), comm, **{"sync_every": 12, **kw})
    finally:
        comm.close()


def outer_tensors(algo) -> list[torch.Tensor]:
    """Every fragment's global copy (flat and its views) and outer momentum."""
    return [t for f in algo.fragment_list
            for t in (f.global_flat, *f.global_params,
                      *(s["momentum_buffer"] for s in f.outer_optimizer.state.values()))]


def test_offload_keeps_outer_state_on_cpu_and_changes_nothing():
    """With offload the global copies and the outer momentum are CPU tensors in storage of
    their own (never the model's), not pinned (the model is on the CPU); and
    the run is bit for bit the one without offload. On a CPU-only machine the parameters are
    in CPU memory anyway, so the move itself is checked where CUDA is
    (``test_offload_moves_the_outer_state_off_the_gpu``) and the pinning request by
    ``test_offload_asks_for_pinned_memory_only_with_cuda``."""
    kw = dict(sync_every=H, fragments=2, overlap=1)
    plain = loco.launch(streaming_worker, 2, args=(H,), kwargs=kw)
    algos = {}
    off = loco.launch(streaming_worker, 2, args=(H,),
                      kwargs={**kw, "offload": True,
                              "step_hook": lambda a: algos.setdefault(a.comm.rank, a)})
    assert max_diff(plain[0]["params"], off[0]["params"]) == 0
    for algo in algos.values():
        model = {p.untyped_storage().data_ptr() for p in algo.model.parameters()}
        tensors = outer_tensors(algo)
        # per fragment: the flat copy, its views (one per parameter) and one flat momentum
        assert len(tensors) == len(algo.params) + 2 * len(algo.fragment_list)
        for t in tensors:
            assert t.device.type == "cpu" and t.untyped_storage().data_ptr() not in model
        for f in algo.fragment_list:
            assert not f.global_flat.is_pinned()


def test_offload_asks_for_pinned_memory_only_with_cuda(monkeypatch):
    """The global copy is pinned (for fast copies to and from the GPU) when the run trains on
    a GPU with offload, and only then: a CPU run pins nothing even where CUDA is there (it
    would open a CUDA context in every process). Pinning needs an accelerator, so it and
    CUDA's presence are faked here; a model on a GPU cannot be, so ``_pinned`` is asked
    directly for that case."""
    from loco.algorithms.buffers import pinned as _pinned

    pinned = []

    def pin_memory(self):
        pinned.append(self.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    for cuda, offload in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        pinned.clear()
        model = make_model(layers=4)
        comm = loco.Comm(None, 0, 1)
        try:
            algo = loco.StreamingDiLoCo(model, make_optimizer(model), comm, sync_every=H,
                                        fragments=2, offload=offload)
        finally:
            comm.close()
        assert not pinned and not any(f.global_flat.is_pinned() for f in algo.fragment_list)
    t = torch.zeros(3)
    assert _pinned(t, torch.device("cpu")) is t and not pinned
    assert _pinned(t, torch.device("cuda", 0)) is pinned[-1]  # a model on a GPU: pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to offload from")
def test_offload_moves_the_outer_state_off_the_gpu():
    """A model on the GPU: with offload its global copy and outer momentum live in pinned
    CPU memory, the pseudo-gradient on the GPU; the result is the one without offload."""
    def run(offload):
        torch.manual_seed(0)
        model = make_model(layers=4).cuda()
        comm = loco.Comm(None, 0, 1, device="cuda")
        try:
            algo = loco.StreamingDiLoCo(model, make_optimizer(model), comm, sync_every=4,
                                        fragments=2, overlap=1, offload=offload)
            for t in range(8):
                x, y = batch(0, t)
                model(x.cuda(), y.cuda()).backward()
                algo.step()
                algo.zero_grad()
            algo.flush()
        finally:
            comm.close()
        return algo

    off, plain = run(True), run(False)
    for t in outer_tensors(off):
        assert t.device.type == "cpu"
    for t in outer_tensors(plain):
        assert t.device.type == "cuda"
    assert off._outer is not None and plain._outer is None  # the helper thread: offload only
    for f in off.fragment_list:
        assert f.global_flat.is_pinned() and f.delta.device.type == "cuda"
        assert f.grad.is_pinned()  # where the averaged pseudo-gradient lands, one copy
    assert all(g.device.type == "cuda" for g in off.global_parameters().values())
    assert max_diff(params_of(off.global_parameters()), params_of(plain.global_parameters())) == 0


SPLITS = {False: (13, 16, 18), True: (16, 18)}  # mid-round, a sync in flight, just applied


@pytest.mark.parametrize("split,eager", [(s, e) for e in SPLITS for s in SPLITS[e]])
def test_state_dict_resumes_bit_identically(split, eager):
    """The straight run checkpoints at every split of ``SPLITS`` (one run, launched once for
    the cases of ``eager``), each checkpoint resumed on its own."""
    kw = dict(fragments=4, overlap=2, alpha=0.5, layers=4, eager=eager)
    out = once(loco.launch, resume_worker, 2, args=(2 * H, SPLITS[eager], H, "streaming"),
               kwargs=kw)
    for straight, resumed in out:
        assert max_diff(straight, resumed[SPLITS[eager].index(split)]) == 0


@pytest.mark.parametrize("method", ["streaming", "noloco"])
def test_a_codec_that_cannot_run_on_the_device_fails_at_construction(method, monkeypatch):
    """The device probe of ``get_codec``: an algorithm whose codec cannot run on ``comm``'s
    device stops when it is built, with a RuntimeError naming the codec, the device and the
    cause, before any communication; it never falls back to another format."""
    from loco.comm.codecs import catalog, fp4

    class NoKernel(fp4.Fp4Codec):  # as a device without the kernel the format needs
        def encode_rows(self, x):
            raise NotImplementedError(f"no 4-bit kernel for {x.device.type}")

    make = catalog._make
    monkeypatch.setattr(catalog, "_make", lambda name, block: NoKernel(
        name, block, fp4.E3M0_GRID) if name == "fp4_e3m0" else make(name, block))
    cls = {"streaming": loco.StreamingDiLoCo, "noloco": loco.NoLoCo}[method]
    model = make_model(layers=4)
    comm = loco.Comm(None, 0, 2)  # no group: any communication would fail
    try:
        with pytest.raises(RuntimeError, match="codec fp4_e3m0 cannot run on cpu: no 4-bit "
                                               "kernel for cpu"):
            cls(model, make_optimizer(model), comm, sync_every=12, codec="fp4_e3m0")
        assert comm.records == deque() and comm.issued_bytes("setup") == 0
    finally:
        comm.close()
    if method == "streaming":  # the other 4-bit format runs here: built as usual
        comm = loco.Comm(None, 0, 1)
        try:
            assert cls(model, make_optimizer(model), comm, sync_every=12, codec="fp4_e2m1")
        finally:
            comm.close()


def test_the_simulator_and_training_send_fragments_at_the_same_steps():
    """The utilization simulator models training's schedule, also for P not dividing H:
    both against the steps by hand, not against each other."""
    from loco.algorithms.streaming_diloco import send_offsets
    from loco.simulate.utilization import send_offsets as simulated

    for (h, p), offsets in SEND_OFFSETS.items():  # P not dividing H, P = H, P = 1, ...
        assert simulated(h, p) == send_offsets(h, p) == offsets, (h, p)


def test_the_reference_fragments_are_the_libraries():
    """The reference's literal fragments (``workers.FRAGMENTS``) are split_fragments' on the
    test model: the tables are checked here once, and the references use them as written."""
    for layers, fragments, pattern in FRAGMENTS:
        model = make_model(layers=layers)
        assert split_fragments(model, fragments, pattern) == fragment_names(
            model, layers, fragments, pattern)


def test_eager_diloco_overlaps_the_round_and_refuses_what_it_cannot_do():
    """DiLoCo with eager updates waits for an average at the step before the next sync
    (τ = H − 1, α = 0); eager updates refuse an outer thread, and an elastic run."""
    from loco.config import ConfigError, build_config
    from loco.config.train_config import validate

    def fn(ctx):
        model = make_model()
        algo = loco.DiLoCo(model, make_optimizer(model), ctx.comm, sync_every=10, eager=True)
        with pytest.raises(ValueError, match="eager updates need a fixed group"):
            loco.StreamingDiLoCo(model, make_optimizer(model), ctx.comm, eager=True,
                                 outer_thread=True)
        return algo.overlap, algo.alpha, algo.eager is not None
    assert loco.launch(fn, 1)[0] == (9, 0.0, True)
    cfg = build_config(overrides={"algorithm": "diloco", "eager": True, "elastic": True,
                                  "launcher": "processes"})
    with pytest.raises(ConfigError, match="^--eager: needs a fixed group"):
        validate(cfg)


@pytest.mark.parametrize("fragments,overlap,alpha,codec", [
    (1, 0, 0.0, "fp32"), (2, 1, 0.5, "fp32"), (4, 2, 0.5, "fp4_e3m0")])
@pytest.mark.usefixtures("rank_order")
def test_speed_aware_local_steps_match_their_reference(fragments, overlap, alpha, codec):
    """Speed-aware local steps (Async Local-SGD's dynamic local updates) with a fixed plan
    of steps per round per worker: the workers train on their ticks only, and each
    pseudo-gradient is weighed by the steps behind it, bit for bit the reference's; the
    weights change the run. The reference takes the ticks as a literal table."""
    plan = [[12, 12, 12], [12, 6, 3], [12, 4, 12]]
    trained = [range(1, 32), [*range(1, 13), 14, 16, 18, 20, 22, 24, 27, 30],
               [*range(1, 13), 16, 20, 24, *range(25, 32)]]
    steps = 2 * H + 7
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, alpha=alpha, codec=codec)
    out = loco.launch(planned_worker, 3, args=(steps, plan), kwargs=kw)
    ref = reference_streaming(3, steps, H, fragments, overlap, alpha, codec, plan=plan,
                              trained=trained)
    for r in out:
        assert max_diff(r["params"], ref) == 0
    assert max_diff(ref, reference_streaming(3, steps, H, fragments, overlap, alpha,
                                             codec)) > 1e-5


# The asynchronous tests' rounds: H = 6 (their plans are rounds of steps per worker, one
# fragment, τ = 0: no layout needs a longer round)
HA = 6


@pytest.mark.parametrize("staleness,codec,feedback", [
    (1, "fp32", 0.0), (2, "fp32", 0.0), (2, "fp4_e3m0", 0.9), (5, "fp32", 0.0)])
@pytest.mark.usefixtures("rank_order")
def test_asynchronous_outer_steps_match_their_reference(staleness, codec, feedback):
    """Asynchronous outer steps with a fixed plan: a slow worker's block spans rounds
    (sending zeros at the syncs between, its error feedback untouched), its pseudo-gradient
    taken from the global copy its block started from and token-weighted with the blocks
    that end at the same sync; bit for bit the reference's, and not the synchronous run.
    The reference takes the ticks and the blocks as literal tables. The blocks end in every
    way: holding H steps (worker 1 at round 2), at S + 1 rounds (worker 2 at round 2 with
    S = 1), both at once (worker 2 at round 3 with S = 2), past H (worker 1 at round 4, 9
    steps) and at the run's last full round (worker 2 at round 4 with S = 2)."""
    plan = [[6, 6, 6], [6, 3, 2], [6, 3, 2], [6, 3, 2], [6, 6, 2]]
    trained = [range(1, 34), [*range(1, 7), *range(8, 25, 2), *range(25, 34)],
               [*range(1, 7), *range(9, 31, 3), 31, 32, 33]]
    ends = {1: [dict.fromkeys(range(5), 6), {0: 6, 2: 6, 4: 9}, {0: 6, 2: 4, 4: 4}],
            2: [dict.fromkeys(range(5), 6), {0: 6, 2: 6, 4: 9}, {0: 6, 3: 6, 4: 2}]}
    steps = 5 * HA + 3
    kw = dict(sync_every=HA, fragments=1, overlap=0, alpha=0.0, codec=codec,
              error_feedback=feedback)
    out = loco.launch(planned_worker, 3, args=(steps, plan), kwargs={
        **kw, "max_staleness": staleness})
    # S = 5: the blocks of S = 2 (the reference reads S only to find the blocks, given here)
    ref = once(reference_streaming, 3, steps, HA, 1, 0, 0.0, codec, plan=plan,
               trained=trained, error_feedback=feedback, max_staleness=min(staleness, 2),
               block_ends=ends[min(staleness, 2)])
    for r in out:
        assert max_diff(r["params"], ref) == 0
    # zeros travel where a block goes on: the bytes of the synchronous run, exactly; and
    # not its model
    sync = once(loco.launch, planned_worker, 3, args=(steps, plan), kwargs=kw)
    assert [r["sent"] for r in out] == [r["sent"] for r in sync]
    assert max_diff(ref, sync[0]["params"]) > 1e-5


def test_asynchronous_outer_steps_resume_exactly_in_the_middle_of_a_block():
    """A checkpoint taken while the slow workers' blocks span rounds (their replicas away
    from the global copy, their blocks' starts kept: at the end of round 1, worker 1's block
    runs to round 2 and worker 2's to round 3) continues bit for bit."""
    plan = [[6, 6, 6], [6, 3, 2], [6, 3, 2], [6, 3, 2]]
    kw = dict(sync_every=HA, fragments=1, overlap=0, alpha=0.0, codec="fp32",
              max_staleness=2, resume_at=2 * HA)
    for straight, resumed in loco.launch(planned_worker, 3, args=(4 * HA, plan), kwargs=kw):
        assert max_diff(straight, resumed) == 0
