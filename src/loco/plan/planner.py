"""``loco plan``: what a run of a configuration will hold and send, before it is launched.

Each rank that differs is dry-run ([`dry_run`][loco.plan.dryrun.dry_run]: the run's own code
on the meta device); its memory by part, its operations of one round of H inner steps and
FSDP2's per-step traffic then give the numbers a run's ``summary.json`` reports, under the
same keys, for ``--steps`` inner steps, and the simulator gives the compute utilization of
that traffic on the link.
"""

from __future__ import annotations

import math
import time
from collections import Counter as Tally
from dataclasses import dataclass

from loco.comm.link import LinkSpec
from loco.config import ConfigError, TrainConfig, resolve, validate, validate_model
from loco.plan.dryrun import RankRun, Sync, dry_run
from loco.plan.simulated import Op, default_step_time, utilization

#: The keys of ``summary.json`` a plan predicts for the run's ``--steps`` (``run``).
RUN_KEYS = ("bytes_sent_per_rank", "bytes_received_per_rank", "raw_bytes_per_rank",
            "peak_sync_bytes_per_rank", "syncs", "slow_link_bytes_sent_per_rank",
            "slow_link_bytes_sent_per_worker", "fast_link_bytes_sent_per_rank",
            "fast_link_bytes_sent_per_worker")


def plan(cfg: TrainConfig, step_time: float | None = None) -> dict:
    """The plan of a run of ``cfg``: each rank's state by part, the bytes it sends per sync,
    per step and for the whole run, and the simulated compute utilization on its link.

    Args:
        cfg: the configuration, as ``loco train`` would take it (validated here).
        step_time: seconds of compute per inner step for the simulator, > 0; default None:
            the Streaming DiLoCo paper's step times interpolated by parameter count
            (`default_step_time`).

    Returns:
        A dict for JSON: the layout, ``memory_bytes_per_rank`` (the largest of any rank, by
            part, as ``summary.json`` gives it at the run's end), ``state_bytes_per_rank``, ``per_sync`` (each
            slow-link operation of a round), ``per_step``, ``run`` (``RUN_KEYS`` for
            ``--steps``, as the run's summary will give them, and
            ``bits_per_parameter_per_step``) and ``utilization``.

    Raises:
        ConfigError: a bad option (the same one-line errors as ``loco train``), pipeline
            stages or ``offload`` (not planned), or ``step_time`` not > 0.
    """
    started = time.perf_counter()
    validate(cfg)
    cfg = resolve(cfg)
    if cfg.runtime.stages > 1:
        raise ConfigError("stages", "loco plan does not plan pipeline stages yet; plan one "
                          f"stage (--stages 1) (got {cfg.runtime.stages})")
    if getattr(cfg.method, "offload", False):
        raise ConfigError("offload", "loco plan does not plan an offloaded outer state yet "
                          "(the dry run would allocate it in host memory); plan without "
                          "--offload: the same state, less the host buffer of Δ̄")
    if step_time is not None and not (math.isfinite(step_time) and step_time > 0):
        raise ConfigError("step_time", f"must be a number of seconds > 0 (got {step_time})")
    layers = validate_model(cfg)
    H, T = cfg.method.sync_every, cfg.run.steps
    classes = {}
    for shard, count in rank_classes(cfg).items():
        steady = dry_run(cfg, cfg.data.vocab_size, 2 * H, shard)
        exact = steady if T >= 2 * H else dry_run(cfg, cfg.data.vocab_size, T, shard)
        classes[shard] = RankClass(count, steady, exact)
    lead = classes[0].steady
    out = {"algorithm": cfg.method.algorithm, "title": cfg.method_class.title, "model": cfg.model.name,
           "model_parameters": lead.parameters, "layers": layers, "vocab_size": cfg.data.vocab_size,
           "workers": cfg.runtime.workers, "worker_ranks": cfg.runtime.worker_ranks,
           "worker_parallel": cfg.runtime.worker_parallel, "dtype": cfg.model.dtype, "steps": T,
           "sync_every": H}
    out["memory_bytes_per_rank"] = {k: max(c.exact.memory[k] for c in classes.values())
                                    for k in lead.memory}
    out["state_bytes_per_rank"] = sum(out["memory_bytes_per_rank"].values())
    out["per_sync"] = per_sync(classes, H)
    out["per_step"] = per_step(classes, H)
    out["run"] = run_totals(classes, T, H)
    sent = out["run"]["slow_link_bytes_sent_per_worker"]
    out["run"]["bits_per_parameter_per_step"] = 8 * sent / (lead.parameters * T)
    out["utilization"] = link_utilization(cfg, classes, layers, lead.parameters, step_time)
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


