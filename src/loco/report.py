"""Side-by-side reports of finished runs: ``report.md``, ``compare.json`` and plots.

Everything here is a function of the run directories on disk (each with ``summary.json`` and
``metrics.jsonl``), so ``loco report DIR...`` re-renders exactly what ``loco compare`` wrote,
without training. No torch import: reports render anywhere matplotlib does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from loco.config import ConfigError

#: Report order, and the methods' names as the papers write them.
METHODS = {"ddp": "DataParallel", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo",
           "noloco": "NoLoCo", "local": "Local"}
#: Options that are the same for every method of a comparison and not worth repeating per
#: method in the settings; ``out`` and ``progress`` say nothing about the run.
NOT_SETTINGS = {"out", "progress", "algorithm"}
#: Bits per value of each wire format of ``loco.comm.codecs``, scales excluded; the 8- and
#: 4-bit ones add one scale byte per ``codec_block`` values. Written out here because reports
#: do not import torch; a test holds it to the codecs' own byte counts.
CODEC_BITS = {"fp32": 32, "bf16": 16, "fp8_e4m3": 8, "int8": 8, "fp4_e3m0": 4, "fp4_e2m1": 4}


def codec_compression(codec: str, block: int = 32) -> float:
    """How many times fewer bytes than fp32 a wire format sends per value, its scales
    included: ``32 / (bits + 8 / block)`` (1 for fp32, 2 for bf16, 7.53 for FP4 at block 32).

    Args:
        codec: a codec name, a key of ``CODEC_BITS``.
        block: values per scale byte of the 8- and 4-bit codecs, >= 1; default 32; ignored
            for fp32 and bf16.

    Returns:
        The compression factor against fp32, >= 1.

    Raises:
        KeyError: an unknown codec.
    """
    bits = CODEC_BITS[codec]
    return 32 / (bits + 8 / block) if bits < 16 else 32 / bits


@dataclass
class Run:
    """A finished run directory."""

    label: str
    path: str
    summary: dict
    records: list[dict]

    @property
    def algorithm(self) -> str:
        return self.summary["algorithm"]

    @property
    def name(self) -> str:
        """The method's display name: the paper's when the label is the algorithm's own."""
        if self.label == self.algorithm:
            return METHODS.get(self.algorithm, self.algorithm)
        return f"{self.label} ({METHODS.get(self.algorithm, self.algorithm)})"


def load_run(path: str, label: str | None = None) -> Run:
    summary_path = os.path.join(path, "summary.json")
    try:
        with open(summary_path) as f:
            summary = json.load(f)
        records = []
        metrics = os.path.join(path, "metrics.jsonl")
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("dirs", f"cannot read the run in {path}: {e}") from None
    if "final_eval_loss" not in summary or "config" not in summary:
        raise ConfigError("dirs", f"{summary_path} is not a loco run summary")
    return Run(label or os.path.basename(os.path.normpath(path)), path, summary, records)


