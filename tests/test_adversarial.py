"""``loco compare --preset adversarial`` (issue 43, item 5): the preset's runs, planned without
training, and the report's Attacks section, rendered from fake run directories."""

import json

import pytest

from loco import compare
from loco.compare.presets import ATTACKS, LIE_TOKENS
from loco.report import find_runs, write_report
from loco.report.adversarial import attacks_section, expected_signs, parse_attacks

METHODS = ("ddp", "diloco", "streaming", "sparseloco", "demo", "noloco")
PROPORTIONAL = ("diloco", "streaming", "sparseloco")


@pytest.fixture(scope="module")
def adversarial():
    """The preset's plan: {label: (algorithm, its prepared configuration)}."""
    plan = compare.plan({}, preset="adversarial")
    return {m.label: (m.algorithm, c) for m, c in zip(plan.methods, plan.configs)}


def test_preset_runs_every_attack_with_the_guard_and_plainly(adversarial):
    expected = set()
    for method in METHODS:
        expected.add(method)
        for name, _ in ATTACKS:
            expected |= {f"{method}-{name}", f"{method}-{name}-plain"}
        if method in PROPORTIONAL:
            expected |= {f"{method}-prop", f"{method}-lie-tokens", f"{method}-lie-tokens-plain"}
    assert set(adversarial) == expected and len(expected) == 6 * 13 + 3 * 3
    for label, (algorithm, cfg) in adversarial.items():
        assert algorithm == label.split("-")[0]
        attack = dict(ATTACKS + (LIE_TOKENS,)).get(label.removesuffix("-plain")
                                                    .removeprefix(f"{algorithm}-"))
        assert cfg.trust.inject == attack, label
        assert cfg.trust.aggregation == ("mean" if label.endswith("-plain") else "drop"), label
        assert cfg.trust.guard_factor == 4
        assert cfg.runtime.local_steps == ("proportional" if "-prop" in label or "-lie-" in label
                                   else "fixed"), label
        assert cfg.runtime.workers == 4 and cfg.runtime.on_nonfinite == "skip"
    assert adversarial["streaming"][1].method.codec == "fp4_e3m0"
    assert "silent" in compare.PRESETS["adversarial"]["about"]


def test_each_attacked_run_differs_from_its_clean_twin_only_in_the_attack(adversarial):
    free = {"inject", "aggregation", "out", "wandb_run_name"}

    def rest(cfg):
        return {k: v for k, v in cfg.to_dict().items() if k not in free}

    for label, (algorithm, cfg) in adversarial.items():
        if cfg.trust.inject is None:
            continue
        clean = f"{algorithm}-prop" if "lie-tokens" in label else algorithm
        assert rest(cfg) == rest(adversarial[clean][1]), label


# ------------------------------------------------------------------------- the report
def write_run(root, label, loss, detected=(), inject=None, aggregation="drop",
              algorithm="diloco"):
    """A finished run's directory as ``find_runs`` reads it: summary.json (the preset's
    configuration of ``algorithm`` with ``inject`` and ``aggregation``) and metrics.jsonl."""
    config = compare.plan({}, algorithm, preset="adversarial").configs[0].to_dict()
    config.update(inject=inject, aggregation=aggregation)
    guard = {"aggregation": aggregation, "factor": 4.0,
             "injected": [inject] if inject else [],
             "detected": [{"worker": w, "sign": s, "rows": 6, "first_step": 20,
                           "last_step": 160, "action": "left out"} for w, s in detected]}
    summary = {"algorithm": algorithm, "workers": 4, "inner_steps": 160, "tokens": 327680,
               "final_eval_loss": loss, "model_parameters": 157920,
               "bytes_sent_per_rank": 1000, "peak_sync_bytes_per_rank": 100,
               "wall_seconds": 10.0, "tokens_per_second": 1000.0, "guard": guard,
               "config": config}
    path = root / label
    path.mkdir()
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text(json.dumps({"step": 160, "eval_loss": loss}) + "\n")


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """A comparison of DiLoCo runs: clean; scale named high (met); zero named low but 10%
    worse (not met); a bit flip nobody named (not met), each with its plain twin."""
    root = tmp_path_factory.mktemp("runs")
    write_run(root, "diloco", 5.0)
    for name, inject, guarded, detected, bare in [
            ("scale", "1:scale=-50", 5.05, [(1, "high")], 8.0),
            ("zero", "1:zero", 5.5, [(1, "low"), (2, "high")], 5.6),
            ("bitflip", "1:bitflip=64", 5.01, [], float("nan"))]:
        write_run(root, f"diloco-{name}", guarded, detected, inject)
        write_run(root, f"diloco-{name}-plain", bare, (), inject, "mean")
    out = root / "report"
    numbers = write_report(find_runs([str(root)]), str(out))
    return numbers, (out / "report.md").read_text()


def section_rows(report):
    """The Attacks section's tables, by first cell."""
    text = report.split("## Attacks", 1)[1].split("\n## ", 1)[0]
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_attacks_section_holds_each_attack_against_its_clean_run(attacked):
    _, report = attacked
    rows = section_rows(report)
    table = [line for line in report.splitlines() if line.startswith("| DiLoCo | 1:")]
    # one row per attack, in the order of the guard's signs' kinds, not the labels'
    assert [line.split("|")[2].strip() for line in table] == ["1:scale=-50", "1:zero",
                                                             "1:bitflip=64"]
    scale = next(line for line in table if "scale" in line)
    assert "5.0000" in scale and "drop: 5.0500 (×1.010)" in scale
    assert "w1 high from step 20 (6 rows)" in scale and "8.0000 (×1.600)" in scale
    assert rows["diloco-scale"] == ["+1.00%", "high", "yes", "+60.00%"]
    assert rows["diloco-zero"] == ["+10.00%", "low", "**no**", "+12.00%"]
    assert rows["diloco-bitflip"] == ["+0.20%", "**not named**", "**no**", "not finite"]
    assert "1 of 3 attacks held to the claim." in report
    assert "In the clean runs the guard named nothing." in report


def test_compare_json_carries_each_attacked_runs_verdict(attacked):
    numbers, _ = attacked
    scale = numbers["diloco-scale"]["compare"]["attack"]
    assert scale["clean"] == "diloco" and scale["met"] is True
    assert scale["vs_clean_pct"] == pytest.approx(1.0)
    assert [d["sign"] for d in scale["named"]] == ["high"]
    assert numbers["diloco-zero"]["compare"]["attack"]["met"] is False
    plain = numbers["diloco-scale-plain"]["compare"]["attack"]
    assert plain["met"] is None and plain["aggregation"] == "mean"
    assert numbers["diloco-bitflip-plain"]["compare"]["attack"]["vs_clean_pct"] is None
    assert "attack" not in numbers["diloco"]["compare"]


def test_no_attacks_no_section(attacked, tmp_path):
    write_run(tmp_path, "diloco", 5.0)
    assert attacks_section(find_runs([str(tmp_path)])) == []


@pytest.mark.parametrize("text,signs", [("1:scale=-50", ("high",)), ("1:scale=0.1", ("low",)),
                                        ("1:zero", ("low",)), ("1:nan", ("nonfinite",)),
                                        ("1:stale=2", ("stale",)),
                                        ("1:lie-tokens=10", ("tokens",))])
def test_each_attack_is_named_by_its_sign(text, signs):
    assert expected_signs(parse_attacks(text)[0]) == signs
