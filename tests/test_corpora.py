"""Corpora beyond text and JSONL: Parquet, Arrow and ``datasets`` directories, globs, a given
tokenizer (``--tokenizer``), a second held-out set (``--eval-corpus``), and sharded, resumable
reading of such a corpus. Every corpus and tokenizer is made in the test; nothing is downloaded."""

import json
import os
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loco.data import (
    ENDOFTEXT,
    CorpusError,
    EvalCorpusError,
    TokenizerError,
    TokenLoader,
    load_documents,
    prepare_corpus,
    prepare_eval_tokens,
    split_documents,
    unigram_entropy,
)
from loco.data import corpus as data_corpus
from loco.data import prepare as data_prepare
from loco.data import tokenizer as data_tokenizer

pa = pytest.importorskip("pyarrow")  # the 'hf' extra
pq = pytest.importorskip("pyarrow.parquet")

WORDS = "the king queen lord love night sword crown heart death honour speak never".split()
VAL = 0.2  # k = 5: documents 2, 7, 12, ... are validation
VOCAB = 300


def documents(n: int, seed: int = 0) -> list[str]:
    """Unique, traceable documents of one to three lines."""
    rng = random.Random(seed)
    return [
        "\n".join(
            f"doc{seed}-{i:03d} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            for _ in range(rng.randint(1, 3))
        )
        for i in range(n)
    ]


DOCS = documents(60)
TRAIN_DOCS = [d for i, d in enumerate(DOCS) if i % 5 != 2]
VAL_DOCS = [d for i, d in enumerate(DOCS) if i % 5 == 2]


def write_parquet(path, docs, **extra):
    table = pa.table({"id": list(range(len(docs))), "text": docs, **extra})
    pq.write_table(table, path, row_group_size=16)  # several row groups and batches
    return path


