"""The compute-utilization simulator: the paper's properties, closed forms, the CLI's output."""

import argparse
import json
import math

import numpy as np
import pytest

from loco.config import ConfigError
from loco.simulate import utilization as u
from loco.simulate.utilization import (METHODS, PRESETS, TARGETS, ModelSpec, required_bandwidth,
                                       utilization)

BANDWIDTHS = np.logspace(-2, 4, 25)
CASES = [(name, method) for name in PRESETS for method in METHODS]


@pytest.fixture(scope="module")
def needs():
    """The default table: {model: {method: {"0.5": Gbit/s, ...}}}."""
    return u.table()


def args(*argv):
    parser = argparse.ArgumentParser()
    u.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name,method", CASES)
def test_infinite_bandwidth_gives_full_utilization(name, method):
    assert utilization(method, PRESETS[name], math.inf) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("name,method", CASES)
def test_utilization_never_falls_as_bandwidth_grows(name, method):
    cu = [utilization(method, PRESETS[name], float(b)) for b in BANDWIDTHS]
    assert all(0 <= c <= 1 for c in cu)
    assert np.all(np.diff(cu) >= -1e-12)
    assert cu[0] < 0.5 < cu[-1]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("target", TARGETS)
def test_data_parallel_needs_the_most_bandwidth(needs, name, target):
    row = {m: needs[name][m][f"{target:g}"] for m in METHODS}
    assert all(row["data_parallel"] > row[m] for m in METHODS[1:])


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("target", TARGETS)
def test_four_bits_need_less_than_sixteen(needs, name, target):
    key = f"{target:g}"
    assert needs[name]["streaming_overlap_fp4"][key] < needs[name]["streaming_overlap"][key]


@pytest.mark.parametrize("name,method", CASES)
def test_fewer_bits_never_hurt(name, method):
    for b in BANDWIDTHS[::4]:
        cu16 = utilization(method, PRESETS[name], float(b), bits=16, fp4_bits=16)
        cu4 = utilization(method, PRESETS[name], float(b), bits=4, fp4_bits=4)
        assert cu4 >= cu16 - 1e-12


@pytest.mark.parametrize("name", PRESETS)
def test_overlap_never_hurts(name):
    spec = PRESETS[name]
    longest = math.ceil(100 / u.fragments(spec, 3)) - 1  # the largest tau below H/P
    for b in BANDWIDTHS:
        cu = [utilization("streaming_overlap", spec, float(b), overlap=t)
              for t in range(longest + 1)]
        assert cu[0] == pytest.approx(utilization("streaming", spec, float(b)), abs=1e-12)
        assert np.all(np.diff(cu) >= -1e-12)


def ring_seconds(nbytes, gbps, workers=2, latency=0.0):
    return 2 * (workers - 1) * (latency + nbytes / workers * 8 / (gbps * 1e9))


@pytest.mark.parametrize("workers,latency", [(2, 0.0), (4, 0.01)])
def test_diloco_matches_its_closed_form(workers, latency):
    spec = ModelSpec("toy", 4, 0.5, 2e9)
    H, gbps = 10, 8.0
    t_reduce = ring_seconds(2e9 * 2, gbps, workers, latency)  # 16-bit values
    expected = H * 0.5 / (H * 0.5 + t_reduce)
    got = utilization("diloco", spec, gbps, H=H, workers=workers, latency_s=latency)
    assert got == pytest.approx(expected, rel=1e-12)


def test_streaming_without_overlap_matches_its_closed_form():
    # 5 layers in fragments of 2: P = 3 fragments of 2, 2 and 1 layers, H/P = 10/3 steps.
    spec = ModelSpec("toy", 5, 0.2, 5e8)
    H, gbps = 10, 3.0
    per_layer_bytes = 5e8 / 5 * 2
    t = sum(ring_seconds(n * per_layer_bytes, gbps) for n in (2, 2, 1))
    got = utilization("streaming", spec, gbps, H=H, layers_per_fragment=2)
    assert got == pytest.approx(H * 0.2 / (H * 0.2 + t), rel=1e-12)


def test_streaming_overlap_stalls_only_for_what_runs_past_tau_steps():
    spec = ModelSpec("toy", 6, 1.0, 6e9)
    H, gbps = 12, 10.0  # P = 2 fragments of 6e9 bytes: 4.8 s each at 10 Gbit/s
    t = ring_seconds(3e9 * 2, gbps)
    for tau in (1, 3, 5):
        got = utilization("streaming_overlap", spec, gbps, H=H, overlap=tau)
        expected = H / (H + 2 * max(0.0, t - tau))
        assert got == pytest.approx(expected, rel=1e-12)


def test_enough_overlap_reaches_full_utilization_where_streaming_does_not():
    spec = PRESETS["10b"]
    fragment_bits = 1e10 / 16 * 16  # 16 fragments, 16-bit values
    gbps = fragment_bits / 0.8 / 1e9 * 1.01  # a fragment takes just under one 0.8 s step
    assert utilization("streaming_overlap", spec, gbps) == pytest.approx(1.0, abs=1e-12)
    assert utilization("streaming", spec, gbps) < 0.99