@dataclass
class RankClass:
    """The ranks of a worker that hold alike: how many, and the dry runs of one of them:
    ``steady``, two rounds (2H steps), the second a round as every later one; ``exact``,
    the run's own ``--steps`` (``steady`` itself from 2H steps on: later rounds repeat the
    second)."""

    count: int
    steady: RankRun
    exact: RankRun


def rank_classes(cfg: TrainConfig) -> dict[int, int]:
    """The ranks of a worker that hold different shares, each with how many ranks hold the
    same as it: ``{shard: count}``. One rank: ``{0: 1}``. FSDP2: ranks alike when their
    shards of every parameter (ceil(rows / R) rows, fewer or none at the end) are alike.
    Data-parallel inside: every rank (each owns its own range of the outer state)."""
    R = cfg.runtime.worker_ranks
    if R == 1:
        return {0: 1}
    if cfg.runtime.worker_parallel != "fsdp":
        return dict.fromkeys(range(R), 1)
    from loco.training.build import make_model

    rows = [p.shape[0] if p.dim() else 1
            for p in make_model(cfg, cfg.data.vocab_size, "meta").parameters()]
    signatures = [tuple(max(0, min(math.ceil(n / R), n - r * math.ceil(n / R))) for n in rows)
                  for r in range(R)]
    first = {}
    for r, sig in enumerate(signatures):
        first.setdefault(sig, r)
    counts = Tally(signatures)
    return {r: counts[sig] for sig, r in first.items()}


def _round(log: list[Sync], k: int, H: int) -> list[Sync]:
    """The operations of round ``k`` (its steps (k−1)H+1 to kH; 1: the first) of a log, not
    those of the flush."""
    return [s for s in log if (k - 1) * H < s.issued <= k * H and not s.at_flush]


def over_run(log: list[Sync], ran: int, steps: int, H: int, size) -> int:
    """``size`` of the operations of a run of ``steps`` inner steps, from the log of a dry
    run of ``ran`` steps: the log itself when it ran those steps; else (``ran`` = 2H <
    ``steps``) its two rounds, then the second repeated for the rounds that follow, a part
    of it for a last partial round, and the flush's operations when the run ends with a
    round.

    Args:
        log: the dry run's operations on one link.
        ran: the dry run's inner steps (``steps``, or 2H).
        steps: the run's inner steps.
        H: inner steps per round.
        size: what to add up of a list of operations (``len``: how many).
    """
    if ran == steps:
        return size(log)
    rounds, part = divmod(steps - ran, H)
    second = _round(log, 2, H)
    return (size([s for s in log if not s.at_flush]) + rounds * size(second)
            + size([s for s in second if s.issued - H <= part])
            + (size([s for s in log if s.at_flush]) if part == 0 else 0))


def total(run: RankRun, link: str, field: str, steps: int, H: int) -> int:
    """The sum of ``field`` over a run of ``steps`` inner steps on ``link`` (``over_run``),
    FSDP2's traffic added to the fast link's ``sent_bytes``.

    Args:
        run: a dry run of ``steps`` steps, or of 2H steps when ``steps`` > 2H.
        link: ``"slow"`` or ``"fast"``.
        field: an ``OpRecord`` field (``sent_bytes``, ``recv_bytes``, ``raw_bytes``).
        steps: the run's inner steps.
        H: inner steps per round.
    """
    fsdp = steps * run.fsdp_step_bytes if link == "fast" and field == "sent_bytes" else 0
    return over_run(getattr(run, link), run.steps, steps, H,
                    lambda ops: sum(getattr(s.record, field) for s in ops)) + fsdp


