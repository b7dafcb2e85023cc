"""The means a loss takes over its own micro-batch, read from its autograd graph (issue 53, item 3).

A term averaged over a count that its micro-batch decides (a token-mean cross-entropy with ignored positions, the mean
of a boolean-masked selection) makes gradient accumulation average micro-batch means, where the big batch takes one
mean over the window: the two differ whenever the counts differ. TRL's ORPO and CPO negative log-likelihood term and
the RPO term of ms-swift's DPO are such terms. This module lists, for one loss, each full mean reduction in its graph
and the number of elements it divides by; whoever compares the lists of a window's micro-batches sees whether the
counts changed. Nothing here changes a loss; it reads the nodes autograd recorded for this step.

- ``NllLossBackward0`` / ``NllLoss2DBackward0`` with reduction mean and no class weights: the count is the number of
  targets that are not ``ignore_index`` (read from the saved target).
- ``MeanBackward0`` (a mean over every element): the count is its input's number of elements.
A mean over a dimension (``MeanBackward1``: a norm layer's mean of squares, a per-row mean) divides by a size the
batch's shape fixes, not by a count; it is not listed.

Importing this module imports torch.
"""
from __future__ import annotations

import math

import torch

__all__ = ["micro_means", "differing", "outcome", "DIFFER", "EQUAL", "NONE"]

_MEAN = 1  # torch's Reduction::Mean
_NODE_LIMIT = 200_000  # a walk never runs unbounded; a graph larger than this is not read (None)


def micro_means(loss) -> list[tuple[str, int]] | None:
    """``(kind, count)`` of each full mean in ``loss``'s graph, in a fixed walk order (the same graph shape gives the
    same order), or None where the graph cannot be read (no graph, too large, a saved tensor already freed)."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return None
    found, stack, seen = [], [root], {id(root)}
    try:
        while stack:
            node = stack.pop()
            if len(seen) > _NODE_LIMIT:
                return None
            entry = _mean_of(node)
            if entry is not None:
                found.append(entry)
            for child, _ in reversed(getattr(node, "next_functions", ())):
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
    except RuntimeError:  # a saved tensor freed by an earlier backward: nothing to read
        return None
    return found


def _mean_of(node) -> tuple[str, int] | None:
    kind = type(node).__name__
    if kind in ("NllLossBackward0", "NllLoss2DBackward0"):
        if getattr(node, "_saved_reduction", None) != _MEAN or getattr(node, "_saved_weight", None) is not None:
            return None
        target, ignore = node._saved_target, node._saved_ignore_index
        return "cross-entropy token mean", int((target != ignore).sum())
    if kind == "MeanBackward0":
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        if sizes is None:
            return None
        return "mean", math.prod(int(s) for s in sizes)
    return None


def differing(records: list[list[tuple[str, int]]]) -> list[tuple[str, list[int]]]:
    """The means whose count changed between micro-batches whose graphs have the same means in the same order: (kind,
    the counts, one per micro-batch). Empty where nothing changed or the graphs differ in shape (nothing to compare)."""
    if len(records) < 2 or any(r is None for r in records):
        return []
    kinds = [[kind for kind, _ in r] for r in records]
    if any(k != kinds[0] for k in kinds[1:]):
        return []
    out = []
    for i, kind in enumerate(kinds[0]):
        counts = [r[i][1] for r in records]
        if len(set(counts)) > 1:
            out.append((kind, counts))
    return out


DIFFER, EQUAL, NONE = "differ", "equal", "none"  # outcome()'s verdicts on a window's records


def outcome(records: list) -> tuple[str, list]:
    """What a window's records (every micro-batch of every rank) say: DIFFER with ``differing``'s list where a mean's
    count changed (the update averages micro-batch means: concluded); EQUAL where the graphs have the same means and
    every count is the same (nothing to tell yet: a later window may differ); NONE where there is no mean to read, a
    graph could not be read, or the graphs differ in shape (nothing this reading can conclude)."""
    if not records or any(r is None for r in records) or not any(records):
        return NONE, []
    changed = differing(records)
    if changed:
        return DIFFER, changed
    kinds = [[kind for kind, _ in r] for r in records]
    return (EQUAL, []) if all(k == kinds[0] for k in kinds[1:]) else (NONE, [])
