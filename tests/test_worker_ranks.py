"""A worker of R ranks: the ranks average their gradients over the
worker's fast link and train one replica with R times the batch; between workers, each rank
reduces only its 1/R of the pseudo-gradient over the slow link."""

import pytest

import loco
from workers import (make_model, max_diff, reference_big_batch, reference_diloco, reference_noloco,
                     reference_streaming, resume_worker, sharded_cases, sharded_worker,
                     smooth_optimizer, worker_batches)

pytestmark = pytest.mark.numerics

#: Comparisons with a reference use AdamW with a larger eps (see ``smooth_optimizer``): the
#: worker's gradient is the mean of R ranks' means, the reference's one mean over R·b
#: samples, ulps apart, which the default eps could turn into steps of ±lr.
SMOOTH = dict(optimizer=smooth_optimizer)
#: Agreement with the references: measured at most 1.2e-7 (two ulps of values near 1) in
#: every case below, natively and with ATEN_CPU_CAPABILITY=default; references fed the
#: wrong data are 2e-2 away or more.
TOL = 1e-6

H = 4


@pytest.mark.parametrize("m,r", [(2, 2), (3, 2), (2, 4), (2, 3)])
def test_diloco_with_ranks_per_worker_matches_workers_with_the_whole_batch(m, r):
    """M workers x R ranks of batch b = the reference's M workers of batch R·b (within
    TOL: the worker's gradient is the mean of R ranks' means, another summation order than
    the reference's; R = 3 gives uneven, padded ranges); a reference fed only rank 0's
    batches is 2.5e-2 away."""
    steps = 2 * H
    out = loco.launch(sharded_worker, mesh=loco.Mesh(m, 1, r), args=(steps,),
                      kwargs=dict(sync_every=H, outer_lr=0.7, outer_momentum=0.9, **SMOOTH))
    ref = reference_diloco(m, steps, H, 0.7, 0.9, data=worker_batches(r), **SMOOTH)
    for o in out:
        assert max_diff(o["params"], ref) < TOL
        assert max_diff(o["params"], out[0]["params"]) == 0  # every rank, every worker


@pytest.mark.parametrize("fragments,overlap,alpha", [(1, 0, 0.0), (2, 1, 0.5), (2, 0, 0.5)])
def test_streaming_with_ranks_per_worker_matches_the_reference(fragments, overlap, alpha):
    steps = 2 * H + 1
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, alpha=alpha, codec="fp32",
              layers=4)
    out = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(steps, "streaming"),
                      kwargs=dict(kw, **SMOOTH))
    ref = reference_streaming(2, steps, H, fragments, overlap, alpha, data=worker_batches(2),
                              **SMOOTH)
    for o in out:
        assert max_diff(o["params"], ref) < TOL  # as above


def test_no_worker_sends_r_copies_over_the_slow_link():
    """Slow-link bytes per worker with R = 2 ranks equal those of one rank per worker (up to
    the shards' rounding); each rank carries half. The fast link carries the gradients."""
    steps = 2 * H
    kw = dict(sync_every=H, outer_lr=0.7, outer_momentum=0.9)
    one = loco.launch(sharded_worker, 2, args=(steps,), kwargs=kw)
    two = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(steps,), kwargs=kw)
    per_worker_one = one[0]["slow"]
    per_worker_two = two[0]["slow"] + two[1]["slow"]  # ranks 0 and 1 are worker 0
    assert abs(per_worker_two - per_worker_one) <= 2 * 2 * 4  # a padded value per shard
    assert abs(two[0]["slow"] - per_worker_one / 2) <= 2 * 4
    assert two[0]["fast"] > 0 and one[0]["fast"] == 0


