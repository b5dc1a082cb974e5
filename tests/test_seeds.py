"""``loco compare --seeds``: the expansion into one run per seed and its checks (no
training), the report's numbers over seeds on hand-built runs (means, spreads, claims paired
by seed, yes / no / mixed), and one tiny real comparison of two seeds."""

import json

import pytest

import loco.training.job
from loco import compare
from loco.cli import main
from loco.config import ConfigError
from loco.report import (Run, baseline, claims_table, comparison, loss_spread, mean_run,
                         order_key, over_seeds, seed_groups, seed_point, targets, verdict)

from test_compare import job, table_rows
from test_sweep import TINY, labels


# ------------------------------------------------------------------------------ the plan
def test_every_run_runs_once_per_seed_with_the_seed_last_in_its_label():
    plan = compare.plan(TINY, "ddp,streaming", sweeps=["mixing=0,0.5"], seeds="2,0")
    assert labels(plan) == ["ddp[seed=2]", "ddp[seed=0]", "streaming[mixing=0,seed=2]",
                            "streaming[mixing=0,seed=0]", "streaming[mixing=0.5,seed=2]",
                            "streaming[mixing=0.5,seed=0]"]
    assert [c.run.seed for c in plan.configs] == [2, 0, 2, 0, 2, 0]
    assert [c.method.mixing for c in plan.configs[2:]] == [0.0, 0.0, 0.5, 0.5]
    assert plan.configs[3].run.out.endswith("/streaming[mixing=0,seed=0]")
    assert plan.methods[3].point == {"mixing": 0.0, "seed": 0}
    assert plan.seeds == [2, 0] and [s.option for s in plan.sweeps] == ["mixing"]
    # Everything but the seed (and the swept option) is the same job.
    assert len({(c.run.steps, c.runtime.workers, c.model.name, c.method.sync_every) for c in plan.configs}) == 1


def test_without_seeds_nothing_changes():
    plan = compare.plan({**TINY, "seed": 3}, "ddp,diloco")
    assert labels(plan) == ["ddp", "diloco"] and plan.seeds == []
    assert [c.run.seed for c in plan.configs] == [3, 3]
    assert all(m.point == {} for m in plan.methods)


def test_one_seed_still_labels_its_runs():
    plan = compare.plan(TINY, "diloco", seeds=[5])
    assert labels(plan) == ["diloco[seed=5]"] and plan.configs[0].run.seed == 5


