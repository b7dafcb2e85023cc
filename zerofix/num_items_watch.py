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

import weakref

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
        _follow(result, args)
        return result

    # Copies are plain tensors: a watched count kept by the user (deepcopy, pickle, torch.save) outlives the step.
    def __deepcopy__(self, memo):
        return _plain(self).__deepcopy__(memo)

    def __reduce_ex__(self, protocol):
        return _plain(self).__reduce_ex__(protocol)


# Results of another tensor subclass (a DTensor), whose class cannot be changed: followed by identity, one step.
_derived: "weakref.WeakSet" = weakref.WeakSet()


def _plain(tensor):
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _mark(tensor) -> None:
    """Watch a result from now on, *as the same object*: its class changes, no alias is made (an alias is a view
    in autograd's eyes, and the Trainer's ``loss *= ...`` on a view of DDP's output raises)."""
    if type(tensor) is torch.Tensor:
        tensor.__class__ = _Watched
    elif not isinstance(tensor, (_Watched, torch.nn.Parameter)):
        _derived.add(tensor)


def _follow(result, args) -> None:
    """Every tensor in ``result`` (tuples and lists of results too) watched, except an argument handed back as it
    was (``x.type_as(n)``, ``x.to(same)``): its value does not come from the count."""
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor) and not isinstance(a, _Watched)}
    for tensor in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(tensor, torch.Tensor) and id(tensor) not in inputs:
            _mark(tensor)


def _follow_in_place(name, args, kwargs):
    """``loss.div_(n)`` and ``torch.div(loss, n, out=loss)`` change a tensor the caller keeps: it is watched from
    then on (a Parameter keeps its class)."""
    in_place = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
    target = (kwargs or {}).get("out") if kwargs and "out" in kwargs else (args[0] if in_place and args else None)
    for tensor in target if isinstance(target, (tuple, list)) else (target,):
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
            _mark(tensor)


def watched(num_items):
    """A tensor equal to ``num_items`` whose results are followed; ``num_items`` itself when it is not a tensor
    (``None``, or an int: transformers 4.46-4.48 pass ``.item()``; see ``as_tensor_like_release``)."""
    if not isinstance(num_items, torch.Tensor):
        return num_items
    _Watched.python_reads = 0
    return num_items.as_subclass(_Watched)  # an alias: the Trainer's own count stays plain


def depends(value) -> bool:
    """Whether ``value`` (the loss) was computed from a watched count."""
    return isinstance(value, _Watched) or (isinstance(value, torch.Tensor) and value in _derived)


def unwatched(value):
    """``value`` itself, a plain tensor again (the same object: storage and autograd history untouched);
    anything else as it is."""
    if isinstance(value, _Watched):
        value.__class__ = torch.Tensor
    return value


def python_reads() -> int:
    """How often the count became a Python number since the last ``watched()``."""
    return _Watched.python_reads


def as_tensor_like_release(num_items):
    """transformers 4.46-4.48 hand an int to the loss: watch it as a 0-dim int64 tensor (dividing a float
    tensor by it gives bitwise the same value; tests/test_num_items_watch.py)."""
    if isinstance(num_items, int) and not isinstance(num_items, bool):
        return torch.tensor(num_items, dtype=torch.int64)
    return num_items
