"""``loco eval``: downstream tasks through lm-evaluation-harness.

A finished run directory (``loco train --out RUN_DIR``) holds its configuration in
``summary.json`` and its weights in the end-of-training checkpoint
(``checkpoints/stepNNNNNNNN/``). :func:`open_run` reads both; :func:`run_models` rebuilds the
models the run ends with:

- DiLoCo and Streaming DiLoCo: the **global copy** (the outer algorithm's parameters, what
  the run's final evaluation scores), from worker 0's checkpoint;
- DataParallel: worker 0's model (every worker holds the same);
- NoLoCo and Local: every replica's model (one per worker), and their average. The final
  model is replica 0, or the average for a run trained with ``--final-average``, as the run's
  own final evaluation.

Pipeline stages are merged (each stage's rank file holds its part); workers of several ranks
are read from their rank files (``--launcher threads``) or, when their tensors went through
``torch.distributed.checkpoint``, from their worker directories (FSDP2 shards assembled).

:func:`make_lm` wraps a model and the run's tokenizer as an lm-evaluation-harness
``TemplateLM`` (log-likelihoods of continuations, rolling log-likelihoods, greedy
generation); :func:`evaluate_run` runs tasks with ``lm_eval.simple_evaluate`` and writes the
scores into ``summary.json`` (``downstream``, ``downstream_replicas``,
``downstream_average``) and lm-eval's full results into ``RUN_DIR/eval/<time>.json``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from unittest import mock

import torch

from loco import checkpoint
from loco.report import main_metric

#: What ``--include-path`` must point at when a task's data cannot be downloaded.
OFFLINE_HINT = ("without network, point --include-path at a directory of task YAML files "
                "whose dataset_path/data_files are local files (see docs/eval.md)")


class EvalError(ValueError):
    """A bad run directory, task or option; the message is one line meant for the user
    (``loco eval`` prints it and exits with code 2)."""


# ----------------------------------------------------------------------------- the run
@dataclass
class RunCheckpoint:
    """A finished run and its end-of-training checkpoint.

    Args:
        out: the run directory.
        cfg: the run's configuration (a ``TrainConfig``).
        summary: its ``summary.json``.
        meta: the checkpoint's ``latest.json``.
        step: the checkpoint's step.
    """

    out: str
    cfg: Any
    summary: dict
    meta: dict
    step: int

    @property
    def replicas_differ(self) -> bool:
        """Whether the workers end with models of their own (NoLoCo, Local)."""
        return not self.cfg.method.replicas_identical


def open_run(run_dir: str) -> RunCheckpoint:
    """Read a finished run directory: its summary, configuration and last checkpoint.

    Args:
        run_dir: a ``loco train --out`` directory.

    Raises:
        EvalError: no such directory, no ``summary.json``, no checkpoint, or a checkpoint
            this version cannot read.
    """
    from loco.config import TrainConfig, canonical

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
    saved = summary.get("config") if isinstance(summary, dict) else None
    if not isinstance(saved, dict):
        saved = meta.get("config")
    if not isinstance(saved, dict):
        raise EvalError(f"{run_dir} records no configuration (in summary.json or "
                        f"{checkpoint.DIRNAME}/latest.json)")
    names = {f.name for f in TrainConfig.fields()}
    try:
        cfg = TrainConfig(**{k: v for k, v in canonical(saved).items() if k in names})
    except (TypeError, ValueError) as e:
        raise EvalError(f"{run_dir}'s configuration cannot be read by this version of loco "
                        f"({e})") from None
    step = int(meta["step"])
    if step != cfg.steps:
        print(f"loco eval: warning: {run_dir}'s last checkpoint is of step {step}, not the "
              f"last step {cfg.steps}", file=sys.stderr)
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
    if getattr(cfg, "tokenizer", None) is not None:
        extra["tokenizer"] = cfg.tokenizer
    try:
        corpus = prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.val_fraction, cfg.cache_dir,
                                cfg.text_field, **extra)
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


# ------------------------------------------------------------------------- the weights
def _layout(run: RunCheckpoint) -> tuple[int, int, int]:
    """(M workers, S stages, R ranks per worker) of the run's checkpoint."""
    cfg = run.cfg
    workers = int(run.summary.get("workers") or cfg.workers)
    stages = int(run.summary.get("stages") or cfg.stages)
    ranks = int(run.meta.get("worker_ranks", cfg.worker_ranks))
    if ranks > 1 and stages > 1:
        raise EvalError("a checkpoint of pipeline stages with workers of several ranks is "
                        "not supported yet")
    return workers, stages, ranks


