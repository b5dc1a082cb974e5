"""SparseLoCo as its reference code runs it (tplr-ai/templar ``src/tplr/compress.py``), each
part against a single-process reference written from that code, not from loco's:

* the tiles (``ChunkingTransformer.encode``: ``(y h) (x w) -> y x h w``, each side the
  largest divisor not above 64; the sides here are a literal table for the test model);
* the top-k of each tile (``TopKCompressor.compress``: ``k = min(64, tile)``; the reference
  also rounds ``k`` down to even and up to 2 for its 12-bit packing, which loco's positions
  coding does not need: no tile here is odd or of 1 value);
* the statistical 2-bit quantiser (``_quantize_values`` with 4 bins and a range of 6σ);
* the mean over the senders (``decompress``'s ``scatter_reduce(..., "mean",
  include_self=False)``);
* the whole method: error feedback β = 0.95, outer lr 1, no momentum (the paper's box).

Each test names the mistake it was shown to catch (planted by hand, then removed).
"""

import math

import pytest
import torch
from workers import (batch, make_model, make_optimizer, max_diff, once, params_of,
                     train_steps)

import loco
from loco.comm.codecs.formats import ef_bytes, packed_bytes
from loco.comm.codecs.tiles import TiledTopK

pytestmark = pytest.mark.numerics

# the test model's tensors and their tiles (h, w): the largest divisors <= 64 of each side
TILES = {(64, 32): (64, 32), (32,): (1, 32), (96, 32): (48, 32), (32, 32): (32, 32),
         (16,): (1, 16), (32, 96): (32, 48)}
K = 64


# ------------------------------------------------------------------- the reference, written
def ref_tiles(t: torch.Tensor) -> torch.Tensor:
    """The tiles of ``t`` (rows y·x, values h·w), tile (i, j) at row i·x + j, by slicing."""
    h, w = TILES[tuple(t.shape)]
    m = t.reshape(1, -1) if t.dim() == 1 else t
    return torch.stack([m[i:i + h, j:j + w].reshape(-1) for i in range(0, m.shape[0], h)
                        for j in range(0, m.shape[1], w)])


def ref_untile(tiles: torch.Tensor, shape) -> torch.Tensor:
    h, w = TILES[tuple(shape)]
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    out = torch.zeros(rows, cols)
    for r, (i, j) in enumerate((i, j) for i in range(0, rows, h) for j in range(0, cols, w)):
        out[i:i + h, j:j + w] = tiles[r].view(h, w)
    return out.view(shape)


def ref_quantise_stat(val: torch.Tensor) -> torch.Tensor:
    """``TopKCompressor._quantize_values`` then ``_dequantize_values``: 4 bins, 6σ."""
    n_bins, offset = 4, 2
    shift = val.mean()
    centered = val - shift
    std = centered.norm() / math.sqrt(centered.numel() - 1)
    scale = 6 * std / n_bins
    if scale == 0 or torch.isnan(scale) or torch.isinf(scale):
        scale = torch.tensor(1.0)
    q = (centered / scale + offset).round().clamp(0, n_bins - 1).long()
    sums = torch.zeros(n_bins).scatter_add_(0, q.flatten(), centered.flatten())
    counts = torch.zeros(n_bins).scatter_add_(0, q.flatten(), torch.ones(q.numel()))
    lookup = torch.where(counts > 0, sums / counts, torch.zeros_like(sums))
    return lookup[q] + shift


def ref_quantise_split(val: torch.Tensor) -> torch.Tensor:
    """loco's 2 bits, from docs/algorithms/sparseloco.md: per tile, the sign, and whether the
    magnitude is at least the mean kept magnitude; each half decoded to its mean magnitude,
    rounded to bf16."""
    out = torch.empty_like(val)
    for r, v in enumerate(val):
        mag = v.abs()
        hi = mag >= mag.mean()
        lo = mag[~hi].mean() if (~hi).any() else torch.tensor(0.0)
        out[r] = torch.where(hi, mag[hi].mean().bfloat16().float(), lo.bfloat16().float())
        out[r] *= torch.where(v < 0, -1.0, 1.0)
    return out


