"""Tokenized corpora, built once into the cache and then read from it memory-mapped.

Text and JSONL corpora are split in memory (:mod:`loco.data.split`), then tokenized.
Parquet, Arrow and ``datasets`` corpora are streamed in record batches instead, never held in
memory: document i (counting non-blank ones, in file order) is validation when
i % k == k // 2 (k = round(1/val_fraction)), and each document is followed by the end-of-text
token; they are tokenized in batches straight into the .npy files.  Such a corpus with fewer
than k documents is split like text.  Every array is read memory-mapped, so a corpus larger
than memory is tokenized once and then paged in as the loader touches it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loco.data.cache import (FORMAT_VERSION, _cache_key, _cache_root, _corpus_name, _meta,
                             _publish, _write_meta)
from loco.data.corpus import (SHAKESPEARE, CorpusError, _check_columns, _file_digest,
                              _is_columnar, _read_documents, _source_files, _stream_documents)
from loco.data.split import split_documents
from loco.data.tokenizer import (ENDOFTEXT, _encode, _encode_documents, _GivenTokenizer,
                                 _load_tokenizer, _plain, _train_bpe, _train_tokenizer,
                                 _vocab_size)
from loco.data.tokens import _entropy, _token_dtype, _TokenFile, unigram_entropy


class EvalCorpusError(CorpusError):
    """An ``--eval-corpus`` that cannot be used; the message is one line meant for the user."""


@dataclass
class Corpus:
    """A tokenized corpus, as :func:`prepare_corpus` returns it.

    Args:
        train: the training token ids, a memory-mapped 1-D array.
        val: the validation token ids, a memory-mapped 1-D array.
        vocab_size: the number of token ids the tokenizer can produce.
        tokenizer_path: the cached copy of the tokenizer's tokenizer.json.
        unigram_entropy: the unigram entropy of ``train`` in nats per token.
        name: a short name of the corpus (for logs).
        cache_dir: the cache entry holding all of the above.
        eos_id: the end-of-text id that separates streamed documents; None when the
            tokenizer has none.
        eval_extra: a second held-out set's token ids (``--eval-corpus``, see
            :func:`prepare_eval_tokens`); None without one.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: str
    unigram_entropy: float
    name: str
    cache_dir: str
    eos_id: int | None = None
    eval_extra: np.ndarray | None = None
    _tokenizer: object = field(default=None, init=False, repr=False, compare=False)

    def decode(self, ids: Any) -> str:
        """Text of a 1-D sequence of token ids.

        Args:
            ids: the ids: a list, a numpy array or a tensor.
        """
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(self.tokenizer_path)
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu()
        return self._tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"loco: {message}", file=sys.stderr, flush=True)


def _save_tokenizer(path: Path, tokenizer, given: _GivenTokenizer | None) -> None:
    if given is None:
        tokenizer.save(str(path))
    else:
        given.save(path)  # a copy of the given file, byte for byte


def _build_entry(
    entry: Path,
    corpus: str,
    files: list[Path],
    vocab_size: int,
    val_fraction: float,
    text_field: str,
    progress: bool,
    given: _GivenTokenizer | None = None,
) -> None:
    k = max(2, round(1 / val_fraction))
    args = (entry, corpus, files, vocab_size, val_fraction, text_field, progress, given)
    if _is_columnar(files[0]) and _has_documents(files, text_field, k):
        _build_streamed(*args)
    else:
        _build_in_memory(*args)


def _has_documents(files: list[Path], text_field: str, count: int) -> bool:
    docs = _stream_documents(files, text_field)
    try:
        return sum(1 for _ in islice(docs, count)) == count
    finally:
        docs.close()


