"""The training configuration: typed sections of options (``sections``), and the whole
configuration with its loading, defaults and checks (``train_config``): ``cfg.method``,
``cfg.model``, ``cfg.data``, ``cfg.optim``, ``cfg.run``, ``cfg.comm``, ``cfg.runtime``,
``cfg.trust``.

``resume_config`` and ``check_layout`` live in ``loco.checkpoint.resume``; their names here
are kept for code that imports them from ``loco.config``, and load that module on first use
(nothing in this package uses them).
"""

from loco.config.train_config import (
    RENAMED,
    SECTIONS,
    TrainConfig,
    build_config,
    canonical,
    choices,
    coerce,
    load_yaml,
    method_section,
    model_dims,
    profile_steps,
    resolve,
    steps_for_tokens,
    validate,
    validate_model,
    warnings_for,
)
from loco.config.sections import (
    DEFAULT_STEPS,
    DTYPES,
    LAUNCHER_NAMES,
    LAYOUT,
    NONFINITE,
    RESUMABLE,
    ROUTINGS,
    WORKER_PARALLEL,
    algorithm_names,
    betas,
    duration_seconds,
    worker_speeds,
)
from loco.lazy import lazy_exports
from loco.options import ConfigError

__all__ = ["ConfigError", "DEFAULT_STEPS", "DTYPES", "LAUNCHER_NAMES", "LAYOUT", "NONFINITE",
           "RENAMED", "RESUMABLE", "ROUTINGS", "SECTIONS", "TrainConfig", "WORKER_PARALLEL",
           "algorithm_names", "betas", "build_config", "canonical", "check_layout", "choices",
           "coerce", "duration_seconds", "load_yaml", "method_section", "model_dims", "profile_steps", "resolve", "resume_config",
           "steps_for_tokens", "validate", "validate_model", "warnings_for", "worker_speeds"]

__getattr__, __dir__ = lazy_exports(__name__, {"check_layout": "loco.checkpoint.resume",
                                               "resume_config": "loco.checkpoint.resume"})