def ref_compress(t: torch.Tensor, values: str):
    """``compress``: the top-k of each tile (positions sorted), its values quantised."""
    tiles = ref_tiles(t)
    k = min(K, tiles.shape[1])
    idx = torch.topk(tiles.abs(), k, dim=-1, sorted=False).indices.sort(dim=-1).values
    val = tiles.gather(-1, idx)
    return idx, ref_quantise_stat(val) if values == "stat" else ref_quantise_split(val)


def ref_decompress(shape, messages, mean: str, workers: int) -> torch.Tensor:
    """``batch_decompress`` without its clip: every sender's values at their positions,
    averaged per position over the senders (``scatter_reduce`` mean) or over all workers."""
    idx = torch.cat([i for i, _ in messages], dim=-1)
    val = torch.cat([v for _, v in messages], dim=-1)
    rows = ref_tiles(torch.zeros(shape)).shape
    if mean == "senders":
        x = torch.zeros(rows).scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
    else:
        x = torch.zeros(rows).scatter_add_(-1, idx, val) / workers
    return ref_untile(x, shape)


def ref_runs(flats, block, k, mean, workers):
    """loco's runs layout (docs/algorithms/sparseloco.md#format): each worker's flat vector,
    zero-padded to whole chunks of ``block``, top-k of each chunk in loco's 2 bits; the
    decoded sum over the workers divided by M or, per position, by its senders."""
    n = flats[0].numel()
    pad = -n % block
    total, count = torch.zeros(n + pad), torch.zeros(n + pad)
    for f in flats:
        chunks = torch.cat([f, torch.zeros(pad)]).view(-1, block)
        idx = torch.topk(chunks.abs(), k, dim=-1, sorted=False).indices.sort(dim=-1).values
        dense = torch.zeros_like(chunks).scatter_(-1, idx, ref_quantise_split(chunks.gather(-1, idx)))
        total += dense.view(-1)
        count += (dense.view(-1) != 0).float()
    out = total / (count.clamp(min=1) if mean == "senders" else workers)
    return out[:n]


def reference_sparseloco(workers, steps, h, values, mean, beta=0.95, runs=None):
    """The paper's box with the reference code's compressor, in one process (``runs``:
    ``(block, k)`` of loco's runs layout in place of the tiles)."""
    models = [make_model(layers=2) for _ in range(workers)]
    opts = [make_optimizer(m) for m in models]
    glob = [p.detach().clone() for p in models[0].parameters()]
    errors = [[torch.zeros_like(p) for p in glob] for _ in range(workers)]
    for start in range(0, steps, h):
        for m, (model, opt) in enumerate(zip(models, opts)):
            train_steps(model, opt, m, range(start, start + h))
        if runs is not None:
            _runs_round(models, glob, errors, beta, mean, runs)
            continue
        sent = [[None] * len(glob) for _ in range(workers)]
        for m, model in enumerate(models):
            for i, (g, p) in enumerate(zip(glob, model.parameters())):
                errors[m][i].mul_(beta).add_(g - p.detach())
                idx, val = ref_compress(errors[m][i], values)
                sent[m][i] = (idx, val)
                errors[m][i] -= ref_decompress(g.shape, [(idx, val)], "senders", 1)
        for i, g in enumerate(glob):
            g -= ref_decompress(g.shape, [s[i] for s in sent], mean, workers)
        for model in models:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
    names = [n for n, _ in models[0].named_parameters()]
    return dict(zip(names, glob))


def _runs_round(models, glob, errors, beta, mean, runs):
    """One sync of the runs layout: e ← βe + Δ over the flat vector, sent, kept, averaged."""
    flats = []
    for m, model in enumerate(models):
        for i, (g, p) in enumerate(zip(glob, model.parameters())):
            errors[m][i].mul_(beta).add_(g - p.detach())
        flat = torch.cat([e.reshape(-1) for e in errors[m]])
        own = ref_runs([flat], *runs, "all", 1)
        flats.append(flat)
        at = 0
        for e in errors[m]:
            e -= own[at:at + e.numel()].view(e.shape)
            at += e.numel()
    avg, at = ref_runs(flats, *runs, mean, len(models)), 0
    for g in glob:
        g -= avg[at:at + g.numel()].view(g.shape)
        at += g.numel()
    for model in models:
        with torch.no_grad():
            for p, g in zip(model.parameters(), glob):
                p.copy_(g)


