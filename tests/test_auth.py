"""The job key (issue 43, "only the job's members"): key files, MACs on payloads and their
rows, AES-GCM sealing, admission by an HMAC challenge (threads, and two real processes
where the stranger knows the address but not the key), the sealed state an elastic joiner
receives, and the per-quorum admission of an elastic job."""

from __future__ import annotations

import datetime
import json
import os
import sys
import textwrap

import pytest
import torch

import loco
import loco.training.build
import loco.training.job
from loco.comm.auth import (AdmissionError, AuthError, JobKey, admit, context, job_key,
                            load_key, open_state, proves_request, request_proof, seal_state)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def key_file(tmp_path, content: bytes, name: str = "job.key") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


# ----------------------------------------------------------------------------- key files
def test_key_file_hex_or_raw(tmp_path, monkeypatch):
    assert load_key(key_file(tmp_path, KEY.hex().encode() + b"\n")) == KEY
    raw = b"\xff" * 20  # not hex: taken as it is
    assert load_key(key_file(tmp_path, raw)) == raw
    monkeypatch.delenv("LOCO_JOB_KEY_FILE", raising=False)
    assert job_key(None) is None
    monkeypatch.setenv("LOCO_JOB_KEY_FILE", key_file(tmp_path, KEY.hex().encode()))
    assert job_key(None) == KEY
    assert job_key(key_file(tmp_path, raw, "other.key")) == raw  # the option wins


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"),
    ("directory", "cannot be read"),
    ("short", "has 8 bytes, fewer than 16"),
    ("empty", "has 0 bytes"),
])
def test_bad_key_files_are_one_clear_line(tmp_path, case, message):
    path = {"missing": str(tmp_path / "nope.key"), "directory": str(tmp_path),
            "short": key_file(tmp_path, b"00" * 8 + b"\n", "short.key"),
            "empty": key_file(tmp_path, b"", "empty.key")}[case]
    with pytest.raises(ValueError) as e:
        load_key(path)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("how", ["option", "env"])
