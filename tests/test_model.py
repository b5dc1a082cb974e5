import math

import pytest
import torch
import torch.nn.functional as F

from loco.model import (MODEL_SIZES, Transformer, apply_rotary, model_config, parameter_count,
                        rotary_tables)

pytestmark = pytest.mark.numerics


def build(name="tiny", vocab=64, seq_len=16, seed=0, **overrides):
    cfg = model_config(name, vocab_size=vocab, seq_len=seq_len, **overrides)
    return Transformer(cfg, generator=torch.Generator().manual_seed(seed))


def tokens(vocab=64, B=2, T=16, seed=1):
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny", "small", "medium"])
def test_named_sizes_build_and_run(name):
    model = build(name, vocab=128, seq_len=8)
    assert len(model.blocks) == MODEL_SIZES[name]["n_layers"]
    logits = model(tokens(128, B=1, T=8))
    assert logits.shape == (1, 8, 128)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "name,vocab,lo,hi",
    [
        ("tiny", 2048, 0.05e6, 0.2e6),
        ("small", 4096, 1e6, 2e6),
        ("large", 32000, 100e6, 130e6),
        ("xl", 4096, 250e6, 400e6),
    ],
)
def test_parameter_counts(name, vocab, lo, hi):
    with torch.device("meta"):
        model = Transformer(model_config(name, vocab_size=vocab, seq_len=256))
    assert lo < model.num_parameters() < hi


def test_default_ffn_hidden_is_rounded_multiple_of_32():
    cfg = model_config("small", vocab_size=64, seq_len=8)
    assert cfg.ffn_hidden % 32 == 0
    assert 8 * cfg.d_model / 3 <= cfg.ffn_hidden < 8 * cfg.d_model / 3 + 32
    assert model_config("small", vocab_size=64, seq_len=8, ffn_hidden=100).ffn_hidden == 100


