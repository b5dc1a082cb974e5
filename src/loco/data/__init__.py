"""The data layer: corpora, their split, tokenizers, the token cache and batches.

One job per module:

- :mod:`loco.data.corpus`: the files a corpus argument names, and reading their documents.
- :mod:`loco.data.split`: the train/validation split of a corpus held in memory.
- :mod:`loco.data.tokens`: token id arrays (dtype, unigram entropy, .npy files).
- :mod:`loco.data.tokenizer`: the trained BPE, a given tokenizer, encoding.
- :mod:`loco.data.cache`: cache entry keys, metadata and atomic publishing.
- :mod:`loco.data.prepare`: :func:`prepare_corpus` and :func:`prepare_eval_tokens`.
- :mod:`loco.data.loader`: the sharded, resumable :class:`TokenLoader` and evaluation batches.

It imports nothing from loco's other layers.
"""

from loco.data.cache import FORMAT_VERSION
from loco.data.corpus import SHAKESPEARE, CorpusError, load_documents
from loco.data.loader import TokenLoader, eval_batches
from loco.data.prepare import (
    Corpus,
    EvalCorpusError,
    prepare_corpus,
    prepare_eval_tokens,
)
from loco.data.split import split_documents
from loco.data.tokenizer import ENDOFTEXT, EOS_NAMES, TokenizerError
from loco.data.tokens import unigram_entropy

__all__ = [
    "ENDOFTEXT",
    "EOS_NAMES",
    "FORMAT_VERSION",
    "SHAKESPEARE",
    "Corpus",
    "CorpusError",
    "EvalCorpusError",
    "TokenLoader",
    "TokenizerError",
    "eval_batches",
    "load_documents",
    "prepare_corpus",
    "prepare_eval_tokens",
    "split_documents",
    "unigram_entropy",
]
