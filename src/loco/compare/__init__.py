"""``loco compare``: several methods on the same job, one after another, then a report.

Every method trains the same model on the same data with the same seed and token budget;
only the method and its own knobs differ. Each run keeps its own directory under ``--out``
(``metrics.jsonl``, ``summary.json``, ``loss.png``, ``comm/``), and :mod:`loco.report` writes
``report.md``, ``compare.json`` and the plots from those directories, as ``loco report`` does
later without training.

Option precedence, lowest first: ``loco train``'s defaults, the ``--preset``, the YAML
``--config``, the flags; per method, then, the preset's and the YAML's ``methods:`` entries,
``--set LABEL.OPTION=VALUE`` and, last, the ``--sweep`` values of each grid point.

A sweep (``--sweep OPTION=VALUES``, repeatable) runs every method that a swept option applies
to once per point of the grid (the cartesian product of the options' values), under labels
such as ``streaming[overlap=1,mixing=0.5]``; the report then adds the papers' ablation view:
final eval loss (and bytes) against the swept value, one line per value of the other options.

Several seeds (``--seeds 0,1,2``) run every method (every grid point) once per seed, under
labels such as ``diloco[seed=1]`` or ``streaming[mixing=0.5,seed=2]``: the seed is one more
swept option, the last, that applies to every method. The report then gives each method's
mean over its seeds with their spread, and checks the papers' claims seed by seed.

Modules: ``presets`` (the shared options, ``--preset``), ``methods`` (``--algorithms``,
``--set``), ``sweeps`` (``--sweep``, ``--seeds``), ``planning`` (the checked plan),
``runner`` (training it, then the report).
"""

from loco.compare.methods import (LABEL, Method, MethodError, method_option, parse_methods,
                                  parse_sets)
from loco.compare.planning import Plan, plan
from loco.compare.presets import FEW_OUTER_STEPS, PRESETS, SHARED, only_for
from loco.compare.runner import FollowMetrics, run, wandb_group
from loco.compare.sweeps import (LIST_OPTIONS, MAX_SEEDS, NOT_SWEPT, SWEEP_VALUE, Sweep, expand,
                                 parse_seeds, parse_sweeps, seed_sweep, split_sweep_values,
                                 sweep_label)
from loco.config import algorithm_names

__all__ = ["FEW_OUTER_STEPS", "LABEL", "LIST_OPTIONS", "MAX_SEEDS", "NOT_SWEPT", "PRESETS",
           "SHARED", "SWEEP_VALUE", "FollowMetrics", "Method", "MethodError", "Plan", "Sweep",
           "algorithm_names", "expand", "method_option", "only_for", "parse_methods",
           "parse_seeds", "parse_sets", "parse_sweeps", "plan", "run", "seed_sweep",
           "split_sweep_values", "sweep_label", "wandb_group"]
