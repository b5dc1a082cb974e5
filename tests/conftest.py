"""Test-session settings."""

import torch

# The test models are tiny: one intra-op thread is as fast as two for them, and it keeps the
# single-process references from oversubscribing the cores when the machine is busy.
torch.set_num_threads(1)
