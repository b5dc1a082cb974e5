"""The claims a comparison checks beyond the loss gaps of tests/test_compare.py and
tests/test_seeds.py: FP4 against a Streaming run in fp32, DiLoCo against no communication,
random routing's replica spread, seed by seed; the report's regime sentence; and the
``evidence`` preset, which must plan every claim it is there to test (no training)."""

import pytest

from loco import compare
from loco.algorithms import StreamingDiLoCo
from loco.report import (Run, claims, mean_spread, order_key, reference, regime,
                         routing_claim, targets)

FP4_CLAIM = StreamingDiLoCo.claims[0]  # FP4 ≈ fp32: against a twin in fp32


def fp32_twin(runs, streaming):
    """The reference of Streaming DiLoCo's FP4 claim."""
    return reference(runs, streaming, FP4_CLAIM, {})


def run(label, algorithm, loss=5.0, seed=None, spreads=(), summary=None, **config):
    """A finished run as summary.json and metrics.jsonl read, with a spread logged per value
    of ``spreads``."""
    config = {"seed": seed if seed is not None else 0, "sync_every": 10, "fragments": 2,
              "overlap": "1", "mixing": 0.5, "codec": "fp32", "group_size": 2, "gamma": 0.7,
              **config}
    records = [{"step": 10 * (i + 1), "spread": s} for i, s in enumerate(spreads)]
    records.insert(1, {"step": 5, "loss": 6.0})  # a record without a spread is skipped
    return Run(label, label, {"algorithm": algorithm, "final_eval_loss": loss,
                              "bytes_sent_per_rank": 10, "peak_sync_bytes_per_rank": 5,
                              "model_parameters": 1000, "tokens": 2000, "inner_steps": 300,
                              "config": config, **(summary or {})}, records)


def by_text(rows):
    return {c.text: c for c in rows}


# ------------------------------------------------------------------------------ FP4 vs fp32
def test_fp4_is_held_against_the_streaming_run_in_fp32():
    fp4 = run("streaming", "streaming", 5.04, codec="fp4_e3m0")
    fp32 = run("streaming-fp32", "streaming", 5.0)
    assert fp32_twin([fp4, fp32], fp4) is fp32
    row = by_text(claims([fp4, fp32]))[
        "Streaming DiLoCo eval loss within 1% of streaming-fp32 (Streaming DiLoCo)'s"]
    assert (row.measured, row.met, row.pair) == ("+0.80%", True, (5.04, 5.0))
    worse = run("streaming", "streaming", 5.06, codec="fp4_e3m0")
    assert not by_text(claims([worse, fp32]))[row.text].met  # +1.2%


def test_no_fp4_claim_without_a_true_twin():
    fp4 = run("streaming", "streaming", codec="fp4_e3m0")
    # other fragments: not the same Streaming, so no reference
    assert fp32_twin([fp4, run("wide", "streaming", fragments=4)], fp4) is None
    # the baseline itself in fp32: nothing to hold against
    plain = run("streaming", "streaming")
    assert fp32_twin([plain, run("wide", "streaming")], plain) is None
    # a DiLoCo run is no twin, and the other claims go on without one
    texts = [c.text for c in claims([fp4, run("diloco", "diloco")])]
    assert not any("streaming-fp32" in t or "1% of" in t for t in texts)
    assert ("Streaming DiLoCo eval loss within 2% of DiLoCo's (twin: diloco, AdamW inside)"
            in texts)


# ------------------------------------------------------------------------------ vs Local
@pytest.mark.parametrize("diloco,met", [(5.2, True), (5.4, False)])
def test_diloco_must_end_below_no_communication(diloco, met):
    rows = by_text(claims([run("diloco", "diloco", diloco), run("local", "local", 5.3)]))
    row = rows["DiLoCo eval loss below Local's (no communication) (twin: local, AdamW inside)"]
    assert row.met is met and row.pair == (diloco, 5.3)
    assert row.measured == f"{100 * (diloco - 5.3) / 5.3:+.2f}%"


