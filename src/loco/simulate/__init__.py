"""Simulators that say what each method needs at scale, without training anything:
:mod:`loco.simulate.utilization` (compute utilization against bandwidth, the Streaming DiLoCo
paper's per-layer model) and :mod:`loco.simulate.latency` (NoLoCo's tree all-reduce against
pairwise exchange, and stragglers)."""