def test_noloco_with_ranks_per_worker_gossips_between_workers_only():
    """Groups are groups of workers: rank r of each member swaps its 1/R shard of Δ and φ;
    the worker gathers the group's means over its fast link. Equals the reference with M
    workers of batch R·b (tolerance as above); no operation spans all workers."""
    steps = 2 * 4
    kw = dict(sync_every=4, group_size=2, outer_lr=0.7, outer_momentum=0.5, gamma=0.7,
              warn=False)
    out = loco.launch(sharded_worker, mesh=loco.Mesh(4, 1, 2), args=(steps, "noloco"),
                      kwargs=dict(kw, **SMOOTH))
    ref = reference_noloco(4, steps, 4, 2, 0.7, 0.5, 0.7, data=worker_batches(2), **SMOOTH)
    for rank, o in enumerate(out):
        assert max_diff(o["params"], ref[rank // 2]) < TOL
        assert all(len(r.participants) == 2 for r in o["records"])  # a pair of workers


def test_data_parallel_with_ranks_per_worker_is_one_big_batch():
    """M workers x R ranks of DataParallel train like one model on all M·R batches
    (tolerance as above: the mean is taken inside the worker first); each rank sends 1/R of
    the worker's slow-link bytes."""
    steps = 4
    out = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(steps, "ddp"), kwargs=SMOOTH)
    ref, _ = reference_big_batch(4, steps, **SMOOTH)
    flat = loco.launch(sharded_worker, 2, args=(steps, "ddp"), kwargs=SMOOTH)
    for o in out:
        assert max_diff(o["params"], ref) < TOL
    assert abs(out[0]["slow"] + out[1]["slow"] - flat[0]["slow"]) <= 2 * 2 * 4 * steps


def test_streaming_fp4_with_ranks_per_worker_encodes_each_rank_s_shard():
    """With FP4 each rank encodes its own 1/R range of Δ (and of the mean): the reference
    applies the codec to the same ranges and agrees (measured: bit for bit); one that encodes
    the whole fragment at once does not (its scale blocks start elsewhere: 2% of the values
    differ)."""
    steps = 2 * H + 1
    kw = dict(sync_every=H, fragments=2, overlap=1, alpha=0.5, codec="fp4_e3m0", layers=4)
    out = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(steps, "streaming"),
                      kwargs=dict(kw, **SMOOTH))
    data = worker_batches(2)
    ref = reference_streaming(2, steps, H, 2, 1, 0.5, "fp4_e3m0", data=data, shards=2, **SMOOTH)
    whole = reference_streaming(2, steps, H, 2, 1, 0.5, "fp4_e3m0", data=data, **SMOOTH)
    for o in out:
        assert max_diff(o["params"], ref) < TOL
    assert share_beyond(out[0]["params"], whole, TOL) > 1e-2


def test_error_feedback_with_ranks_per_worker_is_sharded_like_the_outer_state():
    """Each rank keeps the error of its own 1/R of the fragment and feeds back what its own
    range became on the wire: the reference's error feedback applied range by range (FSDP2:
    ``test_fsdp_error_feedback_keeps_each_rank_s_local_shards``)."""
    steps, parallel = 2 * H + 1, "ddp"
    kw = dict(sync_every=H, fragments=2, overlap=1, alpha=0.5, codec="fp4_e3m0", layers=4,
              error_feedback=0.9)
    out = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(steps, "streaming"),
                      kwargs=dict(kw, **SMOOTH))
    data = worker_batches(2)
    ref = reference_streaming(2, steps, H, 2, 1, 0.5, "fp4_e3m0", data=data, shards=2,
                              parallel=parallel, error_feedback=0.9, **SMOOTH)
    without = reference_streaming(2, steps, H, 2, 1, 0.5, "fp4_e3m0", data=data, shards=2,
                                  parallel=parallel, **SMOOTH)
    for o in out:
        assert max_diff(o["params"], ref) < TOL
    assert max_diff(out[0]["params"], without) > 10 * TOL


def share_beyond(a: dict, b: dict, tol: float) -> float:
    """The share of values of ``a`` more than ``tol`` from ``b``'s."""
    over = sum(int(((a[n] - b[n]).abs() > tol).sum()) for n in b)
    return over / sum(v.numel() for v in b.values())


