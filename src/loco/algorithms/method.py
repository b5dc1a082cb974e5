"""The seam every method plugs into: what the rest of loco may ask of a method.

A method is one class (an [`Algorithm`][loco.algorithms.base.Algorithm]) and one registry
line ([`register`][loco.algorithms.registry.register]). The class owns its options and their
checks, how it is built from a configuration, what it adds to the report and how its final
model is read back; nothing outside ``loco.algorithms`` asks which method a run is by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

#: The outer optimizer's options, shared by the methods that take outer steps every H inner
#: steps (``Method.outer_defaults``).
OUTER = ("sync_every", "outer_lr", "outer_momentum", "nesterov")

#: The option every method takes, whether or not its training reads it: H, the steps of a
#: round (``Method.takes``).
ROUND = ("sync_every",)

#: The report's words for the values of ``inner_optimizer`` (``Method.inner_name``).
INNER_WORDS = {"adamw": "AdamW", "muon": "Muon"}


@dataclass(frozen=True)
class PaperClaim:
    """A paper's claim about a method, declared as data and checked by the report on the
    runs of one seed.

    Args:
        kind: ``"loss"``: this method's final eval loss is at most ``limit`` % above the
            reference's (``limit`` 0: below it); ``"bytes"``: the reference sends at least
            ``limit`` times this method's bytes per worker; ``"peak"``: this method's peak
            sync bytes are about P (``fragments``) times below the reference's, once its
            codec's share is factored out (at least 0.9 P); ``"goodput"``: this method's
            goodput is at least ``limit`` (a fraction); ``"wallclock"`` and ``"tokens"``:
            its eval loss at the same training seconds, or the same tokens, as the
            reference's (where the shorter run ended) is at most ``limit`` % above it
            (``limit`` 0: below it).
        against: the reference method's name, or ``"twin"``: a run of the same method
            configured the same but for ``want`` (and ``free``).
        limit: the bound, in % (``loss``) or a factor (``bytes``); unused for ``peak``.
        want: option values the reference must hold. For a twin it must hold all of them,
            and the claim applies only to runs that hold none; for a method it is a
            preference: a run of that method holding them is taken over its baseline.
        free: options a twin may also differ in.
        text: the claim's wording after the two runs' names; ``{ref}`` is the reference's
            name. Default: ``within {limit}% of {ref}'s`` for ``loss``.
    """

    kind: str
    against: str
    limit: float = 0.0
    want: dict[str, Any] = field(default_factory=dict)
    free: tuple[str, ...] = ()
    text: str = ""


class Method:
    """What a method declares about itself (class attributes and class methods only).

    Every attribute has a default that suits a method with no options of its own, so a
    subclass names only what differs.
    """

    name: ClassVar[str] = ""
    """The method's name on the command line (``--algorithm``) and in run directories."""
    title: ClassVar[str] = ""
    """The method's name as its paper writes it (reports, plots)."""
    options: ClassVar[type | None] = None
    """A dataclass of the method's own options (fields made with ``loco.options.opt``): a
    section of the configuration, so they are flags and YAML keys."""
    shared: ClassVar[tuple[str, ...]] = ()
    """Options of the configuration's method section that mean something to this method
    (e.g. ``OUTER``, ``spread_every``)."""
    defaults: ClassVar[dict[str, Any]] = {"sync_every": 50}
    """Values for shared options left unset (None): e.g. H and the outer optimizer."""
    replicas_identical: ClassVar[bool] = True
    """Whether every worker holds the same parameters after each step, so one worker may
    evaluate for all."""
    global_copy: ClassVar[bool] = False
    """Whether the method keeps global parameters apart from the replicas' (DiLoCo): its
    final model is the global copy, and evaluating the replicas next to it is meaningful."""
    replicas_by_default: ClassVar[bool] = False
    """Whether ``loco eval`` scores every replica unless told otherwise."""
    claims: ClassVar[tuple[PaperClaim, ...]] = ()
    """The papers' claims about the method that a comparison can check."""

    @classmethod
    def uses(cls) -> tuple[str, ...]:
        """Every option that means something to this method alone or to a few: its own
        section's fields and the ``shared`` ones."""
        own = tuple(f.name for f in fields(cls.options)) if cls.options else ()
        return own + cls.shared

    @classmethod
    def takes(cls) -> tuple[str, ...]:
        """Every option of the configuration's method section a run of this method may set:
        ``uses``, and ``ROUND`` (H, the steps of a round, which every method has:
        checkpoints and replica checks count rounds)."""
        return cls.uses() + tuple(n for n in ROUND if n not in cls.uses())

    @classmethod
    def check(cls, cfg: Any, layers: int) -> None:
        """Check the method's own options in ``cfg`` for a model of ``layers`` blocks.

        Args:
            cfg: the run's configuration, resolved.
            layers: the model's blocks (transformer layers).

        Raises:
            ConfigError: naming the first option out of range and what it allows.
        """

    @classmethod
    def warnings(cls, cfg: Any) -> list[str]:
        """Legal settings that are probably not what the user meant, one message each.

        Args:
            cfg: the run's configuration, resolved.
        """
        return []

    @classmethod
    def from_config(cls, cfg: Any, model: Any, optimizer: Any, comm: Any, pipeline: Any = None,
                    inner: Any = None) -> Any:
        """The method as a run of ``cfg`` builds it on this rank (collective: see
        [`Algorithm`][loco.algorithms.base.Algorithm]).

        Args:
            cfg: the run's resolved configuration.
            model: the module this rank trains.
            optimizer: the inner optimizer over its parameters.
            comm: the slow link between workers (``ctx.comm``).
            pipeline: this rank's pipeline stage; default None (no stages).
            inner: the fast link between the ranks of this worker (``ctx.inner``); default
                None (a worker of one rank).
        """
        algo = cls(model, optimizer, comm, max_grad_norm=cfg.optim.grad_clip or None,
                   on_nonfinite=cfg.runtime.on_nonfinite, inner=inner, aggregation=cfg.trust.aggregation,
                   guard_factor=cfg.trust.guard_factor, inject=cfg.trust.inject,
                   **cls.kwargs(cfg, model, comm, pipeline))
        if pipeline is not None and pipeline.stages > 1:
            algo.grad_norm_fn = pipeline.grad_norm  # clip by the whole model's gradient norm
        return algo

    @classmethod
    def kwargs(cls, cfg: Any, model: Any, comm: Any, pipeline: Any) -> dict[str, Any]:
        """The constructor's method-specific arguments for a configuration.

        Args:
            cfg: the run's resolved configuration.
            model: the module this rank trains.
            comm: the slow link between workers (its rank is the replica's).
            pipeline: this rank's pipeline stage, or None.
        """
        return {}

    @classmethod
    def checkpoint_delay(cls, cfg: Any) -> int:
        """Inner steps after a round's end during which a sync may still be in flight.

        Args:
            cfg: the run's configuration, resolved.
        """
        return 0

    @classmethod
    def setting(cls, config: dict) -> str:
        """The report's phrase for the method's own knobs: H and the outer optimizer by
        default.

        Args:
            config: a saved run's options (``summary.json``'s ``config``).
        """
        return f"H={config['sync_every']}" + cls.outer_setting(config)

    @classmethod
    def outer_setting(cls, config: dict) -> str:
        """The report's words for the outer optimizer, ``", ..."``, or empty where the run
        has none.

        Args:
            config: a saved run's options.
        """
        lr, mu = config.get("outer_lr"), config.get("outer_momentum")
        if lr is None or mu is None:
            return ""
        kind = "heavy-ball" if config.get("nesterov") is False else "Nesterov"
        return f", outer lr {lr:g}, " + (f"{kind} μ={mu:g}" if mu else "no momentum")

    @classmethod
    def wire(cls, config: dict) -> str | None:
        """The wire format of what a run sends, where the report shows it next to the
        bytes (DataParallel's gradients); None elsewhere.

        Args:
            config: a saved run's options.
        """
        return None

    @classmethod
    def inner_name(cls, config: dict) -> str:
        """The inner optimizer a run steps, in the report's words: ``AdamW``, ``Muon``, or
        ``Muon (original scale)`` where ``muon_scale`` is not the default ``adamw-rms``.
        Runs with the same words step the same optimizer, whatever their rates (``lr``,
        ``muon_lr``: each run's own sweep), so a claim holds a method against the reference
        method's run with the same words, its twin (``loco.report.papers.reference``).

        Args:
            config: a saved run's options; one without ``inner_optimizer`` (an older run's)
                stepped AdamW.
        """
        name = config.get("inner_optimizer") or "adamw"
        if name != "muon":
            return INNER_WORDS.get(name, name)
        scale = config.get("muon_scale") or "adamw-rms"
        return "Muon" if scale == "adamw-rms" else f"Muon ({scale} scale)"

    @classmethod
    def fragment_names(cls, cfg: Any, module: Any, tied: bool) -> list[list[str]]:
        """The parameter names of each fragment the method syncs (a method with a global
        copy); one fragment of every trained parameter by default.

        Args:
            cfg: the run's configuration.
            module: the module the method syncs (a stage's part with pipeline stages).
            tied: whether ``module`` holds a copy of a tied embedding.
        """
        from loco.algorithms.fragments import split_fragments

        return split_fragments(module, 1)


def leftover_steps(cfg: Any) -> list[str]:
    """A warning when ``steps`` is not a multiple of H: the last steps never reach the
    global model (a method that averages every H steps)."""
    if cfg.run.steps % cfg.method.sync_every:
        return [f"--steps {cfg.run.steps} is not a multiple of --sync-every {cfg.method.sync_every}: the "
                f"last {cfg.run.steps % cfg.method.sync_every} inner steps never reach the global "
                "model that is evaluated"]
    return []
