"""The configuration in sections: each section checks its own options, the file system and
the environment are the preflight step's, and a resumed run says which options may change."""

import dataclasses
import os

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
