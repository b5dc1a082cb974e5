"""A small Llama-style decoder-only language model.

Pre-norm transformer with RMSNorm, rotary position embeddings (RoPE), SwiGLU
MLPs, QK-norm (RMSNorm on queries and keys, as in the Streaming DiLoCo
paper's runs) and optional grouped-query attention, an optional z-loss on the
output log-partition function, an output head tied to the token embedding, and
normal(0, 0.02) init with residual output projections scaled down by
sqrt(2 * n_layers). The repeated blocks live in `Transformer.blocks`, an ordered
`nn.ModuleList`; that list is what the training code partitions into fragments.

The init is sharding-invariant (``normal_rows``): a model built on the meta
device, sharded, then materialised (``materialise``) holds, on every rank,
exactly its rows of the unsharded model.

Pipeline stages split a model through the [`StagedModel`][loco.model.StagedModel] interface:
its ``stage_part(stage, stages)`` gives each stage its [`StagePart`][loco.model.StagePart].
``Transformer`` implements it (its parts are [`StageModule`][loco.model.StageModule]s).
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int
    seq_len: int  # maximum context length; sizes the RoPE tables
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # grouped-query attention's key/value heads; None: n_heads
    ffn_hidden: int | None = None  # None: 8/3 * d_model rounded up to a multiple of 32
    rope_theta: float = 10000.0
    qk_norm: bool = True
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2); 0 disables
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(f"head_dim={self.d_model // self.n_heads} must be even for RoPE")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.ffn_hidden is None:
            # 8/3 keeps SwiGLU's three matrices at the parameter cost of a 4x GELU MLP;
            # a multiple of 32 keeps the matmuls hardware friendly.
            self.ffn_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(d_model=32, n_layers=2, n_heads=2),  # ~0.16M params at vocab 4096
    "small": dict(d_model=128, n_layers=4, n_heads=4),  # ~1.3M params at vocab 4096
    "medium": dict(d_model=256, n_layers=8, n_heads=8),  # ~7.5M params at vocab 4096
    "large": dict(d_model=768, n_layers=12, n_heads=12),  # ~88M params at vocab 4096
    "xl": dict(d_model=1024, n_layers=24, n_heads=16),  # ~308M params at vocab 4096
    # The Streaming DiLoCo paper's scaling ladder: head size 64; its MLP is 4·d wide, ours a
    # SwiGLU of 8/3·d at the same parameter cost. Names are the paper's sizes; the count
    # here depends on the vocabulary (at vocab 32k: 35m 35M ... 1b 1.3B).
    "35m": dict(d_model=512, n_layers=6, n_heads=8),
    "100m": dict(d_model=768, n_layers=9, n_heads=12),
    "200m": dict(d_model=1024, n_layers=12, n_heads=16),
    "300m": dict(d_model=1280, n_layers=15, n_heads=20),
    "500m": dict(d_model=1536, n_layers=18, n_heads=24),
    "1b": dict(d_model=2048, n_layers=24, n_heads=32),
    # Llama 3's shapes: grouped-query attention with 8 KV heads, head size 128, rope theta
    # 500000 (this model's QK-norm and tied head are not Llama 3's). 8B: 32 layers x 4096,
    # 32 heads, SwiGLU hidden 14336 (7.00B params at vocab 4096, 7.50B at 128256). 70B: 80
    # layers x 8192, 64 heads, hidden 28672 (68.49B at vocab 4096, 69.50B at 128256).
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
               rope_theta=500000.0),
    "70b": dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                rope_theta=500000.0),
}


def parameter_count(cfg: ModelConfig) -> int:
    """The parameters of ``Transformer(cfg)``, counted without building it (the head is
    tied to the embedding, so it adds none).

    Args:
        cfg: the model's configuration.
    """
    d, f, kv = cfg.d_model, cfg.ffn_hidden, cfg.n_kv_heads * cfg.head_dim
    norms = 2 * cfg.head_dim if cfg.qk_norm else 0
    attention = d * (d + 2 * kv) + d * d  # the fused q, k, v projection and the output's
    block = attention + 3 * d * f + 2 * d + norms  # SwiGLU, two norms, q/k norms
    return cfg.vocab_size * d + cfg.n_layers * block + d


def model_config(name: str, vocab_size: int, seq_len: int, **overrides) -> ModelConfig:
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_SIZES)}")
    return ModelConfig(vocab_size=vocab_size, seq_len=seq_len, **{**MODEL_SIZES[name], **overrides})


class Linear(nn.Linear):
    """Bias-free linear layer that leaves its weight for Transformer to initialise.

    nn.Linear's own init draws from the global RNG, which workers building models
    concurrently in threads must not touch.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)

    def reset_parameters(self):
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Mean of squares in bf16 loses too much precision, so normalise in fp32.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of angle position * theta^(-2i/head_dim), each [seq_len, head_dim // 2]."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by position, pairing dimension i with i + head_dim/2.

    cos and sin are [T, head_dim // 2]. The rotation makes q.k depend on positions
    only through their difference.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.float(), sin.float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # Grouped-query attention: n_heads queries share n_kv_heads keys and values.
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * cfg.n_kv_heads * cfg.head_dim)
        self.proj = Linear(cfg.d_model, cfg.d_model)
        # QK-norm bounds the attention logits, which keeps training stable at high learning rates.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([C, kv, kv], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.d_model, cfg.ffn_hidden)  # gate
        self.w3 = Linear(cfg.d_model, cfg.ffn_hidden)  # up
        self.w2 = Linear(cfg.ffn_hidden, cfg.d_model)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def rope_window(cos: torch.Tensor, sin: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first T rows of the rotary tables, with a clear error past the model's seq_len."""
    if T > cos.shape[0]:
        raise ValueError(f"sequence length {T} exceeds the model's seq_len {cos.shape[0]}")
    return cos[:T], sin[:T]


def token_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32, plus the optional z-loss."""
    logits = logits.float()
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
    if z_loss:
        # Pulls log Z towards 0 so the softmax normaliser cannot drift (PaLM).
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return loss


class StagedModel:
    """What a model provides so that pipeline stages can split it (``loco.runtime.pipeline``
    uses nothing else of it): ``stage_part``. A model that stages can split derives from it
    and implements ``stage_part``."""

    def stage_part(self, stage: int, stages: int) -> "StagePart":
        """The part of the model that pipeline stage ``stage`` of ``stages`` owns, a
        [`StagePart`][loco.model.StagePart] that shares the model's modules.

        Args:
            stage: the stage, in [0, stages).
            stages: S, in [1, the model's number of blocks].

        Raises:
            ValueError: ``stages`` out of range.
        """
        raise NotImplementedError


# ------------------------------------------------------------- sharding-invariant init
INIT_BLOCK = 1 << 16
"""Elements per seeded block of rows (at least one row): the extra memory of drawing a
shard, and the unit the bits are defined in."""


def block_seed(seed: int, name: str, block: int) -> int:
    """The seed of block ``block`` of parameter ``name``: a hash of the three, stable across
    processes and Python's hash seed (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor this rank fills for parameter ``p``, and the row of the whole that it
    starts at: ``p`` and 0 for a plain tensor; for a DTensor its ``to_local()`` and, when
    it is sharded on dimension 0 (FSDP2), the offset ``torch.chunk`` gives the mesh
    coordinate: coordinate x ceil(rows / ranks).

    Raises:
        ValueError: a DTensor sharded on another dimension, or on several mesh dimensions.
    """
    placements = getattr(p, "placements", None)
    if placements is None:
        return p, 0
    sharded = [(d, pl) for d, pl in enumerate(placements) if pl.is_shard()]
    if not sharded:
        return p.to_local(), 0
    if len(sharded) > 1 or sharded[0][1].dim != 0:
        raise ValueError(f"cannot initialise a DTensor placed {placements}: only one "
                         "dimension-0 shard is supported")
    mesh_dim = sharded[0][0]
    chunk = -(-p.shape[0] // p.device_mesh.size(mesh_dim))
    return p.to_local(), p.device_mesh.get_coordinate()[mesh_dim] * chunk


@torch.no_grad()
def normal_rows(out: torch.Tensor, first: int, rows: int, std: float, seed: int,
                name: str) -> torch.Tensor:
    """Fill ``out`` with rows ``[first, first + len(out))`` of a normal(0, ``std``)
    parameter of ``rows`` rows, the same bits whichever range is asked for.

    The parameter's rows are cut into blocks of ``max(1, INIT_BLOCK // row size)`` rows
    (the last one shorter); block b is drawn alone, on the CPU generator, from
    ``block_seed(seed, name, b)``. So any shard of dimension 0 (FSDP2's) is drawn with at
    most one block of extra memory, with the bits of the unsharded draw on any device.

    Args:
        out: the rows to fill (at least one dimension), any device and floating dtype.
        first: the row of the whole that ``out`` starts at, in [0, rows].
        rows: the whole parameter's rows (its dimension 0).
        std: the standard deviation, > 0.
        seed: the run's seed.
        name: the parameter's name in its model (``blocks.0.attn.qkv.weight``).

    Returns:
        ``out``.
    """
    if out.shape[0] == 0:  # a rank past the last of torch.chunk's shards
        return out
    per = max(1, INIT_BLOCK // max(1, math.prod(out.shape[1:])))
    stop = first + out.shape[0]
    for b in range(first // per, -(-stop // per)):
        lo, hi = b * per, min((b + 1) * per, rows)
        gen = torch.Generator().manual_seed(block_seed(seed, name, b))
        dst = out[max(lo, first) - first:min(hi, stop) - first]
        if (dst.shape[0] == hi - lo and out.device.type == "cpu" and out.dtype == torch.float32
                and dst.is_contiguous()):
            dst.normal_(0.0, std, generator=gen)  # the whole block: drawn in place
        else:
            block = torch.empty((hi - lo, *out.shape[1:])).normal_(0.0, std, generator=gen)
            dst.copy_(block[max(lo, first) - lo:min(hi, stop) - lo])
    return out


def materialise(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a model built on the meta device (whole, or sharded by FSDP2) on ``device``
    and initialise it with its ``init_weights()``; a model whose parameters are already real
    (loaded weights) is moved there instead.

    The buffers that were real before (a Hugging Face model's rotary tables) keep their
    values, and tied parameters stay one parameter (``to_empty`` makes new ones); the
    model's ``init_weights`` fills its parameters (each rank its own shard) and any buffer
    built on meta.

    Args:
        model: a ``Transformer`` or another module with an ``init_weights()``, possibly
            sharded.
        device: the rank's device.

    Returns:
        ``model``, on ``device``.
    """
    if not any(p.is_meta for p in model.parameters()):
        return model.to(device)
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (module, name), *tied in (o for o in owners.values() if len(o) > 1):
        for other, other_name in tied:
            other._parameters[other_name] = module._parameters[name]
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in kept:
                b.copy_(kept[n])
    model.init_weights()
    return model


class Transformer(nn.Module, StagedModel):
    """The decoder. Built under ``torch.device("meta")`` it allocates nothing (then
    ``materialise`` it, before or after sharding); otherwise its weights are drawn at once
    by ``init_weights``.

    Args:
        cfg: the model's configuration.
        generator: its ``initial_seed()`` is the init's seed (the generator is not drawn
            from: a generator already used gives the same weights as a fresh one of the same
            seed); None: a seed drawn from torch's global generator.
    """

    def __init__(self, cfg: ModelConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.seed = (generator.initial_seed() if generator is not None
                     else int(torch.randint(2**62, (1,), device="cpu")))
        # Passing _weight skips nn.Embedding's own init, which would use the global RNG.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Derived from the config, so kept out of the state dict.
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.embed.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter, or this rank's shard of it, from ``self.seed``, and compute
        the rotary tables, on the device they are on.

        Matrices (the embedding and every Linear) are normal(0, init_std), the residual
        output projections (``attn.proj``, ``mlp.w2``) normal(0, init_std / sqrt(2 ·
        n_layers)) (GPT-2), drawn by ``normal_rows`` keyed by the parameter's name; norms'
        gains are ones. Any sharding on dimension 0 gives the unsharded model's bits.
        """
        # Each block adds two residual branches; shrinking their output projections
        # keeps the residual stream's variance from growing with depth (GPT-2).
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            local, first = local_rows(p)
            if p.dim() == 2:  # every Linear and the Embedding; norm weights stay at 1
                std = residual_std if name.endswith(("attn.proj.weight", "mlp.w2.weight")) else self.cfg.init_std
                normal_rows(local, first, p.shape[0], std, self.seed, name)
            else:
                local.fill_(1.0)
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope_window(self.rope_cos, self.rope_sin, idx.shape[1])
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        # Tied head: the embedding matrix doubles as the output projection.
        logits = F.linear(self.norm(x), self.embed.weight)
        if targets is None:
            return logits
        return token_loss(logits, targets, self.cfg.z_loss)

    def num_parameters(self) -> int:
        # parameters() yields each tensor once, so the tied head is not double counted.
        return sum(p.numel() for p in self.parameters())

    def stage_part(self, stage: int, stages: int) -> "StageModule":
        """The part of this model pipeline stage ``stage`` of ``stages`` owns (see
        [`StageModule`][loco.model.StageModule]).

        Args:
            stage: the stage, in [0, stages).
            stages: S, in [1, n_layers].

        Raises:
            ValueError: ``stages`` out of range.
        """
        return StageModule(self, stage, stages)


# ------------------------------------------------------------------------ pipeline stages
def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Block index ranges ``[start, stop)`` of each stage: contiguous, as equal as possible.

    Earlier stages take the extra block when ``stages`` does not divide ``n_layers``.

    Args:
        n_layers: the model's blocks.
        stages: S, an integer in [1, n_layers].

    Returns:
        S ranges ``(start, stop)`` covering ``[0, n_layers)`` in order.

    Raises:
        ValueError: ``stages`` < 1 or more than ``n_layers``.
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1 (got {stages})")
    if stages > n_layers:
        raise ValueError(f"{stages} pipeline stages need at least {stages} blocks "
                         f"(the model has {n_layers})")
    base, extra = divmod(n_layers, stages)
    bounds, start = [], 0
    for k in range(stages):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class StagePart(nn.Module):
    """What every stage's part of a model offers the pipeline: its place (``stage``,
    ``stages``, ``block_range``, ``is_first``, ``is_last``), the width of the activations it
    passes on (``width``), the parameter it shares with another stage (``tied``: the tied
    embedding of a model whose head reuses it, on the first and last of several stages; else
    None), ``forward`` and ``loss``.

    ``forward`` maps token ids ``(batch, seq)`` (stage 0) or activations
    ``(batch, seq, width)`` (later stages) to activations, or on the last stage to logits
    ``(batch, seq, vocab)``. The part shares the model's modules and names its parameters as
    the model does, so an optimizer or an outer algorithm built on it sees exactly this
    stage's parameters.

    Args:
        stage: this part's stage, in [0, stages).
        stages: S, in [1, the model's number of blocks].
        n_blocks: the model's blocks.
        width: the activations' last dimension (d_model).
        z_loss: the model's z-loss coefficient.

    Raises:
        ValueError: ``stages`` out of range.
    """

    def __init__(self, stage: int, stages: int, n_blocks: int, width: int, z_loss: float):
        super().__init__()
        self.stage, self.stages = stage, stages
        self.block_range = stage_bounds(n_blocks, stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.width, self.z_loss = width, z_loss

    @property
    def tied(self) -> nn.Parameter | None:
        """The parameter this part shares with another stage's part, or None."""
        return None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss, as the whole model computes it (with its z-loss).

        Args:
            logits: the last stage's output, ``(batch, seq, vocab)``.
            targets: the next-token ids, ``(batch, seq)``.
        """
        return token_loss(logits, targets, self.z_loss)


class StageModule(StagePart):
    """The part of a ``Transformer`` one pipeline stage owns: its
    run of blocks (``stage_bounds``), the token embedding on stage 0, the final norm and the
    output head on stage S − 1. The head is tied to the embedding, so the last of several
    stages holds the embedding too (``tied``). Parameters keep the model's names
    (``embed.weight``, ``blocks.3.attn.qkv.weight``, ``norm.weight``).

    Args:
        model: the whole model, whose modules are shared.
        stage: this part's stage, in [0, stages).
        stages: S, in [1, the model's number of blocks].

    Raises:
        ValueError: ``stages`` out of range.
    """

    def __init__(self, model: Transformer, stage: int, stages: int):
        super().__init__(stage, stages, len(model.blocks), model.cfg.d_model, model.cfg.z_loss)
        self.cfg = model.cfg
        start, stop = self.block_range
        self.embed = model.embed if (self.is_first or self.is_last) else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, stop)})
        self.norm = model.norm if self.is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def tied(self) -> nn.Parameter | None:
        """The embedding matrix, on the first and the last of several stages (the head
        reuses it); else None."""
        return self.embed.weight if self.stages > 1 and self.embed is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's part of the forward pass.

        Args:
            x: token ids ``(batch, seq)`` on stage 0, activations ``(batch, seq, d_model)``
                on later stages.

        Returns:
            Activations ``(batch, seq, d_model)``, or on the last stage logits
                ``(batch, seq, vocab)``.
        """
        cos, sin = rope_window(self.rope_cos, self.rope_sin, x.shape[1])
        if self.is_first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.is_last:
            x = F.linear(self.norm(x), self.embed.weight)
        return x
