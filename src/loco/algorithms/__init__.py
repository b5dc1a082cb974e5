"""Training algorithms; each drops into a plain PyTorch loop in place of ``optimizer.step()``.

Each method is one class and one line below; ``register`` adds one from outside.
"""

from loco.algorithms.base import Algorithm
from loco.algorithms.data_parallel import DataParallel
from loco.algorithms.demo import DeMo
from loco.algorithms.diloco import DiLoCo
from loco.algorithms.local import Local
from loco.algorithms.method import Method, PaperClaim
from loco.algorithms.noloco import NoLoCo
from loco.algorithms.registry import method, methods, register
from loco.algorithms.sparseloco import SparseLoCo
from loco.algorithms.sparta import Sparta, SpartaDiLoCo
from loco.algorithms.streaming_diloco import StreamingDiLoCo

# The report's order: the data-parallel baseline, the papers' methods, no communication.
register(DataParallel)
register(DiLoCo)
register(StreamingDiLoCo)
register(SparseLoCo)
register(NoLoCo)
register(DeMo)
register(Sparta)
register(SpartaDiLoCo)
register(Local)

__all__ = ["Algorithm", "DataParallel", "DeMo", "DiLoCo", "Local", "Method", "NoLoCo",
           "PaperClaim", "SparseLoCo", "Sparta", "SpartaDiLoCo", "StreamingDiLoCo", "method", "methods",
           "register"]
