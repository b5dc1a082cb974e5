"""The command line: bad input fails early and clearly; a small run writes honest files."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import loco.training.job
from loco.cli import build_parser, main
from loco.config import build_config


def small_run(corpus, out, *extra):
    text, cache = corpus
    return ["train", "--model", "tiny", "--workers", "2", "--steps", "12", "--sync-every", "4",
            "--seq-len", "32", "--batch-size", "4", "--vocab-size", "300", "--eval-every", "6",
            "--eval-batches", "2", "--log-every", "3", "--corpus", text, "--cache-dir", cache,
            "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """``trained(*extra)``: the directory of ``small_run`` with those options, trained once
    for the module; the tests that read the same run share it (a test that writes into a
    run copies it first)."""
    runs = {}

    def train(*extra):
        if extra not in runs:
            out = tmp_path_factory.mktemp("trained") / "run"
            assert main(small_run(corpus, out, *extra)) == 0
            runs[extra] = out
        return runs[extra]
    return train


BAD_INPUTS = [
    (["--workers", "0"], "--workers", ">= 1"),
    (["--workers", "-3"], "--workers", ">= 1"),
    (["--steps", "0"], "--steps", ">= 1"),
    (["--steps", "-1"], "--steps", ">= 1"),
    (["--sync-every", "0"], "--sync-every", ">= 1"),
    (["--algorithm", "noloco", "--eager"], "--eager",
     "applies to diloco, streaming, sparseloco, sparta_diloco only, not to --algorithm noloco"),
    (["--algorithm", "demo", "--codec", "int8"], "--codec", "not to --algorithm demo"),
    (["--algorithm", "sgd"], "--algorithm", "diloco"),
    (["--model", "huge"], "--model", "tiny, small"),
    (["--launcher", "mpi"], "--launcher", "processes"),
    (["--launcher", "torchrun"], "--launcher", "started by torchrun"),
    (["--workers", "two"], "--workers", "invalid int"),
    (["--lr", "0"], "--lr", "> 0"),
    (["--outer-momentum", "1"], "--outer-momentum", "[0, 1)"),
    (["--batch-size", "0"], "--batch-size", ">= 1"),
    (["--seq-len", "1"], "--seq-len", ">= 2"),
    (["--vocab-size", "100"], "--vocab-size", "257"),
    (["--val-fraction", "0.9"], "--val-fraction", "(0, 0.5]"),
    (["--corpus", "/no/such/corpus.txt"], "--corpus", "does not exist"),
    (["--config", "/no/such/config.yaml"], "--config", "not found"),
    (["--fragments", "3", "--sync-every", "2", "--model", "medium"], "--fragments",
     "<= --sync-every (2)"),
    (["--fragments", "8"], "--fragments", "[1, 4]"),
    (["--overlap", "25"], "--overlap", "[0, 25)"),  # the default H = 50, P = 2
    (["--overlap", "-1"], "--overlap", "[0, 25)"),
    (["--fragments", "3", "--overlap", "16"], "--overlap", "[0, 16), the smallest gap"),
    (["--overlap", "1,2"], "--overlap", "gives 2 values but there are 4 workers"),
    (["--overlap", "1,x,2,3"], "--overlap", "one per worker such as 1,1,2,5"),
    (["--sync-every", "0"], "--sync-every", ">= 1"),
    (["--tokens", "lots"], "--tokens", "20x"),
    (["--tokens", "20x", "--steps", "10"], "--tokens", "not both"),
    (["--adam-betas", "0.9"], "--adam-betas", "two numbers in [0, 1)"),
    (["--adam-betas", "0.9,1.5"], "--adam-betas", "two numbers in [0, 1)"),
    (["--dim", "100", "--heads", "3"], "--dim", "even head size"),
    (["--layers", "0"], "--layers", ">= 1"),
    (["--grad-codec", "fp8"], "--grad-codec", "'fp32', 'bf16'"),
    (["--model", "2b"], "--model", "35m, 100m"),
    (["--mixing", "1.5"], "--mixing", "[0, 1]"),
    (["--alpha", "1.5"], "--mixing", "[0, 1]"),  # the old name still works
    (["--codec", "fp5"], "--codec", "fp4_e3m0"),
    (["--codec-block", "3"], "--codec-block", "multiple of 2 with --codec fp4_e3m0"),
    (["--fragment-pattern", "random"], "--fragment-pattern", "strided"),
    (["--outer-lr", "0"], "--outer-lr", "> 0"),
    (["--algorithm", "noloco", "--group-size", "3"], "--group-size", "divides --workers (4)"),
    (["--algorithm", "noloco", "--group-size", "1"], "--group-size", ">= 2"),
    (["--algorithm", "noloco", "--gamma", "-1"], "--gamma", ">= 0"),
    (["--spread-every", "-1"], "--spread-every", ">= 0"),
    (["--stages", "0"], "--stages", "[1, 4]"),
    (["--stages", "5"], "--stages", "[1, 4]"),
    (["--model", "tiny", "--stages", "3"], "--stages", "[1, 2]"),
    (["--routing", "random"], "--routing", "--stages 2 or more"),
    (["--routing", "shuffled", "--stages", "2"], "--routing", "'fixed', 'random'"),
    (["--stages", "4", "--fragments", "2"], "--fragments", "[1, 1]"),
    (["--link-bandwidth", "fast"], "--link-bandwidth", "100Mbit"),
    (["--link-bandwidth", "100MB"], "--link-bandwidth", "100Mbit"),
    (["--link-latency=-5ms"], "--link-latency", "50ms"),
    (["--worker-ranks", "0"], "--worker-ranks", ">= 1"),
    (["--worker-ranks", "2", "--stages", "2"], "--worker-ranks", "stages (--stages 2) is not "
     "supported yet; use --worker-ranks 1 or --stages 1"),
    (["--worker-ranks", "2", "--worker-parallel", "fsdp"], "--worker-parallel",
     "add --launcher processes, or start the run with torchrun"),
    (["--worker-parallel", "fsdp", "--launcher", "processes"], "--worker-parallel",
     "add --worker-ranks 2 or more"),
    (["--worker-parallel", "zero"], "--worker-parallel", "'ddp', 'fsdp'"),
    (["--fast-link-bandwidth", "fast"], "--fast-link-bandwidth", "100Mbit"),
    (["--fast-link-latency=-5ms"], "--fast-link-latency", "50ms"),
    (["--min-workers", "2"], "--min-workers", "only means something with --elastic"),
    (["--elastic"], "--elastic", "--launcher processes"),
    (["--elastic", "--launcher", "processes", "--stages", "2"], "--stages",
     "must be 1 with --elastic"),
    (["--elastic", "--launcher", "processes", "--min-workers", "5"], "--min-workers",
     "[1, --workers 4]"),
    (["--elastic", "--launcher", "processes", "--eval-replicas"], "--eval-replicas",
     "leave it out with --elastic"),
    (["--profile", "0-3"], "--profile", "A-B with 1 <= A <= B <= --steps (400)"),
    (["--profile", "9-2"], "--profile", "e.g. 20-30, or one step N"),
    (["--profile", "abc"], "--profile", "A-B"),
    (["--steps", "10", "--profile", "5-11"], "--profile", "<= --steps (10)"),
    # counts are checked before --tokens is turned into steps (it divides by them)
    (["--tokens", "2e7", "--workers", "0"], "--workers", ">= 1"),
    (["--tokens", "2e7", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["--tokens", "20x", "--seq-len", "0"], "--seq-len", ">= 2"),
]


@pytest.mark.parametrize("args,option,allowed", BAD_INPUTS, ids=[" ".join(a) for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_exit_2(args, option, allowed, capsys, monkeypatch):
    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(SystemExit) as e:
        sys.exit(main(["train", "--no-progress", *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert option in err and allowed in err


def expect_error(argv, option, allowed, capsys, monkeypatch):
    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and allowed in err


def test_empty_corpus_file_and_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nothing").mkdir()
    for corpus in (tmp_path / "empty.txt", tmp_path / "nothing"):
        expect_error(["train", "--corpus", str(corpus), "--no-progress"], "--corpus", "empty"
                     if corpus.is_file() else "no", capsys, monkeypatch)


def test_batch_that_does_not_fit_the_data(corpus, tmp_path, capsys, monkeypatch):
    argv = small_run(corpus, tmp_path / "run", "--batch-size", "100000")
    expect_error(argv, "--batch-size", "does not fit", capsys, monkeypatch)


def test_unknown_key_in_yaml_config(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workers: 2\nstepz: 5\n")
    expect_error(["train", "--config", str(cfg)], "--config", "stepz", capsys, monkeypatch)


def test_small_run_writes_metrics_summary_and_plot(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--algorithm", "diloco")) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("algorithm", "workers", "inner_steps", "tokens", "final_eval_loss",
                "bytes_sent_per_rank", "peak_sync_bytes_per_rank", "wall_seconds",
                "tokens_per_second", "config", "unigram_entropy"):
        assert key in summary
    assert summary["tokens"] == 12 * 2 * 4 * 32
    assert math.isfinite(summary["final_eval_loss"])
    # 3 syncs of the whole model, each 2 (M-1) ceil(n/M) fp32 values per worker
    n = summary["model_parameters"]
    assert summary["syncs"] == 3
    assert summary["peak_sync_bytes_per_rank"] == 2 * 1 * math.ceil(n / 2) * 4
    assert summary["bytes_sent_per_rank"] == 3 * summary["peak_sync_bytes_per_rank"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [3, 6, 9, 12]
    assert any("eval_loss" in r for r in records[:-1])  # evaluated during training
    assert records[-1]["eval_loss"] == summary["final_eval_loss"]
    assert records[-1]["bytes_sent"] == summary["bytes_sent_per_rank"]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "final eval loss" in capsys.readouterr().out


def test_default_streaming_run_reports_every_sync_and_fragment(trained):
    """The default method: P = 2 fragments, one sent every H/P = 2 steps, applied τ = 1 step
    later (the last one by the final flush), each as FP4 with one scale byte per 32 values."""
    out = trained()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "streaming" and summary["config"]["codec"] == "fp4_e3m0"
    assert summary["config"]["outer_lr"] == 0.4  # the paper's, filled in for streaming
    frags = summary["fragments"]
    assert [f["syncs"] for f in frags] == [3, 3]
    assert sum(f["elements"] for f in frags) == summary["model_parameters"]
    assert sum(f["bytes_sent"] for f in frags) == summary["bytes_sent_per_rank"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r.get("event") == "sync"]
    assert [(s["step"], s["fragment"], s["applied_step"]) for s in syncs] == [
        (2, 0, 3), (4, 1, 5), (6, 0, 7), (8, 1, 9), (10, 0, 11), (12, 1, 12)]
    for s in syncs:
        n = frags[s["fragment"]]["elements"]
        c = math.ceil(math.ceil(n / 2) / 32) * 32
        assert s["raw_bytes"] == 4 * n
        assert s["wire_bytes"] == 2 * 1 * (c // 2 + c // 32)
        # the worker waits at most while the sync is in flight, plus the wake-up of its thread
        # (the flushed last sync is waited for right after it is sent)
        assert 0 <= s["seconds_waited"] <= s["seconds_in_flight"] + 0.05
    assert summary["peak_sync_bytes_per_rank"] == max(s["wire_bytes"] for s in syncs)


def test_noloco_run_reports_replicas_spread_and_average(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--algorithm", "noloco", "--spread-every", "4",
                          "--final-average", "--workers", "4")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["outer_momentum"] == 0.5 and summary["config"]["nesterov"] is False
    r = summary["replicas"]
    assert len(r["eval_losses"]) == 4 and len(set(r["eval_losses"])) == 4  # pairs only
    assert r["mean_eval_loss"] == pytest.approx(sum(r["eval_losses"]) / 4)
    assert summary["final_eval_loss"] == r["average_eval_loss"]  # --final-average
    # one pairwise exchange of Δ and φ (fp32) per outer step, with the one other worker
    assert summary["bytes_sent_per_rank"] == 3 * 2 * 4 * summary["model_parameters"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spread = [r["spread"] for r in records if "spread" in r]
    assert len(spread) == 3 and all(s > 0 for s in spread)
    assert "average" in capsys.readouterr().out


def test_noloco_warns_outside_the_theory(corpus, tmp_path, capsys):
    assert main(small_run(corpus, tmp_path / "run", "--algorithm", "noloco", "--gamma", "5",
                          "--steps", "4")) == 0
    assert "gamma" in capsys.readouterr().err


def test_yaml_config_and_flags_precedence(corpus, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: ddp\nsteps: 4\nworkers: 3\n")
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--config", str(cfg), "--workers", "2")[0:1]
                + ["--config", str(cfg)] + small_run(corpus, out)[1:]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "ddp"  # from the file
    assert summary["workers"] == 2 and summary["inner_steps"] == 12  # flags win


def _help_text(stdout):
    return stdout.split("Options may also come from a YAML file")[0]  # not the examples


HELP_END = "--- end of help ---"


def _console_helps(*argvs):
    """`loco train ARGV --help` at 200 columns for each ARGV, through the console script
    (`python -m loco`, the module run as ``__main__`` as `python -m` runs it) in one fresh
    Python: one start of Python and torch for all of them."""
    code = ("import json, runpy, sys\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    sys.argv = ['loco', 'train', *argv, '--help']\n"
            "    try:\n"
            "        runpy.run_module('loco', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as done:\n"
            "        assert done.code == 0, done.code\n"
            f"    print({HELP_END!r}, flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr[-2000:]
    texts = res.stdout.split(HELP_END + "\n")
    assert len(texts) == len(argvs) + 1 and texts[-1] == ""
    return [_help_text(t) for t in texts[:-1]]


def _train_help(*args, capsys):
    """`loco train ARGS --help` at 200 columns through `main` in this process, which parses
    as the console script does (``_console_helps``) without starting Python again."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["train", *args, "--help"])
    assert exit_.value.code == 0
    return _help_text(capsys.readouterr().out)


