"""The ``loco`` command line. Flags are generated from :class:`loco.config.TrainConfig`.

Only the subcommand being run gets its options built, so ``loco --help`` and
``loco simulate`` start without importing torch (the configuration imports the methods).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from loco.options import ConfigError

EPILOG = """Options may also come from a YAML file (--config); flags override it.
Examples:
  loco train                                   # default job: Streaming DiLoCo, 4 workers, FP4
  loco train --algorithm streaming --fragments 4 --sync-every 100 --overlap 2 --codec int8
  loco train --algorithm diloco                # DiLoCo: whole model, fp32, every H steps
  loco train --algorithm ddp --steps 200       # data-parallel baseline
  loco train --algorithm noloco --group-size 2 --gamma 0.7 --stages 2 --routing random
  loco train --model tiny --workers 2 --launcher processes
  loco train --model hf:configs/llama-35m --corpus 'data/*.parquet' --tokenizer tok.json
  loco train --tensorboard --wandb             # also log to TensorBoard and W&B (offline)
  loco train --workers 2 --worker-ranks 4      # 2 workers of 4 ranks: 8 ranks in all
  torchrun --nproc-per-node 8 -m loco train    # one rank per GPU, NCCL"""


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag_type(f: dataclasses.Field):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


PATHS = {"corpus", "cache_dir", "out", "resume", "tokenizer", "eval_corpus"}


def _metavar(f: dataclasses.Field) -> str:
    return {int: "N", float: "X"}.get(_flag_type(f), "PATH" if f.name in PATHS else "NAME")


COMPARE_EPILOG = """Examples:
  loco compare --preset quick                      # all five methods, about 8 min on 2 CPU cores
  loco compare --algorithms diloco,streaming,s8=streaming --set s8.codec=int8 --steps 200
  loco compare --link-bandwidth 100Mbit --link-latency 50ms --preset quick
  loco compare --preset quick --algorithms ddp,streaming --seeds 0,1,2   # mean ± seeds' spread
  loco compare --preset evidence                   # the papers' claims over 3 seeds, ~30 min
  loco report runs/compare-20261122-101500         # re-render from the saved runs"""


EVAL_EPILOG = """Examples:
  loco eval runs/diloco-20261122-101500 --tasks hellaswag,piqa,arc_easy
  loco eval runs/noloco-20261122-101500 --tasks piqa --limit 200 --no-replicas
  loco eval RUN_DIR --tasks my_piqa --include-path my_tasks/   # tasks on local files
  loco report runs/compare-20261122-101500   # the report adds a downstream table"""


def add_train_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                      algorithm: str | None = None, every_method: bool = False) -> None:
    """One flag per TrainConfig field (the YAML keys are the same names), in ``--help``'s
    groups by section (``loco.config.groups``): every method's own flags are parsed, the
    listed ones are ``algorithm``'s (None: none, with a line saying how to list them).

    Args:
        parser: the subcommand's parser.
        skip: fields that get no flag.
        algorithm: the method whose own options ``--help`` lists; default None.
        every_method: list every method's own options (``loco compare``, whose runs may
            be of any method); default False.
    """
    from loco.config.groups import option_groups

    for group in option_groups(algorithm, every_method):
        target = parser.add_argument_group(group.title, group.description or None)
        for f in group.fields:
            if f.name not in skip:
                _add_flag(target, f, group.listed)


def _add_flag(group, f: dataclasses.Field, listed: bool) -> None:
    """The flag of one option (``--no-NAME`` too for a boolean), in ``group``."""
    from loco.config import RENAMED, choices

    flag = "--" + f.name.replace("_", "-")
    flags = [flag] + ["--" + o.replace("_", "-") for o, n in RENAMED.items() if n == f.name]
    help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
    help_text = help_text if listed else argparse.SUPPRESS
    if str(f.type).startswith("bool"):
        group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=help_text)
    elif f.metadata.get("repeat"):  # given again: one more entry (coerce joins them)
        group.add_argument(*flags, dest=f.name, action="append", default=argparse.SUPPRESS,
                           metavar=_metavar(f), help=help_text)
    else:
        group.add_argument(*flags, dest=f.name, type=_flag_type(f), default=argparse.SUPPRESS,
                           choices=choices(f), metavar=None if choices(f) else _metavar(f),
                           help=help_text)


