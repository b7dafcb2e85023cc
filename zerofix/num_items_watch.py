"""Does computing a loss read ``num_items_in_batch``? Measured on the real call, with no extra forward.

The Trainer passes ``num_items_in_batch`` to the model (as a loss kwarg), to ``compute_loss_func`` or to a
subclass's ``compute_loss``. A loss normalised by it has to read it: the division (or a ``.to(device)``
before it, or ``.item()``) is a torch operation on the tensor. ``watched(n)`` returns a tensor equal to
``n`` whose every torch operation is counted and runs on the plain tensor, so the loss's value is
bitwise the one ``n`` gives and everything computed from it is a plain tensor. A loss computed without a
single read ignores the count: it is a mean over its micro-batch, whatever the forward's signature says.

Reads that cannot normalise anything are not counted: attribute reads (``.requires_grad``, ``.device``,
``.shape``: DeepSpeed's ZeRO-3 hooks look at every tensor argument of a forward). A loss that reads the
count for something else (a metric) counts as normalised: the wrong direction to err in is to divide a
normalised loss, and reading is the only evidence the other way.

Plain code, no patching; tests/test_num_items_watch.py.
"""
from __future__ import annotations

import torch


class _Watched(torch.Tensor):
    reads = 0  # torch operations on a watched tensor since the last reset (one watch at a time: a Trainer step)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":  # attribute reads cannot divide anything
            _Watched.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def watched(num_items):
    """A tensor equal to ``num_items`` whose torch operations are counted; ``num_items`` itself when it is
    not a tensor (``None``, or an int: transformers 4.46-4.48 pass ``.item()``), which cannot be watched."""
    if not isinstance(num_items, torch.Tensor):
        return num_items
    _Watched.reads = 0
    return num_items.as_subclass(_Watched)


def reads() -> int:
    return _Watched.reads


def as_tensor_like_release(num_items):
    """transformers 4.46-4.48 hand an int to the loss: watch it as a 0-dim int64 tensor (dividing a float
    tensor by it gives bitwise the same value; tests/test_num_items_watch.py)."""
    if isinstance(num_items, int) and not isinstance(num_items, bool):
        return torch.tensor(num_items, dtype=torch.int64)
    return num_items
