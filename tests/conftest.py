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
# The same for every rank process the tests start (the processes launcher, torchrun, `loco
# train` in a subprocess), which would otherwise take cores / ranks threads: under pytest-xdist
# the cores are shared with other files, and a rank's second thread waits on a busy core at
# every op (a torchrun job of one rank: 10 steps of the tiny model 0.84 s, against 0.06 s).
os.environ.setdefault("LOCO_CPU_THREADS", "1")
# The threads launcher's ranks on one core (each launch on the core it was started from):
# they share one GIL, and handing it to a thread on the other core at every operation of
# the tiny model cost the suite's threads-launched tests about a third more CPU
# (`loco.runtime.starter.thread_ranks_core`; measured in docs/testing.md).
os.environ.setdefault("LOCO_THREADS_ONE_CORE", "1")

# The files that take longest (measured with --durations, most first), collected first. Under
# pytest-xdist (`make test`) each file goes whole to the next free worker in collection
# order: the long ones, mostly waiting on worker processes, start at once, and the short ones
# fill the cores around them instead of leaving one long file to run on alone at the end.
SLOWEST_FIRST = ("test_elastic_cli.py", "test_elastic.py", "test_train_worker_ranks.py",
                 "test_streaming.py", "test_netns_wan.py", "test_reliability.py",
                 "test_worker_ranks.py", "test_cli.py", "test_outer_thread.py",
                 "test_compression.py", "test_harness.py", "test_hf_models.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable within a file


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

