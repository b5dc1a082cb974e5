"""The compression frontier's wire: error feedback with every lossy codec, the all-gathered
chunked top-k (SparseLoCo), its bytes, Elias-Fano coding, and resuming bit for bit.

The reference (``workers.reference_streaming``) is the algorithm box in one process with the
same tensor operations in the same order as the library, so the runs agree bit for bit."""

import math

import pytest
import torch
from workers import max_diff, reference_streaming, resume_worker, streaming_worker

import loco
from loco.comm.codecs.bitpack import ef_decode, ef_encode, pack, unpack
from loco.comm.codecs import get_codec
from loco.comm.codecs.formats import CODEC_NAMES, chunk_topk_bytes, ef_bytes, packed_bytes

pytestmark = pytest.mark.numerics

H = 4  # the smallest H with P = 2 fragments and τ = 1 (sends 2 steps apart)
LOSSY = tuple(n for n in CODEC_NAMES if n != "fp32")


def _run(workers, steps, codec, beta, fragments=1, overlap=0, alpha=0.0, keep=None, **kw):
    kw = dict(sync_every=H, fragments=fragments, overlap=overlap, alpha=alpha, codec=codec,
              error_feedback=beta, codec_keep=keep, outer_lr=0.7, outer_momentum=0.9, **kw)
    return loco.launch(streaming_worker, workers, args=(steps,), kwargs=kw)


@pytest.mark.parametrize("codec", LOSSY)
def test_error_feedback_matches_the_reference_with_every_codec(codec):
    """e ← β·e + Δ; sent = C(e); e ← e − D(C(e)), per worker, bit for bit: with the
    all-reduced codecs (each worker's rows) and the all-gathered one (its whole fragment).
    topk_2bit keeps 1/4 of each chunk of 64 here: a chunk of 4096 would be one chunk."""
    block = 64 if codec.startswith("topk_2bit") else None
    keep = 0.25 if codec.startswith("topk_2bit") else None
    steps = 3 * H
    out = _run(2, steps, codec, 0.9, keep=keep, codec_block=block)
    ref = reference_streaming(2, steps, H, 1, 0, 0.0, codec=codec, outer_lr=0.7,
                              error_feedback=0.9, block=block, keep=keep)
    assert max_diff(out[0]["params"], ref) == 0
    assert max_diff(out[1]["params"], out[0]["params"]) == 0
    without = reference_streaming(2, steps, H, 1, 0, 0.0, codec=codec, outer_lr=0.7,
                                  block=block, keep=keep)
    # the feedback changed something: measured 1.6e-4 (bf16) to 0.03 (the top-k codecs) of
    # the parameters, whose ulps are about 1e-7; a codec that dropped the feedback gives 0
    assert max_diff(without, ref) > 1e-5


@pytest.mark.parametrize("codec,workers", [("fp4_e3m0", 3), ("topk_2bit", 3), ("int2", 2)])
def test_error_feedback_with_fragments_and_overlap(codec, workers):
    block, keep = (64, 0.25) if codec == "topk_2bit" else (None, None)
    steps = 2 * H + H // 2  # ends with the third round's first sync sent, in flight
    out = _run(workers, steps, codec, 0.95, fragments=2, overlap=1, alpha=0.5, keep=keep,
               codec_block=block, layers=4)
    ref = reference_streaming(workers, steps, H, 2, 1, 0.5, codec=codec, outer_lr=0.7,
                              error_feedback=0.95, block=block, keep=keep)
    assert all(max_diff(r["params"], ref) == 0 for r in out)


def test_gathered_bytes_are_exact():
    """An all-gather sends the whole encoded fragment to each of the M − 1 others: bytes per
    worker = syncs · (M − 1) · chunks · chunk bytes (2-bit codes, two bf16 magnitudes,
    Elias-Fano positions)."""
    steps, workers = 2 * H, 3
    out = _run(workers, steps, "topk_2bit", 0.95)
    n = sum(s["elements"] for s in out[0]["stats"])
    chunks = math.ceil(n / 4096)
    per_sync = (workers - 1) * chunks * (packed_bytes(64, 2) + 4 + ef_bytes(4096, 64))
    assert all(r["sent"] == 2 * per_sync for r in out)
    assert chunk_topk_bytes("topk_2bit", 4096, 64) == 16 + 4 + 64


@pytest.mark.parametrize("algo,extra", [
    ("streaming", dict(fragments=2, overlap=1, alpha=0.5, codec="fp4_e3m0", error_feedback=0.9)),
    ("diloco", dict(codec="int2", error_feedback=0.9)),
    ("sparseloco", dict(codec_block=64, codec_keep=0.25)),
])
def test_error_feedback_resumes_bit_for_bit(algo, extra):
    """The error buffers and what was sent of the fragment in flight are checkpointed."""
    out = loco.launch(resume_worker, 2, args=(3 * H, H + 1, H, algo), kwargs=extra)
    for straight, resumed in out:
        assert max_diff(straight, resumed) == 0


