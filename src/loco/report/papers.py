"""The papers' claims checked on runs: each method's declared claims
(``loco.algorithms.PaperClaim``) against its reference run, seed by seed, and the runs' regime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loco.algorithms import PaperClaim, methods
from loco.comm.codecs.formats import CHUNK_TOPK_CODEC_NAMES
from loco.report.cells import ratio_cell
from loco.report.numbers import baseline, codec_compression
from loco.report.runs import Run
from loco.report.seeds import half_range_pct


#: Options that say where a run is written, not what it does: [`twin`][loco.report.papers.twin]
#: runs may differ in them.
PLACE = frozenset({"out", "wandb_run_name"})


def verdict(met: list[bool]) -> bool | None:
    """A claim's verdict over seeds: True if it holds on every seed, False if on none, None
    (mixed) otherwise.

    Args:
        met: whether it holds, per seed.
    """
    return True if all(met) else False if not any(met) else None


@dataclass
class Claim:
    """One of the papers' claims, checked on the runs of one seed.

    Args:
        text: the claim, naming the methods without a seed.
        measured: what was measured, as the report shows it.
        met: whether it holds.
        pair: a comparison's two values, the method's and its reference's (final eval
            losses, or replicas' spreads), whose gap in % of the reference's is the margin;
            None for other claims.
    """

    text: str
    measured: str
    met: bool
    pair: tuple[float, float] | None = None


def targets(runs: list[Run]) -> list[tuple[str, str, bool | None]]:
    """The papers' claims checked on these runs, seed by seed where there are several.

    Each seed's claims are checked on its own runs ([`claims`][loco.report.papers.claims]), so a
    method is held against the run of the same seed. A loss claim over several seeds reads
    ``+1.20% (seeds: +0.8% to +1.6%; seed spread ±0.9% / ±1.1%)``: the margin's mean over
    the seeds, its range, and the half-range of each method's loss over the seeds in % of
    its mean; another claim gives its measure once where the seeds agree, else per seed.

    Args:
        runs: the runs, in report order.

    Returns:
        (claim, measured, met) per claim that these runs can check; with several seeds, met
            is a [`verdict`][loco.report.papers.verdict]: None where the claim holds on some seeds
            only (mixed).
    """
    by_seed: dict[int | None, list[Run]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, []).append(r)
    if len(by_seed) == 1:
        return [(c.text, c.measured, c.met) for c in claims(runs)]
    merged: dict[str, dict[int | None, Claim]] = {}
    for seed, mine in by_seed.items():
        for c in claims(mine):
            merged.setdefault(c.text, {})[seed] = c
    return [(text, _measured_over_seeds(per_seed), verdict([c.met for c in per_seed.values()]))
            for text, per_seed in merged.items()]


def _measured_over_seeds(per_seed: dict[int | None, Claim]) -> str:
    """A claim's measured cell over seeds (see [`targets`][loco.report.papers.targets])."""
    found = list(per_seed.values())
    if found[0].pair is None:
        texts = {c.measured for c in found}
        return (found[0].measured if len(texts) == 1 else
                "; ".join(f"seed {seed}: {c.measured}" for seed, c in per_seed.items()))
    gaps = [100 * (a - b) / b for a, b in (c.pair for c in found)]
    spreads = [half_range_pct([c.pair[i] for c in found]) for i in (0, 1)]
    return (f"{sum(gaps) / len(gaps):+.2f}% (seeds: {min(gaps):+.1f}% to {max(gaps):+.1f}%; "
            f"seed spread ±{spreads[0]:.1f}% / ±{spreads[1]:.1f}%)")


def twin(runs: list[Run], run: Run, also_free: tuple[str, ...] = (), **want: Any
         ) -> Run | None:
    """Another run of ``run``'s algorithm that holds ``want`` and is otherwise configured as
    ``run`` is, but for where it is written (``PLACE``) and the options ``also_free``: the
    reference a claim holds ``run`` against.

    Args:
        runs: the runs of one seed.
        run: the run.
        also_free: more options the two may differ in.
        **want: option values the twin must have (and ``run`` may not).
    """
    free = PLACE | set(want) | set(also_free)

    def rest(r: Run) -> dict:
        return {k: v for k, v in r.summary.config.items() if k not in free}

    return next((r for r in runs if r is not run and r.method is run.method
                 and all(r.summary.config.get(k) == v for k, v in want.items())
                 and rest(r) == rest(run)), None)


