"""``loco eval``'s command: tasks on a run's models, scores into its ``summary.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any
from unittest import mock

import torch

from loco.harness.lm import make_lm
from loco.harness.rundir import EvalError, RunCheckpoint, load_tokenizer, open_run
from loco.harness.tasks import check_task_data, import_lm_eval, quiet, scores, task_manager
from loco.harness.weights import run_models
from loco.report import main_metric


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
    method = run.cfg.method_class
    if replicas is None:
        replicas = method.replicas_by_default
    if replicas and method.replicas_identical and not method.global_copy:
        log(f"{method.title}'s workers hold the same model: --replicas adds nothing")
        replicas = False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lm_eval = import_lm_eval()
    with quiet(verbose):
        manager = task_manager(tasks, include_path)
        check_task_data(manager, tasks)
        tokenizer, corpus = load_tokenizer(run)
        full, by_model = {}, {}
        for keys, description, model in run_models(run, corpus.vocab_size, replicas):
            log(f"evaluating {description} on {', '.join(tasks)}")
            lm = make_lm(model, tokenizer, run.cfg.data.seq_len, batch_size, device, description,
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
                      f"model's {run.cfg.data.seq_len} tokens (--seq-len) and were scored on their "
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
    if run.cfg.method_class.global_copy:
        return "global"
    if run.replicas_differ and run.cfg.method.final_average:
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
