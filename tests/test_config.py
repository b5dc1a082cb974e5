"""The configuration in sections: each section checks its own options, the file system and
the environment are the preflight step's, and a resumed run says which options may change."""

import dataclasses
import os
import re

import pytest

from loco.cli import build_parser
from loco.config import (LAYOUT, RESUMABLE, SECTIONS, ConfigError, TrainConfig, build_config,
                         resolve, validate)
from loco.training.preflight import preflight


def flag(name):
    return "--" + name.replace("_", "-")


def test_every_option_belongs_to_one_section_or_one_method():
    from loco.algorithms import methods

    owned = [f.name for s in SECTIONS for f in dataclasses.fields(s)]
    owned += sorted({f.name for c in methods().values() if c.options
                     for f in dataclasses.fields(c.options)})
    assert sorted(owned) == sorted(f.name for f in TrainConfig.fields())
    assert len(owned) == len(set(owned))


@pytest.mark.parametrize("option,value,allowed", [
    ("lr", 0.0, "> 0"), ("seq_len", 1, ">= 2"), ("vocab_size", 10, "[257, 1048576]"),
    ("comm_timeout", -1.0, "> 0"), ("max_restarts", 101, "[0, 100]"),
    ("log_every", 0, ">= 1"), ("outer_momentum", 1.0, "[0, 1)"), ("z_loss", -1.0, ">= 0")])
def test_a_section_checks_its_own_options(option, value, allowed):
    cfg = build_config(overrides={option: value})
    section = next(s for s in SECTIONS if option in {f.name for f in dataclasses.fields(s)})
    with pytest.raises(ConfigError) as e:
        section.check(cfg)
    assert str(e.value).startswith(flag(option) + ": ") and allowed in str(e.value)
    others = [s for s in SECTIONS if s is not section]
    for s in others:  # no other section looks at it
        s.check(cfg)


def test_the_file_system_and_extras_are_the_preflight_steps(tmp_path, monkeypatch):
    cfg = build_config(overrides={"corpus": str(tmp_path / "none.txt"), "out": str(tmp_path)})
    validate(cfg)  # the configuration itself is fine
    with pytest.raises(ConfigError, match="--corpus: path does not exist"):
        preflight(resolve(cfg))
    monkeypatch.setattr("loco.training.preflight.missing_extras",
                        lambda cfg: [("wandb", "needs the wandb extra: pip install 'loco[wandb]'")])
    with pytest.raises(ConfigError, match=r"^--wandb: needs the wandb extra"):
        preflight(resolve(build_config(overrides={"out": str(tmp_path / "new")})))


def test_resume_help_and_error_name_every_option_a_resumed_run_may_change(tmp_path):
    train = build_parser("train")._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(next(a for a in train._actions if a.dest == "resume").help.split())
    for name in RESUMABLE + LAYOUT:
        assert flag(name) in help_text
    assert len(RESUMABLE + LAYOUT) == 18


def test_resume_refuses_a_changed_option_naming_all_that_may_change(tmp_path):
    from loco import checkpoint
    from loco.checkpoint import resume_config

    cfg = build_config(overrides={"out": str(tmp_path)})
    os.makedirs(tmp_path / checkpoint.DIRNAME)
    (tmp_path / checkpoint.DIRNAME / "latest.json").write_text(
        '{"step": 1, "files": [], "config": %s}' % __import__("json").dumps(cfg.to_dict()))
    with pytest.raises(ConfigError) as e:
        resume_config(str(tmp_path), {"lr": 1.0})
    for name in RESUMABLE + LAYOUT:
        assert flag(name) in str(e.value)


def test_a_yaml_file_nests_options_by_section(tmp_path, capsys):
    """Options nest under their sections (a method's own under ``method``), as ``--help``
    groups them; a key under the wrong section is refused naming its own; nothing is
    printed for a nested file."""
    from loco.config.groups import nest

    path = tmp_path / "nested.yaml"
    path.write_text("method: {algorithm: diloco, sync-every: 20, codec: int8}\n"
                    "optim: {lr: 0.001}\nrun: {steps: 40}\nruntime: {workers: 2}\n"
                    "model: {model: tiny}\n")
    cfg = build_config(str(path), {"steps": 60})  # flags win
    assert (cfg.method.algorithm, cfg.method.sync_every, cfg.method.codec, cfg.optim.lr, cfg.run.steps, cfg.runtime.workers,
            cfg.model.name) == ("diloco", 20, "int8", 0.001, 60, 2, "tiny")
    assert capsys.readouterr().err == ""
    assert nest({"lr": 0.001, "codec": "int8", "workers": 2}) == {
        "method": {"codec": "int8"}, "optim": {"lr": 0.001}, "runtime": {"workers": 2}}
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("optim: {steps: 10, lr: 0.01}\n")
    with pytest.raises(ConfigError, match=r"steps not in section 'optim' \(they are in: run\)"):
        build_config(str(wrong), {})
    twice = tmp_path / "twice.yaml"
    twice.write_text("run: {steps: 10}\nsteps: 20\n")
    with pytest.raises(ConfigError, match="--steps: given twice"):
        build_config(str(twice), {})