def test_console_script_help_lists_every_option_by_section_and_method(monkeypatch, capsys):
    """`loco train --help` lists the sections' options in their groups and points to each
    method's own; `--algorithm NAME --help` lists NAME's own options and the shared ones it
    takes, and no other method's: over the methods, every option is listed. The console
    script's help is the one `main` prints (checked on the first method)."""
    from loco.algorithms import methods
    from loco.config import SECTIONS, TrainConfig

    def flag(name):  # the option's own line of --help, not a mention in another's
        return re.compile(rf"^ +--{name.replace('_', '-')}[ ,\n]", re.M)

    monkeypatch.setenv("COLUMNS", "200")
    first = next(iter(methods()))
    text, first_text = _console_helps((), ("--algorithm", first))
    assert text == _train_help(capsys=capsys)
    for section in SECTIONS:
        assert f"\n{section.section}:\n" in text
    assert "loco train --algorithm NAME --help" in text
    assert not flag("codec").search(text) and not flag("group_size").search(text)
    seen = set()
    for i, (name, cls) in enumerate(methods().items()):
        text = _train_help("--algorithm", name, capsys=capsys)
        if i == 0:
            assert text == first_text
        own = {f.name for f in TrainConfig.fields()} - {f.name for s in SECTIONS
                                                         for f in dataclasses.fields(s)}
        for option in own | {"sync_every", "outer_lr", "spread_every"}:
            assert bool(flag(option).search(text)) == (option in cls.takes()), (name, option)
        seen |= {f.name for f in TrainConfig.fields() if flag(f.name).search(text)}
    assert seen == {f.name for f in TrainConfig.fields()}