def _rank(replica: int, stage: int, stages: int, ranks: int, shard: int = 0) -> int:
    return (replica * stages + stage) * ranks + shard


def _load_rank(run: RunCheckpoint, rank: int) -> dict:
    try:
        return checkpoint.load_rank(run.out, run.step, rank)["algorithm"]
    except checkpoint.CheckpointError as e:
        raise EvalError(str(e)) from None


def stage_tensors(run: RunCheckpoint, replica: int) -> list[tuple[dict, dict]]:
    """One replica's tensors in the checkpoint, per pipeline stage: (its model's
    ``state_dict``, the outer algorithm's global copies by name: ``fragment{i}.global`` as
    one fp32 vector of the fragment's parameters in order, or ``fragment{i}.global.{j}``
    per parameter; empty for methods without one).

    Args:
        run: the run.
        replica: the worker, in [0, M).
    """
    _, stages, ranks = _layout(run)
    if run.meta.get("dcp_workers"):  # a worker of R ranks saved its tensors through DCP
        path = checkpoint.worker_dir(run.out, run.step, replica)
        try:
            tensors = checkpoint.read_worker(path)
        except Exception as e:  # noqa: BLE001 - DCP's errors are many; report the first line
            first = str(e).strip().splitlines()
            raise EvalError(f"{path} cannot be read ({type(e).__name__}: "
                            f"{first[0][:200] if first else ''})") from None
        outer = {k: v for k, v in tensors.get("outer", {}).items() if ".global" in k}
        return [(tensors["model"], outer)]
    out = []
    for stage in range(stages):
        states = [_load_rank(run, _rank(replica, stage, stages, ranks, shard))
                  for shard in range(ranks)]
        outer = {}
        for i, _ in enumerate(states[0].get("fragments") or []):
            # R ranks of one worker each hold a contiguous 1/R of the fragment, in order.
            outer[f"fragment{i}.global"] = torch.cat(
                [s["fragments"][i]["global_params"].reshape(-1) for s in states])
        out.append((states[0]["model"], outer))
    return out


def _fragment_names(cfg, module, pipeline: bool) -> list[list[str]]:
    """The parameter names of each fragment, as the method builds them
    (``Method.fragment_names``)."""
    tied = pipeline and getattr(module, "tied", None) is not None
    return cfg.method.fragment_names(cfg, module, tied)


