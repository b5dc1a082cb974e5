"""Test-session settings."""

import os

import pytest
import torch

# The codecs' fused kernels compile for seconds per shape: the suite runs the eager reference
# unless a test asks for "fused" (tests/test_codecs_fused.py checks that both give the same bits).
os.environ.setdefault("LOCO_CODEC_KERNEL", "eager")

# The test models are tiny: one intra-op thread is as fast as two for them, and it keeps the
# single-process references from oversubscribing the cores when the machine is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small text corpus; its tokenizer (vocab 300) trains in well under a second."""
    import random

    rng = random.Random(0)
    words = ("the king queen lord love death night day sword crown heart blood "
             "speak hear mine thine thou art doth hath").split()
    d = tmp_path_factory.mktemp("corpus")
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(6000)]
    (d / "text.txt").write_text("\n".join(lines))
    return str(d / "text.txt"), str(d / "cache")

