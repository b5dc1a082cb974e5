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
import warnings
from dataclasses import dataclass
from typing import Any

import yaml

from loco.algorithms import method, methods
from loco.algorithms.method import Method
from loco.config.groups import (
    METHOD,
    SECTIONS,
    check_applies,
    flatten,
    nesting_hint,
    own_fields,
    section_of,
    takers,
)
from loco.config.sections import (
    DEFAULT_STEPS,
    CommunicationOptions,
    DataOptions,
    MethodOptions,
    ModelOptions,
    OptimOptions,
    RunOptions,
    RuntimeOptions,
)
from loco.config.trust import TrustOptions
from loco.options import ConfigError, need


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


_SECTION_CLASSES: dict[type, type] = {}


def method_section(algorithm: str) -> type:
    """The class of the method section of a run of ``algorithm``: the shared options
    (``MethodOptions``: ``algorithm``, H, the outer optimizer, ...) and that method's own
    (its ``Method.options``), one dataclass. Built when first asked for, so a method
    registered at any time gets its section.

    Args:
        algorithm: a registered method's name.

    Raises:
        ConfigError: ``algorithm`` is not a registered method.
    """
    if algorithm not in methods():
        raise ConfigError("algorithm", f"must be one of {', '.join(methods())} (got "
                          f"{algorithm!r})")
    own = method(algorithm).options
    if own is None:
        return MethodOptions
    if own not in _SECTION_CLASSES:
        _SECTION_CLASSES[own] = dataclasses.make_dataclass(
            f"{own.__name__}Section", [], bases=(own, MethodOptions))
    return _SECTION_CLASSES[own]


@dataclass(init=False)
class TrainConfig:
    """Every option of ``loco train``, by section: ``cfg.method`` (the method, the options
    several methods share and the chosen method's own), ``cfg.model.name``, ``cfg.data``,
    ``cfg.optim``, ``cfg.run``, ``cfg.comm``, ``cfg.runtime`` and ``cfg.trust``, each a
    dataclass of ``loco.config.sections`` (read ``cfg.optim.lr``, ``cfg.method.sync_every``;
    ``cfg.model.name`` is the model's name).

    Built from options by name, flat: ``TrainConfig(algorithm="diloco", lr=1e-3)``. Each is
    a flag (``sync_every``: ``--sync-every``), a YAML key under its section and a key of
    ``to_dict()`` (what ``summary.json`` records); its help text is
    ``field.metadata["help"]``, its allowed values ``field.metadata["choices"]`` (see
    ``loco.config.choices``). Build one with [`build_config`][loco.config.build_config]
    (which converts YAML values), fill the defaults that depend on the method with
    [`resolve`][loco.config.resolve], and check it with [`validate`][loco.config.validate].

    Args:
        **options: option values by name (the flat names of ``to_dict``; old names of
            ``RENAMED`` too); the rest keep their defaults.

    Raises:
        ConfigError: an unknown ``algorithm``, or an option of other methods only set to a
            value other than its default (naming the methods it applies to).
        TypeError: a name that is no option.
    """

    method: Any
    model: ModelOptions
    data: DataOptions
    optim: OptimOptions
    run: RunOptions
    comm: CommunicationOptions
    runtime: RuntimeOptions
    trust: TrustOptions

    def __init__(self, **options: Any) -> None:
        options = canonical(options)
        mine = method_section(options.get("algorithm", MethodOptions.algorithm))
        by_section = {s.section: {} for s in SECTIONS}
        where = {**section_of(), **{f.name: METHOD for f in dataclasses.fields(mine)}}
        own = {f.name: f for f in own_fields()}
        for name, value in options.items():
            if name not in where:
                raise TypeError(f"TrainConfig: no option {name!r}")
            if name in own and not any(f.name == name for f in dataclasses.fields(mine)):
                refuse_other(name, value, own[name].default, options.get("algorithm"))
                continue
            by_section[where[name]][name] = value
        for s in SECTIONS[1:]:
            setattr(self, s.section, s(**by_section[s.section]))
        self.method = mine(**by_section[METHOD])

    @classmethod
    def from_saved(cls, values: dict[str, Any]) -> TrainConfig:
        """A configuration from a saved one (``summary.json``'s, a checkpoint's): options
        unknown today and other methods' own options (an older release recorded every
        method's) are left out.

        Args:
            values: option values by name.
        """
        values = canonical(values)
        mine = {f.name for f in dataclasses.fields(
            method_section(values.get("algorithm", MethodOptions.algorithm)))}
        keep = set(section_of()) - {f.name for f in own_fields()} | mine
        return cls(**{k: v for k, v in values.items() if k in keep})

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        """Every option field, in the order of the command line's help: the method section
        (the shared options, then every registered method's own, each once), then the other
        sections in ``SECTIONS``' order."""
        return ([*dataclasses.fields(MethodOptions), *own_fields()]
                + [f for s in SECTIONS[1:] for f in dataclasses.fields(s)])

    def sections(self) -> list[Any]:
        """The section objects, in ``SECTIONS``' order (the method's first)."""
        return [getattr(self, s.section) for s in SECTIONS]

    def to_dict(self) -> dict[str, Any]:
        """The options by name, flat (what ``summary.json`` and the checkpoints record): the
        method section's (the shared options and the chosen method's own), then the others."""
        return {k: v for section in self.sections() for k, v in dataclasses.asdict(section).items()}

    def option(self, name: str) -> Any:
        """One option's value by its flat name; another method's own option reads as its
        default (unset in this run).

        Args:
            name: the option's name (``sync_every``).

        Raises:
            AttributeError: no option of that name.
        """
        where = section_of()
        if name in where and hasattr(getattr(self, where[name]), name):
            return getattr(getattr(self, where[name]), name)
        own = {f.name: f.default for f in own_fields()}
        if name in own:
            return own[name]
        raise AttributeError(f"TrainConfig has no option {name!r}")

    def replace(self, **options: Any) -> TrainConfig:
        """A copy with some options changed.

        Args:
            **options: the new values by option name (flat: ``lr=1e-3``).
        """
        return TrainConfig(**{**self.to_dict(), **canonical(options)})

    def __getattr__(self, name: str) -> Any:
        """A flat read (``cfg.method.sync_every``) of an older release: works for one more, with a
        DeprecationWarning naming the nested read (``cfg.method.sync_every``)."""
        if name.startswith("_") or name in ("method", *(s.section for s in SECTIONS)):
            raise AttributeError(name)
        where = section_of()
        if name not in where:
            raise AttributeError(f"TrainConfig has no option {name!r}")
        warnings.warn(f"cfg.{name} is a flat read of the nested configuration; read "
                      f"cfg.{where[name]}.{name} (flat reads go in the next release)",
                      DeprecationWarning, stacklevel=2)
        return self.option(name)

    def __reduce__(self):
        return (_from_dict, (self.to_dict(),))

    @property
    def method_class(self) -> type[Method]:
        """The class of the method ``method.algorithm`` names."""
        return method(self.method.algorithm)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens consumed by all workers in one inner step: every rank of every
        worker reads a batch."""
        return (self.runtime.workers * self.runtime.worker_ranks * self.data.batch_size
                * self.data.seq_len)


def _from_dict(values: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from ``to_dict()``'s values (unpickling)."""
    return TrainConfig(**values)