@torch.no_grad()
def replica_model(run: RunCheckpoint, replica: int, vocab_size: int,
                  global_copy: bool = False) -> torch.nn.Module:
    """A replica's model (fp32, CPU, eval mode) from the checkpoint; with ``global_copy``
    (DiLoCo, Streaming DiLoCo) the outer algorithm's global parameters instead of the
    replica's own.

    Args:
        run: the run.
        replica: the worker whose checkpoint to read, in [0, M).
        vocab_size: the tokenizer's vocabulary size.
        global_copy: load the global copy; default False.

    Raises:
        EvalError: the checkpoint does not fit the run's model.
    """
    from loco.training import make_model

    cfg = run.cfg
    _, stages, _ = _layout(run)
    model = make_model(cfg, vocab_size)
    if stages > 1:
        from loco.runtime.pipeline import split_stages

        parts = split_stages(model, stages)
    else:
        parts = [model]
    for stage, (part, (state, outer)) in enumerate(zip(parts, stage_tensors(run, replica))):
        if "tied" in state and "tied" not in part.state_dict():
            state = {k: v for k, v in state.items() if k != "tied"}  # an older stage's alias
        try:
            part.load_state_dict(state)
        except (RuntimeError, KeyError) as e:
            raise EvalError(f"the checkpoint of step {run.step} (replica {replica}, stage "
                            f"{stage}) does not fit the run's model: "
                            f"{str(e).splitlines()[0][:200]}") from None
        if not global_copy:
            continue
        if not outer:
            raise EvalError(f"the checkpoint of step {run.step} holds no global copy")
        named = dict(part.named_parameters())
        for i, names in enumerate(_fragment_names(cfg, part, stages > 1)):
            params = [named[n] for n in names]
            if f"fragment{i}.global" in outer:
                flat = outer[f"fragment{i}.global"].reshape(-1)
                if flat.numel() < sum(p.numel() for p in params):
                    raise EvalError(f"the global copy of fragment {i} in the checkpoint is "
                                    "smaller than its parameters")
                values, offset = [], 0
                for p in params:
                    values.append(flat[offset:offset + p.numel()])
                    offset += p.numel()
            else:
                values = [outer[f"fragment{i}.global.{j}"] for j in range(len(params))]
            for p, v in zip(params, values):
                p.copy_(v.reshape(p.shape))
    return model.eval()


def run_models(run: RunCheckpoint, vocab_size: int, replicas: bool = False):
    """The models to evaluate, one at a time, as (keys, description, model). The keys say
    what the model is: ``final`` (the run's final model: the global copy, worker 0's model,
    or for NoLoCo and Local replica 0 or, with ``--final-average``, the replicas' average);
    with ``replicas`` also ``replica{m}`` for every worker and, for NoLoCo and Local,
    ``average`` (the mean of the replicas' trainable parameters, as
    ``loco.train.replica_report`` forms it). A model with several keys comes once.

    Args:
        run: the run.
        vocab_size: the tokenizer's vocabulary size.
        replicas: also every replica (and their average); default False.
    """
    workers = _layout(run)[0]
    if run.cfg.method.global_copy:
        yield ("final",), "the global model", replica_model(run, 0, vocab_size, True)
    elif not run.replicas_differ:  # DataParallel: every worker holds the final model
        yield ("final",), "worker 0's model", replica_model(run, 0, vocab_size)
        return
    average_final = run.replicas_differ and run.cfg.final_average
    if not (replicas or average_final):
        if run.replicas_differ:
            yield ("final",), "replica 0 (the run's final model)", \
                replica_model(run, 0, vocab_size)
        return
    total = None
    for m in range(workers):
        model = replica_model(run, m, vocab_size)
        if run.replicas_differ:  # the average's sum, before the model moves to a device
            total = copy.deepcopy(model) if total is None else _add(total, model)
        keys = ((f"replica{m}",) if replicas else ()) + (
            ("final",) if run.replicas_differ and m == 0 and not average_final else ())
        if keys:
            yield keys, f"replica {m}", model
        del model
    if total is not None:
        with torch.no_grad():
            for p in total.parameters():
                if p.requires_grad:
                    p.div_(workers)
        keys = (("average",) if replicas else ()) + (("final",) if average_final else ())
        yield keys, "the replicas' average", total