def _build_in_memory(entry, corpus, files, vocab_size, val_fraction, text_field, progress,
                     given) -> None:
    """Split the text into blocks, train or take the tokenizer, tokenize (see module docs)."""
    train_text, val_text = split_documents(_read_documents(files, text_field, corpus), val_fraction)
    name = _corpus_name(corpus, files)
    if given is None:
        _say(progress, f"training a {vocab_size}-token BPE tokenizer on "
             f"{len(train_text) / 1e6:.1f}M characters of {name} (cached in {entry})")
        tokenizer = _train_tokenizer(train_text, vocab_size)
    else:
        _say(progress, f"tokenizing {len(train_text) / 1e6:.1f}M characters of {name} "
             f"with {given.path} (cached in {entry})")
        tokenizer = given.tokenizer
    vocab = _vocab_size(tokenizer)
    dtype = _token_dtype(vocab)
    train, val = _encode(tokenizer, train_text, dtype), _encode(tokenizer, val_text, dtype)
    extra = {}
    if given is not None or _is_columnar(files[0]):
        extra = dict(split="text", tokenizer=given and given.path,
                     eos_id=0 if given is None else given.eos_id)
    meta = _meta(corpus, files, vocab, val_fraction, text_field, len(train), len(val),
                 unigram_entropy(train, vocab), extra)

    def write(tmp: Path) -> None:
        _save_tokenizer(tmp / "tokenizer.json", tokenizer, given)
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        _write_meta(tmp, meta)

    _publish(entry, write)