def sparseloco_worker(ctx, steps, h, **kw):
    model = make_model(layers=2)
    opt = make_optimizer(model)
    algo = loco.SparseLoCo(model, opt, ctx.comm, sync_every=h, **kw)
    train_steps(model, opt, ctx.rank, range(steps), lambda: (algo.step(), algo.zero_grad()))
    return {"params": params_of(algo.global_parameters()), "sent": ctx.comm.totals().sent_bytes,
            "nbytes": algo.codecs[0].encoded_nbytes(algo.fragment_list[0].delta.numel())}


# ------------------------------------------------------------------------------ the tests
def _shapes():
    return [tuple(p.shape) for p in make_model(layers=2).parameters()]


def test_the_tiles_are_the_reference_codes():
    """Mistake caught: tiles cut column-major (``permute(2, 0, 3, 1)``)."""
    shapes = _shapes()
    codec = TiledTopK("topk_2bit", shapes, 64, K, "split")
    assert [(h, w) for _, h, w in codec.plan.tiles] == [TILES[s] for s in shapes]
    x = torch.randn(codec.plan.numel, generator=torch.Generator().manual_seed(0))
    at, tiled = 0, []
    for s in shapes:
        n = math.prod(s)
        tiled.append(ref_tiles(x[at:at + n].view(s)).reshape(-1))
        at += n
    assert torch.equal(x[codec.plan.order], torch.cat(tiled))


@pytest.mark.parametrize("values", ["split", "stat"])
def test_each_tensor_decodes_as_the_reference_compressor(values):
    """Mistakes caught: the stat bins' offset 1 in place of 2; the split decoder's high and
    low magnitudes swapped; 1-D tensors sent at 64 of 4096 rather than whole."""
    shapes = _shapes()
    codec = TiledTopK("topk_2bit", shapes, 64, K, values)
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = torch.zeros(codec.encoded_nbytes(flat.numel()), dtype=torch.uint8)
    decoded = torch.zeros_like(flat)
    codec.decode_flat(codec.encode_flat(flat, out), decoded)
    at = 0
    for t in tensors:
        want = ref_decompress(t.shape, [ref_compress(t, values)], "senders", 1)
        got = decoded[at:at + t.numel()].view(t.shape)
        # the stat quantiser's mean and norm sum the same values in another order: ulps
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (values, t.shape)
        at += t.numel()
    dense = [i for i, s in enumerate(shapes) if len(s) == 1]
    at = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    for i in dense:  # 1-D tensors: every value sent (each decoded to its bin or half)
        assert (decoded[at[i]:at[i] + math.prod(shapes[i])] != 0).all()


def test_bytes_per_tensor_are_exact():
    """A tiled message: per tensor, per tile the 2-bit codes of min(64, tile) values, two
    bf16 magnitudes (split) and the positions (Elias-Fano; none for a tile sent whole); the
    stat values carry 20 header bytes per tensor instead of the magnitudes."""
    shapes = _shapes()
    for values in ("split", "stat"):
        codec = TiledTopK("topk_2bit", shapes, 64, K, values)
        want = 0
        for s in shapes:
            h, w = TILES[s]
            tiles, k = math.prod(s) // (h * w), min(K, h * w)
            where = 0 if k == h * w else ef_bytes(h * w, k)
            per_tile = packed_bytes(k, 2) + where + (4 if values == "split" else 0)
            want += tiles * per_tile + (20 if values == "stat" else 0)
        assert codec.encoded_nbytes(codec.plan.numel) == want


@pytest.mark.parametrize("values,mean", [("stat", "senders"), ("split", "all"),
                                         ("split", "senders")])
