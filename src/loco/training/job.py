"""``loco train``: one training job, the same code for every launcher.

:func:`run_training` prepares the data in the calling process (so bad input fails before any
worker starts), then launches :func:`train_worker` on every rank. The lead rank (replica 0's
last pipeline stage, which holds its loss; rank 0 without pipeline stages) writes
``metrics.jsonl``, ``summary.json`` and ``loss.png`` into the run directory and returns the
summary. The ranks of replica 0 (all its stages, all its ranks with ``--worker-ranks``)
evaluate the global model together.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime

import torch

from loco import hf
from loco.comm.link import LinkSpec
from loco.config import ConfigError, TrainConfig, resolve, validate, warnings_for
from loco.data import (Corpus, CorpusError, EvalCorpusError, TokenizerError, prepare_corpus,
                       prepare_eval_tokens)
from loco.hf import is_hf
from loco.runtime import Elastic, Mesh, RankContext, launch, under_torchrun
from loco.runtime.vitals import DIR_ENV
from loco.training.build import setup_worker
from loco.training.finish import finish_worker
from loco.training.loop import train_loop
from loco.training.preflight import preflight


def run_training(cfg: TrainConfig) -> dict:
    """Validate, prepare data, train on every worker; return the lead rank's summary.

    Args:
        cfg: the run's configuration (its defaults that depend on other options, and
            torchrun's world size, are filled in here).

    Returns:
        The content of the run's ``summary.json`` (``Summary.to_dict()``).

    Raises:
        ConfigError: a bad option, before any worker starts.
        TrainingError: a worker failed, naming its rank and step.
    """
    cfg = prepare_config(cfg)
    for message in warnings_for(cfg):
        print(f"loco train: warning: {message}", file=sys.stderr)
    corpus = prepare_data(cfg)
    check_fits(cfg, corpus)
    return launch_training(cfg, corpus)


def prepare_config(cfg: TrainConfig) -> TrainConfig:
    """Validated, with the defaults that depend on other options (and torchrun's world size)
    filled in; raises ConfigError before anything runs."""
    if under_torchrun() and cfg.runtime.stages >= 1 and cfg.runtime.worker_ranks >= 1 and not cfg.runtime.lighthouse:
        # torchrun, not --workers, decides how many workers there are
        world = int(os.environ["WORLD_SIZE"])
        per_worker = cfg.runtime.stages * cfg.runtime.worker_ranks
        if world % per_worker:
            raise ConfigError("stages" if cfg.runtime.worker_ranks == 1 else "worker_ranks",
                              f"--workers x --worker-ranks x --stages must be "
                              f"torchrun's world size {world}, so --worker-ranks x --stages "
                              f"must divide it (got {cfg.runtime.worker_ranks} x {cfg.runtime.stages})")
        cfg = cfg.replace(workers=world // per_worker)
    validate(cfg)
    cfg = resolve(cfg)
    if cfg.run.out is None:
        cfg = cfg.replace(out=os.path.join(
            "runs", f"{cfg.method.algorithm}-{datetime.now():%Y%m%d-%H%M%S}"))
    preflight(cfg)
    return cfg


def prepare_data(cfg: TrainConfig) -> Corpus:
    """The tokenized corpus (trained and cached on first use)."""
    try:
        corpus = prepare_corpus(cfg.data.corpus, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.cache_dir,
                                cfg.data.text_field, progress=cfg.run.progress, tokenizer=cfg.data.tokenizer)
        if cfg.data.eval_corpus is not None:
            corpus.eval_extra = prepare_eval_tokens(cfg.data.eval_corpus, corpus, cfg.data.text_field,
                                                    cfg.data.cache_dir, progress=cfg.run.progress)
        return corpus
    except TokenizerError as e:
        raise ConfigError("tokenizer", str(e)) from None
    except EvalCorpusError as e:
        raise ConfigError("eval_corpus", str(e)) from None
    except CorpusError as e:
        raise ConfigError("corpus", str(e)) from None


def launch_training(cfg: TrainConfig, corpus: Corpus) -> dict:
    """Train a prepared config on every rank; return the lead rank's summary."""
    # Where the ranks note their step and memory (setup_worker): the launchers read it when
    # one dies without a word.
    if cfg.run.out is not None:
        os.environ[DIR_ENV] = os.path.join(cfg.run.out, "vitals")
    results = launch(train_worker, mesh=Mesh(cfg.runtime.workers, cfg.runtime.stages, cfg.runtime.worker_ranks),
                     launcher=cfg.runtime.launcher, args=(cfg, corpus),
                     timeout=cfg.comm.comm_timeout, max_restarts=cfg.runtime.max_restarts,
                     link=LinkSpec.parse(cfg.comm.link_bandwidth, cfg.comm.link_latency),
                     fast_link=LinkSpec.parse(cfg.comm.fast_link_bandwidth, cfg.comm.fast_link_latency),
                     elastic=Elastic(min_workers=cfg.runtime.min_workers, restarts=cfg.runtime.max_restarts,
                                     lighthouse=cfg.runtime.lighthouse, worker=cfg.runtime.worker_index,
                                     start_wait=cfg.runtime.start_wait)
                     if cfg.runtime.elastic else None)
    # The lead rank's summary (under torchrun the list holds only this rank's value; in an
    # elastic run a worker lost for good has None).
    return next((r for r in results if r and "final_eval_loss" in r),
                next(r for r in results if r))


def check_fits(cfg: TrainConfig, corpus: Corpus) -> None:
    """Raise a ConfigError naming the option when a batch does not fit the data: every rank
    of every worker reads its own share of the training windows, and the validation split
    must hold a sequence (a pipeline's, a whole batch).

    Args:
        cfg: the prepared configuration.
        corpus: the tokenized corpus.
    """
    windows = (len(corpus.train) - 1) // cfg.data.seq_len
    readers = cfg.runtime.workers * cfg.runtime.worker_ranks
    per_reader = windows // readers
    if per_reader < cfg.data.batch_size:
        who = (f"{cfg.runtime.workers} workers" if cfg.runtime.worker_ranks == 1 else
               f"{readers} ranks ({cfg.runtime.workers} workers x {cfg.runtime.worker_ranks} ranks)")
        raise ConfigError("batch_size", f"a batch does not fit the data: each of {who} has "
                          f"{per_reader} windows of {cfg.data.seq_len} tokens but a batch needs "
                          f"{cfg.data.batch_size}; lower --batch-size, --seq-len or --workers"
                          + (" or --worker-ranks" if cfg.runtime.worker_ranks > 1 else ""))
    if corpus.eval_extra is not None and len(corpus.eval_extra) <= cfg.data.seq_len:
        raise ConfigError("eval_corpus", f"it has {len(corpus.eval_extra)} tokens, fewer than "
                          f"one sequence of {cfg.data.seq_len} + 1; give more text or lower --seq-len")
    if len(corpus.val) <= cfg.data.seq_len:
        raise ConfigError("seq_len", f"the validation split ({len(corpus.val)} tokens) is "
                          f"shorter than one sequence; lower --seq-len or raise --val-fraction")
    if is_hf(cfg.model.name) and hf.has_weights(cfg.model.name):
        try:
            hf.check_vocab(cfg.model.name, hf.load_config(cfg.model.name), corpus.vocab_size)
        except hf.HFModelError as e:
            raise ConfigError("tokenizer" if cfg.data.tokenizer else "model", str(e)) from None
    val_windows = (len(corpus.val) - 1) // cfg.data.seq_len
    if cfg.runtime.stages > 1 and val_windows < cfg.data.batch_size:  # stages exchange whole batches
        raise ConfigError("batch_size", f"the validation split has {val_windows} windows of "
                          f"{cfg.data.seq_len} tokens but a pipeline evaluates whole batches of "
                          f"{cfg.data.batch_size}; lower --batch-size or raise --val-fraction")


def train_worker(ctx: RankContext, cfg: TrainConfig, corpus: Corpus) -> dict:
    """Everything one rank does in ``loco train``: set up (or resume), train, evaluate,
    checkpoint, report; the lead rank returns the summary, the others ``{"rank": r}``."""
    torch.set_flush_denormal(True)  # denormal floats slow CPU steps down (see Design)
    worker, loop = setup_worker(ctx, cfg, corpus)
    try:
        train_loop(worker, loop)
        return finish_worker(worker, loop)
    except BaseException:
        if worker.log is not None:  # the dashboards mark the run failed
            worker.log.dash.close(failed=True)
        raise
