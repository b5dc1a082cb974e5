"""Models of any size: built on the meta device, sharded by FSDP2 inside a worker, then
materialised, each rank drawing only its shard, bit for bit the rows of the unsharded model
(``build_model``, ``loco.model.materialise``, ``normal_rows``). The built-in model and
Hugging Face models; R = 1, 2, 4 ranks per worker; and one rank of a 64-rank worker of the
70b preset, whose memory is its shard's."""

import json
from types import SimpleNamespace

import pytest
import torch

import loco
import loco.model
from loco.config import build_config
from loco.model import Transformer, materialise, model_config, normal_rows
from loco.training.build import build_model, make_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.numerics

VOCAB = 67  # rows that no R divides: torch.chunk's uneven shards, the last ones shorter
BLOCK = 96  # elements per seeded block in the sharded runs: shards start and end mid-block


def write_hf(path) -> dict[str, str]:
    """A tiny Llama with grouped-query attention (tied embeddings) and a tiny GPT-2 (its
    Conv1D weights, biases, LayerNorms and position embedding), as ``--model`` values."""
    transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, vocab_size=1000,
                             max_position_embeddings=64, tie_word_embeddings=True,
                             bos_token_id=None, eos_token_id=None).save_pretrained(path / "llama")
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=1000, n_positions=64,
                            bos_token_id=0, eos_token_id=0).save_pretrained(path / "gpt2")
    return {"llama": f"hf:{path / 'llama'}", "gpt2": f"hf:{path / 'gpt2'}"}


def config(model: str, ranks: int):
    return build_config(overrides={"model": model, "worker_parallel": "fsdp", "seed": 7,
                                   "worker_ranks": ranks, "seq_len": 16})


def whole(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole: gathering a DTensor is a collective, so every rank
    of the worker calls it."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.detach().clone()
    return out


def built_worker(ctx, models: dict[str, str], block: int):
    """``build_model`` of every model on this rank: the whole tensors, and which are
    sharded."""
    loco.model.INIT_BLOCK = block
    out = {}
    for key, model in models.items():
        built = build_model(config(model, ctx.worker_ranks), ctx, VOCAB)
        out[key] = {"tensors": whole(built),
                    "sharded": sorted(n for n, p in built.named_parameters()
                                      if hasattr(p, "placements")),
                    "over": {p.device_mesh.size() for p in built.parameters()
                             if hasattr(p, "placements")}}
    return out


def built_workers(ctx, models: dict[str, str], block: int):
    """`built_worker` on this rank of a worker of 4 ranks (``ctx``), then as a rank of a
    worker of 2: ranks 0 and 1, and 2 and 3, each pair a worker sharded over a device mesh
    of its own (what ``ctx`` holds for a worker of 2 ranks). One launch for both sizes."""
    from torch.distributed.device_mesh import init_device_mesh

    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "shard"))
    two = SimpleNamespace(device_mesh=pairs, device=ctx.device, worker_ranks=2,
                          inner=SimpleNamespace(size=2, account=lambda *a: None))
    return {4: built_worker(ctx, models, block), 2: built_worker(two, models, block)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"tiny": "tiny", **write_hf(tmp_path_factory.mktemp("hf"))}


@pytest.fixture(scope="module")
def unsharded(models):
    """R = 1: what a worker of one rank builds (``shard_worker`` leaves the model whole, so
    it is materialised whole on the device): the reference."""
    ctx = SimpleNamespace(device_mesh=object(), inner=None, device=torch.device("cpu"),
                          worker_ranks=1)
    old, loco.model.INIT_BLOCK = loco.model.INIT_BLOCK, BLOCK
    try:
        return built_worker(ctx, models, BLOCK)
    finally:
        loco.model.INIT_BLOCK = old


def equal(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.fixture(scope="module")
def sharded(models):
    """What every rank of a worker of 4 ranks builds, and of a worker of 2 (processes)."""
    return loco.launch(built_workers, mesh=loco.Mesh(1, 1, 4), launcher="processes",
                       args=(models, BLOCK))


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_shards_equal_the_unsharded_model_bit_for_bit(models, unsharded, sharded, ranks):
    """Every rank of a worker of R ranks builds on meta, shards, and draws only its rows;
    gathered, the parameters (and the recomputed rotary tables) are the R = 1 model's, bit
    for bit: the built-in model, a GQA Llama with tied embeddings, a GPT-2."""
    for rank in sharded:
        for key in models:
            assert rank[ranks][key]["sharded"], key  # FSDP2 really sharded it
            assert rank[ranks][key]["over"] == {ranks}, key  # over the worker's R ranks
            assert equal(rank[ranks][key]["tensors"], unsharded[key]["tensors"]) == [], key


def test_the_reference_is_drawn_and_tied(unsharded):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    tiny = unsharded["tiny"]["tensors"]
    assert tiny["embed.weight"].std() > 0.01 and torch.equal(
        tiny["norm.weight"], torch.ones(32))
    llama = unsharded["llama"]["tensors"]
    assert "hf.lm_head.weight" not in llama  # tied: one parameter
    assert llama["hf.model.layers.0.self_attn.k_proj.weight"].shape == (8, 32)  # 1 KV head
    rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(hidden_size=32, num_attention_heads=4))
    assert torch.equal(llama["hf.model.rotary_emb.inv_freq"], rotary.inv_freq)
    gpt2 = unsharded["gpt2"]["tensors"]
    assert not gpt2["hf.transformer.h.0.attn.c_attn.bias"].any()
    assert torch.equal(gpt2["hf.transformer.h.0.ln_1.weight"], torch.ones(32))


