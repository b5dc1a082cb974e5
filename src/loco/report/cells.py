"""How numbers read in the report's table cells."""

from __future__ import annotations

from typing import Any

from loco.report.runs import Run


def ratio_cell(x: float | None) -> str:
    """A ratio: ``1,234×``, ``12.3×``, ``1.23×``; ``∞`` for infinity, ``–`` for none.

    Args:
        x: the ratio, >= 0, or None.
    """
    if x is None:
        return "–"
    if x == float("inf"):
        return "∞"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def pct_cell(x: float | None) -> str:
    """A signed percentage with two decimals (``+1.23%``); ``–`` for none.

    Args:
        x: the percentage, or None.
    """
    return "–" if x is None else f"{x:+.2f}%"


def sent_cell(run: Run) -> str:
    """Bytes sent by the busiest rank (a worker's, for workers of one rank); DataParallel's with its gradients' wire format.

    Args:
        run: a run.
    """
    sent = f"{run.summary.bytes_sent_per_rank:,}"
    wire = run.method.wire(run.summary.config)
    return f"{sent} ({wire})" if wire else sent


def bits_cell(bits: float | None) -> str:
    """Bits per parameter per inner step, to three significant digits; ``–`` where not
    recorded.

    Args:
        bits: [`Summary.bits_per_parameter_per_step`][loco.training.summary.Summary.bits_per_parameter_per_step].
    """
    return "–" if bits is None else "0" if bits == 0 else f"{bits:.3g}"


def link_cell(run: Run, link: str) -> str:
    """Bytes a worker sent over one link, its ranks together; ``–`` where not recorded.

    Args:
        run: a run.
        link: ``slow`` or ``fast``.
    """
    value = getattr(run.summary, f"{link}_link_bytes_sent_per_worker")
    return "–" if value is None else f"{value:,}"


def value_cell(value: Any) -> str:
    """A swept option's value as written on the command line: ``true``/``false`` for booleans.

    Args:
        value: the value, as the run's configuration holds it.
    """
    return "true" if value is True else "false" if value is False else str(value)
