"""Training algorithms; each drops into a plain PyTorch loop in place of ``optimizer.step()``."""

from loco.algorithms.base import Algorithm
from loco.algorithms.data_parallel import DataParallel
from loco.algorithms.diloco import DiLoCo
from loco.algorithms.local import Local
from loco.algorithms.noloco import NoLoCo
from loco.algorithms.streaming_diloco import StreamingDiLoCo

ALGORITHMS = {"ddp": DataParallel, "diloco": DiLoCo, "local": Local, "noloco": NoLoCo,
              "streaming": StreamingDiLoCo}
"""The algorithms by the names the command line uses (``--algorithm``)."""

__all__ = ["ALGORITHMS", "Algorithm", "DataParallel", "DiLoCo", "Local", "NoLoCo",
           "StreamingDiLoCo"]
