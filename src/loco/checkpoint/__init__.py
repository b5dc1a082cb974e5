"""Checkpoints: every rank saves everything it needs to continue, and a run resumes exactly.

One job a module, each using only those listed before it:

- ``staging``: copies of a rank's state that training cannot change (``snapshot``,
  ``Stager``'s reused host buffers, ``compact`` for a write in place);
- ``files``: the on-disk format: one file per rank, a worker's tensors through DCP,
  ``latest.json``, every file whole by rename (``save_rank``, ``save_worker``, ``latest``);
- ``writer``: each rank's writes on a background thread and the lead's commit (``Writer``);
- ``resume``: before a resumed run starts, its configuration and whether its worker layout
  can load the checkpoint (``resume_config``, ``check_layout``);
- ``policy``: when a checkpoint is due (``--checkpoint-every``, ``--checkpoint-interval``)
  and each rank's writer (``--keep-checkpoints``);
- ``state``: what a rank saves, and in a resumed run how it is read back (resharded to
  another R) and put back (``rank_state``, ``resume_state``, ``restore``, ``seek``).

The package sits in the configuration's layer (``resume`` reads a saved ``TrainConfig``) and
below ``loco.training``, which takes the checkpoints of its workers through it.
docs/reliability.md, "Checkpoints", describes the design.
"""

from loco.checkpoint.files import (
    DIRNAME,
    CheckpointError,
    check_files,
    commit,
    discard_uncommitted,
    latest,
    load_rank,
    load_worker,
    read_worker,
    rank_file,
    save_rank,
    save_worker,
    step_dir,
    worker_dir,
)
from loco.checkpoint.resume import check_layout, resume_config
from loco.checkpoint.staging import Stager, compact, map_tensors, snapshot
from loco.checkpoint.writer import Writer, wait_for_ranks

__all__ = ["DIRNAME", "CheckpointError", "Stager", "Writer", "check_files", "check_layout",
           "commit", "compact", "discard_uncommitted", "latest", "load_rank", "load_worker",
           "map_tensors", "read_worker", "rank_file", "resume_config", "save_rank",
           "save_worker", "snapshot", "step_dir", "wait_for_ranks", "worker_dir"]
