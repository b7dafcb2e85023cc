"""accelerate-short-last-window (opt-in): the last window of an epoch is divided by its own length.

Opt-in, because nothing a loop does tells its bug from a right usage. Its ambiguity list, each usage left
as accelerate runs it unless the user names this entry (tests/test_accelerate_loop.py, the default patch;
tests/test_upstream_accelerate.py, accelerate's own suite with plain ``ZEROFIX=1``):

- a loss normalised per window by the user (accelerate's gradient-accumulation guide: the sum over the
  window's counted items, times GAS and the number of processes): right on a short window exactly as
  accelerate scales it; rescaled it would be GAS/n times too large;
- accelerate's own ``test_grad_sync.py`` asserts the n/GAS short window;
- a mid-epoch resume (``load_state`` + ``skip_first_batches``) and an epoch stopped early by a step cap: the
  window's length foreseen from the dataloader (the DeepSpeed path below) is then wrong;
- the Trainer, a backward outside ``accumulate()``, ``sync_each_batch``, ``no_sync``: never touched.

When named (``zerofix.patch(opt_in=[...])``, ``ZEROFIX_OPT_IN``), for a loop whose loss is each
micro-batch's own mean:

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
through untouched.

Under DeepSpeed the gradients of the window's earlier micro-batches are already in the engine's partitions
(a different place per ZeRO stage, offload and release) by the time the window closes, and the engine
divides each loss by its config GAS. So there the window's length is known when it *opens*: accelerate
windows restart at every epoch (``accelerator.step`` counts the micro-batches since the dataloader's last
end), so at a window's first ``accumulate()`` the micro-batches left are ``len(active_dataloader) -
accelerator.step``; when fewer than GAS are left, every loss of that window is multiplied by GAS/n before
accelerate hands it to the engine. At the window's close zerofix checks that it had n micro-batches and
says so on every rank if not (a loop that skips ``accumulate()`` for some batches). accelerate < 1.10 lets
DeepSpeed's own micro-step count decide the boundary, which never falls on a short window's last
micro-batch (the window is never applied, and every later window is shifted): from the first short
window on, zerofix sets the engine's boundary flag from accelerate's ``sync_gradients`` before each
backward inside ``accumulate()``, as accelerate 1.10 does for every backward.
"""
from __future__ import annotations

import inspect

from zerofix import applied, paths
from zerofix._log import log
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "accelerate-short-last-window"
FIX_IDS = (FIX_ID,)
_KEY = "_zerofix_window"  # accelerator.__dict__: the current accumulate() window
_FLAGS_KEY = "_zerofix_flags_boundaries"  # accelerator.__dict__: zerofix sets the engine's boundary flags


class _Window:
    __slots__ = ("micro_batches", "closing", "factor", "expected")

    def __init__(self):
        self.micro_batches = 0  # accumulate() calls of this window
        self.closing = False  # the current micro-batch closes it: the next accumulate() opens a new one
        self.factor = None  # GAS/n once a short window's gradients were rescaled (or, DeepSpeed, its losses)
        self.expected = None  # DeepSpeed: the short window's length foreseen when it opened


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
    if "step" not in do_sync.__code__.co_names:
        return drifted("Accelerator._do_sync no longer counts the micro-batches in self.step")
    try:  # accelerate >= 1.10's wrapper sets the engine's boundary from sync_gradients itself
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
        sets_boundary = "sync_gradients" in inspect.signature(DeepSpeedEngineWrapper.backward).parameters
    except ImportError:
        sets_boundary = True
    return found(wrapper_sets_boundary=sets_boundary)


def accumulate(wrapped, accelerator, args, kwargs):
    window = accelerator.__dict__.get(_KEY)
    if window is None or window.closing:
        path = paths.accelerate_path(accelerator)
        if not path.covered:  # no window is opened: backward() passes straight through
            if paths.stood_aside(FIX_ID, path):
                log("warning", "zerofix: %s stands aside on %s: accelerate's own scaling runs unchanged", FIX_ID, path)
            return wrapped(*args, **kwargs)
        window = accelerator.__dict__[_KEY] = _Window()
        if _under_deepspeed(accelerator):  # a short window must be known before it runs
            left = _micro_batches_left(accelerator)
            gas = accelerator.gradient_accumulation_steps
            if left is not None and 0 < left < gas:
                window.expected, window.factor = left, gas / left
    window.micro_batches += 1
    return wrapped(*args, **kwargs)


