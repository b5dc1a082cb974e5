"""The typed training configuration: the sections of ``loco.config.sections`` and every
registered method's own options, as one dataclass.

Precedence: defaults < YAML file < flags. [`validate`][loco.config.validate] checks every
value before any worker starts and raises [`ConfigError`][loco.config.ConfigError] naming the
option and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from loco.algorithms import method, methods
from loco.algorithms.method import Method
from loco.config.groups import SECTIONS, check_applies, flatten, nesting_hint
from loco.config.sections import DEFAULT_STEPS
from loco.options import ConfigError, need


def _method_sections() -> tuple[type, ...]:
    """Every registered method's own options section, once (a section another one extends
    is left to it)."""
    found: list[type] = []
    for cls in methods().values():
        if cls.options is not None and cls.options not in found:
            found.append(cls.options)
    return tuple(s for s in found if not any(o is not s and issubclass(o, s) for o in found))


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


# Fields in --help order: the method section first (its shared options, then every method's
# own), then the other sections as SECTIONS lists them (dataclass fields follow the reverse MRO).
@dataclass
class TrainConfig(*reversed(SECTIONS[1:]), *reversed(_method_sections()), SECTIONS[0]):
    """Every option of ``loco train``, with its default: the sections of
    ``loco.config.sections`` and each registered method's own section.

    Each field is a flag (``sync_every``: ``--sync-every``) and a key of the YAML
    ``--config`` file; its help text is ``field.metadata["help"]`` and its allowed values,
    where they are a list, ``field.metadata["choices"]`` (see
    ``loco.config.choices``); ``loco train --help`` and the options table of
    the API reference list them all.
    Build one with [`build_config`][loco.config.build_config] (which converts YAML values),
    fill the defaults that depend on the method with [`resolve`][loco.config.resolve], and
    check it with [`validate`][loco.config.validate].
    """

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        """The option fields, in the order of the command line's help."""
        return list(dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The options by field name (what ``summary.json`` and the checkpoints record)."""
        return dataclasses.asdict(self)

    @property
    def method(self) -> type[Method]:
        """The class of the method ``algorithm`` names."""
        return method(self.algorithm)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens consumed by all workers in one inner step: every rank of every
        worker reads a batch."""
        return self.workers * self.worker_ranks * self.batch_size * self.seq_len


def choices(f: dataclasses.Field) -> tuple | None:
    """A field's allowed values (``metadata["choices"]``, called where it is a function of
    what is registered), or None for any value of its type."""
    allowed = f.metadata.get("choices")
    return allowed() if callable(allowed) else allowed


def load_yaml(path: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a YAML config file: data only (safe_load), options nested by section
    (``optim: {lr: 0.001}``; a flat file of older releases is read too, with one line on
    standard error saying how to nest it), keys must be known options (or one of ``extra``,
    which a command reads itself, at the top level).

    Args:
        path: the YAML file, a mapping of section: {option: value} (keys with ``-`` or
            ``_``; see [`flatten`][loco.config.groups.flatten]).
        extra: further keys allowed besides the TrainConfig fields; default none.

    Returns:
        The values by field name (dashes turned into underscores), not yet converted.

    Raises:
        ConfigError: the file is missing, not valid YAML, not a mapping, or has an unknown
            key or one in the wrong section.
    """
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of section: {{option: value}}")
    values, flat = flatten(data, path)
    known = {f.name for f in TrainConfig.fields()} | set(extra)
    data = canonical(values)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError("config", f"unknown option(s) in {path}: {', '.join(unknown)}")
    if flat:
        print(f"loco: {nesting_hint(path, flat)}", file=sys.stderr)
    return data


def coerce(field_: dataclasses.Field, value: Any) -> Any:
    """Convert a YAML value to the field's type, with a ConfigError if it does not fit."""
    kind = field_.type if isinstance(field_.type, str) else field_.type.__name__
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(field_.name, "must not be empty")
    if field_.metadata.get("repeat") and isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)  # a repeated flag, or a YAML list
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


def model_dims(cfg: TrainConfig) -> dict[str, int | float]:
    """The model's shape: the named size's (``n_layers``, ``d_model``, ``n_heads`` and, for
    the Llama presets, ``n_kv_heads``, ``ffn_hidden``, ``rope_theta``), with ``layers``,
    ``dim`` and ``heads`` overriding the first three.

    Args:
        cfg: the configuration (``model`` must be a known size).
    """
    from loco.model import MODEL_SIZES

    base = MODEL_SIZES[cfg.model]
    return {**base, "n_layers": cfg.layers or base["n_layers"],
            "d_model": cfg.dim or base["d_model"], "n_heads": cfg.heads or base["n_heads"]}


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


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill the defaults that depend on other options.

    ``steps`` left at None gets ``DEFAULT_STEPS``, or what ``tokens`` asks for; the shared
    method options left at None (``sync_every`` H, ``outer_lr``, ``outer_momentum``,
    ``nesterov``) get the method's ``defaults`` (the papers' values), or stay None where it
    has none. Idempotent.

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
    unset = {k: v for k, v in cfg.method.defaults.items() if getattr(cfg, k) is None}
    if cfg.steps is None:
        unset["steps"] = DEFAULT_STEPS if cfg.tokens is None else steps_for_tokens(cfg)
    return dataclasses.replace(cfg, **unset) if unset else cfg