def test_data_parallel_hides_reductions_under_the_backward_pass():
    spec = ModelSpec("toy", 4, 0.3, 4e9)
    backward = 0.2
    gbps = 4e9 * 16 / backward / 1e9  # all gradients take exactly the backward pass
    cu = utilization("data_parallel", spec, gbps)
    # Layer L's reduction starts after its weight gradient, 1/4 into the backward pass, so
    # the step ends 1/4 of the backward pass late; a slower link loses more.
    assert cu == pytest.approx(0.3 / (0.3 + backward / 4), rel=1e-12)
    assert utilization("data_parallel", spec, gbps * 2) > cu > utilization("data_parallel",
                                                                             spec, gbps / 2)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("target", [0.5, 0.95])
def test_required_bandwidth_is_the_threshold(method, target):
    spec = PRESETS["1b"]
    gbps = required_bandwidth(method, spec, target)
    assert utilization(method, spec, gbps) >= target
    assert utilization(method, spec, gbps * (1 - 1e-4)) < target


def test_latency_can_make_a_target_unreachable():
    spec = PRESETS["1b"]
    # Data-parallel: the last layer's all-reduce (2 latencies) is never hidden: CU <= 0.1/0.102.
    assert required_bandwidth("data_parallel", spec, 0.99, latency_s=0.001) == math.inf
    assert math.isfinite(required_bandwidth("streaming_overlap", spec, 0.99, latency_s=0.001))


def test_json_output_shape(capsys):
    code = u.run(args("--model", "1b", "--json", "--targets", "0.5,0.95", "--plot", ""))
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["1b"]
    assert tuple(data["1b"]) == METHODS
    for row in data["1b"].values():
        assert list(row) == ["0.5", "0.95"]
        assert all(isinstance(v, float) and v > 0 for v in row.values())


def test_json_marks_unreachable_targets_null(capsys):
    u.run(args("--model", "1b", "--json", "--targets", "0.99", "--latency", "0.01",
               "--plot", ""))
    data = json.loads(capsys.readouterr().out)
    assert data["1b"]["data_parallel"]["0.99"] is None


def test_table_and_plot(capsys, tmp_path):
    path = tmp_path / "cu.png"
    code = u.run(args("--model", "custom", "--layers", "6", "--step-time", "0.2",
                      "--params", "3e8", "--sync-every", "12", "--plot", str(path)))
    assert code == 0
    out = capsys.readouterr().out
    assert "custom: 6 layers" in out and "H=12" in out
    assert all(m in out for m in METHODS) and "95%" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD = [
    (["--sync-every", "0"], "sync_every", ">= 1"),
    (["--layers-per-fragment", "0"], "layers_per_fragment", "[1, 24]"),
    (["--model", "1b", "--layers-per-fragment", "25"], "layers_per_fragment", "[1, 24]"),
    (["--overlap", "-1"], "overlap", "[0, 12.5)"),
    (["--model", "1b", "--overlap", "13"], "overlap", "[0, 12.5)"),
    (["--model", "100b", "--overlap", "3"], "overlap", "[0, 2.77778)"),
    (["--bits", "0"], "bits", "[1, 64]"),
    (["--bits", "65"], "bits", "[1, 64]"),
    (["--fp4-bits", "0"], "fp4_bits", "[1, 64]"),
    (["--workers", "1"], "workers", ">= 2"),
    (["--latency", "-0.1"], "latency", ">= 0"),
    (["--targets", "0.5,1"], "targets", "(0, 1)"),
    (["--targets", "95"], "targets", "(0, 1)"),
    (["--targets", "0"], "targets", "(0, 1)"),
    (["--targets", "half"], "targets", "comma-separated"),
    (["--model", "custom", "--layers", "4", "--step-time", "1"], "params", "required"),
    (["--model", "custom", "--params", "1e9", "--step-time", "1"], "layers", "required"),
    (["--model", "custom", "--layers", "4", "--params", "1e9"], "step_time", "required"),
    (["--model", "custom", "--layers", "0", "--step-time", "1", "--params", "1e9"],
     "layers", ">= 1"),
    (["--model", "custom", "--layers", "4", "--step-time", "0", "--params", "1e9"],
     "step_time", "> 0"),
    (["--model", "custom", "--layers", "4", "--step-time", "1", "--params", "-1"],
     "params", "> 0"),
    (["--model", "10b", "--layers", "4"], "layers", "--model custom"),
]


@pytest.mark.parametrize("argv,option,allowed", BAD)
def test_bad_inputs_name_the_option(argv, option, allowed, capsys):
    with pytest.raises(ConfigError) as err:
        u.run(args(*argv, "--plot", ""))
    assert err.value.option == option
    assert str(err.value).startswith(f"--{option.replace('_', '-')}: ")
    assert allowed in str(err.value)
    assert capsys.readouterr().out == ""


def test_api_rejects_bad_settings():
    with pytest.raises(ConfigError, match="--sync-every"):
        utilization("diloco", PRESETS["1b"], 10.0, H=0)
    with pytest.raises(ConfigError, match="--targets"):
        required_bandwidth("diloco", PRESETS["1b"], 1.0)
    with pytest.raises(ValueError, match="unknown method"):
        utilization("ddp", PRESETS["1b"], 10.0)
    with pytest.raises(ValueError, match="bandwidth"):
        utilization("diloco", PRESETS["1b"], 0.0)
