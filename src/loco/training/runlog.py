"""The run directory's files: ``metrics.jsonl`` as training goes, ``summary.json`` and
``loss.png`` at the end (and the dashboards that mirror them)."""

from __future__ import annotations

import json
import os

from loco.config import TrainConfig
from loco.dashboard import Dashboards
from loco.training.summary import Summary


class RunLog:
    """The run directory: metrics.jsonl as training goes, summary.json and loss.png at the end."""

    def __init__(self, out: str, resume_at: int | None = None, cfg: TrainConfig | None = None,
                 resumed_from: int | None = None):
        """``resume_at``: continue a resumed run's metrics.jsonl, cut at that many bytes (its
        size at the checkpoint), so that no record is lost or repeated. ``cfg``: also log to
        the dashboards it asks for (--tensorboard, --wandb); ``resumed_from``: the step
        metrics.jsonl was cut back to, so a dashboard hides what came after it."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.records: list[dict] = []
        self.dash = Dashboards.open(cfg, resumed_from=resumed_from) if cfg else Dashboards()
        path = os.path.join(out, "metrics.jsonl")
        if resume_at is None:
            self._metrics = open(path, "w", buffering=1)
            return
        with open(path, "r+b") as f:
            f.truncate(resume_at)
        with open(path) as f:
            self.records = [json.loads(line) for line in f if line.strip()]
        self._metrics = open(path, "a", buffering=1)

    def tell(self) -> int:
        """Bytes written so far."""
        self._metrics.flush()
        return self._metrics.tell()

    def metric(self, record: dict) -> None:
        """Append a record to metrics.jsonl (and the dashboards)."""
        self.records.append(record)
        self._metrics.write(json.dumps(record) + "\n")
        self.dash.metric(record)

    def finish(self, summary: Summary) -> None:
        """Close metrics.jsonl; write ``summary.json`` (atomically), the dashboards'
        summary and ``loss.png``.

        Args:
            summary: the run's summary.
        """
        from loco.plot import plot_losses

        content = summary.to_dict()
        self._metrics.close()
        tmp = os.path.join(self.out, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(content, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "summary.json"))
        self.dash.finish(content)
        plot_losses(self.records, os.path.join(self.out, "loss.png"),
                    title=f"{summary.algorithm}, {summary.workers} workers",
                    reference=summary.unigram_entropy)
