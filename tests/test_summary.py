"""The summary's typed record: exactly ``summary.json``'s content, read back from today's
and older runs, and importable without torch."""

import json
import os
import subprocess
import sys

import pytest

from loco.cli import main
from loco.training.summary import Summary
from test_cli import small_run


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """A short run's directory."""
    out = tmp_path_factory.mktemp("summary") / "run"
    assert main(small_run(corpus, out, "--steps", "8", "--final-eval-batches", "2")) == 0
    return out


def test_a_runs_summary_is_the_record_and_back(run):
    text = (run / "summary.json").read_text()
    content = json.loads(text)
    summary = Summary.from_dict(content)
    assert summary.unknown == {}  # the record knows every key the job writes
    assert summary.inner_steps == 8 and summary.workers == 2
    assert summary.final_eval_loss == content["final_eval_loss"]
    assert content["final_model"] == "the global model"  # Streaming DiLoCo's global copy
    # H = 4 (small_run), 8 steps, tau = 1: checkpoints at steps 5 and 8; each blocked a while
    assert content["checkpoints"] == 2 and 0 < content["checkpoint_seconds"] < 60
    memory = content["memory_bytes_per_rank"]
    assert set(memory) == {"model", "gradients", "inner_optimizer", "outer", "comm", "staging"}
    assert memory["gradients"] == memory["model"] == 4 * content["model_parameters"]
    assert memory["comm"] > 0 and memory["staging"] == 0  # FP4's kept buffers; CPU: in place
    peak = content["memory_peak_over_state"]  # the threads launcher: 2 ranks in one process
    assert peak["peak_of"] == "resident" and peak["state_bytes"] == sum(memory.values())
    assert peak["ratio"] == pytest.approx(peak["peak_bytes"] / peak["state_bytes"], abs=1e-3)
    assert peak["peak_bytes"] == content["max_rss_bytes"] // 2
    assert list(summary.to_dict()) == list(content)
    assert json.dumps(summary.to_dict(), indent=2) == text
    # the one currency is in the file too: 8 · bytes / (parameters · steps), bytes / token
    sent = content["bytes_sent_per_rank"]
    assert sent > 0 and content["bits_per_parameter_per_step"] == pytest.approx(
        8 * sent / (content["model_parameters"] * 8), rel=1e-12)
    assert content["bytes_per_token"] == pytest.approx(sent * 2 / content["tokens"], rel=1e-12)


def test_an_older_summary_reads_with_its_missing_keys_none_and_others_kept(run):
    content = json.loads((run / "summary.json").read_text())
    old = {k: v for k, v in content.items()
           if k not in ("worker_ranks", "max_rss_bytes", "codec_kernel", "fast_link")}
    old["memory_bytes_per_rank"] = {k: v for k, v in content["memory_bytes_per_rank"].items()
                                    if k not in ("comm", "staging")}  # before they counted
    old["downstream"] = {"hellaswag": {"acc": 0.25}}  # added by another tool
    summary = Summary.from_dict(old)
    assert summary.worker_ranks is None and summary.max_rss_bytes is None
    assert summary.codec_kernel is None and summary.fast_link is None
    assert summary.unknown == {"downstream": {"hellaswag": {"acc": 0.25}}}
    again = summary.to_dict()
    assert list(again)[-1] == "downstream"
    assert {k: v for k, v in again.items() if k in old} == old


def test_the_summary_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch fails
            "from loco.training.summary import Summary, human_bytes\n"
            "assert Summary.from_dict({'tokens': 3}).to_dict()['tokens'] == 3\n"
            "assert human_bytes(1500) == '1.5KB'\n")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_the_final_eval_loss_says_which_model_it_is_of():
    """The global copy (DiLoCo's family), the one model (replicas that stay identical), or
    worker 0's replica and the replicas' average (replicas that differ)."""
    from types import SimpleNamespace

    from loco.algorithms.registry import method
    from loco.training.finish import final_model

    def of(name, average=False):
        return final_model(SimpleNamespace(method_class=method(name),
                                            method=SimpleNamespace(final_average=average)))

    assert of("diloco") == of("streaming") == of("sparseloco") == "the global model"
    assert of("ddp") == of("demo") == "the model"
    assert of("noloco") == of("local") == "worker 0's replica"
    assert of("noloco", True) == "the replicas' average"