def _micro_batches_left(accelerator) -> int | None:
    """Micro-batches left in the epoch, this one included, when accelerate's windows follow the dataloader
    (``sync_with_dataloader``) and it has a length; else None (nothing is foreseen)."""
    state = accelerator.gradient_state
    loader = getattr(state, "active_dataloader", None)
    if loader is None or not state.sync_with_dataloader:
        return None
    try:
        total = len(loader)
    except TypeError:  # an iterable dataset without a length
        return None
    return total - accelerator.step  # accelerate resets step at every end of the dataloader


def backward(wrapped, accelerator, args, kwargs):
    window = accelerator.__dict__.get(_KEY)
    if window is None:  # outside accumulate()
        return wrapped(*args, **kwargs)
    if window.expected is not None:  # DeepSpeed, a foreseen short window
        return _deepspeed_short_backward(wrapped, accelerator, window, args, kwargs)
    if accelerator.__dict__.get(_FLAGS_KEY):
        _set_engine_boundary(accelerator)
    if not accelerator.gradient_state.sync_gradients:  # mid-window
        return wrapped(*args, **kwargs)
    window.closing = True
    if window.factor is not None:  # a further backward of a short window's last micro-batch: scale its share
        args, kwargs = _scaled(args, kwargs, window.factor)
        return wrapped(*args, **kwargs)
    gas = accelerator.gradient_accumulation_steps
    n = window.micro_batches
    if not (n < gas and accelerator.gradient_state.end_of_dataloader and _accelerate_divides(accelerator)):
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    window.factor = gas / n
    _scale_gradients(accelerator, window.factor)
    return result


def _scaled(args, kwargs, factor):
    if args:
        return (args[0] * factor, *args[1:]), kwargs
    return args, {**kwargs, "loss": kwargs["loss"] * factor}


def _deepspeed_short_backward(wrapped, accelerator, window, args, kwargs):
    """Every loss of a short window under DeepSpeed, multiplied by GAS/n before the engine divides by GAS."""
    closing = accelerator.gradient_state.sync_gradients
    if closing:
        window.closing = True
        if window.micro_batches != window.expected:
            log("warning", "%s: the epoch's last window was foreseen with %d micro-batches and closed after %d "
                "(were some batches trained outside accumulate()?): its micro-batches were scaled by %g "
                "instead of %g.", FIX_ID, window.expected, window.micro_batches, window.factor,
                accelerator.gradient_accumulation_steps / window.micro_batches)
        if _engine_flags_needed():  # accelerate < 1.10 leaves the boundary to DeepSpeed's count
            accelerator.__dict__[_FLAGS_KEY] = True
    if accelerator.__dict__.get(_FLAGS_KEY):
        _set_engine_boundary(accelerator)
    args, kwargs = _scaled(args, kwargs, window.factor)
    return wrapped(*args, **kwargs)


def _engine_flags_needed() -> bool:
    """accelerate < 1.10: DeepSpeedEngineWrapper.backward takes no sync_gradients and never sets the engine's
    boundary (applied.facts says which, from the structural check)."""
    return not applied.facts(FIX_ID).get("wrapper_sets_boundary", True)


def _set_engine_boundary(accelerator) -> None:
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    if engine is not None:
        engine.set_gradient_accumulation_boundary(accelerator.gradient_state.sync_gradients)


def _under_deepspeed(accelerator) -> bool:
    return "DEEPSPEED" in str(getattr(accelerator, "distributed_type", ""))


def _accelerate_divides(accelerator) -> bool:
    """Whether Accelerator.backward divides this loss by GAS itself (not under DeepSpeed / Megatron-LM,
    whose engines scale)."""
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
