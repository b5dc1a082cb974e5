"""``loco compare``: several methods on the same job, one after another, then a report.

Every method trains the same model on the same data with the same seed and token budget;
only the method and its own knobs differ. Each run keeps its own directory under ``--out``
(``metrics.jsonl``, ``summary.json``, ``loss.png``, ``comm/``), and :mod:`loco.report` writes
``report.md``, ``compare.json`` and the plots from those directories, as ``loco report`` does
later without training.

Option precedence, lowest first: ``loco train``'s defaults, the ``--preset``, the YAML
``--config``, the flags; per method, then, the preset's and the YAML's ``methods:`` entries and
``--set LABEL.OPTION=VALUE``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import yaml

from loco.config import ALGORITHM_NAMES, RENAMED, ConfigError, TrainConfig, coerce, load_yaml

DEFAULT_ALGORITHMS = ("ddp", "diloco", "streaming", "noloco", "local")

#: Options every method must share: the same model, data, seed and token budget (and the
#: same machine and network), so that only the methods differ.
SHARED = ("model", "steps", "workers", "stages", "batch_size", "seq_len", "seed", "corpus",
          "text_field", "vocab_size", "val_fraction", "cache_dir", "dtype", "eval_every",
          "eval_batches", "final_eval_batches", "log_every", "launcher", "link_bandwidth",
          "link_latency", "out", "progress", "resume")
#: Options that mean something to some methods only; --set elsewhere is an error.
ONLY_FOR = {
    "sync_every": ("diloco", "streaming", "noloco"),
    "outer_lr": ("diloco", "streaming", "noloco"),
    "outer_momentum": ("diloco", "streaming", "noloco"),
    "nesterov": ("diloco", "streaming", "noloco"),
    "offload": ("diloco", "streaming"),
    **{k: ("streaming",) for k in ("fragments", "fragment_pattern", "overlap", "mixing", "codec",
                                   "codec_block")},
    "group_size": ("noloco",),
    "gamma": ("noloco",),
    "spread_every": ("noloco", "local"),
    "final_average": ("noloco", "local"),
}

#: Named settings. ``shared`` options apply to every method; ``methods`` maps an algorithm
#: to its own options (applied to every method of that algorithm).
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "about": "the small model (1.3M parameters) on Shakespeare, 4 workers of 4 x 128 "
                 "tokens, 300 steps, H = 30: all five methods in about 8 minutes on a 2-core "
                 "CPU",
        "shared": {"model": "small", "workers": 4, "steps": 300, "batch_size": 4,
                   "seq_len": 128, "warmup": 30, "eval_every": 50, "eval_batches": 8,
                   "final_eval_batches": 50, "log_every": 10},
        "methods": {"diloco": {"sync_every": 30}, "noloco": {"sync_every": 30,
                                                             "spread_every": 10},
                    "streaming": {"sync_every": 30, "fragments": 2, "overlap": 1,
                                  "codec": "fp4_e3m0"},
                    "local": {"spread_every": 10}},
    },
    "paper": {
        "about": "close to the papers' smaller runs, for one GPU machine (bring a large "
                 "--corpus): the large model (12 layers, d=768, ~88M parameters at vocab 4096), "
                 "M = 4 workers (add --workers 2 for M = 2), seq 1024, bf16, H = 100, "
                 "Streaming with 4 fragments of 3 layers, τ = 1, α = 0.5, FP4",
        "shared": {"model": "large", "workers": 4, "steps": 8800, "batch_size": 16,
                   "seq_len": 1024, "dtype": "bf16", "lr": 4e-4, "warmup": 1000,
                   "weight_decay": 0.1, "eval_every": 500, "eval_batches": 32,
                   "final_eval_batches": 200, "log_every": 50, "comm_timeout": 1800.0},
        "methods": {"diloco": {"sync_every": 100},
                    "streaming": {"sync_every": 100, "fragments": 4, "overlap": 1,
                                  "mixing": 0.5, "codec": "fp4_e3m0"},
                    "noloco": {"sync_every": 100, "group_size": 2, "spread_every": 100},
                    "local": {"spread_every": 100}},
    },
}

LABEL = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


@dataclass
class Method:
    label: str  # its run directory and its key in compare.json
    algorithm: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_methods(text: str | list) -> list[Method]:
    """``ddp,diloco,s8=streaming``: algorithm names, or ``label=algorithm`` for a second run of
    an algorithm with other options."""
    items = text if isinstance(text, list) else str(text).split(",")
    methods = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        label, _, algorithm = item.partition("=") if "=" in item else (item, "", item)
        label, algorithm = label.strip(), algorithm.strip()
        if algorithm not in ALGORITHM_NAMES:
            raise ConfigError("algorithms", f"unknown method {algorithm!r}; choose from "
                              f"{', '.join(ALGORITHM_NAMES)} (or LABEL=METHOD)")
        if not LABEL.match(label):
            raise ConfigError("algorithms", f"label {label!r} must be lower-case letters, "
                              "digits, '-' or '_', starting with a letter")
        if any(m.label == label for m in methods):
            raise ConfigError("algorithms", f"{label!r} is listed twice; name a second run "
                              f"LABEL={algorithm}")
        methods.append(Method(label, algorithm))
    if not methods:
        raise ConfigError("algorithms", "name at least one method")
    return methods


def method_option(method: Method, option: str, value: Any, source: str) -> None:
    """Set one per-method option, refusing what would make the comparison unfair or means
    nothing to that method."""
    by_name = {f.name: f for f in TrainConfig.fields()}
    name = option.replace("-", "_")
    where = f"{source} {method.label}.{option}"
    if name not in by_name or name == "algorithm":
        raise ConfigError("set", f"{where}: unknown option {option!r} (see loco train --help)")
    if name in SHARED:
        raise ConfigError("set", f"{where}: --{option.replace('_', '-')} must be the same for "
                          "every method (same model, data, seed and token budget); give it "
                          "once, without a method")
    allowed = ONLY_FOR.get(name)
    if allowed and method.algorithm not in allowed:
        raise ConfigError("set", f"{where}: --{name.replace('_', '-')} does not apply to "
                          f"{method.algorithm} (only to {', '.join(allowed)})")
    try:
        method.options[name] = coerce(by_name[name], value)
    except ConfigError as e:
        raise ConfigError("set", f"{where}: {e}") from None


def parse_sets(items: list[str], methods: list[Method]) -> None:
    """``--set LABEL.OPTION=VALUE`` (VALUE is read as YAML: 4, 0.5, true, fp32)."""
    by_label = {m.label: m for m in methods}
    for item in items:
        key, eq, raw = item.partition("=")
        label, dot, option = key.strip().partition(".")
        if not (eq and dot and option):
            raise ConfigError("set", f"{item!r} must look like LABEL.OPTION=VALUE, e.g. "
                              "streaming.fragments=4")
        if label not in by_label:
            raise ConfigError("set", f"{item!r}: no method {label!r} in --algorithms "
                              f"({', '.join(by_label)})")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        option = RENAMED.get(option.replace("-", "_"), option)
        method_option(by_label[label], option, value, "--set")


@dataclass
class Plan:
    out: str
    methods: list[Method]
    configs: list[TrainConfig]  # validated and resolved, one per method
    preset: str | None
    warnings: list[str]


def plan(shared: dict[str, Any], algorithms: str | list | None = None,
         sets: list[str] | None = None, preset: str | None = None,
         config_file: str | None = None) -> Plan:
    """Every method's configuration, checked before anything trains. ``shared``: options
    given as flags, for every method."""
    from loco.config import warnings_for
    from loco.train import prepare_config

    values: dict[str, Any] = {}
    per_method: list[tuple[str, dict, str]] = []  # (algorithm or label, options, source)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)} (got {preset!r})")
        values.update(PRESETS[preset]["shared"])
        per_method += [(k, v, f"preset {preset}:") for k, v in PRESETS[preset]["methods"].items()]
    if config_file:
        data = load_yaml(config_file, extra=("algorithms", "methods"))
        algorithms = data.pop("algorithms", None) if algorithms is None else algorithms
        extra = data.pop("methods", None) or {}
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise ConfigError("config", f"{config_file}: 'methods' must map a method label to "
                              "a mapping of option: value")
        values.update(data)
        per_method += [(k, v, f"{config_file}:") for k, v in extra.items()]
    if "algorithm" in shared:
        raise ConfigError("algorithm", "loco compare takes --algorithms (a list)")
    values.update(shared)
    methods = parse_methods(algorithms if algorithms is not None
                            else ",".join(DEFAULT_ALGORITHMS))
    for key, options, source in per_method:
        targets = [m for m in methods if m.label == key or (m.algorithm == key and
                                                           source.startswith("preset"))]
        if not targets and not source.startswith("preset"):
            raise ConfigError("config", f"{source} 'methods' names {key!r}, which is not in "
                              f"--algorithms ({', '.join(m.label for m in methods)})")
        for m in targets:
            for option, value in options.items():
                method_option(m, option, value, source)
    parse_sets(sets or [], methods)

    by_name = {f.name: f for f in TrainConfig.fields()}
    values = {k: coerce(by_name[k], v) for k, v in values.items()}
    if values.get("resume"):
        raise ConfigError("resume", "loco compare starts fresh runs; continue one method's "
                          "run with loco train --resume OUT/LABEL, then loco report OUT")
    from loco.runtime import under_torchrun

    if values.get("launcher") == "torchrun" or under_torchrun():
        raise ConfigError("launcher", "loco compare runs its methods one after another in "
                          "this process (threads or processes); under torchrun, run loco "
                          "train once per method and then loco report on their directories")
    out = values.pop("out", None) or os.path.join(
        "runs", f"compare-{datetime.now():%Y%m%d-%H%M%S}")
    configs, warnings = [], []
    for m in methods:
        cfg = TrainConfig(**{**values, **m.options, "algorithm": m.algorithm,
                             "out": os.path.join(out, m.label), "progress": False})
        try:
            cfg = prepare_config(cfg)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
        warnings += [f"{m.label}: {w}" for w in warnings_for(cfg)]
        if os.path.exists(os.path.join(cfg.out, "summary.json")):
            raise ConfigError("out", f"{out} already holds a finished run {m.label!r}; choose "
                              "another --out (nothing is overwritten)")
        configs.append(cfg)
    if preset == "paper":
        import torch

        if not torch.cuda.is_available():
            warnings.append("--preset paper is sized for a GPU machine; on this CPU it "
                            "would take days")
    return Plan(out, methods, configs, preset, warnings)


class MethodError(ConfigError):
    """A method's configuration is bad: the message names the method and the option."""

    def __init__(self, label: str, error: ConfigError):
        ValueError.__init__(self, f"method {label!r}: {error}")
        self.option = error.option