@torch.no_grad()
def _add(total: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``total`` with ``model``'s trainable parameters added to its own."""
    others = dict(model.named_parameters())
    for name, p in total.named_parameters():
        if p.requires_grad:
            p.add_(others[name])
    return total


# ---------------------------------------------------------------------- lm-eval adapter
def _lm_eval():
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
        import lm_eval.evaluator  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise EvalError(f"loco eval needs lm-evaluation-harness ({e}): pip install "
                        "'loco[eval]'") from None
    return lm_eval


def eot_token_id(tokenizer) -> int:
    """The tokenizer's end-of-text token: the first of ``loco.data.EOS_NAMES`` it has
    (``<|endoftext|>`` for loco's own), else 0."""
    from loco import data

    for name in getattr(data, "EOS_NAMES", (data.ENDOFTEXT,)):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    return 0


@functools.cache
def lm_class() -> type:
    """``LocoLM``, an ``lm_eval.api.model.TemplateLM`` over a loco model (lm-eval is
    imported on first use); build one with :func:`make_lm`."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from tqdm import tqdm

    class LocoLM(TemplateLM):
        """A loco model (``forward(idx) -> logits``) and its ``tokenizers.Tokenizer``."""

        def __init__(self, model, tokenizer, max_length: int, batch_size: int = 16,
                     device: str | torch.device = "cpu", description: str = "",
                     eot_id: int | None = None):
            super().__init__()
            self.model = model.to(device).eval()
            self.tokenizer_ = tokenizer
            self._max_length = max_length
            self.batch_size = batch_size
            self._device = torch.device(device)
            self.description = description
            self._eot = eot_token_id(tokenizer) if eot_id is None else eot_id
            self.truncated = 0

        @property
        def eot_token_id(self) -> int:
            return self._eot

        @property
        def max_length(self) -> int:
            return self._max_length

        def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                       **kwargs) -> list[int]:
            return self.tokenizer_.encode(string, add_special_tokens=bool(
                add_special_tokens)).ids

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer_.decode(list(tokens))

        def get_model_info(self) -> dict:
            return {"model": "loco", "model_description": self.description,
                    "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                    "max_length": self._max_length}

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            """(log P(continuation | context), whether it is the greedy continuation) of
            every (key, context tokens, continuation tokens): the context is cut on the
            left to fit ``max_length`` tokens of input; a continuation longer than that is
            scored on its last ``max_length`` tokens (counted in ``truncated``)."""
            rows = []
            for _, context, continuation in requests:
                whole = (list(context) + list(continuation))[-(self._max_length + 1):]
                scored = min(len(continuation), len(whole) - 1)
                if scored < len(continuation):
                    self.truncated += 1
                rows.append((whole[:-1], whole[len(whole) - scored:]))
            results: list[tuple[float, bool] | None] = [None] * len(rows)
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
            batches = [order[i:i + self.batch_size]
                       for i in range(0, len(order), self.batch_size)]
            for batch in tqdm(batches, disable=disable_tqdm or len(batches) < 2,
                              desc="loco eval", leave=False):
                width = len(rows[batch[0]][0])
                x = torch.zeros(len(batch), width, dtype=torch.long)
                for b, i in enumerate(batch):
                    x[b, :len(rows[i][0])] = torch.tensor(rows[i][0])
                logp = torch.log_softmax(self.model(x.to(self.device)).float(), dim=-1).cpu()
                for b, i in enumerate(batch):
                    inputs, targets = rows[i]
                    if not targets:
                        results[i] = (0.0, True)
                        continue
                    n = len(inputs)
                    target = torch.tensor(targets)
                    rowlogp = logp[b, n - len(targets):n]
                    ll = rowlogp.gather(-1, target[:, None]).sum().item()
                    greedy = bool((rowlogp.argmax(-1) == target).all())
                    results[i] = (ll, greedy)
                    key = requests[i][0]
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, (ll, greedy))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Log-likelihood of whole texts, in windows of ``max_length`` tokens (lm-eval's
            rolling windows, each predicting new tokens only)."""
            out = []
            for request in tqdm(requests, disable=disable_tqdm, desc="loco eval rolling",
                                leave=False):
                (text,) = request.args
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)]
                scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows],
                                                    disable_tqdm=True)
                total = sum(ll for ll, _ in scores)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
                out.append(total)
            return out

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """Greedy generation (sampling options are ignored) until a stop string of
            ``until``, the end-of-text token or ``max_gen_toks`` tokens (default 256); the
            context is cut on the left to ``max_length`` tokens at every step."""
            out = []
            for request in tqdm(requests, disable=disable_tqdm, desc="loco eval generate",
                                leave=False):
                context, kwargs = request.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                ids = self.tok_encode(context) or [self.prefix_token_id]
                generated: list[int] = []
                text = ""
                for _ in range(int(kwargs.get("max_gen_toks", 256))):
                    window = (ids + generated)[-self._max_length:]
                    logits = self.model(torch.tensor([window], device=self.device))
                    token = int(logits[0, -1].argmax())
                    if token == self._eot:
                        break
                    generated.append(token)
                    text = self.tok_decode(generated)
                    if any(u and u in text for u in until):
                        break
                for u in until:
                    if u:
                        text = text.split(u)[0]
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
                out.append(text)
            return out

    return LocoLM


