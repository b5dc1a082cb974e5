"""Training a plan's runs one after another, with one progress bar, then the report."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading

from loco.compare.methods import MethodError
from loco.compare.planning import Plan
from loco.config import ConfigError
from loco.training.summary import Summary, human_bytes


def run(p: Plan, progress: bool = True) -> dict[str, dict]:
    """Train every run of the plan, one after another, then write the report.

    Args:
        p: the plan (see [`plan`][loco.compare.planning.plan]).
        progress: show the overall progress bar.

    Returns:
        ``compare.json``'s contents.
    """
    from tqdm import tqdm

    from loco.report import load_run, order_key, write_report
    from loco.training import check_fits, launch_training, prepare_data

    for w in p.warnings:
        print(f"loco compare: warning: {w}", file=sys.stderr)
    first = p.configs[0]
    corpus = prepare_data(first.replace(progress=progress))
    for m, cfg in zip(p.methods, p.configs):
        try:
            check_fits(cfg, corpus)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
    os.makedirs(p.out, exist_ok=True)
    steps = first.run.steps
    bar = tqdm(total=steps * len(p.configs), unit="step", disable=not progress,
               dynamic_ncols=True)
    runs = []
    for i, (m, cfg) in enumerate(zip(p.methods, p.configs)):
        bar.set_description(f"[{i + 1}/{len(p.configs)}] {m.label}")
        done = i * steps
        with FollowMetrics(os.path.join(cfg.run.out, "metrics.jsonl"),
                           lambda rec: _advance(bar, done + rec["step"], rec)), \
                wandb_group(p.out):
            summary = Summary.from_dict(launch_training(cfg, corpus))
        _advance(bar, done + steps, {})
        bar.write(f"{m.label}: eval loss {summary.final_eval_loss:.4f}, sent per rank "
                  f"{human_bytes(summary.bytes_sent_per_rank)}, "
                  f"{summary.wall_seconds:.0f} s")
        runs.append(load_run(cfg.run.out, m.label))
    bar.close()
    return write_report(sorted(runs, key=order_key), p.out)


@contextlib.contextmanager
def wandb_group(out: str):
    """While the methods train: ``$LOCO_WANDB_GROUP`` set to the comparison directory's name
    (unless already set), so that ``--wandb`` puts every method's run in one W&B group (the
    processes launcher's workers inherit it)."""
    from loco.dashboard import GROUP_ENV

    if os.environ.get(GROUP_ENV):
        yield
        return
    os.environ[GROUP_ENV] = os.path.basename(os.path.normpath(os.path.abspath(out)))
    try:
        yield
    finally:
        os.environ.pop(GROUP_ENV, None)


def _advance(bar, n: int, record: dict) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if "train_loss" in record:
        bar.set_postfix(loss=f"{record['train_loss']:.3f}", refresh=False)


class FollowMetrics:
    """Follows a run's ``metrics.jsonl`` from a thread while it trains and calls ``on_record``
    with each new record: the overall progress bar works the same for every launcher,
    whichever process the lead rank lives in.

    Args:
        path: the ``metrics.jsonl`` to follow (it may not exist yet).
        on_record: called with each new record that has a ``step``.
        interval: seconds between two reads.
    """

    def __init__(self, path: str, on_record, interval: float = 0.5):
        self.path, self.on_record, self.interval = path, on_record, interval
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="follow-metrics")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._poll()

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in record:
                self.on_record(record)
