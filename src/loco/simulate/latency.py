"""NoLoCo's latency argument, simulated: a tree all-reduce against a pairwise exchange, and
the cost of stragglers (``loco simulate latency``).

Two Monte Carlo models, numpy only, deterministic for a seed:

- **Message times.** Each message takes ``t_c · exp(σZ − σ²/2)`` (log-normal, mean ``t_c``).
  A tree all-reduce over N workers (a power of two) is ``log2 N`` levels up then down, each
  parent waiting for the slower child; a pair exchange is the tree at N = 2 (``2·t_c`` at
  σ = 0). Ratio = E[tree time] / E[pair time], ``log2 N`` at σ = 0. Latency only: no
  bandwidth, contention or arithmetic.
- **Stragglers.** Inner-step times are log-normal with mean 1 and spread σ_s; an outer step
  of H inner steps waits for the slowest of the group's sums. Slowdown = E[max of the
  group's sums] / H; every outer step starts in sync, a lower bound for NoLoCo's pairs.

One trial is a cluster of ``max(workers)``; each aligned block of N workers is one sample for
N, and the same draws serve every N and H. The assumptions are discussed in
docs/simulators.md, "The model and its assumptions".
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from loco.options import ConfigError

DEFAULT_WORKERS = "4,8,16,32,64,128,256,512,1024"
DEFAULT_SIGMAS = "0,0.25,0.5,1.0"
#: 10% spread of inner-step times: a homogeneous cluster with some jitter from data loading,
#: kernels and the host. An assumption, not a measurement: set --step-sigma for your hardware,
#: or --preset paper-fig5b for the setting of NoLoCo's Figure 5B.
DEFAULT_STEP_SIGMA = 0.1
PRESETS = {"paper-fig5b": {"step_sigma": math.sqrt(0.5)}}
"""Named settings of ``loco simulate latency``. ``paper-fig5b`` is NoLoCo's Figure 5B
(Kolehmainen et al. 2025): inner-step times log-normal with σ² = 0.5, the variance of the
log of a step time (σ_s = √0.5 ≈ 0.707), where the all-reduce/pair slowdown ratio is about
1.2 at H = 100. An explicit ``--step-sigma`` overrides it."""
DEFAULT_SYNC_EVERY = "1,10,50,100,500"
DEFAULT_TRIALS = 100
DEFAULT_SEED = 0
MAX_WORKERS = 65536
MAX_SIGMA = 4.0


# --- validation: every bad value names its option and the allowed range

def _check_workers(n: int, option: str = "workers") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not (
            2 <= n <= MAX_WORKERS and n & (n - 1) == 0):
        raise ConfigError(option, f"must be a power of two in [2, {MAX_WORKERS}], got {n}")
    return int(n)


def _check_sigma(sigma: float, option: str) -> float:
    if not (0.0 <= sigma <= MAX_SIGMA):  # also rejects NaN
        raise ConfigError(option, f"must be in [0, {MAX_SIGMA:g}], got {sigma}")
    return float(sigma)


def _check_at_least_one(value: int, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(option, f"must be an integer >= 1, got {value}")
    return int(value)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError("seed", f"must be an integer >= 0, got {seed}")
    return int(seed)


# --- message times: tree all-reduce against pair exchange

def lognormal(rng: np.random.Generator, sigma: float, size: tuple[int, ...],
              mean: float = 1.0) -> np.ndarray:
    """Log-normal draws of mean ``mean``: ``mean · exp(σZ − σ²/2)``; σ = 0 gives ``mean``.

    Args:
        rng: the generator of the draws.
        sigma: σ, the spread (the standard deviation of the underlying normal), >= 0.
        size: the shape of the result.
        mean: the mean of every draw; default 1.
    """
    return mean * np.exp(sigma * rng.standard_normal(size) - sigma * sigma / 2)


def tree_allreduce_times(n_max: int, sigma: float, *, t_c: float = 1.0,
                         trials: int = DEFAULT_TRIALS,
                         rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Samples of the time of a binary-tree all-reduce (reduce up, broadcast down) over
    N = 2, 4, ..., ``n_max`` workers whose messages take log-normal times of mean ``t_c``.

    Each trial simulates one all-reduce over ``n_max`` workers; every aligned subtree of N of
    its leaves, timed with its own messages only, is one sample of an all-reduce over N, so N
    gets ``trials · n_max / N`` samples (independent: the subtrees share no message).

    Args:
        n_max: the largest group, a power of two in [2, 65536].
        sigma: σ, the spread of the message times, in [0, 4].
        t_c: the mean time of one message; default 1.
        trials: simulated all-reduces over ``n_max`` workers, >= 1; default 100.
        rng: the generator of the draws (``numpy.random.default_rng(seed)``).

    Returns:
        For every N = 2, 4, ..., ``n_max``, the ``trials · n_max / N`` sampled times.

    Raises:
        ConfigError: an argument out of range.
    """
    _check_workers(n_max)
    _check_sigma(sigma, "sigmas")
    _check_at_least_one(trials, "trials")
    levels = n_max.bit_length() - 1
    # up: ready[k][:, i] is when the subtree of leaves i·2^k ... (i+1)·2^k − 1 has its sum;
    # a parent waits for the slower of its two children (child ready time + its message)
    ready = [np.zeros((trials, n_max))]
    for _ in range(levels):
        arrival = ready[-1] + lognormal(rng, sigma, ready[-1].shape, t_c)
        ready.append(np.maximum(arrival[:, 0::2], arrival[:, 1::2]))
    # down: reached[d][:, i] is when node i at depth d has the result, counted from the
    # root's; each child gets it at its parent's time plus its own message
    reached = [np.zeros((trials, 1))]
    for _ in range(levels):
        parents = np.repeat(reached[-1], 2, axis=1)
        reached.append(parents + lognormal(rng, sigma, parents.shape, t_c))
    times = {}
    for k in range(1, levels + 1):
        last_leaf = reached[levels].reshape(trials, n_max >> k, 1 << k).max(axis=2)
        times[1 << k] = (ready[k] + last_leaf - reached[levels - k]).ravel()
    return times


