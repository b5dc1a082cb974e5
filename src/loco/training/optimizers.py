"""The inner optimizer (``--inner-optimizer``): AdamW on every parameter, or MuLoCo's Muon on
the hidden weight matrices and AdamW on the rest, as one ``torch.optim.Optimizer``.

Which parameters are *hidden matrices* (`split_muon`):
every 2-D parameter except the embeddings and the output head. That is the blocks' attention
and MLP projections of the built-in model (``blocks.*.attn.qkv``, ``attn.proj``, ``mlp.w1``,
``w2``, ``w3``) and of a Hugging Face model (``q_proj`` ... ``down_proj``, GPT-2's ``c_attn``
...); AdamW gets the token (and position) embeddings, the output head, tied or not, the norms'
gains, the biases and anything not 2-D.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MUON_LR_ADJUST = "match_rms_adamw"
"""Muon's update is scaled by 0.2 sqrt(max(rows, columns)) to AdamW's update RMS (Moonshot's
"Muon is Scalable for LLM Training"), so one ``--lr`` and its schedule serve both: the
default (``--muon-scale adamw-rms``)."""
MUON_SCALES = {"adamw-rms": MUON_LR_ADJUST, "original": "original"}
"""``--muon-scale``'s names for torch.optim.Muon's ``adjust_lr_fn``: ``original`` scales by
sqrt(max(1, rows / columns)), as Keller Jordan's Muon (and MuLoCo, CCLoco) do."""
HEAD_NAMES = ("lm_head",)
"""Names of output-head modules found by name: a Hugging Face pipeline stage
([`LlamaStage`][loco.hf.LlamaStage]) keeps ``lm_head`` outside any ``PreTrainedModel``."""


