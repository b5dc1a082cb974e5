"""Hugging Face models through ``--model hf:PATH``: a tiny Llama and a tiny GPT-2, built from
configs written here (no network), trained by every algorithm, split into fragments and
pipeline stages, loaded from weights; and the one-line errors of unusable models."""

import json
import subprocess
import sys

import pytest
import torch

from loco import hf
from loco.algorithms.fragments import find_blocks, split_fragments
from loco.cli import main
from loco.runtime.pipeline import split_stages

transformers = pytest.importorskip("transformers")

ALGORITHMS = ("streaming", "diloco", "noloco", "ddp", "local")


def write_llama(path, layers=2, vocab=1000, tie=False):
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab,
                             max_position_embeddings=64, tie_word_embeddings=tie,
                             bos_token_id=None, eos_token_id=None).save_pretrained(path)
    return f"hf:{path}"


def write_gpt2(path):
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=1000, n_positions=64,
                            bos_token_id=0, eos_token_id=0).save_pretrained(path)
    return f"hf:{path}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    return {"llama": write_llama(d / "llama"), "llama4": write_llama(d / "llama4", layers=4),
            "gpt2": write_gpt2(d / "gpt2")}


def hf_run(corpus, out, model, *extra):
    text, cache = corpus
    return ["train", "--model", model, "--workers", "2", "--steps", "8", "--sync-every", "4",
            "--seq-len", "32", "--batch-size", "4", "--vocab-size", "300", "--eval-every", "4",
            "--eval-batches", "2", "--log-every", "2", "--corpus", text, "--cache-dir", cache,
            "--out", str(out), "--no-progress", "--final-eval-batches", "4", *extra]


def summary_of(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_a_hugging_face_model(models, corpus, tmp_path, name, algorithm):
    main(hf_run(corpus, tmp_path, models[name], "--algorithm", algorithm))
    summary = summary_of(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    # The model trained is the Hugging Face one, at the corpus's vocabulary (300, not 1000).
    assert summary["model_parameters"] == hf.parameter_count(models[name], 300)
    assert torch.isfinite(torch.tensor(losses)).all() and losses[-1] < losses[0]
    assert summary["final_eval_loss"] < 5.7  # ln(300) = 5.70: better than uniform


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ("--algorithm", "noloco", "--stages", "2", "--routing", "random"),
    ("--algorithm", "streaming", "--stages", "2", "--fragments", "2"),
    ("--algorithm", "diloco", "--dtype", "bf16"),
])
def test_llama_stages_and_bf16(models, corpus, tmp_path, extra):
    main(hf_run(corpus, tmp_path, models["llama4"], *extra))
    assert summary_of(tmp_path)["final_eval_loss"] < 5.7


@pytest.mark.numerics
def test_llama_stages_compose_to_the_whole_model(models):
    model = hf.build(models["llama4"], 300, seed=0)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = model(x, x)
    h = x
    parts = split_stages(model, 3)
    for part in parts:
        h = part(h)
    # The same modules and ops in the same order: bit-identical, not merely close.
    assert torch.equal(parts[-1].loss(h, x), whole)
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert parts[0].block_range == (0, 2) and parts[2].block_range == (3, 4)


def test_decoder_layers_are_the_blocks_and_fragments(models):
    model = hf.build(models["llama4"], 300, seed=0)
    assert list(find_blocks(model)) == list(model.hf.model.layers)
    frags = split_fragments(model, 2)
    for i in range(4):  # strided: layer i in fragment i mod 2
        assert all(n in frags[i % 2] for n in frags[0] + frags[1]
                   if n.startswith(f"hf.model.layers.{i}."))
    # The input and output embeddings are equal in size; each goes to its own fragment.
    assert ("hf.model.embed_tokens.weight" in frags[0]) != ("hf.lm_head.weight" in frags[0])


FRAGMENTS_OF_TWIN_EMBEDDINGS = """
import torch.nn as nn
from loco.algorithms.fragments import split_fragments
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Embedding(30, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 30, bias=False)
print(split_fragments(Net(), 2))
"""


def test_fragments_are_the_same_in_every_process():
    """Equal-sized parameters outside the blocks (a Llama's input and output embeddings) are
    placed in the model's order, not a set's, whose order changes with the hash seed. (The
    two processes run at once: each spends its time importing torch.)"""
    runs = [subprocess.Popen([sys.executable, "-c", FRAGMENTS_OF_TWIN_EMBEDDINGS], text=True,
                             stdout=subprocess.PIPE, env={"PYTHONHASHSEED": seed})
            for seed in ("1", "4")]  # seeds that order the two names differently
    seen = {run.communicate(timeout=300)[0] for run in runs}
    assert [run.returncode for run in runs] == [0, 0] and len(seen) == 1


def test_fresh_model_is_drawn_from_the_seed(models):
    a, b, c = (hf.build(models["gpt2"], 300, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert a.hf.config.vocab_size == 300 and a.hf.config.resid_pdrop == 0.0  # no dropout


def test_weights_are_loaded_and_a_larger_vocabulary_is_refused(corpus, tmp_path, capsys):
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=64))
    net.save_pretrained(tmp_path / "w")
    loaded = hf.build(f"hf:{tmp_path / 'w'}", 300, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), loaded.hf.parameters()))
    net.resize_token_embeddings(280)
    net.save_pretrained(tmp_path / "small")
    capsys.readouterr()
    code = main(hf_run(corpus, tmp_path / "out", f"hf:{tmp_path / 'small'}"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "vocabulary mismatch" in err and "300" in err and "280" in err


def test_token_budget_counts_the_hugging_face_parameters(models):
    from loco.config import build_config, steps_for_tokens

    cfg = build_config(overrides={"model": models["llama"], "tokens": "20x", "vocab_size": 300,
                                  "workers": 2, "batch_size": 4, "seq_len": 32})
    assert steps_for_tokens(cfg) == -(-20 * hf.parameter_count(models["llama"], 300) // 256)


def test_ready_configs_build():
    from loco.config import build_config, validate

    for size in ("35m", "100m", "200m", "300m", "500m", "1b"):
        config = hf.load_config(f"hf:configs/llama-{size}")
        assert config.hidden_size // config.num_attention_heads == 64
        assert config.intermediate_size == 4 * config.hidden_size
    validate(build_config(overrides={"model": "hf:configs/llama-35m"}))
    assert hf.parameter_count("hf:configs/llama-35m", 4096) == (
        6 * (4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512) + 2 * 4096 * 512 + 512)


def bad(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    return [
        (["--model", f"hf:{tmp_path / 'nowhere'}"], "--model", "not a directory"),
        (["--model", f"hf:{tmp_path / 'empty'}"], "--model", "no config.json"),
        (["--model", f"hf:{tmp_path / 't5'}"], "--model", "not a causal language model"),
        (["--layers", "3"], "--layers", "config.json"),
        (["--seq-len", "65"], "--seq-len", "max_position_embeddings 64"),
    ]


def test_bad_hugging_face_models_are_one_line_errors(models, corpus, tmp_path, capsys):
    cases = bad(tmp_path) + [(["--model", models["gpt2"], "--stages", "2"], "--stages",
                              "cannot split a gpt2")]
    for extra, option, text in cases:
        code = main(hf_run(corpus, tmp_path / "out", models["llama"], *extra))
        err = capsys.readouterr().err.strip()
        assert code == 2, extra
        assert len(err.splitlines()) == 1 and option in err and text in err, err
