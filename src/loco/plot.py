"""Plots of a run (matplotlib, drawn off-screen to PNG files)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_losses(records: list[dict], path: str, title: str = "", reference: float | None = None) -> None:
    """Train and eval loss against tokens; ``reference`` draws the unigram entropy."""
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
    """The side-by-side plots of :mod:`loco.report` (``runs``: its Run objects), as PNG files
    in ``out``; returns their file names. A run with nothing to show on a plot (no bytes on a
    log axis, no spread) is left off it and named in its legend's title."""
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
        for run, pts in drawn:
            ax.plot(*zip(*pts), marker=marker, ms=3, lw=1.4, label=run.name,
                    drawstyle="steps-post" if steps else "default")
        missing = [run.name for run, pts in curves if not pts]
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
    return written
