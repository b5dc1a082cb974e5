"""Splitting a model into the fragments that Streaming DiLoCo synchronizes one at a time.

With an integer ``P`` the model's repeated blocks (the largest ``nn.ModuleList``: transformer
layers) are dealt out **strided** (block i to fragment ``i % P``, the paper's default) or
**sequential** (contiguous runs). Parameters outside the blocks (embeddings, final norm, a
head) are placed one at a time, largest first, into the fragment with the fewest elements so
far; a tied head shares the embedding's tensor and is counted once.

An explicit list gives each fragment as a module, a parameter name, or a list of them; every
trainable parameter must then appear in exactly one of them.

A ``Fragment`` holds one fragment's parameters and its state, as the methods with a global
copy keep it (this rank's share): the global copy θ^g_p, its outer optimizer, the error
feedback, its views of the sync buffers and its counters; ``build_fragment`` makes one, and
``save_fragment``, ``load_fragment`` and ``fragment_outer_state`` give and take its part of a
checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from loco.algorithms.buffers import SyncBuffers, pinned
from loco.algorithms.sharding import Share, flatten_fp32, unflatten_views

PATTERNS = ("strided", "sequential")
"""How the blocks are dealt out to an integer number of fragments."""


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the ``nn.ModuleList`` (or ``nn.ModuleDict``, as a
    pipeline stage holds its share of the blocks) with the most parameters.

    Args:
        model: the model to search, at any depth.

    Returns:
        The blocks, in order.

    Raises:
        ValueError: the model holds no non-empty ``nn.ModuleList`` or ``nn.ModuleDict``.
    """
    lists = [list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
             for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not lists:
        raise ValueError("fragments: the model has no nn.ModuleList of blocks to split; pass "
                         "fragments=1 or an explicit list of modules per fragment")
    return max(lists, key=lambda blocks: sum(p.numel() for b in blocks for p in b.parameters()))


def split_fragments(model: nn.Module, fragments: int | Sequence, pattern: str = "strided"
                    ) -> list[list[str]]:
    """The names of the trainable parameters of each fragment, in the model's order.

    Args:
        model: the model to split; only parameters with ``requires_grad`` are placed.
        fragments: P, an integer >= 1 and at most the number of blocks (see
            [`find_blocks`][loco.algorithms.fragments.find_blocks]); 1 puts the whole model in
            one fragment. Or an explicit non-empty list of fragments, each a module, a
            parameter name, or a non-empty list of them; every trainable parameter must then
            be in exactly one fragment.
        pattern: how an integer P > 1 deals the blocks out: ``"strided"`` (default, block i
            to fragment i mod P) or ``"sequential"`` (contiguous runs of blocks). Parameters
            outside the blocks go, largest first, to the fragment with the fewest elements.

    Returns:
        One list of parameter names per fragment, each in the order of
            ``model.named_parameters()``.

    Raises:
        ValueError: P out of range, an unknown ``pattern``, no blocks to split, or an
            explicit list that misses a parameter, repeats one, or names something that is
            not a trainable parameter of the model.
    """
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    name_of = {id(p): n for n, p in named.items()}
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        groups = _by_blocks(model, fragments, pattern, named, name_of)
    elif isinstance(fragments, Sequence) and not isinstance(fragments, str):
        groups = _explicit(fragments, named, name_of)
    else:
        raise ValueError(f"fragments must be an int or a list of modules (got {fragments!r})")
    order = {n: i for i, n in enumerate(named)}
    return [sorted(g, key=order.__getitem__) for g in groups]


def _by_blocks(model, count: int, pattern: str, named: dict, name_of: dict) -> list[set[str]]:
    if count < 1:
        raise ValueError(f"fragments (P) must be >= 1 (got {count})")
    if count == 1:
        return [set(named)]
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)} (got {pattern!r})")
    blocks = find_blocks(model)
    if count > len(blocks):
        raise ValueError(f"fragments (P) must be at most the number of blocks, {len(blocks)} "
                         f"(got {count})")
    groups: list[set[str]] = [set() for _ in range(count)]
    for i, block in enumerate(blocks):
        p = i % count if pattern == "strided" else i * count // len(blocks)
        groups[p].update(name_of[id(t)] for t in block.parameters() if id(t) in name_of)
    sizes = [sum(named[n].numel() for n in g) for g in groups]
    placed = set().union(*groups)
    # Ties in size go by the model's order: a set's order differs between processes, and
    # every worker must build the same fragments (a Llama's input and output embeddings tie).
    order = {n: i for i, n in enumerate(named)}
    for name in sorted(set(named) - placed, key=lambda n: (-named[n].numel(), order[n])):
        smallest = sizes.index(min(sizes))
        groups[smallest].add(name)
        sizes[smallest] += named[name].numel()
    return groups


