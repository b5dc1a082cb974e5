"""A run's summary: the typed record that ``summary.json`` holds (torch-free).

[`Summary`][loco.training.summary.Summary] has one field per key of ``summary.json``, in the
file's order. ``Summary.to_dict()`` is the file's content; ``Summary.from_dict()`` reads it
back, also from an older run that lacks some keys or a file that others added keys to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from loco.lazy import renamed


@dataclass
class Summary:
    """The final numbers of one ``loco train`` run, as the lead rank writes them to
    ``summary.json``. Every field but ``unknown`` is one key of the file; a key that an
    older run did not write is None. "Per rank" values are the largest of any rank's (each
    rank of a worker sends its share), "per worker" ones the largest of any worker's, its
    ranks summed; "bytes" count the training traffic only (tag
    ``train``, see How bytes are counted).

    Args:
        algorithm: the method (``--algorithm``).
        workers: replicas M that trained (torchrun decides it when launched by torchrun).
        stages: pipeline stages per replica (``--stages``).
        routing: the pipeline's routing (``--routing``); None without pipeline stages.
        launcher: how the ranks were started: ``threads``, ``processes`` or ``torchrun``.
        worker_ranks: ranks R per worker (``--worker-ranks``).
        worker_parallel: how a worker's ranks share the model: ``ddp`` or ``fsdp``.
        inner_steps: inner steps T of the run (``--steps``).
        tokens: training tokens of the whole run, every rank together.
        final_eval_loss: the final model's mean token loss on the validation split, in nats
            per token.
        final_model: which model ``final_eval_loss`` is of, in words: "the global model"
            (a method with a global copy: DiLoCo, Streaming DiLoCo, SparseLoCo), "the model"
            (every replica holds it: DataParallel, DeMo), "worker 0's replica" or "the
            replicas' average" (NoLoCo, Local, SPARTA; ``--final-average``).
        final_eval_loss_extra: the final model's loss on ``--eval-corpus``, in nats per
            token; None without one.
        unigram_entropy: the training split's unigram entropy, in nats per token (a
            reference loss).
        model_parameters: parameters of the whole model.
        bytes_sent_per_rank: bytes sent between workers, the busiest rank's (as
            ``slow_link_bytes_sent_per_rank``).
        bytes_received_per_rank: bytes received from other workers, the busiest rank's.
        raw_bytes_per_rank: what ``bytes_sent_per_rank`` would be in fp32 without a
            codec, in bytes.
        peak_sync_bytes_per_rank: bytes of the largest single synchronization, the busiest
            rank's.
        pipeline_bytes_sent_per_rank: bytes sent between pipeline stages, the busiest
            rank's; None without stages.
        slow_link_bytes_sent_per_rank: bytes sent over the slow link between workers, the
            busiest rank's.
        slow_link_bytes_sent_per_worker: bytes sent over the slow link, the busiest worker's
            (its ranks summed).
        fast_link_bytes_sent_per_rank: bytes sent over the fast link inside a worker, the
            busiest rank's (0 for R = 1).
        fast_link_bytes_sent_per_worker: bytes sent over the fast link, the busiest worker's
            (its ranks summed).
        memory_bytes_per_rank: bytes of the tensors a rank holds by part (``model``,
            ``gradients``, ``inner_optimizer``, ``outer``: the outer algorithm's state, sync
            buffers and spare copies; ``comm``: the buffers its Comms keep between
            operations; ``staging``: the checkpoint's host buffers, 0 on a CPU), the
            largest of any rank; None when the algorithm does not report them. Runs from
            before ``comm`` and ``staging`` were counted lack those two keys (their state
            counted the first four).
        max_rss_bytes: peak resident memory of the largest process, in bytes (threads: all
            ranks').
        memory_peak_over_state: for the rank where it is largest, ``state_bytes`` (the sum
            of its ``memory_bytes``), ``peak_bytes`` (on the CPU its process's peak
            resident memory, shared by the ranks of the threads launcher; on a GPU the
            device's peak allocated), ``peak_of`` (``resident`` or ``device``) and
            ``ratio``; None when the state is not reported.
        syncs: synchronizations worker 0 took part in.
        comm_seconds: seconds worker 0 had operations in flight.
        comm_wait_seconds: the longest time any rank was blocked on training communication,
            in seconds.
        compute_utilization: 1 - blocked time / training-loop time, the mean over ranks (a
            fraction in [0, 1]).
        nonfinite_skipped: non-finite ``inner_steps`` and ``syncs`` skipped (``--on-
            nonfinite skip``), summed over ranks; a sync skipped by all its workers counts
            once per worker.
        goodput: the share of the workers' capacity that went into committed progress
            (``loco.training.goodput``): ``total``, ``per_worker`` and each worker's
            ``step_seconds`` when it does not wait; None for runs before it was recorded.
        worker_speeds: the speed factors of ``--worker-speed``, one per worker; None when
            every worker ran at its own speed.
        local_steps: with ``--local-steps proportional``: ``rounds``, every round's inner
            steps per worker as the workers agreed them; ``max_staleness``; with
            asynchronous outer steps, ``staleness``: how many blocks of all workers were
            applied at each staleness (outer steps old); with ``--quorum``, ``quorum``,
            ``grace``, ``held_syncs`` and ``merged`` (every sync's merged workers, None
            where it was held); None otherwise.
        resumed_from_step: the checkpoint's step this run resumed from; None for a fresh
            run.
        restarts: times the launcher restarted the workers.
        elastic: with ``--elastic``: ``min_workers`` and the recovery report (syncs by
            participants, dropped syncs, losses, membership events); None otherwise.
        link: the emulated slow link's ``bandwidth`` and ``latency`` as given; None without
            one.
        fast_link: the emulated fast link's ``bandwidth`` and ``latency``; None without one.
        wall_seconds: seconds of the lead rank's whole worker, evaluation included.
        train_seconds: seconds of the slowest rank's training loop, without evaluation and
            the spread diagnostic.
        eval_seconds: seconds of the periodic evaluations.
        diagnostic_seconds: seconds of the replicas' spread diagnostic.
        checkpoints: checkpoints the lead rank took in this run (not one it resumed from).
        checkpoint_seconds: the time its training thread was blocked by them (waiting for
            the previous write and copying the state; the writing is in the background).
        tokens_per_second: ``tokens / train_seconds``.
        per_worker: every rank's counters, in rank order.
        fragments: per fragment (Streaming DiLoCo, DiLoCo): tensors, elements, syncs and
            bytes; None for other methods.
        codec_kernel: the wire ``codec``, the ``kernel`` that ran it and the ``reason``;
            None without a codec.
        replicas: methods whose replicas differ (and ``--eval-replicas``): every replica's
            eval loss, their mean, the loss of their average; None otherwise.
        replicas_verified: with ``--verify-every K`` (a method with replicated state): the
            replica checks' ``every``, ``checks``, ``differed`` (``step``, ``workers`` named,
            ``healed_from``), ``skipped``, ``bytes_sent`` and ``seconds``; None otherwise.
        guard: what the guard did (``--aggregation``): ``aggregation``, ``factor``,
            ``injected`` (the ``--inject`` entries) and ``detected``, one entry per worker
            and sign (``nonfinite``, ``high``, ``low``, ``stale``, ``mac``) with the
            ``rows`` named (each reducer counts the rows it judged), ``first_step``,
            ``last_step`` and the ``action``; ``peak_ratio``: by worker, the largest ratio
            of its contribution's norm to the median it was judged by; None without a
            guard.
        corpus: the corpus's ``name``, ``train_tokens``, ``val_tokens``, ``vocab_size`` and
            ``eval_corpus_tokens``.
        device: the lead rank's device, as torch names it (``cpu``, ``cuda:0``).
        machine: host, platform, CPU, cores, accelerator, Python and torch versions.
        config: the run's full configuration (``TrainConfig.to_dict()``).
        unknown: keys this record does not know (added by other tools, such as the
            evaluation harness's scores), in the file's order; written back after the known
            ones.
    """

    algorithm: str | None = None
    workers: int | None = None
    stages: int | None = None
    routing: str | None = None
    launcher: str | None = None
    worker_ranks: int | None = None
    worker_parallel: str | None = None
    inner_steps: int | None = None
    tokens: int | None = None
    final_eval_loss: float | None = None
    final_model: str | None = None
    final_eval_loss_extra: float | None = None
    unigram_entropy: float | None = None
    model_parameters: int | None = None
    bytes_sent_per_rank: int | None = None
    bytes_received_per_rank: int | None = None
    raw_bytes_per_rank: int | None = None
    peak_sync_bytes_per_rank: int | None = None
    pipeline_bytes_sent_per_rank: int | None = None
    slow_link_bytes_sent_per_rank: int | None = None
    slow_link_bytes_sent_per_worker: int | None = None
    fast_link_bytes_sent_per_rank: int | None = None
    fast_link_bytes_sent_per_worker: int | None = None
    memory_bytes_per_rank: dict[str, int] | None = None
    max_rss_bytes: int | None = None
    memory_peak_over_state: dict[str, Any] | None = None
    syncs: int | None = None
    comm_seconds: float | None = None
    comm_wait_seconds: float | None = None
    compute_utilization: float | None = None
    nonfinite_skipped: dict[str, int] | None = None
    goodput: dict[str, Any] | None = None
    worker_speeds: list[float] | None = None
    local_steps: dict[str, Any] | None = None
    resumed_from_step: int | None = None
    restarts: int | None = None
    elastic: dict[str, Any] | None = None
    link: dict[str, Any] | None = None
    fast_link: dict[str, Any] | None = None
    wall_seconds: float | None = None
    train_seconds: float | None = None
    eval_seconds: float | None = None
    diagnostic_seconds: float | None = None
    checkpoints: int | None = None
    checkpoint_seconds: float | None = None
    tokens_per_second: float | None = None
    per_worker: list[dict[str, Any]] | None = None
    fragments: list[dict[str, Any]] | None = None
    codec_kernel: dict[str, Any] | None = None
    replicas: dict[str, Any] | None = None
    replicas_verified: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    corpus: dict[str, Any] | None = None
    device: str | None = None
    machine: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    unknown: dict[str, Any] = field(default_factory=dict)

    @property
    def _sent_per_worker(self) -> int | None:
        """A worker's slow-link bytes, its ranks together (``bytes_sent_per_rank``, a
        worker's of one rank, for runs that predate the per-worker count)."""
        if self.slow_link_bytes_sent_per_worker is not None:
            return self.slow_link_bytes_sent_per_worker
        return self.bytes_sent_per_rank

    @property
    def bits_per_parameter_per_step(self) -> float | None:
        """The one currency every method is compared in: the bits a worker sent to other
        workers per model parameter per inner step,
        ``8 · sent / (model_parameters · inner_steps)``, ``sent`` the worker's slow-link
        bytes, its ranks together. DataParallel in fp32 over a ring of M workers sends
        64 (M − 1) / M; DiLoCo in fp32 about that divided by H; Local 0. None when a part
        is not recorded."""
        sent = self._sent_per_worker
        if sent is None or not self.model_parameters or not self.inner_steps:
            return None
        return 8 * sent / (self.model_parameters * self.inner_steps)

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes a worker sent to other workers per token it trained:
        ``sent · workers / tokens``; None when a part is not recorded."""
        sent = self._sent_per_worker
        if sent is None or not self.tokens or not self.workers:
            return None
        return sent * self.workers / self.tokens

    @property
    def downstream(self) -> dict[str, dict[str, Any]] | None:
        """The final model's task scores, ``{task: {metric: value}}``, as ``loco eval``
        records them (an ``unknown`` key); None for a run not scored."""
        return self.unknown.get("downstream")

    def __getattr__(self, name: str) -> Any:
        """A field's old name (``OLD_KEYS``), for one release, with a DeprecationWarning."""
        if name in OLD_KEYS:
            renamed(f"Summary.{name}", f"Summary.{OLD_KEYS[name]}")
            return getattr(self, OLD_KEYS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The content of ``summary.json``: every known key in the record's order, the
        currency (``DERIVED``: computed from them, for readers of the file), then the
        ``unknown`` ones."""
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "unknown"}
        return {**known, **{k: getattr(self, k) for k in DERIVED}, **self.unknown}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        """The record of a ``summary.json``'s content.

        Args:
            d: the file's content, of this version of loco or an older one: a missing key
                is None, a key the record does not know is kept in ``unknown``, an old key
                (``OLD_KEYS``) is read as its new one, with a DeprecationWarning.
        """
        d = _new_keys(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"unknown"}
        return cls(**{k: v for k, v in d.items() if k in names},
                   unknown={k: v for k, v in d.items() if k not in names and k not in DERIVED})


OLD_KEYS = {f"{what}_per_worker": f"{what}_per_rank"
            for what in ("bytes_sent", "bytes_received", "raw_bytes", "peak_sync_bytes")}
"""Keys of ``summary.json`` renamed, by old name: runs written before the rename are read for
one release. Each was the busiest rank's figure under a name that said worker (a worker's
figure, its ranks summed, is ``slow_link_bytes_sent_per_worker``)."""


def _new_keys(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its old keys (``OLD_KEYS``) under their new names, with one
    DeprecationWarning naming them; a new key present wins."""
    old = [k for k in OLD_KEYS if k in d]
    if not old:
        return d
    renamed(f"summary.json's {', '.join(old)} (a run of an older loco)",
            ", ".join(OLD_KEYS[k] for k in old), stacklevel=4)
    out = {k: v for k, v in d.items() if k not in OLD_KEYS}
    return {**{OLD_KEYS[k]: d[k] for k in old if OLD_KEYS[k] not in d}, **out}


DERIVED = ("bits_per_parameter_per_step", "bytes_per_token")
"""Keys of ``summary.json`` computed from the others (properties of the record): written for
whoever reads the file, recomputed when it is read back."""


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units, for people: ``512B``, ``1.5KB``, ``2.3GB``.

    Args:
        n: a count of bytes (negative allowed).
    """
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"
