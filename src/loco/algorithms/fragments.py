"""Splitting a model into the fragments that Streaming DiLoCo synchronizes one at a time.

With an integer ``P`` the model's repeated blocks (the largest ``nn.ModuleList``: transformer
layers) are dealt out **strided** (block i to fragment ``i % P``, the paper's default) or
**sequential** (contiguous runs). Parameters outside the blocks (embeddings, final norm, a
head) are placed one at a time, largest first, into the fragment with the fewest elements so
far; a tied head shares the embedding's tensor and is counted once.

An explicit list gives each fragment as a module, a parameter name, or a list of them; every
trainable parameter must then appear in exactly one of them.

A ``Fragment`` holds one fragment's parameters and its
outer state, as Streaming DiLoCo keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from loco.algorithms.sharding import Share, flatten_fp32

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
