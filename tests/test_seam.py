"""A method is one seam: a method registered from outside the package (docs/examples/
averaging.py: plain parameter averaging every H steps) trains, compares, reports and
evaluates with no edit elsewhere."""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_harness import tasks, train_args  # noqa: E402,F401  (tasks is a fixture)

import loco  # noqa: E402
from loco.algorithms import registry  # noqa: E402
from loco.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
from averaging import Averaging  # noqa: E402  (the docs' example method, one file)


@pytest.fixture
def averaging(monkeypatch):
    """``avg`` registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    registry.register(Averaging)
    return Averaging


def summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_a_method_registered_from_outside_trains_and_evaluates(averaging, corpus, tasks,
                                                                 tmp_path, capsys):
    out = tmp_path / "avg"
    assert main(train_args(corpus, out, "--algorithm", "avg", "--steps", "8")) == 0
    s = summary(out)
    assert s["algorithm"] == "avg" and s["config"]["sync_every"] == 4  # the method's default
    # two all-reduces of the whole model, M = 2: each worker sends half of it twice per sync
    floats = s["model_parameters"]
    assert s["bytes_sent_per_rank"] == 2 * 2 * 4 * (floats // 2 + floats % 2)
    assert main(["eval", str(out), "--tasks", "loco_tiny_mc", "--include-path", tasks,
                 "--limit", "4", "--batch-size", "4"]) == 0
    assert "loco_tiny_mc" in summary(out)["downstream"]
    capsys.readouterr()


@pytest.mark.slow
def test_a_method_registered_from_outside_compares_and_reports(averaging, corpus, tmp_path):
    text, cache = corpus
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "avg,local", "--model", "tiny", "--workers", "2",
                 "--steps", "8", "--seq-len", "32", "--batch-size", "4", "--vocab-size",
                 "300", "--eval-every", "4", "--eval-batches", "2", "--final-eval-batches",
                 "4", "--corpus", text, "--cache-dir", cache, "--out", str(out),
                 "--no-progress", "--set", "avg.sync-every=2"]) == 0
    report = (out / "report.md").read_text()
    assert "Plain averaging" in report and "H=2" in report  # the shared options' setting
    assert "Plain averaging eval loss below Local's (no communication)" in report
    numbers = json.loads((out / "compare.json").read_text())
    assert numbers["avg"]["config"]["sync_every"] == 2


def test_a_registered_method_is_a_choice_and_its_options_are_checked(averaging, capsys):
    assert main(["train", "--algorithm", "avg", "--sync-every", "0"]) == 2
    assert "--sync-every: must be an integer >= 1 (got 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["train", "--algorithm", "nope"])
    assert exit.value.code == 2
    assert "'avg'" in capsys.readouterr().err  # argparse lists the registered methods
    with pytest.raises(ValueError, match="taken"):
        registry.register(type("Other", (Averaging,), {}))


def test_a_method_with_options_registered_after_the_configuration_is_imported(
        averaging, corpus, tmp_path, capsys):
    import loco.config  # noqa: F401  (imported long before avg was registered, by loco.cli)

    assert main(["train", "--algorithm", "avg", "--average-mix", "2"]) == 2
    assert "--average-mix: must be in (0, 1] (got 2.0)" in capsys.readouterr().err
    assert main(["train", "--algorithm", "diloco", "--average-mix", "0.5"]) == 2
    assert ("--average-mix: applies to avg only, not to --algorithm diloco (got 0.5)"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["train", "--algorithm", "avg", "--help"])
    assert "method: avg's own" in capsys.readouterr().out
    config = tmp_path / "avg.yaml"
    config.write_text("method:\n  algorithm: avg\n  average_mix: 0.5\n")
    out = tmp_path / "avg"
    assert main(train_args(corpus, out, "--config", str(config), "--steps", "4")) == 0
    assert summary(out)["config"]["average_mix"] == 0.5
    capsys.readouterr()


def _mix_worker(ctx, mix):
    model = torch.nn.Linear(3, 2)
    algo = Averaging(model, torch.optim.SGD(model.parameters(), lr=0.0), ctx.comm,
                     sync_every=1, mix=mix)
    with torch.no_grad():  # replicas that differ (lr 0: the step only averages)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(ctx.rank)))
    before = [p.detach().clone() for p in model.parameters()]
    algo.step()
    return before, [p.detach().clone() for p in model.parameters()]


def test_the_example_option_moves_each_replica_that_far_towards_the_mean():
    out = loco.launch(_mix_worker, 2, args=(0.25,))
    for i in range(2):  # the reference: p + mix * (mean - p), the mean of the two replicas
        mean = (out[0][0][i] + out[1][0][i]) / 2
        for before, after in out:
            torch.testing.assert_close(after[i], before[i] + 0.25 * (mean - before[i]))
        assert not torch.equal(out[0][1][i], out[1][1][i])  # moved a quarter, not onto it