def find_runs(dirs: list[str]) -> list[Run]:
    """Runs in ``dirs``: each is a run directory or a directory of run directories (a
    ``loco compare`` output). Returned in report order: the papers' methods first."""
    runs = []
    for d in dirs:
        if os.path.isfile(os.path.join(d, "summary.json")):
            runs.append(load_run(d))
            continue
        if not os.path.isdir(d):
            raise ConfigError("dirs", f"no such directory: {d}")
        found = sorted(e for e in os.listdir(d)
                       if os.path.isfile(os.path.join(d, e, "summary.json")))
        if not found:
            raise ConfigError("dirs", f"{d} holds no finished run (no summary.json in it or "
                              "in its subdirectories)")
        runs += [load_run(os.path.join(d, e)) for e in found]
    labels = [r.label for r in runs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError("dirs", f"two runs are named {', '.join(twice)}; give run "
                          "directories with different names")
    return sorted(runs, key=order_key)


def order_key(run: Run):
    known = list(METHODS)
    return (known.index(run.algorithm) if run.algorithm in known else len(known),
            run.label != run.algorithm, run.label)


# ------------------------------------------------------------------------------ numbers
def method_setting(run: Run) -> str:
    """The method's own knobs in one short phrase."""
    c = run.summary["config"]
    algo = run.algorithm
    if algo == "ddp":
        return "gradients averaged every step"
    if algo == "local":
        return "no communication"
    text = f"H={c['sync_every']}"
    if algo == "streaming":
        mixing = c.get("mixing", c.get("alpha"))  # runs saved before the rename say alpha
        text += f", P={c['fragments']}, τ={c['overlap']}, α={mixing}, {c['codec']}"
    if algo == "noloco":
        text += f", n={c['group_size']}, γ={c['gamma']}"
    if run.summary.get("stages", 1) > 1:
        text += f", {run.summary['stages']} stages ({run.summary['routing']} routing)"
    return text


def comparison(runs: list[Run], out: str = ".") -> dict[str, dict]:
    """``compare.json``: per run label, its summary plus a ``compare`` entry with the numbers
    relative to DataParallel (and DiLoCo for the peak)."""
    ddp = next((r for r in runs if r.algorithm == "ddp"), None)
    diloco = next((r for r in runs if r.algorithm == "diloco"), None)
    numbers = {}
    for r in runs:
        s = r.summary
        rel = {"label": r.label, "method": r.name, "setting": method_setting(r),
               "run_dir": os.path.relpath(r.path, out), "eval_loss_vs_ddp_pct": None, "ddp_bytes_over_bytes": None,
               "diloco_peak_over_peak": None}
        if ddp is not None:
            base = ddp.summary["final_eval_loss"]
            rel["eval_loss_vs_ddp_pct"] = 100 * (s["final_eval_loss"] - base) / base
            if s["bytes_sent_per_worker"]:
                rel["ddp_bytes_over_bytes"] = (ddp.summary["bytes_sent_per_worker"]
                                               / s["bytes_sent_per_worker"])
        if diloco is not None and s["peak_sync_bytes_per_worker"]:
            rel["diloco_peak_over_peak"] = (diloco.summary["peak_sync_bytes_per_worker"]
                                            / s["peak_sync_bytes_per_worker"])
        numbers[r.label] = {**s, "compare": rel}
    return numbers


def targets(runs: list[Run]) -> list[tuple[str, str, bool]]:
    """The papers' claims checked on these runs: (claim, measured, met)."""
    by = {}
    for r in runs:
        by.setdefault(r.algorithm, r)  # the first run of each algorithm
    rows = []

    def loss_gap(a: str, b: str, limit: float):
        if a in by and b in by:
            la, lb = by[a].summary["final_eval_loss"], by[b].summary["final_eval_loss"]
            gap = 100 * (la - lb) / lb
            rows.append((f"{by[a].name} eval loss within {limit:g}% of {by[b].name}'s",
                         f"{gap:+.2f}%", gap <= limit))

    loss_gap("streaming", "diloco", 2)
    loss_gap("diloco", "ddp", 5)
    loss_gap("noloco", "diloco", 3)
    if "ddp" in by and "streaming" in by:
        sent = by["streaming"].summary["bytes_sent_per_worker"]
        ratio = by["ddp"].summary["bytes_sent_per_worker"] / sent if sent else float("inf")
        rows.append((f"{by['ddp'].name} sends at least 100× the bytes of "
                     f"{by['streaming'].name}", f"{_ratio(ratio)}", ratio >= 100))
    if "diloco" in by and "streaming" in by:
        s = by["streaming"]
        config = s.summary["config"]
        p = config["fragments"]
        peak = s.summary["peak_sync_bytes_per_worker"]
        ratio = by["diloco"].summary["peak_sync_bytes_per_worker"] / peak if peak else float("inf")
        # The claim is about fragments: a 4-bit codec alone makes the peak 7.5x smaller, so
        # its share (DiLoCo sends fp32) is factored out, and what is left must be about P.
        codec = config.get("codec", "fp32")
        squeeze = codec_compression(codec, config.get("codec_block", 32))
        frag = ratio / squeeze
        # What the split allows at best: the whole model against the largest fragment.
        largest = max((f["elements"] for f in s.summary.get("fragments") or []), default=0)
        cap = (f"; the largest fragment allows {_ratio(s.summary['model_parameters'] / largest)}"
               if largest else "")
        rows.append((f"{s.name}'s peak sync about P={p}× below {by['diloco'].name}'s, from "
                     f"the fragments alone", f"{_ratio(frag)} ({_ratio(ratio)} in all, "
                     f"{_ratio(squeeze)} of it from {codec}{cap})", frag >= 0.9 * p))
    return rows


# ------------------------------------------------------------------------------ markdown
def _ratio(x: float | None) -> str:
    if x is None:
        return "–"
    if x == float("inf"):
        return "∞"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}%"