def test_warns_when_the_last_round_never_syncs(corpus, tmp_path, capsys):
    assert main(small_run(corpus, tmp_path / "run", "--steps", "10", "--algorithm",
                          "diloco")) == 0  # H = 4
    assert "not a multiple of --sync-every" in capsys.readouterr().err


def records_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.numerics
@pytest.mark.parametrize("algorithm", ["diloco", "ddp"])
def test_pipeline_stages_with_fixed_routing_train_like_the_unsplit_model(trained, algorithm):
    """2 replicas x 2 stages: every loss as with whole-model workers (clipping active, so the
    gradient norm must span both stages), and the bytes between stages exactly as counted."""
    from loco.model import model_config

    clip = ("--algorithm", algorithm, "--grad-clip", "0.05")
    whole, piped = records_of(trained(*clip)), records_of(trained(*clip, "--stages", "2"))
    for key in ("train_loss", "eval_loss"):
        a = [(r["step"], r[key]) for r in whole if key in r]
        b = [(r["step"], r[key]) for r in piped if key in r]
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 2
        # The stage boundary groups the matmul sums and the clipping norm differently, a few
        # ulps per step; AdamW carries them 12 steps. Losses lie in [4, 8), ulp 2^-21: 16 ulps
        # (measured: at most 1/3 ulp, on the generic, AVX2 and AVX-512 kernels).
        for (_, x), (_, y) in zip(a, b):
            assert y == pytest.approx(x, abs=16 * 2.0**-21)
    summary = json.loads((trained(*clip, "--stages", "2") / "summary.json").read_text())
    assert summary["stages"] == 2 and summary["routing"] == "fixed"
    assert len(summary["per_worker"]) == 4  # ranks
    # Per step, stage 0 sends its activations (fp32) and the int64 targets, and both stages
    # swap the tied embedding's gradient (fp32) and their squared gradient norms (fp32).
    d = model_config("tiny", 300, 32).d_model
    per_step = 4 * 32 * d * 4 + 4 * 32 * 8 + 300 * d * 4 + 4
    assert summary["pipeline_bytes_sent_per_rank"] == 12 * per_step
    assert summary["per_worker"][1]["pipeline_bytes_sent"] == 12 * (per_step - 4 * 32 * 8)


