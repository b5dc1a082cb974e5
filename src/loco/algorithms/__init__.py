"""Training algorithms; each drops into a plain PyTorch loop in place of ``optimizer.step()``."""

from loco.algorithms.base import Algorithm
from loco.algorithms.data_parallel import DataParallel
from loco.algorithms.diloco import DiLoCo
from loco.algorithms.local import Local

#: Names used by the command line.
ALGORITHMS = {"ddp": DataParallel, "diloco": DiLoCo, "local": Local}

__all__ = ["ALGORITHMS", "Algorithm", "DataParallel", "DiLoCo", "Local"]
