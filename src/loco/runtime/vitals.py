"""A rank's vital signs on disk: the step it is at and its resident memory, written as it
trains. A process killed without a word (the kernel's out-of-memory
killer sends SIGKILL) leaves nothing else behind: the launchers read these files to say at
which step and with how much memory it died, and a rank whose last two runs both ended at
the same step is not trained a third time (it would most likely die there again).

A record is written as each step begins (a small file, replaced atomically: well under a
millisecond), so that the step two deaths are compared by is exact. The files live in
``$LOCO_VITALS_DIR`` (``loco train`` sets it to ``<out>/vitals``), one per
global rank, each replaced atomically; without the variable nothing is written.
"""

from __future__ import annotations

import json
import os
import resource
import signal

DIR_ENV = "LOCO_VITALS_DIR"
"""Environment variable naming the directory of the vitals files."""


class RepeatedDeath(RuntimeError):
    """A rank's last two runs both ended at the same step: it is not trained again."""


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (``/proc/self/statm``; where there is
    none, the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


#: Allocations at least this large get pages of their own from the kernel (glibc's mmap
#: threshold), which go back to it when the tensor is freed.
MMAP_THRESHOLD = 1 << 20
#: Parameters of at least this many bytes make a model large (:func:`return_freed_memory`).
LARGE_MODEL_BYTES = 256 << 20


def return_freed_memory() -> bool:
    """Make freed tensors' memory go back to the kernel (glibc; elsewhere nothing is done).

    glibc serves a block from its heap, where a freed block stays resident, unless it is
    above the mmap threshold; by default that threshold rises to the size of any mmapped
    block freed, up to 32 MiB, so that after the first step a large model's per-layer
    tensors (gradients, temporaries, activations) come from the heap, and their freed pages
    stay resident and fragment it (0.6 GB more at ``--model 300m``, docs/memory.md). A fixed
    threshold of ``MMAP_THRESHOLD`` keeps every large tensor in pages of its own; the cost
    is a page fault for each page of each new tensor, which a small model's fast steps feel
    (15% slower at ``--model small``) and a large model's do not (5%): call it only for
    models of at least ``LARGE_MODEL_BYTES`` of parameters, before their gradients and
    optimizer state are allocated. Idempotent.

    Returns:
        Whether the threshold was set (False off glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # <malloc.h>; setting it also turns the dynamic threshold off
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD))


def vitals_path(directory: str | None, rank: int) -> str | None:
    """The vitals file of global rank ``rank`` in ``directory`` (None: none)."""
    return None if not directory else os.path.join(directory, f"rank{rank:05d}.json")


def read_vitals(directory: str | None, rank: int) -> dict | None:
    """The last record a rank wrote, or None (none, or unreadable).

    Args:
        directory: the vitals directory (None: none).
        rank: the rank's global rank.
    """
    path = vitals_path(directory, rank)
    try:
        with open(path) as f:
            return json.load(f)
    except (TypeError, OSError, ValueError):
        return None


class Vitals:
    """What one rank writes: its step and resident memory, and the step its previous run
    ended at (read when it starts).

    Args:
        directory: where the files are (None: write nothing).
        rank: this process's global rank.
    """

    def __init__(self, directory: str | None, rank: int):
        self.path, self.rank = vitals_path(directory, rank), rank
        self.before = read_vitals(directory, rank) if directory else None
        """The record the previous run of this rank left (None on a first run)."""

    def check_restart(self, restarts: int) -> None:
        """Refuse to train a restarted rank whose last two runs ended at the same step.

        Args:
            restarts: how many times this rank's process was restarted.

        Raises:
            RepeatedDeath: saying the step and the memory it held.
        """
        before = self.before
        if restarts > 0 and before is not None and before.get("previous_end") == before["step"]:
            raise RepeatedDeath(
                f"rank {self.rank} died at step {before['step']} in each of its last two "
                f"runs, with {before['rss_bytes'] / 1e9:.1f} GB resident the last time: out "
                "of memory? Not restarted again (fewer workers per machine, a smaller "
                "--batch-size or --offload need less)")

    def note(self, step: int) -> None:
        """Record ``step`` and the memory now (nothing without a directory).

        Args:
            step: the step this rank begins (0 before the first).
        """
        if self.path is None:
            return
        record = {"step": step, "rss_bytes": resident_bytes(), "pid": os.getpid(),
                  "previous_end": None if self.before is None else self.before["step"]}
        tmp = f"{self.path}.tmp"
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)


def death_note(exitcode: int | None, record: dict | None) -> str:
    """What a rank's exit code and last vitals say about its death, for an error message:
    for SIGKILL, its last known step and memory and "out of memory?"; else ''.

    Args:
        exitcode: the process's exit code (negative: the signal that killed it).
        record: its last vitals record, or None.
    """
    if exitcode != -signal.SIGKILL:
        return ""
    where = ("" if record is None else f" at step {record['step']} with "
             f"{record['rss_bytes'] / 1e9:.1f} GB resident (last seen)")
    return (f"killed by SIGKILL{where}: out of memory? (the kernel's out-of-memory killer "
            "sends SIGKILL; `dmesg` names its victims)")


__all__ = ["DIR_ENV", "LARGE_MODEL_BYTES", "MMAP_THRESHOLD", "RepeatedDeath", "Vitals",
           "death_note", "read_vitals", "resident_bytes", "return_freed_memory",
           "vitals_path"]
