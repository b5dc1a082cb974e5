"""Real slow links: train across network namespaces joined by rate-limited veth links.

Needs root and iproute2 (``ip``, ``tc``). For M workers it builds, all under a name prefix
``loco-wan-<pid>`` that no other run shares::

    loco-wan-<pid>-w0  [wan0 10.77.0.1/24] ==veth== [port0] \\
    loco-wan-<pid>-w1  [wan1 10.77.0.2/24] ==veth== [port1]  > br0 in loco-wan-<pid>-br
    ...                                                     /

* one network namespace per worker, holding ``lo`` and its end of a veth pair, with an address
  in 10.77.0.0/24 and no default route: the only hosts it can reach are the other workers;
* a bridge namespace holding the bridge ``br0`` with the other ends of the veth pairs;
* ``tc ... tbf`` on both ends of every veth pair: the worker end's egress is the worker's
  upload, the bridge end's egress its download, each limited to ``--rate`` (netem is not
  available, so there is no added latency: only the rate limit);
* no device is ever created in the host's namespace (the veth pairs are created inside the
  namespaces), so nothing of this run can reach or disturb the host's network.

Then one ``torchrun`` per worker namespace (``ip netns exec``), joined by torch's static
rendezvous (its TCPStore on worker 0), runs ``loco train`` with gloo on the worker's veth
(``GLOO_SOCKET_IFNAME``). After the run it compares each worker's interface byte counters with
the library's own count of the payload bytes that rank sent and received (``OUT/comm/
rank<r>.json``, every tag), explains the difference (frame headers, ACKs, the rendezvous and
gloo's connection set-up, retransmissions), and prints the wall time, the time the rate alone
implies, and the compute utilization.

Every namespace it created is deleted at the end (which removes the veths and the bridge with
them), also when the run fails or on SIGINT/SIGTERM; leftovers of earlier runs whose process
is gone are removed at start.

    sudo .venv/bin/python benchmarks/netns_wan.py                       # 4 workers, 100mbit
    sudo .venv/bin/python benchmarks/netns_wan.py --workers 2 --model tiny --steps 20
    sudo .venv/bin/python benchmarks/netns_wan.py --rate 20mbit -- --outer-lr 0.5

Arguments after ``--`` go to ``loco train`` unchanged (and override the ones set here).
Exit status: 0 when the run succeeded and the byte counts agree within ``--tolerance``, 1 when
the run failed, 2 when the machine cannot run it (not root, no iproute2) or an option is wrong,
3 when the counts disagree, 128 + N when stopped by signal N.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import datetime

PREFIX = "loco-wan"
SUBNET = "10.77.0"  # worker i is SUBNET.(i + 1)/24
BRIDGE = "br0"
# Bytes of headers on every TCP segment as the interface counters see it: Ethernet 14 (the
# counters exclude preamble, FCS and the inter-frame gap) + IPv4 20 + TCP 20 + the timestamp
# option 12 that Linux puts on every segment.
HEADER_BYTES = 14 + 20 + 20 + 12
# The C library, opened once here: the child between fork and exec (``_die_with_parent``)
# then only calls into it (no dlopen there, in a process that may run other threads).
LIBC = ctypes.CDLL(None, use_errno=True)
NEEDS = "benchmarks/netns_wan.py needs root and iproute2 (ip, tc): it creates network namespaces"


class Interrupted(Exception):
    """Raised by the SIGINT/SIGTERM handler so that the ``finally`` clauses clean up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class CommandError(RuntimeError):
    pass


# ------------------------------------------------------------------------------- helpers
def missing_requirements() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return f"{NEEDS}; run it as root (not root here)"
    lacking = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if lacking:
        return f"{NEEDS}; not found: {', '.join(lacking)}"
    return None


