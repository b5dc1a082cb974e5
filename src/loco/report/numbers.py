"""``compare.json``'s numbers: each run against the baselines, and the wire formats' compression."""

from __future__ import annotations

import os

from loco.algorithms import methods
from loco.comm.codecs.formats import (CHUNK_TOPK_CODEC_NAMES, CODEC_BITS, DEFAULT_CHUNK,
                                      DEFAULT_CHUNK_KEEP, DEFAULT_KEEP, chunk_kept,
                                      chunk_topk_bytes)
from loco.comm.codecs.formats import SPARSE_CODEC_NAMES as SPARSE_CODECS
from loco.report.runs import Run
from loco.report.seeds import over_seeds, seed_groups


def codec_compression(codec: str, block: int | None = 32, keep: float | None = None) -> float:
    """How many times fewer bytes than fp32 a wire format sends per value, its scales
    included: ``32 / (bits + 8 / block)`` (1 for fp32, 2 for bf16, 7.53 for FP4 at block 32).

    The dropping codecs send ``keep`` of the values in fp32: ``32 / (32 keep + where)``,
    ``where`` the bits per value that say which were kept: ``topk``'s bitmap or 16-bit
    indices, whichever is smaller (rows up to 65536 values), none for ``dare`` and
    ``random_drop``, whose 8-byte seed per row is left out (6.4 for ``topk`` and 8 for the
    others at keep 1/8).

    Args:
        codec: a codec name, a key of ``CODEC_BITS``.
        block: values per scale byte of the 8-, 4- and 2-bit codecs, >= 1, or per chunk of
            the chunked top-k codecs; default 32 (None: the codec's own, 32 or 4096); ignored
            for the others.
        keep: the share of values the dropping codecs send, in (0, 1]; default None: 1/8
            (1/64 of each chunk for the chunked top-k); ignored for the others.

    Returns:
        The compression factor against fp32 (below 1 only for a dropping codec keeping
            nearly every value).

    Raises:
        KeyError: an unknown codec.
    """
    bits = CODEC_BITS[codec]
    if codec in CHUNK_TOPK_CODEC_NAMES:
        chunk = DEFAULT_CHUNK if block is None else block
        k = chunk_kept(chunk, DEFAULT_CHUNK_KEEP if keep is None else keep)
        return 32 * chunk / (8 * chunk_topk_bytes(codec, chunk, k))
    block = 32 if block is None else block
    if codec in SPARSE_CODECS:
        keep = DEFAULT_KEEP if keep is None else keep
        where = min(1.0, 16 * keep) if codec == "topk" else 0.0
        return 32 / (bits * keep + where)
    return 32 / (bits + 8 / block) if bits < 16 else 32 / bits


#: Downstream task metrics (``loco eval``) a report shows, by preference: both papers quote
#: accuracy, HellaSwag, PIQA and ARC-Easy usually length-normalized.
MAIN_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc", "word_perplexity",
                "perplexity")


def main_metric(entry: dict) -> tuple[str, float | None] | None:
    """A downstream task's headline metric: the first of ``MAIN_METRICS`` it has, else its
    first; None when it has none.

    Args:
        entry: the task's ``{metric: value}`` (``summary.json``'s ``downstream[task]``).
    """
    names = [k for k in entry if k not in ("samples", "shots")]
    for name in MAIN_METRICS:
        if name in entry:
            return name, entry[name]
    return (names[0], entry[names[0]]) if names else None


def method_setting(run: Run) -> str:
    """The method's own knobs in one short phrase (``Method.setting``), its inner optimizer
    where it is not the method's default (``", Muon inside"``), and its pipeline stages.

    Args:
        run: a run.
    """
    text = run.method.setting(run.summary.config)
    inner = run.method.inner_name(run.summary.config or {})
    if inner != run.method.inner_name({}):
        text += f", {inner} inside"
    if (run.summary.stages or 1) > 1:
        text += f", {run.summary.stages} stages ({run.summary.routing} routing)"
    return text


def comparison(runs: list[Run], out: str = ".") -> dict[str, dict]:
    """``compare.json``: per run label, its summary plus a ``compare`` entry with the numbers
    relative to DataParallel (and DiLoCo for the peak).

    Args:
        runs: the runs, in report order.
        out: the directory the report goes to; ``run_dir`` is relative to it.

    Returns:
        By label: every field of the run's summary (``Summary.to_dict()``: a key an older
            run did not write is None) and ``compare``: ``label``,
            ``method``, ``setting``, ``run_dir``, ``eval_loss_vs_ddp_pct``,
            ``ddp_bytes_over_bytes``, ``diloco_peak_over_peak`` (None where there is no such
            baseline), ``grad_codec`` (DataParallel's runs; None for others) and ``sweep`` (a
            sweep run's grid point; None for others) and ``downstream`` (``loco eval``'s
            headline metric of each task, ``{task: {"metric", "value"}}``; None for a run
            not evaluated). With several seeds, the baselines are the runs of the same seed,
            and ``compare`` adds ``seed`` and ``over_seeds``: its method's (grid point's)
            numbers over the seeds (see [`over_seeds`][loco.report.seeds.over_seeds]).
    """
    groups = dict(seed_groups(runs))
    numbers = {}
    for r in runs:
        peers = [p for p in runs if p.seed == r.seed]
        ddp, diloco = baseline(peers, "ddp"), baseline(peers, "diloco")
        s = r.summary
        sweep = r.sweep
        rel = {"label": r.label, "method": r.name, "setting": method_setting(r),
               "run_dir": os.path.relpath(r.path, out), "eval_loss_vs_ddp_pct": None,
               "ddp_bytes_over_bytes": None, "diloco_peak_over_peak": None,
               "grad_codec": r.method.wire(s.config),
               "bits_per_parameter_per_step": s.bits_per_parameter_per_step,
               "bytes_per_token": s.bytes_per_token,
               "sweep": sweep[1] if sweep else None,
               "downstream": {task: dict(zip(("metric", "value"), main_metric(entry)))
                              for task, entry in (s.downstream or {}).items()
                              if main_metric(entry)} or None}
        if groups:
            rel.update(seed=r.seed, over_seeds=over_seeds(groups[r.group]))
        if ddp is not None:
            base = ddp.summary.final_eval_loss
            rel["eval_loss_vs_ddp_pct"] = 100 * (s.final_eval_loss - base) / base
            if s.bytes_sent_per_rank:
                rel["ddp_bytes_over_bytes"] = (ddp.summary.bytes_sent_per_rank
                                               / s.bytes_sent_per_rank)
        if diloco is not None and s.peak_sync_bytes_per_rank:
            rel["diloco_peak_over_peak"] = (diloco.summary.peak_sync_bytes_per_rank
                                            / s.peak_sync_bytes_per_rank)
        numbers[r.label] = {**s.to_dict(), "compare": rel}
    return numbers


def baseline(runs: list[Run], algorithm: str) -> Run | None:
    """The run that stands for ``algorithm`` in the comparisons: the one labelled with the
    algorithm's own name (a seed aside), else the first not part of a sweep, else the first.

    Args:
        runs: the runs, in report order.
        algorithm: an algorithm name.

    Returns:
        The run, or None when no run is of that algorithm.
    """
    cls = methods().get(algorithm)
    mine = [r for r in runs if r.method is cls]
    return next((r for r in mine if r.group == algorithm),
                next((r for r in mine if not r.sweep), mine[0] if mine else None))
