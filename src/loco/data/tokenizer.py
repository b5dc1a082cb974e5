"""Tokenizers: the byte-level BPE trained on a corpus, a given one, and encoding with either.

By default a byte-level BPE is trained on the training split (streamed corpora: over their
training documents, one at a time); its ``<|endoftext|>`` is id 0.  A given tokenizer (a
tokenizer.json or a Hugging Face tokenizer directory) is used as it is, without its
truncation, padding or added special tokens; its end-of-text token is the ``eos_token`` of a
tokenizer_config.json beside it, else a special token named like one (``<|endoftext|>``,
``</s>``, ...), else there is none and documents are not separated.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loco.data.corpus import CorpusError, _file_digest, _first_line
from loco.data.split import _blocks
from loco.data.tokens import _token_dtype

ENDOFTEXT = "<|endoftext|>"
# End-of-text tokens recognised in a given tokenizer without a tokenizer_config.json.
EOS_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
# Characters tokenized in one batch: they bound the memory a streamed corpus needs.
BATCH_CHARS = 1024 * 1024


class TokenizerError(CorpusError):
    """A ``--tokenizer`` that cannot be used (missing, unreadable, not a fast tokenizer)."""


# --------------------------------------------------------------------------- encoding


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


# ---------------------------------------------------------------------- a given one


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