def test_any_range_of_rows_is_drawn_alone(monkeypatch):
    """Rows [a, b) drawn alone are the whole draw's rows [a, b), whether the range starts and
    ends on a block's boundary, inside one block, or spans several."""
    monkeypatch.setattr(loco.model, "INIT_BLOCK", 5 * 7)  # blocks of 5 rows of 7
    full = normal_rows(torch.empty(23, 7), 0, 23, 0.02, 1, "w")
    for a, b in [(0, 5), (3, 4), (3, 17), (5, 20), (20, 23), (22, 23), (9, 9)]:
        part = normal_rows(torch.empty(b - a, 7), a, 23, 0.02, 1, "w")
        assert torch.equal(part, full[a:b]), (a, b)
    assert torch.equal(normal_rows(torch.empty(23, 7, dtype=torch.float64), 0, 23, 0.02, 1,
                                   "w"), full.double())
    assert not torch.equal(normal_rows(torch.empty(23, 7), 0, 23, 0.02, 1, "v"), full)
    assert not torch.equal(normal_rows(torch.empty(23, 7), 0, 23, 0.02, 2, "w"), full)


def test_meta_build_equals_the_eager_model():
    """``make_model`` (meta, then materialised) and ``Transformer(cfg, generator)`` (drawn at
    once from the generator's seed) are the same model; a used generator gives the same
    weights as a fresh one of its seed."""
    cfg = config("tiny", 1)
    built = make_model(cfg, VOCAB)
    used = torch.Generator().manual_seed(7)
    torch.rand(3, generator=used)
    eager = Transformer(model_config("tiny", VOCAB, 16), used)
    assert equal(whole(built), whole(eager)) == []
    assert make_model(cfg, VOCAB, "meta").embed.weight.is_meta


def test_loaded_weights_are_moved_not_drawn(models, tmp_path):
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=80, max_position_embeddings=64))
    net.save_pretrained(tmp_path / "w")
    cfg = config(f"hf:{tmp_path / 'w'}", 1)
    model = materialise(make_model(cfg, VOCAB, "meta"), "cpu")
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), model.hf.parameters()))


FAKE_RANK = """
import json, time
from types import SimpleNamespace
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from loco.config import build_config
from loco.training.build import build_model

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                if line.startswith(key + ":"))

dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
cfg = build_config(overrides={"model": model, "worker_parallel": "fsdp", "worker_ranks": world})
ctx = SimpleNamespace(device_mesh=mesh, device=torch.device("cpu"),
                      inner=SimpleNamespace(size=world, account=lambda *a: None))
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
base, start = status("VmRSS"), time.perf_counter()
built = build_model(cfg, ctx, 4096)
local = {n: p.to_local() for n, p in built.named_parameters()}
got = {"growth": status("VmHWM") - base, "seconds": time.perf_counter() - start,
       "shard": sum(t.numel() * t.element_size() for t in local.values()),
       "whole": sum(p.numel() * p.element_size() for p in built.parameters()),
       "drawn": float(local["blocks.0.attn.qkv.weight"].detach().std()),
       "ones": bool((local["norm.weight"] == 1).all())}
open(out, "w").write(json.dumps(got))
"""


def fake_rank(rank: int, world: int, model: str, out) -> dict:
    """``FAKE_RANK`` run as rank ``rank`` of ``world`` in a process of its own, forked from
    the launchers' fork server (torch already imported there: what a rank process starts
    from); what it measured."""
    from workers import forked, join_all

    code = {"rank": rank, "world": world, "model": model, "out": str(out)}
    exitcode, = join_all([forked(exec, FAKE_RANK, code)], 600)
    assert exitcode == 0, exitcode
    return json.loads(out.read_text())


@pytest.mark.slow
def test_one_rank_of_a_70b_worker_holds_only_its_shard(tmp_path):
    """Rank 37 of a 128-rank FSDP2 worker of ``--model 70b`` (vocab 4096: 68.5B parameters,
    274 GB in fp32), under torch's fake process group in a process of its own: building,
    sharding and materialising raise its resident memory by at most 1.1 x its shard's bytes
    (2.14 GB; every dimension divides by 128, so the shard is exactly 1/128). Measured:
    1.01 x (of 64 ranks' 4.28 GB shard as well, whose draw took twice the CPU)."""
    got = fake_rank(37, 128, "70b", tmp_path / "rank.json")
    assert got["whole"] == 4 * 68_485_935_104 and got["shard"] == got["whole"] // 128
    assert got["growth"] <= 1.1 * got["shard"], got
    assert abs(got["drawn"] - 0.02) < 1e-3 and got["ones"]
