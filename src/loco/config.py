"""The typed training configuration.

Every option is a dataclass field with a default and a help text that says what it trades off;
the same fields become ``loco train``'s flags and the keys of its YAML ``--config`` file.
Precedence: defaults < YAML file < flags. :func:`validate` checks every value before any
worker starts and raises :class:`ConfigError` naming the option and what is allowed.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from loco.comm.formats import CODEC_NAMES  # torch-free, so that --help is quick

ALGORITHM_NAMES = ("streaming", "diloco", "noloco", "ddp", "local")
PATTERNS = ("strided", "sequential")
#: The papers' outer optimizers, used where --outer-lr, --outer-momentum, --[no-]nesterov
#: are not given: (lr, momentum, Nesterov). NoLoCo's lr and momentum are its β and α.
OUTER_DEFAULTS = {"diloco": (0.7, 0.9, True), "streaming": (0.4, 0.9, True),
                  "noloco": (0.7, 0.5, False)}
#: H (--sync-every) where it is not given: the Streaming DiLoCo paper's H = 100 for it and
#: for its DiLoCo baseline, the NoLoCo paper's H = 50; for ddp and local, H only sets the
#: checkpoint rounds.
SYNC_DEFAULTS = {"streaming": 100, "diloco": 100, "noloco": 50, "ddp": 50, "local": 50}
DEFAULT_STEPS = 400
"""Inner steps when neither --steps nor --tokens is given."""
GRAD_CODECS = ("fp32", "bf16")
LAUNCHER_NAMES = ("threads", "processes", "torchrun")
ROUTINGS = ("fixed", "random")
NONFINITE = ("stop", "skip")
WORKER_PARALLEL = ("ddp", "fsdp")
"""How the ranks of one worker (``--worker-ranks``) split its replica: ddp (each holds the
whole model and their gradients are averaged) or fsdp (FSDP2 shards the model over them)."""
#: The worker layout a checkpoint is written for: a resumed run must keep it.
LAYOUT = ("worker_ranks", "worker_parallel")
#: Options a resumed run may change: how it runs, not what it computes.
RESUMABLE = ("launcher", "progress", "comm_timeout", "checkpoint_every", "max_restarts",
             "on_nonfinite", "resume", "out", "tensorboard", "wandb", "wandb_project",
             "wandb_run_name", "wandb_mode", "profile")
DTYPES = ("fp32", "bf16")


class ConfigError(ValueError):
    """A bad option: ``option`` is the flag's name, the message says what is allowed.

    The message reads ``--option-name: message``; the command line prints it in one line
    and exits with code 2.

    Args:
        option: the option's name, as a field name (``sync_every``) or a flag without the
            dashes.
        message: what is wrong and what is allowed.
    """

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"--{option.replace('_', '-')}: {message}")


RENAMED = {"alpha": "mixing"}
"""Old option names still accepted (flags, YAML keys, ``--set``, saved runs), by old name:
``--alpha`` was Streaming DiLoCo's mixing factor, a name NoLoCo's momentum α also claims."""


def canonical(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` by field name with old names (``RENAMED``) replaced by the current ones.

    Args:
        values: option values by name (YAML keys, saved configurations, flags).

    Raises:
        ConfigError: an option given under both its old and its new name.
    """
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ConfigError(new, f"given twice, as {new} and as its old name {old}")
            out[new] = out.pop(old)
    return out


