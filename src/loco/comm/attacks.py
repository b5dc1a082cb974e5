"""Faults and attacks on demand (``--inject WORKER:KIND[=X][@STEP]``): what a faulty or
hostile worker sends, for drills, tests and ``loco compare --preset adversarial``.

An attack acts on what a worker sends over the slow link, from inner step STEP on (default:
the first), where an honest worker's loco would have sent its own values:

- on its contribution to an average (``Comm.all_reduce_mean``, ``Comm.all_gather_mean``,
  NoLoCo's exchanges, DeMo's gathered coefficients), before it is encoded: ``scale=X``
  (multiplied by X), ``noise=SIGMA`` (Gaussian noise of that σ added), ``nan`` (every
  value NaN), ``zero`` (every value 0), ``stale=K`` (the contribution of K averages ago,
  resent: K >= 1);
- on the bytes it sends, after encoding: ``bitflip=N`` (N random bits flipped in each
  message);
- on what it claims: ``lie-tokens=X`` (its claimed speed, from which the round's steps and
  a token-weighted merge's weights follow, X times its own: ``--local-steps
  proportional``);
- ``silent``: it never sends again (an elastic run goes on without it).

The attacks are drawn from a generator seeded by the worker and the step, so that a run is
reproduced exactly. The guard (``loco.comm.guard``) is what defends against them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

#: The kinds of attack, with whether each takes a value.
KINDS = {"scale": True, "noise": True, "nan": False, "zero": False, "stale": True,
         "bitflip": True, "lie-tokens": True, "silent": False}
#: The attacks that change a contribution's values (before encoding).
VALUE_KINDS = ("scale", "noise", "nan", "zero", "stale")


@dataclass(frozen=True)
class Attack:
    """One ``--inject`` entry.

    Args:
        worker: the worker that misbehaves.
        kind: one of ``KINDS``.
        value: its X (None for the kinds without one).
        step: the inner step it starts at; default 0.
    """

    worker: int
    kind: str
    value: float | None = None
    step: int = 0

    def __str__(self) -> str:
        value = "" if self.value is None else f"={self.value:g}"
        return f"{self.worker}:{self.kind}{value}" + (f"@{self.step}" if self.step else "")


def parse_attack(text: str) -> Attack:
    """One attack from ``WORKER:KIND[=X][@STEP]``.

    Args:
        text: the entry.

    Raises:
        ValueError: the text does not have that form, KIND is unknown, or its value is out
            of range; the message says what is allowed.
    """
    form = "WORKER:KIND[=X][@STEP], e.g. 1:scale=-50 or 2:nan@40"
    head, _, step = text.strip().partition("@")
    worker, sep, rest = head.partition(":")
    kind, has_value, value = rest.partition("=")
    try:
        worker_i, step_i = int(worker), int(step) if step else 0
        number = float(value) if has_value else None
    except ValueError:
        raise ValueError(f"{text!r} is not {form}") from None
    if not sep or kind not in KINDS:
        raise ValueError(f"{text!r}: KIND must be one of {', '.join(KINDS)} ({form})")
    if KINDS[kind] != (number is not None):
        raise ValueError(f"{text!r}: {kind} " + ("needs a value (=X)" if KINDS[kind]
                                                 else "takes no value"))
    if worker_i < 0 or step_i < 0:
        raise ValueError(f"{text!r}: WORKER and STEP must be >= 0")
    if kind in ("stale", "bitflip") and (number < 1 or not float(number).is_integer()):
        raise ValueError(f"{text!r}: {kind} needs an integer >= 1")
    if kind in ("noise", "lie-tokens") and not number > 0:
        raise ValueError(f"{text!r}: {kind} needs a value > 0")
    return Attack(worker_i, kind, number, step_i)


def parse_attacks(text: str | None) -> list[Attack]:
    """Every attack of a comma-separated ``--inject`` value.

    Args:
        text: the value; None or empty: none.

    Raises:
        ValueError: an entry that ``parse_attack`` refuses.
    """
    return [parse_attack(t) for t in (text or "").split(",") if t.strip()]


class Injector:
    """The attacks one worker carries out (``attacks`` already filtered to it), applied by
    its Comm to what it sends. ``step`` is the worker's inner step, kept up to date by its
    algorithm.

    Args:
        attacks: this worker's attacks.
        worker: its index, which seeds the random draws.
    """

    def __init__(self, attacks: list[Attack], worker: int):
        self.attacks = attacks
        self.worker = worker
        self.step = 0
        self._history: dict[int, deque] = {}  # stale=K: past contributions, by size
        self.applied: dict[str, int] = {}
        """How many messages each attack has changed so far, by ``str(attack)``."""

    def active(self, kind: str) -> Attack | None:
        """This worker's attack of a kind in force at ``step``, or None.

        Args:
            kind: one of ``KINDS``.
        """
        return next((a for a in self.attacks if a.kind == kind and self.step >= a.step), None)

    def _generator(self, salt: int, device: torch.device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed((self.worker * 1_000_003 + self.step * 7919 + salt) % (2 ** 63))
        return g

    def _count(self, attack: Attack) -> None:
        self.applied[str(attack)] = self.applied.get(str(attack), 0) + 1

    def contribution(self, flat: torch.Tensor) -> None:
        """Change this worker's contribution as its value attacks say; keep it for
        ``stale``.

        Args:
            flat: the 1-D contribution, changed in place.
        """
        stale = self.active("stale")
        if stale is not None:  # what it sent K averages ago, sent again (once it has sent K)
            past = self._history.setdefault(flat.numel(), deque(maxlen=int(stale.value)))
            if len(past) == stale.value:
                flat.copy_(past[0])
                self._count(stale)
            past.append(flat.detach().clone())
        for kind in ("scale", "noise", "nan", "zero"):
            attack = self.active(kind)
            if attack is None:
                continue
            if kind == "scale":
                flat.mul_(attack.value)
            elif kind == "noise":
                g = self._generator(1, flat.device)
                flat.add_(torch.randn(flat.shape, generator=g, device=flat.device,
                                      dtype=flat.dtype), alpha=attack.value)
            elif kind == "nan":
                flat.fill_(float("nan"))
            else:
                flat.zero_()
            self._count(attack)

    def wire(self, payload: torch.Tensor) -> None:
        """Flip ``bitflip=N`` random bits of what this worker sends, after encoding.

        Args:
            payload: any contiguous tensor, changed in place.
        """
        attack = self.active("bitflip")
        if attack is None or payload.numel() == 0:
            return
        data = payload.view(-1).view(torch.uint8)
        g = self._generator(2, torch.device("cpu"))
        where = torch.randint(0, data.numel(), (int(attack.value),), generator=g)
        bits = torch.randint(0, 8, (int(attack.value),), generator=g, dtype=torch.uint8)
        masks = torch.bitwise_left_shift(torch.ones_like(bits), bits).to(data.device)
        data[where.to(data.device)] ^= masks
        self._count(attack)

    def claim(self, seconds: float) -> float:
        """The seconds per step this worker claims, from which the workers share a round's
        steps and weigh a token-weighted merge (``lie-tokens=X``: ``seconds / X``, X times
        its speed, so X times its tokens).

        Args:
            seconds: its measured seconds per step.
        """
        attack = self.active("lie-tokens")
        if attack is None:
            return seconds
        self._count(attack)
        return seconds / attack.value

    @property
    def silent(self) -> bool:
        """Whether this worker has gone silent (``silent``) at ``step``."""
        return self.active("silent") is not None
