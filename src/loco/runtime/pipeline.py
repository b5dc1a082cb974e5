"""Pipeline stages across the ranks of a worker, with fixed or random routing between them.

Launched with ``launch(fn, mesh=Mesh(M, S))``, every worker is a pipeline of S ranks:
rank = worker · S + stage. Each rank holds the whole model object but owns, trains and
synchronises only its stage's part: the model's
[`stage_part`][loco.model.StagedModel.stage_part] (see
[`split_stages`][loco.runtime.pipeline.split_stages]). When a part shares a parameter with another stage's (``tied``: the embedding that the output
head reuses, on stage 0 and stage S − 1), the two copies' gradient increments are summed
point to point after every backward, so both copies stay identical under the same optimizer;
outer algorithms average each copy among the workers of its own stage.

[`PipelineStage`][loco.runtime.pipeline.PipelineStage] runs one training micro-step: stage 0
embeds its worker's batch, the activations (and the int64 targets) cross every boundary
k → k+1, the last stage computes the mean token loss and the activation gradients travel back
along the same path, sequentially (no micro-batch interleaving).

Routing. ``routing="fixed"``: every worker keeps its own pipeline. ``routing="random"``: sample
``s`` of the batch held by worker ``r`` at stage ``k`` goes to worker ``π(r)`` at stage
``k+1``, where π = [`routing_permutation`][loco.runtime.pipeline.routing_permutation] of
(seed, step, s, k); every rank computes π itself (no messages), each rank processes exactly its
batch size of samples per step, and gradients return the same way. Evaluation
([`PipelineStage.evaluate`][loco.runtime.pipeline.PipelineStage.evaluate]) always uses fixed
routing.

All traffic goes through ``ctx.pipe`` (a [`Comm`][loco.comm.comm.Comm] over the world), one
``sendrecv`` per boundary and direction, byte-counted under the tag given (``"train"`` or
``"eval"``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from loco.lazy import renamed_arguments
from loco.model import StagedModel, StageModule, StagePart, stage_bounds

if TYPE_CHECKING:
    from loco.runtime.context import RankContext

ROUTINGS = ("fixed", "random")
"""How samples cross the stage boundaries: each worker's own pipeline, or a random one."""

# Transport message tags of the two tensors that cross a boundary together.
_TAG_ACT, _TAG_TARGET = 1, 2


def stage_part(model: nn.Module, stage: int, stages: int) -> StagePart:
    """The part of ``model`` that pipeline stage ``stage`` of ``stages`` owns: the model's
    own [`stage_part`][loco.model.StagedModel.stage_part].

    Args:
        model: the whole model, a [`StagedModel`][loco.model.StagedModel] (loco's
            ``Transformer``, a Hugging Face Llama model).
        stage: the stage, in [0, stages).
        stages: S, in [1, the model's number of blocks].

    Raises:
        ValueError: a model that stages cannot split, or ``stages`` out of range.
    """
    if not isinstance(model, StagedModel):
        raise ValueError(f"pipeline stages cannot split a {type(model).__name__}: loco's "
                         "Transformer and Hugging Face Llama models only")
    return model.stage_part(stage, stages)


def split_stages(model: nn.Module, stages: int) -> list[StagePart]:
    """The parts of ``model`` owned by each of ``stages`` pipeline stages (its
    [`stage_part`][loco.model.StagedModel.stage_part] of each).

    The blocks are cut into S contiguous runs, as equal as possible
    ([`stage_bounds`][loco.model.stage_bounds]); stage 0 owns the token embedding, stage
    S − 1 the final norm and the output head. With one stage the single part owns the whole
    model. The parts share ``model``'s modules.

    Args:
        model: the whole model, a [`StagedModel`][loco.model.StagedModel].
        stages: S, in [1, the model's number of blocks].

    Raises:
        ValueError: a model that stages cannot split, or ``stages`` out of range.
    """
    return [stage_part(model, k, stages) for k in range(stages)]


