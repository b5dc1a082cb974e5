"""--tensorboard and --wandb: every field of metrics.jsonl, the sync and elastic events and the
summary reach the dashboards, read back from what they wrote (TensorBoard's event reader; the
records of W&B's offline run file). No network: W&B runs offline, its directories in tmp.

TensorBoard stores scalars as float32: values are compared with a relative tolerance of
1e-6 (float32 keeps 24 bits, a relative error of at most 6e-8). W&B keeps them exactly."""

import glob
import importlib.util
import json
import math
import os
import struct
from pathlib import Path

import pytest

from loco import compare
from loco.config import build_config
from loco.dashboard import (GROUP_ENV, DashboardError, Dashboards, flatten, missing_extra,
                            record_scalars)

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

REL = 1e-6  # float32

# The records of a streaming run (train.py's log_step and write_summary), with the elastic
# records of log_membership and a final record without a periodic evaluation.
RECORDS = [
    {"event": "sync", "step": 2, "applied_step": 3, "fragment": 0, "raw_bytes": 92032,
     "wire_bytes": 12240, "received_bytes": 12240, "seconds_in_flight": 0.0175,
     "seconds_waited": 0.0034},
    {"step": 3, "tokens": 768, "train_loss": 5.710638046264648, "lr": 0.00024,
     "bytes_sent": 12240, "slow_link_bytes_sent": 12240, "fast_link_bytes_sent": 0,
     "elapsed": 0.62},
    {"event": "elastic_sync", "step": 4, "participants": [0, 1], "contributors": 2,
     "retries": 0, "time": 1.25, "unix_time": 1795597505.25},
    {"event": "sync", "step": 4, "applied_step": 5, "fragment": 1, "raw_bytes": 53760,
     "wire_bytes": 7140, "received_bytes": 7140, "seconds_in_flight": 0.01,
     "seconds_waited": 5.7e-06},
    {"step": 6, "tokens": 1536, "train_loss": 5.70196, "lr": 0.00042, "eval_loss": 5.71728,
     "spread": 0.0123, "bytes_sent": 31620, "elapsed": 0.68},
    {"event": "membership", "step": 6, "elastic": "membership", "time": 1.5,
     "unix_time": 1795597505.5, "worker": 0, "members": [0], "joined": [], "left": [1],
     "error": None},
    {"event": "sync", "step": 6, "applied_step": 7, "fragment": 0, "raw_bytes": 92032,
     "wire_bytes": 12240, "received_bytes": 12240, "seconds_in_flight": 0.028,
     "seconds_waited": 0.0133},
    {"step": 9, "tokens": 2304, "train_loss": 5.6727, "lr": 0.0006, "bytes_sent": 38760,
     "elapsed": 0.73},
    {"step": 12, "tokens": 3072, "train_loss": 5.6035, "lr": 0.00078, "bytes_sent": 58140,
     "elapsed": 0.80},
    {"step": 12, "tokens": 3072, "eval_loss": 5.598203834734465, "bytes_sent": 1234567891,
     "elapsed": 0.86},
]

SUMMARY = {
    "algorithm": "streaming", "workers": 2, "stages": 1, "routing": None, "inner_steps": 12,
    "tokens": 3072, "final_eval_loss": 5.598203834734465, "bytes_sent_per_rank": 58140,
    "memory_bytes_per_rank": {"model": 145792, "inner_optimizer": 291584},
    "nonfinite_skipped": {"inner_steps": 0, "syncs": 0}, "elastic": None,
    "compute_utilization": 0.82, "wall_seconds": 0.86,
    "per_worker": [{"bytes_sent": 58140, "train_seconds": 0.21},
                   {"bytes_sent": 58140, "train_seconds": 0.22}],
    "corpus": {"name": "text", "vocab_size": 300}, "device": "cpu",
    "config": {"algorithm": "streaming", "lr": 0.003},
}


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B's own files in tmp, no console output, no git or system-metrics sampling."""
    for name, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                      ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    monkeypatch.delenv(GROUP_ENV, raising=False)


def config(out, **options):
    return build_config(overrides={"algorithm": "streaming", "out": str(out), **options})


