"""accelerate-short-last-window: the last window of an epoch is divided by its own length.

A plain ``with accelerator.accumulate(model)`` loop lets ``Accelerator.backward`` divide every loss by
``gradient_accumulation_steps``. When the epoch ends inside a window (10 micro-batches at GAS=4), accelerate
closes that window early (``end_of_dataloader``, ``sync_with_dataloader``) but has already divided its
micro-batches by GAS: the update is n/GAS of the window's mean (measured 2/3 for 2 micro-batches at GAS=3 on
every stack, accelerate 1.1.1 - 1.15.0, 1 process and DDP).

zerofix counts the ``accumulate()`` calls of the current window. At the backward that closes a window at
the end of the dataloader with n < GAS micro-batches, after accelerate's own backward (DDP has averaged the
gradients by then), it multiplies the gradients of every parameter the accelerator's optimizers hold by
GAS/n, before any clipping or ``optimizer.step()``; a further backward in that same micro-batch has its
loss multiplied by GAS/n instead, so nothing is scaled twice. Every full window, the Trainer (which does
not use ``accumulate()`` and counts its windows itself) and a backward outside ``accumulate()`` pass
through untouched. Under DeepSpeed the gradients live in the engine's partitions, and accelerate < 1.10
never closes the short window at all: both are measured (tests/test_accelerate_loop.py) and left as they
are for now.
"""
from __future__ import annotations

import inspect

from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "accelerate-short-last-window"
FIX_IDS = (FIX_ID,)
_KEY = "_zerofix_window"  # accelerator.__dict__: the current accumulate() window


class _Window:
    __slots__ = ("micro_batches", "closing", "factor")

    def __init__(self):
        self.micro_batches = 0  # accumulate() calls of this window
        self.closing = False  # the current micro-batch closes it: the next accumulate() opens a new one
        self.factor = None  # GAS/n once a short window's gradients were rescaled


def structural_check(fix_id: str, targets) -> Check:
    """Found when ``accumulate()`` decides the window through ``_do_sync`` (which closes it at the end of the
    dataloader) and ``backward`` divides by gradient_accumulation_steps."""
    from accelerate.accelerator import Accelerator

    accumulate = inspect.unwrap(targets["Accelerator.accumulate"])
    if "_do_sync" not in accumulate.__code__.co_names:
        return drifted("Accelerator.accumulate no longer calls _do_sync")
    do_sync = getattr(Accelerator, "_do_sync", None)
    if do_sync is None or not {"end_of_dataloader", "num_steps"} <= set(do_sync.__code__.co_names):
        return drifted("Accelerator._do_sync no longer closes a window at the end of the dataloader")
    backward = inspect.unwrap(targets["Accelerator.backward"])
    if "gradient_accumulation_steps" not in backward.__code__.co_names:
        return drifted("Accelerator.backward no longer divides by gradient_accumulation_steps")
    return found()


def accumulate(wrapped, accelerator, args, kwargs):
    window = accelerator.__dict__.get(_KEY)
    if window is None or window.closing:
        window = accelerator.__dict__[_KEY] = _Window()
    window.micro_batches += 1
    return wrapped(*args, **kwargs)


def backward(wrapped, accelerator, args, kwargs):
    window = accelerator.__dict__.get(_KEY)
    if window is None or not accelerator.gradient_state.sync_gradients:  # outside accumulate(), mid-window
        return wrapped(*args, **kwargs)
    window.closing = True
    if window.factor is not None:  # a further backward of a short window's last micro-batch: scale its share
        if args:
            args = (args[0] * window.factor, *args[1:])
        else:
            kwargs = {**kwargs, "loss": kwargs["loss"] * window.factor}
        return wrapped(*args, **kwargs)
    gas = accelerator.gradient_accumulation_steps
    n = window.micro_batches
    if not (n < gas and accelerator.gradient_state.end_of_dataloader and _accelerate_divides(accelerator)):
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    window.factor = gas / n
    _scale_gradients(accelerator, window.factor)
    return result


def _accelerate_divides(accelerator) -> bool:
    """Whether Accelerator.backward divides this loss by GAS itself (not under DeepSpeed / Megatron-LM,
    whose engines scale; their short windows are left as they are)."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    return "DEEPSPEED" not in kind and "MEGATRON" not in kind


def _scale_gradients(accelerator, factor: float) -> None:
    import torch

    seen = set()
    with torch.no_grad():
        for optimizer in getattr(accelerator, "_optimizers", ()):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in seen and param.grad is not None:
                        seen.add(id(param))
                        param.grad.mul_(factor)
