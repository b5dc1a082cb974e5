"""loco: training language models across workers that talk rarely and little."""

from loco.algorithms import Algorithm, DataParallel, DiLoCo, Local, NoLoCo, StreamingDiLoCo
from loco.comm import Comm
from loco.runtime import Mesh, WorkerContext, WorkerError, launch

__version__ = "0.1.0"

__all__ = ["Algorithm", "Comm", "DataParallel", "DiLoCo", "Local", "Mesh", "NoLoCo",
           "StreamingDiLoCo", "WorkerContext", "WorkerError", "launch", "__version__"]
