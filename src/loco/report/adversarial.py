"""The report's Attacks section: runs with ``--inject`` held against their clean twin, with the
guard and with plain averaging (``loco compare --preset adversarial``, docs/security.md).

An attacked run's clean twin is a run of the same method configured as it is but for
``inject`` (none), ``aggregation`` and ``guard_factor`` (and where it is written); its plain
twin is the same attacked run with ``aggregation: mean``. The claim, per attacked run with a
guard: its final eval loss within ``LIMIT_PCT`` % of the clean twin's, and the attacked
worker named in ``guard.detected`` by a sign that names the attack (``NAMED_BY``).
"""

from __future__ import annotations

import math
from typing import Any

from loco.comm.attacks import Attack, parse_attacks
from loco.report.papers import twin
from loco.report.runs import Run

#: How far (in % of the clean run's final eval loss, either way) an attacked run with the
#: guard may end from its clean twin.
LIMIT_PCT = 3.0

#: The guard's signs (``loco.comm.guard.SIGNS``) that name each kind of attack; ``scale``
#: by a factor below 1 in size is ``low`` instead (see ``expected_signs``). A bit flip is
#: named by whatever it does to the message: a non-finite or outsized value, or a failed
#: MAC with a job key; ``silent`` by any sign.
NAMED_BY = {"scale": ("high",), "noise": ("high",), "nan": ("nonfinite",), "zero": ("low",),
            "stale": ("stale",), "bitflip": ("nonfinite", "high", "low", "mac"),
            "lie-tokens": ("tokens",), "silent": ()}


def expected_signs(attack: Attack) -> tuple[str, ...]:
    """The signs that name ``attack`` (``NAMED_BY``; ``scale=X`` with ``|X| < 1`` is
    ``low``); empty: any sign names it."""
    if attack.kind == "scale" and abs(attack.value) < 1:
        return ("low",)
    return NAMED_BY.get(attack.kind, ())


def attacks_of(run: Run) -> list[Attack]:
    """The attacks injected into ``run`` (its configuration's ``inject``); empty for a
    clean run."""
    return parse_attacks((run.summary.config or {}).get("inject"))


def plain(run: Run) -> bool:
    """Whether ``run`` averaged plainly (``aggregation: mean``: no guard)."""
    return (run.summary.config or {}).get("aggregation") == "mean"


def clean_twin(runs: list[Run], run: Run) -> Run | None:
    """``run``'s clean twin: its method's run without ``inject``, otherwise configured as
    ``run`` is but for ``aggregation`` and ``guard_factor``; None without one."""
    return twin(runs, run, ("aggregation", "guard_factor"), inject=None)


def detections(run: Run) -> list[dict]:
    """``run``'s ``guard.detected`` entries (empty without a guard record)."""
    return list((run.summary.guard or {}).get("detected") or [])


def named(run: Run, attack: Attack) -> list[dict]:
    """The entries of ``guard.detected`` that name ``attack``'s worker by a sign that names
    the attack (``expected_signs``)."""
    signs = expected_signs(attack)
    return [d for d in detections(run)
            if d["worker"] == attack.worker and (not signs or d["sign"] in signs)]


def vs_clean_pct(run: Run, clean: Run) -> float:
    """``run``'s final eval loss against ``clean``'s, in % (NaN where either is not
    finite)."""
    a, b = run.summary.final_eval_loss, clean.summary.final_eval_loss
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or not b:
        return math.nan
    return 100 * (a - b) / b


def attack_entry(runs: list[Run], run: Run) -> dict[str, Any] | None:
    """An attacked run's numbers for ``compare.json`` (its ``compare.attack``); None for a
    clean run.

    Returns:
        ``inject``, ``workers`` and ``kinds`` attacked, ``aggregation``, ``clean`` (the
            clean twin's label, or None), ``clean_loss``, ``vs_clean_pct``, ``named`` (the
            ``guard.detected`` entries that name an attack) and ``met``: for a run with a
            guard, whether it ends within ``LIMIT_PCT`` % of its clean twin with every
            attack named (None without a clean twin, and for a plain run: no claim).
    """
    attacks = attacks_of(run)
    if not attacks:
        return None
    clean = clean_twin(runs, run)
    pct = vs_clean_pct(run, clean) if clean is not None else math.nan
    found = [d for a in attacks for d in named(run, a)]
    every = all(named(run, a) for a in attacks)
    met = (None if plain(run) or clean is None
           else bool(abs(pct) <= LIMIT_PCT and every))
    return {"inject": ",".join(str(a) for a in attacks),
            "workers": sorted({a.worker for a in attacks}),
            "kinds": [a.kind for a in attacks],
            "aggregation": (run.summary.config or {}).get("aggregation"),
            "clean": clean.label if clean is not None else None,
            "clean_loss": clean.summary.final_eval_loss if clean is not None else None,
            "vs_clean_pct": None if math.isnan(pct) else pct, "named": found, "met": met}


def add_attacks(numbers: dict[str, dict], runs: list[Run]) -> None:
    """Add ``compare.attack`` (``attack_entry``) to each attacked run of ``compare.json``'s
    ``numbers`` (in place); clean runs are left as they are."""
    for r in runs:
        entry = attack_entry(runs, r)
        if entry is not None:
            numbers[r.label]["compare"]["attack"] = entry


def loss_cell(run: Run | None, clean: Run | None) -> str:
    """A final eval loss and its ratio to the clean run's: ``5.1234 (×1.004)``; ``–``
    without a run."""
    if run is None:
        return "–"
    loss = run.summary.final_eval_loss
    text = "–" if loss is None else f"{loss:.4f}"
    pct = vs_clean_pct(run, clean) if clean is not None else math.nan
    return text if math.isnan(pct) else f"{text} (×{1 + pct / 100:.3f})"