def test_noloco_with_random_routing_over_stages(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--algorithm", "noloco", "--workers", "4", "--stages",
                          "2", "--routing", "random", "--spread-every", "4")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["stages"] == 2 and summary["routing"] == "random"
    r = summary["replicas"]
    assert len(r["eval_losses"]) == 4 and all(math.isfinite(x) for x in r["eval_losses"])
    assert math.isfinite(r["average_eval_loss"])
    spread = [x["spread"] for x in records_of(out) if "spread" in x]
    assert len(spread) == 3 and all(s > 0 for s in spread)
    assert "random routing" in capsys.readouterr().out


def test_pipeline_stages_under_the_processes_launcher(corpus, tmp_path, trained):
    """The same job under the processes launcher as under threads: the same bytes between
    stages and the same final loss, bit for bit. The same operations on the same CPU: each
    process has one intra-op thread, the threads launcher cores ÷ workers, but the tiny
    model's operations are below torch's parallel grain, so the count splits nothing."""
    job = ("--algorithm", "diloco", "--grad-clip", "0.05", "--stages", "2")
    assert main(small_run(corpus, tmp_path / "procs", *job, "--launcher", "processes")) == 0
    ref = json.loads((trained(*job) / "summary.json").read_text())
    got = json.loads((tmp_path / "procs" / "summary.json").read_text())
    assert got["launcher"] == "processes" and got["stages"] == 2
    assert got["pipeline_bytes_sent_per_rank"] == ref["pipeline_bytes_sent_per_rank"]
    assert got["final_eval_loss"] == ref["final_eval_loss"]


