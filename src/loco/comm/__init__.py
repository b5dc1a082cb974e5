"""Communication: the one interface (:class:`Comm`) through which all algorithms talk."""

from loco.comm.interface import Comm, CommStats, Counter, Handle, OpRecord

__all__ = ["Comm", "CommStats", "Counter", "Handle", "OpRecord"]
