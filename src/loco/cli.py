"""The ``loco`` command line. Flags are generated from :class:`loco.config.TrainConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from loco.config import ConfigError, TrainConfig, build_config

EPILOG = """Options may also come from a YAML file (--config); flags override it.
Examples:
  loco train                                   # default job: Streaming DiLoCo, 4 workers, FP4
  loco train --algorithm streaming --fragments 4 --sync-every 100 --overlap 2 --codec int8
  loco train --algorithm diloco                # DiLoCo: whole model, fp32, every H steps
  loco train --algorithm ddp --steps 200       # data-parallel baseline
  loco train --algorithm noloco --group-size 2 --gamma 0.7 --stages 2 --routing random
  loco train --model tiny --workers 2 --launcher processes
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


PATHS = {"corpus", "cache_dir", "out"}


def _metavar(f: dataclasses.Field) -> str:
    return {int: "N", float: "X"}.get(_flag_type(f), "PATH" if f.name in PATHS else "NAME")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="loco", description="Train language models across workers that "
                    "talk rarely and little (Streaming DiLoCo, DiLoCo, NoLoCo, data-parallel, "
                    "local), and simulate what each needs at scale.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a model (default: Streaming DiLoCo on Shakespeare)",
                           description="Train a language model with one of the methods and "
                           "write metrics.jsonl, summary.json and loss.png into --out.",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", metavar="FILE", help="YAML file of options (its keys are "
                       "the flag names); flags given here override it")
    for f in TrainConfig.fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if str(f.type).startswith("bool"):
            train.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            train.add_argument(flag, type=_flag_type(f), default=argparse.SUPPRESS,
                               choices=f.metadata.get("choices"),
                               metavar=None if f.metadata.get("choices") else _metavar(f),
                               help=help_text)
    simulate = sub.add_parser("simulate", help="what each method needs at scale, without "
                              "training: compute utilization against bandwidth, and latency",
                              description="Simulators of the papers' scaling arguments.")
    kinds = simulate.add_subparsers(dest="simulation", required=True, parser_class=Parser)
    for name, text in SIMULATIONS.items():
        module = _simulation(name)
        p = kinds.add_parser(name, help=text, description=(module.__doc__ or text).split(
            "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
    return parser


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
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "simulate":
        try:
            return _simulation(args.simulation).run(args)
        except ConfigError as e:
            print(f"loco simulate {args.simulation}: error: {e}", file=sys.stderr)
            return 2
    return 2


def _train(args: argparse.Namespace) -> int:
    from loco.runtime import WorkerError
    from loco.train import human_bytes, run_training

    names = {f.name for f in TrainConfig.fields()}
    try:
        cfg = build_config(args.config, {k: v for k, v in vars(args).items() if k in names})
        summary = run_training(cfg)
    except ConfigError as e:
        print(f"loco train: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"loco train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Worker threads may sit inside gloo; a normal interpreter shutdown would tear the
        # transport down under them and abort. Nothing is left half-written: summary.json
        # is only ever written whole, at the end.
        print("\nloco train: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    if "final_eval_loss" not in summary:  # a torchrun rank other than 0
        return 0
    out = summary["config"]["out"]
    print(f"final eval loss {summary['final_eval_loss']:.3f} nats/token "
          f"(unigram entropy of the corpus: {summary['unigram_entropy']:.3f})")
    print(f"{summary['tokens']:,} tokens in {summary['wall_seconds']:.1f} s "
          f"({summary['tokens_per_second']:,.0f} tokens/s); sent per worker "
          f"{human_bytes(summary['bytes_sent_per_worker'])}, peak sync "
          f"{human_bytes(summary['peak_sync_bytes_per_worker'])}")
    print(f"compute utilization {summary['compute_utilization']:.1%} (the slowest worker "
          f"waited {summary['comm_wait_seconds']:.1f} s on communication)"
          + (f"; emulated link {summary['link']['bandwidth'] or 'unlimited'}, "
             f"{summary['link']['latency'] or '0 ms'}" if summary.get("link") else ""))
    if summary.get("stages", 1) > 1:
        print(f"pipeline: {summary['stages']} stages per replica, {summary['routing']} routing; "
              f"activations and gradients sent per rank "
              f"{human_bytes(summary['pipeline_bytes_sent_per_rank'])}")
    if summary.get("replicas"):
        r = summary["replicas"]
        print(f"replicas: mean eval loss {r['mean_eval_loss']:.3f}, their average's "
              f"{r['average_eval_loss']:.3f}" + (" (the final model)" if r["final_average"]
                                                  else ""))
    print(f"wrote {out}/metrics.jsonl, summary.json, loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
