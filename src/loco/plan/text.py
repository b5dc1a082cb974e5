"""A plan (`loco.plan.plan`) as ``loco plan`` prints it."""

from __future__ import annotations

from loco.training.summary import human_bytes

#: The most operations of a round listed one by one; more are summarized in one line.
LISTED_SYNCS = 6


def format_plan(p: dict) -> str:
    """The plan for people: the layout, the state of a rank by part, the bytes per sync,
    per step and for the run on each link, and the simulated compute utilization.

    Args:
        p: a plan from [`plan`][loco.plan.plan].
    """
    R = p["worker_ranks"]
    lines = [f"{p['title']} ({p['algorithm']}) on the {p['model']} model: "
             f"{p['model_parameters']:,} parameters, {p['layers']} blocks, vocabulary "
             f"{p['vocab_size']:,}",
             f"{p['workers']} workers x {R} rank{'s' if R > 1 else ''}"
             + (f" ({p['worker_parallel']})" if R > 1 else "") + f", {p['dtype']}; "
             f"H = {p['sync_every']}, {p['steps']:,} inner steps", "",
             "State of a rank by part (summary.json's memory_bytes_per_rank, the largest of "
             "any rank):"]
    width = max(len(k) for k in p["memory_bytes_per_rank"])
    for part, n in [*p["memory_bytes_per_rank"].items(), ("total", p["state_bytes_per_rank"])]:
        lines.append(f"  {part:<{width}}  {human_bytes(n):>9}")
    lines += ["", _slow_header(p), *_syncs(p)]
    step, run = p["per_step"], p["run"]
    lines.append(f"  per step   {_pair(step, 'slow_link', R)} (the mean over a round of "
                 f"H = {p['sync_every']} steps)")
    lines.append(f"  the run    {_pair(run, 'slow_link', R)} in {p['steps']:,} steps; "
                 f"{run['bits_per_parameter_per_step']:.3g} bits per parameter per step")
    if R > 1:
        lines.append(f"Fast link inside a worker: per step {_pair(step, 'fast_link', R)}; the "
                     f"run {_pair(run, 'fast_link', R)}")
    lines += ["", _utilization(p["utilization"], R), f"(planned in {p['seconds']:.1f} s)"]
    return "\n".join(lines)


def _slow_header(p: dict) -> str:
    R = p["worker_ranks"]
    return ("Sent over the slow link between workers" + (
        f" (each of a worker's {R} ranks sends its share; per worker: its ranks summed):"
        if R > 1 else " (per worker):"))


def _pair(d: dict, link: str, R: int) -> str:
    """``X per rank, Y per worker`` (``Y`` alone for workers of one rank)."""
    worker = human_bytes(d[f"{link}_bytes_sent_per_worker"])
    if R == 1:
        return worker
    return f"{human_bytes(d[f'{link}_bytes_sent_per_rank'])} per rank, {worker} per worker"


def _syncs(p: dict) -> list[str]:
    """The operations of one round, one per line (or summarized when there are many)."""
    syncs, R = p["per_sync"], p["worker_ranks"]
    if not syncs:
        return ["  per sync   nothing: the workers never communicate"]
    if len(syncs) > LISTED_SYNCS:
        sizes = sorted(s["bytes_sent_per_worker"] for s in syncs)
        each = human_bytes(sizes[0]) + ("" if sizes[0] == sizes[-1]
                                        else f" to {human_bytes(sizes[-1])}")
        return [f"  per sync   {len(syncs)} operations per round of H = {p['sync_every']} steps, "
                f"{each} each per worker"]
    out = []
    for i, s in enumerate(syncs):
        when = f"after step {s['step']}" + (
            f", applied at step {s['applied_step']}"
            if s["applied_step"] not in (None, s["step"]) else "")
        size = human_bytes(s["bytes_sent_per_worker"]) + (
            f" ({human_bytes(s['bytes_sent_per_rank'])} per rank)" if R > 1 else "")
        out.append(f"  {'per sync' if i == 0 else '':<10} {s['op']} {when}: {size}")
    return out


def _utilization(u: dict, R: int) -> str:
    bandwidth = u["link_bandwidth"]
    link = (f"{'a' if bandwidth else 'an'} {bandwidth or 'unlimited'} link, latency "
            f"{u['link_latency'] or '0 ms'}")
    head = f"Compute utilization (loco simulate utilization's model), each rank on {link}: "
    if u["compute_utilization"] is None:
        return head + f"not simulated: {u['simulated_as']}"
    shared = u.get("compute_utilization_one_link_per_worker")
    return (head + f"{u['compute_utilization']:.1%}"
            + ("" if shared is None else f"; {shared:.1%} if a worker's {R} ranks share one")
            + f"\n  simulated as {u['simulated_as']}; {u['step_time']:.3g} s of compute per "
            f"inner step ({u['step_time_from']})")


__all__ = ["LISTED_SYNCS", "format_plan"]