def test_same_seed_same_weights_different_seed_different():
    a, b, c = build(seed=3).state_dict(), build(seed=3).state_dict(), build(seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    two_dim = [k for k in a if a[k].dim() == 2]
    assert two_dim and all(not torch.equal(a[k], c[k]) for k in two_dim)


def test_generator_leaves_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build(seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_causality():
    model = build()
    idx = tokens()
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 64
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
    assert not torch.allclose(before[:, t], after[:, t])


def test_loss_is_cross_entropy_plus_z_loss():
    idx, targets = tokens(seed=1), tokens(seed=2)
    model = build()
    logits = model(idx)
    ce = F.cross_entropy(logits.view(-1, 64), targets.view(-1))
    torch.testing.assert_close(model(idx, targets), ce)

    coef = 1e-2
    model.cfg.z_loss = coef
    lse = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(model(idx, targets), ce + coef * (lse**2).mean())
    assert coef * (lse**2).mean() > 1e-3  # the z-loss term is large enough to be seen


def test_output_head_is_tied_to_embedding():
    model = build()
    vocab_shaped = [n for n, p in model.named_parameters() if 64 in p.shape]
    assert vocab_shaped == ["embed.weight"]
    n_matrices = sum(p.dim() == 2 for p in model.parameters())
    assert n_matrices == 1 + 5 * len(model.blocks)  # embed, then qkv, proj, w1, w2, w3 per block

    # The input uses only row 0 of the embedding, so any gradient on row 1 came through the head.
    idx = torch.zeros(1, 4, dtype=torch.long)
    model(idx, torch.ones(1, 4, dtype=torch.long)).backward()
    assert model.embed.weight.grad[1].abs().sum() > 0


def test_rope_scores_depend_only_on_relative_position():
    head_dim, seq_len = 16, 32
    cos, sin = rotary_tables(head_dim, seq_len, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    rq = apply_rotary(q.expand(seq_len, head_dim), cos, sin)  # q placed at every position
    rk = apply_rotary(k.expand(seq_len, head_dim), cos, sin)
    scores = rq @ rk.T  # scores[i, j] = <q at i, k at j>
    # Exact maths would give equal diagonals. In fp32 the angles (up to 31 rad) are rounded,
    # by up to ulp(31) / 2 ~ 1e-6, so cos and sin are off by ~2e-6 at most, and a score sums
    # |q_j k_j| ~ 14 of them: under 6e-5 (measured 1.5e-6 on every instruction set).
    for offset in (-5, 0, 3):
        diagonal = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=0, atol=1e-4)
    assert not torch.allclose(scores[0, 0], scores[0, 3])
    # A rotation preserves norms.
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(seq_len))


def test_rope_buffers_not_in_state_dict_and_follow_device():
    model = build()
    assert not any("rope" in k for k in model.state_dict())
    model = model.to(torch.float64)
    assert model.rope_cos.dtype == torch.float64


def test_init_std():
    model = build("medium", vocab=4096, seq_len=8)
    std = model.embed.weight.std().item()
    assert abs(std - 0.02) < 0.001
    w2 = model.blocks[0].mlp.w2.weight
    assert abs(w2.std().item() - 0.02 / math.sqrt(2 * 8)) < 0.0005
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_autocast_bf16_forward_backward():
    model = build()
    idx = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_few_adamw_steps_overfit_a_batch():
    model = build()
    idx, targets = tokens(seed=1), tokens(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(idx, targets)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(idx, targets).item() < 0.5 * first


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'huge'.*tiny.*small.*medium.*large.*xl"):
        model_config("huge", vocab_size=64, seq_len=8)


def test_sequence_longer_than_seq_len_raises():
    model = build(seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(B=1, T=9))


@pytest.mark.parametrize("name,vocab,params", [
    ("8b", 4096, 6_996_373_504), ("8b", 128256, 7_504_932_864),
    ("70b", 4096, 68_485_935_104), ("70b", 128256, 69_503_053_824)])
def test_llama_presets_have_llama_3_shapes(name, vocab, params):
    """Llama 3's shapes (grouped-query attention, 8 KV heads, head size 128, rope theta
    500000, explicit SwiGLU width), counted on the meta device and by formula. Llama 3's own
    counts at its vocabulary of 128256 (8,030,261,248 and 70,553,706,496) have an untied
    output head and no QK-norm."""
    cfg = model_config(name, vocab_size=vocab, seq_len=8)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_parameters() == parameter_count(cfg) == params
    llama3 = params + vocab * cfg.d_model - cfg.n_layers * 2 * cfg.head_dim
    assert vocab != 128256 or llama3 == {"8b": 8_030_261_248, "70b": 70_553_706_496}[name]
    shapes = {"8b": (4096, 32, 32, 14336), "70b": (8192, 80, 64, 28672)}[name]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_hidden) == shapes
    assert cfg.n_kv_heads == 8 and cfg.head_dim == 128 and cfg.rope_theta == 500000.0
    assert model.blocks[0].attn.qkv.weight.shape == (cfg.d_model + 2 * 8 * 128, cfg.d_model)


def test_earlier_sizes_keep_their_architecture():
    """Every size without n_kv_heads is multi-head attention as before: one fused q, k, v
    projection 3·d wide, and the parameter count 4d² + 3df + ... per block."""
    for name, dims in MODEL_SIZES.items():
        if "n_kv_heads" in dims:
            continue
        cfg = model_config(name, vocab_size=4096, seq_len=8)
        with torch.device("meta"):
            model = Transformer(cfg)
        d, f = cfg.d_model, cfg.ffn_hidden
        assert model.blocks[0].attn.qkv.weight.shape == (3 * d, d)
        block = 4 * d * d + 3 * d * f + 2 * d + 2 * cfg.head_dim
        assert model.num_parameters() == 4096 * d + cfg.n_layers * block + d


def test_grouped_query_attention_equals_repeated_key_value_heads():
    """4 query heads sharing 2 key/value heads compute what 4 heads with each key/value head
    repeated for its 2 queries compute."""
    gqa, mha = build(n_heads=4, n_kv_heads=2), build(n_heads=4)
    state = gqa.state_dict()
    for i in range(len(gqa.blocks)):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split([32, 16, 16])
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat(
            [q] + [t.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32) for t in (k, v)])
    mha.load_state_dict(state)
    idx = tokens()
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        model_config("tiny", vocab_size=64, seq_len=8, n_heads=4, n_kv_heads=3)


def test_llama_presets_are_options_the_configuration_checks():
    from loco.config import ConfigError, build_config, steps_for_tokens, validate

    validate(build_config(overrides={"model": "70b"}))
    cfg = build_config(overrides={"model": "8b", "tokens": "20x", "workers": 1,
                                  "batch_size": 1, "seq_len": 128})
    assert steps_for_tokens(cfg) == -(-20 * 6_996_373_504 // 128)
    with pytest.raises(ConfigError, match="heads.*multiple of the model's 8 key/value heads"):
        validate(build_config(overrides={"model": "8b", "heads": 4}))
