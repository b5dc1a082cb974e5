"""Compute utilization against bandwidth: the Streaming DiLoCo paper's per-layer simulator.

CU = compute time / wall time of one worker (workers are identical), simulated as a
discrete-event timeline: a compute stream running the per-layer forward and backward passes
in order, and one FIFO link carrying one ring all-reduce at a time. A layer's (outer)
gradient is reduced once its weight gradient is done; its next forward pass (next step, or
step t+τ+1 with overlap τ) waits for the reduction. Data-parallel reduces every layer every
step, DiLoCo the whole model every H steps, Streaming DiLoCo one of P fragments about every
H/P steps. The table gives, per target CU, the lowest bandwidth that reaches it (bisection on
a log scale: CU never falls as bandwidth grows). The assumptions the paper leaves open are
listed in docs/simulators.md, "Assumptions the paper leaves open".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loco.options import ConfigError

METHODS = ("ddp", "diloco", "streaming", "streaming_overlap", "streaming_overlap_fp4")
"""The simulated methods: data-parallel, DiLoCo, Streaming DiLoCo without overlap, with
overlap τ, and with overlap and FP4 values."""
LABELS = {"ddp": "Data-parallel", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo",
          "streaming_overlap": "Streaming DiLoCo, overlap",
          "streaming_overlap_fp4": "Streaming DiLoCo, overlap, FP4"}

#: Old method names, read for one release: the simulator called DataParallel
#: ``data_parallel`` where ``loco train --algorithm`` says ``ddp``.
OLD_NAMES = {"data_parallel": "ddp"}


def method_name(method: str) -> str:
    """A method's name, an old one (``OLD_NAMES``) read as the current one with a
    DeprecationWarning."""
    if method in OLD_NAMES:
        warnings.warn(f"method {method!r} is now {OLD_NAMES[method]!r} (as loco train's "
                      "--algorithm); the old name goes in the next release",
                      DeprecationWarning, stacklevel=3)
    return OLD_NAMES.get(method, method)
STYLES = {"diloco": {"linestyle": "--", "zorder": 3}}
PATTERNS = ("strided", "sequential")
"""How layers are grouped into Streaming fragments: strided (layer i in fragment i % P, the
paper's choice and the default) or sequential (contiguous runs)."""
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
"""The compute utilizations the table finds the bandwidth for, by default."""
WARMUP_PERIODS = 2
MEASURED_PERIODS = 2


@dataclass(frozen=True)
class ModelSpec:
    """A model as the simulator sees it: its layers, its compute time per step, its size.

    Args:
        name: a label for tables and plots.
        layers: L, the number of layers, an integer >= 1.
        step_time: seconds of compute per training step, finite and > 0.
        params: the parameter count, finite and > 0 (spread evenly over the layers).
    """

    name: str
    layers: int
    step_time: float  # seconds of compute per training step
    params: float

    def describe(self) -> str:
        """One line for tables and plots: layers, step time, parameters."""
        return f"{self.layers} layers, {self.step_time:g} s per step, {self.params:.3g} params"


PRESETS = {"1b": ModelSpec("1b", 24, 0.1, 1e9), "10b": ModelSpec("10b", 48, 0.8, 1e10),
           "100b": ModelSpec("100b", 108, 4.9, 1e11)}
"""The Streaming DiLoCo paper's three models: layers and step times as it gives them."""

PAPER_TABLE4 = {
    "1b": {"ddp": (86.8, 152.6, 184.2, 222.3, 569.0),
           "diloco": (1.4, 6.2, 13.3, 23.3, 86.8),
           "streaming": (1.4, 5.2, 9.1, 16.0, 28.1),
           "streaming_overlap": (1.4, 4.3, 6.2, 9.1, 11.0),
           "streaming_overlap_fp4": (0.4, 0.9, 1.7, 2.0, 3.0)},
    "10b": {"ddp": (104.8, 222.3, 222.3, 268.3, 471.5),
            "diloco": (1.7, 7.5, 16.0, 33.9, 104.8),
            "streaming": (1.7, 5.2, 9.1, 13.3, 19.3),
            "streaming_overlap": (1.7, 3.6, 5.2, 6.2, 7.5),
            "streaming_overlap_fp4": (0.4, 0.9, 1.4, 1.4, 1.7)},
    "100b": {"ddp": (184.2, 323.8, 390.7, 390.7, 471.5),
             "diloco": (3.0, 11.0, 23.3, 49.4, 184.2),
             "streaming": (2.4, 6.2, 9.1, 11.0, 19.3),
             "streaming_overlap": (1.7, 3.6, 4.3, 5.2, 5.2),
             "streaming_overlap_fp4": (0.5, 0.9, 1.1, 1.1, 1.4)},
}
"""Table 4 of the Streaming DiLoCo paper (Douillard et al. 2025, arXiv 2501.18512): the
bandwidth in Gbit/s each method needs for 50, 80, 90, 95 and 99% CU (H = 100, 3-layer
fragments, τ = 1)."""


@dataclass(frozen=True)
class Settings:
    """The method options shared by every model (the flags of ``loco simulate utilization``).

    Args:
        H: inner steps between two syncs of the same parameters (DiLoCo, Streaming), >= 1;
            default 100.
        layers_per_fragment: layers in each Streaming fragment, in [1, layers]; default 3.
            P = ceil(layers / layers_per_fragment).
        overlap: τ, steps of compute a Streaming reduction runs under before it must be
            merged, an integer in [0, H); default 1. loco's trainer needs τ < floor(H/P)
            (one fragment in flight); the simulator also takes larger τ, several fragments
            in flight, as the paper's Figure 9 does.
        bits: bits per value on the wire for every method but the FP4 variant, in
            [1, 64]; default 16.
        fp4_bits: bits per value for ``streaming_overlap_fp4``, in [1, 64]; default 4.
        workers: W, workers in the ring all-reduce, >= 2; default 2.
        latency_s: one-way latency per message in seconds, finite and >= 0; default 0.
        pattern: how layers are grouped into fragments, one of
            [`PATTERNS`][loco.simulate.utilization.PATTERNS]; default ``"strided"``.
    """

    H: int = 100
    layers_per_fragment: int = 3
    overlap: int = 1
    bits: int = 16
    fp4_bits: int = 4
    workers: int = 2
    latency_s: float = 0.0
    pattern: str = "strided"


def fragments(spec: ModelSpec, layers_per_fragment: int) -> int:
    """P, the number of Streaming DiLoCo fragments: ceil(layers / layers_per_fragment).

    Args:
        spec: the model.
        layers_per_fragment: layers in each fragment, an integer >= 1.
    """
    return math.ceil(spec.layers / layers_per_fragment)


def send_offsets(H: int, P: int) -> list[int]:
    """When each fragment is sent: fragment p (0-based) after the inner steps t (from 1)
    with ``t % H == ((p + 1) · H // P) % H``, the schedule of loco's Streaming DiLoCo (P
    distinct steps spread evenly over a round, the last fragment at its end).

    Args:
        H: inner steps per round, an integer >= 1.
        P: fragments, an integer in [1, H].

    Returns:
        P offsets, each in [0, H).
    """
    return [((p + 1) * H // P) % H for p in range(P)]


def smallest_gap(H: int, P: int) -> int:
    """floor(H / P): the fewest inner steps between two consecutive fragment sends of
    [`send_offsets`][loco.simulate.utilization.send_offsets] (the gaps, cyclically, are
    floor((p+2)H/P) − floor((p+1)H/P), each floor(H/P) or that plus one).

    Args:
        H: inner steps per round, an integer >= 1.
        P: fragments, an integer in [1, H].
    """
    return H // P


def fragment_layers(layers: int, layers_per_fragment: int,
                    pattern: str = "strided") -> list[list[int]]:
    """The layers (0 = the first in the forward pass) of each of the P fragments.

    Args:
        layers: L, an integer >= 1.
        layers_per_fragment: an integer in [1, L]; P = ceil(L / layers_per_fragment).
        pattern: ``"strided"`` (default; layer i goes to fragment i % P, the paper's choice)
            or ``"sequential"`` (contiguous runs of ``layers_per_fragment`` layers, the last
            one holding what is left over).

    Raises:
        ValueError: an unknown ``pattern``.
    """
    P = math.ceil(layers / layers_per_fragment)
    if pattern == "strided":
        return [list(range(p, layers, P)) for p in range(P)]
    if pattern == "sequential":
        return [list(range(p * layers_per_fragment, min(layers, (p + 1) * layers_per_fragment)))
                for p in range(P)]
    raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")


def _integer(value: Any, option: str, low: int, high: int | None = None,
             what: str = "") -> int:
    """``value`` as an int if it is an integer in [low, high]; else a ConfigError."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, np.integer))
          and low <= value and (high is None or value <= high))
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(option, f"must be an integer {bound}{what}, got {value!r}")
    return int(value)


def check(spec: ModelSpec, settings: Settings) -> None:
    """Raise ``ConfigError`` naming the first option outside its range.

    Args:
        spec: the model; ``layers`` an integer >= 1, ``step_time`` and ``params`` finite and
            > 0.
        settings: the method options, in the ranges [`Settings`][loco.simulate.utilization.Settings]
            gives (integers where they count steps, layers, bits or workers; at most H
            fragments; ``overlap`` below H).

    Raises:
        ConfigError: an option out of range (``loco.config.ConfigError``).
    """
    s = settings
    _integer(spec.layers, "layers", 1)
    if not spec.step_time > 0 or math.isinf(spec.step_time):
        raise ConfigError("step_time", f"seconds per step must be finite and > 0, "
                          f"got {spec.step_time}")
    if not spec.params > 0 or math.isinf(spec.params):
        raise ConfigError("params", f"must be finite and > 0, got {spec.params}")
    H = _integer(s.H, "sync_every", 1, what=" (H counts inner steps)")
    _integer(s.layers_per_fragment, "layers_per_fragment", 1, spec.layers,
             f" (the layers of {spec.name})")
    P = fragments(spec, s.layers_per_fragment)
    if P > H:
        raise ConfigError("layers_per_fragment", f"gives P = {P} fragments for {spec.name}, "
                          f"more than H = {H}: every fragment needs its own send step "
                          f"(P <= H); use more layers per fragment or a larger H")
    _integer(s.overlap, "overlap", 0, H - 1,
             f" (tau counts inner steps and must stay below H = {H}, so that a fragment is "
             f"merged before it is sent again)")
    for option in ("bits", "fp4_bits"):
        _integer(getattr(s, option), option, 1, 64)
    _integer(s.workers, "workers", 2, what=" (one worker has nobody to talk to)")
    if not 0 <= s.latency_s < math.inf:
        raise ConfigError("latency", f"seconds must be finite and >= 0, got {s.latency_s}")
    if s.pattern not in PATTERNS:
        raise ConfigError("pattern", f"must be one of {', '.join(PATTERNS)}, got {s.pattern!r}")


@dataclass(frozen=True)
class Plan:
    """One worker's program: compute operations in order and the reductions between them.

    ``issues[i]`` are the reductions issued when operation i ends, ``waits[i]`` those that must
    be done before it starts; ``window`` is the measured range of operations [first, end).
    Consecutive operations with no reduction between them are merged into one (the timeline
    is the same), so an operation may span many layers or whole steps.

    Args:
        durations: seconds of every compute operation, in program order.
        issues: operation index -> indices (into ``transfer_bytes``) of the reductions
            issued when it ends, in issue order.
        waits: operation index -> indices of the reductions that must be done before it
            starts.
        transfer_bytes: the bytes of every reduction.
        window: ``(first, end)``, the operations measured: ``first`` starts the first
            measured step, ``end`` the step after the last.
    """

    durations: list[float]
    issues: dict[int, list[int]]
    waits: dict[int, list[int]]
    transfer_bytes: list[float]
    window: tuple[int, int]


def _layer_graph_plan(spec: ModelSpec, steps: int, window: tuple[int, int],
                      reductions: list[tuple[int, int, int, float]]) -> Plan:
    """The per-layer graph of ``steps`` training steps with ``reductions``.

    Each step is F_0..F_{L−1}, then A_{L−1}, W_{L−1}, ..., A_0, W_0, each a third of the step
    divided by L. A reduction ``(step, layer, wait_step, nbytes)`` is issued when W_layer of
    ``step`` ends, and F_layer of ``wait_step`` waits for it (none if ``wait_step`` >=
    ``steps``). ``window`` is in steps.
    """
    L = spec.layers
    per_step, op = 3 * L, spec.step_time / (3 * L)
    issue_at: dict[int, list[int]] = {}
    wait_at: dict[int, list[int]] = {}
    transfer_bytes = []
    for step, layer, wait_step, nbytes in sorted(
            reductions, key=lambda r: (r[0], L - 1 - r[1])):  # issue order: W_{L-1} first
        k = len(transfer_bytes)
        transfer_bytes.append(nbytes)
        issue_at.setdefault(step * per_step + L + 2 * (L - 1 - layer) + 1, []).append(k)
        if wait_step < steps:
            wait_at.setdefault(wait_step * per_step + layer, []).append(k)
    barriers = {window[0] * per_step, window[1] * per_step}
    busy_steps = {i // per_step for i in (*issue_at, *wait_at, *barriers)}
    durations: list[float] = []
    issues: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    index = {}
    merge = False  # may the next operation join the last one?
    for step in range(steps):
        base = step * per_step
        ops = range(base, base + per_step) if step in busy_steps else (base,)
        duration = op if step in busy_steps else spec.step_time
        for i in ops:
            waited = wait_at.get(i)
            if merge and not waited and i not in barriers:
                durations[-1] += duration
            else:
                durations.append(duration)
                if waited:
                    waits[len(durations) - 1] = waited
            index[i] = len(durations) - 1
            issued = issue_at.get(i)
            if issued:
                issues[len(durations) - 1] = issued
            merge = not issued
    return Plan(durations, issues, waits, transfer_bytes,
                (index[window[0] * per_step], index[window[1] * per_step]))


def data_parallel_plan(spec: ModelSpec, bits: int) -> Plan:
    """Per-layer graph: F_1..F_L, then A_L, W_L, ..., A_1, W_1; layer l's gradient is
    reduced after W_l and the next step's F_l waits for it.

    Args:
        spec: the model.
        bits: bits per value on the wire, in [1, 64].
    """
    steps = WARMUP_PERIODS + MEASURED_PERIODS + 1
    per_layer = spec.params / spec.layers * bits / 8
    reductions = [(s, layer, s + 1, per_layer) for s in range(steps - 1)
                  for layer in range(spec.layers)]
    return _layer_graph_plan(spec, steps, (WARMUP_PERIODS, steps - 1), reductions)


def outer_plan(spec: ModelSpec, H: int, fragment_layers: list[list[int]], overlap: int,
               bits: int) -> Plan:
    """Per-layer graph of H-step rounds with outer reductions (DiLoCo: one fragment holding
    every layer, overlap 0): fragment p is sent at the steps of
    [`send_offsets`][loco.simulate.utilization.send_offsets], one all-reduce per layer issued
    after its weight gradient, waited for by its forward pass in step t+overlap+1.

    Args:
        spec: the model.
        H: inner steps per round, an integer >= 1.
        fragment_layers: the layers of each of the P fragments (P <= H).
        overlap: τ, the steps a reduction runs under before it is merged, in [0, H).
        bits: bits per value on the wire, in [1, 64].
    """
    P = len(fragment_layers)
    sending: dict[int, list[int]] = {}
    for p, offset in enumerate(send_offsets(H, P)):
        sending.setdefault(offset, []).append(p)
    steps = (WARMUP_PERIODS + MEASURED_PERIODS) * H + 1
    per_layer = spec.params / spec.layers * bits / 8
    reductions = [(s, layer, s + overlap + 1, per_layer) for s in range(steps - 1)
                  for p in sending.get((s + 1) % H, ()) for layer in fragment_layers[p]]
    return _layer_graph_plan(spec, steps,
                             (WARMUP_PERIODS * H, (WARMUP_PERIODS + MEASURED_PERIODS) * H),
                             reductions)


@functools.lru_cache(maxsize=128)
def plan_for(method: str, spec: ModelSpec, settings: Settings) -> Plan:
    """The program of one worker for ``method``; cached (a sweep over bandwidths builds it
    once), so the caller must not modify it.

    Args:
        method: one of [`METHODS`][loco.simulate.utilization.METHODS].
        spec: the model.
        settings: the method options (not checked here; see
            [`check`][loco.simulate.utilization.check]).

    Raises:
        ValueError: an unknown ``method``.
    """
    s = settings
    method = method_name(method)
    if method == "ddp":
        return data_parallel_plan(spec, s.bits)
    if method == "diloco":
        return outer_plan(spec, s.H, [list(range(spec.layers))], 0, s.bits)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    layers = fragment_layers(spec.layers, s.layers_per_fragment, s.pattern)
    overlap = 0 if method == "streaming" else s.overlap
    bits = s.fp4_bits if method == "streaming_overlap_fp4" else s.bits
    return outer_plan(spec, s.H, layers, overlap, bits)


def allreduce_seconds(nbytes: float, bandwidth_gbps: float, workers: int,
                      latency_s: float) -> float:
    """Ring all-reduce: 2(W−1) messages of B/W bytes, each paying the latency.

    Args:
        nbytes: B, the bytes reduced.
        bandwidth_gbps: each worker's link in Gbit/s (1e9 bit/s), > 0; ``math.inf``
            allowed.
        workers: W, >= 2.
        latency_s: seconds per message, >= 0.

    Returns:
        ``2(W−1)·latency + 2(W−1)/W·B·8/bandwidth`` seconds.
    """
    hops = 2 * (workers - 1)
    return hops * latency_s + hops / workers * nbytes * 8 / (bandwidth_gbps * 1e9)


def simulate(plan: Plan, bandwidth_gbps: float, workers: int, latency_s: float) -> float:
    """Run the timeline; return compute time / wall time over the measured window, capped
    at the window's compute time / link time (the long-run rate when the link cannot keep
    up, which a large overlap would otherwise push past the window).

    Args:
        plan: one worker's program.
        bandwidth_gbps: each worker's link in Gbit/s, > 0; ``math.inf`` allowed.
        workers: W, workers in the ring all-reduce, >= 2.
        latency_s: seconds per message, >= 0.

    Returns:
        The compute utilization, in (0, 1].
    """
    cost = [allreduce_seconds(b, bandwidth_gbps, workers, latency_s)
            for b in plan.transfer_bytes]
    done = [0.0] * len(cost)
    starts = [0.0] * len(plan.durations)
    now = link_free = 0.0
    for i, duration in enumerate(plan.durations):
        start = max([now] + [done[k] for k in plan.waits.get(i, ())])
        starts[i] = start
        now = start + duration
        for k in plan.issues.get(i, ()):  # FIFO: in issue order, behind the previous one
            link_free = done[k] = max(now, link_free) + cost[k]
    first, end = plan.window
    busy = sum(plan.durations[first:end])
    link = sum(cost[k] for i in range(first, end) for k in plan.issues.get(i, ()))
    return min(1.0, busy / (starts[end] - starts[first]), busy / link if link > 0 else 1.0)


def utilization(method: str, spec: ModelSpec, bandwidth_gbps: float, *, H: int = 100,
                layers_per_fragment: int = 3, overlap: int = 1, bits: int = 16,
                fp4_bits: int = 4, workers: int = 2, latency_s: float = 0.0,
                pattern: str = "strided") -> float:
    """Compute utilization in [0, 1] of ``method`` on ``spec`` with a link of
    ``bandwidth_gbps`` Gbit/s per worker (``math.inf`` allowed).

    Args:
        method: one of [`METHODS`][loco.simulate.utilization.METHODS].
        spec: the model, e.g. ``PRESETS["1b"]``.
        bandwidth_gbps: each worker's link in Gbit/s (1e9 bit/s), > 0; ``math.inf``
            allowed.
        H: inner steps between two syncs of the same parameters, >= 1; default 100.
        layers_per_fragment: layers per Streaming fragment, in [1, layers]; default 3.
        overlap: τ, an integer in [0, H); default 1.
        bits: bits per value on the wire, in [1, 64]; default 16.
        fp4_bits: bits per value of the FP4 variant, in [1, 64]; default 4.
        workers: W, workers in the ring all-reduce, >= 2; default 2.
        latency_s: one-way latency per message in seconds, finite and >= 0; default 0.
        pattern: ``"strided"`` (default) or ``"sequential"`` fragments.

    Raises:
        ConfigError: an option out of range (see [`check`][loco.simulate.utilization.check]).
        ValueError: ``bandwidth_gbps`` <= 0 or an unknown ``method``.
    """
    s = Settings(H, layers_per_fragment, overlap, bits, fp4_bits, workers, latency_s, pattern)
    check(spec, s)
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth must be > 0 Gbit/s, got {bandwidth_gbps}")
    return simulate(plan_for(method, spec, s), bandwidth_gbps, workers, latency_s)


def required_bandwidth(method: str, spec: ModelSpec, target: float, *, rel_tol: float = 1e-6,
                       **settings: Any) -> float:
    """The lowest bandwidth (Gbit/s, to ``rel_tol``) at which ``method`` reaches ``target``
    CU; ``math.inf`` when even an infinite bandwidth does not (latency caps CU).

    Found by bisection on a log scale: CU never falls as the bandwidth grows.

    Args:
        method: one of [`METHODS`][loco.simulate.utilization.METHODS].
        spec: the model.
        target: the compute utilization to reach, in (0, 1).
        rel_tol: relative precision of the result, > 0; default 1e-6.
        **settings: the fields of [`Settings`][loco.simulate.utilization.Settings] (``H``,
            ``layers_per_fragment``, ``overlap``, ``bits``, ``fp4_bits``, ``workers``,
            ``latency_s``, ``pattern``); the defaults for those left out.

    Raises:
        ConfigError: ``target`` or a setting out of range.
    """
    if not 0 < target < 1:
        raise ConfigError("targets", f"each target must be in (0, 1), got {target}")
    s = Settings(**settings)
    check(spec, s)
    plan = plan_for(method, spec, s)

    def cu(bandwidth: float) -> float:
        return simulate(plan, bandwidth, s.workers, s.latency_s)

    if cu(math.inf) < target:
        return math.inf
    hi = 1.0
    while cu(hi) < target:
        hi *= 10
        if hi > 1e18:  # the target is CU's supremum, reached only at infinite bandwidth
            return math.inf
    lo = hi / 10
    while cu(lo) >= target and lo > 1e-18:
        hi, lo = lo, lo / 10
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if cu(mid) < target else (lo, mid)
    return hi


def target_key(target: float) -> str:
    """The key of a target CU in the results: ``f"{target:g}"`` (0.95 -> ``"0.95"``).

    Args:
        target: a compute utilization in (0, 1).
    """
    return f"{target:g}"


def table(specs: dict[str, ModelSpec] | None = None, targets: tuple[float, ...] = TARGETS,
          methods: tuple[str, ...] = METHODS,
          **settings: Any) -> dict[str, dict[str, dict[str, float]]]:
    """``{model: {method: {"0.5": gbps, ...}}}``, the bandwidth each method needs for each
    target CU (``math.inf`` where unreachable); the presets by default.

    Args:
        specs: the models by name; default None ([`PRESETS`][loco.simulate.utilization.PRESETS]).
        targets: compute utilizations, each in (0, 1); default
            [`TARGETS`][loco.simulate.utilization.TARGETS].
        methods: the methods, from [`METHODS`][loco.simulate.utilization.METHODS]; default
            all.
        **settings: the fields of [`Settings`][loco.simulate.utilization.Settings].

    Raises:
        ConfigError: a target or a setting out of range.
    """
    specs = PRESETS if specs is None else specs
    return {name: {m: {target_key(t): required_bandwidth(m, spec, t, **settings)
                       for t in targets} for m in methods}
            for name, spec in specs.items()}


def plot(specs: dict[str, ModelSpec], path: str | Path, bandwidths: np.ndarray | None = None,
         targets: tuple[float, ...] = TARGETS, **settings: Any) -> Path:
    """Draw CU against bandwidth (log axis), one curve per method, one panel per model.

    Needs matplotlib.

    Args:
        specs: the models by name.
        path: the PNG file to write.
        bandwidths: the bandwidths in Gbit/s to evaluate, each > 0; default None (97 points
            from 0.01 to 10^4 Gbit/s).
        targets: target CUs to mark with horizontal lines; default
            [`TARGETS`][loco.simulate.utilization.TARGETS].
        **settings: the fields of [`Settings`][loco.simulate.utilization.Settings].

    Returns:
        ``path``, as a ``Path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = np.logspace(-2, 4, 97) if bandwidths is None else bandwidths
    fig, axes = plt.subplots(1, len(specs), figsize=(5 * len(specs), 4), squeeze=False,
                             sharey=True)
    for ax, (name, spec) in zip(axes[0], specs.items()):
        for method in METHODS:
            cu = [100 * utilization(method, spec, float(b), **settings) for b in bandwidths]
            ax.plot(bandwidths, cu, label=LABELS[method], **STYLES.get(method, {}))
        for t in targets:
            ax.axhline(100 * t, color="grey", linewidth=0.5, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth per worker (Gbit/s)")
        ax.set_title(f"{name}: {spec.describe()}", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("compute utilization (%)")
    axes[0][0].set_ylim(0, 101)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``loco simulate utilization``'s options to ``parser``."""
    parser.add_argument("--model", choices=(*PRESETS, "custom", "all"), default="all",
                        help="model to simulate: a preset of the paper (1b: 24 layers, 0.1 s "
                        "per step; 10b: 48 layers, 0.8 s; 100b: 108 layers, 4.9 s), custom "
                        "(needs --layers, --step-time, --params) or all three presets "
                        "(default: all)")
    parser.add_argument("--layers", type=int, default=None,
                        help="custom model: number of layers; more layers give data-parallel "
                        "finer-grained overlap and Streaming more fragments")
    parser.add_argument("--step-time", type=float, default=None,
                        help="custom model: seconds of compute per training step; longer steps "
                        "hide more communication")
    parser.add_argument("--params", type=float, default=None,
                        help="custom model: parameter count (e.g. 7e9); the bytes every "
                        "reduction sends grow with it")
    parser.add_argument("--sync-every", type=int, default=100, dest="sync_every",
                        help="H: inner steps between two syncs of the same parameters "
                        "(DiLoCo, Streaming); larger H sends fewer bytes per step but lets "
                        "workers drift further apart (default: 100)")
    parser.add_argument("--layers-per-fragment", type=int, default=3,
                        help="layers in each Streaming fragment, P = ceil(layers / this); "
                        "smaller fragments lower the peak bandwidth, not the total bytes "
                        "(default: 3)")
    parser.add_argument("--overlap", type=int, default=1,
                        help="tau: steps of compute a Streaming reduction may run under before "
                        "it must be merged, an integer 0 <= tau < H; hides transfer time at "
                        "the cost of staler fragments. loco's trainer needs tau < floor(H/P) "
                        "(one fragment in flight); larger tau, as in the paper's Figure 9, "
                        "puts several in flight (default: 1)")
    parser.add_argument("--pattern", choices=PATTERNS, default="strided",
                        help="how layers form Streaming fragments: strided (layer i in "
                        "fragment i %% P, the paper's choice) or sequential (contiguous runs) "
                        "(default: strided)")
    parser.add_argument("--bits", type=int, default=16,
                        help="bits per value on the wire for every method but the FP4 variant "
                        "(default: 16)")
    parser.add_argument("--fp4-bits", type=int, default=4,
                        help="bits per value for streaming_overlap_fp4; fewer bits send less "
                        "but quantize the outer gradients more coarsely (default: 4)")
    parser.add_argument("--workers", type=int, default=2,
                        help="W, workers in the ring all-reduce; each sends 2(W-1)/W of the "
                        "bytes and pays 2(W-1) latencies per reduction (default: 2)")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds of one-way latency per message; caps the CU that any "
                        "bandwidth can reach, hardest for data-parallel's per-layer "
                        "reductions (default: 0)")
    parser.add_argument("--targets", default=",".join(target_key(t) for t in TARGETS),
                        help="comma-separated compute utilizations in (0, 1) to find the "
                        "bandwidth for (default: 0.5,0.8,0.9,0.95,0.99)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG of CU against bandwidth, one panel per model, to "
                        "PATH (default: no file is written)")
    parser.add_argument("--json", action="store_true",
                        help="print only {model: {method: {target: Gbit/s}}} as JSON, null "
                        "where unreachable (default: a readable table)")


def _specs(args: argparse.Namespace) -> dict[str, ModelSpec]:
    custom = {"layers": args.layers, "step_time": args.step_time, "params": args.params}
    if args.model != "custom":
        given = [k for k, v in custom.items() if v is not None]
        if given:
            raise ConfigError(given[0], "only applies to --model custom")
        return PRESETS if args.model == "all" else {args.model: PRESETS[args.model]}
    for option, value in custom.items():
        if value is None:
            raise ConfigError(option, "is required with --model custom (with --layers, "
                              "--step-time and --params)")
    return {"custom": ModelSpec("custom", args.layers, args.step_time, args.params)}


def _targets(text: str) -> tuple[float, ...]:
    try:
        targets = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise ConfigError("targets", f"must be comma-separated numbers, got {text!r}") from None
    for t in targets:
        if not 0 < t < 1:
            raise ConfigError("targets", f"each target must be in (0, 1), got {t:g}")
    return targets


def _format(gbps: float) -> str:
    return "unreachable" if math.isinf(gbps) else f"{gbps:.3g}" if gbps < 100 else f"{gbps:.0f}"


def format_table(results: dict[str, dict[str, dict[str, float]]], specs: dict[str, ModelSpec],
                 targets: tuple[float, ...], s: Settings) -> str:
    """The readable table of ``loco simulate utilization``: one block per model.

    Args:
        results: what [`table`][loco.simulate.utilization.table] returned.
        specs: the models by name, as given to ``table``.
        targets: the target CUs, as given to ``table``.
        s: the settings the results were computed with.
    """
    lines = [f"Bandwidth per worker (Gbit/s) needed to reach each compute utilization "
             f"(H={s.H}, {s.layers_per_fragment} layers per fragment, {s.pattern}, "
             f"tau={s.overlap}, "
             f"{s.bits}-bit values, FP4 variant {s.fp4_bits}-bit, ring all-reduce over "
             f"{s.workers} workers, latency {s.latency_s:g} s)"]
    width = max(len(m) for m in METHODS)
    for name, spec in specs.items():
        P = fragments(spec, s.layers_per_fragment)
        gap = smallest_gap(s.H, P)
        gaps = f"{gap}" if s.H % P == 0 else f"{gap} or {gap + 1}"
        lines += ["", f"{name}: {spec.describe()}; Streaming: {P} fragments, one every "
                  f"{gaps} steps"
                  + (f"; tau={s.overlap} >= {gap}: up to {s.overlap // gap + 1} fragments in "
                     f"flight (loco's trainer allows one)" if s.overlap >= gap else ""),
                  f"{'method':<{width}}" + "".join(f"{100 * t:>12g}%" for t in targets)]
        for method, row in results[name].items():
            lines.append(f"{method:<{width}}" + "".join(f"{_format(row[target_key(t)]):>13}"
                                                          for t in targets))
    return "\n".join(lines)


def _plot_range(results: dict[str, dict[str, dict[str, float]]]) -> np.ndarray:
    finite = [v for models in results.values() for row in models.values() for v in row.values()
              if math.isfinite(v)]
    if not finite:
        return np.logspace(-2, 4, 97)
    lo, hi = math.floor(math.log10(min(finite))) - 1, math.ceil(math.log10(max(finite))) + 1
    return np.logspace(lo, hi, 16 * (hi - lo) + 1)


def run(args: argparse.Namespace) -> int:
    """``loco simulate utilization``: print the table (or JSON), write the plot."""
    specs = _specs(args)
    targets = _targets(args.targets)
    s = Settings(args.sync_every, args.layers_per_fragment, args.overlap, args.bits,
                 args.fp4_bits, args.workers, args.latency, args.pattern)
    for spec in specs.values():
        check(spec, s)
    settings = asdict(s)
    results = table(specs, targets, **settings)
    if args.json:
        print(json.dumps({model: {m: {k: None if math.isinf(v) else v for k, v in row.items()}
                                  for m, row in methods.items()}
                          for model, methods in results.items()}, indent=2))
    else:
        print(format_table(results, specs, targets, s))
        if not args.plot:
            print("\n(add --plot PATH to draw CU against bandwidth)")
    if args.plot:
        path = plot(specs, args.plot, _plot_range(results), targets, **settings)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