@renamed_arguments("routing_permutation", {"replicas": "workers"})
def routing_permutation(seed: int, step: int, sample: int, boundary: int,
                        workers: int) -> list[int]:
    """π for sample index ``sample`` crossing boundary ``boundary`` (stage k → k+1) at ``step``:
    the sample held by worker r at stage k goes to worker π[r] at stage k+1.

    A pure function of its arguments (a ``torch.Generator`` seeded from a hash of them), so
    every rank, and a single-process reference, computes the same permutation.

    Args:
        seed: the run's routing seed.
        step: the training step, the same on every rank.
        sample: the sample's index in the batch, in [0, batch_size).
        boundary: k, the boundary between stage k and stage k + 1, in [0, S − 1).
        workers: M, the number of workers.

    Returns:
        A permutation of ``range(workers)``.
    """
    key = f"loco/pipeline-routing/{seed}/{step}/{sample}/{boundary}".encode()
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
                                      >> 1)
    return torch.randperm(workers, generator=g).tolist()


@renamed_arguments("routing_path", {"replicas": "workers"})
def routing_path(seed: int, step: int, sample: int, origin: int, workers: int,
                 stages: int, routing: str = "random") -> list[int]:
    """Worker visited at every stage by sample ``sample`` of worker ``origin``'s batch.

    Args:
        seed: the run's routing seed.
        step: the training step.
        sample: the sample's index in the batch.
        origin: the worker whose stage 0 embedded the sample, in [0, workers).
        workers: M, the number of workers.
        stages: S, the pipeline stages.
        routing: ``"random"`` (default) follows
            [`routing_permutation`][loco.runtime.pipeline.routing_permutation] at every
            boundary; any other value (``"fixed"``) stays on ``origin``.

    Returns:
        S worker indices, the first ``origin``.
    """
    path = [origin]
    for k in range(stages - 1):
        r = path[-1]
        path.append(routing_permutation(seed, step, sample, k, workers)[r]
                    if routing == "random" else r)
    return path


