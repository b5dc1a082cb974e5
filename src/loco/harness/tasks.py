"""lm-evaluation-harness's tasks: finding them, loading their data, reading their scores."""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os

from loco.harness.rundir import EvalError


def import_lm_eval():
    """The ``lm_eval`` package, its model, evaluator and task modules imported.

    Raises:
        EvalError: lm-evaluation-harness is not installed (the ``eval`` extra).
    """
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
        import lm_eval.evaluator  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise EvalError(f"loco eval needs lm-evaluation-harness ({e}): pip install "
                        "'loco[eval]'") from None
    return lm_eval


#: What ``--include-path`` must point at when a task's data cannot be downloaded.
OFFLINE_HINT = ("without network, point --include-path at a directory of task YAML files "
                "whose dataset_path/data_files are local files (see docs/eval.md)")


def task_manager(tasks: list[str], include_path: str | None = None):
    """An ``lm_eval.tasks.TaskManager`` that knows every task of ``tasks``: only the
    ``include_path`` tasks when they are all there (fast), else lm-eval's own as well.

    Raises:
        EvalError: an unknown task name, or an ``include_path`` that is not a directory.
    """
    lm_eval = import_lm_eval()
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
def quiet(verbose: bool):
    """While open: lm-eval's and datasets' logging at errors only, datasets' progress bars
    off; their levels are restored on exit.

    Args:
        verbose: leave the logging as it is.
    """
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
