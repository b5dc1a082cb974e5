"""Token id arrays: their dtype, their unigram entropy, and .npy files written batch by batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


def _entropy(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_entropy of an empty token stream")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best context-free model.

    Args:
        tokens: token ids, an array or tensor of any shape.
        vocab_size: the number of ids the tokenizer can produce; every id is below it.

    Raises:
        ValueError: ``tokens`` is empty.
    """
    return _entropy(np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size))


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