def opt(default, help: str, choices: tuple | None = None, **kw):
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclass
class TrainConfig:
    """Every option of ``loco train``, with its default.

    Each field is a flag (``sync_every``: ``--sync-every``) and a key of the YAML
    ``--config`` file; its help text is ``field.metadata["help"]`` and its allowed values,
    where they are a list, ``field.metadata["choices"]``; ``loco train --help`` and the
    options table of the API reference list them all.
    Build one with [`build_config`][loco.config.build_config] (which converts YAML values),
    fill the defaults that depend on the algorithm with
    [`resolve`][loco.config.resolve], and check it with [`validate`][loco.config.validate].
    """

    # --- method
    algorithm: str = opt("streaming", "training method: streaming (Streaming DiLoCo: one "
                         "fragment at a time, overlapped, 4-bit), diloco (outer step every H "
                         "inner steps), noloco (gossip in random groups, no collective), ddp "
                         "(gradients averaged every step), local (no communication)",
                         ALGORITHM_NAMES)
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
    sync_every: int | None = opt(None, "H: inner steps between two syncs of the same "
                                 "parameters; larger H sends fewer bytes but lets workers "
                                 "drift further apart (default: the papers' 100 for streaming "
                                 "and diloco, 50 for noloco; for ddp and local, 50 steps per "
                                 "checkpoint round)")
    outer_lr: float | None = opt(None, "outer learning rate (NoLoCo's beta) (default: the "
                                 "papers' 0.7 for diloco and noloco, 0.4 for streaming)")
    outer_momentum: float | None = opt(None, "outer momentum (NoLoCo's alpha), in [0, 1) "
                                       "(default: 0.9 for diloco and streaming, 0.5 for noloco)")
    nesterov: bool | None = opt(None, "Nesterov outer momentum, or --no-nesterov for heavy-ball "
                                "(default: on for diloco and streaming, off for noloco, as "
                                "the papers' code)")
    fragments: int = opt(2, "P (streaming): fragments the model's blocks are split into, each "
                         "synced once every H steps: fragment p at step floor((p + 1) H / P) of "
                         "each round, so any P <= H works; the peak bytes of a sync are those "
                         "of the largest fragment")
    fragment_pattern: str = opt("strided", "how blocks are dealt to fragments (streaming): "
                                "strided (block i to fragment i mod P) or sequential",
                                PATTERNS)
    overlap: str = opt("1", "tau (streaming): inner steps a sync stays in flight while training "
                       "goes on, 0 <= tau < floor(H/P) (the smallest gap between two sends); "
                       "hides the transfer time. One integer for every worker, or one per "
                       "worker: 1,1,2,5")
    mixing: float = opt(0.5, "mixing factor alpha (streaming): share of the local parameters "
                        "kept when a synced fragment is merged back, in [0, 1]; 0 replaces "
                        "them (old name: --alpha)")
    codec: str = opt("fp4_e3m0", "wire format of the pseudo-gradients (streaming); the "
                     "reduction itself is fp32", CODEC_NAMES)
    codec_keep: float | None = opt(None, "share of the values the sparse codecs (topk, "
                                   "dare, random_drop) send, in (0, 1] (default: 1/8, the "
                                   "bytes of 4 bits per value)")
    grad_codec: str = opt("fp32", "wire format of DataParallel's (ddp) gradients: fp32, or "
                          "bf16 as the Streaming DiLoCo paper's data-parallel baseline; the "
                          "reduction itself is fp32", GRAD_CODECS)
    codec_block: int = opt(32, "values per power-of-two scale of the 8- and 4-bit codecs; "
                           "larger blocks send fewer scale bytes but clip less evenly")
    group_size: int = opt(2, "n (noloco): workers per random gossip group, redrawn every outer "
                          "step; must divide --workers")
    gamma: float = opt(0.7, "gamma (noloco): pull of each worker's slow weights towards its "
                       "group's mean")
    spread_every: int = opt(50, "log the RMS distance of the replicas to their mean every this "
                            "many steps (noloco, local; 0 disables). A diagnostic, not part of "
                            "the algorithm: an all-worker all-reduce of the full model (noloco "
                            "has no other collective), kept out of the training bytes, the "
                            "blocked time, compute utilization and train_seconds")
    eval_replicas: bool = opt(False, "diloco, streaming: at the end also evaluate every "
                              "replica and the replicas' average, next to the global model "
                              "(the Streaming DiLoCo paper's Table 3); every worker evaluates "
                              "(noloco and local always do)")
    final_average: bool = opt(False, "noloco, local: end with every replica replaced by the "
                              "replicas' average, and report that as the final model")
    offload: bool = opt(False, "keep the global copy and outer optimizer state in CPU memory "
                        "(diloco, streaming)")
    # --- inner optimization
    steps: int | None = opt(None, "inner steps per worker (total tokens = steps x workers x "
                            f"batch-size x seq-len) (default: {DEFAULT_STEPS}, or what "
                            "--tokens asks for)")
    tokens: str | None = opt(None, "token budget instead of --steps: a count (2e7) or tokens "
                             "per model parameter (20x, Chinchilla's ratio); the steps are "
                             "rounded up to whole batches of all workers")
    batch_size: int = opt(8, "sequences per worker per inner step")
    seq_len: int = opt(128, "tokens per sequence (context length)")
    lr: float = opt(3e-3, "peak inner AdamW learning rate")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at lr x this ratio")
    warmup: int = opt(50, "linear warm-up steps of the inner learning rate")
    weight_decay: float = opt(0.1, "AdamW weight decay (the NoLoCo paper: 0)")
    adam_betas: str = opt("0.9,0.95", "inner AdamW betas b1,b2 (the NoLoCo paper: 0.9,0.999)")
    grad_clip: float = opt(1.0, "clip the (averaged) gradient norm to this; 0 disables")
    # --- model and data
    model: str = opt("small", "model size: tiny (~0.1M params, tests), small (~1.3M, CPU "
                     "default), medium (~7.5M), large (~100M), xl (~300M), or the Streaming "
                     "DiLoCo paper's ladder: 35m, 100m, 200m, 300m, 500m, 1b (layers x d: "
                     "6x512 ... 24x2048, head size 64); or hf:PATH, a Hugging Face causal LM: "
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
    seed: int = opt(0, "seed for weights, data order and everything random")
    # --- evaluation and output
    eval_every: int = opt(100, "evaluate the global model every this many inner steps "
                          "(0: only at the end)")
    eval_batches: int = opt(8, "batches per periodic evaluation")
    eval_corpus: str | None = opt(None, "a second held-out set, in any --corpus format, whose "
                                  "loss is reported next to the validation split's at every "
                                  "evaluation (eval_loss_extra) (default: none)")
    final_eval_batches: int = opt(100, "at most this many batches in the final evaluation")
    log_every: int = opt(10, "write a metrics record every this many inner steps")
    out: str | None = opt(None, "run directory (default: runs/<algorithm>-<time>)")
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
    # --- runtime
    launcher: str = opt("threads", "how workers run: threads of this process (fast start), "
                        "local processes (torch elastic), or torchrun (detected from its "
                        "environment)", LAUNCHER_NAMES)
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
    # --- reliability
    checkpoint_every: int = opt(1, "save a checkpoint every this many outer rounds of H "
                                "(--sync-every) inner steps, at the first step with no sync in "
                                "flight (streaming: tau steps after the round's end), and at "
                                "the end; 0: only at the end. Each rank writes its own file "
                                "atomically in the background, with no collective")
    resume: str | None = opt(None, "continue the run in this directory from its last "
                             "checkpoint, exactly; its options are reused, and only "
                             f"{', '.join('--' + o.replace('_', '-') for o in RESUMABLE[:6])}"
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
    lighthouse: str | None = opt(None, "with --elastic: the address (http://host:port) of a "
                                 "running torchft Lighthouse (torchft_lighthouse "
                                 "--min_replicas N); this process is then one worker, "
                                 "--worker-index, started by hand or by torchrun (one process "
                                 "per worker) on any machine (default: loco starts the "
                                 "Lighthouse and all workers on this machine)")
    worker_index: int | None = opt(None, "with --lighthouse: this process's worker, in [0, "
                                   "--workers)")
    on_nonfinite: str = opt("stop", "a non-finite gradient or pseudo-gradient is caught before "
                            "it reaches the parameters; stop the run (the last checkpoint is "
                            "the last good state) or skip that step or sync and count it",
                            NONFINITE)

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        """The option fields, in the order of the command line's help."""
        return list(dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The options by field name (what ``summary.json`` and the checkpoints record)."""
        return dataclasses.asdict(self)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens consumed by all workers in one inner step: every rank of every
        worker reads a batch."""
        return self.workers * self.worker_ranks * self.batch_size * self.seq_len


def load_yaml(path: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a YAML config file: data only (safe_load), keys must be known options (or one of
    ``extra``, which a command reads itself).

    Args:
        path: the YAML file, a mapping of option: value (keys with ``-`` or ``_``).
        extra: further keys allowed besides the TrainConfig fields; default none.

    Returns:
        The values by field name (dashes turned into underscores), not yet converted.

    Raises:
        ConfigError: the file is missing, not valid YAML, not a mapping, or has an unknown
            key.
    """
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of option: value")
    known = {f.name for f in TrainConfig.fields()} | set(extra)
    data = canonical({str(k).replace("-", "_"): v for k, v in data.items()})
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError("config", f"unknown option(s) in {path}: {', '.join(unknown)}")
    return data


def coerce(field_: dataclasses.Field, value: Any) -> Any:
    """Convert a YAML value to the field's type, with a ConfigError if it does not fit."""
    kind = field_.type if isinstance(field_.type, str) else field_.type.__name__
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(field_.name, "must not be empty")
    try:
        if kind.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if kind.startswith("float"):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(field_.name, f"expected {kind.split(' ')[0]}, got {value!r}") from None


def build_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A TrainConfig from the defaults, a YAML file and overrides, in that precedence.

    Every value is converted to its field's type; ranges are checked later, by
    [`validate`][loco.config.validate].

    Args:
        yaml_path: a YAML ``--config`` file (see [`load_yaml`][loco.config.load_yaml]);
            default None (none).
        overrides: values by field name that win over the file's (the flags given);
            default None (none).

    Raises:
        ConfigError: a bad file, an unknown key, or a value of the wrong type.
    """
    values: dict[str, Any] = {}
    if yaml_path:
        values.update(load_yaml(yaml_path))
    values.update(canonical(overrides or {}))
    by_name = {f.name: f for f in TrainConfig.fields()}
    return TrainConfig(**{k: coerce(by_name[k], v) for k, v in values.items()})


def model_dims(cfg: TrainConfig) -> dict[str, int]:
    """The model's ``n_layers``, ``d_model`` and ``n_heads``: the named size's, with
    ``layers``, ``dim`` and ``heads`` overriding them.

    Args:
        cfg: the configuration (``model`` must be a known size).
    """
    from loco.model import MODEL_SIZES

    base = MODEL_SIZES[cfg.model]
    return {"n_layers": cfg.layers or base["n_layers"], "d_model": cfg.dim or base["d_model"],
            "n_heads": cfg.heads or base["n_heads"]}


def steps_for_tokens(cfg: TrainConfig) -> int:
    """The inner steps that a ``tokens`` budget asks for, rounded up to whole steps of all
    workers: a count (``2e7``) or a multiple of the model's parameters (``20x``; embeddings
    counted, at ``vocab_size``).

    Args:
        cfg: the configuration, with ``tokens`` set.

    Raises:
        ConfigError: ``tokens`` is not a number > 0 or a ratio like ``20x``.
    """
    from loco.model import ModelConfig, parameter_count

    text = cfg.tokens.strip().lower()
    try:
        value = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError("tokens", f"expected a token count such as 2e7 or tokens per "
                          f"parameter such as 20x (got {cfg.tokens!r})")
    if text.endswith("x") and cfg.model.startswith("hf:"):
        from loco import hf

        value *= hf.parameter_count(cfg.model, cfg.vocab_size)
    elif text.endswith("x"):
        mcfg = ModelConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, **model_dims(cfg))
        value *= parameter_count(mcfg)
    return max(1, math.ceil(value / cfg.tokens_per_step))


def overlaps(cfg: TrainConfig) -> list[int]:
    """τ of every worker, from ``overlap`` (one integer for all, or one per worker).

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: not integers, or a list whose length is not ``workers``.
    """
    try:
        values = [int(v) for v in str(cfg.overlap).split(",")]
    except ValueError:
        raise ConfigError("overlap", f"expected an integer or one per worker such as 1,1,2,5 "
                          f"(got {cfg.overlap!r})") from None
    if len(values) == 1:
        return values * cfg.workers
    if len(values) != cfg.workers:
        raise ConfigError("overlap", f"gives {len(values)} values but there are {cfg.workers} "
                          f"workers; give one integer, or one per worker")
    return values


def profile_steps(cfg: TrainConfig) -> tuple[int, int] | None:
    """The first and last inner step ``profile`` asks for, both included.

    Args:
        cfg: the configuration, its ``steps`` resolved (see
            [`resolve`][loco.config.resolve]).

    Returns:
        ``(first, last)`` with 1 <= first <= last <= ``steps``; None without ``profile``.

    Raises:
        ConfigError: ``profile`` is not ``A-B`` or ``N``, or its steps are out of range.
    """
    if cfg.profile is None:
        return None
    text = str(cfg.profile).strip()
    first, sep, last = text.partition("-")
    try:
        window = (int(first), int(last) if sep else int(first))
    except ValueError:
        window = None
    steps = cfg.steps if cfg.steps is not None else DEFAULT_STEPS
    if window is None or not 1 <= window[0] <= window[1] <= steps:
        raise ConfigError("profile", f"must be a range of inner steps A-B with 1 <= A <= B <= "
                          f"--steps ({steps}), e.g. 20-30, or one step N (got {cfg.profile!r})")
    return window


def betas(cfg: TrainConfig) -> tuple[float, float]:
    """The inner AdamW betas from ``adam_betas`` (``"0.9,0.95"``).

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: not two numbers in [0, 1).
    """
    try:
        b1, b2 = (float(v) for v in str(cfg.adam_betas).split(","))
    except ValueError:
        b1 = b2 = math.nan
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError("adam_betas", f"expected two numbers in [0, 1) such as 0.9,0.95 "
                          f"(got {cfg.adam_betas!r})")
    return b1, b2


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill the defaults that depend on other options.

    ``sync_every`` left at None gets the algorithm's ``SYNC_DEFAULTS``; ``steps`` left at
    None gets ``DEFAULT_STEPS``, or what ``tokens`` asks for; ``outer_lr``,
    ``outer_momentum`` and ``nesterov`` left at None get the papers' values for the
    algorithm (``OUTER_DEFAULTS``); other algorithms keep None. Idempotent.

    Args:
        cfg: the configuration.

    Returns:
        A new TrainConfig (``cfg`` is not changed).

    Raises:
        ConfigError: both ``steps`` and ``tokens`` given, or a ``tokens`` that does not parse.
    """
    if cfg.steps is not None and cfg.tokens is not None:
        raise ConfigError("tokens", f"give --tokens or --steps, not both (got --tokens "
                          f"{cfg.tokens} and --steps {cfg.steps})")
    if cfg.sync_every is None:
        cfg = dataclasses.replace(cfg, sync_every=SYNC_DEFAULTS[cfg.algorithm])
    if cfg.steps is None:
        cfg = dataclasses.replace(cfg, steps=DEFAULT_STEPS if cfg.tokens is None
                                  else steps_for_tokens(cfg))
    if cfg.algorithm in OUTER_DEFAULTS:
        lr, momentum, nesterov = OUTER_DEFAULTS[cfg.algorithm]
        cfg = dataclasses.replace(
            cfg, outer_lr=lr if cfg.outer_lr is None else cfg.outer_lr,
            outer_momentum=momentum if cfg.outer_momentum is None else cfg.outer_momentum,
            nesterov=nesterov if cfg.nesterov is None else cfg.nesterov)
    return cfg


def warnings_for(cfg: TrainConfig) -> list[str]:
    """Legal settings that are probably not what the user meant.

    Args:
        cfg: a valid configuration.

    Returns:
        One message per such setting (e.g. ``--steps`` not a multiple of ``--sync-every``,
            NoLoCo's (α, β, γ) outside the paper's convergence region); empty if none.
    """
    out = []
    if cfg.algorithm == "streaming" and cfg.steps < cfg.sync_every:
        out.append(f"--steps {cfg.steps} is less than --sync-every {cfg.sync_every}: some "
                   "fragments never sync")
    if cfg.algorithm == "noloco":
        from loco.algorithms.noloco import convergence_warnings

        resolved = resolve(cfg)
        out += convergence_warnings(resolved.outer_lr, resolved.outer_momentum, cfg.gamma,
                                    cfg.group_size)
    if cfg.elastic and cfg.spread_every and cfg.algorithm in ("noloco", "local"):
        out.append("--spread-every ignored: an elastic run measures no spread (a collective "
                   "outside the syncs)")
    fast = [f"--{n.replace('_', '-')}" for n in ("fast_link_bandwidth", "fast_link_latency")
            if getattr(cfg, n) is not None]
    if fast and cfg.worker_ranks == 1:
        out.append(f"{' and '.join(fast)} ignored: a fast link joins the ranks of a worker, "
                   "and workers of one rank (--worker-ranks 1) have none")
    elif fast and cfg.worker_parallel == "fsdp":
        out.append(f"{' and '.join(fast)}: only the outer algorithm's traffic inside a worker "
                   "is emulated; FSDP2's own all-gathers and reduce-scatters (--worker-parallel "
                   "fsdp) are counted but not delayed")
    if cfg.algorithm in ("diloco", "noloco") and cfg.steps % cfg.sync_every:
        out.append(f"--steps {cfg.steps} is not a multiple of --sync-every {cfg.sync_every}: the "
                   f"last {cfg.steps % cfg.sync_every} inner steps never reach the global "
                   "model that is evaluated")
    return out


def validate(cfg: TrainConfig) -> None:
    """Check every option; raise ConfigError for the first that is out of range.

    The checks, in order:

    - an option with choices (and ``model``) is one of them;
    - ``stages`` in [1, the model's blocks]; random ``routing`` needs ``stages`` > 1;
      ``launcher`` torchrun only in a process torchrun started;
    - ``layers``, ``dim``, ``heads`` >= 1 where given; ``d_model`` a multiple of the heads
      with an even head size; ``adam_betas`` two numbers in [0, 1); ``tokens`` parses and
      is not given with ``steps``;
    - ``workers``, ``worker_ranks``, ``steps``, ``batch_size``, ``sync_every``,
      ``log_every``, ``eval_batches``, ``final_eval_batches`` >= 1; ``seq_len`` >= 2;
      ``eval_every``, ``warmup``, ``spread_every``, ``checkpoint_every`` >= 0;
      ``profile`` a range of steps ``A-B`` (or one step ``N``) within [1, ``steps``];
    - ``worker_ranks`` > 1 not with ``stages`` > 1; ``worker_parallel`` fsdp needs
      ``worker_ranks`` > 1 and the processes launcher or torchrun
      (``validate_worker_ranks``);
    - ``lr``, ``outer_lr``, ``comm_timeout`` finite and > 0; ``outer_momentum`` in [0, 1);
      ``max_restarts`` in [0, 100]; ``min_lr_ratio`` in [0, 1]; ``weight_decay``,
      ``grad_clip``, ``z_loss`` >= 0;
    - noloco: ``group_size`` >= 2 and dividing ``workers``; ``gamma`` finite and >= 0;
    - streaming: ``fragments`` in [1, the blocks of the smallest stage] and <= ``sync_every``;
      every worker's ``overlap`` in [0, floor(H/P)); ``mixing`` in [0, 1]; ``codec_block``
      even, in [2, 65536];
    - ``link_bandwidth``, ``link_latency``, ``fast_link_bandwidth`` and
      ``fast_link_latency`` parse; ``val_fraction`` in (0, 0.5];
      ``vocab_size`` in [257, 1048576]; ``corpus`` is ``shakespeare`` or an existing path
      (a file must not be empty).

    Args:
        cfg: the configuration to check.

    Raises:
        ConfigError: the first option out of range, naming what is allowed.
    """
    from loco.model import MODEL_SIZES

    def need(ok: bool, option: str, message: str):
        if not ok:
            raise ConfigError(option, f"{message} (got {getattr(cfg, option)!r})")

    for f in TrainConfig.fields():
        choices = f.metadata.get("choices")
        if choices:
            need(getattr(cfg, f.name) in choices, f.name, f"must be one of {', '.join(choices)}")
    need(cfg.model in MODEL_SIZES or cfg.model.startswith("hf:"), "model",
         f"must be one of {', '.join(MODEL_SIZES)}, or hf:PATH")
    for name in ("layers", "dim", "heads", "steps", "sync_every"):
        need(getattr(cfg, name) is None or getattr(cfg, name) >= 1, name,
             "must be an integer >= 1")
    cfg = resolve(cfg)
    layers = validate_model(cfg)
    betas(cfg)
    need(1 <= cfg.stages <= layers, "stages",
         f"must be in [1, {layers}], the number of blocks of the {cfg.model} model")
    need(cfg.routing == "fixed" or cfg.stages > 1, "routing",
         "random routing needs pipeline stages: add --stages 2 or more")
    if cfg.launcher == "torchrun":
        from loco.runtime import under_torchrun

        need(under_torchrun(), "launcher", "torchrun is only valid when started by torchrun: "
             "torchrun --nproc-per-node N -m loco train ...")
    for name in ("workers", "worker_ranks", "steps", "batch_size", "sync_every", "log_every",
                 "eval_batches", "final_eval_batches"):
        need(getattr(cfg, name) >= 1, name, "must be an integer >= 1")
    validate_worker_ranks(cfg)
    need(cfg.seq_len >= 2, "seq_len", "must be an integer >= 2")
    need(cfg.eval_every >= 0, "eval_every", "must be an integer >= 0")
    need(cfg.warmup >= 0, "warmup", "must be an integer >= 0")
    for name in ("lr", "outer_lr", "comm_timeout"):
        v = getattr(cfg, name)
        if v is not None:
            need(math.isfinite(v) and v > 0, name, "must be a number > 0")
    if cfg.outer_momentum is not None:
        need(0 <= cfg.outer_momentum < 1, "outer_momentum", "must be in [0, 1)")
    need(cfg.spread_every >= 0, "spread_every", "must be an integer >= 0")
    need(cfg.checkpoint_every >= 0, "checkpoint_every", "must be an integer >= 0 (0: only at "
         "the end)")
    need(0 <= cfg.max_restarts <= 100, "max_restarts", "must be in [0, 100]")
    profile_steps(cfg)
    validate_elastic(cfg)
    if cfg.algorithm == "noloco":
        need(cfg.group_size >= 2 and cfg.workers % cfg.group_size == 0, "group_size",
             f"must be an integer >= 2 that divides --workers ({cfg.workers})")
        need(math.isfinite(cfg.gamma) and cfg.gamma >= 0, "gamma", "must be a number >= 0")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
    need(cfg.z_loss >= 0, "z_loss", "must be >= 0")
    if cfg.algorithm == "streaming":
        blocks = layers // cfg.stages  # the smallest stage's blocks
        need(1 <= cfg.fragments <= blocks, "fragments",
             f"must be in [1, {blocks}], the number of blocks of the {cfg.model} model"
             + (f" in its smallest of {cfg.stages} pipeline stages" if cfg.stages > 1 else ""))
        need(cfg.fragments <= cfg.sync_every, "fragments",
             f"must be <= --sync-every ({cfg.sync_every}): at most one fragment per step")
        gap = cfg.sync_every // cfg.fragments  # the smallest gap between two sends
        need(all(0 <= t < gap for t in overlaps(cfg)), "overlap",
             f"every value must be in [0, floor(H/P)) = [0, {gap}), the smallest gap between "
             f"two sends, with --sync-every {cfg.sync_every} and --fragments {cfg.fragments}")
        need(0 <= cfg.mixing <= 1, "mixing", "must be in [0, 1]")
        if cfg.codec_keep is not None:
            need(0 < cfg.codec_keep <= 1, "codec_keep", "must be in (0, 1]")
        need(2 <= cfg.codec_block <= 65536 and cfg.codec_block % 2 == 0, "codec_block",
             "must be an even integer in [2, 65536]")
    from loco.comm.link import parse_bandwidth, parse_latency

    for name, parse in (("link_bandwidth", parse_bandwidth), ("link_latency", parse_latency),
                        ("fast_link_bandwidth", parse_bandwidth),
                        ("fast_link_latency", parse_latency)):
        if getattr(cfg, name) is not None:
            try:
                parse(getattr(cfg, name))
            except ValueError as e:
                raise ConfigError(name, str(e)) from None
    need(0 < cfg.val_fraction <= 0.5, "val_fraction", "must be in (0, 0.5]")
    need(257 <= cfg.vocab_size <= 1 << 20, "vocab_size",
         "must be in [257, 1048576] (256 byte symbols plus the end-of-text token)")
    for name in ("corpus", "eval_corpus"):
        validate_corpus_path(cfg, name)
    from loco.dashboard import missing_extra

    missing = missing_extra(cfg)
    if missing:  # "--wandb needs the wandb extra: pip install 'loco[wandb]'"
        flag, message = missing.split("; ")[0].split(" ", 1)
        raise ConfigError(flag[2:], message)
    if cfg.tokenizer is not None:
        need(os.path.exists(cfg.tokenizer), "tokenizer", "path does not exist; give a "
             "tokenizer.json or a Hugging Face tokenizer directory")


def validate_corpus_path(cfg: TrainConfig, name: str) -> None:
    """``corpus`` (or ``eval_corpus``, when given) is ``shakespeare``, an existing non-empty
    path, or a glob that matches files.

    Args:
        cfg: the configuration.
        name: ``"corpus"`` or ``"eval_corpus"``.
    """
    path = getattr(cfg, name)
    if path is None or path == "shakespeare":
        return
    if any(c in path for c in "*?["):
        if not glob.glob(os.path.expanduser(path), recursive=True):
            raise ConfigError(name, f"no files match the pattern (got {path!r})")
        return
    if not os.path.exists(path):
        raise ConfigError(name, "path does not exist; give a text, .jsonl, .parquet or "
                          ".arrow file, a glob or a directory of them, a Hugging Face datasets "
                          f"directory, or 'shakespeare' (got {path!r})")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ConfigError(name, f"file is empty (got {path!r})")


def validate_model(cfg: TrainConfig) -> int:
    """Check the model's options; return its number of blocks. The built-in model: ``dim`` a
    multiple of ``heads`` with an even head size. ``hf:PATH``: a directory with a causal
    LM's config.json, no ``layers``/``dim``/``heads`` overrides, ``seq_len`` within its
    position embeddings, and its architecture splittable into ``stages``.

    Args:
        cfg: the resolved configuration.
    """
    if not cfg.model.startswith("hf:"):
        dims = model_dims(cfg)
        head = dims["d_model"] // dims["n_heads"]
        if dims["d_model"] % dims["n_heads"] or head % 2:
            raise ConfigError("dim" if cfg.dim else "heads", f"d_model {dims['d_model']} must "
                              f"be a multiple of the {dims['n_heads']} heads with an even head "
                              f"size (rotary embeddings) (got {dims})")
        return dims["n_layers"]
    from loco import hf

    for name in ("layers", "dim", "heads"):
        if getattr(cfg, name) is not None:
            raise ConfigError(name, f"resizes the built-in model only; with --model hf:PATH "
                              f"edit its config.json (got {getattr(cfg, name)})")
    try:
        config = hf.load_config(cfg.model)
    except hf.HFModelError as e:
        raise ConfigError("model", str(e)) from None
    limit = hf.max_positions(config)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError("seq_len", f"must be at most the model's max_position_embeddings "
                          f"{limit} (got {cfg.seq_len})")
    if cfg.stages > 1 and not hf.splits_into_stages(config):
        raise ConfigError("stages", f"pipeline stages cannot split a {config.model_type} model "
                          f"yet (they can: {', '.join(hf.STAGE_ARCHITECTURES)}); use --stages 1 "
                          f"(got {cfg.stages})")
    return hf.num_layers(config)


def validate_worker_ranks(cfg: TrainConfig) -> None:
    """Check the worker layout: more than one rank per worker not with pipeline stages;
    ``worker_parallel`` fsdp only with ``worker_ranks`` > 1 and a launcher that builds a
    ``DeviceMesh`` (processes or torchrun).

    Args:
        cfg: the configuration, ``worker_ranks`` and ``stages`` already >= 1.

    Raises:
        ConfigError: naming ``worker_ranks`` or ``worker_parallel`` and what is allowed.
    """
    from loco.runtime import under_torchrun

    if cfg.worker_ranks > 1 and cfg.stages > 1:
        raise ConfigError("worker_ranks", f"more than one rank per worker with pipeline stages "
                          f"(--stages {cfg.stages}) is not supported yet; use --worker-ranks 1 "
                          f"or --stages 1 (got {cfg.worker_ranks})")
    if cfg.worker_parallel != "fsdp":
        return
    if cfg.worker_ranks < 2:
        raise ConfigError("worker_parallel", "fsdp shards a worker's model over its ranks: add "
                          "--worker-ranks 2 or more (got fsdp with --worker-ranks "
                          f"{cfg.worker_ranks})")
    if cfg.launcher == "threads" and not under_torchrun():
        raise ConfigError("worker_parallel", "fsdp needs the DeviceMesh that --launcher "
                          "processes and torchrun build, which the threads launcher does not; "
                          "add --launcher processes, or start the run with torchrun "
                          "(got fsdp with --launcher threads)")


def validate_elastic(cfg: TrainConfig) -> None:
    """Check ``elastic`` and its options: elastic runs under the processes launcher (or,
    with ``lighthouse`` and ``worker_index``, as one worker of an external Lighthouse's job,
    also under torchrun), without pipeline stages (workers of R ranks are fine), and not with
    ``eval_replicas``; ``min_workers`` in [1, ``workers``], ``worker_index`` in
    [0, ``workers``); these only with ``elastic``.

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: naming the option and what is allowed.
    """
    from loco.runtime import under_torchrun

    for name in ("min_workers", "lighthouse", "worker_index"):
        if getattr(cfg, name) is not None and not cfg.elastic:
            raise ConfigError(name, f"only means something with --elastic (got "
                              f"{getattr(cfg, name)})")
    if not cfg.elastic:
        return
    if (cfg.lighthouse is None) != (cfg.worker_index is None):
        raise ConfigError("worker_index" if cfg.worker_index is None else "lighthouse",
                          "--lighthouse and --worker-index go together: this process is one "
                          f"worker of that Lighthouse's job (got --lighthouse "
                          f"{cfg.lighthouse}, --worker-index {cfg.worker_index})")
    if cfg.worker_index is not None and not 0 <= cfg.worker_index < cfg.workers:
        raise ConfigError("worker_index", f"must be in [0, --workers {cfg.workers}) (got "
                          f"{cfg.worker_index})")
    if cfg.lighthouse is None and (cfg.launcher != "processes" or under_torchrun()):
        raise ConfigError("elastic", "loco starts the workers of an elastic run under "
                          "--launcher processes; under torchrun (one job per worker) give "
                          "--lighthouse and --worker-index (got --launcher "
                          f"{'torchrun' if under_torchrun() else cfg.launcher})")
    if cfg.stages != 1:
        raise ConfigError("stages", "must be 1 with --elastic: elastic workers are not "
                          f"pipelines for now (got {cfg.stages})")
    if cfg.eval_replicas:
        raise ConfigError("eval_replicas", "is a collective outside the syncs, which an "
                          "elastic run does not make; leave it out with --elastic")
    if cfg.min_workers is not None and not 1 <= cfg.min_workers <= cfg.workers:
        raise ConfigError("min_workers", f"must be in [1, --workers {cfg.workers}] (got "
                          f"{cfg.min_workers})")


def check_layout(meta: dict, worker_ranks: int, worker_parallel: str,
                 launcher: str = "processes") -> None:
    """Whether a run of this worker layout can resume a checkpoint. Workers of several
    ranks under the processes launcher or torchrun save their tensors through
    ``torch.distributed.checkpoint``, which reshards: such a checkpoint resumes with any
    R of the same ``worker_parallel`` (and with R = 1 from ``ddp``). Rank files (workers
    of one rank, or the threads launcher) hold each rank's shard and resume with the same
    R only; and the threads launcher, which has no process groups, cannot load DCP for a
    worker of several ranks.

    Args:
        meta: the checkpoint's ``latest.json`` (a checkpoint that records no layout was
            written by workers of one rank, ddp).
        worker_ranks: R of the resumed run.
        worker_parallel: ``worker_parallel`` of the resumed run.
        launcher: the resumed run's launcher; default ``"processes"``.

    Raises:
        ConfigError: a layout that cannot load the checkpoint, naming the option and the
            values to resume with.
    """
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    ranks = int(meta.get("worker_ranks", saved.get("worker_ranks", 1)))
    parallel = meta.get("worker_parallel", saved.get("worker_parallel", "ddp"))
    dcp = bool(meta.get("dcp_workers"))
    same = f"--worker-ranks {ranks}" + (f" --worker-parallel {parallel}"
                                        if parallel != "ddp" else "")
    if dcp and worker_ranks > 1 and launcher == "threads":
        raise ConfigError("launcher", f"the checkpoint's tensors were saved through "
                          f"torch.distributed.checkpoint by workers of {ranks} ranks; the "
                          "threads launcher has no process groups to load them into workers "
                          "of several ranks: resume with --launcher processes (or torchrun)")
    if (worker_ranks, worker_parallel) == (ranks, parallel):
        return
    if worker_parallel != parallel:
        raise ConfigError("worker_parallel", f"the checkpoint was written by workers of "
                          f"{ranks} rank(s) ({parallel}), this run has {worker_ranks} "
                          f"({worker_parallel}); the outer state is laid out differently "
                          f"(flat ranges under ddp, parameter shards under fsdp): resume "
                          f"with --worker-parallel {parallel}")
    if not dcp:
        files = "the threads launcher" if ranks > 1 else "one rank per worker"
        raise ConfigError("worker_ranks", f"the checkpoint was written by workers of {ranks} "
                          f"rank(s) in per-rank files ({files}), "
                          f"which do not reshard; resume with {same} (checkpoints of workers "
                          "of several ranks under --launcher processes or torchrun reshard)")


def resume_config(directory: str, given: dict[str, Any]) -> TrainConfig:
    """The configuration of the run being resumed from ``directory``, with ``given`` options
    (flags or a YAML file) allowed to change only how it runs (RESUMABLE).

    Args:
        directory: the run directory, with a checkpoint.
        given: options given for the resumed run, by field name; only those of
            ``RESUMABLE`` may differ from the saved ones.

    Returns:
        The saved configuration with the given changes, ``resume`` and ``out`` set to
            ``directory``.

    Raises:
        ConfigError: no such directory, no usable checkpoint, or a changed option that is
            not resumable.
    """
    from loco import checkpoint

    if not os.path.isdir(directory):
        raise ConfigError("resume", f"no such directory: {directory}")
    try:
        meta = checkpoint.latest(directory)
    except checkpoint.CheckpointError as e:
        raise ConfigError("resume", str(e)) from None
    if meta is None:
        raise ConfigError("resume", f"{directory} has no checkpoint "
                          f"({os.path.join(directory, checkpoint.DIRNAME, 'latest.json')} is "
                          "missing); nothing to resume")
    saved = meta.get("config")
    if isinstance(saved, dict):
        saved = canonical(saved)
    by_name = {f.name: f for f in TrainConfig.fields()}
    if not isinstance(saved, dict) or set(saved) - set(by_name):
        raise ConfigError("resume", f"{directory}'s checkpoint does not record a configuration "
                          "of this version of loco")
    values = {k: coerce(by_name[k], v) for k, v in saved.items()}
    for name, value in given.items():
        value = coerce(by_name[name], value)
        if name not in RESUMABLE + LAYOUT and value != values.get(name):
            raise ConfigError(name, f"differs from the run being resumed ({values.get(name)!r}); "
                              "a resumed run keeps its options except "
                              f"{', '.join('--' + o.replace('_', '-') for o in RESUMABLE[:6])}")
        values[name] = value
    check_layout(meta, *(values.get(k, by_name[k].default)
                         for k in (*LAYOUT, "launcher")))
    try:
        checkpoint.check_files(directory, meta)
    except checkpoint.CheckpointError as e:
        raise ConfigError("resume", str(e)) from None
    return TrainConfig(**{**values, "resume": directory, "out": directory})