def test_sparseloco_matches_the_papers_box():
    """SparseLoCo itself (outer lr 1, no momentum, β = 0.95, all-gathered 2-bit top-k) in
    loco's runs layout and the box's mean over all against the reference, bit for bit, with
    3 workers (its defaults, the tiles and the senders' mean:
    tests/test_sparseloco_reference.py)."""
    from workers import make_model, make_optimizer, params_of, train_steps

    def worker(ctx):
        model = make_model(layers=4)
        opt = make_optimizer(model)
        algo = loco.SparseLoCo(model, opt, ctx.comm, sync_every=H, codec_block=64,
                               codec_keep=0.25, sparse_layout="runs", sparse_values="split",
                               sparse_mean="all")
        train_steps(model, opt, ctx.rank, range(3 * H), lambda: (algo.step(), algo.zero_grad()))
        return params_of(algo.global_parameters())

    out = loco.launch(worker, 3)
    ref = reference_streaming(3, 3 * H, H, 1, 0, 0.0, codec="topk_2bit", outer_lr=1.0,
                              outer_momentum=0.0, error_feedback=0.95, block=64, keep=0.25)
    assert all(max_diff(r, ref) == 0 for r in out)


def test_sparseloco_is_diloco_with_its_wire_and_outer_rule():
    from loco.algorithms import SparseLoCo

    model = torch.nn.Linear(4, 4)
    algo = SparseLoCo(model, torch.optim.AdamW(model.parameters()), loco.Comm(None, 0, 1))
    assert (algo.codec.name, algo.error_feedback, algo.sync_every) == ("topk_2bit", 0.95, 30)
    group = algo.fragment_list[0].outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (1.0, 0.0)


# ------------------------------------------------------------------------------ the format
def test_topk_2bit_keeps_the_largest_of_each_chunk_in_two_magnitudes():
    codec = get_codec("topk_2bit", block=64, keep=0.125)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    d = codec.decode_rows(codec.encode_rows(x), 256).view(-1, 64)
    xs = x.view(-1, 64)
    for row, dec in zip(xs, d):
        kept = dec.nonzero().view(-1)
        assert set(kept.tolist()) == set(row.abs().topk(8).indices.tolist())
        assert torch.equal(dec[kept].sign(), row[kept].sign())
        mags = row[kept].abs()
        hi = mags >= mags.mean()
        lo_level = mags[~hi].mean() if (~hi).any() else torch.tensor(0.0)
        hi_level = mags[hi].mean().bfloat16().float()
        want = torch.where(hi, hi_level, lo_level.bfloat16().float())
        # each value decodes to its own half's level (caught: the decoder's halves swapped)
        assert torch.equal(dec[kept].abs(), want)
    assert codec.row_bytes(4096) * 8 / 4096 == 8 * (2 + 4 + ef_bytes(64, 8)) / 64


def test_default_chunk_format_costs():
    """64 of 4096: 0.164 bits per value with Elias-Fano positions, 0.227 packed in 12 bits;
    the positions' limit is log2 C(4096, 64) bits."""
    ef, packed = get_codec("topk_2bit"), get_codec("topk_2bit_packed")
    assert ef.row_bytes(4096) == 84 and packed.row_bytes(4096) == 116
    limit = math.log2(math.comb(4096, 64)) / 8
    assert limit < ef_bytes(4096, 64) < packed_bytes(64, 12)
    assert ef_bytes(4096, 64) / limit < 1.1


@pytest.mark.parametrize("n,k", [(4096, 64), (64, 8), (100, 7), (10, 10), (5, 1), (1, 1)])
def test_elias_fano_round_trip_and_size(n, k):
    g = torch.Generator().manual_seed(n + k)
    idx = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(5)])
    buf = ef_encode(idx, n)
    assert buf.shape == (5, ef_bytes(n, k))
    assert torch.equal(ef_decode(buf, n, k), idx)
    with pytest.raises(RuntimeError, match="set bits"):  # torch._assert_async: no host read
        ef_decode(torch.zeros_like(buf), n, k)


@pytest.mark.parametrize("width", [1, 2, 3, 6, 12, 17])
def test_bit_packing_round_trip(width):
    v = torch.randint(0, 2 ** width, (4, 37), generator=torch.Generator().manual_seed(width))
    buf = pack(v, width)
    assert buf.shape == (4, packed_bytes(37, width))
    assert torch.equal(unpack(buf, 37, width), v)
    assert pack(v[:0], width).shape == (0, packed_bytes(37, width))


def test_all_gather_mean_sends_what_it_says_and_returns_what_was_sent():
    def worker(ctx):
        codec = get_codec("topk_2bit", block=64, keep=0.25)
        x = torch.randn(200, generator=torch.Generator().manual_seed(ctx.rank))
        sent = torch.empty(200)
        mine = x.clone()
        ctx.comm.all_gather_mean(x, codec=codec, sent=sent).wait()
        return {"mean": x, "sent": sent, "mine": mine, "bytes": ctx.comm.totals().sent_bytes}

    out = loco.launch(worker, 3)
    codec = get_codec("topk_2bit", block=64, keep=0.25)
    echoes = [codec.decode(codec.encode(r["mine"]), (200,)) for r in out]
    assert all(torch.equal(r["sent"], e) for r, e in zip(out, echoes))
    assert all(torch.equal(r["mean"], (echoes[0] + echoes[1] + echoes[2]) / 3) for r in out)
    assert all(r["bytes"] == 2 * codec.row_bytes(256) for r in out)


@pytest.mark.parametrize("overrides,match", [
    ({"error_feedback": 1.0}, "--error-feedback"),
    ({"codec": "int2", "codec_block": 6}, "--codec-block"),
    ({"codec_keep": 0.0}, "--codec-keep"),
])
def test_bad_wire_options_are_refused_in_one_line(overrides, match):
    from loco.config import ConfigError, build_config, validate

    cfg = build_config(overrides={"algorithm": "sparseloco", **overrides})
    with pytest.raises(ConfigError, match=match) as err:
        validate(cfg)
    assert "\n" not in str(err.value)