def inner(run: Run) -> str:
    """The inner optimizer ``run`` stepped, in the report's words (``Method.inner_name``)."""
    return run.method.inner_name(run.summary.config or {})


def candidates(runs: list[Run], method: str, by: dict[str, Run]) -> list[Run]:
    """The runs a claim naming ``method`` may be held against: its runs outside a sweep, and
    its [`baseline`][loco.report.numbers.baseline] run (``by``), in report order."""
    cls, base = methods().get(method), by.get(method)
    return [r for r in runs if r.method is cls and (r is base or not r.sweep)]


def reference(runs: list[Run], run: Run, claim: PaperClaim, by: dict[str, Run]
              ) -> Run | None:
    """The run a claim about ``run`` holds it against; None without one.

    A twin ([`twin`][loco.report.papers.twin]) holding the claim's ``want`` where ``run`` holds
    none of it (``FP4 ≈ fp32``: a Streaming run in fp32). Else a run of the named method
    with ``run``'s inner optimizer ([`inner`][loco.report.papers.inner]; MuLoCo against
    DataParallel with Muon inside): the first holding ``want`` (NoLoCo against a DiLoCo run
    with heavy-ball momentum, the NoLoCo paper's), else that method's baseline run, else its
    first. Where no run of that method has ``run``'s inner optimizer, the same choice among
    all of its runs: the comparison crosses optimizers
    ([`twin_note`][loco.report.papers.twin_note] says so). Only runs with ``run``'s injected
    failure (``fault``: none, or the same) count: a run that lost a worker half-way is no
    reference for one that did not (``--preset hetero``'s ``ddp-fail``), nor the reverse.

    Args:
        runs: the runs of one seed.
        run: the run the claim is about.
        claim: the claim.
        by: each method's [`baseline`][loco.report.numbers.baseline] run, by name.
    """
    config = run.summary.config
    if claim.against == "twin":
        if any(config.get(k) == v for k, v in claim.want.items()):
            return None
        return twin(runs, run, claim.free, **claim.want)
    mine = [r for r in candidates(runs, claim.against, by)
            if r.summary.config.get("fault") == config.get("fault")]
    pool = [r for r in mine if inner(r) == inner(run)] or mine
    wanted = [r for r in pool if claim.want and all(
        r.summary.config.get(k) == v for k, v in claim.want.items())]
    base = [r for r in pool if r is by.get(claim.against)]
    return next(iter(wanted + base + pool), None)


def twin_note(run: Run, ref: Run) -> str:
    """What a claim naming a method says of the run it used: ``" (twin: ddp-muon, Muon
    inside)"`` where both step the same inner optimizer, else ``" (crosses optimizers:
    sign-SGD against AdamW in ddp)"``.

    Args:
        run: the run the claim is about.
        ref: its [`reference`][loco.report.papers.reference].
    """
    mine, theirs = inner(run), inner(ref)
    if mine == theirs:
        return f" (twin: {ref.group}, {mine} inside)"
    return f" (crosses optimizers: {mine} against {theirs} in {ref.group})"


def subjects(runs: list[Run], run: Run, claim: PaperClaim, by: dict[str, Run]) -> list[Run]:
    """The runs of ``run``'s method a claim of it holds of (``run``: its baseline).

    A twin claim: every run of the method outside a sweep that has a twin. A claim naming a
    method: ``run``, and per other inner optimizer among the method's runs outside a sweep
    the first with it, where the named method has a run with that one too (MuLoCo, DiLoCo
    with Muon inside, against DataParallel with Muon inside).

    Args:
        runs: the runs of one seed.
        run: the method's baseline run.
        claim: one of the method's claims.
        by: each method's baseline run, by name.
    """
    mine = [r for r in runs if r.method is run.method and not r.sweep]
    if claim.against == "twin":
        return mine
    firsts: dict[str, Run] = {}
    for r in mine:
        firsts.setdefault(inner(r), r)
    theirs = {inner(r) for r in candidates(runs, claim.against, by)}
    return [run] + [r for name, r in firsts.items() if name != inner(run) and name in theirs]


