"""``loco train --profile A-B``: a torch.profiler trace of a few inner steps.

The algorithms mark every phase of a sync with a ``torch.profiler.record_function`` range
(``loco/pseudo_gradient``, ``loco/all_reduce``, ``loco/encode``, ``loco/all_to_all``,
``loco/reduce``, ``loco/all_gather``, ``loco/decode``, ``loco/wait``, ``loco/outer_step``, ``loco/merge``;
``loco/inner_step`` and ``loco/forward_backward`` around the rest of a step);
:class:`StepProfiler` runs a profiler over steps A to B and writes a Chrome trace that
https://ui.perfetto.dev opens. See docs/profiling.md.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, record_function
from tqdm import tqdm

TRACE_DIR = "profile"
"""The run directory's folder that holds the traces."""


def trace_path(out: str, rank: int) -> str:
    """Where the trace of the process whose lead rank is ``rank`` goes:
    ``<out>/profile/trace-rank<rank>.json``."""
    return os.path.join(out, TRACE_DIR, f"trace-rank{rank}.json")


class StepProfiler:
    """Profile inner steps ``first`` to ``last`` (both included) of one process.

    The profiler is per process and sees every thread of it (``profile_all_threads``): the
    training thread's ranges, and those of the communication threads, where a sync's
    encode, all-to-all, reduce, all-gather and decode run. Under the threads launcher every
    rank is a thread of one process, so one rank (rank 0) profiles and its trace holds
    every rank; under the processes launcher and torchrun every rank writes its own. Each
    profiled step is a ``loco/step#N`` range on the profiling thread.

    Args:
        window: ``(first, last)`` inner steps, from
            [`profile_steps`][loco.config.profile_steps]; None: no profiling.
        out: the run directory.
        rank: this rank (the trace's name).
        device: the rank's device (CUDA activities are recorded on a CUDA device).
        enabled: whether this rank profiles (False: every method does nothing).
        announce: what to print when the trace is written: None (default) for nothing, or
            a note after the line that says where it is (``""`` for none).
    """

    def __init__(self, window: tuple[int, int] | None, out: str, rank: int,
                 device: torch.device, enabled: bool = True, announce: str | None = None):
        self.window = window if enabled else None
        self.path = trace_path(out, rank)
        self.device = device
        self.announce = announce
        self._profiler: Any = None
        self._first = 0  # the first step profiled

    def step(self, step: int):
        """A context around one whole step of the loop: starts the profiler at the window's
        first step (or the first step this run trains, if later), marks the step, and stops
        the profiler and writes the trace after the window's last.

        Args:
            step: the inner step about to run.
        """
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return nullcontext()
        return self._profiled(step)

    @contextmanager
    def _profiled(self, step: int):
        if self._profiler is None:
            self._first = step
            self._start()
        with record_function(f"loco/step#{step}"):
            yield
        if step == self.window[1]:  # (not reached when the step raised: see close)
            self._finish(step)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities, record_shapes=False, with_stack=False,
            experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self._profiler.start()

    def _finish(self, last: int) -> None:
        prof, self._profiler = self._profiler, None
        prof.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        if self.announce is not None:
            first = self._first
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            tqdm.write(f"loco: profile of {steps} written to {self.path}{self.announce} (open "
                       "in https://ui.perfetto.dev)", file=sys.stderr)

    def close(self) -> None:
        """Stop a profiler still running (the run failed inside the window); no trace."""
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            prof.stop()
