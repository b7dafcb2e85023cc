"""deepspeed-scale-wrt-gas: ``engine.backward(loss, scale_wrt_gas=False)`` is not divided by GAS.

DeepSpeed 0.18.3 moved the division by gradient_accumulation_steps from ``backward()`` into a backward
hook that ``engine.forward`` registers on every output tensor (``_backward_prologue_per_tensor``). The
hook divides unconditionally, so ``scale_wrt_gas=False`` only changes backward's return value: the
Trainer, which divides the loss itself and passes False (transformers >= 4.49), gets updates of 1/GAS,
and under ZeRO-0/1/2 1/GAS**2 for a model that returns its logits next to the loss (both outputs'
hooks divide; measured 1/64 at GAS=8 for a causal LM and a custom module under ZeRO-2, 1/8 under ZeRO-3).
DeepSpeed 0.18.4 (#7724) makes the hook honour the flag of the running ``backward()``.

zerofix does the same from outside: its ``backward`` wrapper records the caller's ``scale_wrt_gas`` on
the engine for the duration of the call, and its wrapper of the hook passes the gradient through
unscaled while that flag is False. A backward that does not go through ``engine.backward`` (a plain
``loss.backward()``) keeps DeepSpeed's default, dividing. The division at both outputs with
``scale_wrt_gas=True`` (0.18.3 - 0.19.5) is deepspeed-output-hook-division's; on 0.18.3 both layer.

Ambiguity list (docs/fixes.md): it reacts only to ``scale_wrt_gas=False`` on 0.18.3; the default ``True`` (every
loop that lets DeepSpeed divide) passes through untouched, as in 0.18.4 (tests/test_deepspeed_backports.py).
"""
from __future__ import annotations

import inspect

from zerofix import applied
from zerofix.fixes import _deepspeed_backward
from zerofix.fixes.contract import Check, drifted

FIX_ID = "deepspeed-scale-wrt-gas"
FIX_IDS = (FIX_ID,)
HOOK = "DeepSpeedEngine._backward_prologue_per_tensor"
BACKWARD = _deepspeed_backward.QUALNAME
_KEY = "_zerofix_scale_wrt_gas"  # in engine.__dict__ while engine.backward runs


def structural_check(fix_id: str, targets) -> Check:
    """None when the hook is the one measured broken: ``(self, grad)``, dividing by
    gradient_accumulation_steps unconditionally (it reads nothing else; 0.18.4 reads the flag of the
    running backward, 0.19 whether backward() scaled the graph already)."""
    hook = inspect.unwrap(targets[HOOK])
    params = list(inspect.signature(hook).parameters)
    if params != ["self", "grad"]:
        return drifted(f"{HOOK}{tuple(params)} is not (self, grad)")
    names = set(hook.__code__.co_names)
    if names != {"gradient_accumulation_steps"}:  # 0.18.3: ``return grad / self.gradient_accumulation_steps()``
        return drifted(f"{HOOK} consults {sorted(names - {'gradient_accumulation_steps'})}: not the unconditional "
                       "division")
    return _deepspeed_backward.check(targets[BACKWARD])


def backward(wrapped, engine, args, kwargs):
    flags = engine.__dict__  # not nn.Module.__setattr__: ~1 us per call
    position = applied.facts(FIX_ID)[_deepspeed_backward.POSITION]
    flags[_KEY] = bool(_deepspeed_backward.scale_wrt_gas(args, kwargs, position))
    try:
        return wrapped(*args, **kwargs)
    finally:
        flags.pop(_KEY, None)


def per_tensor(wrapped, engine, args, kwargs):
    if engine.__dict__.get(_KEY, True):
        return wrapped(*args, **kwargs)
    return args[0] if args else kwargs["grad"]  # scale_wrt_gas=False: the caller already scaled