def table(runs: list[Run], numbers: dict[str, dict]) -> list[str]:
    link = any(r.summary.get("link") for r in runs)
    head = ["method", "setting", "final eval loss", "vs DataParallel", "sent / worker (B)",
            "peak sync / worker (B)", "DataParallel ÷ sent", "wall time (s)", "tokens/s"]
    if link:
        head.append("compute utilization")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s, rel = r.summary, numbers[r.label]["compare"]
        row = [r.name, rel["setting"], f"{s['final_eval_loss']:.4f}",
               _pct(rel["eval_loss_vs_ddp_pct"]), f"{s['bytes_sent_per_worker']:,}",
               f"{s['peak_sync_bytes_per_worker']:,}",
               "∞" if rel["eval_loss_vs_ddp_pct"] is not None and not s["bytes_sent_per_worker"]
               else _ratio(rel["ddp_bytes_over_bytes"]),
               f"{s['wall_seconds']:.1f}", f"{s['tokens_per_second']:,.0f}"]
        if link:
            row.append(f"{s['compute_utilization']:.1%}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def settings(runs: list[Run]) -> list[str]:
    """Options shared by every run (as YAML), then those that differ, per method."""
    import yaml

    configs = [r.summary["config"] for r in runs]
    keys = [k for k in configs[0] if k not in NOT_SETTINGS]
    shared = {k: configs[0][k] for k in keys
              if all(c.get(k) == configs[0][k] for c in configs)}
    differ = [k for k in keys if k not in shared]
    lines = ["Shared by every method (`loco train` options):", "", "```yaml",
             yaml.safe_dump(shared, sort_keys=False).rstrip(), "```"]
    if differ:
        lines += ["", "Per method:", "", "| method | " + " | ".join(differ) + " |",
                  "|" + "---|" * (len(differ) + 1)]
        lines += ["| " + " | ".join([r.name] + [str(r.summary["config"].get(k)) for k in differ])
                  + " |" for r in runs]
    return lines


def machine(runs: list[Run]) -> list[str]:
    seen = []
    for r in runs:
        m = r.summary.get("machine")
        if m and m not in seen:
            seen.append(m)
    if not seen:
        return ["Not recorded in these runs' summaries."]
    lines = []
    for m in seen:
        lines.append(f"- {m['hostname']}: {m['cpu']} ({m['cpu_count']} cores)"
                     + (f", {m['accelerator']}" if m.get("accelerator") else ", no accelerator")
                     + f"; {m['platform']}; Python {m['python']}, torch {m['torch']}")
    devices = sorted({r.summary.get("device", "?") for r in runs})
    launchers = sorted({r.summary.get("launcher", "?") for r in runs})
    lines.append(f"- device {', '.join(devices)}; launcher {', '.join(launchers)}")
    return lines


def render_markdown(runs: list[Run], numbers: dict[str, dict], plots: list[str]) -> str:
    first = runs[0].summary
    link = next((r.summary["link"] for r in runs if r.summary.get("link")), None)
    lines = ["# loco compare", "",
             f"{len(runs)} methods on the same job: {first['config']['model']} model "
             f"({first['model_parameters']:,} parameters), {first['workers']} workers, "
             f"{first['inner_steps']} inner steps, {first['tokens']:,} training tokens each, "
             f"seed {first['config']['seed']}"
             + (f"; emulated link {link['bandwidth'] or 'unlimited'}, "
                f"{link['latency'] or '0 ms'} per worker" if link else "") + ".", "",
             "Eval loss: nats/token on held-out text (the global model; for NoLoCo and Local, "
             "replica 0 unless the run ends with the replicas' average). Bytes: sent by the "
             "busiest worker over the run, training traffic only; peak: the largest single "
             "sync. Wall time: the whole run, evaluation included.", ""]
    lines += table(runs, numbers)
    rows = targets(runs)
    if rows:
        lines += ["", "## The papers' claims on this run", "", "| claim | measured | met |",
                  "|---|---|---|"]
        lines += [f"| {claim} | {value} | {'yes' if ok else '**no**'} |"
                  for claim, value, ok in rows]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Settings", ""] + settings(runs)
    lines += ["", "## Machine", ""] + machine(runs)
    lines += ["", "Run directories (metrics.jsonl, summary.json, loss.png): "
              + ", ".join(f"`{numbers[r.label]['compare']['run_dir']}/`" for r in runs) + "."]
    return "\n".join(lines) + "\n"


def write_report(runs: list[Run], out: str) -> dict[str, dict]:
    """Write ``report.md``, ``compare.json`` and the plots into ``out``; return the numbers.
    Files are written whole (temporary file, then rename)."""
    from loco.plot import plot_comparison

    os.makedirs(out, exist_ok=True)
    numbers = comparison(runs, out)
    plots = plot_comparison(runs, out)
    _write(os.path.join(out, "compare.json"), json.dumps(numbers, indent=2) + "\n")
    _write(os.path.join(out, "report.md"), render_markdown(runs, numbers, plots))
    return numbers


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