def sh(*cmd: str, check: bool = True) -> str:
    """Run a command; return its stdout; raise CommandError with its stderr on failure."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise CommandError(f"`{' '.join(cmd)}` failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


def list_netns() -> list[str]:
    out = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours(name: str, pid: int | None = None) -> bool:
    m = re.fullmatch(rf"{PREFIX}-(\d+)-(w\d+|br|probe)", name)
    return bool(m) and (pid is None or int(m.group(1)) == pid)


def kill_netns_processes(ns: str) -> None:
    """End the processes still inside one of our namespaces (ours: we started them there)."""
    pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if pid_alive(p)]
            time.sleep(0.1)
        if not pids:
            return


def delete_netns(ns: str) -> None:
    kill_netns_processes(ns)
    sh("ip", "netns", "delete", ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is no longer alive."""
    removed = []
    for ns in list_netns():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-(w\d+|br|probe)", ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            delete_netns(ns)
            removed.append(ns)
    return removed


def tc_rate_bytes(rate: str) -> float:
    """tc's rate syntax (bit, kbit, mbit, gbit, bps, kbps, ..., kibit, ...) in bytes/s."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    if not m:
        raise ValueError(f"not a tc rate: {rate!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    prefixes = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    for p, mult in prefixes.items():
        if unit == p + "bit":
            return value * mult / 8
        if unit == p + "bps":
            return value * mult
    if unit == "":
        return value / 8  # tc reads a bare number as bits per second
    raise ValueError(f"not a tc rate: {rate!r}")


# ------------------------------------------------------------------------------- network
class WanNet:
    """The namespaces, bridge, veth pairs and tbf qdiscs of one run."""

    def __init__(self, workers: int, rate: str, burst: str, limit: str, mtu: int,
                 prefix: str | None = None):
        self.workers, self.rate, self.burst, self.limit, self.mtu = workers, rate, burst, limit, mtu
        self.prefix = prefix or f"{PREFIX}-{os.getpid()}"
        self.bridge_ns = f"{self.prefix}-br"
        self.created: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}-w{i}"

    @staticmethod
    def dev(i: int) -> str:
        return f"wan{i}"

    @staticmethod
    def port(i: int) -> str:
        return f"port{i}"

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _add_ns(self, name: str) -> None:
        self.created.append(name)  # before: a half-made namespace is still removed
        sh("ip", "netns", "add", name)
        # No IPv6: its router solicitations and neighbour discovery would be traffic the
        # library cannot know about (IPv4 ARP remains: a few 42-byte frames per peer).
        sh("ip", "netns", "exec", name, "sysctl", "-q", "-w",
           "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
           check=False)

    def _tbf(self, ns: str, dev: str) -> None:
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
           "burst", self.burst, "limit", self.limit)

    def up(self) -> None:
        self._add_ns(self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0")
        for i in range(self.workers):
            ns, dev, port = self.ns(i), self.dev(i), self.port(i)
            self._add_ns(ns)
            # Created inside the namespaces: no device of this run ever exists on the host.
            sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port,
               "netns", self.bridge_ns)
            # One frame per TCP segment (no 64 KB GSO super-frames): the counters then see
            # what a real link of this MTU would carry, headers and ACKs included.
            sh("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "gso_max_segs", "1")
            sh("ip", "-n", self.bridge_ns, "link", "set", port, "mtu", str(self.mtu),
               "gso_max_segs", "1", "master", BRIDGE)
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._tbf(ns, dev)  # upload
            self._tbf(self.bridge_ns, port)  # download
            sh("ip", "-n", self.bridge_ns, "link", "set", port, "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "mtu", str(self.mtu), "up")
        for i in range(self.workers):  # no default route: only 10.77.0.0/24 is reachable
            routes = sh("ip", "-n", self.ns(i), "-4", "route", "show", "default")
            if routes.strip():
                raise CommandError(f"{self.ns(i)} has a default route: {routes.strip()}")

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until every link is up (carrier on both ends through the bridge)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [json.loads(sh("ip", "-n", self.ns(i), "-j", "link", "show", self.dev(i)))[0]
                      .get("operstate") for i in range(self.workers)]
            if all(s == "UP" for s in states) or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def counters(self) -> list[dict]:
        """Each worker interface's byte and packet counters (stats64)."""
        out = []
        for i in range(self.workers):
            link = sh("ip", "-n", self.ns(i), "-j", "-s", "link", "show", self.dev(i))
            s = json.loads(link)[0]["stats64"]
            out.append({"tx_bytes": s["tx"]["bytes"], "tx_packets": s["tx"]["packets"],
                        "rx_bytes": s["rx"]["bytes"], "rx_packets": s["rx"]["packets"]})
        return out

    def qdisc_stats(self) -> list[dict]:
        """Drops and rate of both tbf qdiscs of every worker's link."""
        def tbf(ns, dev):
            shown = json.loads(sh("tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev))
            q = next(q for q in shown if q.get("kind") == "tbf")
            return {"drops": q.get("drops", 0), "overlimits": q.get("overlimits", 0),
                    "rate_bytes_per_second": q.get("options", {}).get("rate")}
        return [{"up": tbf(self.ns(i), self.dev(i)), "down": tbf(self.bridge_ns, self.port(i))}
                for i in range(self.workers)]

    def tcp_stats(self) -> list[dict]:
        """Each worker namespace's TCP segment counters (/proc/net/snmp is per namespace)."""
        out = []
        for i in range(self.workers):
            lines = [ln.split() for ln in sh("ip", "netns", "exec", self.ns(i), "cat",
                                             "/proc/net/snmp").splitlines()
                     if ln.startswith("Tcp:")]
            tcp = dict(zip(lines[0][1:], map(int, lines[1][1:])))
            out.append({k: tcp[k] for k in ("ActiveOpens", "PassiveOpens", "OutSegs", "InSegs",
                                            "RetransSegs")})
        return out

    def down(self) -> list[str]:
        """Delete every namespace this run made (their veths and the bridge go with them);
        return the ones still present afterwards (should be none)."""
        for name in reversed(self.created):
            delete_netns(name)
        left = [n for n in list_netns() if n in self.created or ours(n, os.getpid())]
        self.created = left
        return left


# -------------------------------------------------------------------------------- workers
def _die_with_parent() -> None:
    """In the child before exec: torchrun is killed if this script dies, even by SIGKILL.
    (Its trainer process may outlive it then; the next run removes the namespace and ends
    the processes left in it.)"""
    try:
        LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; cleanup also kills by namespace
        pass


def start_workers(net: WanNet, train_args: list[str], out: str, port: int,
                  lighthouse: str | None = None, restarts: int = 0,
                  fault: str | None = None) -> list[subprocess.Popen]:
    """One torchrun per worker namespace: all of one world (static rendezvous on worker 0),
    or, with ``lighthouse``, each a world of its own, one worker of that elastic job
    (``fault``: its LOCO_FAULT, a drill)."""
    procs = []
    threads = max(1, (os.cpu_count() or 1) // net.workers)
    for i in range(net.workers):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=net.dev(i), OMP_NUM_THREADS=str(threads),
                   PYTHONUNBUFFERED="1", LOCO_ELASTIC_HOST=net.addr(i))
        if fault:
            env["LOCO_FAULT"] = fault
        if lighthouse is None:
            run = ["--nnodes", str(net.workers), "--nproc-per-node", "1", "--node-rank", str(i),
                   "--rdzv-backend", "static", "--master-addr", net.addr(0),
                   "--master-port", str(port), "--local-addr", net.addr(i), "--max-restarts",
                   "0", "-m", "loco", "train", *train_args]
        else:
            run = ["--standalone", "--nproc-per-node", "1", "--max-restarts", str(restarts),
                   "-m", "loco", "train", *train_args, "--elastic", "--lighthouse", lighthouse,
                   "--worker-index", str(i)]
        cmd = ["ip", "netns", "exec", net.ns(i), sys.executable, "-m", "torch.distributed.run",
               *run]
        procs.append(_spawn(cmd, env, os.path.join(out, "logs", f"worker{i}.log")))
    return procs


def _spawn(cmd: list[str], env: dict, log_path: str) -> subprocess.Popen:
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)


CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace


def start_lighthouse(net: WanNet, min_workers: int) -> tuple[object, str]:
    """torchft's Lighthouse, in this process but listening in worker 0's namespace; returns
    the server (``shutdown()`` stops it) and its address.

    A thread of this process joins the namespace (setns, which moves only the calling
    thread) and starts the server there: its socket, and the threads it starts, belong to
    that namespace for good, while the rest of this process stays on the host's network.
    No Python of its own to start (torch imported again: seconds of CPU)."""
    from loco.comm.membership import start_lighthouse as start

    made: dict = {}

    def inside() -> None:
        try:
            fd = os.open(f"/run/netns/{net.ns(0)}", os.O_RDONLY)
            try:
                if LIBC.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {net.ns(0)}")
            finally:
                os.close(fd)
            made["server"] = start(min_workers)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            made["error"] = e

    thread = threading.Thread(target=inside, name="loco-wan-lighthouse")
    thread.start()
    thread.join()
    if "error" in made:
        raise CommandError(f"the Lighthouse did not start in {net.ns(0)}: {made['error']}")
    server = made["server"]
    return server, f"http://{net.addr(0)}:{server.address().rsplit(':', 1)[1]}"


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each worker's process group, then SIGKILL what is left after 10 s."""
    live = [p for p in procs if p.poll() is None]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def wait_workers(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every worker; once one fails, give the others 30 s, then stop them."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + 30)
        if time.monotonic() > deadline:
            stop_workers(procs)
            return [p.poll() for p in procs]
        time.sleep(0.2)


def prepare_data(train_args: list[str]) -> str | None:
    """Check the training options and build the tokenizer and token cache once, here, so
    that the workers only read it; return loco's complaint about the options, if any."""
    from loco.cli import build_parser
    from loco.config import ConfigError, TrainConfig, build_config, resolve, validate
    from loco.data import CorpusError, prepare_corpus

    args = build_parser().parse_args(["train", *train_args])  # exits 2 on a bad flag
    names = {f.name for f in TrainConfig.fields()}
    try:
        cfg = build_config(args.config, {k: v for k, v in vars(args).items() if k in names})
        validate(cfg)
        cfg = resolve(cfg)
        prepare_corpus(cfg.data.corpus, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.cache_dir,
                       cfg.data.text_field)
    except (ConfigError, CorpusError) as e:
        return f"loco train: error: {e}"
    return None


def worker_error(path: str, lines: int = 15) -> str:
    """The end of a worker's log before torchrun's own report of the failure."""
    with open(path, errors="replace") as f:
        log = f.read().splitlines()
    cut = next((k for k, ln in enumerate(log)
                if re.match(r"[EW]\d{4} .*elastic/multiprocessing/api\.py", ln)), len(log))
    return "\n".join(log[:cut][-lines:] or log[-lines:])


# ------------------------------------------------------------------------------- analysis
def _lib_bytes(lib: dict, tag: str, key: str) -> int:
    """One tag's bytes over every communicator in a ``comm/rank<r>.json``."""
    return sum(c.get(tag, {}).get(key, 0) for c in lib.values() if isinstance(c, dict))


def analyse(net: WanNet, before: list[dict], after: list[dict], out: str, qdiscs: list[dict],
            tcp: list[dict], rate_bps: float, tolerance: float) -> dict:
    """Interface counters next to the library's counts, and where the difference comes from."""
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    rows = []
    for i in range(net.workers):  # static rendezvous: node rank i is global rank i
        with open(os.path.join(out, "comm", f"rank{i}.json")) as f:
            lib = json.load(f)
        c = {k: after[i][k] - before[i][k] for k in after[i]}
        row = {"worker": i, "namespace": net.ns(i), "device": net.dev(i), "address": net.addr(i),
               "iface_tx_bytes": c["tx_bytes"], "iface_rx_bytes": c["rx_bytes"],
               "iface_tx_packets": c["tx_packets"], "iface_rx_packets": c["rx_packets"],
               "lib_sent_bytes": lib["sent_bytes"], "lib_recv_bytes": lib["recv_bytes"],
               "lib_train_sent_bytes": _lib_bytes(lib, "train", "sent_bytes"),
               "lib_train_recv_bytes": _lib_bytes(lib, "train", "recv_bytes"),
               "retransmitted_segments": tcp[i]["RetransSegs"],
               "tcp_connections": tcp[i]["ActiveOpens"] + tcp[i]["PassiveOpens"],
               "qdisc_drops_up": qdiscs[i]["up"]["drops"],
               "qdisc_drops_down": qdiscs[i]["down"]["drops"]}
        for d, lib_key in (("tx", "lib_sent_bytes"), ("rx", "lib_recv_bytes")):
            wire, payload = row[f"iface_{d}_bytes"], row[lib_key]
            headers = row[f"iface_{d}_packets"] * HEADER_BYTES
            row[f"{d}_ratio"] = wire / payload if payload else None
            row[f"{d}_header_bytes"] = headers  # every frame's Ethernet/IP/TCP headers
            # What neither the library's payload nor the headers explain: TCPStore and
            # rendezvous messages, gloo's connection set-up and per-message framing, ARP,
            # retransmitted segments.
            row[f"{d}_other_bytes"] = wire - payload - headers
        # The least time the link needs for this worker's bytes: its busier direction.
        row["link_seconds"] = max(row["iface_tx_bytes"], row["iface_rx_bytes"]) / rate_bps
        row["train_link_seconds"] = max(row["lib_train_sent_bytes"],
                                        row["lib_train_recv_bytes"]) / rate_bps
        rows.append(row)
    keys = ("iface_tx_bytes", "iface_rx_bytes", "iface_tx_packets", "iface_rx_packets",
            "lib_sent_bytes", "lib_recv_bytes", "tx_header_bytes", "rx_header_bytes",
            "tx_other_bytes", "rx_other_bytes", "retransmitted_segments", "tcp_connections",
            "qdisc_drops_up", "qdisc_drops_down")
    tot = {k: sum(r[k] for r in rows) for k in keys}
    tot["tx_ratio"] = tot["iface_tx_bytes"] / tot["lib_sent_bytes"]
    tot["rx_ratio"] = tot["iface_rx_bytes"] / tot["lib_recv_bytes"]
    ratios = [r[k] for r in rows for k in ("tx_ratio", "rx_ratio") if r[k] is not None]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    ok = bool(ratios) and all(abs(x - 1) <= tolerance for x in ratios)
    return {
        "prefix": net.prefix,
        "workers": rows, "totals": tot,
        "agreement": {"tolerance": tolerance, "ok": ok, "worst_ratio": worst},
        "rate_bytes_per_second": rate_bps,
        "min_link_seconds": max(r["link_seconds"] for r in rows),
        "min_train_link_seconds": max(r["train_link_seconds"] for r in rows),
        "train_wall_seconds": summary["wall_seconds"],
        "train_seconds": summary["train_seconds"],
        "compute_utilization": summary["compute_utilization"],
        "comm_wait_seconds": summary["comm_wait_seconds"],
        "bytes_sent_per_rank": summary["bytes_sent_per_rank"],
        "final_eval_loss": summary["final_eval_loss"],
        "model_parameters": summary["model_parameters"],
        "syncs": summary["syncs"],
    }


def report_elastic(out: str, wall: float) -> dict:
    """Print and return the membership of an elastic run (its summary's ``elastic``)."""
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    elastic = {k: v for k, v in summary["elastic"].items() if k != "events"}
    print(f"elastic run finished in {wall:.1f} s: final eval loss "
          f"{summary['final_eval_loss']:.4f}; syncs by participants "
          f"{elastic['syncs_by_participants']}; dropped syncs {elastic['dropped_syncs']}")
    for loss in elastic["losses"]:
        print(f"  workers {loss['left']} lost: next committed sync after "
              f"{loss['to_next_sync']:.1f} s, full strength after "
              + (f"{loss['to_full_strength']:.1f} s" if loss["to_full_strength"] is not None
                 else "never"))
    return elastic


def report(res: dict, args, wall: float) -> None:
    rows, tot = res["workers"], res["totals"]
    total = dict(tot, worker="total")
    print(f"\n{args.workers} workers, each behind a {args.rate} tbf link both ways "
          f"(burst {args.burst}, queue {args.limit}, MTU {args.mtu}); loco train "
          f"--algorithm {args.algorithm} --model {args.model} ({res['model_parameters']:,} "
          f"parameters) --steps {args.steps} --sync-every {args.sync_every}: {res['syncs']} "
          f"syncs\n")
    print("bytes on each worker's interface (tbf-shaped veth) and the library's own count of "
          "what that rank sent and received (comm/rank<r>.json, every tag):")
    w = 13
    print(f"{'worker':7}{'iface tx':>{w}}{'loco sent':>{w}}{'tx/sent':>9}"
          f"{'iface rx':>{w}}{'loco recv':>{w}}{'rx/recv':>9}")
    for r in rows + [total]:
        print(f"{r['worker']!s:7}{r['iface_tx_bytes']:>{w},}{r['lib_sent_bytes']:>{w},}"
              f"{r['tx_ratio']:>9.4f}{r['iface_rx_bytes']:>{w},}{r['lib_recv_bytes']:>{w},}"
              f"{r['rx_ratio']:>9.4f}")
    print(f"\nthe difference, interface - library, split into frame headers ({HEADER_BYTES} B "
          f"per frame: Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, on data segments and "
          f"ACKs alike) and the rest (torchrun's TCPStore rendezvous, served by worker 0, "
          f"gloo's connection set-up and message framing, ARP, retransmissions):")
    print(f"{'worker':7}{'tx frames':>11}{'tx headers':>12}{'tx rest':>10}{'rx frames':>11}"
          f"{'rx headers':>12}{'rx rest':>10}{'TCP conns':>10}{'retrans':>8}{'drops':>6}")
    for r in rows + [total]:
        print(f"{r['worker']!s:7}{r['iface_tx_packets']:>11,}{r['tx_header_bytes']:>12,}"
              f"{r['tx_other_bytes']:>10,}{r['iface_rx_packets']:>11,}{r['rx_header_bytes']:>12,}"
              f"{r['rx_other_bytes']:>10,}{r['tcp_connections']:>10}"
              f"{r['retransmitted_segments']:>8}{r['qdisc_drops_up'] + r['qdisc_drops_down']:>6}")
    mss = args.mtu - 20 - 20 - 12
    wire = tot["iface_tx_bytes"] + tot["iface_rx_bytes"]
    payload = tot["lib_sent_bytes"] + tot["lib_recv_bytes"]
    headers = tot["tx_header_bytes"] + tot["rx_header_bytes"]
    print(f"in all {wire / payload - 1:+.2%} over the library's bytes: headers "
          f"{headers / payload:+.2%} (a full segment carries {mss:,} B in a "
          f"{mss + HEADER_BYTES:,} B frame, {HEADER_BYTES / mss:.2%}; ACKs and partly filled "
          f"segments add more), the rest "
          f"{(wire - payload - headers) / payload:+.2%}")
    train_link, link = res["min_train_link_seconds"], res["min_link_seconds"]
    print(f"\nwall time {wall:.1f} s from starting torchrun to the last exit (loco's run "
          f"{res['train_wall_seconds']:.1f} s, its training loop {res['train_seconds']:.1f} s)")
    print(f"the rate alone implies (bytes x 8 / {args.rate}, busiest link): {link:.1f} s for all "
          f"the run's bytes, {train_link:.1f} s for the training syncs; the slowest worker "
          f"waited {res['comm_wait_seconds']:.1f} s on training communication (the rest of "
          f"the wait: TCP ramp-up and waiting for slower workers)")
    print(f"compute utilization {res['compute_utilization']:.1%}; final eval loss "
          f"{res['final_eval_loss']:.3f}")
    a = res["agreement"]
    print(f"agreement within {a['tolerance']:.0%}: {'yes' if a['ok'] else 'no'} "
          f"(worst per-worker ratio {a['worst_ratio']:.4f})")


# ------------------------------------------------------------------------------------ main
EPILOG = """\
The default job (DiLoCo on the small model: a whole fp32 model, 5.3 MB, in every sync) makes
the training bytes dwarf the fixed costs the library does not count (torchrun's rendezvous,
gloo's connection set-up: a few KB per worker), so what is left between the two counts is mostly the
frame headers. Arguments after -- go to `loco train` unchanged and override the ones above.

Exit status: 0 run done and bytes agree within --tolerance; 1 the run failed; 2 cannot run
here (not root, no iproute2) or bad options; 3 the counts disagree; 128+N stopped by signal N.

examples:
  sudo .venv/bin/python benchmarks/netns_wan.py
  sudo .venv/bin/python benchmarks/netns_wan.py --workers 2 --model tiny --steps 20
  sudo .venv/bin/python benchmarks/netns_wan.py --rate 20mbit --algorithm streaming -- --codec int8
"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str]):
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="worker namespaces (one rank each)")
    ap.add_argument("--rate", default="100mbit",
                    help="tbf rate of every worker's link, each direction (tc syntax)")
    ap.add_argument("--burst", default="64kb",
                    help="tbf bucket: bytes that may leave back to back at full speed after "
                    "an idle spell; a few jumbo frames, ~5 ms at 100mbit, so no sync of "
                    "megabytes can slip past the rate")
    ap.add_argument("--limit", default="16mb",
                    help="tbf queue: bytes that may wait for tokens; large enough that the "
                    "M-1 peers sending to one worker at once never overflow it (a drop would "
                    "be retransmitted: bytes on the wire the library does not send)")
    ap.add_argument("--mtu", type=int, default=9000,
                    help="MTU of the links; with jumbo frames the 66 bytes of Ethernet/IP/TCP "
                    "headers per segment are 0.7%% of it (4.6%% at 1500)")
    ap.add_argument("--algorithm", default="diloco",
                    choices=("streaming", "diloco", "noloco", "ddp"),
                    help="loco train --algorithm")
    ap.add_argument("--model", default="small", help="loco train --model")
    ap.add_argument("--steps", type=int, default=60, help="loco train --steps")
    ap.add_argument("--sync-every", type=int, default=20, help="loco train --sync-every")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest relative difference between the interface counters and the "
                    "library's bytes that counts as agreement")
    ap.add_argument("--port", type=int, default=29500,
                    help="TCPStore port on worker 0 (inside its own namespace: never the host's)")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds the whole run may take before it is stopped")
    ap.add_argument("--out", help="run directory for loco's output and the worker logs "
                    "(default: runs/netns-wan-<time>)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    ap.add_argument("--elastic", action="store_true",
                    help="an elastic job instead (loco train --elastic): a torchft Lighthouse "
                    "listening in worker 0's namespace (served by this script's process), "
                    "each worker a torchrun job of its own that "
                    "advertises its namespace's address; reports the membership, not the "
                    "byte agreement (torchft's own traffic is not the library's)")
    ap.add_argument("--kill", metavar="WORKER:STEP",
                    help="with --elastic: kill that worker (SIGKILL) before that step; "
                    "torchrun restarts it (--max-restarts) and it rejoins from a live one")
    ap.add_argument("--max-restarts", type=int, default=1,
                    help="with --elastic: torchrun's restarts of each worker")
    ap.add_argument("--min-workers", type=int,
                    help="with --elastic: loco train --min-workers (default: a majority)")
    args = ap.parse_args(argv)
    if (args.kill or args.min_workers) and not args.elastic:
        ap.error("--kill and --min-workers go with --elastic")
    if args.kill and not re.fullmatch(r"\d+:\d+", args.kill):
        ap.error(f"--kill must look like WORKER:STEP (got {args.kill!r})")
    if not 2 <= args.workers <= 250:
        ap.error("--workers must be between 2 and 250 (one address each in a /24)")
    if not 576 <= args.mtu <= 65535:
        ap.error("--mtu must be between 576 and 65535")
    try:
        tc_rate_bytes(args.rate)
    except ValueError as e:
        ap.error(str(e))
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    why = missing_requirements()
    if why:
        print(why, file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or os.path.join(
        "runs", f"netns-wan-{datetime.now():%Y%m%d-%H%M%S}"))
    train_args = ["--workers", str(args.workers), "--algorithm", args.algorithm,
                  "--model", args.model, "--steps", str(args.steps),
                  "--sync-every", str(args.sync_every), "--eval-every", "0",
                  "--final-eval-batches", "4", "--no-progress", "--out", out, *extra]

    stale = remove_stale()
    if stale:
        print(f"removed {len(stale)} namespaces left by earlier runs: {', '.join(stale)}")
    complaint = prepare_data(train_args)
    if complaint:
        print(complaint, file=sys.stderr)
        return 2

    net = WanNet(args.workers, args.rate, args.burst, args.limit, args.mtu)
    procs: list[subprocess.Popen] = []
    lighthouse = None
    cleaning = False

    def on_signal(signum, _frame):
        if not cleaning:
            raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                         signal.SIGHUP)}
    result: dict = {"config": {**vars(args), "extra": extra, "train_args": train_args},
                    "out": out, "prefix": net.prefix}
    code = 1
    try:
        net.up()
        net.wait_ready()
        qd = net.qdisc_stats()
        rate_bps = qd[0]["up"]["rate_bytes_per_second"] or tc_rate_bytes(args.rate)
        print(f"{args.workers} namespaces {net.prefix}-w0..w{args.workers - 1} on bridge "
              f"{net.bridge_ns}; tbf {args.rate} each way; training, logs in {out}/logs",
              flush=True)
        before = net.counters()
        t0 = time.perf_counter()
        if args.elastic:
            need = args.min_workers or args.workers // 2 + 1
            lighthouse, address = start_lighthouse(net, need)
            procs = start_workers(net, [*train_args, "--min-workers", str(need)], out,
                                  args.port, address, args.max_restarts,
                                  fault=f"{args.kill}:kill" if args.kill else None)
        else:
            procs = start_workers(net, train_args, out, args.port)
        codes = wait_workers(procs, args.timeout)
        wall = time.perf_counter() - t0
        after = net.counters()
        result.update(exit_codes=codes, wall_seconds=wall)
        if args.elastic and all(c == 0 for c in codes):
            result["elastic"] = report_elastic(out, wall)
            code = 0
        elif any(c != 0 for c in codes):
            print(f"the run failed: worker exit codes {codes}; see {out}/logs", file=sys.stderr)
            for i, c in enumerate(codes):
                if c != 0:
                    print(f"--- worker {i} (exit code {c}) ---\n"
                          + worker_error(os.path.join(out, "logs", f"worker{i}.log")),
                          file=sys.stderr)
            code = 1
        else:
            result.update(analyse(net, before, after, out, net.qdisc_stats(), net.tcp_stats(),
                                  rate_bps, args.tolerance))
            report(result, args, wall)
            code = 0 if result["agreement"]["ok"] else 3
    except Interrupted as e:
        print(f"\ninterrupted by {e}; cleaning up", file=sys.stderr, flush=True)
        code = 128 + e.signum
    except CommandError as e:
        print(f"netns_wan: {e}", file=sys.stderr)
        code = 1
    except Exception:  # noqa: BLE001 - reported; the namespaces still go
        traceback.print_exc()
        code = 1
    finally:
        cleaning = True
        stop_workers(procs)
        if lighthouse is not None:
            lighthouse.shutdown()
        made = len(net.created)
        left = net.down()
        for s, h in previous.items():
            signal.signal(s, h)
        result["namespaces_left"] = left
        if left:
            print(f"could not remove: {', '.join(left)}", file=sys.stderr)
            code = code or 1
        else:
            print(f"removed the {made} namespaces of this run and their links")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "exit_code": code}, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