# ------------------------------------------------------------------------------ fair twins
DDP_CLAIM = "eval loss within 5% of {}'s"


def test_a_muon_method_is_held_against_the_muon_twin_and_says_so():
    """MuLoCo (DiLoCo with Muon inside) against DataParallel with Muon inside, DiLoCo with
    AdamW inside against DataParallel with AdamW inside, whatever the order of the runs; no
    Local with Muon inside, so MuLoCo is not held against Local at all."""
    ddp = run("ddp", "ddp", 4.8)
    ddp_muon = run("ddp-muon", "ddp", 4.44, inner_optimizer="muon", lr=0.03)
    diloco = run("diloco", "diloco", 5.07)
    muloco = run("muloco", "diloco", 4.78, inner_optimizer="muon", lr=0.03, codec="int2")
    runs = [ddp_muon, ddp, diloco, muloco, run("local", "local", 5.3)]
    rows = by_text(claims(runs))
    fair = rows["muloco (DiLoCo) " + DDP_CLAIM.format("ddp-muon (DataParallel)")
                + " (twin: ddp-muon, Muon inside)"]
    assert fair.pair == (4.78, 4.44) and fair.measured == "+7.66%" and not fair.met
    plain = rows["DiLoCo " + DDP_CLAIM.format("DataParallel") + " (twin: ddp, AdamW inside)"]
    assert plain.pair == (5.07, 4.8) and plain.met is False
    assert not any(t.startswith("muloco") and "Local" in t for t in rows)
    assert "DiLoCo eval loss below Local's (no communication) (twin: local, AdamW inside)" in rows


def test_an_adamw_method_takes_the_adamw_run_over_a_muon_baseline():
    """The same inner optimizer wins over the baseline: with DataParallel's first run (its
    baseline) Muon inside, DiLoCo with AdamW inside is held against the AdamW one."""
    ddp_muon = run("ddp-muon", "ddp", 4.44, inner_optimizer="muon")
    ddp_adamw = run("ddp-adamw", "ddp", 4.8, inner_optimizer="adamw")
    diloco = run("diloco", "diloco", 5.0)
    (row,) = [c for c in claims([ddp_muon, ddp_adamw, diloco]) if "5%" in c.text]
    assert row.text == ("DiLoCo " + DDP_CLAIM.format("ddp-adamw (DataParallel)")
                        + " (twin: ddp-adamw, AdamW inside)")
    assert row.pair == (5.0, 4.8)


def test_without_a_same_optimizer_twin_the_claim_says_it_crosses_optimizers():
    """DeMo is its own optimizer (sign-SGD), and a DiLoCo with Muon inside has no
    DataParallel with Muon inside here, nor does Muon with Keller Jordan's scale count as the
    same Muon: each claim is still checked, against the baseline, and says so."""
    ddp = run("ddp", "ddp", 4.8)
    texts = [c.text for c in claims([ddp, run("demo", "demo", 4.7)])]
    assert "DeMo " + DDP_CLAIM.format("DataParallel") + (
        " (crosses optimizers: sign-SGD against AdamW in ddp)") in texts
    assert ("DataParallel sends at least 10× the bytes of DeMo (crosses optimizers: sign-SGD "
            "against AdamW in ddp)") in texts
    muon = run("diloco", "diloco", 4.9, inner_optimizer="muon")
    rows = by_text(claims([ddp, muon]))
    row = rows["DiLoCo " + DDP_CLAIM.format("DataParallel")
               + " (crosses optimizers: Muon against AdamW in ddp)"]
    assert row.pair == (4.9, 4.8)
    original = run("ddp-kj", "ddp", 4.5, inner_optimizer="muon", muon_scale="original")
    texts = [c.text for c in claims([ddp, original, muon])]
    assert any(t.endswith("(crosses optimizers: Muon against AdamW in ddp)") for t in texts)
    assert not any("ddp-kj" in t for t in texts)


