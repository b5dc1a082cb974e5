"""TensorBoard and Weights & Biases: a second home for what ``metrics.jsonl`` and
``summary.json`` hold.

``loco train --tensorboard`` writes event files under ``<out>/tensorboard``; ``--wandb``
starts a W&B run (offline by default, under ``<out>/wandb``). Both get every
``metrics.jsonl`` record as it is written, as ``metrics/<field>`` or ``<event>/<field>``
scalars at its ``step``, and the final summary as ``summary/<dotted key>``. The run
directory stays the reference: a dashboard that fails after its start only warns. The
names and what becomes a scalar are listed in docs/dashboards.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loco.config import TrainConfig

#: The environment variable that puts a W&B run into a group; ``loco compare`` sets it to
#: its directory's name while its methods train, so that they show up together.
GROUP_ENV = "LOCO_WANDB_GROUP"

#: Metrics records (no ``event`` field) go under this prefix.
METRICS = "metrics"
SUMMARY = "summary"


class DashboardError(RuntimeError):
    """A dashboard could not start (W&B online without a login or a network, say)."""


def missing_extras(cfg: TrainConfig) -> list[tuple[str, str]]:
    """The extras that ``--tensorboard`` or ``--wandb`` ask for and that are not importable,
    as data: ``(option, message)`` pairs, the message naming what to install; empty when all
    is there (or neither is asked for).

    Args:
        cfg: the configuration.
    """
    missing = []
    if cfg.run.tensorboard and not _tensorboard_importable():
        missing.append(("tensorboard", "needs the tensorboard extra: "
                        "pip install 'loco[tensorboard]'"))
    if cfg.run.wandb and not _spec("wandb"):
        missing.append(("wandb", "needs the wandb extra: pip install 'loco[wandb]'"))
    return missing


def missing_extra(cfg: TrainConfig) -> str | None:
    """The [`missing_extras`][loco.dashboard.missing_extras] in one line
    (``--wandb needs the wandb extra: ...``), or None when all is there.

    Args:
        cfg: the configuration.
    """
    return "; ".join(f"--{option} {message}" for option, message in missing_extras(cfg)) or None


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _tensorboard_importable() -> bool:
    if not _spec("tensorboard"):
        return False
    try:
        importlib.import_module("torch.utils.tensorboard")
    except Exception:  # noqa: BLE001 - an incompatible tensorboard fails in many ways
        return False
    return True


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested record by dotted key: dicts and lists of dicts are walked into
    (list items by index), a list of plain values is one leaf (the list).

    Args:
        value: a dict (or any JSON-like value).
        prefix: the key of ``value`` itself; default none.
    """
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def scalar(value: Any) -> float | None:
    """A leaf as a scalar: a number (a boolean as 0 or 1), a list of plain values as its
    length; None for anything else (None, text)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return float(len(value))
    return None


def record_scalars(record: dict) -> tuple[str, int | None, dict[str, float]]:
    """A ``metrics.jsonl`` record's prefix (``metrics`` or its ``event``), step and scalars
    by name (``<prefix>/<field>``); ``step`` and ``event`` are not scalars."""
    prefix = str(record.get("event") or METRICS)
    step = record.get("step")
    step = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None
    fields = {k: v for k, v in record.items() if k not in ("step", "event")}
    values = {}
    for key, leaf in flatten(fields).items():
        number = scalar(leaf)
        if number is not None:
            values[f"{prefix}/{key}"] = number
    return prefix, step, values


def summary_leaves(summary: dict) -> dict[str, Any]:
    """The summary's leaves as ``summary/<dotted key>``, its ``config`` left out (the run's
    configuration, logged as such); None values left out."""
    return {f"{SUMMARY}/{k}": v for k, v in
            flatten({k: v for k, v in summary.items() if k != "config"}).items()
            if v is not None}


def _warn(what: str, error: BaseException) -> None:
    line = (str(error).splitlines() or [""])[0][:300]
    print(f"loco: warning: {what} failed ({type(error).__name__}: {line}); it logs no more "
          "of this run, training goes on (metrics.jsonl and summary.json have it all)",
          file=sys.stderr, flush=True)


class Dashboards:
    """The dashboards of one run (those of ``--tensorboard`` and ``--wandb``): each metrics
    record as it is written, then the summary. Without either option it does nothing.

    Make one with [`open`][loco.dashboard.Dashboards.open]. A dashboard that fails while the
    run trains warns once on stderr and is dropped; training goes on.

    Args:
        backends: the open dashboards (what ``open`` makes); default none.
    """

    def __init__(self, backends: list | None = None):
        self.backends = list(backends or [])

    @classmethod
    def open(cls, cfg: TrainConfig, *, group: str | None = None,
             resumed_from: int | None = None) -> Dashboards:
        """Start the dashboards that ``cfg`` asks for.

        Args:
            cfg: the run's configuration (``out``, ``tensorboard``, ``wandb``,
                ``wandb_project``, ``wandb_run_name``, ``wandb_mode``).
            group: the W&B group; default: ``$LOCO_WANDB_GROUP`` (which ``loco compare``
                sets to its directory's name), else none.
            resumed_from: the checkpoint's step that a resumed run continues from:
                TensorBoard hides the earlier run's events after it, as ``metrics.jsonl``
                was cut there; default None (a fresh run, or one that appends).

        Raises:
            DashboardError: a missing extra, or a W&B run that cannot start.
        """
        if not (cfg.run.tensorboard or cfg.run.wandb):
            return cls()
        problem = missing_extra(cfg)
        if problem:
            raise DashboardError(problem)
        backends: list = []
        try:
            if cfg.run.tensorboard:
                backends.append(_TensorBoard(cfg, resumed_from))
            if cfg.run.wandb:
                backends.append(_WandB(cfg, group if group is not None
                                       else os.environ.get(GROUP_ENV) or None))
        except BaseException:
            for b in backends:
                b.close(failed=True)
            raise
        return cls(backends)

    @property
    def active(self) -> bool:
        """Whether any dashboard is open."""
        return bool(self.backends)

    def metric(self, record: dict) -> None:
        """Log one ``metrics.jsonl`` record (a metrics record or an event).

        Args:
            record: the record, as written to ``metrics.jsonl``.
        """
        if not self.backends:
            return
        prefix, step, values = record_scalars(record)
        for b in list(self.backends):
            try:
                b.metric(record, prefix, step, values)
            except Exception as e:  # noqa: BLE001 - a dashboard never stops the training
                self._drop(b, e)

    def finish(self, summary: dict) -> None:
        """Log the final summary and close every dashboard.

        Args:
            summary: the run's summary, as written to ``summary.json``.
        """
        for b in list(self.backends):
            try:
                b.summary(summary)
            except Exception as e:  # noqa: BLE001
                self._drop(b, e)
        self.close()

    def close(self, failed: bool = False) -> None:
        """Close every dashboard (flush TensorBoard's files, finish the W&B run); what
        ``finish`` does after the summary, and what a run that fails should call.

        Args:
            failed: the run failed (W&B marks it so); default False.
        """
        backends, self.backends = self.backends, []
        for b in backends:
            try:
                b.close(failed=failed)
            except Exception as e:  # noqa: BLE001
                _warn(f"closing {b.name}", e)

    def _drop(self, backend, error: BaseException) -> None:
        _warn(f"logging to {backend.name}", error)
        self.backends.remove(backend)
        try:
            backend.close(failed=True)
        except Exception:  # noqa: BLE001 - already reported
            pass


def _run_name(cfg: TrainConfig) -> str | None:
    if cfg.run.wandb_run_name:
        return cfg.run.wandb_run_name
    return os.path.basename(os.path.normpath(cfg.run.out)) if cfg.run.out else None


class _TensorBoard:
    """torch's SummaryWriter under ``<out>/tensorboard``."""

    name = "TensorBoard"

    def __init__(self, cfg: TrainConfig, resumed_from: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.log_dir = os.path.join(cfg.run.out or ".", "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=30,
                                    purge_step=None if resumed_from is None
                                    else resumed_from + 1)
        self.last_step = resumed_from or 0
        self.writer.add_text("config", _code(json.dumps(cfg.to_dict(), indent=2)),
                             global_step=self.last_step)

    def metric(self, record: dict, prefix: str, step: int | None, values: dict) -> None:
        step = self.last_step if step is None else step
        self.last_step = max(self.last_step, step)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        if prefix not in (METRICS, "sync"):  # elastic events: who joined, left, the errors
            self.writer.add_text(prefix, _code(json.dumps(record)), global_step=step)

    def summary(self, summary: dict) -> None:
        step = self.last_step or int(summary.get("inner_steps") or 0)
        numbers = {}
        for tag, leaf in summary_leaves(summary).items():
            number = scalar(leaf)
            if number is not None:
                numbers[tag] = number
                self.writer.add_scalar(tag, number, global_step=step)
        self.writer.add_text(SUMMARY, _code(json.dumps(summary, indent=2)), global_step=step)
        self._hparams(numbers)

    def _hparams(self, numbers: dict[str, float]) -> None:
        """The configuration and the headline numbers in TensorBoard's HPARAMS tab, in this
        run's own directory (so that the methods of a comparison line up there)."""
        from torch.utils.tensorboard.summary import hparams

        config = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                  for k, v in self.cfg.to_dict().items()}
        metrics = {k: v for k, v in numbers.items() if math.isfinite(v) and k in (
            f"{SUMMARY}/final_eval_loss", f"{SUMMARY}/bytes_sent_per_rank",
            f"{SUMMARY}/wall_seconds", f"{SUMMARY}/tokens_per_second",
            f"{SUMMARY}/compute_utilization")}
        for event in hparams(config, metrics):
            self.writer.file_writer.add_summary(event)

    def close(self, failed: bool = False) -> None:
        self.writer.flush()
        self.writer.close()


def _code(text: str) -> str:
    """Text as a Markdown code block (TensorBoard renders its text entries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class _WandB:
    """A W&B run: ``dir=<out>``, so that an offline run lands in ``<out>/wandb``."""

    name = "W&B"

    def __init__(self, cfg: TrainConfig, group: str | None):
        import wandb

        os.makedirs(cfg.run.out or ".", exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.run.wandb_project, name=_run_name(cfg), dir=cfg.run.out or ".",
                mode=cfg.run.wandb_mode, config=cfg.to_dict(), group=group,
                tags=[cfg.method.algorithm], job_type="train", reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", init_timeout=120))
        except Exception as e:  # noqa: BLE001 - wandb raises many kinds
            line = (str(e).splitlines() or [""])[0][:300]
            hint = ("; log in with `wandb login` (or set WANDB_API_KEY), or use "
                    "--wandb-mode offline" if cfg.run.wandb_mode == "online" else "")
            raise DashboardError(f"--wandb: the W&B run did not start ({type(e).__name__}: "
                                 f"{line}){hint}") from e
        self.run.define_metric("step")
        self.prefixes: set[str] = set()
        for prefix in (METRICS, "sync", "elastic_sync", "membership"):
            self._define(prefix)
        self.last_step = 0

    def _define(self, prefix: str) -> None:
        """Plot ``<prefix>/*`` against ``step``."""
        self.run.define_metric(f"{prefix}/*", step_metric="step")
        self.prefixes.add(prefix)

    def metric(self, record: dict, prefix: str, step: int | None, values: dict) -> None:
        if prefix not in self.prefixes:
            self._define(prefix)
        step = self.last_step if step is None else step
        self.last_step = step
        # No step= given: W&B's row counter only grows, whatever the records' steps.
        self.run.log({"step": step, **values})

    def summary(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary_leaves(summary).items()
                                 if isinstance(v, (bool, int, float, str))})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        _teardown_if_idle()


def _teardown_if_idle() -> None:
    """Stop W&B's service process once this process has no W&B run open any more: it
    completes a run's files only then (its ``atexit`` hook would, but not in the processes
    of the multiprocessing module, such as the processes launcher's workers). A later run
    starts a new one."""
    import wandb

    try:
        from wandb.sdk import wandb_setup

        session = getattr(wandb_setup, "_singleton", None)
        if session is None or session.most_recent_active_run is not None:
            return  # another run of this process (the caller's own, say) is still open
    except Exception:  # noqa: BLE001 - other wandb internals: leave it to wandb's atexit hook
        return
    wandb.teardown()


__all__ = ["Dashboards", "DashboardError", "GROUP_ENV", "missing_extra", "missing_extras", "flatten",
           "record_scalars", "summary_leaves"]
