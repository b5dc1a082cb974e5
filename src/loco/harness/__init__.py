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

Modules: ``rundir`` (the run directory, its tokenizer), ``weights`` (its models),
``lm`` (the ``TemplateLM``), ``tasks`` (lm-eval's tasks and scores), ``evaluate`` (the
command).
"""

from loco.harness.evaluate import evaluate_run, score_table, write_scores
from loco.harness.lm import eot_token_id, lm_class, make_lm
from loco.harness.rundir import EvalError, RunCheckpoint, load_tokenizer, open_run
from loco.harness.tasks import (OFFLINE_HINT, check_task_data, import_lm_eval, quiet, scores,
                                task_manager)
from loco.harness.weights import replica_model, run_models, stage_tensors

__all__ = ["OFFLINE_HINT", "EvalError", "RunCheckpoint", "check_task_data", "eot_token_id",
           "evaluate_run", "import_lm_eval", "lm_class", "load_tokenizer", "make_lm",
           "open_run", "quiet", "replica_model", "run_models", "scores", "score_table",
           "stage_tensors", "task_manager", "write_scores"]