def test_a_run_that_lost_a_worker_is_no_reference_for_one_that_did_not():
    """``--preset hetero``'s only DataParallel runs a failure (``ddp-fail``): DiLoCo, which
    runs none, has no DataParallel to be held against, and the claims naming DataParallel
    are left out; a DataParallel run without a failure beside it is taken."""
    failing = run("ddp-fail", "ddp", 5.08, fault="1:240:exit", elastic=True)
    diloco = run("diloco", "diloco", 5.45)
    texts = [c.text for c in claims([failing, diloco, run("streaming", "streaming", 5.5)])]
    assert not any("ddp-fail" in t or "DataParallel" in t for t in texts), texts
    ddp = run("ddp", "ddp", 4.9)
    rows = by_text(claims([failing, ddp, diloco]))
    row = rows["DiLoCo " + DDP_CLAIM.format("DataParallel") + " (twin: ddp, AdamW inside)"]
    assert row.pair == (5.45, 4.9)


# ------------------------------------------------------------------------------ routing
def pipeline(label, routing, spreads, algorithm="noloco", stages=2, seed=None, loss=5.0):
    return run(label, algorithm, loss, seed, spreads, {"stages": stages, "routing": routing},
               stages=stages, routing=routing)


def test_random_routing_is_held_against_fixed_by_mean_spread():
    fixed = pipeline("noloco", "fixed", [0.10, 0.20, 0.30])
    routed = pipeline("routed", "random", [0.09, 0.18, 0.24])
    assert mean_spread(fixed) == pytest.approx(0.2) and mean_spread(routed) == pytest.approx(0.17)
    (row,) = routing_claim([fixed, routed])
    assert row.text == ("random routing lowers the replicas' spread: routed (NoLoCo) below "
                        "NoLoCo")
    assert row.measured == "-15.00%" and row.met
    (row,) = routing_claim([fixed, pipeline("routed", "random", [0.2, 0.2, 0.3])])
    assert row.measured == "+16.67%" and not row.met


def test_a_sweep_over_routing_is_held_the_same_way():
    fixed = pipeline("noloco[routing=fixed]", "fixed", [0.2])
    routed = pipeline("noloco[routing=random]", "random", [0.18])
    (row,) = routing_claim(sorted([routed, fixed], key=order_key))
    assert row.text == ("random routing lowers the replicas' spread: NoLoCo [routing=random] "
                        "below NoLoCo [routing=fixed]")
    assert row.measured == "-10.00%" and row.met


def test_routing_needs_a_fixed_run_of_the_same_algorithm_and_stages():
    routed = pipeline("routed", "random", [0.1])
    assert routing_claim([routed, pipeline("noloco", "fixed", [0.2], stages=4)]) == []
    assert routing_claim([routed, pipeline("local", "fixed", [0.2], algorithm="local")]) == []
    assert routing_claim([routed, pipeline("noloco", "fixed", [])]) == []  # no spread logged
    assert mean_spread(run("ddp", "ddp")) is None


def test_routing_over_seeds_gives_margin_range_and_spread():
    fixed = [0.20, 0.30]
    routed = [0.17, 0.27]
    runs = sorted([pipeline(f"noloco[seed={s}]", "fixed", [fixed[s]], seed=s) for s in (0, 1)]
                  + [pipeline(f"routed[seed={s}]", "random", [routed[s]], seed=s)
                     for s in (0, 1)], key=order_key)
    rows = {text: (measured, met) for text, measured, met in targets(runs)}
    measured, met = rows["random routing lowers the replicas' spread: routed (NoLoCo) below "
                         "NoLoCo"]
    gaps = [100 * (r - f) / f for r, f in zip(routed, fixed)]  # -15%, -10%
    spread = [50 * (max(v) - min(v)) / (sum(v) / 2) for v in (routed, fixed)]
    assert measured == (f"{sum(gaps) / 2:+.2f}% (seeds: {min(gaps):+.1f}% to "
                        f"{max(gaps):+.1f}%; seed spread ±{spread[0]:.1f}% / "
                        f"±{spread[1]:.1f}%)")
    assert met is True