def test_yaml_seeds_and_the_flag_replacing_them(tmp_path):
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text("algorithms: [diloco]\nseeds: [0, 1]\n")
    assert labels(compare.plan(TINY, config_file=str(cfg))) == ["diloco[seed=0]",
                                                                 "diloco[seed=1]"]
    assert labels(compare.plan(TINY, config_file=str(cfg), seeds="7")) == ["diloco[seed=7]"]
    assert labels(compare.plan(TINY, "ddp", config_file=str(cfg))) == ["ddp[seed=0]",
                                                                       "ddp[seed=1]"]
    cfg.write_text("algorithms: [diloco]\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"^--seeds: .*not both \(seed 3 is given by .*cmp"):
        compare.plan(TINY, config_file=str(cfg), seeds="0,1")


@pytest.mark.parametrize("text", ["0,1,2", [4], "16", " 3 , 1 "])
def test_good_seeds(text):
    assert compare.parse_seeds(text) == [int(s) for s in str(text).strip("[]").split(",")]


BAD_SEEDS = [
    (["--seeds", ""], "'' is not a seed"),
    (["--seeds", "0,,1"], "'' is not a seed"),
    (["--seeds=-1"], "'-1' is not a seed"),
    (["--seeds", "1.5"], "'1.5' is not a seed"),
    (["--seeds", "a,b"], "'a' is not a seed"),
    (["--seeds", "0,1,0"], "the seed 0 is listed twice"),
    (["--seeds", ",".join(map(str, range(17)))], "17 seeds are too many"),
    (["--seed", "1", "--seeds", "0,1"], "give --seeds or --seed, not both"),
]


@pytest.mark.parametrize("extra,message", BAD_SEEDS, ids=[" ".join(e) for e, _ in BAD_SEEDS])
def test_bad_seeds_fail_in_one_line_before_anything_runs(extra, message, corpus, tmp_path,
                                                         capsys, monkeypatch):
    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    out = tmp_path / "cmp"
    assert main(job(corpus, out, "--algorithms", "ddp,diloco", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("loco compare: error: --seeds: ") and message in err, err
    assert "1 to 16 distinct integers >= 0" in err or "not both" in err, err
    assert not out.exists()  # nothing was started or written


# ------------------------------------------------------------------------------ labels
def seeded(label, algorithm, loss, seed, sent=1000, peak=100, **config):
    """A finished run of ``loco compare --seeds``, as its summary.json reads."""
    config = {"seed": seed, "sync_every": 8, "fragments": 2, "overlap": "1", "mixing": 0.5,
              "codec": "fp32", "group_size": 2, "gamma": 0.7, **config}
    return Run(label, label, {"algorithm": algorithm, "final_eval_loss": loss,
                              "bytes_sent_per_rank": sent, "peak_sync_bytes_per_rank": peak,
                              "model_parameters": 1000, "config": config}, [])


def test_seeded_labels_read_back():
    assert seed_point("diloco[seed=1]", {"seed": 1}) == ("diloco", 1)
    assert seed_point("streaming[mixing=0.5,seed=2]", {"seed": 2}) == (
        "streaming[mixing=0.5]", 2)
    assert seed_point("streaming[overlap=(1,2),seed=12]", {"seed": 12}) == (
        "streaming[overlap=(1,2)]", 12)
    assert seed_point("diloco[seed=1]", {"seed": 2}) is None  # not the run's own seed
    assert seed_point("diloco", {"seed": 1}) is None
    run = seeded("streaming[mixing=0.5,seed=2]", "streaming", 3.0, 2, mixing=0.5)
    assert (run.seed, run.group, run.base) == (2, "streaming[mixing=0.5]", "streaming")
    assert run.sweep == ("streaming", {"mixing": 0.5})  # the seed is not a grid point
    assert run.name == "Streaming DiLoCo [mixing=0.5,seed=2]"
    assert run.group_name == "Streaming DiLoCo [mixing=0.5]"
    plain = seeded("diloco[seed=1]", "diloco", 3.0, 1)
    assert (plain.sweep, plain.base, plain.name, plain.group_name) == (
        None, "diloco", "DiLoCo [seed=1]", "DiLoCo")
    runs = [seeded("diloco[seed=1]", "diloco", 3, 1), seeded("ddp[seed=1]", "ddp", 3, 1),
            seeded("diloco[seed=0]", "diloco", 3, 0), seeded("ddp[seed=0]", "ddp", 3, 0)]
    assert [r.label for r in sorted(runs, key=order_key)] == [
        "ddp[seed=0]", "ddp[seed=1]", "diloco[seed=0]", "diloco[seed=1]"]
    assert baseline(runs, "diloco").label == "diloco[seed=1]"  # its own label, a seed aside


# ------------------------------------------------------------------------------ the maths
#: Final eval losses per seed 0, 1, 2. Streaming against DiLoCo: +1.0%, -3.85%, +2.08%
#: (within 2% on two seeds: mixed); DiLoCo against DataParallel: +2.04%, +4.0%, +2.13% (yes);
#: NoLoCo against DiLoCo: +10%, +7.7%, +10.4% (no).
LOSSES = {"ddp": (4.9, 5.0, 4.7), "diloco": (5.0, 5.2, 4.8), "streaming": (5.05, 5.0, 4.9),
          "noloco": (5.5, 5.6, 5.3)}


def three_seeds():
    runs = [seeded(f"{a}[seed={s}]", a, loss, s, sent=1000 if a == "ddp" else 5,
                   peak=100 if a == "diloco" else 50)
            for a, losses in LOSSES.items() for s, loss in enumerate(losses)]
    return sorted(runs, key=order_key)


def test_a_method_over_its_seeds():
    runs = three_seeds()
    groups = dict(seed_groups(runs))
    assert list(groups) == ["ddp", "diloco", "streaming", "noloco"]
    assert [r.seed for r in groups["diloco"]] == [0, 1, 2]
    numbers = over_seeds(groups["diloco"])
    assert numbers["seeds"] == [0, 1, 2] and numbers["label"] == "diloco"
    assert numbers["final_eval_loss_per_seed"] == [5.0, 5.2, 4.8]
    assert numbers["final_eval_loss_mean"] == pytest.approx(5.0)
    assert (numbers["final_eval_loss_min"], numbers["final_eval_loss_max"]) == (4.8, 5.2)
    assert loss_spread(groups["diloco"]) == "5.0000 ± 0.2000 (4.8000–5.2000)"
    mean = mean_run("diloco", groups["diloco"])
    assert (mean.label, mean.seed, mean.name) == ("diloco", None, "DiLoCo")
    assert mean.summary.final_eval_loss == pytest.approx(5.0)
    assert mean.summary.bytes_sent_per_rank == 5
    # One seed is not several: no groups, and the runs stand for themselves.
    assert seed_groups([r for r in runs if r.seed == 1]) == []


def test_each_run_is_compared_with_the_baseline_of_its_own_seed():
    numbers = comparison(three_seeds())
    for seed in range(3):
        rel = numbers[f"diloco[seed={seed}]"]["compare"]
        gap = 100 * (LOSSES["diloco"][seed] / LOSSES["ddp"][seed] - 1)
        assert rel["eval_loss_vs_ddp_pct"] == pytest.approx(gap)
        assert rel["seed"] == seed
        assert rel["over_seeds"]["final_eval_loss_per_seed"] == list(LOSSES["diloco"])


def gaps(a, b):
    return [100 * (x - y) / y for x, y in zip(LOSSES[a], LOSSES[b])]


def half_range(a):
    values = LOSSES[a]
    return 50 * (max(values) - min(values)) / (sum(values) / len(values))


def test_loss_claims_pair_runs_of_the_same_seed():
    rows = {claim: (measured, met) for claim, measured, met in targets(three_seeds())}
    for a, b, limit, met in (("streaming", "diloco", 2, None), ("diloco", "ddp", 5, True),
                             ("noloco", "diloco", 3, False)):
        names = {"ddp": "DataParallel", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo",
                 "noloco": "NoLoCo"}
        measured, ok = rows[f"{names[a]} eval loss within {limit}% of {names[b]}'s "
                            f"(twin: {b}, AdamW inside)"]
        g = gaps(a, b)
        assert measured == (f"{sum(g) / 3:+.2f}% (seeds: {min(g):+.1f}% to {max(g):+.1f}%; "
                            f"seed spread ±{half_range(a):.1f}% / ±{half_range(b):.1f}%)")
        assert ok is met, (a, b, g)
    assert rows["Streaming DiLoCo eval loss within 2% of DiLoCo's (twin: diloco, AdamW "
                "inside)"][0] == (
        "-0.25% (seeds: -3.8% to +2.1%; seed spread ±1.5% / ±4.0%)")
    # Bytes are the same on every seed: their claim reads as one seed's.
    assert rows["DataParallel sends at least 100× the bytes of Streaming DiLoCo (twin: ddp, "
                "AdamW inside)"] == (
        "200× (DataParallel's gradients in fp32)", True)


def test_one_seed_reads_as_today():
    one = [r for r in three_seeds() if r.seed == 1]
    plain = [Run(r.group, r.path, r.summary, []) for r in one]
    assert targets(one) == targets(plain)
    assert all(ok in (True, False) for _, _, ok in targets(one))
    assert claims_table(one) == claims_table(plain)
    assert "seeds' spread" not in "\n".join(claims_table(one))


@pytest.mark.parametrize("met,expected", [([True, True, True], True), ([False, False], False),
                                          ([True, False, True], None), ([False, True], None),
                                          ([True], True), ([False], False)])
def test_verdict_over_seeds(met, expected):
    assert verdict(met) is expected


def test_claims_table_says_mixed_and_warns_about_the_spread():
    lines = claims_table(three_seeds())
    rows = {line.split(" | ")[0].lstrip("| "): line.rsplit(" | ", 1)[1].rstrip(" |")
            for line in lines if line.startswith("| ") and "within" in line}
    same = " (twin: {}, AdamW inside)"
    assert rows == {"Streaming DiLoCo eval loss within 2% of DiLoCo's" + same.format("diloco"):
                    "mixed",
                    "DiLoCo eval loss within 5% of DataParallel's" + same.format("ddp"): "yes",
                    "NoLoCo eval loss within 3% of DiLoCo's" + same.format("diloco"): "**no**"}
    assert lines[-1].endswith("A margin smaller than the seeds' spread is not a result.")
    assert "each of the 3 seeds" in lines[-1]


# ------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def two_seeds(corpus, tmp_path_factory):
    """DataParallel and DiLoCo, each on seeds 0 and 1, trained once."""
    out = tmp_path_factory.mktemp("seeds") / "cmp"
    assert main(job(corpus, out, "--algorithms", "ddp,diloco", "--seeds", "0,1",
                    "--checkpoint-every", "0")) == 0
    return out


RUNS = ["ddp[seed=0]", "ddp[seed=1]", "diloco[seed=0]", "diloco[seed=1]"]


def test_two_seeds_train_four_different_runs(two_seeds):
    numbers = json.loads((two_seeds / "compare.json").read_text())
    assert list(numbers) == RUNS
    for label in RUNS:
        summary = json.loads((two_seeds / label / "summary.json").read_text())
        assert summary["config"]["seed"] == int(label[-2])
        assert numbers[label]["compare"]["seed"] == int(label[-2])
    for method in ("ddp", "diloco"):
        losses = [numbers[f"{method}[seed={s}]"]["final_eval_loss"] for s in (0, 1)]
        assert losses[0] != losses[1]  # the seeds really differ
        entry = numbers[f"{method}[seed=1]"]["compare"]["over_seeds"]
        assert entry["seeds"] == [0, 1] and entry["final_eval_loss_per_seed"] == losses
        assert entry["final_eval_loss_mean"] == pytest.approx(sum(losses) / 2)
        assert (entry["final_eval_loss_min"], entry["final_eval_loss_max"]) == (
            min(losses), max(losses))


def test_two_seeds_report_one_row_per_method_and_every_run(two_seeds):
    report = (two_seeds / "report.md").read_text()
    numbers = json.loads((two_seeds / "compare.json").read_text())
    assert "2 methods, each with 2 seeds, on the same job" in report
    rows = table_rows(report)
    assert list(rows) == ["DataParallel", "DiLoCo"]
    for name, method in (("DataParallel", "ddp"), ("DiLoCo", "diloco")):
        losses = [numbers[f"{method}[seed={s}]"]["final_eval_loss"] for s in (0, 1)]
        low, high = min(losses), max(losses)
        assert rows[name][2] == "0, 1"
        assert rows[name][3] == (f"{(low + high) / 2:.4f} ± {(high - low) / 2:.4f} "
                                 f"({low:.4f}–{high:.4f})")
    every = table_rows(report.split("## Every run", 1)[1])
    assert list(every) == ["DataParallel [seed=0]", "DataParallel [seed=1]",
                           "DiLoCo [seed=0]", "DiLoCo [seed=1]"]
    assert float(every["DiLoCo [seed=1]"][2]) == round(
        numbers["diloco[seed=1]"]["final_eval_loss"], 4)
    claims = report.split("## The papers' claims on this run", 1)[1].split("\n## ", 1)[0]
    claim = next(line for line in claims.splitlines() if "within 5% of DataParallel" in line)
    assert "(seeds: " in claim and "seed spread ±" in claim
    assert "A margin smaller than the seeds' spread is not a result." in claims


def test_loco_report_reproduces_two_seeds_from_disk(two_seeds):
    before = {n: (two_seeds / n).read_bytes() for n in ("report.md", "compare.json")}
    for name in before:
        (two_seeds / name).unlink()
    assert main(["report", str(two_seeds)]) == 0
    assert {n: (two_seeds / n).read_bytes() for n in before} == before