def test_sparseloco_with_tiles_matches_the_reference_code(values, mean):
    """The whole method, 3 workers, 3 syncs of H = 4, bit for bit. Mistakes caught: the
    senders' mean divided by M (``counts`` left out); the error feedback subtracting the
    value before quantisation."""
    steps, h = 12, 4
    out = loco.launch(sparseloco_worker, 3, args=(steps, h),
                      kwargs=dict(sparse_layout="tiles", sparse_values=values,
                                  sparse_mean=mean))
    ref = once(reference_sparseloco, 3, steps, h, values, mean)  # also another case's other
    assert all(max_diff(r["params"], ref) == 0 for r in out)
    assert all(r["sent"] == steps // h * 2 * r["nbytes"] for r in out)  # to M − 1 = 2
    other = once(reference_sparseloco, 3, steps, h, values,
                 "all" if mean == "senders" else "senders")
    assert max_diff(other, ref) > 1e-4  # the two means differ by far more than rounding


def test_runs_with_the_senders_mean_divide_each_position_by_its_senders():
    """The runs layout (chunks of the flat vector) with ``sparse_mean="senders"``: the
    gathered sum at each position over the workers that sent it, against the reference's
    ``scatter_reduce`` mean of every worker's decoded message. Mistake caught: dividing by
    M."""
    from loco.comm.codecs import get_codec

    codec = get_codec("topk_2bit", 64, keep=0.25)
    codec.mean = "senders"
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(256, generator=g) for _ in range(3)]
    msgs = [codec.encode(x) for x in xs]
    decoded = [codec.decode(mm, (256,)) for mm in msgs]
    stacked = torch.stack(decoded)
    count = (stacked != 0).sum(0)
    want = torch.where(count > 0, stacked.sum(0) / count.clamp(min=1), 0.0)

    def gather(out, _mine):
        out.copy_(torch.stack([mm.view(-1) for mm in msgs]))

    from loco.comm.reduce import Buffers
    flat = xs[0].clone()
    codec.gather_mean(flat, 3, 3, Buffers(torch.device("cpu")), gather)
    assert torch.allclose(flat, want, rtol=0, atol=1e-7)
    assert not torch.allclose(flat, stacked.sum(0) / 3)


def test_tiles_bad_settings_stop_with_one_line():
    from loco.config import build_config, validate
    from loco.options import ConfigError

    for overrides, option in [({"sparse_values": "stat"}, "sparse_values"),
                              ({"codec": "int2", "sparse_mean": "senders"}, "sparse_mean"),
                              ({"sparse_layout": "squares"}, "sparse_layout")]:
        with pytest.raises((ConfigError, SystemExit, ValueError)) as err:
            validate(build_config(overrides={"algorithm": "sparseloco", **overrides}))
        assert option.replace("_", "-") in str(err.value) or option in str(err.value)


def test_tiles_resume_bit_for_bit():
    from workers import resume_worker

    out = loco.launch(resume_worker, 2, args=(12, 5, 4, "sparseloco"),
                      kwargs=dict(sparse_layout="tiles", sparse_values="stat",
                                  sparse_mean="senders"))
    for straight, resumed in out:
        assert max_diff(straight, resumed) == 0


def test_clip_at_the_median_norm_is_the_reference_codes_clip():
    """``--aggregation clip --guard-factor 1`` is ``batch_decompress``'s ``clip_norm``: each
    message scaled by ``min(median norm / its norm, 1)`` before the senders' mean (here over
    the whole message: the reference clips tensor by tensor). Mistake caught: the clip left
    out (the ×3 worker's values averaged whole)."""
    from loco.comm.codecs import get_codec
    from loco.comm.guard import Guard
    from loco.comm.reduce import Buffers

    codec = get_codec("topk_2bit", 64, keep=0.25)
    codec.mean = "senders"
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(256, generator=g) * s for s in (1.0, 1.2, 3.0)]
    msgs = [codec.encode(x) for x in xs]
    decoded = torch.stack([codec.decode(mm, (256,)) for mm in msgs])
    norms = decoded.norm(dim=1)
    clipped = decoded * (norms.median() / norms).clamp(max=1)[:, None]
    count = (decoded != 0).sum(0)
    want = torch.where(count > 0, clipped.sum(0) / count.clamp(min=1), 0.0)
    flat = xs[0].clone()
    codec.gather_mean(flat, 3, 3, Buffers(torch.device("cpu")),
                      lambda out, _m: out.copy_(torch.stack([m.view(-1) for m in msgs])),
                      None, Guard("clip", 1.0, 3))
    # The scale's rounding and the sum's order: a few ulps of the largest clipped addend, not
    # of the result (two addends of opposite sign cancel to 0.06 from 2.2 and 2.7 here).
    ulps = 4 * torch.finfo(torch.float32).eps * clipped.abs().max()
    assert torch.allclose(flat, want, rtol=1e-6, atol=float(ulps))
    assert not torch.allclose(flat, torch.where(count > 0, decoded.sum(0) / count, 0.0))


