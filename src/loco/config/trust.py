"""The options of a run that trusts no worker: robust aggregation, attacks on demand,
replica checks and the job key (docs/security.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

from loco.comm.attacks import parse_attacks
from loco.comm.guard import AGGREGATIONS, DEFAULT_AGGREGATION, DEFAULT_FACTOR
from loco.options import ConfigError, need, opt

#: The environment variable that may hold the job key's file (``--job-key-file`` wins).
JOB_KEY_ENV = "LOCO_JOB_KEY_FILE"


@dataclass
class TrustOptions:
    """What a run does about workers it cannot trust: how contributions are aggregated, faults and attacks to inject, how often the replicas are compared, and the job key."""

    section: ClassVar[str] = "trust"

    aggregation: str = opt(DEFAULT_AGGREGATION, "how each average treats the workers' "
                           "contributions, judged by whoever reduces them (each chunk's "
                           "reducer, or every worker of an all-gather): drop (a contribution "
                           "whose norm is non-finite, above --guard-factor times the median or "
                           "below it over the factor, or that repeats an old one or fails its "
                           "MAC, is left out and the mean re-weighted), clip (clipped to that "
                           "norm; --guard-factor 1 is Templar's clip to the median), trimmed "
                           "(coordinate-wise mean without the largest and smallest quarter), "
                           "median (coordinate-wise), or mean (plain: the transport's own "
                           "all-reduce, nothing checked)", AGGREGATIONS)
    guard_factor: float = opt(DEFAULT_FACTOR, "the factor of the median norm beyond which "
                              "--aggregation drop and clip act, >= 1")
    inject: str | None = opt(None, "inject a fault or attack: WORKER:KIND or WORKER:KIND=X, "
                             "then @STEP to start at a step; repeatable (or "
                             "comma-separated), e.g. 1:scale=-50 or 2:nan@40; KIND is "
                             "scale=X, noise=SIGMA, "
                             "nan, zero, stale=K, bitflip=N, lie-tokens=X or silent (from "
                             "the start unless @STEP); the summary records what "
                             "was injected and what the guard detected (default: none)",
                             repeat=True)
    verify_every: int = opt(10, "every this many rounds of --sync-every inner steps, the "
                            "workers compare a digest of their global copy (computed on the "
                            "device, 24 bytes); a worker whose copy differs from the "
                            "majority's is named and healed from it, and without a majority "
                            "the run stops; 0: never")
    job_key_file: str | None = opt(None, "a file holding the job's secret key (at least 16 "
                                   "bytes): only processes that prove it are admitted, and "
                                   "every payload loco moves between workers carries a MAC "
                                   f"(default: ${JOB_KEY_ENV}, else none)")
    encrypt: bool = opt(False, "with a job key: encrypt every payload loco moves between "
                        "workers (AES-256-GCM, which also authenticates it, in place of the "
                        "MAC; needs the 'cryptography' package: pip install 'loco[encrypt]')")

    @staticmethod
    def check(cfg) -> None:
        """The factor >= 1; every attack parses and names a worker of the run; the replica
        check's interval >= 0; the key file readable."""
        need(cfg, math.isfinite(cfg.trust.guard_factor) and cfg.trust.guard_factor >= 1,
             "guard_factor", "must be a number >= 1")
        need(cfg, cfg.trust.verify_every >= 0, "verify_every", "must be an integer >= 0 "
             "(0: never)")
        try:
            attacks = parse_attacks(cfg.trust.inject)
        except ValueError as e:
            raise ConfigError("inject", str(e)) from None
        for a in attacks:
            need(cfg, a.worker < cfg.runtime.workers, "inject",
                 f"worker {a.worker} is out of range: WORKER must be in [0, {cfg.runtime.workers})")
            need(cfg, a.kind != "silent" or cfg.runtime.elastic, "inject",
                 "silent needs --elastic (without elastic membership a worker that never "
                 "sends again stops the run)")
            need(cfg, a.kind != "lie-tokens" or cfg.runtime.local_steps == "proportional", "inject",
                 "lie-tokens needs --local-steps proportional (only a token-weighted merge "
                 "believes a worker's claim)")
        path = cfg.trust.job_key_file or os.environ.get(JOB_KEY_ENV)
        need(cfg, not cfg.trust.encrypt or bool(path), "encrypt",
             f"needs a job key (--job-key-file or ${JOB_KEY_ENV}): the payloads are "
             "encrypted with it")
        if cfg.trust.encrypt:
            try:
                import cryptography  # noqa: F401
            except ImportError:
                raise ConfigError("encrypt", "needs the 'cryptography' package: pip install "
                                  "'loco[encrypt]'") from None
        if path:
            from loco.comm.auth import load_key

            try:
                load_key(path)
            except ValueError as e:
                raise ConfigError("job_key_file", str(e)) from None
