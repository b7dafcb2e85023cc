"""transformers-accelerate-double-division (transformers >=5.2.0,<5.5.4).

From 5.2.0 the Trainer builds its Accelerator with ``num_steps=gradient_accumulation_steps``, so
``Accelerator.backward`` divides by GAS a loss the Trainer already divided (or the model already
normalised by ``num_items_in_batch``): every non-DeepSpeed update is 1/GAS of the intended one.
DeepSpeed is unaffected (accelerate leaves scaling to the engine, which the Trainer tells not to).
Upstream (#45349, 5.5.4) gives accelerate ``num_steps=1``; we do the same, scoped to each training
step, so Trainers created before ``patch()`` are covered and ``unpatch()`` leaves no state behind.
"""
from __future__ import annotations

import inspect

from accelerate import Accelerator
from accelerate.utils import DistributedType


def structural_check(targets) -> str | None:
    params = list(inspect.signature(targets["Trainer.training_step"]).parameters)
    if params[:3] != ["self", "model", "inputs"]:
        return f"Trainer.training_step{tuple(params)} is not (self, model, inputs, ...)"
    prop = inspect.getattr_static(Accelerator, "gradient_accumulation_steps", None)
    if not isinstance(prop, property) or prop.fset is None:
        return "Accelerator.gradient_accumulation_steps is no longer a settable property"
    return None


def training_step(wrapped, instance, args, kwargs):
    accelerator = getattr(instance, "accelerator", None)
    if accelerator is None or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return wrapped(*args, **kwargs)
    steps = accelerator.gradient_accumulation_steps
    if steps == 1:
        return wrapped(*args, **kwargs)
    # The Trainer divides by the window's real length itself; accelerate must divide by 1.
    accelerator.gradient_accumulation_steps = 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        accelerator.gradient_accumulation_steps = steps
