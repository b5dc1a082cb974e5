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