def tree_allreduce_time(n: int, sigma: float, *, t_c: float = 1.0, trials: int = DEFAULT_TRIALS,
                        rng: np.random.Generator) -> np.ndarray:
    """``trials`` samples of the time of a tree all-reduce over ``n`` workers;
    ``2·t_c·log2 n`` at σ = 0.

    Args:
        n: N, a power of two in [2, 65536].
        sigma: σ, the spread of the message times, in [0, 4].
        t_c: the mean time of one message; default 1.
        trials: samples, >= 1; default 100.
        rng: the generator of the draws (``numpy.random.default_rng(seed)``).

    Raises:
        ConfigError: an argument out of range.
    """
    return tree_allreduce_times(n, sigma, t_c=t_c, trials=trials, rng=rng)[n]


def pair_exchange_time(sigma: float, *, t_c: float = 1.0, trials: int = DEFAULT_TRIALS,
                       rng: np.random.Generator) -> np.ndarray:
    """``trials`` samples of a pair's exchange: two rounds (a send and a reply), each ending
    when both of the messages the two workers sent each other at once have arrived;
    ``2·t_c`` at σ = 0.

    Args:
        sigma: σ, the spread of the message times, in [0, 4].
        t_c: the mean time of one message; default 1.
        trials: samples, >= 1; default 100.
        rng: the generator of the draws (``numpy.random.default_rng(seed)``).

    Raises:
        ConfigError: an argument out of range.
    """
    _check_sigma(sigma, "sigmas")
    _check_at_least_one(trials, "trials")
    rounds = lognormal(rng, sigma, (trials, 2, 2), t_c).max(axis=2)
    return rounds.sum(axis=1)