# ------------------------------------------------------------------------------ regime
def test_the_regime_sentence_states_tokens_per_parameter_and_outer_steps():
    runs = [run("ddp", "ddp"), run("diloco", "diloco", sync_every=30),
            run("noloco", "noloco", sync_every=10)]
    text = regime(runs)
    assert text.startswith("Regime: 2 training tokens per model parameter, 30 outer steps at "
                           "H = 10 and 10 outer steps at H = 30; the papers train on 25 or "
                           "more tokens per parameter")
    assert text.endswith("early in training, while the loss still falls fast.")
    long = [run("ddp", "ddp", summary={"tokens": 50_000})]
    assert regime(long) == ("Regime: 50 training tokens per model parameter; the papers train "
                            "on 25 or more tokens per parameter (Streaming DiLoCo's 1B model: "
                            "25B and 250B tokens) with H = 30 to 500.")


# ------------------------------------------------------------------------------ the preset
def test_the_evidence_preset_plans_a_run_for_every_claim():
    p = compare.plan({}, preset="evidence")
    assert p.seeds == compare.PRESETS["evidence"]["seeds"] and len(p.seeds) >= 3
    by_label = {}
    for m, cfg in zip(p.methods, p.configs):
        by_label.setdefault(m.label.split("[")[0], []).append(cfg)
    assert set(by_label) >= {"ddp", "diloco", "streaming", "streaming-fp32", "noloco", "local",
                             "noloco-pp", "noloco-routed"}
    one = {label: cfgs[0] for label, cfgs in by_label.items()}
    assert one["streaming"].method.codec == "fp4_e3m0" and one["streaming-fp32"].method.codec == "fp32"
    assert one["noloco-pp"].runtime.stages == one["noloco-routed"].runtime.stages == 2
    assert (one["noloco-pp"].runtime.routing, one["noloco-routed"].runtime.routing) == ("fixed", "random")
    assert one["noloco-pp"].method.spread_every == one["noloco-routed"].method.spread_every > 0
    # the same job for every method: model, tokens, workers, seeds
    assert len({(c.model.name, c.run.steps, c.runtime.workers, c.data.batch_size, c.data.seq_len) for c in p.configs}) == 1
    assert all(sorted(c.run.seed for c in cfgs) == sorted(p.seeds) for cfgs in by_label.values())


def test_the_frontier_preset_gives_muloco_its_muon_twin():
    """``ddp-muon`` is DataParallel as the preset runs it but for Muon inside at MuLoCo's lr,
    and MuLoCo's claim against DataParallel, on the preset's own configurations, uses it."""
    p = compare.plan({"seed": 0}, preset="frontier")
    cfg = {m.label: c.to_dict() for m, c in zip(p.methods, p.configs)}
    differ = {k for k in cfg["ddp"] if cfg["ddp"][k] != cfg["ddp-muon"][k]}
    assert differ == {"inner_optimizer", "lr", "muon_lr", "out"}
    assert (cfg["ddp-muon"]["inner_optimizer"], cfg["ddp-muon"]["lr"]) == ("muon", 0.03)
    assert all(cfg["ddp-muon"][k] == cfg["muloco"][k] for k in ("lr", "muon_lr", "muon_scale"))
    losses = {"ddp": 4.80, "ddp-muon": 4.44, "diloco": 5.07, "muloco": 4.78}
    runs = [Run(label, label, {"algorithm": cfg[label]["algorithm"], "final_eval_loss": loss,
                               "config": cfg[label]}, []) for label, loss in losses.items()]
    texts = [c.text for c in claims(runs)]
    assert [t for t in texts if t.startswith("muloco") and "DataParallel" in t] == [
        "muloco (DiLoCo) " + DDP_CLAIM.format("ddp-muon (DataParallel)")
        + " (twin: ddp-muon, Muon inside)"]