def run(p: Plan, progress: bool = True) -> dict[str, dict]:
    """Train every method of the plan, one after another, then write the report. Returns
    ``compare.json``'s contents."""
    from tqdm import tqdm

    from loco.report import load_run, order_key, write_report
    from loco.train import check_fits, human_bytes, launch_training, prepare_data

    for w in p.warnings:
        print(f"loco compare: warning: {w}", file=sys.stderr)
    first = p.configs[0]
    corpus = prepare_data(dataclasses.replace(first, progress=progress))
    for m, cfg in zip(p.methods, p.configs):
        try:
            check_fits(cfg, corpus)
        except ConfigError as e:
            raise MethodError(m.label, e) from None
    os.makedirs(p.out, exist_ok=True)
    steps = first.steps
    bar = tqdm(total=steps * len(p.configs), unit="step", disable=not progress,
               dynamic_ncols=True)
    runs = []
    for i, (m, cfg) in enumerate(zip(p.methods, p.configs)):
        bar.set_description(f"[{i + 1}/{len(p.configs)}] {m.label}")
        done = i * steps
        with FollowMetrics(os.path.join(cfg.out, "metrics.jsonl"),
                           lambda rec: _advance(bar, done + rec["step"], rec)):
            summary = launch_training(cfg, corpus)
        _advance(bar, done + steps, {})
        bar.write(f"{m.label}: eval loss {summary['final_eval_loss']:.4f}, sent per worker "
                  f"{human_bytes(summary['bytes_sent_per_worker'])}, "
                  f"{summary['wall_seconds']:.0f} s")
        runs.append(load_run(cfg.out, m.label))
    bar.close()
    return write_report(sorted(runs, key=order_key), p.out)


def _advance(bar, n: int, record: dict) -> None:
    if n > bar.n:
        bar.update(n - bar.n)
    if "train_loss" in record:
        bar.set_postfix(loss=f"{record['train_loss']:.3f}", refresh=False)


class FollowMetrics:
    """Follows a run's ``metrics.jsonl`` from a thread while it trains and calls ``on_record``
    with each new record: the overall progress bar works the same for every launcher,
    whichever process the lead rank lives in."""

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