def _build_streamed(entry, corpus, files, vocab_size, val_fraction, text_field, progress,
                    given) -> None:
    """Stream the documents twice (train the BPE, tokenize) into .npy files (see module docs)."""
    k = max(2, round(1 / val_fraction))
    name = _corpus_name(corpus, files)

    def documents() -> Iterator[tuple[bool, str]]:
        docs = _stream_documents(files, text_field)
        return ((i % k == k // 2, doc) for i, doc in enumerate(docs))

    if given is None:
        _say(progress, f"training a {vocab_size}-token BPE tokenizer on the training "
             f"documents of {name} (cached in {entry})")
        tokenizer = _train_bpe((doc for is_val, doc in documents() if not is_val), vocab_size)
        eos_id = tokenizer.token_to_id(ENDOFTEXT)
    else:
        tokenizer, eos_id = given.tokenizer, given.eos_id
    _say(progress, f"tokenizing {name} (cached in {entry})")
    vocab = _vocab_size(tokenizer)

    def write(tmp: Path) -> None:
        train, val = _TokenFile(tmp / "train.npy", vocab), _TokenFile(tmp / "val.npy", vocab)
        with train, val:
            for ids, val_ids in _encode_documents(tokenizer, documents(), eos_id, train.dtype):
                train.append(ids)
                val.append(val_ids)
            train.finish()
            val.finish()
        if not train.count or not val.count:
            raise CorpusError(f"the tokenizer gives no tokens for the "
                              f"{'training' if not train.count else 'validation'} documents "
                              f"of {corpus}")
        _save_tokenizer(tmp / "tokenizer.json", tokenizer, given)
        extra = dict(split="documents", tokenizer=given and given.path, eos_id=eos_id)
        _write_meta(tmp, _meta(corpus, files, vocab, val_fraction, text_field, train.count,
                               val.count, _entropy(train.counts), extra))

    _publish(entry, write)


def _load_entry(entry: Path) -> Corpus:
    meta = json.loads((entry / "meta.json").read_text())
    return Corpus(
        train=np.load(entry / "train.npy", mmap_mode="r"),
        val=np.load(entry / "val.npy", mmap_mode="r"),
        vocab_size=meta["vocab_size"],
        tokenizer_path=str(entry / "tokenizer.json"),
        unigram_entropy=meta["unigram_entropy"],
        name=meta["name"],
        cache_dir=str(entry),
        # Entries of text corpora with a trained BPE do not record it: <|endoftext|> is id 0.
        eos_id=meta.get("eos_id", 0),
    )


def prepare_corpus(
    corpus: str = SHAKESPEARE,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    progress: bool = False,
    tokenizer: str | None = None,
) -> Corpus:
    """Tokenized train/validation data for a corpus, built once and then read from cache.

    Args:
        corpus: ``"shakespeare"``, a text, JSONL, Parquet or Arrow file, a directory of them,
            a Hugging Face ``datasets`` save_to_disk directory, or a glob of them.
        vocab_size: the size of the byte-level BPE trained on the corpus (ignored with
            ``tokenizer``).
        val_fraction: the share of the corpus held out for validation.
        cache_dir: the cache root; default ``$LOCO_CACHE`` or ``~/.cache/loco``.
        text_field: the field or column holding the text in JSONL, Parquet and Arrow corpora.
        progress: print a line to stderr when building a cache entry.
        tokenizer: a tokenizer.json or a Hugging Face tokenizer directory to use instead of
            training a BPE; default None (train one).

    Raises:
        CorpusError: an unusable corpus (TokenizerError: an unusable ``tokenizer``).
    """
    given = None if tokenizer is None else _load_tokenizer(tokenizer)
    if given is None and vocab_size < 257:
        raise ValueError(
            f"vocab_size must be at least 257 (256 bytes + {ENDOFTEXT}), got {vocab_size}"
        )
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    root = _cache_root(cache_dir)
    files = _source_files(corpus)
    _check_columns(files, text_field)
    settings = dict(
        format=FORMAT_VERSION,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        text_field=text_field,
    )
    if given is not None:
        del settings["vocab_size"]
        settings.update(tokenizer=given.digest, eos=given.eos)
    entry = root / _cache_key(corpus, files, settings)
    if not entry.is_dir():
        _build_entry(entry, corpus, files, vocab_size, val_fraction, text_field, progress, given)
    return _load_entry(entry)


# ------------------------------------------------------------------ a second held-out set


def _build_eval_entry(entry: Path, eval_corpus: str, files: list[Path], text_field: str,
                      corpus: Corpus, progress: bool) -> None:
    from tokenizers import Tokenizer

    tokenizer = _plain(Tokenizer.from_file(corpus.tokenizer_path))
    _say(progress, f"tokenizing the eval corpus {_corpus_name(eval_corpus, files)} "
         f"(cached in {entry})")

    def write(tmp: Path) -> None:
        if _is_columnar(files[0]):
            docs = ((False, doc) for doc in _stream_documents(files, text_field))
            with _TokenFile(tmp / "tokens.npy", corpus.vocab_size) as out:
                for ids, _ in _encode_documents(tokenizer, docs, corpus.eos_id, out.dtype):
                    out.append(ids)
                out.finish()
            count = out.count
        else:
            text = "\n\n".join(_read_documents(files, text_field, eval_corpus))
            tokens = _encode(tokenizer, text, _token_dtype(corpus.vocab_size))
            np.save(tmp / "tokens.npy", tokens)
            count = len(tokens)
        if count == 0:
            raise EvalCorpusError(f"eval corpus has no text: {eval_corpus}")
        _write_meta(tmp, dict(format=FORMAT_VERSION, corpus=eval_corpus, text_field=text_field,
                              name=_corpus_name(eval_corpus, files), tokens=count,
                              tokenizer=corpus.tokenizer_path))

    _publish(entry, write)


def prepare_eval_tokens(
    eval_corpus: str,
    corpus: Corpus,
    text_field: str = "text",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> np.ndarray:
    """All of a second held-out corpus, tokenized with the run's tokenizer, built once and
    then read memory-mapped from the cache.

    Text and JSONL corpora are joined with blank lines and tokenized as the training text is;
    Parquet, Arrow and ``datasets`` corpora are streamed, each document followed by the
    end-of-text token (``corpus.eos_id``).

    Args:
        eval_corpus: the held-out corpus, in any form :func:`prepare_corpus` accepts.
        corpus: the run's tokenized corpus, whose tokenizer is used.
        text_field: the field or column holding the text in JSONL, Parquet and Arrow corpora.
        cache_dir: the cache root; default the directory holding ``corpus``'s entry.
        progress: print a line to stderr when building the cache entry.

    Raises:
        EvalCorpusError: an unusable eval corpus.
    """
    try:
        files = _source_files(eval_corpus)
        _check_columns(files, text_field)
        settings = dict(format=FORMAT_VERSION, eval=True, text_field=text_field,
                        eos_id=corpus.eos_id,
                        tokenizer=_file_digest(Path(corpus.tokenizer_path)).hex())
        root = Path(cache_dir).expanduser() if cache_dir else Path(corpus.cache_dir).parent
        entry = root / f"eval-{_cache_key(eval_corpus, files, settings)}"
        if not entry.is_dir():
            _build_eval_entry(entry, eval_corpus, files, text_field, corpus, progress)
    except EvalCorpusError:
        raise
    except CorpusError as e:
        raise EvalCorpusError(str(e)) from None
    return np.load(entry / "tokens.npy", mmap_mode="r")