def test_loco_train_with_a_missing_key_stops_before_any_worker(how, capsys, monkeypatch):
    from loco.cli import main

    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    args = ["train", "--no-progress"]
    if how == "option":
        args += ["--job-key-file", "/nonexistent/job.key"]
    else:
        monkeypatch.setenv("LOCO_JOB_KEY_FILE", "/nonexistent/job.key")
    with pytest.raises(SystemExit) as e:
        sys.exit(main(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--job-key-file" in err and "does not exist" in err


# ------------------------------------------------------------------------------- MACs
def test_rows_round_trip_and_a_flipped_bit_is_named():
    k = JobKey(KEY)
    payload = torch.randint(0, 256, (5, 1000), dtype=torch.uint8)
    ctx = context("reduce", 7, 2)
    tags = k.tag_rows(payload, ctx)
    assert tags.shape == (5, 32) and tags.dtype == torch.uint8
    assert k.check_rows(payload, tags, ctx) == []
    payload[3, 417] ^= 0x10
    assert k.check_rows(payload, tags, ctx) == [3]
    # swapped rows fail too: a tag covers its row's index
    swapped = payload[[1, 0, 2, 3, 4]]
    assert k.check_rows(swapped, tags, ctx) == [0, 1, 3]


def test_a_replay_under_another_context_or_session_fails():
    k = JobKey(KEY)
    payload = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    tags = k.tag_rows(payload, context("reduce", 7, 2))
    assert k.check_rows(payload, tags, context("reduce", 8, 2)) == [0, 1, 2]  # next op
    assert k.check_rows(payload, tags, context("reduce", 7, 1)) == [0, 1, 2]  # other sender
    session = k.bound(b"session-1")
    assert session.check_rows(payload, tags, context("reduce", 7, 2)) == [0, 1, 2]
    assert JobKey(OTHER).check_rows(payload, tags, context("reduce", 7, 2)) == [0, 1, 2]
    # contexts are unambiguous: the parts' boundaries count
    assert context("ab", "c") != context("a", "bc")


def test_one_message_tag_verify_and_named_failure():
    k = JobKey(KEY)
    data = os.urandom(1000)
    tag = k.tag(data, b"ctx")
    assert k.verify(data, tag, b"ctx") and not k.verify(data, tag, b"other")
    body = k.protect(data, b"ctx")
    assert bytes(k.unprotect(body, b"ctx")) == data
    forged = bytearray(body)
    forged[-1] ^= 1
    with pytest.raises(AuthError, match="the codec payload from rank 3 failed its MAC"):
        k.unprotect(bytes(forged), b"ctx", what="the codec payload from rank 3")


def test_aes_gcm_round_trip_and_tamper():
    pytest.importorskip("cryptography")
    k = JobKey(KEY, encrypt=True)
    data = os.urandom(5000)
    sealed = k.seal(data, b"ctx")
    assert data not in sealed and k.open(sealed, b"ctx") == data
    assert k.seal(data, b"ctx") != sealed  # a fresh nonce every time
    tampered = bytearray(sealed)
    tampered[40] ^= 1
    with pytest.raises(AuthError, match="the state sent by worker 2 failed"):
        k.open(bytes(tampered), b"ctx", what="the state sent by worker 2")
    with pytest.raises(AuthError):
        k.open(sealed, b"other")
    with pytest.raises(AuthError):
        JobKey(OTHER, encrypt=True).open(sealed, b"ctx")
    # protect/unprotect and a sealed state go through it
    state = {"w": torch.arange(10.0), "step": 3}
    body = seal_state(k, state, b"s")
    assert b"step" not in body  # encrypted
    got = open_state(k, body, b"s", "worker 0")
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3


def test_a_sealed_state_is_checked_before_it_is_loaded():
    k = JobKey(KEY)
    body = seal_state(k, {"w": torch.ones(4)}, context("state", 5, "addr"))
    assert torch.equal(open_state(k, body, context("state", 5, "addr"), "w0")["w"],
                       torch.ones(4))
    with pytest.raises(AuthError, match="the state sent by worker 1"):
        open_state(k, body, context("state", 6, "addr"), "worker 1")  # another step
    forged = seal_state(JobKey(OTHER), {"w": torch.zeros(4)}, context("state", 5, "addr"))
    with pytest.raises(AuthError, match="the state sent by the worker at X"):
        open_state(k, forged, context("state", 5, "addr"), "the worker at X")


def test_request_proofs_are_bound_to_the_path_and_used_once():
    k, seen = JobKey(KEY), set()
    proof = request_proof(k, "/checkpoint/3/full")
    assert not proves_request(k, proof, "/checkpoint/4/full", seen)
    assert not proves_request(JobKey(OTHER), proof, "/checkpoint/3/full", seen)
    assert not proves_request(k, "garbage", "/checkpoint/3/full", seen)
    assert not proves_request(k, None, "/checkpoint/3/full", seen)
    assert proves_request(k, proof, "/checkpoint/3/full", seen)
    assert not proves_request(k, proof, "/checkpoint/3/full", seen)  # a replay
    assert not proves_request(k, proof.upper(), "/checkpoint/3/full", seen)  # respelt


# -------------------------------------------------------------------------- admission
def _admit_with(ctx, keys):
    try:
        bound = admit(ctx.comm, keys[ctx.worker])
        return ("admitted", bound.job.hex(), ctx.comm.totals("setup").sent_bytes)
    except AdmissionError as e:
        return ("refused", str(e), None)


def test_admission_over_threads():
    ok = loco.launch(_admit_with, 3, launcher="threads", args=([KEY] * 3,))
    assert [r[0] for r in ok] == ["admitted"] * 3
    assert len({r[1] for r in ok}) == 1  # one session, the same everywhere
    assert all(r[2] == 2 * 2 * 32 for r in ok)  # two all-gathers of 32 bytes, under "setup"
    again = loco.launch(_admit_with, 3, launcher="threads", args=([KEY] * 3,))
    assert again[0][1] != ok[0][1]  # fresh challenges: a new session each time
    out = loco.launch(_admit_with, 3, launcher="threads", args=([KEY, OTHER, KEY],))
    assert [r[0] for r in out] == ["refused"] * 3
    for rank in (0, 2):
        assert "rank 1 could not prove the job key" in out[rank][1]
    assert "rank 0, rank 2 could not prove" in out[1][1]
    assert "this process's key may be the one that differs" in out[1][1]


STRANGER = textwrap.dedent("""
    import datetime, os, sys
    import torch.distributed as dist
    from loco.comm import Comm
    from loco.comm.auth import AdmissionError, admit, load_key

    rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    key = load_key(path)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, timeout=timeout)  # the test's, as a client
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    comm = Comm(dist.group.WORLD, rank, 2)
    try:
        admit(comm, key)
        print("ADMITTED", flush=True)
    except AdmissionError as e:
        print("REFUSED", e, flush=True)
    comm.close()
    os._exit(0)
""")


def _pair(keys: list[str]) -> list[str]:
    """STRANGER's two ranks with these key files, over a TCPStore this process serves on a
    port the kernel picks as it binds (a port found free beforehand can be taken by another
    job before a rank binds it)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return _run_pair(STRANGER, [[str(rank), str(store.port), key]
                                for rank, key in enumerate(keys)])


def _exec_script(script: str, argv: list[str], out: str) -> None:
    """A rank of ``_run_pair``: ``script`` run as ``__main__`` with ``argv``, its output to
    ``out`` (.stdout, .stderr)."""
    sys.argv = ["-c", *argv]
    sys.stdout, sys.stderr = open(out + ".stdout", "w", buffering=1), open(out + ".stderr", "w")
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})


def _run_pair(script: str, argvs: list[list[str]], timeout: float = 120) -> list[str]:
    """Run ``script`` in one process per argv, at once; their stdout, in order. Each is a
    process of its own forked from loco's rank server (torch already imported there), as a
    rank of the processes launcher is; a fresh ``python -c`` would only add the imports."""
    import tempfile

    from workers import forked, join_all

    with tempfile.TemporaryDirectory() as td:
        outs = [os.path.join(td, str(i)) for i in range(len(argvs))]
        procs = [forked(_exec_script, script, argv, out) for argv, out in zip(argvs, outs)]
        for code, out in zip(join_all(procs, timeout), outs):
            assert code == 0, open(out + ".stderr").read()[-3000:]
        return [open(out + ".stdout").read() for out in outs]


def test_a_stranger_process_that_knows_the_address_is_refused(tmp_path):
    """Two processes over gloo and a TCPStore: rank 1 knows the address but holds another
    key; the keyed rank refuses it, naming it, before anything else is sent."""
    mine = key_file(tmp_path, KEY.hex().encode(), "mine.key")
    theirs = key_file(tmp_path, OTHER.hex().encode(), "theirs.key")
    keyed, stranger = _pair([mine, theirs])
    assert "REFUSED" in keyed and "rank 1 could not prove the job key" in keyed
    assert "REFUSED" in stranger and "rank 0 could not prove" in stranger
    keyed, other = _pair([mine, mine])
    assert "ADMITTED" in keyed and "ADMITTED" in other


def test_loco_train_with_a_key(corpus, tmp_path, monkeypatch):
    """The CLI with --job-key-file: the workers are admitted and train as without."""
    from test_cli import small_run

    from loco.cli import main

    path = key_file(tmp_path, KEY.hex().encode())
    monkeypatch.setattr(loco.training.build, "admit", _counting(loco.training.build.admit))
    assert main(small_run(corpus, tmp_path / "run", "--steps", "4", "--job-key-file",
                          path)) == 0
    assert _counting.calls == 2  # each of the 2 workers
    # --encrypt: the same run, bit for bit (the payloads are decrypted as they arrive)
    assert main(small_run(corpus, tmp_path / "secret", "--steps", "4", "--job-key-file",
                          path, "--encrypt")) == 0
    assert _counting.keys and all(k.encrypt for k in _counting.keys[2:])
    losses = [json.loads((tmp_path / run / "summary.json").read_text())["final_eval_loss"]
              for run in ("run", "secret")]
    assert losses[0] == losses[1]


def test_encrypt_without_a_key_stops_before_any_worker(capsys, monkeypatch):
    from test_cli import test_bad_input_is_one_clear_line_and_exit_2 as one_line

    monkeypatch.delenv("LOCO_JOB_KEY_FILE", raising=False)
    one_line(["--encrypt"], "--encrypt", "needs a job key", capsys, monkeypatch)


def _counting(fn):
    _counting.calls, _counting.keys = 0, []

    def wrapped(*a, **k):
        _counting.calls += 1
        _counting.keys.append(a[1])
        return fn(*a, **k)
    return wrapped


# ---------------------------------------------------------------------------- elastic
def test_the_state_a_joiner_receives_is_sealed_and_served_to_keyholders_only():
    from loco.comm.membership import _transport

    td = datetime.timedelta(seconds=10)
    sender, joiner, stranger = (_transport("127.0.0.1", td) for _ in range(3))
    try:
        sender.key, joiner.key, stranger.key = JobKey(KEY), JobKey(KEY), JobKey(OTHER)
        state = {"algorithm": {"w": torch.arange(6.0)}, "torchft": {"step": 4}}
        sender.send_checkpoint([1], 4, state, td)
        got = joiner.recv_checkpoint(0, sender.metadata(), 4, td)
        assert torch.equal(got["algorithm"]["w"], state["algorithm"]["w"])
        with pytest.raises(AuthError, match="refused to send its state"):
            stranger.recv_checkpoint(0, sender.metadata(), 4, td)
        sender._sealed = bytes(sender._sealed[:-1]) + bytes([sender._sealed[-1] ^ 1])
        with pytest.raises(AuthError, match=f"the state sent by the worker at "
                                            f"{sender.metadata()}"):
            joiner.recv_checkpoint(0, sender.metadata(), 4, td)
        stranger.key = None  # a server without the key: torchft's own (pickled) format
        stranger.send_checkpoint([1], 4, state, td)
        with pytest.raises(AuthError, match="failed its MAC"):
            joiner.recv_checkpoint(0, stranger.metadata(), 4, td)
    finally:
        for t in (sender, joiner, stranger):
            t.shutdown(wait=False)


ELASTIC = textwrap.dedent("""
    import os, sys, time
    import torch
    from loco.comm.auth import AuthError, load_key
    from loco.comm.membership import ElasticComm

    lighthouse, worker, path, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ahead = sys.argv[5] if mode == "heal" else None  # worker 0 writes it, a step ahead
    while worker == 1 and ahead and not os.path.exists(ahead):
        time.sleep(0.1)
    comm = ElasticComm(worker, 2, lighthouse, 1 if mode == "heal" else 2, timeout=30.0)
    comm.use_key(load_key(path))
    state = {"w": torch.full((3,), float(worker))}
    comm.register_state("x", lambda: state, lambda s: state.update(s))
    try:
        comm.begin()
        while worker == 0 and ahead and comm.members != (0, 1):  # alone until 1 is here
            comm.commit(True)
            open(ahead, "w").close()
            time.sleep(0.2)
            comm.begin()
        mean = comm.all_reduce_mean(torch.full((2,), float(worker + 1))).wait()
        print("ADMITTED", comm.job_key.job.hex(), state["w"].tolist(), mean.tolist(),
              comm.healed, flush=True)
    except AuthError as e:
        print("REFUSED", e, flush=True)
    os._exit(0)
""")


def _elastic_pair(tmp_path, keys: tuple[bytes, bytes], mode: str) -> list[str]:
    from loco.comm.membership import start_lighthouse

    paths = [key_file(tmp_path, k.hex().encode(), f"w{i}.key") for i, k in enumerate(keys)]
    lighthouse = start_lighthouse(1 if mode == "heal" else 2, join_timeout=30)
    try:
        return _run_pair(ELASTIC, [[lighthouse.address(), str(w), paths[w], mode,
                                    str(tmp_path / "ahead")] for w in range(2)])
    finally:
        lighthouse.shutdown()


def test_elastic_quorum_members_prove_the_key(tmp_path):
    w0, w1 = _elastic_pair(tmp_path, (KEY, OTHER), "quorum")
    assert "REFUSED" in w0 and "worker 1 could not prove the job key" in w0
    assert "REFUSED" in w1 and "worker 0 could not prove the job key" in w1


def test_elastic_joiner_heals_from_a_sealed_state(tmp_path):
    w0, w1 = _elastic_pair(tmp_path, (KEY, KEY), "heal")
    assert w0.startswith("ADMITTED") and w1.startswith("ADMITTED"), (w0, w1)
    assert w0.split()[1] == w1.split()[1]  # one session
    assert "[0.0, 0.0, 0.0]" in w1 and w1.rstrip().endswith("True")  # worker 0's state


@pytest.mark.slow
def test_loco_train_elastic_with_a_key_rejoins_a_restarted_worker(corpus, tmp_path,
                                                                  monkeypatch):
    """The CLI, elastic, with a key: worker 2 is killed at step 16 and restarted; it proves
    the key at the next quorum, takes a live worker's sealed state, and the syncs count it
    again (its operations numbered from the quorum, as the others'). ``--min-workers 3``:
    the survivors wait for it at that quorum, so a loaded machine, where the restart takes
    longer than the 16 steps left, cannot end the run before it is back."""
    import json

    from test_cli import small_run

    from loco.cli import main

    monkeypatch.setenv("LOCO_FAULT", "2:16:kill")
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--workers", "3", "--steps", "32", "--elastic",
                          "--launcher", "processes", "--max-restarts", "1", "--min-workers", "3",
                          "--link-latency", "50ms", "--checkpoint-every", "0",
                          "--eval-every", "0", "--final-eval-batches", "2",
                          "--job-key-file", key_file(tmp_path, KEY.hex().encode()))) == 0
    elastic = json.loads((out / "summary.json").read_text())["elastic"]
    assert [loss["left"] for loss in elastic["losses"]] == [[2]]
    assert elastic["losses"][0]["to_full_strength"] is not None  # back, and counted
    assert set(elastic["syncs_by_participants"]) == {"3"}