@pytest.mark.parametrize("algo_name,kw", [
    ("diloco", dict(sync_every=H, outer_lr=0.7, outer_momentum=0.9)),
    ("noloco", dict(sync_every=H, group_size=2, warn=False))])
def test_each_rank_holds_one_rth_of_the_outer_state(algo_name, kw):
    """The global copy and outer momentum (NoLoCo: slow weights and δ) are split over the
    worker's ranks: each of R = 2 ranks holds half of a one-rank worker's (up to one padded
    value)."""
    one = loco.launch(sharded_worker, 2, args=(H, algo_name), kwargs=dict(kw))
    two = loco.launch(sharded_worker, mesh=loco.Mesh(2, 1, 2), args=(H, algo_name),
                      kwargs=dict(kw))
    whole = one[0]["outer_bytes"]
    n = sum(p.numel() for p in make_model().parameters())
    assert whole >= 2 * 4 * n  # at least two fp32 copies: θ^g and momentum (NoLoCo: φ, δ)
    for o in two:
        assert abs(o["outer_bytes"] - whole / 2) <= 2 * 4  # per buffer, one padded fp32 value


STREAMING = dict(sync_every=H, fragments=2, overlap=1, alpha=0.5, layers=4)
NOLOCO = dict(sync_every=H, group_size=2, outer_lr=0.7, outer_momentum=0.5, gamma=0.7,
              warn=False)
#: Streaming DiLoCo's runs take one step past two rounds, so that the last sync (tau = 1)
#: lands; DiLoCo and NoLoCo two outer steps; DataParallel, which syncs every step, one round.
FSDP_STEPS = 2 * H + 1
STEPS_OF = {"diloco": 2 * H, "noloco": 2 * H, "ddp": H}
FSDP_CASES = {
    "diloco": (sharded_worker, (STEPS_OF["diloco"], "diloco"),
               dict(sync_every=H, outer_lr=0.7, outer_momentum=0.9, **SMOOTH)),
    "streaming": (sharded_worker, (FSDP_STEPS, "streaming"),
                  dict(STREAMING, codec="fp32", **SMOOTH)),
    "streaming_fp4": (sharded_worker, (FSDP_STEPS, "streaming"),
                      dict(STREAMING, codec="fp4_e3m0", **SMOOTH)),
    "streaming_fp4_ef": (sharded_worker, (FSDP_STEPS, "streaming"),
                         dict(STREAMING, codec="fp4_e3m0", error_feedback=0.9, **SMOOTH)),
    "noloco": (sharded_worker, (STEPS_OF["noloco"], "noloco"), dict(NOLOCO, **SMOOTH)),
    "ddp": (sharded_worker, (STEPS_OF["ddp"], "ddp"), SMOOTH),
    # a checkpoint taken while fragment 0's sync is in flight (sent at step 6, tau = 1),
    # both fragments with outer momentum
    "resume": (resume_worker, (FSDP_STEPS, H + 2, H, "streaming"),
               dict(fragments=2, overlap=1, layers=4)),
    # the same through DCP with the model whole on every rank (ddp inside), and NoLoCo's
    "resume_ddp": (resume_worker, (FSDP_STEPS, H + 2, H, "streaming"),
                   dict(fragments=2, overlap=1, layers=4, parallel="ddp")),
    # (NoLoCo's checkpoint one step before its second outer step)
    "resume_noloco": (resume_worker, (2 * H, 2 * H - 1, H, "noloco"),
                      {k: v for k, v in NOLOCO.items() if k != "sync_every"})}


@pytest.fixture(scope="module")
def fsdp_runs():
    """Every FSDP2 case, M = 2 workers x R = 2 ranks, in one processes launch."""
    cases = {k: (fn, args, {"parallel": "fsdp", **kw}) for k, (fn, args, kw) in
             FSDP_CASES.items()}
    return loco.launch(sharded_cases, mesh=loco.Mesh(2, 1, 2), launcher="processes", args=(cases,))