def embedding_and_head(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon leaves to AdamW although 2-D: every ``nn.Embedding``'s (the built-in
    model's ``embed``, also its tied output head; Hugging Face token and position embeddings),
    each Hugging Face model's ``get_input_embeddings()`` and ``get_output_embeddings()``, and a
    ``lm_head`` module's (a Hugging Face pipeline stage's head).

    Args:
        model: the module the optimizer trains: a whole model or one pipeline stage's part.

    Returns:
        The parameters, each once, in the order found.
    """
    found: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        picked = [module] if isinstance(module, nn.Embedding) else []
        if name.rpartition(".")[2] in HEAD_NAMES:
            picked.append(module)
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            if callable(getattr(module, getter, None)):
                try:
                    picked.append(getattr(module, getter)())
                except (NotImplementedError, AttributeError):  # a model without one
                    pass
        for m in picked:
            if isinstance(m, nn.Module):
                found.update((id(p), p) for p in m.parameters(recurse=False))
    return list(found.values())


def split_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split ``model``'s parameters for MuLoCo's inner optimizer.

    Args:
        model: the module the optimizer trains.

    Returns:
        ``(hidden, rest)``: the 2-D parameters other than the embeddings and the output head
        (`embedding_and_head`) for Muon, and
        every other parameter for AdamW; each in ``model.parameters()`` order, each tied
        parameter once.
    """
    outside = {id(p) for p in embedding_and_head(model)}
    hidden, rest = [], []
    for p in model.parameters():
        (hidden if p.dim() == 2 and id(p) not in outside else rest).append(p)
    return hidden, rest


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer that steps ``torch.optim.Muon`` on some parameters and
    ``torch.optim.AdamW`` on the others.

    Its ``param_groups`` are the two optimizers' groups, Muon's first, as the same dicts
    (so an LR scheduler that sets ``lr`` sets both); its ``state`` is one dict both share.
    ``zero_grad``, ``state_dict`` and ``load_state_dict`` are ``torch.optim.Optimizer``'s, so
    a checkpoint restores both bit for bit. ``step`` steps Muon, then AdamW, exactly as the
    two stepped one after the other would.

    Args:
        muon: the parameters for Muon (2-D); may be empty.
        adamw: the parameter groups for AdamW (dicts with ``params`` and per-group options);
            groups without parameters are dropped.
        lr: the learning rate of both.
        weight_decay: Muon's (decoupled) weight decay; AdamW's groups give their own.
        betas: AdamW's betas.
        adjust_lr_fn: Muon's learning-rate adjustment; default
            `MUON_LR_ADJUST`.
        muon_lr: Muon's learning rate; default None: ``lr``.
        fused: AdamW's ``fused`` (`wants_fused`); default None (torch's default).

    Raises:
        ValueError: no parameters at all, or a Muon parameter that is not 2-D.
    """

    def __init__(self, muon: list[nn.Parameter], adamw: list[dict], *, lr: float,
                 weight_decay: float, betas: tuple[float, float],
                 adjust_lr_fn: str = MUON_LR_ADJUST, fused: bool | None = None,
                 muon_lr: float | None = None):
        groups = [g for g in adamw if len(g["params"])]
        self.parts: list[torch.optim.Optimizer] = []
        if muon:
            self.parts.append(torch.optim.Muon(muon, lr=lr if muon_lr is None else muon_lr,
                                               weight_decay=weight_decay,
                                               adjust_lr_fn=adjust_lr_fn))
        if groups:
            self.parts.append(torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused))
        super().__init__([g for part in self.parts for g in part.param_groups], {})
        self._link()
        self._step_supports_amp_scaling = all(
            getattr(part, "_step_supports_amp_scaling", False) for part in self.parts
            if not isinstance(part, torch.optim.Muon))
        """Whether ``step`` takes ``found_inf``: when AdamW's part (if any) is fused."""

    def _link(self) -> None:
        """Point each part at its slice of ``param_groups`` and at the shared ``state``."""
        start = 0
        for part in self.parts:
            part.param_groups = self.param_groups[start:start + len(part.param_groups)]
            part.state = self.state
            start += len(part.param_groups)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of each part (Muon first). With ``found_inf`` set (a 0-d float tensor
        on the parameters' device, 1 for a non-finite gradient, as ``Algorithm`` sets it),
        the step is skipped on the device: AdamW's fused kernel takes it, and Muon's
        parameters and momenta keep their values where it is 1 (`muon_step_unless`), so no
        step reads the device on the host.

        Args:
            closure: re-evaluates the model and returns the loss, called once; optional.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = getattr(self, "found_inf", None)
        for part in self.parts:
            if found is None:
                part.step()
            elif isinstance(part, torch.optim.Muon):
                muon_step_unless(part, found)
            else:
                part.found_inf = found
                try:
                    part.step()
                finally:
                    del part.found_inf
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then the parts see the loaded groups
        and state.

        Args:
            state_dict: a ``state_dict()`` of a ``MuonAdamW`` over the same parameters.
        """
        super().load_state_dict(state_dict)
        self._link()

    def __getstate__(self) -> dict:
        """The base optimizer's pickled state, with the parts."""
        return {**super().__getstate__(), "parts": self.parts}

    def __setstate__(self, state: dict) -> None:
        """Unpickle, and link the parts again."""
        super().__setstate__(state)
        if "parts" in self.__dict__:
            self._link()


@torch.no_grad()
def muon_step_unless(muon: torch.optim.Muon, found_inf: torch.Tensor) -> None:
    """``muon.step()``, except where ``found_inf`` (a 0-d tensor on the parameters' device)
    is nonzero: then every parameter and momentum keeps its value. Decided on the device,
    never read on the host. Each parameter's new value and momentum are computed as
    ``torch.optim.Muon`` computes them (the same operations on the same values, so the same
    bits), into temporaries of its size, then selected with ``torch.where``.

    Args:
        muon: the optimizer; its groups' options as ``torch.optim.Muon`` takes them.
        found_inf: nonzero to skip the step.
    """
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    skip = found_inf != 0
    for group in muon.param_groups:
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = muon.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad,
                                                            memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            moved = buf.lerp(p.grad, 1 - momentum)
            update = p.grad.lerp(moved, momentum) if group["nesterov"] else moved
            update = _zeropower_via_newtonschulz(update, group["ns_coefficients"],
                                                 group["ns_steps"], group["eps"])
            stepped = p.mul(1 - lr * wd)
            stepped.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
            p.copy_(torch.where(skip, p, stepped))
            buf.copy_(torch.where(skip, buf, moved))


def inner_optimizer(model: nn.Module, kind: str, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], muon_lr: float | None = None,
                    muon_scale: str = "adamw-rms") -> torch.optim.Optimizer:
    """The inner optimizer over ``model``'s parameters.

    ``adamw``: ``torch.optim.AdamW`` with weight decay on the parameters of 2 or more
    dimensions only (not on norms' gains or biases), fused (`wants_fused`). ``muon``: a
    `MuonAdamW`: Muon (momentum 0.95, Nesterov, 5
    Newton-Schulz steps, its update matched to AdamW's RMS unless ``muon_scale`` says
    otherwise, at ``muon_lr`` where given) with ``weight_decay`` on the
    hidden matrices (`split_muon`), and the same AdamW
    as ``adamw`` on the rest (decay on the embeddings and head, none on norms and biases).

    Args:
        model: the module to train (a whole model or a pipeline stage's part).
        kind: ``"adamw"`` or ``"muon"``.
        lr: the (peak) learning rate of both.
        weight_decay: the decoupled weight decay of the matrices.
        betas: AdamW's betas.
        muon_lr: Muon's own (peak) learning rate; default None: ``lr``.
        muon_scale: how Muon scales its update, a key of `MUON_SCALES`; default
            ``"adamw-rms"``.

    Raises:
        ValueError: an unknown ``kind`` or ``muon_scale``.
    """
    if kind not in ("adamw", "muon"):
        raise ValueError(f"unknown inner optimizer {kind!r}: adamw or muon")
    if muon_scale not in MUON_SCALES:
        raise ValueError(f"unknown Muon scaling {muon_scale!r}: {' or '.join(MUON_SCALES)}")
    hidden, rest = split_muon(model) if kind == "muon" else ([], list(model.parameters()))
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=wants_fused(model))
    return MuonAdamW(hidden, groups, lr=lr, weight_decay=weight_decay, betas=betas,
                     fused=wants_fused(model), muon_lr=muon_lr,
                     adjust_lr_fn=MUON_SCALES[muon_scale])


def wants_fused(model: torch.nn.Module) -> bool | None:
    """``fused=True`` for AdamW on a model on a GPU or a CPU: one pass over each parameter
    with no temporaries. On a GPU it takes ``found_inf``, so that a non-finite step is
    skipped on the device without the host reading the gradient norm every step
    (``NonFinite.skip_on_device``); on a CPU it is 4-9 times faster than the foreach path
    and needs none of its whole-model temporaries (1.2 GB at ``--model 300m``,
    docs/memory.md). None (torch's default) on other devices."""
    first = next(model.parameters(), None)
    return True if first is not None and first.device.type in ("cuda", "cpu") else None