def latency_ratios(workers: Sequence[int], sigma: float, *, trials: int = DEFAULT_TRIALS,
                   rng: np.random.Generator) -> list[float]:
    """E[tree all-reduce time over N] / E[pair exchange time] for every N of ``workers``
    (``log2 N`` at σ = 0), from ``trials`` all-reduces over ``max(workers)`` workers and as
    many pair exchanges as that cluster has pairs.

    Args:
        workers: the group sizes N, each a power of two in [2, 65536].
        sigma: σ, the spread of the message times, in [0, 4].
        trials: simulated all-reduces over ``max(workers)`` workers, >= 1; default 100.
        rng: the generator of the draws (``numpy.random.default_rng(seed)``).

    Returns:
        One ratio per N, in the order of ``workers``.

    Raises:
        ConfigError: an argument out of range.
    """
    sizes = [_check_workers(n) for n in workers]
    trees = tree_allreduce_times(max(sizes), sigma, trials=trials, rng=rng)
    pair = pair_exchange_time(sigma, trials=trials * max(sizes) // 2, rng=rng).mean()
    return [float(trees[n].mean() / pair) for n in sizes]


def latency_ratio(n: int, sigma: float, *, trials: int = DEFAULT_TRIALS,
                  seed: int = DEFAULT_SEED) -> float:
    """E[tree all-reduce time over ``n`` workers] / E[pair exchange time]; ``log2 n`` at
    σ = 0. Equal to the table's entry for N = ``n`` when ``n`` is the largest N.

    Args:
        n: N, a power of two in [2, 65536].
        sigma: σ, the spread of the message times, in [0, 4].
        trials: simulated all-reduces, >= 1; default 100.
        seed: seed of the draws, an integer >= 0; default 0.

    Raises:
        ConfigError: an argument out of range.
    """
    rng = np.random.default_rng(_check_seed(seed))
    return latency_ratios([n], sigma, trials=trials, rng=rng)[0]


# --- stragglers: slowest of the group's H-step sums

def straggler_slowdowns(group_sizes: Sequence[int], sync_every: Sequence[int], sigma: float, *,
                        trials: int = DEFAULT_TRIALS, rng: np.random.Generator) -> np.ndarray:
    """Slowdown E[max over a group of its workers' H-step times] / H for every group size
    (rows) and H (columns), from ``trials`` outer steps of a cluster of ``max(group_sizes)``
    workers whose inner steps take log-normal times of mean 1 and spread ``sigma``.

    Args:
        group_sizes: the group sizes N, each a power of two in [2, 65536].
        sync_every: the values of H, each an integer >= 1.
        sigma: σ_s, the spread of the inner-step times, in [0, 4].
        trials: simulated outer steps, >= 1; default 100.
        rng: the generator of the draws (``numpy.random.default_rng(seed)``).

    Returns:
        An array of shape ``(len(group_sizes), len(sync_every))``; every entry >= 1 up to
            sampling noise, exactly 1 at σ_s = 0.

    Raises:
        ConfigError: an argument out of range.
    """
    sizes = [_check_workers(n) for n in group_sizes]
    hs = [_check_at_least_one(h, "sync_every") for h in sync_every]
    _check_sigma(sigma, "step_sigma")
    _check_at_least_one(trials, "trials")
    cluster = max(sizes)  # powers of two: every group size divides it
    columns = np.asarray(hs)
    out = np.empty((len(sizes), len(hs)))
    totals = np.zeros((trials, cluster))
    for step in range(1, max(hs) + 1):
        totals += lognormal(rng, sigma, totals.shape)
        due = columns == step
        if due.any():
            slowest = [totals.reshape(trials, cluster // n, n).max(axis=2).mean() for n in sizes]
            out[:, due] = np.array(slowest)[:, None] / step
    return out


def straggler_slowdown(group_size: int, sync_every: int, sigma: float, *,
                       trials: int = DEFAULT_TRIALS, seed: int = DEFAULT_SEED) -> float:
    """Slowdown of a group of ``group_size`` workers that meets every ``sync_every`` inner
    steps (2: a pair), from ``trials`` simulated outer steps; exactly 1 at σ = 0. Equal to
    the table's entry for the largest N (the draws do not depend on the other N or H).

    Args:
        group_size: N, a power of two in [2, 65536].
        sync_every: H, inner steps between syncs, >= 1.
        sigma: σ_s, the spread of the inner-step times, in [0, 4].
        trials: simulated outer steps, >= 1; default 100.
        seed: seed of the draws, an integer >= 0; default 0.

    Raises:
        ConfigError: an argument out of range.
    """
    rng = np.random.default_rng(_check_seed(seed))
    return float(straggler_slowdowns([group_size], [sync_every], sigma, trials=trials,
                                     rng=rng)[0, 0])


# --- the command

@dataclass
class Options:
    """The checked options of one ``loco simulate latency`` run.

    Build it with [`parse_options`][loco.simulate.latency.parse_options], which checks the
    ranges.

    Args:
        workers: the group sizes N, powers of two in [2, 65536], sorted.
        sigmas: the spreads σ of the message times, each in [0, 4], sorted.
        step_sigma: σ_s, the spread of the inner-step times, in [0, 4].
        sync_every: the values of H, each >= 1, sorted.
        trials: Monte Carlo rounds, >= 1.
        seed: seed of the draws, >= 0.
        preset: the name of the [`PRESETS`][loco.simulate.latency.PRESETS] entry the
            options came from, or None (default) for none.
    """

    workers: list[int]
    sigmas: list[float]
    step_sigma: float
    sync_every: list[int]
    trials: int
    seed: int
    preset: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``loco simulate latency``."""
    parser.add_argument("--workers", default=DEFAULT_WORKERS, metavar="N,N,...",
                        help="all-reduce group sizes N, powers of two in [2, "
                        f"{MAX_WORKERS}] (default: {DEFAULT_WORKERS})")
    parser.add_argument("--sigmas", default=DEFAULT_SIGMAS, metavar="X,X,...",
                        help="spreads σ of the log-normal message times (mean t_c), each in "
                        f"[0, {MAX_SIGMA:g}] (default: {DEFAULT_SIGMAS})")
    parser.add_argument("--step-sigma", type=float, default=None, metavar="X",
                        help="spread σ_s of the log-normal inner-step times (mean 1; σ_s is "
                        f"the standard deviation of the log of a step time), in [0, "
                        f"{MAX_SIGMA:g}] (default: {DEFAULT_STEP_SIGMA}: 10%% jitter, an "
                        "assumption for a homogeneous cluster; the preset's value with "
                        "--preset)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help="a named setting: paper-fig5b is NoLoCo's Figure 5B, inner-step "
                        "spread σ_s² = 0.5 (σ_s ≈ 0.707); an explicit --step-sigma wins "
                        "(default: none)")
    parser.add_argument("--sync-every", default=DEFAULT_SYNC_EVERY, metavar="H,H,...",
                        help=f"inner steps H between syncs, each >= 1 (default: "
                        f"{DEFAULT_SYNC_EVERY})")
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, metavar="N",
                        help="Monte Carlo rounds, >= 1: each simulates one all-reduce over, "
                        "and one outer step of, a cluster of max(--workers) workers, whose "
                        "blocks of N are the samples for N (default: "
                        f"{DEFAULT_TRIALS}; the time grows with trials x max N x max H)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="N",
                        help=f"seed of the random draws, >= 0 (default: {DEFAULT_SEED})")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG of both models to PATH (default: no file is written)")
    parser.add_argument("--json", action="store_true",
                        help="print the numbers as JSON only, no tables")


def _parse_list(text: str, kind: Callable[[str], int | float], option: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise ConfigError(option, f"expected comma-separated {noun}, got {text!r}") from None
    if not values:
        raise ConfigError(option, "needs at least one value")
    return sorted(set(values))


def parse_options(args: argparse.Namespace) -> Options:
    """The checked options of ``args``; raises ``ConfigError`` naming a bad one.

    Args:
        args: parsed flags of ``loco simulate latency``: ``workers``, ``sigmas`` and
            ``sync_every`` as comma-separated strings, ``step_sigma`` (None: the preset's or
            the default), ``trials``, ``seed``, and optionally ``preset``.

    Raises:
        ConfigError: a value that does not parse or is out of range (see
            [`Options`][loco.simulate.latency.Options]).
    """
    preset = getattr(args, "preset", None)
    if preset is not None and preset not in PRESETS:
        raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
    step_sigma = args.step_sigma
    if step_sigma is None:
        step_sigma = PRESETS[preset]["step_sigma"] if preset else DEFAULT_STEP_SIGMA
    return Options(
        workers=[_check_workers(n) for n in _parse_list(args.workers, int, "workers")],
        sigmas=[_check_sigma(s, "sigmas") for s in _parse_list(args.sigmas, float, "sigmas")],
        step_sigma=_check_sigma(step_sigma, "step_sigma"),
        sync_every=[_check_at_least_one(h, "sync_every")
                    for h in _parse_list(args.sync_every, int, "sync_every")],
        trials=_check_at_least_one(args.trials, "trials"),
        seed=_check_seed(args.seed), preset=preset)


def simulate(opts: Options) -> dict:
    """Both models over the options' grid: the numbers ``--json`` prints (less ``plot``).

    Keys: the options (``workers``, ``sigmas``, ``step_sigma``, ``sync_every``, ``trials``,
    ``seed``, ``preset``; lists sorted, duplicates dropped); ``latency_ratio``: one row per N, one column
    per σ; ``straggler_slowdown``: ``allreduce`` (one row per N, one column per H), ``pair``
    (one value per H) and ``allreduce_over_pair`` (shaped as ``allreduce``). ``run`` adds
    ``plot``: the PNG's path, or null.

    Args:
        opts: the checked options.
    """
    by_sigma = [latency_ratios(opts.workers, s, trials=opts.trials,
                               rng=np.random.default_rng(opts.seed)) for s in opts.sigmas]
    slow = straggler_slowdowns([2, *opts.workers], opts.sync_every, opts.step_sigma,
                               trials=opts.trials, rng=np.random.default_rng(opts.seed))
    pair, allreduce = slow[0], slow[1:]
    return {**asdict(opts),
            "latency_ratio": [list(row) for row in zip(*by_sigma)],
            "straggler_slowdown": {"allreduce": allreduce.tolist(), "pair": pair.tolist(),
                                   "allreduce_over_pair": (allreduce / pair).tolist()}}


def _table(title: str, corner: str, columns: list[str], rows: list[tuple[str, list[float]]],
           digits: int) -> str:
    width = max(8, *(len(c) + 1 for c in columns))
    lines = [title, f"{corner:>6}" + "".join(f"{c:>{width}}" for c in columns)]
    lines += [f"{name:>6}" + "".join(f"{v:>{width}.{digits}f}" for v in values)
              for name, values in rows]
    return "\n".join(lines)


def format_tables(result: dict) -> str:
    """The three readable tables of a [`simulate`][loco.simulate.latency.simulate] result.

    Args:
        result: what ``simulate`` returned.
    """
    sigmas = [f"σ={s:g}" for s in result["sigmas"]]
    hs = [f"H={h}" for h in result["sync_every"]]
    slow = result["straggler_slowdown"]
    names = [str(n) for n in result["workers"]]
    return "\n\n".join([
        _table("tree all-reduce time / pair exchange time (message times log-normal, mean "
               "t_c, spread σ; log2 N at σ = 0)", "N", sigmas,
               list(zip(names, result["latency_ratio"])), 2),
        _table(f"straggler slowdown: E[time per outer step] / (H · mean step time), inner-step "
               f"spread σ_s = {result['step_sigma']:.4g}"
               + (f" (preset {result['preset']})" if result.get("preset") else "")
               + " (rows N: all-reduce over N workers)",
               "N", hs, [*zip(names, slow["allreduce"]), ("pair", slow["pair"])], 3),
        _table("all-reduce slowdown / pair slowdown", "N", hs,
               list(zip(names, slow["allreduce_over_pair"])), 3)])


def plot(result: dict, path: str) -> None:
    """Two panels: the tree/pair ratio against N (one curve per σ) and the straggler
    slowdown against H (one curve per N, and the pair's). Needs matplotlib.

    Args:
        result: what [`simulate`][loco.simulate.latency.simulate] returned.
        path: the PNG file to write.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.3))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    workers = result["workers"]
    for j, sigma in enumerate(result["sigmas"]):
        left.plot(workers, [row[j] for row in result["latency_ratio"]], "o-",
                  label=f"σ = {sigma:g}")
    left.set_xscale("log", base=2)
    left.set(xlabel="workers N", ylabel="tree all-reduce time / pair exchange time",
             title="message times log-normal (mean t_c)")
    left.legend()
    slow = result["straggler_slowdown"]
    hs = result["sync_every"]
    colors = [f"C{i % 10}" for i in range(len(workers))]
    for n, row, color in zip(workers, slow["allreduce"], colors):
        right.plot(hs, row, "o-", color=color, label=f"all-reduce, N = {n}")
    right.plot(hs, slow["pair"], "s--", color="black", label="pair")
    right.set_xscale("log")
    right.set(xlabel="inner steps between syncs H", ylabel="slowdown from stragglers",
              title=f"inner-step times log-normal (σ_s = {result['step_sigma']:g})")
    right.legend(fontsize=7, ncol=2)
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    """``loco simulate latency``: print the tables (or JSON) and write the PNG; raises
    :class:`ConfigError` on a bad option, before simulating anything."""
    result = simulate(parse_options(args))
    result["plot"] = args.plot or None
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_tables(result))
        print(f"\nwrote {args.plot}" if args.plot else "\n(add --plot PATH to draw these)")
    return 0
