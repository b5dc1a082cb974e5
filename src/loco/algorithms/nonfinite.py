"""What a non-finite gradient or pseudo-gradient does: an algorithm's policy, its counts, and
the inner steps skipped on the device that are read later.

Every algorithm holds one [`NonFinite`][loco.algorithms.nonfinite.NonFinite]
(``algo.nonfinite``): the inner step asks it whether to step, a sync whether its reduced
value may be applied. A non-finite value is caught before it reaches any parameter; the
policy then raises [`NonFiniteError`][loco.algorithms.nonfinite.NonFiniteError] or skips
that inner step or sync and counts it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loco.comm.hostreads import allowed

#: What to do with a non-finite gradient or pseudo-gradient: raise NonFiniteError, or skip
#: that inner step or sync (and count it).
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(ArithmeticError):
    """A non-finite gradient or pseudo-gradient, caught before it reached any parameter.

    Raised by an [`Algorithm`][loco.algorithms.base.Algorithm] built with
    ``on_nonfinite="stop"`` (the default); the parameters still hold the last finite state.
    """


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite: one sum in the common case (a finite
    sum proves it); only a non-finite sum is checked element by element.

    Args:
        tensor: a floating-point tensor.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class NonFinite:
    """An algorithm's handling of non-finite values.

    Args:
        policy: ``"stop"`` raises [`NonFiniteError`][loco.algorithms.nonfinite.NonFiniteError]
            before a non-finite value reaches a parameter; ``"skip"`` skips that inner step
            or sync and counts it in ``skipped``.
        on_device: skip a non-finite gradient's inner step on the device (see
            ``skip_on_device``).
        agree: whether a flag holds on every rank of the worker
            ([`WorkerRanks.agree`][loco.algorithms.sharding.WorkerRanks.agree]), so that
            they decide a sync alike.

    Raises:
        ValueError: ``policy`` is not one of ``NONFINITE_POLICIES``.
    """

    def __init__(self, policy: str, on_device: bool, agree: Callable[[bool], bool]):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES} "
                             f"(got {policy!r})")
        self.policy = policy
        self.skip_on_device = on_device
        """Whether a non-finite gradient's inner step is skipped on the device rather than
        decided on the host, so that no step waits for the device: on CUDA with an
        optimizer that takes ``found_inf`` (``fused=True`` Adam, AdamW, SGD;
        ``MuonAdamW``). The skips are then read at the next sync (``settle``)."""
        self.skipped = {"inner_steps": 0, "syncs": 0}
        """Inner steps and syncs skipped because of non-finite values (``"skip"``)."""
        self._agree = agree
        self._pending_skips: torch.Tensor | None = None
        self._pending_since = 0

    def handle(self, what: str, counter: str, step: int) -> None:
        """Handle a non-finite value by the policy: raise, or count a skip.

        Args:
            what: what was not finite, for the error message.
            counter: the key of ``skipped`` to increment: ``"inner_steps"`` or ``"syncs"``.
            step: the inner step it happened at, for the error message.

        Raises:
            NonFiniteError: the policy is ``"stop"``.
        """
        if self.policy == "stop":
            raise NonFiniteError(f"non-finite {what} at step {step}, caught before it reached "
                                 "the parameters (--on-nonfinite stop)")
        self.skipped[counter] += 1

    def optimizer_step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor,
                       step: int) -> bool:
        """Step ``optimizer`` unless the gradient's norm is not finite (then raise or leave
        the parameters as they are); with ``skip_on_device`` the decision is the device's,
        and the skip is read later (``settle``).

        Args:
            optimizer: the inner optimizer.
            norm: the gradient's total norm, a 0-d tensor.
            step: the inner step being taken, for the error message.

        Returns:
            True if the optimizer stepped (or the decision was left to the device), False
                if the step was skipped.

        Raises:
            NonFiniteError: the norm is not finite and the policy is ``"stop"``.
        """
        if self.skip_on_device:
            found = (~torch.isfinite(norm)).to(torch.float32)
            optimizer.found_inf = found
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            self.skipped_on_device(found, "inner_steps", step)
            return True
        if not bool(torch.isfinite(norm)):  # a host read: free on a CPU
            self.handle("gradient", "inner_steps", step)
            return False
        optimizer.step()
        return True

    def skipped_on_device(self, found: torch.Tensor, counter: str, step: int) -> None:
        """Count an inner step or a sync that was skipped on the device where ``found`` (a
        0-d float tensor, 1 or 0) is 1, without reading it: ``settle`` reads the counts
        later.

        Args:
            found: 1 where the step or sync was skipped, 0 where it was applied.
            counter: the key of ``skipped``: ``"inner_steps"`` or ``"syncs"``.
            step: the inner step it happened at (the first of those counted is named if
                the policy stops the run).
        """
        add = torch.stack([found, torch.zeros_like(found)])
        add = add if counter == "inner_steps" else add.flip(0)
        self._pending_skips = add if self._pending_skips is None else self._pending_skips + add
        self._pending_since = self._pending_since or step

    def settle(self, step: int) -> None:
        """Read the inner steps and syncs skipped on the device since the last call
        (``skipped_on_device``): count them in ``skipped``, or raise. Called at every sync,
        logging step and checkpoint; nothing to do when every step was checked on the host.

        Args:
            step: the algorithm's inner step now, for the error message.

        Raises:
            NonFiniteError: a step or sync was skipped and the policy is ``"stop"`` (the
                parameters hold the state without the non-finite steps).
        """
        if self._pending_skips is None:
            return
        with allowed("sync"):
            steps, syncs = (int(n) for n in self._pending_skips.tolist())
        since = self._pending_since
        self._pending_skips, self._pending_since = None, 0
        if (steps or syncs) and self.policy == "stop":
            what = ("a non-finite gradient in {} inner step(s)".format(steps) if steps
                    else "a non-finite update in {} step(s)".format(syncs))
            raise NonFiniteError(f"{what} between steps {since} and {step}, "
                                 "skipped on the device (--on-nonfinite stop)")
        self.skipped["inner_steps"] += steps
        self.skipped["syncs"] += syncs

    def check(self, tensor: torch.Tensor, what: str, step: int,
              verdict: bool | None = None) -> bool:
        """Whether a reduced pseudo-gradient is finite; if not, raise or count a skipped
        sync. Every worker of the sync decides the same: a non-finite value on one worker
        makes the reduced value non-finite on all (the scaled codecs mark such a block with
        ``loco.comm.codecs.NONFINITE_SCALE``), and the ranks of a worker agree.

        Args:
            tensor: the reduced value to check (every element).
            what: what it is, for the error message (e.g. ``"pseudo-gradient"``).
            step: the algorithm's inner step now.
            verdict: whether this rank's ``tensor`` is finite, when it was checked already
                (on a helper thread); default None: check it now.

        Returns:
            True if every element is finite; False if not and the sync is skipped.

        Raises:
            NonFiniteError: an element is not finite and the policy is ``"stop"``.
        """
        self.settle(step)
        with allowed("sync"):
            finite = self._agree(all_finite(tensor) if verdict is None else verdict)
        if finite:
            return True
        self.handle(what, "syncs", step)
        return False


__all__ = ["NONFINITE_POLICIES", "NonFinite", "NonFiniteError", "all_finite"]