def mean_spread(run: Run) -> float | None:
    """The mean of the replicas' RMS spread over a run's logged measures (``--spread-every``);
    None where none was logged.

    Args:
        run: a run.
    """
    spreads = [rec["spread"] for rec in run.records if rec.get("spread") is not None]
    return sum(spreads) / len(spreads) if spreads else None


def routing_claim(runs: list[Run]) -> list[Claim]:
    """NoLoCo's claim that random pipeline routing lowers the replicas' spread (the paper:
    by 10-15%): each run with random routing against its [`twin`][loco.report.papers.twin] with
    fixed routing (labelled runs, or a ``--sweep routing=fixed,random``), by their mean spread
    over the run ([`mean_spread`][loco.report.papers.mean_spread]).

    Args:
        runs: the runs of one seed.

    Returns:
        One Claim per such pair (none without one).
    """
    rows = []
    for routed in runs:
        fixed = (twin(runs, routed, routing="fixed")
                 if routed.summary.config.get("routing") == "random" else None)
        if fixed is None:
            continue
        a, b = mean_spread(routed), mean_spread(fixed)
        if a is None or b is None or not b:
            continue
        change = 100 * (a - b) / b
        rows.append(Claim(f"random routing lowers the replicas' spread: {routed.group_name} "
                          f"below {fixed.group_name}", f"{change:+.2f}%", change < 0, (a, b)))
    return rows


def claims(runs: list[Run]) -> list[Claim]:
    """The papers' claims checked on the runs of one seed (or of no seed): every method's
    declared claims (``Method.claims``) on its [`subjects`][loco.report.papers.subjects],
    each against its [`reference`][loco.report.papers.reference] (a claim naming a method
    says which run it used: [`twin_note`][loco.report.papers.twin_note]), then random
    routing against fixed ([`routing_claim`][loco.report.papers.routing_claim]).

    Args:
        runs: the runs, in report order, of one seed.

    Returns:
        One Claim per claim that these runs can check.
    """
    by = {a: r for a in methods() if (r := baseline(runs, a)) is not None}
    rows = []
    for run in by.values():
        for claim in run.method.claims:
            for subject in subjects(runs, run, claim, by):
                ref = reference(runs, subject, claim, by)
                row = None if ref is None else CHECKS[claim.kind](subject, ref, claim)
                if row is not None:
                    if claim.against != "twin":
                        row.text += twin_note(subject, ref)
                    rows.append(row)
    return rows + routing_claim(runs)


def loss_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``run``'s final eval loss at most ``claim.limit`` % above ``ref``'s."""
    la, lb = run.summary.final_eval_loss, ref.summary.final_eval_loss
    gap = 100 * (la - lb) / lb
    text = (claim.text or "within {limit:g}% of {ref}'s").format(limit=claim.limit,
                                                                   ref=ref.group_name)
    return Claim(f"{run.group_name} eval loss {text}", f"{gap:+.2f}%", gap <= claim.limit,
                 (la, lb))


def bytes_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``ref`` sends at least ``claim.limit`` times ``run``'s bytes per worker."""
    sent = run.summary.bytes_sent_per_rank
    ratio = ref.summary.bytes_sent_per_rank / sent if sent else float("inf")
    wire = ref.method.wire(ref.summary.config)
    note = f" ({ref.group_name}'s gradients in {wire})" if wire else ""
    return Claim(f"{ref.group_name} sends at least {claim.limit:g}× the bytes of "
                 f"{run.group_name}", f"{ratio_cell(ratio)}{note}", ratio >= claim.limit)


def peak_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim:
    """``run``'s peak sync about P times below ``ref``'s from the fragments alone: a
    narrower codec alone makes the peak smaller (``ref`` sends fp32), so its share is
    factored out, and what is left must be at least 0.9 P."""
    config = run.summary.config
    p = config["fragments"]
    peak = run.summary.peak_sync_bytes_per_rank
    ratio = ref.summary.peak_sync_bytes_per_rank / peak if peak else float("inf")
    codec = config.get("codec", "fp32")
    block = config.get("codec_chunk") if codec in CHUNK_TOPK_CODEC_NAMES else None
    squeeze = codec_compression(codec, block or config.get("codec_block", 32),
                                config.get("codec_keep"))
    frag = ratio / squeeze
    # What the split allows at best: the whole model against the largest fragment.
    largest = max((f["elements"] for f in run.summary.fragments or []), default=0)
    cap = (f"; the largest fragment allows {ratio_cell(run.summary.model_parameters / largest)}"
           if largest else "")
    return Claim(f"{run.group_name}'s peak sync about P={p}× below {ref.group_name}'s, from "
                 f"the fragments alone", f"{ratio_cell(frag)} ({ratio_cell(ratio)} in all, "
                 f"{ratio_cell(squeeze)} of it from {codec}{cap})", frag >= 0.9 * p)


