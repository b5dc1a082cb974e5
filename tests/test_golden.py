"""Golden histories: per-step parameter summaries of a tiny deterministic Streaming DiLoCo
run, stored as readable JSON, guard against silent numeric drift in any part of the path
(fragments, schedule, reduction, outer step, merge).

Regenerate after an intended change of the numbers with:

    LOCO_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import math
import os
from pathlib import Path

import pytest

import loco
from workers import streaming_worker

FIXTURE = Path(__file__).parent / "fixtures" / "streaming_golden.json"
REGENERATE = os.environ.get("LOCO_REGENERATE_GOLDEN") == "1"
H, STEPS, WORKERS = 12, 24, 2
SETTINGS = {  # name: (P, τ, α, codec)
    "diloco": (1, 0, 0.0, "fp32"),
    "P2-tau1-alpha0.5": (2, 1, 0.5, "fp32"),
    "P4-tau2-alpha0": (4, 2, 0.0, "fp32"),
    "P4-tau1-alpha0.5-bf16": (4, 1, 0.5, "bf16"),
}


def history_worker(ctx, fragments, overlap, alpha, codec):
    """After every inner step: per fragment, the global copy's sum and first values, and
    this worker's local parameters' sum (float64 sums, so the order of addition is moot)."""
    rows = []

    def record(algo):
        rows.append({
            "step": algo.inner_steps,
            "global": [[f.global_flat.double().sum().item(), *f.global_flat[:3].tolist()]
                       for f in algo.fragment_list],
            "local": [sum(p.double().sum().item() for p in f.params) for f in algo.fragment_list],
        })
    streaming_worker(ctx, STEPS, step_hook=record, sync_every=H, fragments=fragments,
                     overlap=overlap, alpha=alpha, codec=codec)
    return rows


def run(setting):
    return loco.launch(history_worker, WORKERS, args=SETTINGS[setting])[0]


def test_regenerate_or_fixture_is_complete():
    if REGENERATE:
        settings = [f' "{name}": [\n' + ",\n".join("  " + json.dumps(row) for row in run(name))
                    + "\n ]" for name in SETTINGS]  # one step per line, easy to diff
        FIXTURE.write_text("{\n" + ",\n".join(settings) + "\n}\n")
    stored = json.loads(FIXTURE.read_text())
    assert sorted(stored) == sorted(SETTINGS), "regenerate: LOCO_REGENERATE_GOLDEN=1"
    assert all(len(rows) == STEPS for rows in stored.values())


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_history_matches_golden(setting):
    expected = json.loads(FIXTURE.read_text())[setting]
    got = run(setting)
    for want, have in zip(expected, got, strict=True):
        assert have["step"] == want["step"]
        for key in ("global", "local"):
            flat_want = [v for item in want[key] for v in (item if isinstance(item, list) else [item])]
            flat_have = [v for item in have[key] for v in (item if isinstance(item, list) else [item])]
            for a, b in zip(flat_have, flat_want, strict=True):
                assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), (setting, want["step"], key, a, b)
    # the histories really move: the global copy changes at the syncs
    assert got[0]["global"] != got[-1]["global"]