@pytest.mark.parametrize("case,reference", [
    ("diloco", lambda data: reference_diloco(2, STEPS_OF["diloco"], H, 0.7, 0.9, data=data,
                                             **SMOOTH)),
    ("streaming", lambda data: reference_streaming(2, FSDP_STEPS, H, 2, 1, 0.5, data=data,
                                                   **SMOOTH)),
    ("noloco", lambda data: reference_noloco(2, STEPS_OF["noloco"], H, 2, 0.7, 0.5, 0.7,
                                             data=data, **SMOOTH)[0]),
    ("ddp", lambda data: reference_big_batch(4, STEPS_OF["ddp"], **SMOOTH)[0])])
def test_fsdp_inside_a_worker_matches_the_reference(fsdp_runs, case, reference):
    """FSDP2 over the R = 2 ranks of each of M = 2 workers (processes): each rank keeps and
    syncs its own shards with the same rank of the other worker (DataParallel: its gradient
    shards, hybrid sharding); the result equals the reference with M workers of batch R·b
    (within TOL: FSDP2's reduce-scatter takes the mean of the ranks' means).
    Every rank sends over the slow link and holds about 1/R of the outer state."""
    ref = reference(worker_batches(2))
    runs = [r[case] for r in fsdp_runs]
    for o in runs[:2]:  # worker 0's ranks (NoLoCo's replicas differ between workers)
        assert max_diff(o["params"], ref) < TOL
    assert all(o["slow"] > 0 for o in runs)
    assert abs(runs[0]["slow"] - runs[1]["slow"]) <= 0.2 * runs[0]["slow"]  # each ~1/R
    sizes = [o["outer_bytes"] for o in runs]
    assert max(sizes) - min(sizes) <= 0.2 * max(sizes)  # ~1/R each (dim-0 chunks)


def test_fsdp_error_feedback_keeps_each_rank_s_local_shards(fsdp_runs):
    """Error feedback under FSDP2: each rank's error is of its own dim-0 chunks, fed back with
    what those became on the wire; the reference does the same chunk by chunk. Within TOL
    but for a few values: FSDP2's reduce-scatter and the reference average the ranks'
    gradients in other orders, and FP4 turns that last-bit difference into one step of its
    grid where a value of Δ lies on a rounding boundary (seen with the generic kernels, one
    value 4.6e-5 off; the error feedback then carries it). The layout is still checked: the
    ddp layout's ranges differ in over 1% of the values (the next test)."""
    ref = reference_streaming(2, FSDP_STEPS, H, 2, 1, 0.5, "fp4_e3m0", data=worker_batches(2),
                              shards=2, parallel="fsdp", error_feedback=0.9, **SMOOTH)
    for r in fsdp_runs[:2]:
        assert share_beyond(r["streaming_fp4_ef"]["params"], ref, TOL) < 1e-3
        assert max_diff(r["streaming_fp4_ef"]["params"], ref) < 1e-3
    assert max_diff(fsdp_runs[0]["streaming_fp4_ef"]["params"],
                    fsdp_runs[0]["streaming_fp4"]["params"]) > 10 * TOL


def test_fsdp_with_fp4_encodes_each_rank_s_local_shards(fsdp_runs):
    """Streaming DiLoCo FP4 under FSDP2: each rank encodes the concatenation of its dim-0
    chunks of the fragment's tensors; the reference applies the codec to the same chunks and
    agrees (measured: bit for bit); one with the ddp layout's ranges does not (8% differ)."""
    data = worker_batches(2)
    ref = reference_streaming(2, FSDP_STEPS, H, 2, 1, 0.5, "fp4_e3m0", data=data, shards=2,
                              parallel="fsdp", **SMOOTH)
    ranges = reference_streaming(2, FSDP_STEPS, H, 2, 1, 0.5, "fp4_e3m0", data=data, shards=2,
                                 **SMOOTH)
    for r in fsdp_runs[:2]:
        assert max_diff(r["streaming_fp4"]["params"], ref) < TOL
    assert share_beyond(fsdp_runs[0]["streaming_fp4"]["params"], ranges, TOL) > 1e-2