def numeric_fields(record: dict) -> dict[str, float]:
    """The scalars a record should give, by tag: its numbers, a list as its length."""
    prefix = record.get("event", "metrics")
    out = {}
    for k, v in record.items():
        if k in ("step", "event") or v is None or isinstance(v, str):
            continue
        out[f"{prefix}/{k}"] = float(len(v)) if isinstance(v, list) else float(v)
    return out


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's event reader finds, by tag: (step, value) in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def texts(log_dir) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"):
            [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def expected_scalars(records) -> dict[str, list[tuple[int, float]]]:
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        for tag, value in numeric_fields(rec).items():
            want.setdefault(tag, []).append((rec["step"], value))
    return want


def assert_scalars_match(got: dict, want: dict) -> None:
    for tag, points in want.items():
        assert tag in got, tag
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, g), (_, w) in zip(got[tag], points):
            assert g == pytest.approx(w, rel=REL), tag


def wandb_records(run_dir) -> list:
    """The records of an offline W&B run's ``.wandb`` file: LevelDB's log format (32 KiB
    blocks of chunks, each a 7-byte header: CRC, length, type) after a 7-byte file header,
    each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(run_dir) -> dict:
    """An offline run's run record, history rows and summary, decoded."""
    run, history, summary = None, [], {}
    for r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in r.history.item})
        elif kind == "summary":
            for i in r.summary.update:
                summary[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return {"run": run, "history": history, "summary": summary}


def offline_runs(out) -> list[str]:
    return sorted(glob.glob(os.path.join(str(out), "wandb", "offline-run-*")))


# ------------------------------------------------------------------------------- helpers


def test_flatten_walks_dicts_and_lists_of_dicts():
    nested = {"a": {"b": 1, "c": {"d": 2.5}}, "per": [{"x": 1}, {"x": 2}], "ids": [3, 4],
              "none": None}
    assert flatten(nested) == {"a.b": 1, "a.c.d": 2.5, "per.0.x": 1, "per.1.x": 2,
                               "ids": [3, 4], "none": None}
    prefix, step, values = record_scalars({"event": "membership", "step": 7, "members": [0, 2],
                                           "ok": True, "error": "gone", "time": 1.5,
                                           "left": None})
    assert (prefix, step) == ("membership", 7)
    assert values == {"membership/members": 2.0, "membership/ok": 1.0, "membership/time": 1.5}


def test_nothing_asked_for_does_nothing(tmp_path):
    dash = Dashboards.open(config(tmp_path / "run"))
    assert not dash.active
    for rec in RECORDS:
        dash.metric(rec)
    dash.finish(SUMMARY)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tmp_path):
    out = tmp_path / "run"
    dash = Dashboards.open(config(out, tensorboard=True))
    for rec in RECORDS:
        dash.metric(rec)
    dash.finish(SUMMARY)
    got = scalars(out / "tensorboard")
    want = expected_scalars(RECORDS)
    assert_scalars_match(got, want)
    # the sync events' bytes and waits, the elastic syncs' participants
    assert got["sync/wire_bytes"] == [(2, 12240.0), (4, 7140.0), (6, 12240.0)]
    assert got["elastic_sync/participants"] == [(4, 2.0)]
    assert got["membership/left"] == [(6, 1.0)]
    # two records at step 12 both kept; a large count to float32's precision
    assert [s for s, _ in got["metrics/bytes_sent"]][-2:] == [12, 12]
    assert got["metrics/bytes_sent"][-1][1] == pytest.approx(1234567891, rel=REL)
    # nothing but those, and the summary's
    assert {t for t in got if not t.startswith("summary/")} == set(want)
    # the summary: every number (nested keys dotted, lists of dicts by index), at the last step
    assert got["summary/final_eval_loss"] == [(12, pytest.approx(5.598203834734465, rel=REL))]
    assert got["summary/memory_bytes_per_rank.model"] == [(12, 145792.0)]
    assert got["summary/per_worker.1.train_seconds"] == [(12, pytest.approx(0.22, rel=REL))]
    assert got["summary/nonfinite_skipped.syncs"] == [(12, 0.0)]
    assert "summary/algorithm" not in got and not any(t.startswith("summary/config") for t in got)
    # the whole summary and the configuration as text, the elastic events as text
    text = texts(out / "tensorboard")
    (step, body), = text["summary"]
    assert step == 12 and json.loads(body) == SUMMARY  # a Markdown code block: indented JSON
    assert json.loads(text["config"][0][1])["tensorboard"] is True
    assert [s for s, _ in text["membership"]] == [6]
    assert json.loads(text["membership"][0][1])["left"] == [1]


