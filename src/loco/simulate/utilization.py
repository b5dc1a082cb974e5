"""Compute utilization against bandwidth: the Streaming DiLoCo paper's per-layer simulator.

Compute utilization (CU) is the time spent computing divided by the wall time. Following
Douillard et al. (2025), each worker runs a dependency graph: the forward pass layer by layer,
then the backward pass in reverse, each layer's backward split into its activation gradient
and its weight gradient. For **data-parallel**, a layer's gradient reduction starts as soon as
its weight gradient is ready and overlaps the rest of the backward pass; the next step's forward
of that layer waits for the reduction. **DiLoCo** reduces the whole model once every H steps,
and the next step waits for it. **Streaming DiLoCo** splits the model into P fragments of
``layers_per_fragment`` layers and reduces one fragment every H/P steps; without overlap the
next step waits for it, with overlap τ the reduction runs under the next τ steps of compute.
**FP4** is Streaming DiLoCo with overlap sending 4-bit values instead of 16-bit ones.

The simulator is a discrete-event timeline with two resources per worker: a compute stream
that runs one operation at a time, in program order, and one network link that carries one
all-reduce at a time, first in first out. An operation starts when the previous one has ended
and every reduction it waits for is done; a reduction starts when the operation that produced
its values has ended and the link is free. Workers are identical, so one worker's timeline is
the whole system's. CU is measured over whole periods (one step for data-parallel, one round of
H steps otherwise) after warm-up periods, from the start of a period's first step to the start
of the first step after the window, so the stalls a round ends with are counted. The table
gives, for each target CU, the lowest bandwidth that reaches it, found by bisection on a log
scale (CU never falls as bandwidth grows: every time in the timeline is a max-plus expression
of transfer times, so it cannot fall as they shrink).

Assumptions the paper leaves open, and how they are chosen here:

1. **Step time split.** Forward is 1/3 of a step, backward 2/3 (≈ 2 FLOPs per parameter per
   token forward, 4 backward); each layer gets an equal share, and its backward is half
   activation gradient, then half weight gradient (the activation gradient first: it is on
   the critical path to the layers below).
2. **Parameters.** The presets use the nominal sizes, 1e9, 1e10 and 1e11 parameters. The
   paper's step times (6·params FLOPs per token at 60% MFU) fold in a batch size and a chip
   count it does not state, so they do not pin the parameter count down; we take the step
   times as given. Non-block parameters (embeddings, head) are spread evenly over the layers,
   so every layer holds params / layers.
3. **All-reduce cost.** A ring among W workers (default W = 2): 2(W−1) sequential messages of
   B/W bytes each, so a reduction of B bytes takes 2(W−1)·latency + 2(W−1)/W·B·8/bandwidth;
   with W = 2 each worker sends exactly B bytes. Bandwidth is each worker's own link, in
   Gbit/s = 1e9 bit/s. The reduced values are ``bits`` wide on the wire (16 by default;
   ``fp4_bits``, 4, for the FP4 variant); the reduction's arithmetic costs nothing.
4. **Data-parallel reductions** are one all-reduce per layer (no bucketing), issued in the
   order the weight gradients are ready; the optimizer update is instantaneous.
5. **Outer reductions** (DiLoCo, Streaming) start once the whole step that ends the inner
   phase has finished (after its inner optimizer step), not per layer, and are applied at a
   step boundary: without overlap the next step waits for them as a whole.
6. **Overlap τ**: a reduction issued after step t must be done before step t+τ+1 starts, i.e.
   it runs under the compute of steps t+1..t+τ; τ = 0 is Streaming without overlap. Later
   reductions queue behind it on the link, and compute stalls only when one is late.
7. **Fragments**: P = ceil(layers / layers_per_fragment); the last fragment holds the layers
   left over. Fragment p (0-based) is reduced after step ceil((p+1)·H/P) − 1 of each round,
   so the gaps are floor or ceil of H/P when P does not divide H, and the last fragment ends
   the round. τ must stay below H/P, as in training.
8. **Unreachable targets**: latency alone caps CU (every reduction costs 2(W−1)·latency even
   at infinite bandwidth); a target above that cap needs ``math.inf`` Gbit/s (``null`` in
   the JSON, "unreachable" in the table).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loco.config import ConfigError

METHODS = ("data_parallel", "diloco", "streaming", "streaming_overlap", "streaming_overlap_fp4")
"""The simulated methods: data-parallel, DiLoCo, Streaming DiLoCo without overlap, with
overlap τ, and with overlap and FP4 values."""
LABELS = {"data_parallel": "Data-parallel", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo",
          "streaming_overlap": "Streaming DiLoCo, overlap",
          "streaming_overlap_fp4": "Streaming DiLoCo, overlap, FP4"}
#: DiLoCo and Streaming without overlap send the same bytes, blocking, so their curves coincide:
#: DiLoCo is drawn dashed on top.
STYLES = {"diloco": {"linestyle": "--", "zorder": 3}}
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


@dataclass(frozen=True)
class Settings:
    """The method options shared by every model (the flags of ``loco simulate utilization``).

    Args:
        H: inner steps between two syncs of the same parameters (DiLoCo, Streaming), >= 1;
            default 100.
        layers_per_fragment: layers in each Streaming fragment, in [1, layers]; default 3.
            P = ceil(layers / layers_per_fragment).
        overlap: τ, steps of compute a Streaming reduction runs under before it must be
            merged, in [0, H/P); default 1.
        bits: bits per value on the wire for every method but the FP4 variant, in
            [1, 64]; default 16.
        fp4_bits: bits per value for ``streaming_overlap_fp4``, in [1, 64]; default 4.
        workers: W, workers in the ring all-reduce, >= 2; default 2.
        latency_s: one-way latency per message in seconds, finite and >= 0; default 0.
    """

    H: int = 100
    layers_per_fragment: int = 3
    overlap: int = 1
    bits: int = 16
    fp4_bits: int = 4
    workers: int = 2
    latency_s: float = 0.0


def fragments(spec: ModelSpec, layers_per_fragment: int) -> int:
    """P, the number of Streaming DiLoCo fragments: ceil(layers / layers_per_fragment).

    Args:
        spec: the model.
        layers_per_fragment: layers in each fragment, >= 1.
    """
    return math.ceil(spec.layers / layers_per_fragment)


def check(spec: ModelSpec, settings: Settings) -> None:
    """Raise ``ConfigError`` naming the first option outside its range.

    Args:
        spec: the model; ``layers`` an integer >= 1, ``step_time`` and ``params`` finite and
            > 0.
        settings: the method options, in the ranges [`Settings`][loco.simulate.utilization.Settings]
            gives (``overlap`` below H/P for this model's P).

    Raises:
        ConfigError: an option out of range (``loco.config.ConfigError``).
    """
    s = settings
    if isinstance(spec.layers, bool) or not isinstance(spec.layers, int) or spec.layers < 1:
        raise ConfigError("layers", f"must be an integer >= 1, got {spec.layers}")
    if not spec.step_time > 0 or math.isinf(spec.step_time):
        raise ConfigError("step_time", f"seconds per step must be finite and > 0, "
                          f"got {spec.step_time}")
    if not spec.params > 0 or math.isinf(spec.params):
        raise ConfigError("params", f"must be finite and > 0, got {spec.params}")
    if s.H < 1:
        raise ConfigError("sync_every", f"H must be >= 1, got {s.H}")
    if not 1 <= s.layers_per_fragment <= spec.layers:
        raise ConfigError("layers_per_fragment", f"must be in [1, {spec.layers}] (the layers "
                          f"of {spec.name}), got {s.layers_per_fragment}")
    period = s.H / fragments(spec, s.layers_per_fragment)
    if not 0 <= s.overlap < period:
        raise ConfigError("overlap", f"tau must be in [0, H/P) = [0, {period:g}) for "
                          f"{spec.name} (P = {fragments(spec, s.layers_per_fragment)} "
                          f"fragments), got {s.overlap}")
    for option in ("bits", "fp4_bits"):
        if not 1 <= getattr(s, option) <= 64:
            raise ConfigError(option, f"must be in [1, 64], got {getattr(s, option)}")
    if s.workers < 2:
        raise ConfigError("workers", f"must be >= 2 (one worker has nobody to talk to), "
                          f"got {s.workers}")
    if not 0 <= s.latency_s < math.inf:
        raise ConfigError("latency", f"seconds must be finite and >= 0, got {s.latency_s}")


@dataclass(frozen=True)
class Plan:
    """One worker's program: compute operations in order and the reductions between them.

    ``issues[i]`` are the reductions issued when operation i ends, ``waits[i]`` those that must
    be done before it starts; ``window`` is the measured range of operations [first, end).

    Args:
        durations: seconds of every compute operation, in program order.
        issues: operation index -> indices (into ``transfer_bytes``) of the reductions
            issued when it ends.
        waits: operation index -> indices of the reductions that must be done before it
            starts.
        transfer_bytes: the bytes of every reduction.
        window: ``(first, end)``, the operations measured.
    """

    durations: list[float]
    issues: dict[int, list[int]]
    waits: dict[int, list[int]]
    transfer_bytes: list[float]
    window: tuple[int, int]


def _link(plan: Plan, after: int, before: int, nbytes: float) -> None:
    k = len(plan.transfer_bytes)
    plan.transfer_bytes.append(nbytes)
    plan.issues.setdefault(after, []).append(k)
    plan.waits.setdefault(before, []).append(k)


def data_parallel_plan(spec: ModelSpec, bits: int) -> Plan:
    """Per-layer graph: F_1..F_L, then A_L, W_L, ..., A_1, W_1; layer l's gradient is
    reduced after W_l and the next step's F_l waits for it.

    Args:
        spec: the model.
        bits: bits per value on the wire.
    """
    L, op = spec.layers, spec.step_time / (3 * spec.layers)
    steps = WARMUP_PERIODS + MEASURED_PERIODS + 1
    per_step = 3 * L
    plan = Plan([op] * (per_step * steps), {}, {}, [],
                (WARMUP_PERIODS * per_step, (steps - 1) * per_step))
    for step in range(steps - 1):
        base = step * per_step
        for l in reversed(range(L)):
            weight_grad = base + L + 2 * (L - 1 - l) + 1
            _link(plan, weight_grad, base + per_step + l, spec.params / L * bits / 8)
    return plan


def outer_plan(spec: ModelSpec, H: int, fragment_layers: list[int], overlap: int,
               bits: int) -> Plan:
    """Step-level graph of H-step rounds: fragment p's reduction is issued after step
    ceil((p+1)·H/P) − 1 of each round and step t+overlap+1 waits for it (DiLoCo: one
    fragment of every layer, overlap 0).

    Args:
        spec: the model.
        H: inner steps per round, >= 1.
        fragment_layers: the layers of each of the P fragments.
        overlap: τ, steps a reduction runs under, in [0, H/P).
        bits: bits per value on the wire.
    """
    P = len(fragment_layers)
    steps = (WARMUP_PERIODS + MEASURED_PERIODS) * H + 1
    plan = Plan([spec.step_time] * steps, {}, {}, [],
                (WARMUP_PERIODS * H, (WARMUP_PERIODS + MEASURED_PERIODS) * H))
    for round_start in range(0, steps - 1, H):
        for p, n_layers in enumerate(fragment_layers):
            t = round_start + math.ceil((p + 1) * H / P) - 1
            if t + overlap + 1 < steps:
                _link(plan, t, t + overlap + 1, spec.params * n_layers / spec.layers * bits / 8)
    return plan


def plan_for(method: str, spec: ModelSpec, settings: Settings) -> Plan:
    """The program of one worker for ``method``.

    Args:
        method: one of [`METHODS`][loco.simulate.utilization.METHODS].
        spec: the model.
        settings: the method options (not checked here; see
            [`check`][loco.simulate.utilization.check]).

    Raises:
        ValueError: an unknown ``method``.
    """
    s = settings
    if method == "data_parallel":
        return data_parallel_plan(spec, s.bits)
    if method == "diloco":
        return outer_plan(spec, s.H, [spec.layers], 0, s.bits)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    P = fragments(spec, s.layers_per_fragment)
    sizes = [min(s.layers_per_fragment, spec.layers - p * s.layers_per_fragment)
             for p in range(P)]
    overlap = 0 if method == "streaming" else s.overlap
    bits = s.fp4_bits if method == "streaming_overlap_fp4" else s.bits
    return outer_plan(spec, s.H, sizes, overlap, bits)


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
    """Run the timeline; return compute time / wall time over the measured window.

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
    return min(1.0, busy / (starts[end] - starts[first]))


def utilization(method: str, spec: ModelSpec, bandwidth_gbps: float, *, H: int = 100,
                layers_per_fragment: int = 3, overlap: int = 1, bits: int = 16,
                fp4_bits: int = 4, workers: int = 2, latency_s: float = 0.0) -> float:
    """Compute utilization in [0, 1] of ``method`` on ``spec`` with a link of
    ``bandwidth_gbps`` Gbit/s per worker (``math.inf`` allowed).

    Args:
        method: one of [`METHODS`][loco.simulate.utilization.METHODS].
        spec: the model, e.g. ``PRESETS["1b"]``.
        bandwidth_gbps: each worker's link in Gbit/s (1e9 bit/s), > 0; ``math.inf``
            allowed.
        H: inner steps between two syncs of the same parameters, >= 1; default 100.
        layers_per_fragment: layers per Streaming fragment, in [1, layers]; default 3.
        overlap: τ, in [0, H/P); default 1.
        bits: bits per value on the wire, in [1, 64]; default 16.
        fp4_bits: bits per value of the FP4 variant, in [1, 64]; default 4.
        workers: W, workers in the ring all-reduce, >= 2; default 2.
        latency_s: one-way latency per message in seconds, finite and >= 0; default 0.

    Raises:
        ConfigError: an option out of range (see [`check`][loco.simulate.utilization.check]).
        ValueError: ``bandwidth_gbps`` <= 0 or an unknown ``method``.
    """
    s = Settings(H, layers_per_fragment, overlap, bits, fp4_bits, workers, latency_s)
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
            ``latency_s``); the defaults for those left out.

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
                        "it must be merged, 0 <= tau < H/P; hides transfer time at the cost "
                        "of staler fragments (default: 1)")
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
    lines = [f"Bandwidth per worker (Gbit/s) needed to reach each compute utilization "
             f"(H={s.H}, {s.layers_per_fragment} layers per fragment, tau={s.overlap}, "
             f"{s.bits}-bit values, FP4 variant {s.fp4_bits}-bit, ring all-reduce over "
             f"{s.workers} workers, latency {s.latency_s:g} s)"]
    width = max(len(m) for m in METHODS)
    for name, spec in specs.items():
        P = fragments(spec, s.layers_per_fragment)
        lines += ["", f"{name}: {spec.describe()}; Streaming: {P} fragments, one every "
                  f"{s.H / P:.3g} steps",
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
                 args.fp4_bits, args.workers, args.latency)
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