def refuse_other(name: str, value: Any, default: Any, algorithm: str | None) -> None:
    """Refuse another method's own option set for this run (its default passes: unset).

    Raises:
        ConfigError: naming the methods the option applies to.
    """
    if value == default:
        return
    raise ConfigError(name, f"applies to {', '.join(takers(name))} only, not to --algorithm "
                      f"{algorithm or MethodOptions.algorithm} (got {value!r})")


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

    base = MODEL_SIZES[cfg.model.name]
    return {**base, "n_layers": cfg.model.layers or base["n_layers"],
            "d_model": cfg.model.dim or base["d_model"], "n_heads": cfg.model.heads or base["n_heads"]}


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

    text = cfg.run.tokens.strip().lower()
    try:
        value = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError("tokens", f"expected a token count such as 2e7 or tokens per "
                          f"parameter such as 20x (got {cfg.run.tokens!r})")
    if text.endswith("x") and cfg.model.name.startswith("hf:"):
        from loco import hf

        value *= hf.parameter_count(cfg.model.name, cfg.data.vocab_size)
    elif text.endswith("x"):
        mcfg = ModelConfig(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len, **model_dims(cfg))
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
    if cfg.run.profile is None:
        return None
    text = str(cfg.run.profile).strip()
    first, sep, last = text.partition("-")
    try:
        window = (int(first), int(last) if sep else int(first))
    except ValueError:
        window = None
    steps = cfg.run.steps if cfg.run.steps is not None else DEFAULT_STEPS
    if window is None or not 1 <= window[0] <= window[1] <= steps:
        raise ConfigError("profile", f"must be a range of inner steps A-B with 1 <= A <= B <= "
                          f"--steps ({steps}), e.g. 20-30, or one step N (got {cfg.run.profile!r})")
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
    if cfg.run.steps is not None and cfg.run.tokens is not None:
        raise ConfigError("tokens", f"give --tokens or --steps, not both (got --tokens "
                          f"{cfg.run.tokens} and --steps {cfg.run.steps})")
    unset = {k: v for k, v in cfg.method_class.defaults.items() if cfg.option(k) is None}
    if cfg.run.steps is None:
        unset["steps"] = DEFAULT_STEPS if cfg.run.tokens is None else steps_for_tokens(cfg)
    return cfg.replace(**unset) if unset else cfg


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
    out = cfg.method_class.warnings(cfg)
    if cfg.runtime.elastic and cfg.method.spread_every and not cfg.method_class.replicas_identical:
        out.append("--spread-every ignored: an elastic run measures no spread (a collective "
                   "outside the syncs)")
    fast = [f"--{n.replace('_', '-')}" for n in ("fast_link_bandwidth", "fast_link_latency")
            if cfg.option(n) is not None]
    if fast and cfg.runtime.worker_ranks == 1:
        out.append(f"{' and '.join(fast)} ignored: a fast link joins the ranks of a worker, "
                   "and workers of one rank (--worker-ranks 1) have none")
    elif fast and cfg.runtime.worker_parallel == "fsdp":
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
    by_name = {f.name: f for f in TrainConfig.fields()}
    for name, value in cfg.to_dict().items():
        f = by_name[name]
        allowed = choices(f)
        if allowed and not (value is None and f.default is None):  # None: the method's
            need(cfg, value in allowed, f.name, f"must be one of {', '.join(allowed)}")
    for section in SECTIONS:
        section.check(cfg)
    check_applies(cfg)
    cfg = resolve(cfg)
    layers = validate_model(cfg)
    need(cfg, 1 <= cfg.runtime.stages <= layers, "stages",
         f"must be in [1, {layers}], the number of blocks of the {cfg.model.name} model")
    need(cfg, cfg.runtime.routing == "fixed" or cfg.runtime.stages > 1, "routing",
         "random routing needs pipeline stages: add --stages 2 or more")
    for name in ("steps", "sync_every"):
        need(cfg, cfg.option(name) >= 1, name, "must be an integer >= 1")
    profile_steps(cfg)
    cfg.method_class.check(cfg, layers)


