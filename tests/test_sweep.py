"""``loco compare --sweep``: the grid syntax and its checks, the expansion into runs (no
training), and one tiny real sweep whose report carries the sweep's table and plot."""

import json

import pytest

import loco.training.job
from loco import compare
from loco.cli import main
from loco.config import ConfigError
from loco.report import Run, order_key, sweep_point

from test_compare import job, table_rows


def labels(plan):
    return [m.label for m in plan.methods]


TINY = {"model": "tiny", "workers": 2, "steps": 16, "sync_every": 8}


# ------------------------------------------------------------------------------ syntax
@pytest.mark.parametrize("option,text,values", [
    ("mixing", "0,0.5", ["0", "0.5"]),
    ("mixing", " 0 , 0.5 ", ["0", "0.5"]),
    ("mixing", "0;0.5", ["0", "0.5"]),
    ("sync_every", "50", ["50"]),
    ("overlap", "0", ["0"]),
    ("overlap", "0;1;2;5", ["0", "1", "2", "5"]),
    ("overlap", "1;1,1,2,5", ["1", "1,1,2,5"]),
    ("adam_betas", "0.9,0.95;0.9,0.999", ["0.9,0.95", "0.9,0.999"]),
])
def test_sweep_values_split_on_commas_or_semicolons(option, text, values):
    assert compare.split_sweep_values(option, text) == values


@pytest.mark.parametrize("option,text,message", [
    ("overlap", "0,1,2,5", "ambiguous"),
    ("adam_betas", "0.9,0.95", "ambiguous"),
    ("mixing", "", "empty value"),
    ("mixing", "0,,0.5", "empty value"),
    ("overlap", "1;", "empty value"),
])
def test_sweep_values_refuse_ambiguity_and_empty_values(option, text, message):
    with pytest.raises(ConfigError, match=message) as err:
        compare.split_sweep_values(option, text)
    assert str(err.value).startswith("--sweep: ")


def test_ambiguous_overlap_says_how_to_write_it():
    with pytest.raises(ConfigError) as err:
        compare.split_sweep_values("overlap", "0,1,2,5")
    assert "'overlap=0;1;2;5'" in str(err.value)  # one run per value
    assert "'overlap=1;0,1,2,5'" in str(err.value)  # a per-worker list against one value


BAD_SWEEPS = [
    (["--sweep", "bogus=1,2"], "unknown option 'bogus'"),
    (["--sweep", "out=a,b"], "unknown option 'out'"),
    (["--sweep", "mixing"], "must look like OPTION=VALUES"),
    (["--sweep", "=1,2"], "must look like OPTION=VALUES"),
    (["--sweep", "mixing="], "empty value"),
    (["--sweep", "mixing=0,,1"], "empty value"),
    (["--sweep", "overlap=0,1"], "ambiguous"),
    (["--sweep", "steps=8,16"], "--steps must be the same for every method"),
    (["--sweep", "model=tiny,small"], "--model must be the same for every method"),
    (["--algorithms", "ddp,diloco", "--sweep", "overlap=0;1"],
     "--overlap applies to none of the methods (ddp, diloco); only to streaming"),
    (["--algorithms", "diloco,local", "--sweep", "grad_codec=fp32,bf16"],
     "--grad-codec applies to none of the methods"),
    (["--sweep", "mixing=0", "--sweep", "mixing=0.5"], "mixing is given twice"),
    (["--sweep", "mixing=0,0.0"], "the value 0.0 is listed twice"),
    (["--sweep", "fragments=1,two"], "fragments=two: --fragments: expected int"),
    (["--sweep", "codec=fp32,fp99"], "method 'diloco[codec=fp99]': --codec: must be one of"),
    (["--sweep", "codec=fp32,a/b"], "may hold only letters"),
    (["--sweep", "sync_every=8,6"], "method 'streaming[sync_every=6]': --overlap"),
]


