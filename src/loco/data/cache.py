"""The on-disk cache of tokenized corpora: entry keys, names, metadata and atomic publishing.

An entry (tokenizer.json, train.npy, val.npy, meta.json) is stored under
``<cache_dir>/<key>``, where the key hashes everything the entry depends on: the corpus
contents (for the Shakespeare package, its version and file names and sizes), the settings
(vocabulary size or the given tokenizer's contents, validation fraction, text field) and
FORMAT_VERSION.  Under torchrun every process prepares the corpus at once, so an entry is
built in a private temporary directory and renamed into place; rename is atomic, so readers
only ever see complete entries, and a process that loses the race drops its copy.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from loco.data.corpus import SHAKESPEARE, _file_digest, _has_glob, _is_columnar, _is_jsonl

# Bump when the tokenization or the cache layout changes, so old entries are not reused.
FORMAT_VERSION = 1


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir or os.environ.get("LOCO_CACHE") or "~/.cache/loco").expanduser()


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
