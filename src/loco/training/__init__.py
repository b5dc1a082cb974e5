"""The training job: what every launcher runs, in parts, each its own module.

- ``job``: [`run_training`][loco.training.job.run_training], the configuration and data
  it prepares, the launch, and what each rank runs (``train_worker``);
- ``preflight``: the checks of what lies outside the configuration;
- ``build``: a rank's model, optimizer, schedule, algorithm and loader (``setup_worker``);
- ``worker``: what a rank's run is made of (``Rank``) and the loop's running values;
- ``checkpoints``: a worker's checkpoints, taken through ``loco.checkpoint`` when due;
- ``loop``: the steps, their logging and the replicas' spread diagnostic;
- ``hooks``: what a run's options add to the inner step (faults, an emulated speed,
  speed-aware ticks, non-finite settling, an elastic run's token count);
- ``evaluation``: the global model's, the replicas' and their average's losses;
- ``counters``: every rank's bytes, times and memory, gathered at the end;
- ``finish``: the end of the run and the lead rank's summary;
- ``summary``: the summary's typed record (torch-free);
- ``runlog``: the run directory's files; ``errors``: a worker's failure;
- ``emulation``: workers of unequal speed, emulated (``--worker-speed``);
- ``local_steps``: speed-aware local steps (``--local-steps proportional``) and their
  blocks; ``goodput``: the share of the workers' capacity the run turned into progress.

The public names below are imported on first use, so that ``loco.training.summary`` loads
without torch (``seek`` and ``shard_mesh`` are ``loco.checkpoint.state``'s).
"""

from loco.lazy import lazy_exports

_EXPORTS = {
    "run_training": "job", "prepare_config": "job", "prepare_data": "job",
    "launch_training": "job", "check_fits": "job", "train_worker": "job",
    "setup_worker": "build", "make_model": "build", "build_model": "build", "adamw": "build",
    "lr_lambda": "build", "Rank": "worker", "Loop": "worker", "evaluate": "evaluation",
    "replica_report": "evaluation", "seek": "loco.checkpoint.state",
    "shard_mesh": "loco.checkpoint.state",
    "replica_spread": "loop", "blocked_seconds": "counters",
    "write_comm_totals": "counters", "Summary": "summary", "human_bytes": "summary",
    "RunLog": "runlog", "TrainingError": "errors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(
    __name__, {name: module if "." in module else f"loco.training.{module}"
               for name, module in _EXPORTS.items()}, {"Worker": "Rank"})