def test_a_flat_yaml_file_is_read_with_one_line_on_how_to_nest_it(tmp_path, capsys):
    path = tmp_path / "flat.yaml"
    path.write_text("sync_every: 10\nlr: 0.01\n")
    cfg = build_config(str(path), {})
    assert (cfg.method.sync_every, cfg.optim.lr) == (10, 0.01)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nest them under their sections" in err[0]
    assert "method: {sync_every: ...}" in err[0] and "optim: {lr: ...}" in err[0]


@pytest.mark.parametrize("algorithm,option,value,takers", [
    ("noloco", "eager", True, "diloco, streaming, sparseloco, sparta_diloco"),
    ("demo", "outer_lr", 0.5, "diloco, streaming, sparseloco, noloco, sparta_diloco"),
    ("ddp", "codec", "int8", "diloco, streaming, sparseloco, sparta_diloco"),
    ("diloco", "group_size", 4, "noloco"),
    ("streaming", "final_average", True, "noloco, sparta, local")])
def test_an_option_of_other_methods_is_refused_naming_them(algorithm, option, value, takers):
    with pytest.raises(ConfigError) as e:  # another method's own: refused when built
        validate(build_config(overrides={"algorithm": algorithm, option: value}))
    assert str(e.value) == (f"{flag(option)}: applies to {takers} only, not to --algorithm "
                            f"{algorithm} (got {value!r})")


def test_a_method_takes_its_own_options_and_its_defaults_pass_resolved():
    validate(build_config(overrides={"algorithm": "noloco", "group_size": 4, "workers": 4,
                                     "sync_every": 10}))
    for algorithm in ("ddp", "demo", "local", "sparta"):  # H filled in from the method
        validate(resolve(build_config(overrides={"algorithm": algorithm})))
        # every method has rounds of H steps: its checkpoints and replica checks count them
        validate(build_config(overrides={"algorithm": algorithm, "sync_every": 4}))
    # an option's own default, given, is no setting: --no-eager with NoLoCo passes
    validate(build_config(overrides={"algorithm": "noloco", "eager": False}))


def test_the_configuration_is_nested_by_section_and_flat_reads_warn_for_one_release():
    import pickle

    cfg = build_config(overrides={"algorithm": "diloco", "lr": 1e-3, "sync_every": 7,
                                  "codec": "int8", "workers": 3})
    assert (cfg.optim.lr, cfg.method.sync_every, cfg.method.codec) == (1e-3, 7, "int8")
    assert (cfg.runtime.workers, cfg.model.name, cfg.method_class.name) == (3, "small", "diloco")
    assert not hasattr(cfg.method, "group_size")  # the chosen method's options, no other's
    assert [s.section for s in cfg.sections()] == [s.section for s in SECTIONS]
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # the processes launcher sends it
    assert cfg.replace(lr=2e-3).optim.lr == 2e-3 and cfg.optim.lr == 1e-3
    with pytest.warns(DeprecationWarning, match=r"cfg\.sync_every is a flat read .* read "
                                                r"cfg\.method\.sync_every"):
        assert cfg.sync_every == 7


def test_a_saved_configuration_of_an_older_release_is_read_without_other_methods_options():
    saved = {**build_config(overrides={"algorithm": "noloco"}).to_dict(), "eager": True,
             "codec": "int8", "a_future_option": 1}  # an older release recorded every method's
    cfg = TrainConfig.from_saved(saved)
    assert cfg.method.algorithm == "noloco" and not hasattr(cfg.method, "eager")
    with pytest.raises(ConfigError, match="--eager: applies to"):
        TrainConfig(**{k: v for k, v in saved.items() if k != "a_future_option"})


def test_the_top_k_chunk_has_its_own_flag_and_the_block_is_read_for_it_one_release():
    from loco.algorithms.diloco import outer_kwargs
    from loco.config import warnings_for

    chunk = resolve(build_config(overrides={"algorithm": "sparseloco", "codec_chunk": 1024,
                                            "steps": 60}))
    validate(chunk)
    assert outer_kwargs(chunk)["codec_block"] == 1024 and warnings_for(chunk) == []
    old = resolve(build_config(overrides={"algorithm": "sparseloco", "codec_block": 1024,
                                          "steps": 60}))
    validate(old)
    assert outer_kwargs(old)["codec_block"] == 1024  # the same codec, with a deprecation line
    assert ("--codec-block with --codec topk_2bit is deprecated: it is read as --codec-chunk "
            "1024 for this release; give --codec-chunk") in warnings_for(old)
    scaled = resolve(build_config(overrides={"algorithm": "diloco", "codec": "int8",
                                             "codec_block": 64, "steps": 400}))
    assert outer_kwargs(scaled)["codec_block"] == 64 and warnings_for(scaled) == []
    for overrides, message in [
            ({"algorithm": "diloco", "codec": "int8", "codec_chunk": 64},
             "--codec-chunk: applies to --codec topk_2bit or topk_2bit_packed"),
            ({"algorithm": "sparseloco", "codec_chunk": 1}, "--codec-chunk: must be an integer "
                                                             "in [2, 65536] (got 1)"),
            ({"algorithm": "sparseloco", "codec_chunk": 64, "codec_block": 64},
             "--codec-chunk: give --codec-chunk alone")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(build_config(overrides=overrides))
