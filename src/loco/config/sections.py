"""The configuration's sections, torchtitan-style: each a dataclass of options with their
defaults and help texts, and a ``check`` of its own options' ranges.

Each field is a flag (``sync_every``: ``--sync-every``) and a YAML key; its help text is
``field.metadata["help"]``. Checks that need the file system, installed extras or the
environment are not here: they are the preflight step (``loco.training.preflight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from loco.algorithms import methods
from loco.algorithms.asynchronous import check_quorum
from loco.options import ConfigError, need, opt
from loco.runtime.faults import ENV, Fault

PATTERNS = ("strided", "sequential")
DEFAULT_STEPS = 400
"""Inner steps when neither --steps nor --tokens is given."""
LAUNCHER_NAMES = ("threads", "processes", "torchrun")
ROUTINGS = ("fixed", "random")
NONFINITE = ("stop", "skip")
LOCAL_STEPS = ("fixed", "proportional")
"""How many inner steps each worker trains per round: H each, or in proportion to its speed."""
WORKER_PARALLEL = ("ddp", "fsdp")
"""How the ranks of one worker (``--worker-ranks``) split its replica: ddp (each holds the
whole model and their gradients are averaged) or fsdp (FSDP2 shards the model over them)."""
#: The worker layout a checkpoint is written for: a resumed run may change it where the
#: checkpoint reshards (``loco.checkpoint.resume.check_layout``).
LAYOUT = ("worker_ranks", "worker_parallel")
#: Options a resumed run may change: how it runs, not what it computes.
RESUMABLE = ("launcher", "progress", "comm_timeout", "checkpoint_every", "checkpoint_interval",
             "keep_checkpoints",
             "max_restarts",
             "on_nonfinite", "resume", "out", "tensorboard", "wandb", "wandb_project",
             "wandb_run_name", "wandb_mode", "profile")
DTYPES = ("fp32", "bf16")
INNER_OPTIMIZERS = ("adamw", "muon")
"""``inner_optimizer``: AdamW everywhere, or MuLoCo's Muon on the hidden matrices."""
MUON_SCALES = ("adamw-rms", "original")
"""``muon_scale``: torch.optim.Muon's ``adjust_lr_fn`` ``match_rms_adamw`` or ``original``."""


def algorithm_names() -> tuple[str, ...]:
    """The registered methods' names: the choices of ``algorithm``."""
    return tuple(methods())


def method_defaults(option: str) -> str:
    """Each registered method's default for a shared option (``Method.defaults``), for its
    help text: ``"streaming 100, diloco 100, ..."``; the methods without one are left out."""
    return ", ".join(f"{name} {cls.defaults[option]}" for name, cls in methods().items()
                     if option in cls.defaults)


def resumable_flags() -> str:
    """The flags a resumed run may change, for help texts and errors."""
    return ", ".join("--" + o.replace("_", "-") for o in RESUMABLE + LAYOUT)


def duration_seconds(text: str) -> float | None:
    """Seconds in a duration such as ``90s``, ``30m``, ``1.5h`` (a bare number: seconds);
    None when ``text`` is not one.

    Args:
        text: the duration.
    """
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    scale = units.get(text[-1:], None)
    try:
        value = float(text[:-1] if scale else text)
    except ValueError:
        return None
    return value * (scale or 1) if value == value and value != float("inf") else None


def at_least_one(cfg, *names: str) -> None:
    """Each named integer option is >= 1 where given (None: left to its default)."""
    for name in names:
        value = cfg.option(name)
        need(cfg, value is None or value >= 1, name, "must be an integer >= 1")


def betas(cfg) -> tuple[float, float]:
    """The inner AdamW betas from ``adam_betas`` (``"0.9,0.95"``).

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: not two numbers in [0, 1).
    """
    try:
        b1, b2 = (float(v) for v in str(cfg.optim.adam_betas).split(","))
    except ValueError:
        b1 = b2 = math.nan
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError("adam_betas", f"expected two numbers in [0, 1) such as 0.9,0.95 "
                          f"(got {cfg.optim.adam_betas!r})")
    return b1, b2


def check_inner_optimizer(cfg) -> None:
    """``inner_optimizer`` muon not with FSDP2 workers: Muon orthogonalises each weight
    matrix whole (Newton-Schulz), and ``worker_parallel`` fsdp shards them over the ranks.

    Raises:
        ConfigError: naming ``inner_optimizer``.
    """
    if cfg.optim.inner_optimizer == "muon" and cfg.runtime.worker_parallel == "fsdp":
        raise ConfigError("inner_optimizer", "muon orthogonalises each weight matrix whole "
                          "and --worker-parallel fsdp shards them over the worker's ranks: "
                          "use --worker-parallel ddp or --inner-optimizer adamw (got muon "
                          "with fsdp)")


