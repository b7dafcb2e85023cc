"""What the Trainer entry reads of a trainer, its model and a step's loss: the facts ``zerofix.decision`` decides
from. Reading only: nothing here changes a trainer or a model, and nothing decides."""
from __future__ import annotations

import inspect

from zerofix import catalogue, decision, envvalues, framework_flags, num_items_watch, scaling, versions

_release = None


def release() -> tuple[int, ...]:
    """The installed transformers release, as numbers (read once: a fact of the process's environment)."""
    global _release
    if _release is None:
        _release = versions.release_tuple(versions.installed_version("transformers") or "0")
    return _release


def unwrap_peft(model):
    """A PeftModel's base model (what the Trainer inspects), or the model itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def unwrapped(trainer, model):
    """The model inside DDP, DeepSpeed and FSDP (a PeftModel stays: its call is the one the count comes with)."""
    try:
        return trainer.accelerator.unwrap_model(model)
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        return model


def _takes_kwargs(function) -> bool:
    try:
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False


def flagged_class(trainer, model) -> str | None:
    """The model class that says ``accepts_loss_kwargs = False`` while its forward takes ``**kwargs``, where the Trainer
    took the flag (``model_accepts_loss_kwargs`` False), on transformers >= 4.54 (the count's rules read here): 27
    generation heads of transformers 5.24 (Qwen2.5/3-VL, Qwen3.5, Gemma 4, GLM-4V, ...) whose forwards hand
    ``**kwargs`` to a ``loss_function`` that divides by the count (issue 47)."""
    if release() < (4, 54) or getattr(trainer, "model_accepts_loss_kwargs", True) is not False:
        return None
    inner = unwrap_peft(unwrapped(trainer, model))
    if inspect.getattr_static(type(inner), "accepts_loss_kwargs", None) is not False:
        return None
    return type(inner).__name__ if _takes_kwargs(inner.forward) else None


def trainer_guess(model) -> bool:
    """What the release's Trainer.__init__ guesses for ``model_accepts_loss_kwargs`` (PEFT-unwrapped): the
    model's ``accepts_loss_kwargs`` from 4.48, else whether the forward takes ``**kwargs`` (4.46-4.47: a
    ``**loss_kwargs`` parameter by that name)."""
    model = unwrap_peft(model)
    if release() >= (4, 48) and hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if release() < (4, 48):
        return "loss_kwargs" in params and params["loss_kwargs"].kind == inspect.Parameter.VAR_KEYWORD
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def count_withheld_by_trainer(trainer, model) -> str | None:
    """The model class whose count a trainer's ``model_accepts_loss_kwargs = False`` withholds against the Trainer's own
    reading of the model (the model declares loss kwargs), with no ``compute_loss_func``; None otherwise. The Trainer
    then never hands the model's loss the count (axolotl 0.17 - 0.19's flag, LLaMA-Factory's with a processor, a user's
    own subclass)."""
    if getattr(trainer, "model_accepts_loss_kwargs", True) is not False:
        return None
    if getattr(trainer, "compute_loss_func", None) is not None:
        return None
    inner = unwrapped(trainer, model)
    try:
        guessed = trainer_guess(inner)
    except Exception:  # noqa: BLE001 - an exotic model: no claim
        return None
    return type(unwrap_peft(inner)).__name__ if guessed else None


def smoother_takes_the_count(trainer) -> bool:
    """No label smoother, or one the Trainer hands ``num_items_in_batch`` (transformers >= 5.24's LabelSmoother): its
    loss is then divided by the count like the model's (decided at every step by the verdict)."""
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is None:
        return True
    try:
        return "num_items_in_batch" in inspect.signature(smoother).parameters
    except (TypeError, ValueError):
        return False


def compiled(trainer, model) -> bool:
    """Under torch.compile a watched count cannot be followed: Dynamo cannot trace a tensor subclass that shows it
    every read (with ``fullgraph=True`` the step would stop), and a watched tensor would send the step through
    another graph (eager where the compiled graph would run: measured, the loss differs in the last bits). So a
    compiled model or ``compute_loss_func`` gets the plain count, the verdict is unknown, and upstream's path runs
    (``backward`` says so at WARNING with the statement that settles it)."""
    loss_func = getattr(trainer, "compute_loss_func", None)
    return (bool(getattr(getattr(trainer, "args", None), "torch_compile", False)) or hasattr(model, "_orig_mod")
            or hasattr(loss_func, "_torchdynamo_orig_callable") or hasattr(loss_func, "_orig_mod"))


def run_facts(trainer, model, path, is_compiled: bool) -> decision.RunFacts:
    """What a run's start decides from (``zerofix.trainer_decision.TrainerDecision.start``)."""
    args = getattr(trainer, "args", None)
    accelerator = getattr(trainer, "accelerator", None)
    loss_type = getattr(args, "loss_type", None)
    said = decision.local_batch_message(loss_type, int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                                        int(getattr(accelerator, "num_processes", 1) or 1))
    flag = framework_flags.of(trainer)
    return decision.RunFacts(
        covered=path.covered, compiled=is_compiled,
        loss_func=getattr(trainer, "compute_loss_func", None) is not None,
        smoother_takes_count=smoother_takes_the_count(trainer),
        trainer_statement=getattr(trainer, "loss_is_scaled_for_ga", None) is not None,
        flagged=flagged_class(trainer, model), withheld=count_withheld_by_trainer(trainer, model),
        framework=flag, framework_fix=catalogue.by_id(flag.fix_id) if flag is not None else None,
        hand_count=envvalues.hand_count_statement(), local_batch=(loss_type, said) if said else None)


def statement_facts(trainer) -> decision.StatementFacts:
    """What the trainer and its model say of the loss by their own attributes (``decision.stated``)."""
    loss_func = getattr(trainer, "compute_loss_func", None)
    model = unwrapped(trainer, trainer.model)
    return decision.StatementFacts(
        trainer_statement=getattr(trainer, "loss_is_scaled_for_ga", None) is not None,
        loss_func_marker=loss_func is not None and not callable(loss_func), loss_func=loss_func is not None,
        model_declares=hasattr(type(unwrap_peft(model)), "accepts_loss_kwargs"),
        accepts=bool(getattr(trainer, "model_accepts_loss_kwargs", False)), guess=trainer_guess(model))


def trainer_facts(accelerator, trainer, num_items, window) -> scaling.TrainerFacts:
    """What the release's Trainer reads when it scales one micro-batch's loss."""
    gas = int(trainer.args.gradient_accumulation_steps)
    return scaling.TrainerFacts(
        accepts_loss_kwargs=bool(getattr(trainer, "model_accepts_loss_kwargs", False)),
        compute_loss_func=getattr(trainer, "compute_loss_func", None) is not None,
        num_items=num_items is not None,
        average_tokens=bool(getattr(trainer.args, "average_tokens_across_devices", False)),
        loss_is_scaled_for_ga=getattr(trainer, "loss_is_scaled_for_ga", None),
        processes=int(accelerator.num_processes), gas=gas, window=int(window or gas))


def last_scalings(loss, depth: int = 2) -> tuple:
    """The constants the last ``depth`` operations of ``loss`` multiply it by, the last one first (``loss / 4`` is
    ``0.25``, ``loss * 2`` is ``2.0``): a Python number or a one-element tensor with no gradient, which is what
    ``loss / gas`` and the Trainer's ``loss *= num_processes`` save. The reading stops at any other operation.
    ``zerofix.decision`` reads a division by exactly the accumulation steps from them (a coincidence, issue 58)."""
    found, node = [], getattr(loss, "grad_fn", None)
    while node is not None and len(found) < depth:
        kind = type(node).__name__
        if kind.startswith("DivBackward"):
            value, invert = num_items_watch.constant_value(getattr(node, "_saved_other", None)), True
        elif kind.startswith("MulBackward"):
            value = num_items_watch.constant_value(getattr(node, "_saved_other", None))
            if value is None:
                value = num_items_watch.constant_value(getattr(node, "_saved_self", None))
            invert = False
        else:
            break
        if value is None or (invert and value == 0):
            break
        found.append(1.0 / value if invert else value)
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None  # a constant operand has no node: one input left
    return tuple(found)


def even_window(batches, num_items, *, world: int, across: bool) -> bool:
    """Whether every micro-batch of a window counts the same number of labels, the window's count over its micro-batches
    (and processes, where the Trainer counts across them): then a micro-batch's mean over its own labels, scaled by the
    window's length, is its share of the window's mean, and handing its loss function the count changes no update but
    in its rounding (a sequence classifier's equal micro-batches). Either way of counting the Trainer has used (the
    labels as they are, or shifted by one for next-token prediction) may match; anything unreadable is not even."""
    try:
        total = int(num_items)
        share = len(batches) * (world if across else 1)
        labels = [b["labels"] for b in batches]
        for shifted in (False, True):
            if shifted and any(x.dim() < 2 for x in labels):
                break
            counts = {int(((x[..., 1:] if shifted else x) != -100).sum()) for x in labels}
            if len(counts) == 1 and counts.pop() * share == total:
                return True
    except Exception:  # noqa: BLE001 - a batch this cannot read: not known to be even
        return False
    return False


def num_items_arg(args, kwargs):
    """The ``num_items_in_batch`` a ``training_step(model, inputs, num_items_in_batch)`` call carries."""
    if "num_items_in_batch" in kwargs:
        return kwargs["num_items_in_batch"]
    return args[2] if len(args) > 2 else None


def with_num_items(args, kwargs, value):
    """The same call with ``num_items_in_batch`` replaced by ``value``."""
    if "num_items_in_batch" in kwargs or len(args) <= 2:
        return args, {**kwargs, "num_items_in_batch": value}
    return (*args[:2], value, *args[3:]), kwargs