def run_totals(classes: dict[int, RankClass], steps: int, H: int) -> dict:
    """``RUN_KEYS`` for a run of ``steps`` inner steps: a busiest rank's (the largest of any
    rank's), a worker's (its ranks summed), ``syncs`` of rank 0 (worker 0's operations),
    as a run's summary gives them."""
    def by_rank(link: str, field: str = "sent_bytes") -> list[tuple[int, int]]:
        return [(c.count, total(c.exact, link, field, steps, H)) for c in classes.values()]

    sent, fast = by_rank("slow"), by_rank("fast")
    lead = classes[0].exact
    peak = max((s.record.sent_bytes for c in classes.values() for s in c.exact.slow),
               default=0)
    return {"bytes_sent_per_rank": max(n for _, n in sent),
            "bytes_received_per_rank": max(n for _, n in by_rank("slow", "recv_bytes")),
            "raw_bytes_per_rank": max(n for _, n in by_rank("slow", "raw_bytes")),
            "peak_sync_bytes_per_rank": peak,
            "syncs": over_run(lead.slow, lead.steps, steps, H, len),
            "slow_link_bytes_sent_per_rank": max(n for _, n in sent),
            "slow_link_bytes_sent_per_worker": sum(c * n for c, n in sent),
            "fast_link_bytes_sent_per_rank": max(n for _, n in fast),
            "fast_link_bytes_sent_per_worker": sum(c * n for c, n in fast)}


def per_step(classes: dict[int, RankClass], H: int) -> dict:
    """The bytes sent per inner step in a round as every round after the first: on each
    link a busiest rank's and a worker's (FSDP2's traffic on the fast link included)."""
    out = {}
    for link, key in (("slow", "slow_link"), ("fast", "fast_link")):
        rows = [(c.count, sum(s.record.sent_bytes for s in _round(getattr(c.steady, link), 2, H))
                 / H + (c.steady.fsdp_step_bytes if link == "fast" else 0))
                for c in classes.values()]
        out[f"{key}_bytes_sent_per_rank"] = max(n for _, n in rows)
        out[f"{key}_bytes_sent_per_worker"] = sum(c * n for c, n in rows)
    return out


def per_sync(classes: dict[int, RankClass], H: int) -> list[dict]:
    """Every slow-link operation of a round, in issue order: the inner step of the round
    it is sent at (1 to H), the step whose update waits for it (after H: in the next
    round), and its bytes (a busiest rank's, and a worker's: its ranks summed)."""
    rounds = {shard: _round(c.steady.slow, 1, H) for shard, c in classes.items()}
    out = []
    for i, s in enumerate(rounds[0]):
        rows = [(classes[shard].count, ops[i].record.sent_bytes)
                for shard, ops in rounds.items() if i < len(ops)]
        out.append({"op": s.record.op, "step": s.issued, "applied_step": s.waited,
                    "bytes_sent_per_rank": max(n for _, n in rows),
                    "bytes_sent_per_worker": sum(c * n for c, n in rows)})
    return out


def link_utilization(cfg: TrainConfig, classes: dict[int, RankClass], layers: int,
                     params: int, step_time: float | None) -> dict:
    """The simulated compute utilization on the slow link of ``--link-bandwidth`` and
    ``--link-latency`` (unlimited and 0 when not given), with its inputs: each rank on a
    link of its own, as ``loco train`` emulates it, and, for workers of several ranks, the
    worker's ranks sharing one such link."""
    H = cfg.method.sync_every
    spec = LinkSpec.parse(cfg.comm.link_bandwidth, cfg.comm.link_latency) or LinkSpec()
    seconds = step_time if step_time is not None else default_step_time(params)
    rounds = {shard: _round(c.steady.slow, 1, H) for shard, c in classes.items()}
    busiest = max(rounds.values(), key=lambda ops: sum(s.record.sent_bytes for s in ops))
    ops = [Op(s.issued, s.waited, s.record.sent_bytes) for s in busiest]
    out = {"link_bandwidth": cfg.comm.link_bandwidth, "link_latency": cfg.comm.link_latency,
           "step_time": seconds,
           "step_time_from": "--step-time" if step_time is not None else
           "the Streaming DiLoCo paper's step times, interpolated by parameters",
           **utilization(ops, H, cfg.runtime.workers, layers, params, spec.bandwidth, spec.latency,
                         seconds)}
    if cfg.runtime.worker_ranks > 1:  # the worker's ranks on one link: each operation theirs summed
        shared = [Op(s.issued, s.waited, sum(classes[shard].count * ops[i].record.sent_bytes
                                             for shard, ops in rounds.items() if i < len(ops)))
                  for i, s in enumerate(rounds[0])]
        out["compute_utilization_one_link_per_worker"] = utilization(
            shared, H, cfg.runtime.workers, layers, params, spec.bandwidth, spec.latency,
            seconds)["compute_utilization"]
    return out


__all__ = ["RUN_KEYS", "RankClass", "over_run", "per_step", "per_sync", "plan", "rank_classes",
           "run_totals", "total"]