def make_lm(model: torch.nn.Module, tokenizer: Any, max_length: int, batch_size: int = 16,
            device: str | torch.device = "cpu", description: str = "",
            eot_id: int | None = None):
    """An lm-evaluation-harness model (``TemplateLM``) over a loco model.

    Args:
        model: a module whose ``forward(idx)`` returns logits ``(batch, seq, vocab)``.
        tokenizer: its ``tokenizers.Tokenizer``.
        max_length: the most tokens of input per forward pass (the run's ``--seq-len``).
        batch_size: sequences per forward pass; default 16.
        device: where to run; default ``"cpu"``.
        description: which model this is, for lm-eval's results; default empty.
        eot_id: the end-of-text token, the context of an empty context (the corpus's
            ``eos_id``, which separated its documents); default None:
            :func:`eot_token_id`.
    """
    return lm_class()(model, tokenizer, max_length, batch_size, device, description, eot_id)


# ------------------------------------------------------------------------- the tasks
def task_manager(tasks: list[str], include_path: str | None = None):
    """An ``lm_eval.tasks.TaskManager`` that knows every task of ``tasks``: only the
    ``include_path`` tasks when they are all there (fast), else lm-eval's own as well.

    Raises:
        EvalError: an unknown task name, or an ``include_path`` that is not a directory.
    """
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise EvalError(f"--include-path: no such directory: {include_path}")

    def missing(manager) -> list[str]:
        return [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]

    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not missing(manager):
            return manager
    manager = TaskManager(include_path=include_path)
    unknown = missing(manager)
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        raise EvalError(f"--tasks: unknown task {unknown[0]!r}"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                        + f"; lm-eval {getattr(lm_eval, '__version__', '')} knows "
                        f"{len(manager.all_tasks)} tasks, groups and tags"
                        + ("" if include_path else ", and --include-path adds your own"))
    return manager


def check_task_data(manager, tasks: list[str]) -> None:
    """Build every task (lm-eval downloads or reads its data then), so that a task whose
    data cannot be had fails before any model is loaded.

    Raises:
        EvalError: a task's data could not be loaded (no network, a missing file).
    """
    for task in tasks:
        try:
            manager.load([task])
        except Exception as e:  # noqa: BLE001 - datasets/hub raise many kinds
            first = " ".join(str(e).strip().split())[:300] or type(e).__name__
            raise EvalError(f"--tasks: {task}: its data could not be loaded "
                            f"({type(e).__name__}: {first}); {OFFLINE_HINT}") from None


