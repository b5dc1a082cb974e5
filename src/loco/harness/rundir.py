"""A finished run for ``loco eval``: its summary, configuration, checkpoint and tokenizer."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from loco import checkpoint
from loco.training.summary import Summary


class EvalError(ValueError):
    """A bad run directory, task or option; the message is one line meant for the user
    (``loco eval`` prints it and exits with code 2)."""


@dataclass
class RunCheckpoint:
    """A finished run and its end-of-training checkpoint.

    Args:
        out: the run directory.
        cfg: the run's configuration (a ``TrainConfig``).
        summary: its ``summary.json``'s record.
        meta: the checkpoint's ``latest.json``.
        step: the checkpoint's step.
    """

    out: str
    cfg: Any
    summary: Summary
    meta: dict
    step: int

    @property
    def replicas_differ(self) -> bool:
        """Whether the workers end with models of their own (NoLoCo, Local)."""
        return not self.cfg.method_class.replicas_identical


def open_run(run_dir: str) -> RunCheckpoint:
    """Read a finished run directory: its summary, configuration and last checkpoint.

    Args:
        run_dir: a ``loco train --out`` directory.

    Raises:
        EvalError: no such directory, no ``summary.json``, no checkpoint, or a checkpoint
            this version cannot read.
    """
    from loco.config import TrainConfig

    if not os.path.isdir(run_dir):
        raise EvalError(f"no such run directory: {run_dir}")
    path = os.path.join(run_dir, "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except FileNotFoundError:
        raise EvalError(f"{run_dir} has no summary.json: not a finished run of loco "
                        "train") from None
    except (OSError, ValueError) as e:
        raise EvalError(f"{path} cannot be read ({e})") from None
    try:
        meta = checkpoint.latest(run_dir)
    except checkpoint.CheckpointError as e:
        raise EvalError(str(e)) from None
    if meta is None:
        raise EvalError(f"{run_dir} has no checkpoint ({checkpoint.DIRNAME}/latest.json is "
                        "missing): loco eval reads the model's weights from the run's last "
                        "checkpoint")
    summary = Summary.from_dict(summary) if isinstance(summary, dict) else Summary()
    saved = summary.config
    if not isinstance(saved, dict):
        saved = meta.get("config")
    if not isinstance(saved, dict):
        raise EvalError(f"{run_dir} records no configuration (in summary.json or "
                        f"{checkpoint.DIRNAME}/latest.json)")
    try:
        cfg = TrainConfig.from_saved(saved)
    except (TypeError, ValueError) as e:
        raise EvalError(f"{run_dir}'s configuration cannot be read by this version of loco "
                        f"({e})") from None
    step = int(meta["step"])
    if step != cfg.run.steps:
        print(f"loco eval: warning: {run_dir}'s last checkpoint is of step {step}, not the "
              f"last step {cfg.run.steps}", file=sys.stderr)
    if meta.get("elastic"):
        raise EvalError(f"{run_dir} is an elastic run (--elastic): reading its checkpoint "
                        "(the lead worker's shared state) is not supported yet")
    return RunCheckpoint(run_dir, cfg, summary, meta, step)


def load_tokenizer(run: RunCheckpoint):
    """The run's tokenizer (a ``tokenizers.Tokenizer``) and its corpus: the corpus is
    prepared as training did (read from cache when it is there).

    Raises:
        EvalError: the corpus (or the tokenizer given to training) cannot be found.
    """
    from tokenizers import Tokenizer

    from loco.data import CorpusError, prepare_corpus

    cfg = run.cfg
    extra = {}
    if cfg.data.tokenizer is not None:
        extra["tokenizer"] = cfg.data.tokenizer
    try:
        corpus = prepare_corpus(cfg.data.corpus, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.cache_dir,
                                cfg.data.text_field, **extra)
    except CorpusError as e:
        raise EvalError(f"the run's tokenizer cannot be rebuilt from its corpus ({e}); run "
                        "loco eval where the run was trained (its --corpus and --cache-dir "
                        "are read from its configuration)") from None
    path = corpus.tokenizer_path
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    tokenizer.no_truncation()  # a tokenizer.json's own settings would cut texts silently
    tokenizer.no_padding()
    return tokenizer, corpus