def worker_speeds(cfg) -> tuple[float, ...] | None:
    """Each worker's speed factor from ``worker_speed`` (``"1,1,0.5,0.33"``); None without.

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: not one number in (0, 1] per worker (``workers``).
    """
    if cfg.runtime.worker_speed is None:
        return None
    try:
        speeds = tuple(float(v) for v in str(cfg.runtime.worker_speed).split(","))
    except ValueError:
        speeds = (math.nan,)
    if not all(0 < v <= 1 for v in speeds):
        raise ConfigError("worker_speed", "must be numbers in (0, 1], one per worker, e.g. "
                          f"1,1,0.5,0.33 (got {cfg.runtime.worker_speed!r})")
    if len(speeds) != cfg.runtime.workers:
        raise ConfigError("worker_speed", f"needs one factor per worker: {cfg.runtime.workers} "
                          f"(--workers), got {len(speeds)} ({cfg.runtime.worker_speed!r})")
    return speeds


def check_local_steps(cfg) -> None:
    """``local_steps`` proportional only where a round of H steps and a global copy exist,
    with workers of one rank and one stage; ``max_staleness`` >= 0, and above 0
    (asynchronous outer steps) only with proportional local steps, one fragment, no overlap
    and no eager updates.

    Raises:
        ConfigError: naming ``local_steps`` or ``max_staleness`` and what it needs.
    """
    need(cfg, cfg.runtime.max_staleness >= 0, "max_staleness", "must be an integer >= 0 (0: "
         "synchronous outer steps)")
    if cfg.runtime.max_staleness:
        check_asynchronous(cfg)
    if cfg.runtime.local_steps != "proportional":
        return
    if not cfg.method_class.global_copy:
        raise ConfigError("local_steps", "proportional needs a method with rounds of H steps "
                          f"and a global copy (diloco, streaming, sparseloco; got "
                          f"--algorithm {cfg.method.algorithm})")
    for name, ok in (("worker_ranks", cfg.runtime.worker_ranks == 1), ("stages", cfg.runtime.stages == 1)):
        if not ok:
            raise ConfigError("local_steps", f"proportional is not supported with --"
                              f"{name.replace('_', '-')} yet (got {cfg.option(name)})")


def check_asynchronous(cfg) -> None:
    """Asynchronous outer steps (``max_staleness`` > 0) pace the rounds by the workers'
    speeds (what else they need of the method, a whole-model sync that nothing overlaps, is
    the method's check: ``loco.algorithms.asynchronous.check_whole_model``).

    Raises:
        ConfigError: naming ``max_staleness`` and what it needs.
    """
    if cfg.runtime.local_steps != "proportional":
        raise ConfigError("max_staleness", "asynchronous outer steps share each round by the "
                          "workers' speeds: add --local-steps proportional (got --local-steps "
                          f"{cfg.runtime.local_steps})")


def check_fault(cfg) -> None:
    """``fault`` parses as ``$LOCO_FAULT`` does, its rank one of the run's.

    Raises:
        ConfigError: naming ``fault`` and the form it takes.
    """
    if cfg.runtime.fault is None:
        return
    try:
        fault = Fault.parse(cfg.runtime.fault)
    except ValueError as e:
        raise ConfigError("fault", str(e).replace(f"{ENV} ", "")) from None
    ranks = cfg.runtime.workers * cfg.runtime.worker_ranks * cfg.runtime.stages
    need(cfg, 0 <= fault.rank < ranks and fault.step >= 1, "fault",
         f"RANK must be in [0, {ranks}) and STEP >= 1")


def check_worker_layout(cfg) -> None:
    """More than one rank per worker not with pipeline stages; ``worker_parallel`` fsdp only
    with ``worker_ranks`` > 1 (the launcher it needs: the preflight step).

    Raises:
        ConfigError: naming ``worker_ranks`` or ``worker_parallel`` and what is allowed.
    """
    if cfg.runtime.worker_ranks > 1 and cfg.runtime.stages > 1:
        raise ConfigError("worker_ranks", f"more than one rank per worker with pipeline stages "
                          f"(--stages {cfg.runtime.stages}) is not supported yet; use --worker-ranks 1 "
                          f"or --stages 1 (got {cfg.runtime.worker_ranks})")
    if cfg.runtime.worker_parallel == "fsdp" and cfg.runtime.worker_ranks < 2:
        raise ConfigError("worker_parallel", "fsdp shards a worker's model over its ranks: add "
                          "--worker-ranks 2 or more (got fsdp with --worker-ranks "
                          f"{cfg.runtime.worker_ranks})")


