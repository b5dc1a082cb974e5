"""loco: training language models across workers that talk rarely and little."""

from loco.algorithms import Algorithm, DataParallel, DiLoCo, Local, StreamingDiLoCo
from loco.comm import Comm
from loco.runtime import Mesh, WorkerContext, WorkerError, launch

__version__ = "0.1.0"

__all__ = ["Algorithm", "Comm", "DataParallel", "DiLoCo", "Local", "Mesh", "StreamingDiLoCo",
           "WorkerContext", "WorkerError", "launch", "__version__"]