def test_emulated_link_slows_blocking_reductions_and_is_reported(corpus, tmp_path, capsys):
    """DataParallel waits for every step's reduction: under a 20 Mbit/s, 30 ms link each one
    takes at least latency + bytes x 8 / rate, and compute utilization shows it."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, "--algorithm", "ddp", "--link-bandwidth", "20Mbit",
                          "--link-latency", "30ms")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["link"] == {"bandwidth": "20Mbit", "latency": "30ms"}
    per_step = summary["bytes_sent_per_rank"] / 12
    floor = 12 * (0.030 + per_step * 8 / 20e6)
    for w in summary["per_worker"]:
        assert w["blocked_seconds"] >= floor * 0.98
        assert 0 < w["compute_utilization"] < 1
    assert summary["comm_wait_seconds"] >= floor * 0.98
    assert summary["train_seconds"] >= floor
    assert "compute utilization" in capsys.readouterr().out
    # every rank's own totals, all tags, for comparison with a packet counter
    ranks = [json.loads((out / "comm" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["outer"]["train"]["sent_bytes"] for r in ranks] == [
        w["bytes_sent"] for w in summary["per_worker"]]
    assert all(r["sent_bytes"] >= r["outer"]["train"]["sent_bytes"] for r in ranks)


@pytest.mark.parametrize("argv,option", [
    (["simulate", "utilization", "--sync-every", "0"], "--sync-every"),
    (["simulate", "utilization", "--model", "custom"], "--layers"),
    (["simulate", "latency", "--workers", "6"], "--workers"),
    (["simulate", "latency", "--trials", "0"], "--trials"),
])
def test_simulate_bad_input_is_one_clear_line_and_exit_2(argv, option, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and "Traceback" not in err


def test_simulate_commands_print_json_without_loading_torch(tmp_path):
    """`loco simulate` is numpy only: it starts without torch and prints its JSON."""
    code = ("import json, sys, io, contextlib; from loco.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    assert main(sys.argv[1:]) == 0\n"
            "data = json.loads(out.getvalue()); assert 'torch' not in sys.modules\n"
            "print(sorted(data))")
    res = subprocess.run([sys.executable, "-c", code, "simulate", "utilization", "--model", "1b",
                          "--json", "--plot", str(tmp_path / "u.png")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "['1b']"
    assert (tmp_path / "u.png").read_bytes()[:4] == b"\x89PNG"
    res = subprocess.run([sys.executable, "-m", "loco", "simulate", "latency", "--workers",
                          "4,8", "--sync-every", "1,10", "--json", "--plot", ""],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["latency_ratio"]


@pytest.mark.parametrize("argv", [
    ["simulate", "utilization", "--model", "1b"],
    ["simulate", "utilization", "--model", "1b", "--json"],
    ["simulate", "latency", "--workers", "4,8", "--sync-every", "1,10", "--trials", "5"],
    ["simulate", "latency", "--workers", "4,8", "--sync-every", "1,10", "--trials", "5",
     "--json"],
    ["--help"], ["train", "--help"], ["compare", "--help"], ["report", "--help"],
    ["simulate", "utilization", "--help"], ["simulate", "latency", "--help"],
], ids=" ".join)
def test_commands_write_no_file_unless_asked(argv, tmp_path, monkeypatch, capsys):
    """A command writes only where it is told (--plot, --out): nothing in the working
    directory by default, with or without --json."""
    monkeypatch.chdir(tmp_path)
    try:
        assert main(argv) == 0
    except SystemExit as done:  # --help
        assert done.code == 0
    assert list(tmp_path.iterdir()) == []
    if "--json" in argv:
        json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout


def test_report_of_one_run_writes_into_it_only(trained, tmp_path, monkeypatch):
    """`loco report DIR` writes into DIR and nowhere else; --out elsewhere leaves DIR as it
    was."""
    out = shutil.copytree(trained(), tmp_path / "run")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(p.name for p in out.iterdir())
    assert main(["report", str(out), "--out", str(tmp_path / "elsewhere")]) == 0
    assert sorted(p.name for p in out.iterdir()) == before
    assert list(work.iterdir()) == []
    assert (tmp_path / "elsewhere" / "report.md").exists()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").exists() and list(work.iterdir()) == []


def test_old_option_names_are_read_as_the_new_ones(tmp_path):
    """--alpha was renamed --mixing (NoLoCo's momentum is also called alpha); the old name
    still works in YAML files, on the command line and in --set, and names the new one."""
    from loco.config import ConfigError, build_config, canonical

    cfg_file = tmp_path / "old.yaml"
    cfg_file.write_text("alpha: 0.25\n")
    assert build_config(str(cfg_file), {}).method.mixing == 0.25
    assert build_config(None, {"alpha": 0.75}).method.mixing == 0.75
    both = tmp_path / "both.yaml"
    both.write_text("alpha: 0.25\nmixing: 0.5\n")
    with pytest.raises(ConfigError, match="mixing.*given twice"):
        build_config(str(both), {})
    assert canonical({"alpha": 0.1, "fragments": 2}) == {"mixing": 0.1, "fragments": 2}
    assert build_parser().parse_args(["train", "--alpha", "0.3"]).mixing == 0.3


@pytest.mark.parametrize("algorithm,h", [("streaming", 50), ("diloco", 100), ("noloco", 50),
                                         ("ddp", 50), ("sparseloco", 30),
                                         ("sparta_diloco", 200)])
def test_per_method_defaults_are_the_papers_and_help_says_so(algorithm, h, capsys):
    from loco.config import resolve

    cfg = resolve(build_config(None, {"algorithm": algorithm}))
    assert cfg.method.sync_every == h and cfg.run.steps == 400
    assert resolve(build_config(None, {"algorithm": algorithm, "sync_every": 7})).method.sync_every == 7
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("the papers' but for streaming, whose paper uses 100 for runs of thousands of "
            "steps: ddp 50, diloco 100, streaming 50, sparseloco 30, noloco 50, demo 50, "
            "sparta 50, sparta_diloco 200, local 50)") in text
    assert f"{algorithm} {h}" in text


def test_model_ladder_overrides_and_token_budget():
    """The paper's ladder by name, --layers/--dim/--heads on top, and --tokens 20x setting
    the steps from the parameter count (embeddings included, at --vocab-size)."""
    from loco.config import model_dims, resolve
    from loco.model import ModelConfig, parameter_count

    cfg = build_config(None, {"model": "1b"})
    assert model_dims(cfg) == {"n_layers": 24, "d_model": 2048, "n_heads": 32}
    cfg = build_config(None, {"model": "35m", "layers": 3, "dim": 256, "heads": 4})
    assert model_dims(cfg) == {"n_layers": 3, "d_model": 256, "n_heads": 4}
    cfg = resolve(build_config(None, {"model": "tiny", "tokens": "20x", "workers": 2,
                                      "batch_size": 4, "seq_len": 32}))
    params = parameter_count(ModelConfig(vocab_size=4096, seq_len=32, d_model=32, n_layers=2,
                                         n_heads=2))
    assert cfg.run.steps == -(-20 * params // (2 * 4 * 32))
    assert resolve(build_config(None, {"tokens": "2e5", "workers": 2, "batch_size": 4,
                                       "seq_len": 32})).run.steps == 782  # ceil(2e5 / 256)


def test_parameter_count_matches_the_built_model():
    import torch

    from loco.model import Transformer, model_config, parameter_count

    for name, dims in [("tiny", {}), ("small", {}), ("35m", {"n_layers": 1, "d_model": 128,
                                                             "n_heads": 2})]:
        mcfg = model_config(name, 300, 16, **dims)
        model = Transformer(mcfg, torch.Generator().manual_seed(0))
        assert parameter_count(mcfg) == model.num_parameters()