def _explicit(fragments: Sequence, named: dict, name_of: dict) -> list[set[str]]:
    if not fragments:
        raise ValueError("fragments: an explicit list needs at least one fragment")
    groups, seen = [], {}
    for i, item in enumerate(fragments):
        modules = [item] if isinstance(item, (nn.Module, str)) else list(item)
        if not modules or not all(isinstance(m, (nn.Module, str)) for m in modules):
            raise ValueError(f"fragments[{i}] must be a module, a parameter name, or a "
                             "non-empty list of them")
        group = set()
        for m in modules:
            if isinstance(m, str) and m not in named:
                raise ValueError(f"fragments[{i}]: {m!r} is not a trainable parameter of the "
                                 "model")
            for t in ([named[m]] if isinstance(m, str) else m.parameters()):
                name = name_of.get(id(t))
                if name is None:
                    continue  # frozen, or not a parameter of this model
                if seen.setdefault(name, i) != i:
                    raise ValueError(f"fragments: parameter {name} is in fragment {seen[name]} "
                                     f"and in fragment {i}; each must be in exactly one")
                group.add(name)
        if not group:
            raise ValueError(f"fragments[{i}] holds no trainable parameter of the model")
        groups.append(group)
    missing = [n for n in named if n not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"fragments: {len(missing)} parameter(s) are in no fragment ({shown}); "
                         "add their modules to one of the fragments")
    return groups


@dataclass
class Fragment:
    """One fragment's parameters and outer state (this rank's share of them)."""

    index: int
    names: list[str]
    params: list[torch.Tensor]  # θ_{m,p}: the live model parameters
    share: Share  # what this rank owns of them (all, or 1/R for a worker of R ranks)
    global_flat: torch.Tensor  # θ^g_p (this rank's share) in one fp32 buffer
    global_params: list[torch.Tensor]  # views of global_flat shaped like share.views
    delta: torch.Tensor  # Δ_{m,p} then Δ̄_p: a view of the one Δ buffer (`SyncBuffers`)
    grad: torch.Tensor  # Δ̄_p where the outer optimizer reads it (delta itself unless offloaded)
    outer_optimizer: torch.optim.Optimizer
    error: torch.Tensor | None = None  # e_{m,p}: what the codec has not sent yet, beside θ^g_p
    syncs: int = 0
    stats: dict = field(default_factory=lambda: dict(raw_bytes=0, bytes_sent=0,
                                                     bytes_received=0, peak_bytes=0))


def flat_outer_state(state: dict) -> dict:
    """An outer optimizer's ``state_dict`` for the one flat tensor it steps; a state with one
    entry per parameter (an older checkpoint) has its momenta concatenated in order.

    Args:
        state: the ``state_dict`` of a fragment's outer SGD, as saved.
    """
    params = state["param_groups"][0]["params"]
    if len(params) == 1:
        return state
    buffers = [state["state"].get(i, {}).get("momentum_buffer") for i in params]
    merged = ({} if any(b is None for b in buffers)
              else {0: {"momentum_buffer": flatten_fp32(buffers)}})
    return {"state": merged, "param_groups": [{**state["param_groups"][0], "params": [0]}]}


