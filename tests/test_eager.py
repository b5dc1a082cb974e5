"""Eager updates (Kale, Douillard and Donchev 2025, arXiv 2502.12996) against a plain
single-process reference written from the paper's Algorithm 3, on real gloo groups.

The box, for worker m at the end of a round (its round t's pseudo-gradient Δ_m^(t) sent,
the average of the round d rounds back at hand)::

    Δ̃_m^(t) = (1/M) (Δ_m^(t) + Σ_{m'≠m} Δ_{m'}^(t−d))     (zeros before the first rounds)
    θ_m ← OuterOpt_m(θ_m, Δ̃_m^(t))

d = 1 is "1-outer-step eager", d = 2 its "2-outer-steps eager" (the paper's Table 2). The
reference keeps every worker's pseudo-gradient of every round and sums the others' by
name; each worker has its own outer parameters and Nesterov momentum, stepped by hand.
It knows nothing of τ: the average is only used d sends later, so the library's result
must not depend on when it lands. Streaming DiLoCo's schedule and fragments are literal
tables (P = 2, H = 6: the paper's send at (p + 1) H / P), not the library's formulas.

The reference groups the sum as the box writes it; the library keeps
``Δ̄ − Δ_m / M`` of the previous sync and adds ``Δ_m / M`` to it, and its outer step is
torch's fused SGD. The two differ by rounding, so the comparison has a tolerance (see
``TOLERANCE``)."""

import pytest
import torch

import loco
from workers import (batch, make_model, make_optimizer, max_diff, once, params_of,
                     resume_worker, smooth_optimizer, ulps)

pytestmark = pytest.mark.numerics

H = 6  # P = 2: sends 3 steps apart, so τ = 1 and τ = H/P − 1 = 2 differ
STEPS = 3 * H + 3  # three rounds and a part: with d = 2 the others' share of rounds 1 and
# 2 are applied, and the last sync is in flight at the end (flushed: DiLoCo's, sent at 18,
# lands at 23; Streaming DiLoCo's, sent at 21, at 22 or 23)
LR, MU = 0.4, 0.9
# Streaming DiLoCo, P = 2 on the 4-block test model, dealt "strided" (block i to fragment
# i mod P; the embedding with fragment 0, the final norm with the last): by name prefix.
FRAGMENTS = {1: [("",)], 2: [("embed.", "blocks.0.", "blocks.2."),
                             ("blocks.1.", "blocks.3.", "norm.")]}
SENDS = {1: {0: 0}, 2: {3: 0, 0: 1}}  # t % H -> the fragment sent after inner step t
# Rounding: the two groupings of Δ̃, and the fused SGD and lerp against the reference's
# expressions, each differ by an ulp or two of the values; the inner AdamW steps (eps =
# 1e-3, whose step is continuous in the gradient: tests/workers.py) carry that on without
# blowing it up. Measured: at most 2 ulps of the parameters' largest magnitude, with the
# AVX2 kernels and with ATEN_CPU_CAPABILITY=default (AdamW's default eps 1e-8 gives up to
# 10); 16 leaves a margin of 8x. The workers' copies differ by over 7e4 ulps, and each
# planted mistake below moves a worker's copy by over 8e4 (measured with H = 6).
TOLERANCE = 16


def eager_worker(ctx, steps, fragments, overlap, alpha, variant):
    """DiLoCo (P = 1) or Streaming DiLoCo with eager updates on the test model, AdamW with
    eps 1e-3; returns this worker's global copy after the flush."""
    model = make_model(layers=4)
    opt = smooth_optimizer(model)
    kw = dict(sync_every=H, codec="fp32", outer_lr=LR, outer_momentum=MU, eager=True,
              eager_variant=variant)
    if fragments == 1:  # as loco train --algorithm diloco --eager builds it
        algo = loco.DiLoCo(model, opt, ctx.comm, **kw)
        assert (algo.overlap, algo.alpha) == (overlap, alpha) == (H - 1, 0.0)
    else:
        algo = loco.StreamingDiLoCo(model, opt, ctx.comm, fragments=fragments,
                                    overlap=overlap, alpha=alpha, **kw)
    for t in range(steps):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        algo.step()
        algo.zero_grad()
    algo.flush()
    return params_of(algo.global_parameters())