@contextlib.contextmanager
def _quiet(verbose: bool):
    """lm-eval's and datasets' logging at warnings only (unless ``verbose``)."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval", "datasets", "httpx",
                                                  "huggingface_hub")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.suppress(Exception):
            import datasets

            datasets.utils.logging.disable_progress_bar()
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def scores(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from ``simple_evaluate``'s results: its metrics without
    their standard errors, named ``metric`` (``metric,FILTER`` for a filter other than
    ``none``), with ``samples`` (the documents scored) and ``shots`` (examples per
    prompt)."""
    out = {}
    for task, values in results.get("results", {}).items():
        entry = {}
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            entry[metric if filt == "none" else key] = value
        samples = results.get("n-samples", {}).get(task)
        if samples:
            entry["samples"] = samples.get("effective", samples.get("original"))
        shots = (results.get("n-shot") or {}).get(task)
        if isinstance(shots, int):
            entry["shots"] = shots
        out[task] = entry
    return out


# ------------------------------------------------------------------------- the command
def evaluate_run(run_dir: str, tasks: list[str], include_path: str | None = None,
                 limit: float | None = None, num_fewshot: int | None = None,
                 batch_size: int = 16, replicas: bool | None = None,
                 device: str | None = None, bootstrap_iters: int = 0,
                 verbose: bool = False, log: Callable[[str], Any] = print) -> dict:
    """Run lm-evaluation-harness tasks on a finished run's final model (and its replicas),
    and record the scores in its ``summary.json`` and ``eval/<time>.json``.

    Args:
        run_dir: a ``loco train --out`` directory.
        tasks: lm-eval task (or group) names, or YAML files.
        include_path: a directory of task YAML files (local data); default None.
        limit: at most this many documents per task (a fraction when < 1); default all.
        num_fewshot: examples in each prompt; default None: the task's own (0 for most).
        batch_size: sequences per forward pass, >= 1; default 16.
        replicas: also every replica and their average; default None: NoLoCo yes, others
            no.
        device: where to run; default CUDA when available, else the CPU.
        bootstrap_iters: bootstrap iterations of lm-eval's standard errors; default 0
            (none).
        verbose: let lm-eval log at its own levels; default False (errors only).
        log: where progress lines go; default ``print``.

    Returns:
        What was written to ``summary.json``: ``downstream`` (the final model's scores),
            ``downstream_setup``, and with replicas ``downstream_replicas`` and (NoLoCo,
            Local) ``downstream_average``.

    Raises:
        EvalError: a bad run directory, task or option (one line for the user).
    """
    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise EvalError("--tasks: give at least one task, e.g. --tasks hellaswag,piqa,arc_easy")
    if batch_size < 1:
        raise EvalError(f"--batch-size: must be >= 1 (got {batch_size})")
    if limit is not None and not limit > 0:
        raise EvalError(f"--limit: must be > 0 (got {limit:g})")
    if num_fewshot is not None and num_fewshot < 0:
        raise EvalError(f"--num-fewshot: must be >= 0 (got {num_fewshot})")
    run = open_run(run_dir)
    method = run.cfg.method
    if replicas is None:
        replicas = method.replicas_by_default
    if replicas and method.replicas_identical and not method.global_copy:
        log(f"{method.title}'s workers hold the same model: --replicas adds nothing")
        replicas = False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lm_eval = _lm_eval()
    with _quiet(verbose):
        manager = task_manager(tasks, include_path)
        check_task_data(manager, tasks)
        tokenizer, corpus = load_tokenizer(run)
        full, by_model = {}, {}
        for keys, description, model in run_models(run, corpus.vocab_size, replicas):
            log(f"evaluating {description} on {', '.join(tasks)}")
            lm = make_lm(model, tokenizer, run.cfg.seq_len, batch_size, device, description,
                         getattr(corpus, "eos_id", None))
            try:
                # (lm-eval records the git commit of the working directory: not the run's)
                with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
                    results = lm_eval.simple_evaluate(
                        model=lm, tasks=tasks, task_manager=manager, limit=limit,
                        num_fewshot=num_fewshot, log_samples=False,
                        bootstrap_iters=bootstrap_iters)
            except KeyError as e:
                raise EvalError(f"--tasks: {e.args[0] if e.args else e}") from None
            if lm.truncated:
                print(f"loco eval: warning: {lm.truncated} continuations were longer than the "
                      f"model's {run.cfg.seq_len} tokens (--seq-len) and were scored on their "
                      "last tokens only", file=sys.stderr)
            for key in keys:
                full[key] = results
                by_model[key] = scores(results)
            del lm, model
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    provenance = os.path.join("eval", f"{stamp}.json")
    setup = {"tasks": tasks, "num_fewshot": num_fewshot, "limit": limit,
             "checkpoint_step": run.step, "device": str(device),
             "lm_eval": getattr(lm_eval, "__version__", None),
             "final_model": _final_description(run),
             "results": provenance, "date": datetime.now().isoformat(timespec="seconds")}
    first = next(iter(full.values()))
    _write_json(os.path.join(run.out, provenance), _jsonable({
        "run": os.path.abspath(run.out), **setup,
        **{k: first.get(k) for k in ("configs", "versions", "n-shot", "higher_is_better",
                                     "n-samples", "config")},
        "models": {k: {part: r.get(part) for part in ("results", "groups", "group_subtasks")}
                   for k, r in full.items()}}))
    return write_scores(run.out, by_model, setup)