class PipelineStage:
    """One rank's pipeline stage: runs its part of a training micro-step or an evaluation.

    Build the optimizer (and the outer algorithm) on
    [`parameters`][loco.runtime.pipeline.PipelineStage.parameters] or ``stage.module``, and
    set the algorithm's ``grad_norm_fn`` to
    [`grad_norm`][loco.runtime.pipeline.PipelineStage.grad_norm] so clipping sees the whole
    model's norm.

    Args:
        model: this rank's full model object, a
            [`StagedModel`][loco.model.StagedModel]; only this stage's part is used and
            trained.
        ctx: the launch's [`RankContext`][loco.runtime.context.RankContext]; its
            ``pipe`` Comm carries the traffic between stages (required when S > 1), its mesh
            gives the stage (``ctx.stage``) and the worker.
        batch_size: samples per batch of every worker, >= 1 (later stages must know the
            shapes they receive).
        seq_len: tokens per sample.
        routing: ``"fixed"`` (default: every worker keeps its own pipeline) or
            ``"random"`` (each sample crosses every boundary to a worker drawn by
            [`routing_permutation`][loco.runtime.pipeline.routing_permutation]).
        seed: the routing seed, the same on every rank; default 0.
        autocast: a context manager entered around each stage's forward (e.g.
            ``torch.autocast("cpu", torch.bfloat16)``); default None (none).

    Raises:
        ValueError: an unknown ``routing``, S > 1 without ``ctx.pipe``, or a model that
            stages cannot split.
    """

    def __init__(self, model: nn.Module, ctx: RankContext, batch_size: int, seq_len: int,
                 *, routing: str = "fixed", seed: int = 0,
                 autocast: contextlib.AbstractContextManager | None = None):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)} (got {routing!r})")
        self.ctx = ctx
        self.stages = ctx.stages
        self.workers = ctx.workers
        self.stage = ctx.stage
        self.worker = ctx.worker
        if self.stages > 1 and ctx.pipe is None:
            raise ValueError("a pipeline of several stages needs ctx.pipe")
        self.pipe = ctx.pipe
        # Every tensor that travels between stages lives on the transport's device.
        self.device = ctx.pipe.device if ctx.pipe is not None else ctx.device
        self._group_cache: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        self.module = stage_part(model, self.stage, self.stages)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.routing, self.seed = routing, seed
        # Mixed precision applies inside each stage; activations cross boundaries in the
        # parameters' dtype, so a receiver always knows what arrives.
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.dtype = next(self.module.parameters()).dtype
        # For each sample index of the last step, the worker it came from at the previous
        # stage (this worker for stage 0): every index exactly once, for any routing.
        self.last_sources: list[int] = []
        self.samples_processed = 0

    @property
    def is_first(self) -> bool:
        """Whether this is stage 0 (it embeds the tokens)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this is stage S − 1 (it computes the loss)."""
        return self.stage == self.stages - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters (those of ``module``), for its optimizer."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters by the model's names (``blocks.3.attn.qkv.weight``)."""
        return self.module.named_parameters()

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters, without the last stage's copy of the tied
        embedding (stage 0 owns it): each of the model's parameters is owned by exactly one
        stage, so sums over the stages of a worker (norms, spreads) count it once."""
        tied = self.module.tied if self.is_last else None
        return [p for p in self.module.parameters() if p.requires_grad and p is not tied]

    def grad_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """The gradient norm of the whole model, from this stage's ``params``: the squared
        norms of every stage's owned gradients, summed over the worker's stages in stage
        order (the same float result on each). For ``Algorithm.grad_norm_fn``.

        Collective over the worker's stages (with S > 1): every stage must call it.

        Args:
            params: this stage's parameters whose gradients count (those of the algorithm);
                the last stage's copy of the tied embedding is left out.

        Returns:
            The norm, a 0-d fp32 tensor.
        """
        owned = {id(p) for p in self.owned_parameters()}
        grads = [p.grad.detach().float() for p in params
                 if id(p) in owned and p.grad is not None]
        sq = (torch.stack([g.pow(2).sum() for g in grads]).sum() if grads
              else torch.zeros((), dtype=torch.float32, device=self.device)).reshape(1)
        if self.stages == 1:
            return sq.sqrt()[0]
        members = [self.ctx.mesh.rank_of(self.worker, k) for k in range(self.stages)]
        parts = self.pipe.exchange(sq, members, tag="train").wait()
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.sqrt()[0]

    def _forward(self, inputs, params=None) -> torch.Tensor:
        with self.autocast:
            if params is None:
                out = self.module(inputs)
            else:
                out = torch.func.functional_call(self.module, params, (inputs,))
        return out if self.is_last else out.to(self.dtype)

    # ------------------------------------------------------------------------ routing plan
    def _perm(self, step: int, sample: int, boundary: int, routing: str) -> list[int]:
        if routing == "fixed" or self.workers == 1:
            return list(range(self.workers))
        return routing_permutation(self.seed, step, sample, boundary, self.workers)

    def _next_workers(self, step: int, routing: str) -> list[int]:
        """Worker at stage+1 that sample s of this rank goes to."""
        return [self._perm(step, s, self.stage, routing)[self.worker]
                for s in range(self.batch_size)]

    def _prev_workers(self, step: int, routing: str) -> list[int]:
        """Worker at stage-1 that sample s of this rank comes from."""
        return [self._perm(step, s, self.stage - 1, routing).index(self.worker)
                for s in range(self.batch_size)]

    def _groups(self, peers: list[int]) -> dict[int, torch.Tensor]:
        """The samples going to (or coming from) each peer, as index tensors on the device,
        by peer. One host-to-device copy for all of them (pinned, not blocking the host, on
        a GPU), and none for a plan seen lately (fixed routing: every step's)."""
        key = tuple(peers)
        if key not in self._group_cache:
            out: dict[int, list[int]] = {}
            for s, p in enumerate(peers):
                out.setdefault(p, []).append(s)
            order = sorted(out)
            flat = torch.tensor([s for p in order for s in out[p]], dtype=torch.long)
            if self.device.type == "cuda":
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            if len(self._group_cache) >= 64:  # random routing: a new plan most steps
                self._group_cache.pop(next(iter(self._group_cache)))
            self._group_cache[key] = dict(zip(order, flat.split([len(out[p]) for p in order])))
        return self._group_cache[key]

    # ------------------------------------------------------------------------ transport
    def _send(self, tensors: list[tuple[torch.Tensor, int]], peers: list[int], stage: int,
              tag: str):
        """Send row s of every tensor to worker ``peers[s]`` at ``stage``; one message per
        (peer, tensor)."""
        sends = []
        for peer, idx in self._groups(peers).items():
            dst = self.ctx.mesh.rank_of(peer, stage)
            for t, ttag in tensors:
                sends.append((t.detach().index_select(0, idx).contiguous(), dst, ttag))
        return self.pipe.sendrecv(sends, [], tag)

    def _recv(self, specs: list[tuple[tuple, torch.dtype, int]], peers: list[int], stage: int,
              tag: str) -> list[torch.Tensor]:
        """Receive row s of every tensor from worker ``peers[s]`` at ``stage``."""
        groups = self._groups(peers)
        outs = [torch.empty((self.batch_size, *shape), dtype=dt, device=self.device)
                for shape, dt, _ in specs]
        recvs, places = [], []
        for peer, idx in groups.items():
            src = self.ctx.mesh.rank_of(peer, stage)
            for i, (shape, dt, ttag) in enumerate(specs):
                buf = torch.empty((len(idx), *shape), dtype=dt, device=self.device)
                recvs.append((buf, src, ttag))
                places.append((i, idx, buf))
        self.pipe.sendrecv([], recvs, tag).wait()
        for i, idx, buf in places:
            outs[i].index_copy_(0, idx, buf)
        return outs

    def _act_shape(self) -> tuple:
        return (self.seq_len, self.module.width)

    def _check_batch(self, batch):
        if batch is None:
            raise ValueError("stage 0 needs the batch (x, y)")
        x, y = batch
        if tuple(x.shape) != (self.batch_size, self.seq_len) or x.shape != y.shape:
            raise ValueError(f"expected batches of shape {(self.batch_size, self.seq_len)}, "
                             f"got x {tuple(x.shape)} and y {tuple(y.shape)}")
        return x, y

    def _receive_inputs(self, step: int, routing: str, tag: str):
        sources = self._prev_workers(step, routing)
        h, y = self._recv([(self._act_shape(), self.dtype, _TAG_ACT),
                           ((self.seq_len,), torch.long, _TAG_TARGET)],
                          sources, self.stage - 1, tag)
        return sources, h, y

    # ------------------------------------------------------------------------ training
    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor] | None = None,
                         step: int = 0) -> torch.Tensor | None:
        """One training micro-step of this stage; gradients accumulate into the parameters.

        ``batch`` is ``(x, y)`` on stage 0 (this worker's batch) and ignored elsewhere.
        ``step`` seeds the routing and must be the same on every rank. Returns the mean
        token loss of the samples this rank's last stage processed (a detached scalar), or
        None on the other stages. With S > 1 the tied embedding gradient is summed between
        stage 0 and stage S−1 of the worker before this returns.

        Args:
            batch: ``(x, y)`` token ids and targets of shape ``(batch_size, seq_len)`` on
                stage 0; ignored elsewhere (default None).
            step: the training step, which seeds the random routing; the same on every rank
                (default 0).

        Raises:
            ValueError: stage 0 got no batch, or one of the wrong shape.
        """
        routing = self.routing
        if self.stages == 1:
            x, y = self._check_batch(batch)
            self.last_sources = [self.worker] * self.batch_size
            self.samples_processed += self.batch_size
            with self._tied_grad_sync():
                loss = self.module.loss(self._forward(x), y)
                loss.backward()
            return loss.detach()

        pending = []
        with self._tied_grad_sync():
            if self.is_first:
                x, y = self._check_batch(batch)
                sources, h_in = [self.worker] * self.batch_size, None
                h = self._forward(x)
            else:
                sources, h_in, y = self._receive_inputs(step, routing, "train")
                h_in.requires_grad_(True)
                h = self._forward(h_in)
            self.last_sources = sources
            self.samples_processed += self.batch_size
            loss = None
            if self.is_last:
                loss = self.module.loss(h, y)
                loss.backward()
            else:
                dests = self._next_workers(step, routing)
                pending.append(self._send([(h, _TAG_ACT), (y, _TAG_TARGET)], dests,
                                          self.stage + 1, "train"))
                (grad,) = self._recv([(self._act_shape(), h.dtype, _TAG_ACT)], dests,
                                     self.stage + 1, "train")
                h.backward(grad)
            if not self.is_first:
                pending.append(self._send([(h_in.grad, _TAG_ACT)], sources, self.stage - 1,
                                          "train"))
        for handle in pending:
            handle.wait()
        return None if loss is None else loss.detach()

    def _tied_grad_sync(self):
        """Around a backward: afterwards add the other tied copy's gradient increment."""
        if self.module.tied is None:
            return contextlib.nullcontext()
        return _TiedGradSync(self)

    # ------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 params: dict | None = None) -> torch.Tensor | None:
        """Loss of one batch with fixed routing (each worker's own pipeline), no gradients;
        traffic is tagged "eval". ``params`` (by name, e.g. an algorithm's
        ``global_parameters()``) replaces this stage's parameters for the call. ``batch`` is
        used on stage 0 and ignored elsewhere. Returns the loss on the last stage, None
        elsewhere.

        Args:
            batch: ``(x, y)`` of shape ``(batch_size, seq_len)`` on stage 0; ignored
                elsewhere (default None).
            params: parameters by name to evaluate instead of the stage's own; default None.

        Raises:
            ValueError: stage 0 got no batch, or one of the wrong shape.
        """
        if self.stages == 1:
            x, y = self._check_batch(batch)
            return self.module.loss(self._forward(x, params), y)
        if self.is_first:
            x, y = self._check_batch(batch)
            h = self._forward(x, params)
        else:
            _, h_in, y = self._receive_inputs(0, "fixed", "eval")
            h = self._forward(h_in, params)
        if self.is_last:
            return self.module.loss(h, y)
        self._send([(h, _TAG_ACT), (y, _TAG_TARGET)], [self.worker] * self.batch_size,
                   self.stage + 1, "eval").wait()
        return None