@pytest.mark.parametrize("extra,message", BAD_SWEEPS, ids=[" ".join(e) for e, _ in BAD_SWEEPS])
def test_bad_sweeps_fail_in_one_line_before_anything_runs(extra, message, corpus, tmp_path,
                                                          capsys, monkeypatch):
    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    out = tmp_path / "cmp"
    # The shared overlap 3 is in [0, H/P) for H = 8 but not for H = 6, whose last case needs.
    assert main(job(corpus, out, "--overlap", "3", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    if "method '" not in message:
        assert "--sweep: " in err, err
    assert not out.exists()  # nothing was started or written


# ------------------------------------------------------------------------------ expansion
def test_a_grid_runs_each_method_once_per_point_of_the_options_that_apply():
    plan = compare.plan(TINY, "ddp,diloco,streaming,s1=streaming",
                        sweeps=["overlap=0;1;0,1", "mixing=0,0.5", "sync_every=8,16"])
    grid = [f"[overlap={o},mixing={m},sync_every={h}]" for o in ("0", "1", "(0,1)")
            for m in ("0", "0.5") for h in ("8", "16")]
    assert labels(plan) == (["ddp", "diloco[sync_every=8]", "diloco[sync_every=16]"]
                            + ["streaming" + g for g in grid] + ["s1" + g for g in grid])
    by = dict(zip(labels(plan), plan.configs))
    assert by["ddp"].method.sync_every == 8  # not swept: ddp runs once, as given
    assert (by["diloco[sync_every=16]"].method.sync_every, by["diloco[sync_every=16]"].option("mixing")) == (
        16, 0.5)
    c = by["s1[overlap=(0,1),mixing=0,sync_every=16]"]
    assert (c.method.overlap, c.method.mixing, c.method.sync_every, c.method.algorithm) == ("0,1", 0.0, 16, "streaming")
    assert c.run.out.endswith("/s1[overlap=(0,1),mixing=0,sync_every=16]")
    point = plan.methods[labels(plan).index("s1[overlap=(0,1),mixing=0,sync_every=16]")].point
    assert point == {"overlap": "0,1", "mixing": 0.0, "sync_every": 16}
    assert [s.option for s in plan.sweeps] == ["overlap", "mixing", "sync_every"]
    # Every run but the swept options is the same job.
    assert len({(c.run.steps, c.runtime.workers, c.model.name, c.run.seed) for c in plan.configs}) == 1


def test_sweep_values_win_over_presets_files_and_set(tmp_path):
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text("methods:\n  streaming: {mixing: 0.25, codec: int8}\n")
    plan = compare.plan(TINY, "streaming", sets=["streaming.mixing=0.75"],
                        config_file=str(cfg), sweeps=["alpha=0,1"])  # the old name of mixing
    assert labels(plan) == ["streaming[mixing=0]", "streaming[mixing=1]"]
    assert [(c.method.mixing, c.method.codec) for c in plan.configs] == [(0.0, "int8"), (1.0, "int8")]


def test_yaml_sweep_takes_lists_and_flags_replace_its_options(tmp_path):
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text("algorithms: [ddp, streaming]\nsweep:\n  overlap: [0, '1,0']\n"
                   "  mixing: 0,0.5\n")
    plan = compare.plan(TINY, config_file=str(cfg))
    assert labels(plan) == ["ddp", "streaming[overlap=0,mixing=0]",
                            "streaming[overlap=0,mixing=0.5]", "streaming[overlap=(1,0),mixing=0]",
                            "streaming[overlap=(1,0),mixing=0.5]"]
    plan = compare.plan(TINY, config_file=str(cfg), sweeps=["mixing=1"])
    assert labels(plan)[1:] == ["streaming[overlap=0,mixing=1]",
                                "streaming[overlap=(1,0),mixing=1]"]
    cfg.write_text("sweep: [overlap]\n")
    with pytest.raises(ConfigError, match="--sweep: a YAML file's 'sweep' must map"):
        compare.plan(TINY, config_file=str(cfg))


def test_sweep_labels_read_back_with_the_runs_own_values():
    config = {"overlap": "1,1,2,5", "mixing": 0.5, "sync_every": 100}
    label = compare.sweep_label("streaming", [("overlap", "1,1,2,5"), ("mixing", "0.5")])
    assert label == "streaming[overlap=(1,1,2,5),mixing=0.5]"
    assert sweep_point(label, config) == ("streaming", {"overlap": "1,1,2,5", "mixing": 0.5})
    assert sweep_point("streaming", config) is None
    assert sweep_point("streaming[bogus=1]", config) is None  # not an option of the run
    run = Run(label, "x", {"algorithm": "streaming", "config": config}, [])
    assert (run.base, run.method_name) == ("streaming", "Streaming DiLoCo")
    assert run.name == "Streaming DiLoCo [overlap=(1,1,2,5),mixing=0.5]"
    other = Run("s8[mixing=0]", "x", {"algorithm": "streaming", "config": config}, [])
    assert other.name == "s8 (Streaming DiLoCo) [mixing=0]"


def test_sweep_runs_are_reported_in_numeric_order():
    def run(label, algorithm, **config):
        return Run(label, label, {"algorithm": algorithm, "config": config}, [])

    runs = [run("diloco[sync_every=100]", "diloco", sync_every=100),
            run("streaming[overlap=(0,1)]", "streaming", overlap="0,1"),
            run("streaming[overlap=10]", "streaming", overlap="10"),
            run("diloco[sync_every=20]", "diloco", sync_every=20),
            run("streaming[overlap=2]", "streaming", overlap="2"),
            run("ddp", "ddp"), run("streaming", "streaming", overlap="1")]
    assert [r.label for r in sorted(runs, key=order_key)] == [
        "ddp", "diloco[sync_every=20]", "diloco[sync_every=100]", "streaming",
        "streaming[overlap=2]", "streaming[overlap=10]", "streaming[overlap=(0,1)]"]


# ------------------------------------------------------------------------------ a real sweep
@pytest.fixture(scope="module")
def swept(corpus, tmp_path_factory):
    """DataParallel in bf16 and in fp32, and Streaming DiLoCo over overlap x mixing (a
    per-worker τ list among the overlaps), trained once."""
    out = tmp_path_factory.mktemp("sweep") / "cmp"
    argv = job(corpus, out, "--algorithms", "ddp,ddp32=ddp,streaming", "--set",
               "ddp.grad-codec=bf16", "--sweep", "overlap=0;1;0,1", "--sweep", "mixing=0,0.5",
               "--checkpoint-every", "0")
    assert main(argv) == 0
    return out


SWEPT = [f"streaming[overlap={o},mixing={m}]" for o in ("0", "1", "(0,1)") for m in ("0", "0.5")]


def test_a_sweep_trains_one_run_per_point(swept):
    numbers = json.loads((swept / "compare.json").read_text())
    assert list(numbers) == ["ddp", "ddp32", *SWEPT]
    for label in SWEPT:
        config = json.loads((swept / label / "summary.json").read_text())["config"]
        point = numbers[label]["compare"]["sweep"]
        assert point == {"overlap": config["overlap"], "mixing": config["mixing"]}
        assert label == compare.sweep_label(
            "streaming", [("overlap", config["overlap"]),
                          ("mixing", "0" if config["mixing"] == 0 else str(config["mixing"]))])
    assert numbers["ddp"]["compare"]["sweep"] is None


def test_sweep_report_has_the_grid_table_and_plot(swept):
    report = (swept / "report.md").read_text()
    numbers = json.loads((swept / "compare.json").read_text())
    section = report.split("## Sweep\n", 1)[1].split("\n## ", 1)[0]
    assert "### overlap × mixing" in section
    lines = [line for line in section.splitlines() if line.startswith("| Streaming DiLoCo |")]
    assert len(lines) == 6
    for line, label in zip(lines, SWEPT):
        cells = [c.strip() for c in line.strip("|").split("|")]
        summary = numbers[label]
        assert cells[1:3] == [summary["config"]["overlap"], str(summary["config"]["mixing"])]
        assert float(cells[3]) == round(summary["final_eval_loss"], 4)
        assert int(cells[5].replace(",", "")) == summary["bytes_sent_per_rank"]
    png = swept / "sweep_overlap_mixing.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![sweep_overlap_mixing.png](sweep_overlap_mixing.png)" in report
    rows = table_rows(report)
    assert "Streaming DiLoCo [overlap=(0,1),mixing=0.5]" in rows


def test_report_names_dataparallels_gradient_format_next_to_its_bytes(swept):
    rows = table_rows((swept / "report.md").read_text())
    numbers = json.loads((swept / "compare.json").read_text())
    bf16, fp32 = rows["DataParallel"], rows["ddp32 (DataParallel)"]
    assert bf16[1] == "gradients averaged every step, sent in bf16"
    assert bf16[4] == f"{numbers['ddp']['bytes_sent_per_rank']:,} (bf16)"
    assert fp32[4] == f"{numbers['ddp32']['bytes_sent_per_rank']:,} (fp32)"
    assert numbers["ddp"]["compare"]["grad_codec"] == "bf16"
    # 16-bit gradients: half of fp32's bytes on the wire.
    assert 2 * numbers["ddp"]["bytes_sent_per_rank"] == numbers["ddp32"]["bytes_sent_per_rank"]


def test_loco_report_reproduces_a_sweep_from_disk(swept):
    before = {n: (swept / n).read_bytes() for n in ("report.md", "compare.json")}
    for name in (*before, "sweep_overlap_mixing.png"):
        (swept / name).unlink()
    assert main(["report", str(swept)]) == 0
    assert {n: (swept / n).read_bytes() for n in before} == before
    assert (swept / "sweep_overlap_mixing.png").exists()


def fake_run(label, algorithm, loss, sent, **config):
    return Run(label, label, {"algorithm": algorithm, "config": config, "final_eval_loss": loss,
                              "bytes_sent_per_rank": sent}, [])


def test_sweep_plot_has_one_line_per_method_and_value_of_the_other_options(tmp_path,
                                                                            monkeypatch):
    """H on the x axis at its values, one line per method and per codec, DataParallel as the
    reference; bytes drawn since H changes them. A per-worker τ list is placed in order."""
    from loco import report

    drawn = []
    monkeypatch.setattr("loco.plot.plot_sweep", lambda *a, **k: drawn.append((a, k)))
    runs = [fake_run("ddp", "ddp", 3.0, 1000), fake_run("local", "local", 3.5, 0)]
    for h in (100, 30):
        runs.append(fake_run(f"diloco[sync_every={h}]", "diloco", 3.0 + 1 / h, 100 // h,
                             sync_every=h))
        for codec in ("fp32", "fp4_e3m0"):
            runs.append(fake_run(f"streaming[sync_every={h},codec={codec}]", "streaming",
                                 3.1 + 1 / h, 10 // h, sync_every=h, codec=codec))
    for tau in ("1", "1,1,2,5", "0"):
        runs.append(fake_run(f"s2[overlap={tau}]", "streaming", 3.2, 7, overlap=tau))
    runs.sort(key=order_key)
    assert report.sweep_plots(runs, str(tmp_path)) == [
        "sweep_sync_every.png", "sweep_sync_every_codec.png", "sweep_overlap.png"]
    (path, option, ticks, lines, references), kw = drawn[0]
    assert path.endswith("sweep_sync_every.png") and option == "sync_every"
    assert ticks == [(30.0, "30"), (100.0, "100")]
    assert lines == [("DiLoCo", [(30.0, 3.0 + 1 / 30, 3), (100.0, 3.01, 1)])]
    assert references == [("DataParallel", 3.0, 1000), ("Local", 3.5, 0)]
    assert kw == {"show_bytes": True}
    (_, option, ticks, lines, _), _ = drawn[1]
    assert [name for name, _ in lines] == ["Streaming DiLoCo, codec=fp32",
                                           "Streaming DiLoCo, codec=fp4_e3m0"]
    assert all([p for p, _, _ in points] == [30.0, 100.0] for _, points in lines)
    (_, option, ticks, lines, _), kw = drawn[2]
    assert ticks == [(0, "0"), (1, "1"), (2, "1,1,2,5")]  # numbers first, then lists
    assert lines == [("s2 (Streaming DiLoCo)", [(0, 3.2, 7), (1, 3.2, 7), (2, 3.2, 7)])]
    assert kw == {"show_bytes": False}  # τ changes no bytes: no bytes panel


def test_sweep_plot_draws_both_panels(tmp_path):
    from loco.plot import plot_sweep

    path = tmp_path / "sweep.png"
    plot_sweep(str(path), "sync_every", [(10.0, "10"), (100.0, "100")],
               [("DiLoCo", [(10.0, 3.2, 500), (100.0, 3.4, 50)])],
               [("DataParallel", 3.0, 5000), ("Local", 3.6, 0)])
    assert path.read_bytes()[:4] == b"\x89PNG"
