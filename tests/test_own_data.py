"""Your own data through ``loco train``: a Parquet or ``datasets`` corpus with ``--text-field``,
a ``tokenizer.json`` (``--tokenizer``), a second held-out set (``--eval-corpus``), exact resume
on them, and the one-line errors of bad data options."""

import json
import random

import pytest
from test_reliability import records

from loco.cli import main
from loco.data import prepare_corpus

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A Parquet corpus (text in "body"), the same documents saved as a datasets directory,
    and a tokenizer.json trained on them (vocab 400)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("own")
    rng = random.Random(1)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(2000)]
    pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}), d / "docs.parquet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return {"dir": d, "docs": docs, "parquet": str(d / "docs.parquet"),
            "tokenizer": str(d / "tokenizer.json"), "cache": str(d / "cache")}


def run(data, out, *extra):
    return ["train", "--model", "tiny", "--workers", "2", "--steps", "16", "--sync-every", "4",
            "--seq-len", "32", "--batch-size", "4", "--eval-every", "4", "--eval-batches", "2",
            "--log-every", "2", "--corpus", data["parquet"], "--text-field", "body",
            "--tokenizer", data["tokenizer"], "--cache-dir", data["cache"], "--out", str(out),
            "--no-progress", "--checkpoint-every", "1", *extra]


@pytest.mark.slow
def test_eval_corpus_of_the_validation_documents_scores_as_the_validation_split(data, tmp_path):
    """Documents i with i % 20 == 10 are the validation split (val_fraction 0.05); given as
    --eval-corpus they tokenize to the same ids, so both losses agree exactly."""
    held = tmp_path / "held.parquet"
    pq.write_table(pa.table({"body": data["docs"][10::20]}), held)
    assert main(run(data, tmp_path / "out", "--eval-corpus", str(held))) == 0
    evals = [r for r in records(tmp_path / "out") if "eval_loss" in r]
    assert len(evals) == 4  # steps 4, 8, 12 and the final evaluation at 16
    assert all(r["eval_loss_extra"] == r["eval_loss"] for r in evals)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final_eval_loss_extra"] == summary["final_eval_loss"]
    corpus = prepare_corpus(data["parquet"], text_field="body", tokenizer=data["tokenizer"],
                            cache_dir=data["cache"])
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(data["tokenizer"]).get_vocab_size(with_added_tokens=True)
    assert summary["corpus"]["vocab_size"] == corpus.vocab_size == vocab  # the tokenizer's
    assert summary["corpus"]["eval_corpus_tokens"] == len(corpus.val)


@pytest.mark.slow
def test_a_datasets_directory_trains_and_resumes_exactly(data, tmp_path, monkeypatch, capsys):
    """A Hugging Face Llama on a datasets directory: interrupted at step 11 and resumed from
    the checkpoint of step 8, it logs exactly what the uninterrupted run logs."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    saved = tmp_path / "ds"
    datasets.Dataset.from_dict({"body": data["docs"]}).save_to_disk(str(saved))
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path / "llama")
    argv = run(data, tmp_path / "full", "--algorithm", "streaming", "--model",
               f"hf:{tmp_path / 'llama'}")
    argv[argv.index("--corpus") + 1] = str(saved)
    assert main(argv) == 0
    monkeypatch.setenv("LOCO_FAULT", "1:11")  # worker 1 fails at step 11, after checkpoint 8
    cut = [str(tmp_path / "cut") if a == str(tmp_path / "full") else a for a in argv]
    assert main(cut) == 1
    monkeypatch.delenv("LOCO_FAULT")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    # The resumed run read exactly the batches the uninterrupted one did.
    assert records(tmp_path / "cut") == records(tmp_path / "full")


BAD = [
    (["--text-field", "text"], "--corpus", "no column 'text' (columns: body, id)"),
    (["--tokenizer", "/no/such/tokenizer.json"], "--tokenizer", "does not exist"),
    (["--eval-corpus", "/no/such/dir/*.parquet"], "--eval-corpus", "no files match"),
    (["--corpus", "/no/such/*.parquet"], "--corpus", "no files match"),
]


@pytest.mark.parametrize("extra,option,text", BAD)
def test_bad_data_options_are_one_line_errors(data, tmp_path, capsys, extra, option, text):
    assert main(run(data, tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and text in err, err


def test_a_file_that_is_not_a_tokenizer_is_refused(data, tmp_path, capsys):
    assert main(run(data, tmp_path, "--tokenizer", data["parquet"])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("loco train: error: --tokenizer:")


def test_a_dashboard_without_its_extra_is_one_line(data, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(run(data, tmp_path, "--wandb")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "loco train: error: --wandb: needs the wandb extra: pip install 'loco[wandb]'"
