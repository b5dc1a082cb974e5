"""Side-by-side reports of finished runs: ``report.md``, ``compare.json`` and plots.

Everything here is a function of the run directories on disk (each with ``summary.json`` and
``metrics.jsonl``), so ``loco report DIR...`` re-renders exactly what ``loco compare`` wrote,
without training. No torch import but through the methods' registry (``loco.algorithms``).

Runs of several seeds (``loco compare --seeds``, labels ending in ``seed=S]``) are reported
per method (per grid point) over their seeds: mean final eval loss ± half the seeds' range,
and the papers' claims checked seed by seed, each run against the run of the same seed.

Modules: ``runs`` (run directories, labels, order), ``seeds`` (runs over seeds), ``numbers``
(``compare.json``), ``papers`` (the papers' claims), ``adversarial`` (the attacked runs
against their clean twins), ``cells``, ``tables`` and ``markdown`` (``report.md``), ``write``
(the files and plots).
"""

from loco.comm.codecs.formats import CODEC_BITS
from loco.report.markdown import claims_table, intro, render_markdown
from loco.report.numbers import (MAIN_METRICS, baseline, codec_compression, comparison,
                                 main_metric, method_setting)
from loco.report.papers import (CHECKS, PAPER_TOKENS_PER_PARAMETER, PLACE, Claim, bytes_claim,
                                claims, loss_claim, mean_spread, peak_claim, reference, regime,
                                routing_claim, targets, twin, verdict)
from loco.report.runs import (SEED_ENTRY, SWEEP_LABEL, Run, find_runs, load_run, order_key,
                              seed_point, sweep_groups, sweep_point, worker_ranks)
from loco.report.seeds import (MEAN_FIELDS, half_range_pct, mean_run, over_seeds, seed_groups,
                               seed_means, seeds_of)
from loco.report.tables import (NOT_SETTINGS, downstream_table, loss_spread, machine, settings,
                                sweep_tables, table)
from loco.report.write import sweep_plots, write_report

__all__ = ["CHECKS", "CODEC_BITS", "MAIN_METRICS", "MEAN_FIELDS", "NOT_SETTINGS",
           "PAPER_TOKENS_PER_PARAMETER", "PLACE", "SEED_ENTRY", "SWEEP_LABEL", "Claim", "Run",
           "baseline", "bytes_claim", "claims", "claims_table", "codec_compression",
           "comparison", "downstream_table", "find_runs", "half_range_pct", "intro",
           "load_run", "loss_claim", "loss_spread", "machine", "main_metric", "mean_run",
           "mean_spread", "method_setting", "order_key", "over_seeds", "peak_claim",
           "reference", "regime", "render_markdown", "routing_claim", "seed_groups",
           "seed_means", "seed_point", "seeds_of", "settings", "sweep_groups", "sweep_plots",
           "sweep_point", "sweep_tables", "table", "targets", "twin", "verdict",
           "worker_ranks", "write_report"]