def build_fragment(index: int, names: list[str], share: Share, buffers: SyncBuffers,
                   outer_device: torch.device, compute: torch.device, sgd: dict,
                   offload: bool, error_feedback: bool) -> Fragment:
    """Fragment ``index``: its parameters, this rank's share, the global copy (and error
    feedback) on ``outer_device``, its views of the sync buffers and its outer SGD.

    Args:
        index: p, the fragment's index.
        names: its parameters' names.
        share: this rank's share of its parameters.
        buffers: the sync buffers, sized to the largest fragment.
        outer_device: where the global copy and outer optimizer live.
        compute: the model's device (to pin host copies for a GPU).
        sgd: the outer SGD's ``lr``, ``momentum`` and ``nesterov``.
        offload: whether the global copy is offloaded (pinned host memory).
        error_feedback: whether to keep an error feedback buffer.
    """
    global_flat = share.read().to(outer_device)
    if offload:
        global_flat = pinned(global_flat, compute)
    delta, grad = buffers.of(share.numel)
    global_flat.grad = grad  # the outer optimizer reads Δ̄ as the global copy's gradient
    # One flat tensor: one fused kernel per outer step, no loop over parameters.
    optimizer = torch.optim.SGD([global_flat], **sgd,
                                fused=outer_device.type in ("cpu", "cuda"))
    error = pinned(torch.zeros_like(global_flat), compute) if error_feedback else None
    return Fragment(index, names, share.params, share, global_flat,
                    unflatten_views(global_flat, share.views), delta, grad, optimizer, error)


def momentum_of(f: Fragment) -> torch.Tensor | None:
    """Fragment ``f``'s outer momentum, one fp32 vector (the optimizer's own), None before
    its first outer step or without momentum.

    Args:
        f: a fragment.
    """
    return f.outer_optimizer.state.get(f.global_flat, {}).get("momentum_buffer")


def make_momentum(f: Fragment) -> None:
    """Give fragment ``f``'s outer optimizer a (zero) momentum, as its first outer step
    would, for a checkpoint's values to be loaded into."""
    f.outer_optimizer.state[f.global_flat]["momentum_buffer"] = torch.zeros_like(
        f.global_flat)


def save_fragment(f: Fragment, tensors: bool, block_start: torch.Tensor | None) -> dict:
    """Fragment ``f``'s part of a checkpoint: its syncs and bytes; with ``tensors`` its
    global copy, outer optimizer, error feedback and asynchronous block's start (where
    kept); without, whether its outer momentum exists.

    Args:
        f: the fragment.
        tensors: include the tensors (the live ones: copy them to keep them).
        block_start: its asynchronous block's start, or None.
    """
    state = {"syncs": f.syncs, "stats": dict(f.stats)}
    if tensors:
        state.update(global_params=f.global_flat, outer_optimizer=f.outer_optimizer.state_dict())
        if f.error is not None:
            state["error"] = f.error
        if block_start is not None:
            state["block_start"] = block_start
    else:
        state["momentum"] = momentum_of(f) is not None
    return state


def load_fragment(f: Fragment, state: dict, block_start: torch.Tensor | None) -> None:
    """Restore what ``save_fragment`` saved (without tensors, a momentum to be filled by
    the outer state's values where one existed).

    Args:
        f: the fragment.
        state: its saved part.
        block_start: its asynchronous block's start, or None.
    """
    if "global_params" in state:
        f.global_flat.copy_(state["global_params"])
        f.outer_optimizer.load_state_dict(flat_outer_state(state["outer_optimizer"]))
    elif state.get("momentum"):  # its values come with load_outer_state
        make_momentum(f)
    if "error" in state and f.error is not None:
        f.error.copy_(state["error"])
    if "block_start" in state and block_start is not None:
        block_start.copy_(state["block_start"])
    f.syncs = int(state["syncs"])
    f.stats.update({k: int(v) for k, v in state.get("stats", {}).items()})


def fragment_outer_state(f: Fragment) -> dict:
    """Fragment ``f``'s global copy, outer momentum (once it exists) and error feedback
    by checkpoint name (``fragment{p}.global``, ``.momentum``, ``.error``), each as (its
    share, this rank's values).

    Args:
        f: the fragment.
    """
    state = {f"fragment{f.index}.global": (f.share, f.global_flat)}
    momentum = momentum_of(f)
    if momentum is not None:
        state[f"fragment{f.index}.momentum"] = (f.share, momentum)
    if f.error is not None:
        state[f"fragment{f.index}.error"] = (f.share, f.error)
    return state