def reference(workers, steps, fragments, alpha, delay):
    """The box in one process: returns every worker's outer parameters by name. It does
    not depend on τ: the tests take it through ``once``, computed once for the runs of
    both τ and for the planted mistakes."""
    M = workers
    models = [make_model(layers=4) for _ in range(M)]
    opts = [smooth_optimizer(m) for m in models]
    named = [dict(m.named_parameters()) for m in models]
    groups = [[n for n in named[0] if n.startswith(prefixes)] for prefixes in
              FRAGMENTS[fragments]]
    outer = [{n: p.detach().clone() for n, p in named[m].items()} for m in range(M)]
    velocity = [{n: torch.zeros_like(p) for n, p in outer[m].items()} for m in range(M)]
    history = [[] for _ in groups]  # per fragment, per sync: every worker's Δ by name
    for t in range(1, steps + 1):
        for m in range(M):
            x, y = batch(m, t - 1)
            models[m](x, y).backward()
            opts[m].step()
            opts[m].zero_grad()
        p = SENDS[fragments].get(t % H)
        if p is None:
            continue
        with torch.no_grad():
            deltas = [{n: outer[m][n] - named[m][n] for n in groups[p]} for m in range(M)]
            late = history[p][-delay] if len(history[p]) >= delay else None
            history[p].append(deltas)
            for m in range(M):
                for n in groups[p]:
                    others = torch.zeros_like(outer[m][n])
                    for k in range(M):
                        if late is not None and k != m:
                            others += late[k][n]
                    g = (deltas[m][n] + others) / M
                    velocity[m][n] = MU * velocity[m][n] + g  # Nesterov, as DiLoCo's
                    outer[m][n] -= LR * (g + MU * velocity[m][n])
                    named[m][n].copy_(alpha * named[m][n] + (1 - alpha) * outer[m][n])
    return outer


def compare(out, ref):
    """Every worker's global copy against its reference, within ``TOLERANCE`` ulps; the
    workers' copies differ (each stepped with its own share)."""
    for got, want in zip(out, ref):
        assert max_diff(got, want) <= ulps(want, TOLERANCE), max_diff(got, want)
    assert max_diff(out[0], out[1]) > ulps(ref[0], 1e3)


@pytest.mark.parametrize("variant,delay", [("1-outer-step", 1), ("2-outer-steps", 2)])
@pytest.mark.parametrize("fragments,overlap,alpha,workers", [
    (1, H - 1, 0.0, 3),  # DiLoCo with --eager: the average lands at the step before the next
    (2, 1, 0.5, 2), (2, 2, 0.5, 2)])  # Streaming DiLoCo, τ = 1 and H/P - 1: the same result
def test_eager_matches_the_box(variant, delay, fragments, overlap, alpha, workers):
    out = loco.launch(eager_worker, workers, args=(STEPS, fragments, overlap, alpha, variant))
    compare(out, once(reference, workers, STEPS, fragments, alpha, delay))


def _own_share_whole(orig):
    """Eager.step with Δ̃ = Δ_m + others: the own term without its 1/M."""
    def step(self, fragment, agree):
        fragment.grad.copy_(self.own[:fragment.grad.numel()]).add_(
            self.others[fragment.index][0])
        fragment.outer_optimizer.step()
        return True
    return step


def _others_with_own(orig):
    """Eager.landed keeping the whole average Δ̄ as the others' share."""
    def landed(self, fragment, finite):
        orig(self, fragment, finite)
        self.others[fragment.index][-1].copy_(fragment.grad)
    return landed