def check_elastic(cfg) -> None:
    """``elastic``'s options only with it; ``lighthouse`` and ``worker_index`` together,
    the index in [0, ``workers``); no pipeline stages (nor a method's options that need a
    fixed group, e.g. ``eval_replicas``: the method's check);
    ``min_workers`` in [1, ``workers``]; ``start_wait`` finite and > 0. (Where its workers
    may start: the preflight step.)

    Raises:
        ConfigError: naming the option and what is allowed.
    """
    for name in ("min_workers", "lighthouse", "worker_index", "start_wait"):
        if cfg.option(name) is not None and not cfg.runtime.elastic:
            raise ConfigError(name, f"only means something with --elastic (got "
                              f"{cfg.option(name)})")
    if not cfg.runtime.elastic:
        return
    if (cfg.runtime.lighthouse is None) != (cfg.runtime.worker_index is None):
        raise ConfigError("worker_index" if cfg.runtime.worker_index is None else "lighthouse",
                          "--lighthouse and --worker-index go together: this process is one "
                          f"worker of that Lighthouse's job (got --lighthouse "
                          f"{cfg.runtime.lighthouse}, --worker-index {cfg.runtime.worker_index})")
    if cfg.runtime.worker_index is not None and not 0 <= cfg.runtime.worker_index < cfg.runtime.workers:
        raise ConfigError("worker_index", f"must be in [0, --workers {cfg.runtime.workers}) (got "
                          f"{cfg.runtime.worker_index})")
    if cfg.runtime.stages != 1:
        raise ConfigError("stages", "must be 1 with --elastic: elastic workers are not "
                          f"pipelines for now (got {cfg.runtime.stages})")
    if cfg.runtime.min_workers is not None and not 1 <= cfg.runtime.min_workers <= cfg.runtime.workers:
        raise ConfigError("min_workers", f"must be in [1, --workers {cfg.runtime.workers}] (got "
                          f"{cfg.runtime.min_workers})")
    wait = cfg.runtime.start_wait
    if wait is not None and not (math.isfinite(wait) and wait > 0):
        raise ConfigError("start_wait", f"must be a number of seconds > 0 (got {wait})")


@dataclass
class MethodOptions:
    """The method, and the options that several methods' outer loops share: H, the outer
    optimizer, the replicas' spread. Each method's own options are declared by its class
    (``Method.options``) and belong to this section too."""

    section: ClassVar[str] = "method"

    algorithm: str = opt("streaming", "training method: " + ", ".join(
        f"{name} ({cls.title})" for name, cls in methods().items()), algorithm_names)
    sync_every: int | None = opt(None, "H: the inner steps of a round: a method with "
                                 "syncs every H syncs the same parameters once a round "
                                 "(larger H sends fewer bytes but lets workers drift further "
                                 "apart); for every method, checkpoints (--checkpoint-every) "
                                 "and replica checks (--verify-every) count rounds, also for "
                                 "those that sync every step or never (ddp, demo, sparta, "
                                 "local) (default: the method's, the papers' "
                                 "but for streaming, whose paper uses 100 for runs of "
                                 "thousands of steps: "
                                 f"{method_defaults('sync_every')})")
    outer_lr: float | None = opt(None, "outer learning rate (NoLoCo's beta) (default: the "
                                 f"method's, the papers': {method_defaults('outer_lr')})")
    outer_momentum: float | None = opt(None, "outer momentum (NoLoCo's alpha), in [0, 1) "
                                       "(default: the method's, the papers': "
                                       f"{method_defaults('outer_momentum')})")
    nesterov: bool | None = opt(None, "Nesterov outer momentum, or --no-nesterov for heavy-ball "
                                "(default: the method's, as the papers' code: "
                                f"{method_defaults('nesterov')})")
    spread_every: int = opt(50, "log the RMS distance of the replicas to their mean every this "
                            "many steps (noloco, local; 0 disables). A diagnostic, not part of "
                            "the algorithm: an all-worker all-reduce of the full model (noloco "
                            "has no other collective), kept out of the training bytes, the "
                            "blocked time, compute utilization and train_seconds")
    final_average: bool = opt(False, "noloco, local: end with every replica replaced by the "
                              "replicas' average, and report that as the final model")

    @staticmethod
    def check(cfg) -> None:
        """H >= 1 where given; outer lr finite and > 0; outer momentum in [0, 1); the spread
        every >= 0 steps. (The method's own options: its class's ``check``.)"""
        at_least_one(cfg, "sync_every")
        if cfg.method.outer_lr is not None:
            need(cfg, math.isfinite(cfg.method.outer_lr) and cfg.method.outer_lr > 0, "outer_lr",
                 "must be a number > 0")
        if cfg.method.outer_momentum is not None:
            need(cfg, 0 <= cfg.method.outer_momentum < 1, "outer_momentum", "must be in [0, 1)")
        need(cfg, cfg.method.spread_every >= 0, "spread_every", "must be an integer >= 0")