def warnings_for(cfg: TrainConfig) -> list[str]:
    """Legal settings that are probably not what the user meant: the method's own
    (``Method.warnings``), then those of the run's layout.

    Args:
        cfg: a valid configuration.

    Returns:
        One message per such setting (e.g. ``--steps`` not a multiple of ``--sync-every``,
            NoLoCo's (α, β, γ) outside the paper's convergence region); empty if none.
    """
    cfg = resolve(cfg)
    out = cfg.method.warnings(cfg)
    if cfg.elastic and cfg.spread_every and not cfg.method.replicas_identical:
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
    return out


def validate(cfg: TrainConfig) -> None:
    """Check every option; raise ConfigError for the first that is out of range.

    In order: every option with choices is one of them; each section checks its own
    options (``loco.config.sections``: counts >= 1 before anything is derived from them,
    so a bad count never reaches a division); an option of some methods only is not set
    for another (``loco.config.groups.check_applies``); the defaults are resolved; the model's
    options (``validate_model``) give its blocks; ``stages`` in [1, blocks] and random
    ``routing`` only with stages; H and the steps >= 1 once resolved; ``profile`` within the
    steps; and the method's own options (``Method.check``). What needs the file system,
    the installed extras or the environment is the preflight step's
    (``loco.training.preflight``).

    Args:
        cfg: the configuration to check.

    Raises:
        ConfigError: the first option out of range, naming what is allowed.
    """
    for f in TrainConfig.fields():
        allowed = choices(f)
        value = getattr(cfg, f.name)
        if allowed and not (value is None and f.default is None):  # None: the method's
            need(cfg, value in allowed, f.name, f"must be one of {', '.join(allowed)}")
    for section in SECTIONS:
        section.check(cfg)
    check_applies(cfg)
    cfg = resolve(cfg)
    layers = validate_model(cfg)
    need(cfg, 1 <= cfg.stages <= layers, "stages",
         f"must be in [1, {layers}], the number of blocks of the {cfg.model} model")
    need(cfg, cfg.routing == "fixed" or cfg.stages > 1, "routing",
         "random routing needs pipeline stages: add --stages 2 or more")
    for name in ("steps", "sync_every"):
        need(cfg, getattr(cfg, name) >= 1, name, "must be an integer >= 1")
    profile_steps(cfg)
    cfg.method.check(cfg, layers)


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
        if dims["n_heads"] % dims.get("n_kv_heads", 1):
            raise ConfigError("heads", f"must be a multiple of the model's "
                              f"{dims['n_kv_heads']} key/value heads (got {dims['n_heads']})")
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


