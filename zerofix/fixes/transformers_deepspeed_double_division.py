"""transformers-deepspeed-double-division (transformers >=4.46,<4.49, with DeepSpeed).

From 4.46 the Trainer hands Accelerator.backward a loss that is already per window: the model normalised
it by ``num_items_in_batch`` (models taking loss kwargs), or, from 4.48, the Trainer divided it by GAS.
With DeepSpeed, accelerate passes it to ``engine.backward``, which divides by GAS again (its default
``scale_wrt_gas=True``): updates of 1/GAS (measured 0.125 at GAS=8, ZeRO-2 and ZeRO-3, 1 and 2 ranks;
4.46-4.47 models with loss kwargs, 4.48 every model). Upstream (#35808, 4.49.0) passes
``scale_wrt_gas=False`` from training_step; zerofix passes it from its Accelerator.backward wrapper, for
the Trainer's calls only and only when the loss is already per window (see ``zerofix.scaling``).
"""
from __future__ import annotations

import inspect

from zerofix.fixes import _trainer_step


def structural_check(targets) -> str | None:
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    params = inspect.signature(DeepSpeedEngineWrapper.backward).parameters.values()
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return "DeepSpeedEngineWrapper.backward takes no **kwargs: scale_wrt_gas cannot reach engine.backward"
    return _trainer_step.check_targets(targets)


def training_step(wrapped, instance, args, kwargs):
    return _trainer_step.training_step(wrapped, instance, args, kwargs)


def backward(wrapped, instance, args, kwargs):
    return _trainer_step.backward(wrapped, instance, args, kwargs)
