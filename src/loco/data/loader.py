"""Sharded, resumable training batches and fixed evaluation batches of a token stream.

The token stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs plus the
next-token targets).  Reader ``rank`` (a training run's rank worker · R + worker rank) owns
the windows whose index is ``rank`` modulo ``world_size``, so no two read the same data.  Each
epoch visits a reader's windows in an order drawn from a generator seeded with (seed, rank,
epoch): the ranks may be threads of one process, so no global RNG is involved, and the order
can be rebuilt from (epoch, position) alone, which is all a checkpoint needs to store.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def _num_windows(tokens, seq_len: int) -> int:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return max(0, (len(tokens) - 1) // seq_len)


def _gather(tokens, windows: np.ndarray, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    if torch.device(device).type == "cuda":
        # Page-locked, then one copy that does not block the host: the training stream
        # orders it before the forward pass, and the caching host allocator keeps the
        # pinned block until the copy is done.
        rows = rows.pin_memory().to(device, non_blocking=True)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenLoader:
    """Random batches of this worker's shard of the token windows, resumable from state_dict.

    Args:
        tokens: the token ids, a 1-D array (memory-mapped is fine).
        batch_size: windows per batch, >= 1.
        seq_len: tokens per input row, >= 1; a window holds seq_len + 1 tokens.
        rank: this reader's index in [0, world_size); it reads the windows with index
            ≡ rank (mod world_size).
        world_size: the number of readers sharing ``tokens``; default 1.
        seed: seeds each epoch's order together with (rank, epoch); default 0.
        device: where the batches are put; default ``"cpu"``.

    Raises:
        ValueError: a non-positive ``batch_size`` or ``seq_len``, ``rank`` outside
            [0, world_size), or a shard with fewer windows than one batch.
    """

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
        """Input tokens in one batch: batch_size × seq_len."""
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
        """The position to resume from: ``{"epoch": e, "position": p}`` (batches read in e)."""
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`: the next batch is the one it would have read.

        Args:
            state: ``{"epoch": e, "position": p}`` with e >= 0 and 0 <= p <= batches_per_epoch.

        Raises:
            ValueError: a state that does not fit this loader.
        """
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise ValueError(
                f"loader state {state} does not fit {self.batches_per_epoch} batches per epoch"
            )
        self._start(epoch, position)


def eval_batches(
    tokens, batch_size: int, seq_len: int, max_batches: int | None = None, device="cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed (x, y) batches spread evenly over ``tokens``: the same on every call.

    Args:
        tokens: the held-out token ids, a 1-D array.
        batch_size: windows per batch, >= 1 (one smaller batch when there are fewer windows).
        seq_len: tokens per input row, >= 1.
        max_batches: at most this many batches, >= 0; default None (every whole batch).
        device: where the batches are put; default ``"cpu"``.

    Raises:
        ValueError: ``tokens`` shorter than one window, or a bad ``batch_size``,
            ``seq_len`` or ``max_batches`` (raised by the call, not the first ``next``).
    """
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