@pytest.mark.parametrize("case", ["resume", "resume_ddp", "resume_noloco"])
def test_dcp_checkpoint_with_a_sync_in_flight_resumes_bit_identically(fsdp_runs, case):
    """The worker's tensors (model, AdamW, global copy, momentum, the pseudo-gradient in
    flight; NoLoCo's φ and δ) saved through torch.distributed.checkpoint, each rank its own
    shards (FSDP2) or share (ddp inside), and loaded into a rebuilt algorithm with its small
    state: the run ends bit for bit where the uninterrupted one does."""
    for r in fsdp_runs:
        straight, resumed = r[case]
        assert max_diff(straight, resumed) == 0


def test_checkpoint_with_ranks_per_worker_and_a_sync_in_flight_resumes_bit_identically():
    """Data-parallel inside (threads): each rank's state_dict holds its 1/R of the outer
    state and of the pseudo-gradient in flight; resumed, the run ends bit for bit alike."""
    out = loco.launch(resume_worker, mesh=loco.Mesh(2, 1, 2), args=(FSDP_STEPS, 2, H, "streaming"),
                      kwargs=dict(fragments=2, overlap=1, layers=4))
    for straight, resumed in out:
        assert max_diff(straight, resumed) == 0


def test_fsdp_collectives_are_counted_as_fast_link_bytes(fsdp_runs):
    """FSDP2's own all-gathers and reduce-scatters are counted on the worker's fast link:
    per step, every block is gathered twice (forward, and again for backward, as FSDP2
    frees it after forward), the root's own parameters once, and every gradient
    reduce-scattered once; each of R ranks sends R − 1 padded shards per collective."""
    from loco.algorithms.fragments import find_blocks
    from workers import make_model

    model = make_model()

    def padded(params):  # FSDP2 pads dim 0 to R equal chunks
        return sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in params)
    in_blocks = {id(p) for b in find_blocks(model) for p in b.parameters()}
    blocks = padded([p for p in model.parameters() if id(p) in in_blocks])
    root = padded([p for p in model.parameters() if id(p) not in in_blocks])
    per_step = (2 - 1) * (2 * blocks + root + blocks + root)
    assert all(r["ddp"]["fast"] == STEPS_OF["ddp"] * per_step for r in fsdp_runs)


@pytest.mark.parametrize("m,r,algo_name", [(3, 2, "diloco"), (2, 3, "streaming")])
def test_fsdp_with_more_workers_or_uneven_shards_matches_the_reference(m, r, algo_name):
    """FSDP2 with M = 3 workers, and with R = 3 ranks, whose dim-0 chunks are uneven
    (``torch.chunk``: 64 rows make 22, 22, 20; 16 make 6, 6, 4): the result is the
    reference's with M workers of batch R·b (tolerance as above)."""
    kw = (dict(sync_every=H, outer_lr=0.7, outer_momentum=0.9) if algo_name == "diloco"
          else dict(STREAMING, codec="fp32"))
    out = loco.launch(sharded_worker, mesh=loco.Mesh(m, 1, r), launcher="processes",
                      args=(FSDP_STEPS, algo_name), kwargs=dict(kw, parallel="fsdp", **SMOOTH))
    ref = (reference_diloco(m, FSDP_STEPS, H, 0.7, 0.9, data=worker_batches(r), **SMOOTH)
           if algo_name == "diloco" else
           reference_streaming(m, FSDP_STEPS, H, 2, 1, 0.5, data=worker_batches(r), **SMOOTH))
    for o in out:
        assert max_diff(o["params"], ref) < TOL