def loss_at(run: Run, axis: str, x: float) -> float | None:
    """``run``'s eval loss at ``x`` on ``axis`` (``tokens`` or ``train_seconds``), linearly
    between its periodic evaluations and its final one; None before its first or past its
    end.

    Args:
        run: a run.
        axis: the records' key of the x axis (the summary holds its final value).
        x: where.
    """
    points = sorted([(rec[axis], rec["eval_loss"]) for rec in run.records
                     if rec.get("eval_loss") is not None and rec.get(axis) is not None]
                    + [(getattr(run.summary, axis), run.summary.final_eval_loss)])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


def equal_claim(axis: str, what: str) -> Callable[[Run, Run, PaperClaim], Claim | None]:
    """The check of a loss claim at an equal ``axis`` (tokens, training seconds): both
    runs' eval losses where the shorter of the two ended, ``run``'s at most ``limit`` %
    above ``ref``'s (``limit`` 0: below it)."""
    def check(run: Run, ref: Run, claim: PaperClaim) -> Claim | None:
        x = min(getattr(run.summary, axis), getattr(ref.summary, axis))
        la, lb = loss_at(run, axis, x), loss_at(ref, axis, x)
        if la is None or lb is None:
            return None
        gap = 100 * (la - lb) / lb
        text = (claim.text or "within {limit:g}% of {ref}'s").format(limit=claim.limit,
                                                                       ref=ref.group_name)
        met = gap < 0 if claim.limit == 0 else gap <= claim.limit
        return Claim(f"{run.group_name} eval loss at equal {what} {text}", f"{gap:+.2f}%",
                     met, (la, lb))
    return check


def goodput_claim(run: Run, ref: Run, claim: PaperClaim) -> Claim | None:
    """``run``'s goodput at least ``claim.limit`` (a fraction); ``ref``'s is shown."""
    mine, theirs = (r.summary.goodput and r.summary.goodput["total"] for r in (run, ref))
    if mine is None or theirs is None:
        return None
    return Claim(f"{run.group_name} goodput at least {claim.limit:.0%} (against "
                 f"{ref.group_name}'s)", f"{mine:.1%} ({ref.group_name}: {theirs:.1%})",
                 mine >= claim.limit)


#: How each kind of declared claim (``loco.algorithms.PaperClaim.kind``) is checked.
CHECKS = {"loss": loss_claim, "bytes": bytes_claim, "peak": peak_claim,
          "goodput": goodput_claim, "wallclock": equal_claim("train_seconds", "wall-clock"),
          "tokens": equal_claim("tokens", "tokens")}


#: The smallest tokens per parameter of the papers' runs (Streaming DiLoCo's 1B model on 25B
#: tokens); the regime sentence holds a comparison's against it.
PAPER_TOKENS_PER_PARAMETER = 25


def regime(runs: list[Run]) -> str:
    """One sentence saying what regime the runs are in against the papers': training tokens
    per model parameter and outer steps (per H the runs use).

    Args:
        runs: the runs, in report order.
    """
    first = runs[0].summary
    ratio = first.tokens / first.model_parameters
    hs = sorted({r.summary.config["sync_every"] for r in runs
                 if "sync_every" in r.method.uses()})
    outer = " and".join(f" {first.inner_steps // h} outer steps at H = {h}" for h in hs)
    early = ratio < PAPER_TOKENS_PER_PARAMETER
    return (f"Regime: {ratio:.2g} training tokens per model parameter"
            + (f",{outer}" if hs else "") + "; the papers train on "
            f"{PAPER_TOKENS_PER_PARAMETER} or more tokens per parameter (Streaming DiLoCo's "
            "1B model: 25B and 250B tokens) with H = 30 to 500"
            + (", so these runs compare the methods early in training, while the loss still "
               "falls fast." if early else "."))