def test_tensorboard_resumed_run_hides_the_events_after_the_checkpoint(tmp_path):
    """metrics.jsonl is cut at a resumed run's checkpoint; TensorBoard hides what the first
    run logged after it."""
    out = tmp_path / "run"
    first = Dashboards.open(config(out, tensorboard=True))
    for step in range(1, 7):
        first.metric({"step": step, "tokens": step * 10, "train_loss": 10.0 - step})
    first.close(failed=True)  # the first run dies after step 6
    again = Dashboards.open(config(out, tensorboard=True), resumed_from=3)
    for step in range(4, 6):
        again.metric({"step": step, "tokens": step * 10, "train_loss": 100.0 + step})
    again.close()
    got = scalars(out / "tensorboard")
    assert got["metrics/train_loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0)]


# -------------------------------------------------------------------------------- W&B


def test_wandb_offline_writes_its_run_directory(tmp_path):
    out = tmp_path / "run"
    dash = Dashboards.open(config(out, wandb=True, wandb_project="loco-test"))
    records = RECORDS + [{"step": 5, "tokens": 1280, "train_loss": 5.0}]  # back in steps
    for rec in records:
        dash.metric(rec)
    dash.finish(SUMMARY)
    assert not (out / "tensorboard").exists()
    (run_dir,) = offline_runs(out)
    (wandb_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert os.path.getsize(wandb_file) > 0
    run = wandb_run(run_dir)
    assert run["run"].display_name == "run" and run["run"].project == "loco-test"
    assert run["run"].run_group == ""
    # one row per record, in order, its step and every number exact
    assert len(run["history"]) == len(records)
    for rec, row in zip(records, run["history"]):
        assert row["step"] == rec["step"]
        fields = {k: v for k, v in row.items() if not k.startswith("_") and k != "step"}
        assert fields == pytest.approx(numeric_fields(rec), rel=1e-12)
    # the summary: numbers and text, nested keys dotted; its config is the run's config
    summary = run["summary"]
    assert summary["summary/final_eval_loss"] == SUMMARY["final_eval_loss"]
    assert summary["summary/memory_bytes_per_rank.model"] == 145792
    assert summary["summary/per_worker.0.bytes_sent"] == 58140
    assert summary["summary/algorithm"] == "streaming"
    assert "summary/routing" not in summary and "summary/config.lr" not in summary


def test_compare_logs_each_method_as_its_own_run_in_one_group(tmp_path):
    """loco compare trains its methods one after another in one process: one W&B run each,
    named by label, grouped by the comparison's directory."""
    cmp = tmp_path / "compare-1"
    dashboards = []
    with compare.wandb_group(str(cmp)):
        assert os.environ[GROUP_ENV] == "compare-1"
        for label in ("diloco", "streaming"):
            dash = Dashboards.open(config(cmp / label, tensorboard=True, wandb=True))
            dashboards.append(dash)
            (run,) = [b.run for b in dash.backends if b.name == "W&B"]
            assert (run.name, run.group) == (label, "compare-1")
            for rec in RECORDS[:2]:
                dash.metric(rec)
            dash.finish(SUMMARY)
    assert GROUP_ENV not in os.environ
    for label in ("diloco", "streaming"):
        (run_dir,) = offline_runs(cmp / label)
        run = wandb_run(run_dir)
        assert (run["run"].display_name, run["run"].run_group) == (label, "compare-1")
        assert len(run["history"]) == 2
        assert "metrics/train_loss" in scalars(cmp / label / "tensorboard")


def test_wandb_leaves_the_callers_own_run_open(tmp_path):
    """loco's run finishes its files by stopping W&B's service only when no other run of
    the process is open: a caller's own run (training from Python) goes on."""
    import wandb

    mine = wandb.init(project="mine", dir=str(tmp_path), mode="offline", reinit="create_new",
                      settings=wandb.Settings(silent=True, console="off"))
    dash = Dashboards.open(config(tmp_path / "run", wandb=True))
    dash.metric(RECORDS[1])
    dash.finish(SUMMARY)
    mine.log({"x": 1.0})
    mine.finish()
    wandb.teardown()
    assert len(wandb_run(offline_runs(tmp_path / "run")[0])["history"]) == 1
    assert [row["x"] for row in wandb_run(offline_runs(tmp_path)[0])["history"]] == [1.0]


def test_compare_names_a_shared_run_name_per_method():
    plan = compare.plan({"wandb": True, "wandb_run_name": "exp", "steps": 20},
                        "diloco,s2=streaming,noloco", sets=["noloco.wandb_run_name=mine"])
    assert [c.run.wandb_run_name for c in plan.configs] == ["exp-diloco", "exp-s2", "mine"]
    assert [c.run.wandb_run_name for c in compare.plan({"steps": 20}, "diloco").configs] == [None]


def test_wandb_that_does_not_start_fails_at_open_in_one_clear_line(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)\ncall wandb.login")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(DashboardError) as e:
        Dashboards.open(config(tmp_path / "run", wandb=True, wandb_mode="online"))
    message = str(e.value)
    assert "\n" not in message and message.startswith("--wandb:")
    assert "api_key not configured" in message and "--wandb-mode offline" in message


def test_a_dashboard_failing_mid_run_warns_and_training_goes_on(tmp_path, capsys):
    class Broken:
        name = "W&B"
        closed = None

        def metric(self, *args):
            raise OSError("disk full")

        def summary(self, summary):
            raise AssertionError("dropped: never called")

        def close(self, failed=False):
            Broken.closed = failed

    dash = Dashboards([Broken()])
    dash.metric(RECORDS[1])
    dash.metric(RECORDS[2])
    dash.finish(SUMMARY)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "W&B" in err and "disk full" in err
    assert Broken.closed is True and not dash.active


# ------------------------------------------------------------------------------ extras


@pytest.mark.parametrize("absent,option,extra", [("tensorboard", "tensorboard", "tensorboard"),
                                                 ("wandb", "wandb", "wandb")])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, absent, option, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == absent else real(name, *a))
    cfg = config(tmp_path / "run", **{option: True})
    message = missing_extra(cfg)
    assert message == (f"--{option} needs the {extra} extra: pip install 'loco[{extra}]'")
    with pytest.raises(DashboardError, match=f"loco\\[{extra}\\]"):
        Dashboards.open(cfg)
    assert not (tmp_path / "run").exists()
    # the other option alone is fine; neither asked for, nothing is checked
    other = "wandb" if option == "tensorboard" else "tensorboard"
    assert missing_extra(config(tmp_path / "run", **{other: True})) is None
    assert missing_extra(config(tmp_path / "run")) is None


def test_both_extras_missing_name_both(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    message = missing_extra(config(tmp_path / "run", tensorboard=True, wandb=True))
    assert "\n" not in message
    assert "loco[tensorboard]" in message and "loco[wandb]" in message


def test_installed_extras_are_not_missing(tmp_path):
    assert missing_extra(config(tmp_path / "run", tensorboard=True, wandb=True)) is None


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_train_logs_every_metric_to_tensorboard_and_wandb(corpus, tmp_path):
    """loco train --tensorboard --wandb: TensorBoard's scalars are metrics.jsonl's records
    one by one, W&B's offline run has one row per record, both have the summary."""
    from loco.cli import main

    text, cache = corpus
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny", "--workers", "2", "--steps", "12",
                 "--sync-every", "4", "--seq-len", "32", "--batch-size", "4",
                 "--vocab-size", "300", "--eval-every", "6", "--eval-batches", "2",
                 "--log-every", "3", "--corpus", text, "--cache-dir", cache, "--out", str(out),
                 "--no-progress", "--tensorboard", "--wandb"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert any(r.get("event") == "sync" for r in records)
    assert (out / "tensorboard").is_dir(), "RunLog does not open the Dashboards yet"
    got = scalars(out / "tensorboard")
    want = expected_scalars(records)
    assert_scalars_match(got, want)
    assert {t for t in got if not t.startswith("summary/")} == set(want)
    assert got["summary/final_eval_loss"] == [
        (12, pytest.approx(summary["final_eval_loss"], rel=REL))]
    assert json.loads(texts(out / "tensorboard")["summary"][0][1]) == summary
    (run_dir,) = offline_runs(out)
    run = wandb_run(run_dir)
    assert run["run"].display_name == "run"
    assert [row["step"] for row in run["history"]] == [r["step"] for r in records]
    assert run["summary"]["summary/final_eval_loss"] == summary["final_eval_loss"]
    assert not math.isnan(run["summary"]["summary/bytes_sent_per_rank"])