def detected_cell(run: Run) -> str:
    """What the guard named in ``run``: ``w1 high from step 20 (24 rows)`` per worker and
    sign, joined by ``;``; ``nothing`` where it named nothing."""
    found = detections(run)
    if not found:
        return "nothing"
    return "; ".join(f"w{d['worker']} {d['sign']} from step {d['first_step']} "
                     f"({d['rows']} row{'s' * (d['rows'] != 1)})" for d in found)


def attack_rows(runs: list[Run]) -> list[tuple[Run | None, Run | None, Run | None]]:
    """(clean twin, guarded run, plain twin) per method × attack: each attacked run with a
    guard, with its plain twin where there is one, and each plain attacked run that has no
    guarded twin (guarded None); by the report order of the attacked run's clean twin (or
    of itself without one), then by the attack's kind in ``NAMED_BY``'s order."""
    guarded = [r for r in runs if attacks_of(r) and not plain(r)]
    rows = [(clean_twin(runs, r), r, twin(runs, r, ("guard_factor",), aggregation="mean"))
            for r in guarded]
    paired = {id(p) for _, _, p in rows if p is not None}
    rows += [(clean_twin(runs, r), None, r) for r in runs
             if attacks_of(r) and plain(r) and id(r) not in paired]
    kinds, place = list(NAMED_BY), {id(r): i for i, r in enumerate(runs)}

    def key(row: tuple) -> tuple:
        clean, subject = row[0], row[1] or row[2]
        kind = attacks_of(subject)[0].kind
        return (place[id(clean or subject)], kinds.index(kind) if kind in kinds
                else len(kinds), place[id(subject)])
    return sorted(rows, key=key)


def attacks_section(runs: list[Run]) -> list[str]:
    """The report's Attacks section, as markdown lines: a table of each method × attack
    (clean loss; with the guard, loss × clean and what it detected; with plain averaging,
    loss × clean), the claim per guarded run, and the clean runs' own detections (false
    alarms); empty when no run carries an ``inject``.

    Args:
        runs: the runs, in report order.
    """
    rows = attack_rows(runs)
    if not rows:
        return []
    lines = ["", "## Attacks", "",
             "Each attacked run against its clean twin (the same run without `--inject`): "
             "its final eval loss with the guard and with plain averaging (`--aggregation "
             "mean`), as a ratio to the clean run's, and what the guard named (worker, sign, "
             "first step, rows named over every reducer).", "",
             "| method | attack | clean loss | with the guard (× clean) | detected | "
             "plain mean (× clean) |", "|---|---|---|---|---|---|"]
    for clean, guarded, bare in rows:
        subject = guarded or bare
        name = clean.group_name if clean is not None else subject.method_name
        guard = (f"{guarded.summary.config.get('aggregation')}: " if guarded else "")
        lines.append(f"| {name} | {', '.join(map(str, attacks_of(subject)))} | "
                     f"{loss_cell(clean, None)} | "
                     + (f"{guard}{loss_cell(guarded, clean)}" if guarded else "–") + " | "
                     + (detected_cell(guarded) if guarded else "–") + " | "
                     f"{loss_cell(bare, clean)} |")
    lines += claim_lines(runs, [r for _, r, _ in rows if r is not None])
    lines += false_alarms(runs)
    return lines


def pct_text(pct: float | None) -> str:
    """A gap to the clean run: ``+1.23%``; ``not finite`` for None (a loss that is not)."""
    return "not finite" if pct is None else f"{pct:+.2f}%"


def claim_lines(runs: list[Run], guarded: list[Run]) -> list[str]:
    """The claim per guarded attacked run, as markdown lines: within ``LIMIT_PCT`` % of
    its clean twin and named (``attack_entry``'s ``met``), next to the damage of its plain
    twin (``–`` without one), and how many hold."""
    if not guarded:
        return []
    met_cell = {True: "yes", False: "**no**", None: "– (no clean twin)"}
    lines = ["", f"Claim: with the guard, every attack leaves the final eval loss within "
             f"{LIMIT_PCT:g}% of the clean run and is named in the summary's "
             "`guard.detected` for the attacked worker (scale and noise as `high`, nan as "
             "`nonfinite`, zero as `low`, stale as `stale`, lie-tokens as `tokens`, a bit "
             "flip by any sign but `stale` and `tokens`).", "",
             "| run | vs clean | named | met | without the guard: vs clean |",
             "|---|---|---|---|---|"]
    held = 0
    for r in guarded:
        entry = attack_entry(runs, r)
        bare = twin(runs, r, ("guard_factor",), aggregation="mean")
        damage = attack_entry(runs, bare)["vs_clean_pct"] if bare is not None else None
        signs = sorted({d["sign"] for d in entry["named"]})
        held += entry["met"] is True
        lines.append(f"| {r.label} | {pct_text(entry['vs_clean_pct'])} | "
                     + (", ".join(signs) or "**not named**") + f" | {met_cell[entry['met']]} | "
                     + (pct_text(damage) if bare is not None else "–") + " |")
    lines += ["", f"{held} of {len(guarded)} attacks held to the claim."]
    return lines


def false_alarms(runs: list[Run]) -> list[str]:
    """A sentence on what the guard named in the clean runs that attacked runs are held
    against (an honest worker named), as markdown lines."""
    cleans = {id(c): c for c, _, _ in attack_rows(runs) if c is not None}.values()
    alarms = [f"{c.label}: {detected_cell(c)}" for c in cleans if detections(c)]
    return ["", "In the clean runs the guard named "
            + ("; ".join(alarms) if alarms else "nothing") + "."]
