"""Runtime: start the ranks (threads, local processes, torchrun) and give each its context;
pipeline stages across the ranks of a worker, with fixed or random routing; FSDP2 over the
ranks of one worker."""

from loco.lazy import old_names
from loco.runtime.context import Mesh, RankContext, WorkerError
from loco.runtime.elastic import Elastic
from loco.runtime.fsdp import shard_worker
from loco.runtime.launch import LAUNCHERS, launch, under_torchrun
from loco.runtime.pipeline import (
    ROUTINGS,
    PipelineStage,
    StageModule,
    routing_path,
    routing_permutation,
    split_stages,
    stage_bounds,
)

__all__ = ["LAUNCHERS", "Mesh", "RankContext", "WorkerError", "launch", "under_torchrun",
           "ROUTINGS", "PipelineStage", "StageModule", "routing_path", "routing_permutation",
           "split_stages", "stage_bounds", "shard_worker", "Elastic"]

__getattr__ = old_names(__name__, {"WorkerContext": "RankContext"})