def validate_model(cfg: TrainConfig) -> int:
    """Check the model's options; return its number of blocks. The built-in model: ``dim`` a
    multiple of ``heads`` with an even head size. ``hf:PATH``: a directory with a causal
    LM's config.json, no ``layers``/``dim``/``heads`` overrides, ``seq_len`` within its
    position embeddings, and its architecture splittable into ``stages``.

    Args:
        cfg: the resolved configuration.
    """
    if not cfg.model.name.startswith("hf:"):
        dims = model_dims(cfg)
        head = dims["d_model"] // dims["n_heads"]
        if dims["d_model"] % dims["n_heads"] or head % 2:
            raise ConfigError("dim" if cfg.model.dim else "heads", f"d_model {dims['d_model']} must "
                              f"be a multiple of the {dims['n_heads']} heads with an even head "
                              f"size (rotary embeddings) (got {dims})")
        if dims["n_heads"] % dims.get("n_kv_heads", 1):
            raise ConfigError("heads", f"must be a multiple of the model's "
                              f"{dims['n_kv_heads']} key/value heads (got {dims['n_heads']})")
        return dims["n_layers"]
    from loco import hf

    for name in ("layers", "dim", "heads"):
        if cfg.option(name) is not None:
            raise ConfigError(name, f"resizes the built-in model only; with --model hf:PATH "
                              f"edit its config.json (got {cfg.option(name)})")
    try:
        config = hf.load_config(cfg.model.name)
    except hf.HFModelError as e:
        raise ConfigError("model", str(e)) from None
    limit = hf.max_positions(config)
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError("seq_len", f"must be at most the model's max_position_embeddings "
                          f"{limit} (got {cfg.data.seq_len})")
    if cfg.runtime.stages > 1 and not hf.splits_into_stages(config):
        raise ConfigError("stages", f"pipeline stages cannot split a {config.model_type} model "
                          f"yet (they can: {', '.join(hf.STAGE_ARCHITECTURES)}); use --stages 1 "
                          f"(got {cfg.runtime.stages})")
    return hf.num_layers(config)