# ------------------------------------------------------------------------------ for real
def test_a_comparison_holds_random_routing_against_fixed(corpus, tmp_path):
    """Stages and routing may differ per method: two NoLoCo runs of 2 stages, fixed and
    random routing, train and the report checks the routing claim on their logged spread."""
    from loco.cli import main
    from loco.report import find_runs

    from test_compare import job

    out = tmp_path / "cmp"
    argv = job(corpus, out, "--algorithms", "noloco,routed=noloco", "--workers", "4",
               "--set", "noloco.stages=2", "--set", "routed.stages=2",
               "--set", "routed.routing=random", "--set", "noloco.spread-every=4",
               "--set", "routed.spread-every=4")
    assert main(argv) == 0
    fixed, routed = find_runs([str(out)])
    assert (fixed.summary.config["routing"], routed.summary.config["routing"]) == (
        "fixed", "random")
    (row,) = routing_claim([fixed, routed])
    a, b = mean_spread(routed), mean_spread(fixed)
    assert row.pair == (a, b) and a != b
    assert row.measured == f"{100 * (a - b) / b:+.2f}%"
    report = (out / "report.md").read_text()
    assert f"| {row.text} | {row.measured} | {'yes' if row.met else '**no**'} |" in report
    assert "2 stages (random routing)" in report


@pytest.mark.parametrize("preset", ["quick", "evidence"])
def test_the_small_presets_give_diloco_and_streaming_the_swept_outer_optimizer(preset):
    """Chosen by the sweeps of docs/claims.md for tens of outer steps; the papers' preset
    keeps the papers' outer optimizers."""
    p = compare.plan({"seed": 0}, preset=preset)
    for cfg in p.configs:
        if cfg.method.algorithm in ("diloco", "streaming", "noloco"):
            assert (cfg.method.outer_lr, cfg.method.outer_momentum) == (1.0, 0.0), cfg.run.out
    paper = compare.plan({}, preset="paper")
    assert {(c.method.outer_lr, c.method.outer_momentum) for c in paper.configs
            if c.method.algorithm == "diloco" and c.method.nesterov} == {(0.7, 0.9)}
    assert {(c.method.outer_lr, c.method.outer_momentum) for c in paper.configs
            if c.method.algorithm == "noloco"} == {(0.7, 0.5)}


# ------------------------------------------------------------------------- unequal workers
def timed(label, cfg, loss, curve, goodput=None, tokens=2000, seconds=100.0):
    """A run of the ``hetero`` preset's configuration ``cfg`` whose periodic evaluations
    are ``curve``: (tokens, training seconds, eval loss) each."""
    records = [{"step": i, "tokens": t, "train_seconds": s, "eval_loss": v}
               for i, (t, s, v) in enumerate(curve)]
    return Run(label, label, {"algorithm": cfg["algorithm"], "final_eval_loss": loss,
                              "tokens": tokens, "train_seconds": seconds, "inner_steps": 240,
                              "goodput": None if goodput is None else {"total": goodput},
                              "config": cfg}, records)


