"""``loco train --profile A-B``: a Chrome trace of those steps, with a range per phase of a
sync (docs/profiling.md)."""

from __future__ import annotations

import collections
import json

import pytest

from loco.checkpoint import resume_config
from loco.cli import main
from loco.config import ConfigError, TrainConfig, profile_steps

#: The ranges of one sync of DiLoCo and Streaming DiLoCo (the all-reduce's on the
#: communication thread, the rest on the training thread).
ALL_REDUCE_PHASES = {"loco/pseudo_gradient", "loco/encode", "loco/all_to_all", "loco/reduce",
                     "loco/all_gather", "loco/decode", "loco/wait", "loco/outer_step",
                     "loco/merge"}
#: DiLoCo's fp32 sync with the plain mean (``--aggregation mean``): the group's own
#: all-reduce, nothing to encode.
NATIVE_PHASES = {"loco/pseudo_gradient", "loco/all_reduce", "loco/wait", "loco/outer_step",
                 "loco/merge"}
#: NoLoCo's: a point-to-point exchange in place of the all-reduce's collectives.
NOLOCO_PHASES = {"loco/pseudo_gradient", "loco/encode", "loco/exchange", "loco/wait",
                 "loco/reduce", "loco/outer_step", "loco/merge"}


def run(corpus, out, *extra):
    text, cache = corpus
    return ["train", "--model", "tiny", "--workers", "2", "--steps", "8", "--sync-every", "4",
            "--seq-len", "32", "--batch-size", "4", "--vocab-size", "300", "--eval-every", "0",
            "--final-eval-batches", "2", "--corpus", text, "--cache-dir", cache,
            "--out", str(out), "--no-progress", *extra]


def trace_events(out) -> list[dict]:
    return json.loads((out / "profile" / "trace-rank0.json").read_text())["traceEvents"]


def loco_ranges(events) -> collections.Counter:
    """How often each loco/ range occurs, by (name, thread)."""
    return collections.Counter((e["name"], e["tid"]) for e in events
                               if e.get("ph") == "X" and e["name"].startswith("loco/"))


def test_streaming_trace_holds_every_phase_of_the_profiled_steps_only(corpus, tmp_path,
                                                                      capsys):
    out = tmp_path / "run"
    assert main(run(corpus, out, "--algorithm", "streaming", "--profile", "3-6")) == 0
    err = capsys.readouterr().err
    assert f"profile of steps 3-6 written to {out / 'profile' / 'trace-rank0.json'}" in err
    ranges = loco_ranges(trace_events(out))
    names = {name for name, _ in ranges}
    assert ALL_REDUCE_PHASES | {"loco/inner_step", "loco/forward_backward"} <= names
    # The profiling thread (rank 0's) marks the steps it profiled: exactly 3 to 6 ...
    steps = {name: tid for name, tid in ranges if name.startswith("loco/step#")}
    assert sorted(steps) == [f"loco/step#{s}" for s in range(3, 7)]
    lead = steps["loco/step#3"]
    # ... and took one inner step in each (the other worker's thread is in the trace too,
    # within a step or so of it: one process profiles every thread)
    assert ranges["loco/inner_step", lead] == ranges["loco/forward_backward", lead] == 4
    assert len({tid for name, tid in ranges if name == "loco/inner_step"}) == 2
    # The collectives run on the communication threads, not on the training threads.
    assert {tid for name, tid in ranges if name == "loco/all_to_all"}.isdisjoint(
        {tid for name, tid in ranges if name == "loco/inner_step"})
    # A resumed run may profile other steps (--profile is resumable).
    assert resume_config(str(out), {"profile": "2-3"}).run.profile == "2-3"


@pytest.mark.parametrize("algorithm,extra,phases", [
    ("diloco", ("--aggregation", "mean"), NATIVE_PHASES),
    # the guard reduces where it sees every worker's rows: loco's reduce-scatter
    ("diloco", (), ALL_REDUCE_PHASES),
    ("noloco", (), NOLOCO_PHASES)])
def test_diloco_and_noloco_traces_hold_their_phases(algorithm, extra, phases, corpus,
                                                    tmp_path):
    out = tmp_path / "run"
    assert main(run(corpus, out, "--algorithm", algorithm, "--profile", "4", *extra)) == 0
    names = {name for name, _ in loco_ranges(trace_events(out))}
    assert phases | {"loco/step#4", "loco/inner_step"} <= names
    assert not any(n.startswith("loco/step#") and n != "loco/step#4" for n in names)


def test_no_profile_writes_no_trace(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(run(corpus, out, "--algorithm", "ddp", "--steps", "2")) == 0
    assert not (out / "profile").exists()


@pytest.mark.parametrize("value,window", [(None, None), ("7", (7, 7)), ("2-9", (2, 9)),
                                          (" 1-10 ", (1, 10)), (10, (10, 10))])
def test_profile_steps_parses(value, window):
    assert profile_steps(TrainConfig(steps=10, profile=value)) == window


@pytest.mark.parametrize("value", ["0-3", "9-2", "abc", "3-", "-3", "5-11", "11", "1-2-3",
                                   "0"])
def test_bad_profile_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"^--profile: .*A-B with 1 <= A <= B <= --steps "
                                          r"\(10\)"):
        profile_steps(TrainConfig(steps=10, profile=value))
