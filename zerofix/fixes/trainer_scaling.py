"""The Trainer's gradient-accumulation scaling: three catalogue entries, one mechanism.

Three entries correct the same path, Trainer.training_step -> Accelerator.backward -> DeepSpeed, on
different releases:

``transformers-nokw-undivided`` (transformers >=4.46,<4.48)
    4.46 stopped dividing the loss by gradient_accumulation_steps in training_step, relying on the model
    normalising by ``num_items_in_batch``. A model whose forward takes no ``**kwargs`` never sees that count
    and returns its micro-batch mean, which nothing divides without DeepSpeed: updates are GAS times too
    large (measured 8.000 at GAS=8, 1 process and 2-rank DDP). With DeepSpeed the engine's own division
    happens to be the only one. Upstream (#35207, 4.48.0) divides by GAS in training_step; zerofix divides
    by the window's real length (what ``get_batch_samples`` fetched), and then the DeepSpeed entry lets the
    engine divide by 1, as on 4.49.
``transformers-deepspeed-double-division`` (transformers >=4.46,<4.49, with DeepSpeed)
    From 4.46 the Trainer hands Accelerator.backward a loss that is already per window: the model normalised
    it by ``num_items_in_batch`` (models taking loss kwargs), or, from 4.48, the Trainer divided it by GAS.
    With DeepSpeed, accelerate passes it to ``engine.backward``, which divides by GAS again (its default
    ``scale_wrt_gas=True``): updates of 1/GAS (measured 0.125 at GAS=8, ZeRO-2 and ZeRO-3, 1 and 2 ranks;
    4.46-4.47 models with loss kwargs, 4.48 every model). Upstream (#35808, 4.49.0) passes
    ``scale_wrt_gas=False`` from training_step; zerofix passes it from its Accelerator.backward wrapper, for
    the Trainer's calls only and only when the loss is already per window.
``transformers-accelerate-double-division`` (transformers >=5.2.0,<5.5.4)
    From 5.2.0 the Trainer builds its Accelerator with ``num_steps=gradient_accumulation_steps``, so
    ``Accelerator.backward`` divides by GAS a loss the Trainer already divided (or the model already
    normalised by ``num_items_in_batch``): every non-DeepSpeed update is 1/GAS of the intended one.
    DeepSpeed is unaffected (accelerate leaves scaling to the engine, which the Trainer tells not to).
    Upstream (#45349, 5.5.4) gives accelerate ``num_steps=1``; zerofix makes accelerate divide by 1 for the
    Trainer's own backward calls only, so a plain ``accelerator.accumulate`` loop keeps its division.

Each entry wraps the same attributes with the wrappers below; when two are applied (4.46-4.47) their layers
stack, and the outermost layer of each call does the whole job while inner layers pass through, so no
correction is applied twice (the rule is ``zerofix.scaling``):

- ``training_step`` opens a ``TrainerStep`` on the trainer's accelerator for the duration of the call:
  the backward inside it is the Trainer's (a plain ``accelerator.accumulate`` loop is never touched);
- ``backward`` (Accelerator.backward) reads the facts of the call, asks ``zerofix.scaling.plan`` what
  the applied entries require, and carries it out: divide the loss by the window's real length, pass
  ``scale_wrt_gas=False`` to DeepSpeed, or let accelerate divide by 1 for this call;
- ``get_batch_samples`` records how many micro-batches the Trainer fetched for the window (the last
  window of an epoch can be shorter than gradient_accumulation_steps).

Trainers created before ``patch()`` are covered (the wrappers are on the classes), and ``unpatch()`` leaves
no state behind.

Ambiguity list (docs/fixes.md): the entries react to the Trainer's own backward of a loss the Trainer believes
normalised by ``num_items_in_batch``, a belief it takes from the forward's signature (``**kwargs``). A head that
takes ``**kwargs`` but returns a plain mean (sequence classification), a ``compute_loss`` override or a
``compute_loss_func`` returning a mean, and TRL's GKDTrainer produce the same observation and are right
unpatched on 5.2.0 - 5.5.3 and 4.48: there these entries are known to harm (1.0 -> 4.0). Deciding from what the
loss does instead is the open issue "Any model the Trainer trains". A plain ``accelerator.accumulate`` loop
is never touched (tests/test_accelerate_loop.py).
"""
from __future__ import annotations

import inspect

from accelerate.utils import DistributedType  # imported by the fixes only, once accelerate is

from zerofix import applied, catalogue, scaling, versions
from zerofix.fixes.contract import Check, drifted, found

NOKW = "transformers-nokw-undivided"
DEEPSPEED = "transformers-deepspeed-double-division"
ACCELERATE = "transformers-accelerate-double-division"
FIX_IDS = (NOKW, DEEPSPEED, ACCELERATE)
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
    global _release_leaves_nokw_undivided  # a cache of an installed-version fact, not patch state
    if _release_leaves_nokw_undivided is None:
        version = versions.installed_version("transformers")
        _release_leaves_nokw_undivided = bool(version) and versions.version_in_range(
            version, catalogue.by_id(NOKW).affected)
    return _release_leaves_nokw_undivided


def structural_check(fix_id: str, targets) -> Check:
    """The signatures the wrappers read, plus what each entry's correction relies on."""
    if fix_id == NOKW:
        params = list(inspect.signature(targets["Trainer.get_batch_samples"]).parameters)
        if params[:3] != ["self", "epoch_iterator", "num_batches"]:
            return drifted(f"Trainer.get_batch_samples{tuple(params)} is not (self, epoch_iterator, num_batches, ...)")
    elif fix_id == DEEPSPEED:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

        params = inspect.signature(DeepSpeedEngineWrapper.backward).parameters.values()
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
            return drifted("DeepSpeedEngineWrapper.backward takes no **kwargs: scale_wrt_gas cannot reach "
                           "engine.backward")
    elif fix_id == ACCELERATE:
        from accelerate.accelerator import Accelerator

        prop = inspect.getattr_static(Accelerator, "gradient_accumulation_steps", None)
        if not isinstance(prop, property) or prop.fset is None:
            return drifted("Accelerator.gradient_accumulation_steps is no longer a settable property")
    else:
        raise KeyError(fix_id)
    step = targets.get("Trainer.training_step")
    if step is not None:
        params = list(inspect.signature(step).parameters)
        if params[:4] != ["self", "model", "inputs", "num_items_in_batch"]:
            return drifted(f"Trainer.training_step{tuple(params)} is not "
                           "(self, model, inputs, num_items_in_batch, ...)")
    backward = targets.get("Accelerator.backward")
    if backward is not None:
        params = list(inspect.signature(backward).parameters.values())
        if [p.name for p in params[:2]] != ["self", "loss"] or params[-1].kind != inspect.Parameter.VAR_KEYWORD:
            return drifted(f"Accelerator.backward{tuple(p.name for p in params)} is not (self, loss, **kwargs)")
    return found()


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
    return scaling.Corrections(applied.is_applied(NOKW), applied.is_applied(DEEPSPEED),
                               applied.is_applied(ACCELERATE))


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
