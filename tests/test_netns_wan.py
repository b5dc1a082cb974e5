"""benchmarks/netns_wan.py: training over real rate-limited links between network namespaces.

The real run needs root, iproute2 and a kernel that allows namespaces, veth pairs and tbf; it
is skipped elsewhere. The refusal without root is tested everywhere.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "netns_wan.py"


def load_script():
    spec = importlib.util.spec_from_file_location("netns_wan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def namespaces_work():
    """Skip unless this machine can build what the benchmark builds: try it on a probe."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs iproute2 (ip, tc)")
    probe = f"loco-wan-{os.getpid()}-probe"  # removed by the script if left behind
    steps = [["ip", "netns", "add", probe],
             ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
             ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "100mbit",
              "burst", "64kb", "limit", "1mb"]]
    try:
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                pytest.skip(f"cannot {' '.join(cmd[:4])}: {p.stderr.strip()}")
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    assert probe not in netns_names()


def test_refuses_without_root(monkeypatch, capsys):
    module = load_script()
    monkeypatch.setattr(module.os, "geteuid", lambda: 1000)
    assert module.main(["--workers", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs root and iproute2" in err and "\n" not in err


def test_refuses_without_iproute2(monkeypatch, capsys):
    module = load_script()
    monkeypatch.setattr(module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(module.shutil, "which", lambda tool: None)
    assert module.main([]) == 2
    assert "not found: ip, tc" in capsys.readouterr().err


def test_help_and_rate_units():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--rate" in p.stdout and "--mtu" in p.stdout
    module = load_script()
    assert module.tc_rate_bytes("100mbit") == 12.5e6
    assert module.tc_rate_bytes("1Gbit") == 125e6
    assert module.tc_rate_bytes("2mbps") == 2e6


# The syncs' bytes do not depend on the batches: small ones and no evaluation keep the runs
# short (a pseudo-gradient of the tiny model is the same 632 KB).
SMALL_BATCHES = ("--seq-len", "32", "--batch-size", "4", "--eval-every", "0",
                 "--final-eval-batches", "2")
# The runs' time-outs only catch a hang: far above what a busy machine takes (the elastic
# run, about 25 s alone, took 209 s with one core busy under `make test`).
HANG = 900


def run_script(capsys, *argv: str) -> tuple[int, str]:
    """The benchmark's ``main`` in this process (its command line is run by
    ``test_help_and_rate_units``): no Python of its own importing torch again; its workers
    are torchrun processes all the same. Returns the exit status and what it printed."""
    cut = argv.index("--")  # loco train's options follow it
    code = load_script().main([*argv[:cut], "--timeout", str(HANG), *argv[cut:]])
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def test_real_links_bytes_agree(namespaces_work, tmp_path, capsys):
    results = tmp_path / "netns.json"
    code, printed = run_script(capsys, "--workers", "2", "--model", "tiny", "--steps", "20",
                               "--sync-every", "10", "--out", str(tmp_path / "run"),
                               "--json", str(results), "--", *SMALL_BATCHES)
    assert code == 0, printed
    assert "agreement within 5%: yes" in printed
    res = json.loads(results.read_text())
    assert res["exit_code"] == 0 and res["exit_codes"] == [0, 0]
    tol = res["agreement"]["tolerance"]
    assert tol == 0.05 and res["agreement"]["ok"]
    for w in res["workers"]:
        # The library counted real traffic, and the interface saw about as much: never less
        # than the payload, and the overhead (headers, rendezvous) within the tolerance.
        assert w["lib_sent_bytes"] > 100_000 and w["lib_recv_bytes"] > 100_000
        for d in ("tx", "rx"):
            assert 1.0 <= w[f"{d}_ratio"] <= 1 + tol, w
            assert w[f"{d}_header_bytes"] > 0
    assert 0 < res["wall_seconds"] < HANG
    assert 0 < res["train_seconds"] <= res["train_wall_seconds"] <= res["wall_seconds"]
    assert 0 < res["compute_utilization"] <= 1
    assert res["min_link_seconds"] > 0
    # Every namespace of the run is gone.
    assert res["prefix"].startswith("loco-wan-") and res["namespaces_left"] == []
    assert not [n for n in netns_names() if n.startswith(res["prefix"] + "-")]


def test_elastic_workers_on_separate_hosts_rejoin(namespaces_work, tmp_path, capsys):
    """Elastic membership across hosts: 2 workers in namespaces of their own (an address
    each, nothing on loopback between them), a Lighthouse listening in worker 0's; worker 1
    killed at step 10, restarted by its torchrun, rejoins from the live worker over the veth
    links. ``--min-workers 2``: the survivor waits for it at the next quorum, so a loaded
    machine, where the restart takes longer than the steps left, cannot end the run before
    it is back; the syncs at steps 12 to 24 are the survivor's with it (the rejoin and
    full strength need one)."""
    results = tmp_path / "netns.json"
    code, printed = run_script(
        capsys, "--elastic", "--workers", "2", "--model", "tiny", "--steps", "24",
        "--sync-every", "4", "--kill", "1:10", "--min-workers", "2",
        "--out", str(tmp_path / "run"), "--json", str(results),
        "--", "--link-latency", "20ms", "--log-every", "50", "--checkpoint-every", "0",
        *SMALL_BATCHES)
    assert code == 0, printed
    res = json.loads(results.read_text())
    assert res["exit_codes"] == [0, 0] and res["namespaces_left"] == []
    elastic = res["elastic"]
    # Worker 1, and only it, left; it came back from the live worker, and every committed
    # sync counted two (the survivor waited for it).
    assert [loss["left"] for loss in elastic["losses"]] == [[1]]
    assert elastic["losses"][0]["to_full_strength"] is not None
    assert set(elastic["syncs_by_participants"]) == {"2"}
    # the live worker served the joiner's state to worker 1's address, over the links
    served = (tmp_path / "run" / "logs" / "worker0.log").read_text()
    assert re.search(r"10\.77\.0\.2 .*GET /checkpoint/", served)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    joined = [e for e in summary["elastic"]["events"] if e["event"] == "membership"
              and 1 in e["joined"] and e["time"] > 0]
    assert joined[-1]["members"] == [0, 1]