def split_decoded(corpus, tokens) -> list[str]:
    text = corpus.decode(tokens)
    assert text.endswith(ENDOFTEXT)
    return text.split(ENDOFTEXT)[:-1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE saved as tokenizer.json, with a BOS post-processor and truncation that
    loco must not apply, and end-of-text candidates for the eos rule."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(40, seed=9), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.enable_truncation(max_length=8)
    directory = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def reference(tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    return tokenizer


def encode_docs(tokenizer, docs, eos_id):
    ids = []
    for doc in docs:
        ids += tokenizer.encode(doc, add_special_tokens=False).ids + [eos_id]
    return ids


@pytest.fixture(scope="module")
def parquet_corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pq")
    # Blank and null rows are not documents and do not count in the split.
    docs = DOCS[:10] + ["", "  \n"] + DOCS[10:]
    return write_parquet(directory / "corpus.parquet", docs)


@pytest.fixture(scope="module")
def bpe_corpus(parquet_corpus, tmp_path_factory):
    return prepare_corpus(str(parquet_corpus), VOCAB, VAL, tmp_path_factory.mktemp("cache"))


# ---------------------------------------------------------------- streamed corpora


def test_parquet_split_by_document(bpe_corpus):
    assert bpe_corpus.train.dtype == np.uint16 and isinstance(bpe_corpus.train, np.memmap)
    assert bpe_corpus.eos_id == 0 and 257 < bpe_corpus.vocab_size <= VOCAB
    # Every document exactly once, every 5th (from the 3rd) held out, in order.
    assert split_decoded(bpe_corpus, bpe_corpus.train) == TRAIN_DOCS
    assert split_decoded(bpe_corpus, bpe_corpus.val) == VAL_DOCS
    assert bpe_corpus.unigram_entropy == pytest.approx(
        unigram_entropy(bpe_corpus.train, bpe_corpus.vocab_size)
    )
    assert bpe_corpus.name == "corpus"


def test_streamed_corpus_never_loads_all_documents(parquet_corpus, tmp_path, monkeypatch):
    def in_memory(*args):
        raise AssertionError("a Parquet corpus was read into memory")

    monkeypatch.setattr(data_prepare, "_read_documents", in_memory)
    monkeypatch.setattr(data_tokenizer, "BATCH_CHARS", 200)  # many tokenizer batches
    monkeypatch.setattr(data_corpus, "BATCH_ROWS", 3)
    corpus = prepare_corpus(str(parquet_corpus), VOCAB, VAL, tmp_path)
    assert split_decoded(corpus, corpus.val) == VAL_DOCS


def test_cache_reused_and_keyed_by_content(bpe_corpus, parquet_corpus, tmp_path, monkeypatch):
    entry = bpe_corpus.cache_dir
    mtime = os.stat(os.path.join(entry, "train.npy")).st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(data_prepare, "_build_entry", no_build)
    again = prepare_corpus(str(parquet_corpus), VOCAB, VAL, os.path.dirname(entry))
    assert again.cache_dir == entry
    assert os.stat(os.path.join(entry, "train.npy")).st_mtime_ns == mtime
    changed = write_parquet(tmp_path / "corpus.parquet", DOCS[:-1] + [DOCS[-1] + "!"])
    with pytest.raises(AssertionError, match="rebuilt"):
        prepare_corpus(str(changed), VOCAB, VAL, os.path.dirname(entry))


def test_save_to_disk_arrow_and_parquet_agree(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict

    rows = {"text": DOCS, "n": list(range(len(DOCS)))}
    write_parquet(tmp_path / "c.parquet", DOCS)
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    held_out = Dataset.from_dict({"text": ["never seen"] * 5, "n": [0] * 5})
    DatasetDict({"test": held_out, "train": Dataset.from_dict(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    table = pa.table(rows)
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as sink:  # IPC file format
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=7)
    tok = str(tokenizer_dir)
    runs = [
        prepare_corpus(str(tmp_path / name), VOCAB, VAL, tmp_path / "cache", tokenizer=tok)
        for name in ("c.parquet", "ds", "dd", "c.arrow")
    ]
    assert len({r.cache_dir for r in runs}) == 4
    for run in runs[1:]:
        assert np.array_equal(run.train, runs[0].train)
        assert np.array_equal(run.val, runs[0].val)
    assert "never seen" not in runs[2].decode(runs[2].train) + runs[2].decode(runs[2].val)


def test_glob_and_directory_pick_the_right_files(tmp_path):
    (tmp_path / "sub").mkdir()
    write_parquet(tmp_path / "b.parquet", ["bee doc"])
    write_parquet(tmp_path / "a.parquet", ["ay doc"])
    write_parquet(tmp_path / "sub" / "c.parquet", ["sea doc"])
    write_parquet(tmp_path / "other.parq", ["not matched"])
    (tmp_path / "README.md").write_text("a dataset card, not text to train on")
    assert load_documents(str(tmp_path / "*.parquet")) == ["ay doc", "bee doc"]
    assert load_documents(str(tmp_path / "**" / "*.parquet")) == ["ay doc", "bee doc", "sea doc"]
    assert load_documents(str(tmp_path)) == ["ay doc", "bee doc", "sea doc"]
    with pytest.raises(CorpusError, match="no files match"):
        load_documents(str(tmp_path / "*.jsonl"))
    with pytest.raises(CorpusError, match="both text and Parquet"):
        load_documents(str(tmp_path / "*.*"))


def test_few_documents_split_like_text(tmp_path):
    docs = DOCS[:3]  # fewer than k = 5 documents
    path = write_parquet(tmp_path / "few.parquet", docs)
    corpus = prepare_corpus(str(path), VOCAB, VAL, tmp_path / "cache")
    train, val = split_documents(docs, VAL)
    assert corpus.decode(corpus.train) == train and corpus.decode(corpus.val) == val


# ------------------------------------------------------------------ given tokenizer


def test_given_tokenizer_ids_are_its_encoding(parquet_corpus, tokenizer_dir, reference, tmp_path):
    corpus = prepare_corpus(
        str(parquet_corpus), 10, VAL, tmp_path, tokenizer=str(tokenizer_dir / "tokenizer.json")
    )
    eos = reference.token_to_id("</s>")  # no tokenizer_config.json: a usual eos name
    assert corpus.eos_id == eos
    assert corpus.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    # Whole documents, without the BOS post-processor and without the file's truncation.
    assert corpus.train.tolist() == encode_docs(reference, TRAIN_DOCS, eos)
    assert corpus.val.tolist() == encode_docs(reference, VAL_DOCS, eos)
    copy = open(corpus.tokenizer_path, "rb").read()
    assert copy == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert corpus.decode(corpus.val).split("</s>")[:-1] == VAL_DOCS


def test_tokenizer_config_names_eos_and_keys_the_cache(parquet_corpus, tokenizer_dir, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    corpus = prepare_corpus(str(parquet_corpus), VOCAB, VAL, tmp_path, tokenizer=str(directory))
    eot = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id("<|eot|>")
    assert corpus.eos_id == eot and corpus.train[-1] == eot
    plain = prepare_corpus(str(parquet_corpus), VOCAB, VAL, tmp_path,
                           tokenizer=str(tokenizer_dir))
    assert plain.cache_dir != corpus.cache_dir


def test_given_tokenizer_on_text_corpus(tmp_path, tokenizer_dir, reference):
    text = "\n".join(DOCS) + "\n"
    path = tmp_path / "plain.txt"
    path.write_text(text)
    corpus = prepare_corpus(str(path), 10, VAL, tmp_path / "cache", tokenizer=str(tokenizer_dir))
    train, val = split_documents([text], VAL)  # the text rule, as without --tokenizer
    assert corpus.train.tolist() == reference.encode(train, add_special_tokens=False).ids
    assert corpus.val.tolist() == reference.encode(val, add_special_tokens=False).ids


# -------------------------------------------------------------------------- eval set


def test_eval_tokens_text_and_parquet(bpe_corpus, tmp_path):
    reference = Tokenizer.from_file(bpe_corpus.tokenizer_path)
    text = "A different held-out text.\nWith two lines.\n"
    (tmp_path / "eval.txt").write_text(text)
    tokens = prepare_eval_tokens(str(tmp_path / "eval.txt"), bpe_corpus)
    assert isinstance(tokens, np.memmap) and tokens.dtype == bpe_corpus.train.dtype
    assert tokens.tolist() == reference.encode(text).ids
    docs = documents(7, seed=3)
    path = write_parquet(tmp_path / "eval.parquet", docs)
    tokens = prepare_eval_tokens(str(path), bpe_corpus, cache_dir=tmp_path / "cache")
    assert tokens.tolist() == encode_docs(reference, docs, bpe_corpus.eos_id)
    entries = list((tmp_path / "cache").iterdir())
    again = prepare_eval_tokens(str(path), bpe_corpus, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == entries and np.array_equal(again, tokens)


def test_eval_corpus_errors(bpe_corpus, tmp_path):
    with pytest.raises(EvalCorpusError, match="does not exist") as info:
        prepare_eval_tokens(str(tmp_path / "missing.parquet"), bpe_corpus)
    assert isinstance(info.value, CorpusError)
    path = write_parquet(tmp_path / "e.parquet", ["x"])
    with pytest.raises(EvalCorpusError, match="'body'"):
        prepare_eval_tokens(str(path), bpe_corpus, text_field="body")


# ------------------------------------------------------------------- shards, resume


def window_index(corpus, seq):
    """Window index of each window's tokens, for the windows whose tokens occur only once."""
    windows = {}
    for w in range((len(corpus.train) - 1) // seq):
        windows.setdefault(corpus.train[w * seq : w * seq + seq + 1].tobytes(), []).append(w)
    return {key: ws[0] for key, ws in windows.items() if len(ws) == 1}


def test_worker_shards_disjoint(bpe_corpus):
    seq, workers, ranks = 12, 2, 2
    index = window_index(bpe_corpus, seq)
    read = {0: [], 1: []}
    for worker in range(workers):
        for shard in range(ranks):
            loader = TokenLoader(bpe_corpus.train, 2, seq, rank=worker * ranks + shard,
                                 world_size=workers * ranks)
            for _ in range(loader.batches_per_epoch):
                x, y = loader.next_batch()
                rows = torch.cat([x, y[:, -1:]], 1).numpy().astype(bpe_corpus.train.dtype)
                read[worker] += [index.get(r.tobytes()) for r in rows]
    assert sum(w is None for w in read[0] + read[1]) < 0.1 * len(read[0] + read[1])
    seen = {worker: {w for w in ws if w is not None} for worker, ws in read.items()}
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    # Worker w's ranks read the windows w * ranks + shard (mod workers x ranks).
    assert all(w % (workers * ranks) // ranks == worker for worker in seen for w in seen[worker])


def test_resume_continues_at_the_exact_batch(bpe_corpus):
    def loader():
        return TokenLoader(bpe_corpus.train, 3, 8, rank=1, world_size=2, seed=4)

    original = loader()
    for _ in range(original.batches_per_epoch + 2):  # into the second epoch
        original.next_batch()
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    for _ in range(original.batches_per_epoch):
        (x1, y1), (x2, y2) = original.next_batch(), resumed.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.parquet", "does not exist"),
        (lambda d: d / "none-*.parquet", "no files match"),
        (
            lambda d: write_parquet(d / "x.parquet", ["a"]),
            r"no column 'body' \(columns: id, text\); choose it with --text-field",
        ),
        (lambda d: write_parquet(d / "x.parquet", ["a"], body=[1]), "holds int64, not text"),
        (
            lambda d: (d / "x.parquet").write_bytes(b"not parquet") and d / "x.parquet",
            "not a readable Parquet",
        ),
    ],
)
def test_bad_corpus_one_line(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(CorpusError, match=message) as info:
        prepare_corpus(str(path), VOCAB, VAL, tmp_path / "cache", text_field="body")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_missing_column_in_save_to_disk(tmp_path):
    Dataset = pytest.importorskip("datasets").Dataset

    Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(CorpusError, match=r"no column 'text' \(columns: content\)"):
        load_documents(str(tmp_path / "ds"))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.json", "tokenizer path does not exist"),
        (lambda d: (d / "t.json").write_text("{not json") and d / "t.json", "cannot read"),
        (lambda d: d, "no tokenizer.json"),
    ],
)
def test_bad_tokenizer(parquet_corpus, tmp_path, make, message):
    with pytest.raises(TokenizerError, match=message) as info:
        prepare_corpus(str(parquet_corpus), VOCAB, VAL, tmp_path, tokenizer=str(make(tmp_path)))
    assert isinstance(info.value, CorpusError) and "\n" not in str(info.value)


def test_dataset_dict_without_train_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    part = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"test": part, "validation": part}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CorpusError, match="splits test, validation but no 'train' split"):
        load_documents(str(tmp_path / "dd"))
    assert load_documents(str(tmp_path / "dd" / "test")) == ["a", "b"]