@dataclass
class OptimOptions:
    """The inner optimization: the learning-rate schedule, the optimizer (AdamW or Muon),
    weight decay and clipping."""

    section: ClassVar[str] = "optim"

    lr: float = opt(3e-3, "peak inner learning rate (AdamW's, and Muon's with "
                    "--inner-optimizer muon)")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at lr x this ratio")
    warmup: int = opt(50, "linear warm-up steps of the inner learning rate")
    weight_decay: float = opt(0.1, "inner weight decay, decoupled: AdamW's (and Muon's with "
                              "--inner-optimizer muon) (the NoLoCo paper: 0)")
    adam_betas: str = opt("0.9,0.95", "inner AdamW betas b1,b2 (the NoLoCo paper: 0.9,0.999)")
    inner_optimizer: str = opt(
        "adamw", "the inner optimizer of every method: adamw on every parameter; or muon "
        "(MuLoCo): torch.optim.Muon on the 2-D weight matrices of the transformer blocks "
        "(attention and MLP projections), AdamW on the embeddings, the output head (tied or "
        "not), norms, biases and anything not 2-D. Muon: momentum 0.95, Nesterov, 5 "
        "Newton-Schulz steps, its update scaled to AdamW's RMS (match_rms_adamw) so that --lr "
        "and its schedule serve both; --weight-decay on Muon's matrices and AdamW's 2-D "
        "weights. Not with --worker-parallel fsdp (Muon needs each matrix whole)",
        INNER_OPTIMIZERS)
    muon_lr: float | None = opt(None, "Muon's own peak learning rate (--inner-optimizer muon), on "
                                "the same warm-up and cosine schedule as --lr (AdamW's, on the "
                                "rest); default: --lr, which --muon-scale adamw-rms makes "
                                "serve both. MuLoCo and CCLoco sweep a separate Muon rate "
                                "(0.02 against AdamW's 1e-3, with --muon-scale original)")
    muon_scale: str = opt("adamw-rms", "how Muon scales its orthogonalised update "
                          "(--inner-optimizer muon): adamw-rms (by 0.2 sqrt(max(rows, "
                          "columns)), to AdamW's update RMS: Moonshot's 'Muon is Scalable "
                          "for LLM Training', torch.optim.Muon's match_rms_adamw) or original "
                          "(by sqrt(max(1, rows/columns)): Keller Jordan's Muon, as MuLoCo "
                          "and CCLoco run it)", MUON_SCALES)
    grad_clip: float = opt(1.0, "clip the (averaged) gradient norm to this; 0 disables")

    @staticmethod
    def check(cfg) -> None:
        """lr (and Muon's) finite and > 0, the schedule's and AdamW's ranges; Muon's options
        only with Muon."""
        need(cfg, cfg.optim.warmup >= 0, "warmup", "must be an integer >= 0")
        need(cfg, math.isfinite(cfg.optim.lr) and cfg.optim.lr > 0, "lr", "must be a number > 0")
        need(cfg, 0 <= cfg.optim.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        need(cfg, cfg.optim.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(cfg, cfg.optim.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        betas(cfg)
        check_inner_optimizer(cfg)
        need(cfg, cfg.optim.muon_lr is None or (math.isfinite(cfg.optim.muon_lr) and cfg.optim.muon_lr > 0),
             "muon_lr", "must be a number > 0")
        for name, default in (("muon_lr", None), ("muon_scale", "adamw-rms")):
            need(cfg, cfg.option(name) == default or cfg.optim.inner_optimizer == "muon", name,
                 "needs --inner-optimizer muon (AdamW alone has no Muon rate or scaling)")


@dataclass
class ModelOptions:
    """The model: a built-in size or a Hugging Face causal LM, its dimensions and precision."""

    section: ClassVar[str] = "model"

    model: str = opt("small", "model size: tiny (~0.1M params, tests), small (~1.3M, CPU "
                     "default), medium (~7.5M), large (~100M), xl (~300M), or the Streaming "
                     "DiLoCo paper's ladder: 35m, 100m, 200m, 300m, 500m, 1b (layers x d: "
                     "6x512 ... 24x2048, head size 64); Llama 3's shapes: 8b, 70b (32x4096, "
                     "80x8192, 8 key/value heads); or hf:PATH, a Hugging Face causal LM: "
                     "a local directory with a config.json (random init) and optionally its "
                     "weights (loaded, never downloaded), e.g. hf:configs/llama-35m")
    layers: int | None = opt(None, "blocks of the model, overriding --model's (default: the "
                             "named size's)")
    dim: int | None = opt(None, "d_model, overriding --model's; a multiple of --heads with an "
                          "even head size (default: the named size's)")
    heads: int | None = opt(None, "attention heads, overriding --model's (default: the named "
                            "size's)")
    z_loss: float = opt(0.0, "z-loss coefficient on the log-partition function (0 disables)")
    dtype: str = opt("fp32", "compute precision: fp32, or bf16 autocast (faster on GPUs and "
                     "on CPUs with AMX at d_model >= 256)", DTYPES)

    @property
    def name(self) -> str:
        """The model's name: a size of the built-in model or ``hf:PATH`` (the ``model``
        option: ``cfg.model.name``)."""
        return self.model

    @staticmethod
    def check(cfg) -> None:
        """A known size or ``hf:PATH``; dimensions >= 1 where given; z-loss >= 0."""
        from loco.model import MODEL_SIZES

        need(cfg, cfg.model.name in MODEL_SIZES or cfg.model.name.startswith("hf:"), "model",
             f"must be one of {', '.join(MODEL_SIZES)}, or hf:PATH")
        for name in ("layers", "dim", "heads"):
            need(cfg, cfg.option(name) is None or cfg.option(name) >= 1, name,
                 "must be an integer >= 1")
        need(cfg, cfg.model.z_loss >= 0, "z_loss", "must be >= 0")


@dataclass
class DataOptions:
    """The data: corpus, tokenizer, batches, held-out split and cache."""

    section: ClassVar[str] = "data"

    corpus: str = opt("shakespeare", "training text: 'shakespeare' (bundled), a text file, "
                      "a .jsonl, .parquet or .arrow file, a glob of them ('data/*.parquet'), a "
                      "directory of them, or a Hugging Face datasets directory (save_to_disk)")
    text_field: str = opt("text", "field holding the text in JSONL, Parquet, Arrow and "
                          "Hugging Face datasets corpora")
    tokenizer: str | None = opt(None, "a tokenizer.json or a Hugging Face tokenizer directory "
                                "to use instead of training a BPE (--vocab-size is then the "
                                "tokenizer's) (default: train a byte-level BPE on the corpus)")
    vocab_size: int = opt(4096, "byte-level BPE vocabulary size (trained once, then cached)")
    val_fraction: float = opt(0.05, "fraction of the text held out for evaluation")
    cache_dir: str | None = opt(None, "where tokenizers and tokenized data are cached "
                                "(default: $LOCO_CACHE or ~/.cache/loco)")
    eval_corpus: str | None = opt(None, "a second held-out set, in any --corpus format, whose "
                                  "loss is reported next to the validation split's at every "
                                  "evaluation (eval_loss_extra) (default: none)")
    batch_size: int = opt(8, "sequences per worker per inner step")
    seq_len: int = opt(128, "tokens per sequence (context length)")

    @staticmethod
    def check(cfg) -> None:
        """The held-out share in (0, 0.5]; a vocabulary of at least the byte symbols; a batch
        of >= 1 sequences of >= 2 tokens."""
        at_least_one(cfg, "batch_size")
        need(cfg, cfg.data.seq_len >= 2, "seq_len", "must be an integer >= 2")
        need(cfg, 0 < cfg.data.val_fraction <= 0.5, "val_fraction", "must be in (0, 0.5]")
        need(cfg, 257 <= cfg.data.vocab_size <= 1 << 20, "vocab_size",
             "must be in [257, 1048576] (256 byte symbols plus the end-of-text token)")


@dataclass
class CommunicationOptions:
    """The links between workers and inside one: emulated bandwidth and latency, time-outs."""

    section: ClassVar[str] = "comm"

    link_bandwidth: str | None = opt(None, "emulate a slow link of this rate per rank, e.g. "
                                     "100Mbit or 1Gbit: an operation moving B bytes takes at "
                                     "least B x 8 / rate, transfers queue, compute goes on; "
                                     "shapes the slow link between workers only, not the fast "
                                     "link inside one (--fast-link-bandwidth) (default: no "
                                     "emulation)")
    link_latency: str | None = opt(None, "emulated one-way latency added to every "
                                   "communication over the slow link, once per dependent phase "
                                   "(twice for an all-reduce), e.g. 50ms (default: none)")
    fast_link_bandwidth: str | None = opt(None, "with --worker-ranks > 1: emulate the fast "
                                          "link between the ranks of a worker at this rate "
                                          "per rank, as --link-bandwidth does for the slow "
                                          "link, e.g. 100Gbit; it shapes the traffic of the "
                                          "worker's Comm, not FSDP2's own all-gathers and "
                                          "reduce-scatters (--worker-parallel fsdp) (default: "
                                          "no emulation)")
    fast_link_latency: str | None = opt(None, "with --worker-ranks > 1: emulated one-way "
                                        "latency of the fast link, as --link-latency, e.g. "
                                        "10us (default: none)")
    comm_timeout: float = opt(300.0, "seconds a communication may take before the run "
                              "fails instead of hanging")

    @staticmethod
    def check(cfg) -> None:
        """The links' rates and latencies parse; the time-out is finite and > 0."""
        from loco.comm.link import parse_bandwidth, parse_latency

        need(cfg, math.isfinite(cfg.comm.comm_timeout) and cfg.comm.comm_timeout > 0, "comm_timeout",
             "must be a number > 0")
        for name, parse in (("link_bandwidth", parse_bandwidth), ("link_latency", parse_latency),
                            ("fast_link_bandwidth", parse_bandwidth),
                            ("fast_link_latency", parse_latency)):
            if cfg.option(name) is not None:
                try:
                    parse(cfg.option(name))
                except ValueError as e:
                    raise ConfigError(name, str(e)) from None


@dataclass
class RuntimeOptions:
    """How the run is laid out and kept alive: M replicas, S stages, R shards, the launcher, checkpoints, restarts and elastic membership."""

    section: ClassVar[str] = "runtime"

    workers: int = opt(4, "number of workers M (replicas), each with its own data shard")
    stages: int = opt(1, "S: pipeline stages per replica; the model's blocks are split into S "
                      "contiguous stages (embedding on the first, head on the last), each on "
                      "a rank of its own, so a run uses workers x S ranks; outer algorithms "
                      "sync among the replicas of each stage")
    routing: str = opt("fixed", "with --stages > 1: fixed (each replica keeps its own "
                       "pipeline) or random (each sample crosses every stage boundary to a "
                       "replica drawn from a shared seed, as NoLoCo's random routing); "
                       "evaluation always uses fixed routing", ROUTINGS)
    worker_ranks: int = opt(1, "R: ranks per worker, joined by a fast link (--fast-link-*): "
                            "each reads its own batch, they train one replica together and "
                            "each sends 1/R of the worker's pseudo-gradient over the slow link; "
                            "a run uses workers x R ranks; not yet with --stages > 1")
    worker_parallel: str = opt("ddp", "with --worker-ranks > 1: how a worker's ranks split its "
                               "replica: ddp (each holds the whole model, gradients averaged "
                               "over the fast link) or fsdp (FSDP2 shards parameters, gradients "
                               "and optimizer state over them; needs --launcher processes or "
                               "torchrun)", WORKER_PARALLEL)
    launcher: str = opt("threads", "how workers run: threads of this process (fast start), "
                        "local processes (torch elastic), or torchrun (detected from its "
                        "environment)", LAUNCHER_NAMES)
    checkpoint_every: int = opt(1, "save a checkpoint every this many outer rounds of H "
                                "(--sync-every) inner steps, at the first step with no sync in "
                                "flight (streaming: tau steps after the round's end), and at "
                                "the end; 0: only at the end. Each rank writes its own file "
                                "atomically in the background, with no collective")
    checkpoint_interval: str | None = opt(None, "also save a checkpoint at the first round "
                                          "end at which this much training time has "
                                          "passed since the last one (or the start), e.g. "
                                          "90s, 30m, 2h; every rank agrees on it with one "
                                          "tiny collective per round (default: by rounds "
                                          "only)")
    keep_checkpoints: int = opt(1, "how many of the newest complete checkpoints to keep on "
                                "disk, >= 1 (older ones are removed once a newer one is "
                                "committed)")
    resume: str | None = opt(None, "continue the run in this directory from its last "
                             "checkpoint, exactly; its options are reused, and only "
                             f"{resumable_flags()}"
                             " may change")
    max_restarts: int = opt(2, "processes launcher: when a worker process dies, restart all "
                            "of them from the last checkpoint, at most this many times "
                            "(with --elastic: restart that worker alone, at most this many "
                            "times per worker; under torchrun, give torchrun --max-restarts)")
    elastic: bool = opt(False, "elastic membership (torchft): a worker that dies is "
                        "restarted alone (at most --max-restarts times each) and joins from a "
                        "live worker's state while the others keep training; every sync "
                        "averages over the workers alive then. Processes launcher (or one "
                        "process per worker with --lighthouse, also under torchrun), workers of "
                        "one rank, no pipeline stages; checkpoints are the lead worker's one "
                        "file (resuming restarts every replica from the global copy); no "
                        "spread diagnostic or --eval-replicas yet")
    min_workers: int | None = opt(None, "with --elastic: the fewest live workers a sync counts "
                                  "with; below it the workers wait (at most --comm-timeout) "
                                  "for more (default: a majority, workers // 2 + 1)")
    start_wait: float | None = opt(None, "with --elastic: seconds the workers that start "
                                   "together wait for all --workers before they begin with "
                                   "those that came (at least --min-workers); a worker "
                                   "started later joins the running job (default: "
                                   "--comm-timeout)")
    lighthouse: str | None = opt(None, "with --elastic: the address (http://host:port) of a "
                                 "running torchft Lighthouse (torchft_lighthouse "
                                 "--min_replicas N); this process is then one worker, "
                                 "--worker-index, started by hand or by torchrun (one process "
                                 "per worker) on any machine (default: loco starts the "
                                 "Lighthouse and all workers on this machine)")
    worker_index: int | None = opt(None, "with --lighthouse: this process's worker, in [0, "
                                   "--workers)")
    worker_speed: str | None = opt(None, "emulate workers of unequal speed: one factor in "
                                   "(0, 1] per worker, e.g. 1,1,0.5,0.33: each inner step of "
                                   "worker i takes 1/factor_i of its measured time (it sleeps "
                                   "the difference after the step's forward and backward, so "
                                   "the CPU is not burned); the summary records the speeds "
                                   "and the goodput (default: every worker at its own speed)")
    local_steps: str = opt("fixed", "inner steps per round of each worker: fixed (H each) or "
                           "proportional to its measured speed (the fastest trains H, a "
                           "worker at half its speed H/2, so that none waits at the sync; "
                           "pseudo-gradients weighed by the steps behind them; agreed by all "
                           "workers at every round's end); proportional: diloco, streaming and "
                           "sparseloco, workers of one rank, no pipeline stages",
                           LOCAL_STEPS)
    max_staleness: int = opt(0, "asynchronous outer steps (with --local-steps proportional): "
                             "a worker's block of H inner steps may span up to this many "
                             "more rounds, its pseudo-gradient applied at the sync that ends "
                             "it, token-weighted with the others that arrive there; "
                             "meanwhile it sends zeros and keeps training; 0: synchronous "
                             "(every worker sends every round's steps)")
    quorum: int | None = opt(None, "Decoupled DiLoCo's minimum quorum (with --max-staleness): "
                             "a sync merges only once this many workers' blocks are ready "
                             "(H steps, or due by --max-staleness), else it is held (nothing "
                             "sent, no outer step, every block goes on); the workers agree on "
                             "when their blocks arrived with one small all-gather per sync "
                             "(default: none, every ready block merges at once)")
    grace: float | None = opt(None, "with --quorum: seconds after the quorum-th ready arrival "
                              "within which a block not ready yet is merged too, with the "
                              "steps it holds, token-weighted (Decoupled DiLoCo's grace "
                              "window; loco does not wait for it) (default: 0)")
    fault: str | None = opt(None, "a drill: one rank fails once, RANK:STEP[:KIND] as "
                            "$LOCO_FAULT (docs/reliability.md): rank RANK fails at inner step "
                            "STEP of a fresh run (KIND raise, exit, kill, hang or nan; default "
                            "raise); with --elastic a worker that exits or is killed is "
                            "restarted and rejoins (default: $LOCO_FAULT, else none)")
    on_nonfinite: str = opt("stop", "a non-finite gradient or pseudo-gradient is caught before "
                            "it reaches the parameters; stop the run (the last checkpoint is "
                            "the last good state) or skip that step or sync and count it",
                            NONFINITE)

    @staticmethod
    def check(cfg) -> None:
        """M and R >= 1; checkpoints every >= 0 rounds, >= 1 kept; restarts in [0, 100]; the worker
        layout and elastic membership (``check_layout_options``, ``check_elastic``)."""
        at_least_one(cfg, "workers", "worker_ranks")
        need(cfg, cfg.runtime.checkpoint_every >= 0, "checkpoint_every", "must be an integer >= 0 "
             "(0: only at the end)")
        need(cfg, cfg.runtime.keep_checkpoints >= 1, "keep_checkpoints", "must be an integer >= 1")
        if cfg.runtime.checkpoint_interval is not None:
            need(cfg, (duration_seconds(cfg.runtime.checkpoint_interval) or 0) > 0,
                 "checkpoint_interval", "must be a positive duration: a number with s, m or "
                 f"h (e.g. 90s, 30m, 2h; got {cfg.runtime.checkpoint_interval!r})")
        need(cfg, 0 <= cfg.runtime.max_restarts <= 100, "max_restarts", "must be in [0, 100]")
        worker_speeds(cfg)
        check_local_steps(cfg)
        check_quorum(cfg)
        check_fault(cfg)
        check_worker_layout(cfg)
        check_elastic(cfg)


@dataclass
class RunOptions:
    """The run: its budget, seed and evaluation, and what it writes and shows (its directory,
    metrics, progress, profiles and dashboards)."""

    section: ClassVar[str] = "run"

    steps: int | None = opt(None, "inner steps per worker (total tokens = steps x workers x "
                            f"batch-size x seq-len) (default: {DEFAULT_STEPS}, or what "
                            "--tokens asks for)")
    tokens: str | None = opt(None, "token budget instead of --steps: a count (2e7) or tokens "
                             "per model parameter (20x, Chinchilla's ratio); the steps are "
                             "rounded up to whole batches of all workers")
    seed: int = opt(0, "seed for weights, data order and everything random")
    eval_every: int = opt(100, "evaluate the global model every this many inner steps "
                          "(0: only at the end)")
    eval_batches: int = opt(8, "batches per periodic evaluation")
    final_eval_batches: int = opt(100, "at most this many batches in the final evaluation")

    out: str | None = opt(None, "run directory (default: runs/<algorithm>-<time>)")
    log_every: int = opt(10, "write a metrics record every this many inner steps")
    progress: bool = opt(True, "show a progress bar (--no-progress to hide it)")
    profile: str | None = opt(None, "profile these inner steps with torch.profiler, A-B "
                              "(inclusive, e.g. 20-30) or one step N, within [1, --steps], and "
                              "write a Chrome/Perfetto trace of them to "
                              "<out>/profile/trace-rank<r>.json, with a range for each phase of "
                              "a sync (loco/encode, loco/all_to_all, loco/wait, ...); a few "
                              "steps after warm-up are enough (default: no profiling)")
    tensorboard: bool = opt(False, "also log every metric, sync and the summary to TensorBoard "
                            "event files under <out>/tensorboard (needs the extra: pip install "
                            "'loco[tensorboard]')")
    wandb: bool = opt(False, "also log every metric, sync and the summary to Weights & Biases "
                      "(needs the extra: pip install 'loco[wandb]')")
    wandb_project: str = opt("loco", "the W&B project of --wandb")
    wandb_run_name: str | None = opt(None, "the W&B run name of --wandb (default: the run "
                                     "directory's name)")
    wandb_mode: str = opt("offline", "online: stream to the W&B server; offline: write the run "
                          "under <out>/wandb, to upload later with wandb sync (needs no "
                          "network)", ("offline", "online"))

    @staticmethod
    def check(cfg) -> None:
        """Counts >= 1 (``steps`` where given), evaluations every >= 0 steps, a metrics
        record every >= 1 steps."""
        at_least_one(cfg, "steps", "eval_batches", "final_eval_batches", "log_every")
        need(cfg, cfg.run.eval_every >= 0, "eval_every", "must be an integer >= 0")