def asked_algorithm(argv: list[str]) -> str | None:
    """The method a ``--help`` asks about: ``--algorithm NAME`` (or ``=NAME``) among
    ``argv`` next to ``--help``/``-h``, where NAME is registered; else None."""
    if not {"--help", "-h"} & set(argv) or "--algorithm" not in " ".join(argv):
        return None
    from loco.algorithms import methods  # imports torch: only for a method's --help

    for i, arg in enumerate(argv):
        name = (arg.partition("=")[2] if arg.startswith("--algorithm=") else
                argv[i + 1] if arg == "--algorithm" and i + 1 < len(argv) else None)
        if name in methods():
            return name
    return None


def build_parser(command: str | None = None, algorithm: str | None = None
                 ) -> argparse.ArgumentParser:
    """The ``loco`` parser; only ``command``'s options are built (every subcommand's with
    None; none but the subcommands' names with ``""``).

    Args:
        command: the subcommand being run, None for all, ``""`` for none.
        algorithm: the method whose own options ``loco train --help`` lists (``--algorithm
            NAME --help``); default None (each method's own are parsed, not listed).
    """
    parser = Parser(prog="loco", description="Train language models across workers that "
                    "talk rarely and little (Streaming DiLoCo, DiLoCo, NoLoCo, data-parallel, "
                    "local), and simulate what each needs at scale.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, build in SUBCOMMANDS.items():
        build(sub, command in (None, name), algorithm)
    return parser


def _train_parser(sub, full: bool, algorithm: str | None = None) -> None:
    """``loco train``: one flag per option (with ``full``)."""
    train = sub.add_parser("train", help="train a model (default: Streaming DiLoCo on Shakespeare)",
                           usage="loco train [-h] [--config FILE] [--algorithm NAME] "
                           "[OPTION ...]",
                           description="Train a language model with one of the methods and "
                           "write metrics.jsonl, summary.json and loss.png into --out.",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", metavar="FILE", help="YAML file of options nested by "
                       "section, e.g. 'optim: {lr: 0.001}' (the groups below; keys are the "
                       "flag names); flags given here override it")
    if full:
        add_train_options(train, algorithm=algorithm)


def _compare_parser(sub, full: bool, algorithm: str | None = None) -> None:  # noqa: ARG001
    """``loco compare``: its own flags and every train option (with ``full``)."""
    compare = sub.add_parser(
        "compare", help="run several methods on the same job and write a side-by-side report",
        description="Train each method (default: ddp, diloco, streaming with FP4 and overlap, "
        "noloco, local) on the same model, data, seed and token budget, one after another, "
        "and write report.md, compare.json and plots into --out, next to each run's own "
        "directory. Every loco train option may be given once for all methods.",
        epilog=COMPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("--algorithms", metavar="LIST", default=argparse.SUPPRESS,
                         help="comma-separated methods to run, each an algorithm name or "
                         "LABEL=ALGORITHM for a second run of one with other options "
                         "(default: ddp,diloco,streaming,noloco,local)")
    compare.add_argument("--set", metavar="LABEL.OPTION=VALUE", action="append", default=[],
                         help="an option for one method only, e.g. streaming.fragments=4 or "
                         "diloco.outer-lr=0.5 (repeatable); options that must be the same for "
                         "every method (model, steps, workers, data, seed, ...) are refused")
    compare.add_argument("--sweep", metavar="OPTION=VALUES", action="append", default=[],
                         help="run every method the option applies to once per value, e.g. "
                         "mixing=0,0.5 or 'overlap=0;1;1,1,2,5' (values separated by ',', or "
                         "by ';' when a value holds a comma, as a per-worker overlap list); "
                         "repeat for a grid (the cartesian product); the report adds a table "
                         "and a plot of final eval loss and bytes against the first option")
    compare.add_argument("--seeds", metavar="LIST", default=None,
                         help="run every method (every point of a sweep) once per seed, e.g. "
                         "0,1,2 (1 to 16 distinct integers >= 0; not with --seed); the report "
                         "gives each method's mean eval loss with the seeds' spread and checks "
                         "each claim seed by seed (yes, no or mixed)")
    if not full:
        return
    from loco.compare import PRESETS

    compare.add_argument("--preset", choices=list(PRESETS), default=None,
                         help="quick: every method in <= 10 min on a 2-core CPU; evidence: "
                         "the papers' claims tested over 3 seeds in about 30 min on a 2-core "
                         "CPU (see docs/claims.md); frontier: the compression frontier over 3 "
                         "seeds in about 50 min (docs/frontier.md); hetero: workers of unequal "
                         "speed over 3 seeds in about 30 min (docs/unequal.md); paper: "
                         "settings close to the papers' for a "
                         "GPU machine (see docs/compare.md); options given here override the "
                         "preset's")
    compare.add_argument("--config", metavar="FILE", help="YAML file of options for every "
                         "method, plus optional 'algorithms: [...]' and 'methods: {LABEL: "
                         "{option: value}}'; flags override it")
    compare.add_argument("--out", metavar="DIR", default=argparse.SUPPRESS,
                         help="directory for the report and one run directory per method "
                         "(default: runs/compare-<time>); finished runs are never overwritten")
    add_train_options(compare, skip=("algorithm", "out", "resume"), every_method=True)


def _report_parser(sub, full: bool, algorithm: str | None = None) -> None:  # noqa: ARG001
    """``loco report``."""
    report = sub.add_parser(
        "report", help="re-render a comparison's report and plots from saved runs",
        description="Write report.md, compare.json and the plots from finished run "
        "directories, without training. Each DIR is a run directory (with summary.json) or "
        "a directory of them, such as a loco compare --out.")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or "
                        "directories holding run directories")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="where to write (default: DIR when a single directory is given)")


