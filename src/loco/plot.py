"""Plots of a run (matplotlib, drawn off-screen to PNG files)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_losses(records: list[dict], path: str, title: str = "", reference: float | None = None) -> None:
    """Train and eval loss against tokens, as a PNG file.

    Args:
        records: a run's ``metrics.jsonl`` records.
        path: the PNG file to write.
        title: the plot's title.
        reference: a loss drawn as a dashed line (the unigram entropy), or None.
    """
    train = [(r["tokens"], r["train_loss"]) for r in records if "train_loss" in r]
    evals = [(r["tokens"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train loss (worker 0)", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (global model)", lw=1.5)
    if reference is not None:
        ax.axhline(reference, ls="--", c="grey", lw=1, label=f"unigram entropy {reference:.2f}")
    ax.set_xlabel("tokens (all workers)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(runs, out: str) -> list[str]:
    """The side-by-side plots of :mod:`loco.report`, as PNG files in ``out``. A run with
    nothing to show on a plot (no bytes on a log axis, no spread) is left off it and named in
    its legend's title. The runs of one method over several seeds share its colour and its
    one legend entry.

    Args:
        runs: the report's Run objects, in report order.
        out: the directory to write into.

    Returns:
        The file names written.
    """
    written = []

    def series(run, x: str, y: str, positive: bool = False):
        pts = [(r[x], r[y]) for r in run.records if r.get(x) is not None and r.get(y) is not None]
        return [(a, b) for a, b in pts if a > 0 and b > 0] if positive else pts

    def figure(name: str, xlabel: str, ylabel: str, title: str, curves, xlog=False, ylog=False,
               marker=None, steps=False):
        drawn = [(run, pts) for run, pts in curves if pts]
        if not drawn:
            return
        fig, ax = plt.subplots(figsize=(7, 4.2))
        colors: dict[str, str] = {}
        for run, pts in drawn:
            first = run.group_name not in colors  # a method's seeds share its colour
            color = colors.setdefault(run.group_name, f"C{len(colors) % 10}")
            ax.plot(*zip(*pts), marker=marker, ms=3, lw=1.4, color=color,
                    label=run.group_name if first else "_nolegend_",
                    drawstyle="steps-post" if steps else "default")
        missing = list(dict.fromkeys(run.group_name for run, pts in curves if not pts))
        ax.set_xscale("log" if xlog else "linear")
        ax.set_yscale("log" if ylog else "linear")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(title=f"not shown: {', '.join(missing)}" if missing else None, fontsize=8,
                  title_fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{out}/{name}", dpi=120)
        plt.close(fig)
        written.append(name)

    figure("loss_vs_tokens.png", "tokens (all workers)", "eval loss (nats/token)",
           "eval loss against tokens", [(r, series(r, "tokens", "eval_loss")) for r in runs],
           marker="o")
    timed = [(r, series(r, "train_seconds", "eval_loss")) for r in runs]
    if any(pts for _, pts in timed):  # (runs before train_seconds was logged have none)
        figure("loss_vs_time.png", "training seconds (evaluations left out)",
               "eval loss (nats/token)", "eval loss against wall-clock training time", timed,
               marker="o")
    figure("loss_vs_bytes.png", "bytes sent per worker (log)", "eval loss (nats/token)",
           "eval loss against bytes sent (no bytes: not on a log axis)",
           [(r, series(r, "bytes_sent", "eval_loss", positive=True)) for r in runs],
           xlog=True, marker="o")
    figure("bytes_vs_time.png", "seconds since the run started", "bytes sent per worker (log)",
           "cumulative bytes sent against time",
           [(r, series(r, "elapsed", "bytes_sent", positive=True)) for r in runs], ylog=True,
           steps=True)
    spread = [(r, series(r, "tokens", "spread")) for r in runs
              if any("spread" in rec for rec in r.records)]
    figure("spread.png", "tokens (all workers)", "RMS distance of the replicas to their mean",
           "replica spread (methods whose replicas differ)", spread, marker=".")
    participants = [(r, [(rec["step"], len(rec["participants"])) for rec in r.records
                         if rec.get("event") == "elastic_sync"]) for r in runs
                    if any(rec.get("event") == "elastic_sync" for rec in r.records)]
    figure("participants.png", "inner step", "workers in the sync",
           "participants of every committed sync (elastic runs)", participants, marker=".",
           steps=True)
    return written


def plot_sweep(path: str, option: str, ticks: list[tuple[float, str]],
               lines: list[tuple[str, list[tuple[float, float, int]]]],
               references: list[tuple[str, float, int]] | None = None,
               show_bytes: bool = True) -> None:
    """A sweep as the papers' ablation figures draw it: final eval loss against the swept
    value, one line per method and value of the other swept options; with ``show_bytes``, a
    second panel of bytes sent per worker (log axis).

    Args:
        path: the PNG file to write.
        option: the swept option on the x axis (its field name).
        ticks: (x position, label) of every value of ``option``: the values themselves when
            they are numbers, else 0, 1, ... in order.
        lines: (legend label, [(x position, final eval loss, bytes sent per worker), ...]).
        references: (name, final eval loss, bytes) of baselines drawn across both panels,
            the first dashed (DataParallel), the next dotted (Local, which sends nothing and
            so appears on the loss panel only); default: none.
        show_bytes: draw the bytes panel; a line that sends nothing is left off it (log
            axis).
    """
    panels = 2 if show_bytes else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.2), squeeze=False)
    loss_ax = axes[0][0]
    positions = [p for p, _ in ticks]
    numeric = all(isinstance(p, float) for p in positions)
    # Values spanning a decade or more (H, codec blocks) read best on a log axis.
    log_x = numeric and min(positions) > 0 and max(positions) >= 8 * min(positions)
    for label, points in lines:
        points = sorted(points)
        loss_ax.plot([p for p, _, _ in points], [loss for _, loss, _ in points], "o-", ms=4,
                     lw=1.4, label=label)
        if show_bytes:
            sent = [(p, b) for p, _, b in points if b > 0]
            if sent:
                axes[0][1].plot(*zip(*sent), "o-", ms=4, lw=1.4, label=label)
    for (name, loss, sent), style in zip(references or [], ("--", ":", "-.")):
        loss_ax.axhline(loss, ls=style, c="grey", lw=1.2, label=name)
        if show_bytes and sent > 0:
            axes[0][1].axhline(sent, ls=style, c="grey", lw=1.2, label=name)
    for ax in axes[0]:
        if log_x:
            ax.set_xscale("log")
        ax.set_xticks(positions)
        ax.set_xticklabels([t for _, t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(option)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    loss_ax.set_ylabel("final eval loss (nats/token)")
    loss_ax.set_title(f"final eval loss against {option}")
    if show_bytes:
        axes[0][1].set_yscale("log")
        axes[0][1].set_ylabel("bytes sent per worker (log)")
        axes[0][1].set_title(f"bytes sent against {option}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frontier(path: str, methods: list[tuple[str, float, list[float]]]) -> None:
    """The compression frontier: each method's final eval loss against the bits a worker
    sent per parameter per inner step (log axis), the mean over its seeds as a point and
    their range as a bar, and the Pareto frontier (no other method both sends fewer bits and
    reaches a lower loss) as a step line. A method that sends nothing (Local) cannot sit on
    a log axis: it is a dotted line across.

    Args:
        path: the PNG file to write.
        methods: (name, bits per parameter per step, final eval loss of each seed), one per
            method, in report order.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    points = []
    for i, (name, bits, losses) in enumerate(methods):
        mean = sum(losses) / len(losses)
        if bits <= 0:
            ax.axhline(mean, ls=":", c="grey", lw=1.2, label=f"{name} (0 bits)")
            continue
        err = [[mean - min(losses)], [max(losses) - mean]]
        ax.errorbar([bits], [mean], yerr=err, fmt="o", ms=5, capsize=3,
                    color=plt.cm.tab20(i % 20), label=name)
        points.append((bits, mean))
    frontier = pareto(points)
    if len(frontier) > 1:
        ax.plot(*zip(*frontier), drawstyle="steps-post", c="black", lw=1, alpha=0.6,
                label="Pareto frontier")
    ax.set_xscale("log")
    ax.set_xlabel("bits sent per parameter per inner step, per worker (log)")
    ax.set_ylabel("final eval loss (nats/token)")
    ax.set_title("the compression frontier (bars: the seeds' range)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both coordinates (fewer bits and a lower loss),
    by increasing bits.

    Args:
        points: (bits, loss) pairs.
    """
    out: list[tuple[float, float]] = []
    for bits, loss in sorted(points):
        if not out or loss < out[-1][1]:
            out.append((bits, loss))
    return out
