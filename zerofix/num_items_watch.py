"""Does the loss depend on ``num_items_in_batch``? Followed through the real call, with no extra forward.

The Trainer passes ``num_items_in_batch`` to the model (as a loss kwarg), to ``compute_loss_func`` or to a
subclass's ``compute_loss``. A loss normalised by it is computed *from* it: the division (after a ``.to(device)``,
a cast, a clamp) is a chain of torch operations from the count to the loss. ``watched(n)`` returns a tensor equal
to ``n`` whose torch operations run on the plain tensor and whose tensor results are watched in turn, so the
watch follows the count through every operation; ``depends(loss)`` asks whether the loss the Trainer received
is one of those results. The values are bitwise the ones ``n`` gives.

What is *not* a normalisation, because nothing computed from it reaches the loss:
- an attribute read (``.shape``, ``.device``, ``.requires_grad``: DeepSpeed's ZeRO-3 hooks look at every tensor
  argument of a forward);
- a moved or cast copy that is dropped (FSDP's and accelerate's device hooks move every tensor argument of a
  forward, ``dispatch_model(..., force_hooks=True)`` does it per layer, mixed precision asks
  ``torch.is_floating_point`` of each);
- a Python number (``.item()``, ``float()``, ``int()``): a log entry or a metric. A loss divided by such a
  number cannot be followed; ``python_reads()`` says it happened, so the caller can say so (ambiguity list).

A watched tensor deep-copies, pickles and moves like a plain tensor (its copies are plain).

Plain code, no patching; tests/test_num_items_watch.py.
"""
from __future__ import annotations

import torch

# Conversions of a tensor to a Python value: the count left torch there, and can no longer be followed.
_PYTHON_CONVERSIONS = frozenset({"item", "tolist", "__float__", "__int__", "__index__", "__bool__", "__complex__"})


class _Watched(torch.Tensor):
    python_reads = 0  # conversions to Python numbers since the last watched() (one watch at a time: a Trainer step)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _PYTHON_CONVERSIONS:
            _Watched.python_reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if name == "__get__" and not isinstance(result, torch.Tensor):
            return result  # .shape, .device, .dtype, .requires_grad: nothing to follow
        _follow_in_place(name, args, kwargs)
        return _follow(result)

    # Copies are plain tensors: a watched count kept by the user (deepcopy, pickle, torch.save) outlives the step.
    def __deepcopy__(self, memo):
        return _plain(self).__deepcopy__(memo)

    def __reduce_ex__(self, protocol):
        return _plain(self).__reduce_ex__(protocol)


def _plain(tensor):
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _follow(result):
    """Every tensor in ``result`` watched (tuples and lists of results too: ``torch.split``, ``max(dim=)``)."""
    if isinstance(result, torch.Tensor):
        return result if isinstance(result, _Watched) else result.as_subclass(_Watched)
    if isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result):
        followed = [_follow(r) for r in result]
        try:
            return type(result)(followed)  # tuple, list, torch.return_types (structseq)
        except TypeError:  # a namedtuple
            return type(result)(*followed)
    return result


def _follow_in_place(name, args, kwargs):
    """``loss.div_(n)`` and ``torch.div(loss, n, out=loss)`` change a plain tensor the caller keeps: it is watched
    from then on (its class, as ``as_subclass`` would give; a Parameter keeps its own)."""
    in_place = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
    target = (kwargs or {}).get("out") if kwargs and "out" in kwargs else (args[0] if in_place and args else None)
    for tensor in target if isinstance(target, (tuple, list)) else (target,):
        if type(tensor) is torch.Tensor:
            tensor.__class__ = _Watched


def watched(num_items):
    """A tensor equal to ``num_items`` whose results are followed; ``num_items`` itself when it is not a tensor
    (``None``, or an int: transformers 4.46-4.48 pass ``.item()``; see ``as_tensor_like_release``)."""
    if not isinstance(num_items, torch.Tensor):
        return num_items
    _Watched.python_reads = 0
    return num_items.as_subclass(_Watched)


def depends(value) -> bool:
    """Whether ``value`` (the loss) was computed from a watched count."""
    return isinstance(value, _Watched)


def unwatched(value):
    """``value`` as a plain tensor (same storage, same autograd history); anything else as it is."""
    return _plain(value) if isinstance(value, _Watched) else value


def python_reads() -> int:
    """How often the count became a Python number since the last ``watched()``."""
    return _Watched.python_reads


def as_tensor_like_release(num_items):
    """transformers 4.46-4.48 hand an int to the loss: watch it as a 0-dim int64 tensor (dividing a float
    tensor by it gives bitwise the same value; tests/test_num_items_watch.py)."""
    if isinstance(num_items, int) and not isinstance(num_items, bool):
        return torch.tensor(num_items, dtype=torch.int64)
    return num_items
