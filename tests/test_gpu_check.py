"""``benchmarks/gpu_check.py``, the check to run first whenever a GPU is at hand: its CPU dry
run (every section at a tiny size, the methods under torchrun with gloo and the host-read
counter), its reading of a profile's streams, and its table."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_check.py")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_writes_the_table(gpu_check, tmp_path):
    out = tmp_path / "check"
    # One method run under torchrun (each is two fresh Pythons, ~5 s of CPU): DiLoCo, first,
    # alone; NoLoCo, after it in the pool, is turned down for want of a second worker.
    res = gpu_check.main(["--dry-run", "--out", str(out), "--methods", "diloco,noloco",
                          "--parallel", "2"])
    assert set(res) == {"device", "mfu", "codecs", "overlap", "methods"}
    assert not [name for name, sec in res.items() if "error" in sec], res
    assert res["mfu"]["eager"]["tokens_per_second"] > 0
    assert all(r["eager"]["encode_gbs"] > 0 for r in res["codecs"]["codecs"].values())
    rows = res["methods"]["methods"]
    assert res["methods"]["mode"] == "count"
    assert rows["diloco"]["returncode"] == 0 and rows["diloco"]["final_eval_loss"] > 0
    (per_step, per_sync), = rows["diloco"]["host_reads"]
    assert per_step == 0 and per_sync is not None
    assert "needs 2 workers" in rows["noloco"]["skipped"]
    saved = json.loads((out / "gpu_check.json").read_text())["methods"]
    assert saved == json.loads(json.dumps(res["methods"]))
    table = (out / "gpu_check.md").read_text()
    assert "| diloco, 12 steps, host reads count | ok, loss" in table
    assert "| noloco, 12 steps, host reads count | not run: needs 2 workers" in table


def test_a_profile_s_streams_give_the_overlap(gpu_check):
    """Two streams' kernels: the busier one is the training stream; the other's busy time
    (merged: 0-10 and 30-40 us) overlaps it for 5 of its 20 us."""
    kernel = {"cat": "kernel", "ph": "X"}
    trace = {"traceEvents": [
        {**kernel, "ts": 0, "dur": 6, "args": {"stream": 7}},
        {**kernel, "ts": 5, "dur": 30, "args": {"stream": 7}},  # 0-35, merged
        {**kernel, "ts": 0, "dur": 10, "args": {"stream": 13}},
        {**kernel, "ts": 2, "dur": 4, "args": {"stream": 13}},
        {**kernel, "ts": 30, "dur": 10, "args": {"stream": 13}},
        {"cat": "cpu_op", "ts": 0, "dur": 100, "args": {}},
    ]}
    got = gpu_check.stream_overlap(trace)
    assert got["streams"] == 2 and got["training_stream_busy_ms"] == 0.035
    assert got["stream 13"]["busy_ms"] == 0.02
    assert got["stream 13"]["overlapped"] == pytest.approx((10 + 5) / 20)


def test_a_failed_run_is_named_with_its_rank_s_error(gpu_check):
    lines = ["noise", "[loco] worker 0 failed:", "Traceback (most recent call last):",
             '  File "x.py", line 3, in step', "RuntimeError: called a synchronizing CUDA "
             "operation", "E1127 09:17:51 torch/distributed/elastic ... failed"]
    reason, tail = gpu_check.failure(lines)
    assert reason == "RuntimeError: called a synchronizing CUDA operation"
    assert tail[0] == "[loco] worker 0 failed:" and tail[-1].startswith("RuntimeError")
    said = gpu_check.failure(["loco train: error: --group-size: must divide --workers"])
    assert said == ("loco train: error: --group-size: must divide --workers", [])
    # torchrun failing before any rank ran: its agent's traceback, whose last line says why
    agent = ["Traceback (most recent call last):",
             '  File ".../torch/distributed/elastic/multiprocessing/errors/__init__.py", line '
             "362, in wrapper", '  File ".../static_tcp_rendezvous.py", line 67, in '
             "next_rendezvous", "    self._store = TCPStore(  # type: ignore[call-arg]",
             "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
             "torch.distributed.DistNetworkError: The server socket has failed to listen on "
             "any local network address. port: 44177, code: -98, name: EADDRINUSE"]
    reason, tail = gpu_check.failure(agent)
    assert reason.startswith("torch.distributed.DistNetworkError: The server socket")
    assert tail == agent
    # a rank that failed before loco's launch said so: its error, not torch elastic's summary
    rank = ["Traceback (most recent call last):", '  File "data.py", line 9, in corpus',
            "FileNotFoundError: no such corpus: x.txt", "E1129 05:00:00 ... failed (exitcode: 1)",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert gpu_check.failure(rank)[0] == "FileNotFoundError: no such corpus: x.txt"


def test_torchrun_jobs_bind_a_port_the_kernel_picks(gpu_check):
    """Each run is ``torchrun --standalone``: its agent binds port 0. A port chosen free
    beforehand (``--master-port``) could be taken by another job before torchrun binds it:
    the overlap section once failed so beside the suite's parallel jobs on a loaded machine."""
    args = types.SimpleNamespace(dry_run=True, ranks=1)
    cmd = gpu_check.train_command(args, "/root", "diloco", [], "/out")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert not [a for a in cmd if a.startswith(("--master-port", "--rdzv-endpoint"))]