def _reads_worker(ctx):
    from loco.comm import hostreads

    from loco.config import TrainConfig, resolve
    from loco.training.build import make_optimizer as build_optimizer

    cfg = resolve(TrainConfig(algorithm="sparseloco", model="tiny", workers=2, sync_every=4,
                              steps=9, sparse_layout="tiles", sparse_values="stat",
                              sparse_mean="senders"))
    model = make_model(layers=2)
    algo = cfg.method_class.from_config(cfg, model, build_optimizer(model, cfg), ctx.comm)
    steps = []
    with hostreads.HostReadCounter() as counter:
        for t in range(9):
            x, y = batch(ctx.rank, t)
            model(x, y).backward()
            algo.step()
            algo.zero_grad()
            steps.append(dict(counter.take()))
    algo.flush()
    return steps


def test_tiles_read_nothing_of_the_device_on_a_step(monkeypatch):
    """The tiled path (permutation, per-tensor bins, senders' counts) makes no host read
    outside a sync, and no more at a sync than the runs' (tests/test_host_reads.py)."""
    from loco.comm import hostreads

    monkeypatch.setenv(hostreads.MODE_ENV, "count")
    for steps in loco.launch(_reads_worker, 2):
        assert not [t for t, reads in enumerate(steps) if reads.get("step")]
        assert max(r.get("sync", 0) for r in steps) <= 5
        assert set().union(*steps) <= {"sync", "host"}


@pytest.mark.parametrize("mean", ["all", "senders"])
def test_sparseloco_with_runs_matches_the_box_written_from_the_docs(mean):
    """loco's first layout (chunks of the flat vector across parameters, the paper's box
    as loco first read it), 3 workers, chunks of 64 keeping 16, against a reference written
    from the docs' definition of the format, not from ``ChunkTopKCodec``. Mistake caught:
    the decoder's high and low halves swapped."""
    out = loco.launch(sparseloco_worker, 3, args=(12, 4),
                      kwargs=dict(codec_block=64, codec_keep=0.25, sparse_mean=mean,
                                  sparse_layout="runs", sparse_values="split"))
    ref = reference_sparseloco(3, 12, 4, "split", mean, runs=(64, 16))
    assert all(max_diff(r["params"], ref) == 0 for r in out)


def test_sparseloco_defaults_are_tiles_split_and_the_senders_mean():
    """The defaults (docs/frontier.md's sweep): the reference's tiles and mean, loco's 2 bits;
    DiLoCo with the same codec keeps loco's first format (runs, the mean over all)."""
    model = make_model(layers=2)
    comm = loco.Comm(None, 0, 1)
    algo = loco.SparseLoCo(model, make_optimizer(model), comm)
    codec = algo.codecs[0]
    assert (type(codec).__name__, codec.values, codec.mean) == ("TiledTopK", "split", "senders")
    plain = loco.DiLoCo(model, make_optimizer(model), comm, codec="topk_2bit",
                        error_feedback=0.95)
    assert (type(plain.codecs[0]).__name__, plain.codecs[0].mean) == ("ChunkTopKCodec", "all")
    with pytest.raises(ValueError, match="sparse_layout applies to the chunked top-k"):
        loco.DiLoCo(model, make_optimizer(model), comm, codec="int2", sparse_layout="tiles")


def test_the_guard_leaves_out_a_garbage_message_in_the_tiled_mean():
    """A worker whose tiled message is ×50 is named ``high`` and left out of the senders'
    mean (the guard judges the tiled messages as it does the runs'). Mistake caught: the
    tiled path not passing its messages' norms to the guard."""
    from loco.comm.guard import Guard
    from loco.comm.reduce import Buffers

    shapes = _shapes()
    codec = TiledTopK("topk_2bit", shapes, 64, K, "split", "senders")
    n = codec.plan.numel
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) for _ in range(4)]
    xs[2] = xs[2] * 50
    msgs = [codec.encode_flat(x, torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8))
            for x in xs]

    def mean_of(rows, guard):
        flat = xs[0].clone()
        codec.gather_mean(flat, len(rows), len(rows), Buffers(torch.device("cpu")),
                          lambda out, _m: out.copy_(torch.cat([msgs[r] for r in rows])),
                          None, guard)
        return flat

    guard = Guard("drop", 4.0, 4)
    guarded = mean_of([0, 1, 2, 3], guard)
    honest = mean_of([0, 1, 3], None)
    assert torch.allclose(guarded, honest, rtol=1e-6, atol=1e-7)
    assert guard.counts[2].sum() > 0 and guard.counts[[0, 1, 3]].sum() == 0
