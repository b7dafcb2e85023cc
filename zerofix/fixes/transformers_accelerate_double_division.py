"""transformers-accelerate-double-division (transformers >=5.2.0,<5.5.4).

From 5.2.0 the Trainer builds its Accelerator with ``num_steps=gradient_accumulation_steps``, so
``Accelerator.backward`` divides by GAS a loss the Trainer already divided (or the model already
normalised by ``num_items_in_batch``): every non-DeepSpeed update is 1/GAS of the intended one.
DeepSpeed is unaffected (accelerate leaves scaling to the engine, which the Trainer tells not to).
Upstream (#45349, 5.5.4) gives accelerate ``num_steps=1``; zerofix makes accelerate divide by 1 for the
Trainer's own backward calls only (the shared mechanism in ``_trainer_step``), so Trainers created before
``patch()`` are covered, a plain ``accelerator.accumulate`` loop keeps its division, and ``unpatch()``
leaves no state behind.
"""
from __future__ import annotations

import inspect

# The defining submodule: the hook may fire while the `accelerate` package itself is still half-imported.
from accelerate.accelerator import Accelerator

from zerofix.fixes import _trainer_step


def structural_check(targets) -> str | None:
    prop = inspect.getattr_static(Accelerator, "gradient_accumulation_steps", None)
    if not isinstance(prop, property) or prop.fset is None:
        return "Accelerator.gradient_accumulation_steps is no longer a settable property"
    return _trainer_step.check_targets(targets)


def training_step(wrapped, instance, args, kwargs):
    return _trainer_step.training_step(wrapped, instance, args, kwargs)


def backward(wrapped, instance, args, kwargs):
    return _trainer_step.backward(wrapped, instance, args, kwargs)