def _latest_others(orig):
    """Eager.step with the newest of the kept shares in place of the oldest."""
    def step(self, fragment, agree):
        shares = self.others[fragment.index]
        shares.reverse()
        try:
            return orig(self, fragment, agree)
        finally:
            shares.reverse()
    return step


MISTAKES = {  # name -> (the Eager method replaced, its replacement given the original, d)
    "the own term without its 1/M": ("step", _own_share_whole, 1),
    "the whole average kept: this worker's Δ counted twice": ("landed", _others_with_own, 1),
    "2-outer-steps taking the last sync's share": ("step", _latest_others, 2)}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_mistake_is_caught(mistake, monkeypatch):
    """Each mistake, planted in the library for the run, takes a worker's copy far outside
    the tolerance of the box's reference: the reference can fail."""
    from loco.algorithms.eager import VARIANTS, Eager

    method, replace, delay = MISTAKES[mistake]
    monkeypatch.setattr(Eager, method, replace(getattr(Eager, method)))
    variant = {d: v for v, d in VARIANTS.items()}[delay]
    out = loco.launch(eager_worker, 2, args=(STEPS, 2, 1, 0.5, variant))
    ref = once(reference, 2, STEPS, 2, 0.5, delay)
    assert max(max_diff(got, want) for got, want in zip(out, ref)) > ulps(ref[0], 1e4)


@pytest.mark.parametrize("variant,split,launcher,shards", [
    ("1-outer-step", 16, "threads", 1),  # fragment 0 sent at 15, in flight until 17
    ("2-outer-steps", 28, "threads", 1),  # in flight, both of every fragment's shares held
    ("2-outer-steps", 29, "processes", 2)])  # just landed; workers of 2 ranks, each
def test_a_checkpoint_resumes_bit_identically(variant, split, launcher, shards):
    """H = 12, P = 4 (sends 3 steps apart), τ = 2: a checkpoint with a sync in flight, or just
    after it landed, resumes on the same bits as the run that went straight on (for two
    more sends of every fragment, which use both kept shares); also
    through torch.distributed.checkpoint (workers of 2 ranks, each holding half of every
    eager state), as loco train saves."""
    kw = dict(fragments=4, overlap=2, alpha=0.5, layers=4, eager=True, eager_variant=variant)
    for straight, resumed in loco.launch(resume_worker, launcher=launcher,
                                         mesh=loco.Mesh(2, 1, shards),
                                         args=(4 * 12, split, 12, "streaming"),
                                         kwargs=kw):
        assert max_diff(straight, resumed) == 0


def test_bad_variants_are_refused_in_one_line():
    """A variant not of the paper's two, or one without eager updates: a ValueError (API)
    or a one-line ConfigError naming --eager-variant (CLI), before any worker starts.
    With eager updates no replicated state is checked: the copies differ by design."""
    from loco.config import ConfigError, build_config
    from loco.config.train_config import validate

    model = make_model()
    comm = loco.Comm(None, 0, 1)
    try:
        with pytest.raises(ValueError, match=r"^eager_variant must be one of 1-outer-step, "
                                             r"2-outer-steps \(got 'two'\)$"):
            loco.DiLoCo(model, make_optimizer(model), comm, eager=True, eager_variant="two")
        with pytest.raises(ValueError, match=r"^eager_variant applies only with eager=True"):
            loco.StreamingDiLoCo(model, make_optimizer(model), comm,
                                 eager_variant="2-outer-steps")
        algo = loco.DiLoCo(model, make_optimizer(model), comm, eager=True)
        assert algo.eager.delay == 1 and algo.replicated_tensors() == []
    finally:
        comm.close()
    cfg = build_config(overrides={"algorithm": "streaming", "eager_variant": "2-outer-steps"})
    with pytest.raises(ConfigError, match=r"^--eager-variant: applies only with --eager "
                                          r"\(got '2-outer-steps'\)$"):
        validate(cfg)
