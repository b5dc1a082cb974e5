"""The train/validation split of a corpus read into memory.

The split happens before tokenization, so the tokenizer never sees validation text and the
validation loss is an honest held-out number.  The documents are joined with blank lines and
cut into blocks of about 64 KiB at line boundaries; every k-th block (k = round(1/val_fraction))
is validation, the rest training.  Whole blocks spread over the corpus make the validation set
cover every part of it while keeping train and validation text disjoint.  A corpus with too few
blocks instead gives the last val_fraction of its text to validation.  (Streamed corpora are
split by document instead; see :mod:`loco.data.prepare`.)
"""

from __future__ import annotations

from loco.data.corpus import CorpusError

BLOCK_CHARS = 64 * 1024


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
    """Deterministically split documents into (train_text, val_text), as the module describes.

    Args:
        docs: the documents, in corpus order; they are joined with blank lines.
        val_fraction: the share held out for validation, in (0, 1); every
            k-th block is held out, k = max(2, round(1/val_fraction)).

    Raises:
        ValueError: ``val_fraction`` outside (0, 1).
        CorpusError: too little text to give both parts some.
    """
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