def _eval_parser(sub, full: bool, algorithm: str | None = None) -> None:  # noqa: ARG001
    """``loco eval``."""
    evaluate = sub.add_parser(
        "eval", help="score a finished run's final model on downstream tasks "
        "(lm-evaluation-harness: HellaSwag, PIQA, ARC-Easy, ...)",
        description="Run lm-evaluation-harness tasks on the model a run ends with (the "
        "global model; for NoLoCo also every replica and their average), read from its last "
        "checkpoint, and write the scores into its summary.json (downstream) and the full "
        "results into RUN_DIR/eval/. Tasks whose data is on the Hugging Face Hub need the "
        "network; without it, define them on local files (--include-path, docs/eval.md).",
        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a loco train --out directory")
    evaluate.add_argument("--tasks", metavar="LIST", required=True,
                          help="comma-separated lm-eval task or group names (or task YAML "
                          "files), e.g. hellaswag,piqa,arc_easy")
    evaluate.add_argument("--include-path", metavar="DIR", default=None,
                          help="a directory of your own task YAML files (e.g. tasks on local "
                          "data files)")
    evaluate.add_argument("--limit", metavar="N", type=float, default=None,
                          help="at most N documents per task (a fraction of them when < 1); "
                          "default all")
    evaluate.add_argument("--num-fewshot", metavar="K", type=int, default=None,
                          help="examples in each prompt (default: the task's own, 0 for most)")
    evaluate.add_argument("--batch-size", metavar="B", type=int, default=16,
                          help="sequences per forward pass (default: 16)")
    evaluate.add_argument("--replicas", action=argparse.BooleanOptionalAction, default=None,
                          help="also every replica (NoLoCo and Local: and their average); "
                          "default: on for NoLoCo, off otherwise")
    evaluate.add_argument("--device", metavar="DEVICE", default=None,
                          help="where to run the model (default: cuda when available, else "
                          "cpu)")
    evaluate.add_argument("--verbose", action="store_true",
                          help="show lm-eval's own log messages")


def _simulate_parser(sub, full: bool, algorithm: str | None = None) -> None:  # noqa: ARG001
    """``loco simulate``: one subcommand per simulator (with ``full``)."""
    simulate = sub.add_parser("simulate", help="what each method needs at scale, without "
                              "training: compute utilization against bandwidth, and latency",
                              description="Simulators of the papers' scaling arguments.")
    kinds = simulate.add_subparsers(dest="simulation", required=True, parser_class=Parser)
    for name, text in SIMULATIONS.items() if full else ():
        module = _simulation(name)
        p = kinds.add_parser(name, help=text, description=(module.__doc__ or text).split(
            "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)


PLAN_EPILOG = """Examples:
  loco plan --model 70b --workers 4 --worker-ranks 64 --worker-parallel fsdp --link-bandwidth 1Gbit
  loco plan --model 300m --workers 2 --algorithm diloco --sync-every 100
  loco plan --model 1b --algorithm ddp --link-bandwidth 100Gbit --link-latency 1ms --json
  loco plan --model hf:configs/llama-35m --codec int8 --fragments 4"""


def _plan_parser(sub, full: bool, algorithm: str | None = None) -> None:
    """``loco plan``: its own flags and every train option (with ``full``)."""
    plan = sub.add_parser(
        "plan", help="what a run will hold and send, before it is launched: each rank's "
        "state by part, the bytes per sync, per step and per run, the compute utilization",
        description="Build the run's model, optimizer and method on the meta device (nothing "
        "is allocated, nothing is sent) and run its inner steps (two rounds of H) over a "
        "loopback transport: print each rank's state by part (summary.json's "
        "memory_bytes_per_rank), "
        "the bytes each worker sends per sync, per step and for --steps over the slow link "
        "(and inside a worker over the fast link), as the run's summary.json will count "
        "them, and the compute utilization loco simulate utilization's model gives on the "
        "link of --link-bandwidth and --link-latency. Takes every loco train option.",
        epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--json", action="store_true",
                      help="print the plan as JSON (the state per rank under "
                      "memory_bytes_per_rank, the run's bytes under summary.json's keys)")
    plan.add_argument("--step-time", metavar="SECONDS", type=float, default=None,
                      help="seconds of compute per inner step for the utilization "
                      "(default: the Streaming DiLoCo paper's step times, interpolated by "
                      "the model's parameters)")
    plan.add_argument("--config", metavar="FILE", help="YAML file of options (its keys are "
                      "the flag names); flags given here override it")
    if full:
        add_train_options(plan, skip=("out", "resume"), algorithm=algorithm)


SUBCOMMANDS = {"train": _train_parser, "compare": _compare_parser, "report": _report_parser,
               "eval": _eval_parser, "simulate": _simulate_parser, "plan": _plan_parser}


SIMULATIONS = {
    "utilization": "bandwidth each method needs for 50-99%% compute utilization (Streaming "
                   "DiLoCo paper's per-layer model), 1B-100B models",
    "latency": "NoLoCo's argument: tree all-reduce against pairwise exchange with log-normal "
               "message times, and stragglers",
}


def _simulation(name: str):
    import importlib

    return importlib.import_module(f"loco.simulate.{name}")


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    command = given[0] if given and given[0] in SUBCOMMANDS else ""
    args = build_parser(command, asked_algorithm(given)).parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "report":
        return _report(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "simulate":
        try:
            return _simulation(args.simulation).run(args)
        except ConfigError as e:
            print(f"loco simulate {args.simulation}: error: {e}", file=sys.stderr)
            return 2
    return 2


def _guarded(command: str, fn):
    """(exit code, fn()): a bad option exits 2 in one line, a worker's failure 1, Ctrl-C 130."""
    from loco.runtime import WorkerError

    try:
        return 0, fn()
    except ConfigError as e:
        print(f"loco {command}: error: {e}", file=sys.stderr)
        return 2, None
    except WorkerError as e:
        print(f"loco {command}: {e}", file=sys.stderr)
        return 1, None
    except KeyboardInterrupt:
        # Worker threads may sit inside gloo; a normal interpreter shutdown would tear the
        # transport down under them and abort. Nothing is left half-written: summaries,
        # reports and checkpoints are only ever written whole.
        print(f"\nloco {command}: interrupted (finished runs and checkpoints are kept)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


def _train(args: argparse.Namespace) -> int:
    from loco.config import TrainConfig, build_config
    from loco.training import run_training
    from loco.training.summary import Summary, human_bytes

    names = {f.name for f in TrainConfig.fields()}

    def train():
        given = {k: v for k, v in vars(args).items() if k in names}
        if given.get("resume"):  # the saved run's options; only how it runs may change
            from loco.checkpoint import resume_config
            from loco.config import load_yaml

            file_values = load_yaml(args.config) if args.config else {}
            cfg = resume_config(given.pop("resume"), {**file_values, **given})
        else:
            cfg = build_config(args.config, given)
        return run_training(cfg)

    code, summary = _guarded("train", train)
    if code:
        return code
    if "final_eval_loss" not in summary:  # a torchrun rank other than 0
        return 0
    summary = Summary.from_dict(summary)
    out = summary.config["out"]
    print(f"final eval loss {summary.final_eval_loss:.3f} nats/token of "
          f"{summary.final_model or 'the final model'} on the validation split (unigram "
          f"entropy of the corpus: {summary.unigram_entropy:.3f}); the progress bar's loss "
          "was the replicas' own, on their training batches")
    print(f"{summary.tokens:,} tokens in {summary.wall_seconds:.1f} s "
          f"({summary.tokens_per_second:,.0f} tokens/s); sent per "
          f"{'worker' if (summary.worker_ranks or 1) == 1 else 'rank'} "
          f"{human_bytes(summary.bytes_sent_per_rank)}, peak sync "
          f"{human_bytes(summary.peak_sync_bytes_per_rank)}"
          + (f", {summary.bits_per_parameter_per_step:.3g} bits per parameter per step"
             if summary.bits_per_parameter_per_step is not None else ""))
    if summary.codec_kernel:
        k = summary.codec_kernel
        print(f"codec {k['codec']}: {k['kernel']} kernels"
              + (f" ({k['reason']})" if k["kernel"] == "eager" and k.get("reason") else ""))
    print(f"compute utilization {summary.compute_utilization:.1%} (the slowest worker "
          f"waited {summary.comm_wait_seconds:.1f} s on communication)"
          + (f"; emulated link {summary.link['bandwidth'] or 'unlimited'}, "
             f"{summary.link['latency'] or '0 ms'}" if summary.link else ""))
    _print_layout(summary)
    print(f"wrote {out}/metrics.jsonl, summary.json, loss.png")
    return 0


def _print_layout(summary) -> None:
    """The final lines of ``loco train`` on the workers' speeds and layout and the replicas."""
    from loco.training.summary import human_bytes

    if summary.worker_speeds and summary.goodput and summary.goodput["total"] is not None:
        shares = ", ".join("-" if g is None else f"{g:.0%}"
                           for g in summary.goodput["per_worker"])
        print(f"goodput {summary.goodput['total']:.1%} of the workers' capacity at speeds "
              f"{', '.join(f'{v:g}' for v in summary.worker_speeds)} (per worker: {shares})")
    stale = (summary.local_steps or {}).get("staleness")
    if stale:
        print("asynchronous outer steps: blocks applied " + ", ".join(
            f"{n} at staleness {k}" for k, n in stale.items()))
    if (summary.local_steps or {}).get("quorum"):
        held, syncs = summary.local_steps["held_syncs"], len(summary.local_steps["merged"])
        print(f"quorum {summary.local_steps['quorum']}, grace {summary.local_steps['grace']:g} "
              f"s: {held} of {syncs} syncs held for their quorum")
    if (summary.worker_ranks or 1) > 1:
        print(f"workers of {summary.worker_ranks} ranks ({summary.worker_parallel}): "
              f"sent per worker {human_bytes(summary.slow_link_bytes_sent_per_worker)} over "
              f"the slow link, {human_bytes(summary.fast_link_bytes_sent_per_worker)} over "
              "the fast link inside it")
    if (summary.stages or 1) > 1:
        print(f"pipeline: {summary.stages} stages per replica, {summary.routing} routing; "
              f"activations and gradients sent per rank "
              f"{human_bytes(summary.pipeline_bytes_sent_per_rank)}")
    if summary.replicas:
        r = summary.replicas
        print(f"replicas: mean eval loss {r['mean_eval_loss']:.3f}, their average's "
              f"{r['average_eval_loss']:.3f}" + (" (the final model)" if r["final_average"]
                                                  else ""))


if __name__ == "__main__":
    sys.exit(main())


def _compare(args: argparse.Namespace) -> int:
    from loco import compare
    from loco.config import TrainConfig

    names = {f.name for f in TrainConfig.fields()} - {"algorithm", "out", "resume"}
    shared = {k: v for k, v in vars(args).items() if k in names}
    if "out" in vars(args):
        shared["out"] = args.out
    progress = shared.pop("progress", True)
    plan = None

    def run():
        nonlocal plan
        plan = compare.plan(shared, getattr(args, "algorithms", None), args.set, args.preset,
                            args.config, sweeps=args.sweep, seeds=args.seeds)
        return compare.run(plan, progress=progress)

    code, numbers = _guarded("compare", run)
    if code:
        return code
    _print_report(plan.out, numbers)
    return 0


def _report(args: argparse.Namespace) -> int:
    from loco.report import find_runs, write_report

    out = args.out
    if out is None:
        if len(args.dirs) != 1:
            print("loco report: error: --out: give a directory to write into when more than "
                  "one DIR is given", file=sys.stderr)
            return 2
        out = args.dirs[0]
    code, numbers = _guarded("report", lambda: write_report(find_runs(args.dirs), out))
    if code:
        return code
    _print_report(out, numbers)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from loco.harness import EvalError, evaluate_run, score_table

    limit = args.limit
    if limit is not None and limit >= 1 and limit == int(limit):
        limit = int(limit)
    try:
        entries = evaluate_run(args.run_dir, args.tasks.split(","), args.include_path, limit,
                               args.num_fewshot, args.batch_size, args.replicas, args.device,
                               verbose=args.verbose)
    except EvalError as e:
        print(f"loco eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nloco eval: interrupted (summary.json is unchanged)", file=sys.stderr)
        return 130
    print("\n".join(score_table(entries)))
    print(f"wrote {os.path.join(args.run_dir, 'summary.json')} (downstream) and "
          f"{os.path.join(args.run_dir, entries['downstream_setup']['results'])}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from loco.config import TrainConfig, build_config
    from loco.plan import format_plan, plan

    names = {f.name for f in TrainConfig.fields()}
    given = {k: v for k, v in vars(args).items() if k in names}
    code, result = _guarded("plan", lambda: plan(build_config(args.config, given),
                                                 args.step_time))
    if code:
        return code
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _print_report(out: str, numbers: dict) -> None:
    """The report's table and claims on the terminal, then where the files are."""
    with open(os.path.join(out, "report.md")) as f:
        text = f.read()
    keep = [line for line in text.split("## Plots")[0].splitlines()[2:]]
    print("\n".join(keep).strip())
    print(f"\nwrote {out}/report.md, compare.json and plots; one run directory per method: "
          f"{', '.join(numbers)}")
