"""``loco plan``: each rank's state by part, the bytes each method sends per sync, per step
and per run, and the compute utilization its link allows, before anything is launched.

Modules: ``dryrun`` (one rank's dry run: the run's own code on the meta device over a
loopback transport), ``planner`` (the plan, under ``summary.json``'s keys), ``simulated``
(the simulator fed with the measured traffic), ``text`` (the plan for people).
"""

from loco.plan.planner import RUN_KEYS, plan
from loco.plan.text import format_plan

__all__ = ["RUN_KEYS", "format_plan", "plan"]
