"""The one mechanism behind the Trainer's gradient-accumulation scaling fixes.

Three catalogue entries (transformers-nokw-undivided, transformers-deepspeed-double-division,
transformers-accelerate-double-division) correct the same path, Trainer.training_step ->
Accelerator.backward -> DeepSpeed, on different releases. Each wraps the same two attributes with the
wrappers below; when two are applied (4.46-4.47) their layers stack, and the outermost layer of each
call does the whole job while inner layers pass through, so no correction is applied twice:

- ``training_step`` opens a ``TrainerStep`` on the trainer's accelerator for the duration of the call:
  the backward inside it is the Trainer's (a plain ``accelerator.accumulate`` loop is never touched);
- ``backward`` (Accelerator.backward) reads the facts of the call, asks ``zerofix.scaling.plan`` what
  the applied entries require, and carries it out: divide the loss by the window's real length, pass
  ``scale_wrt_gas=False`` to DeepSpeed, or let accelerate divide by 1 for this call;
- ``get_batch_samples`` records how many micro-batches the Trainer fetched for the window (the last
  window of an epoch can be shorter than gradient_accumulation_steps).
"""
from __future__ import annotations

import inspect

from accelerate.utils import DistributedType  # imported by the fixes only, once accelerate is

from zerofix import catalogue, patching, scaling

NOKW = "transformers-nokw-undivided"
DEEPSPEED = "transformers-deepspeed-double-division"
ACCELERATE = "transformers-accelerate-double-division"
_STEP = "_zerofix_trainer_step"  # in accelerator.__dict__ while a Trainer step runs
_WINDOW = "_zerofix_window"  # in trainer.__dict__: micro-batches of the current window


class TrainerStep:
    __slots__ = ("trainer", "num_items_in_batch", "handled")

    def __init__(self, trainer, num_items_in_batch):
        self.trainer, self.num_items_in_batch = trainer, num_items_in_batch
        self.handled = False


_release_leaves_nokw_undivided = None


def release_leaves_nokw_undivided() -> bool:
    """Whether the installed Trainer leaves the loss of a model without loss kwargs undivided (the nokw
    entry's range, whether or not that entry is applied: the DeepSpeed entry must know either way)."""
    global _release_leaves_nokw_undivided
    if _release_leaves_nokw_undivided is None:
        version = patching.installed_version("transformers")
        _release_leaves_nokw_undivided = bool(version) and patching.version_in_range(
            version, catalogue.by_id(NOKW).affected)
    return _release_leaves_nokw_undivided


def check_targets(targets) -> str | None:
    """The structural check the three entries share: the signatures the wrappers read."""
    step = targets.get("Trainer.training_step")
    if step is not None:
        params = list(inspect.signature(step).parameters)
        if params[:4] != ["self", "model", "inputs", "num_items_in_batch"]:
            return f"Trainer.training_step{tuple(params)} is not (self, model, inputs, num_items_in_batch, ...)"
    backward = targets.get("Accelerator.backward")
    if backward is not None:
        params = list(inspect.signature(backward).parameters.values())
        if [p.name for p in params[:2]] != ["self", "loss"] or params[-1].kind != inspect.Parameter.VAR_KEYWORD:
            return f"Accelerator.backward{tuple(p.name for p in params)} is not (self, loss, **kwargs)"
    return None


def training_step(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or _STEP in accelerator.__dict__:  # an inner layer, or a nested call
        return wrapped(*args, **kwargs)
    num_items = kwargs.get("num_items_in_batch", args[2] if len(args) > 2 else None)
    accelerator.__dict__[_STEP] = TrainerStep(trainer, num_items)
    try:
        return wrapped(*args, **kwargs)
    finally:
        accelerator.__dict__.pop(_STEP, None)


def get_batch_samples(wrapped, trainer, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        trainer.__dict__[_WINDOW] = len(result[0])
    except (TypeError, IndexError):
        pass
    return result


def describe(accelerator, step: TrainerStep, kwargs) -> scaling.Call:
    trainer = step.trainer
    accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    own_loss = getattr(trainer, "compute_loss_func", None) is not None
    gas = int(trainer.args.gradient_accumulation_steps)
    leaves_undivided = release_leaves_nokw_undivided()
    nokw = not accepts and not own_loss
    return scaling.Call(
        deepspeed=accelerator.distributed_type == DistributedType.DEEPSPEED,
        token_normalised=step.num_items_in_batch is not None and (accepts or own_loss),
        # 4.48's condition (#35207); later releases do not need the DeepSpeed entry, which is its only reader
        trainer_divides=nokw and not leaves_undivided,
        nokw_undivided=nokw and leaves_undivided,
        window=int(trainer.__dict__.get(_WINDOW) or gas),
        gas=gas,
        accelerate_divides=accelerator.gradient_accumulation_steps != 1,
        scale_wrt_gas=bool(kwargs.get("scale_wrt_gas", True)),
    )


def corrections() -> scaling.Corrections:
    return scaling.Corrections(patching.is_applied(NOKW), patching.is_applied(DEEPSPEED),
                               patching.is_applied(ACCELERATE))


def backward(wrapped, accelerator, args, kwargs):
    step = accelerator.__dict__.get(_STEP) if accelerator is not None else None
    if step is None or step.handled:  # not the Trainer's backward, or an outer layer took care of it
        return wrapped(*args, **kwargs)
    step.handled = True
    plan = scaling.plan(describe(accelerator, step, kwargs), corrections())
    if plan.divide_by != 1:
        if args:
            args = (args[0] / plan.divide_by, *args[1:])
        else:
            kwargs = {**kwargs, "loss": kwargs["loss"] / plan.divide_by}
    if plan.scale_wrt_gas is not None:
        kwargs = {**kwargs, "scale_wrt_gas": plan.scale_wrt_gas}
    if not plan.accelerate_divisor_one:
        return wrapped(*args, **kwargs)
    steps = accelerator.gradient_accumulation_steps
    accelerator.gradient_accumulation_steps = 1  # the Trainer divided already (upstream #45349)
    try:
        return wrapped(*args, **kwargs)
    finally:
        accelerator.gradient_accumulation_steps = steps