def _final_description(run: RunCheckpoint) -> str:
    if run.cfg.method.global_copy:
        return "global"
    if run.replicas_differ and run.cfg.final_average:
        return "average"
    return "replica 0"


def write_scores(out: str, by_model: dict[str, dict], setup: dict) -> dict:
    """Merge scores into ``out/summary.json`` (rewritten whole): ``downstream`` for the
    final model, ``downstream_replicas`` (one entry per worker) and ``downstream_average``;
    a task evaluated before keeps its other models' scores, a task evaluated again is
    replaced.

    Args:
        out: the run directory.
        by_model: ``{"final" | "replica{m}" | "average": {task: {metric: value}}}``.
        setup: what was run (``downstream_setup``).

    Returns:
        The summary's ``downstream*`` entries.
    """
    path = os.path.join(out, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    summary["downstream"] = {**(summary.get("downstream") or {}), **by_model.get("final", {})}
    reps = sorted((int(k[7:]), v) for k, v in by_model.items() if k.startswith("replica"))
    if reps:
        old = summary.get("downstream_replicas") or []
        merged = [dict(e) for e in old] + [{} for _ in range(len(old), reps[-1][0] + 1)]
        for m, values in reps:
            merged[m].update(values)
        summary["downstream_replicas"] = merged
    if "average" in by_model:
        summary["downstream_average"] = {**(summary.get("downstream_average") or {}),
                                         **by_model["average"]}
    summary["downstream_setup"] = setup
    _write_json(path, summary)
    return {k: v for k, v in summary.items() if k.startswith("downstream")}


def score_table(entries: dict) -> list[str]:
    """The terminal's table: one row per model, one column per task's main metric.

    Args:
        entries: ``summary.json``'s ``downstream*`` entries.
    """
    rows = [("final model", entries.get("downstream") or {})]
    rows += [(f"replica {m}", e) for m, e in enumerate(entries.get("downstream_replicas")
                                                       or [])]
    if entries.get("downstream_average"):
        rows.append(("replicas' average", entries["downstream_average"]))
    metrics = {}
    for _, entry in rows:
        for task, values in entry.items():
            found = main_metric(values)
            if found and task not in metrics:
                metrics[task] = found[0]
    head = ["model"] + [f"{task} ({metric})" for task, metric in metrics.items()]
    body = []
    for name, entry in rows:
        values = [entry.get(task, {}).get(metric) for task, metric in metrics.items()]
        body.append([name] + ["-" if v is None else f"{v:.4f}" for v in values])
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + body]


def _jsonable(value: Any) -> Any:
    """lm-eval's results as JSON values: anything else becomes its ``str``."""
    return json.loads(json.dumps(value, default=lambda v: (
        dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type)
        else str(v))))


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