def test_the_hetero_preset_checks_goodput_wallclock_tokens_and_eager():
    """Every claim of the issue on the preset's own configurations: speed-aware and
    asynchronous goodput against the barrier, loss at equal wall-clock against it and at
    equal tokens against equal workers (interpolated between evaluations), eager updates at
    the same τ and at a late τ against τ = 1 without."""
    p = compare.plan({"seed": 0}, preset="hetero")
    cfg = {m.label: c.to_dict() for m, c in zip(p.methods, p.configs)}
    assert cfg["diloco"]["worker_speed"] == "1,1,0.5,0.33" and cfg["diloco-even"][
        "worker_speed"] is None
    curve = [(1000, 50.0, 6.0), (2000, 100.0, 5.0)]  # DiLoCo's: 5.5 at 75 s or 1500 tokens
    runs = [timed("diloco", cfg["diloco"], 5.0, curve[:1], 0.47, 2000, 100.0),
            timed("diloco-aware", cfg["diloco-aware"], 5.4, [], 0.96, 1500, 75.0),
            timed("diloco-async", cfg["diloco-async"], 5.6, [], 0.90, 1500, 75.0),
            timed("diloco-even", cfg["diloco-even"], 5.0, curve[:1], None, 2000, 100.0),
            *(timed(label, cfg[label], loss, [], None)
              for label, loss in [("streaming", 5.0), ("streaming-eager", 4.9),
                                  ("streaming-eager-late", 5.1)])]
    rows = by_text(claims(runs))
    aware = rows["diloco-aware (DiLoCo) goodput at least 95% (against DiLoCo's)"]
    assert (aware.met, aware.measured) == (True, "96.0% (DiLoCo: 47.0%)")
    assert not rows["diloco-async (DiLoCo) goodput at least 95% (against DiLoCo's)"].met
    clock = rows["diloco-aware (DiLoCo) eval loss at equal wall-clock below DiLoCo's"]
    assert clock.met and clock.pair == (5.4, pytest.approx(5.5))
    assert not rows["diloco-async (DiLoCo) eval loss at equal wall-clock below DiLoCo's"].met
    tokens = rows["diloco-aware (DiLoCo) eval loss at equal tokens within 2% of "
                  "diloco-even (DiLoCo)'s"]
    assert tokens.met and tokens.measured == "-1.82%"
    eager = [c for t, c in rows.items() if "eager" in t]
    assert {(c.text.split(" eval")[0], c.met) for c in eager} == {
        ("streaming-eager (Streaming DiLoCo)", True),
        ("streaming-eager-late (Streaming DiLoCo)", False)}
    assert all("(the same τ without" in c.text or "(τ = 1 without" in c.text for c in eager)
    assert len({(c["model"], c["steps"], c["workers"], c["seed"]) for c in cfg.values()}) == 1


# ------------------------------------------------------------------------------ settings
def test_the_setting_names_muon_inside_and_the_sparse_wire():
    """The report's setting column says what the loss depends on: Muon inside where the
    method's default is AdamW (never for DeMo's own sign-SGD), and a chunked top-k's layout,
    values and mean: SparseLoCo's defaults (tiles, senders), DiLoCo's (runs, all), what was
    given, and runs where a worker of several ranks under DDP holds no whole tensors."""
    from loco.report.numbers import method_setting

    outer = {"outer_lr": 1.0, "outer_momentum": 0.0}
    muloco = run("muloco", "diloco", inner_optimizer="muon", codec="int2", **outer)
    assert method_setting(muloco) == "H=10, outer lr 1, no momentum, int2, Muon inside"
    assert "inside" not in method_setting(run("diloco", "diloco", **outer))
    assert "inside" not in method_setting(run("demo", "demo", demo_decay=0.999, demo_topk=32,
                                                  demo_chunk=64))
    sparse = run("sparseloco", "sparseloco", codec="topk_2bit", error_feedback=0.95, **outer)
    assert method_setting(sparse) == ("H=10, outer lr 1, no momentum, topk_2bit (tiles, split, "
                                      "mean over the senders), error feedback β=0.95")
    plain = run("d", "diloco", codec="topk_2bit", **outer)
    assert method_setting(plain).endswith("topk_2bit (runs, split, mean over all)")
    given = run("s", "sparseloco", codec="topk_2bit", sparse_values="stat", sparse_mean="all",
                **outer)
    assert "topk_2bit (tiles, stat, mean over all)" in method_setting(given)
    ddp = run("s", "sparseloco", codec="topk_2bit", worker_ranks=2, worker_parallel="ddp",
              **outer)
    assert "topk_2bit (runs, split, mean over the senders)" in method_setting(ddp)