class _TiedGradSync:
    """Sums the embedding-gradient increments of a backward between stage 0 and stage S−1 of
    one worker. Only the increment travels, so micro-steps can accumulate gradients; the
    two increments are added in rank order so both copies end bit-identical."""

    def __init__(self, stage: PipelineStage):
        self.stage = stage
        self.weight = stage.module.tied

    def __enter__(self):
        g = self.weight.grad
        self.before = None if g is None else g.detach().clone()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            return False
        st = self.stage
        g = self.weight.grad
        delta = torch.zeros_like(self.weight) if g is None else g.detach().clone()
        if self.before is not None:
            delta -= self.before
        mesh = st.ctx.mesh
        members = [mesh.rank_of(st.worker, 0), mesh.rank_of(st.worker, st.stages - 1)]
        first, last = st.pipe.exchange(delta.contiguous(), members, tag="train").wait()
        total = first + last
        new = total if self.before is None else self.before + total
        if self.weight.grad is None:
            self.weight.grad = new
        else:
            self.weight.grad.copy_(new)
        return False


# StagePart, StageModule and stage_bounds live with the models (loco.model); they are named
# here too, where the pipeline's users import them from.
__all__ = ["ROUTINGS", "PipelineStage", "StageModule", "StagePart", "routing_path",
           "routing_permutation", "split_stages", "stage_bounds", "stage_part"]
