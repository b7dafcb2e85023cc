"""The Trainer's gradient-accumulation scaling, decided by what the loss does: ``transformers-trainer-scaling``.

Along Trainer.compute_loss -> training_step -> Accelerator.backward (-> engine.backward) a loss must be divided exactly
once by its accumulation window, or not at all when it is normalised by ``num_items_in_batch``. The Trainer decides
which from the forward's signature, and each release divides in its own places: 4.46-4.47 never divide a loss without
loss kwargs (#35207), 4.46-4.48 with DeepSpeed divide a per-window loss again (#35808), 5.2.0-5.5.3 let accelerate
divide again (#45349), and every release from 4.46 skips the division for a head that takes ``**kwargs`` but returns a
plain mean (sequence classification; #47688 open). Heads whose class says ``accepts_loss_kwargs = False`` (27 of 5.24),
and a trainer's own flag that a framework's release has as a bug (issue 67), are never handed the count: their update
is a mean of micro-batch means.

The entry measures, at every step, what the loss does with the count (divided by it, independent of it, unknown:
``zerofix.num_items_watch``) and has the path divide exactly once (``zerofix.scaling``), on the paths it models
(``zerofix.paths``: one process, DDP, DeepSpeed ZeRO-0..3, FSDP1, FSDP2; elsewhere it stands aside and says "not
covered"). Its parts: ``wiring`` (the wrappers), ``runs`` (what is kept beside each trainer), ``reading`` (what is read
of the trainer, the model and the loss), ``handing`` (the count handed where the Trainer does not), ``means`` (the
micro-batch means of a window); every decision is ``zerofix.trainer_decision.TrainerDecision``'s and every word
``zerofix.trainer_words``'s. What each usage upstream documents gets, with the test that shows it, is the entry's
ambiguity list in docs/fixes.md.

Trainers created before ``patch()`` are covered (the wrappers are on the classes), and ``unpatch()`` leaves no state
behind: what the entry keeps lives in weak maps, never on the user's objects.
"""
from __future__ import annotations

import inspect

from zerofix import trainer_words
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "transformers-trainer-scaling"
FIX_IDS = (FIX_ID,)
NOT_SEEN = trainer_words.NOT_SEEN


def structural_check(fix_id: str, targets) -> Check:
    """The signatures the wrappers read."""
    if fix_id != FIX_ID:
        raise KeyError(fix_id)
    params = list(inspect.signature(targets["Trainer.training_step"]).parameters)
    if params[:4] != ["self", "model", "inputs", "num_items_in_batch"]:
        return drifted(f"Trainer.training_step{tuple(params)} is not (self, model, inputs, num_items_in_batch, ...)")
    params = list(inspect.signature(targets["Trainer.compute_loss"]).parameters)
    if params[:2] != ["self", "model"] or "num_items_in_batch" not in params:
        return drifted(f"Trainer.compute_loss{tuple(params)} takes no num_items_in_batch")
    params = list(inspect.signature(targets["Trainer.get_batch_samples"]).parameters)
    if params[:3] != ["self", "epoch_iterator", "num_batches"]:
        return drifted(f"Trainer.get_batch_samples{tuple(params)} is not (self, epoch_iterator, num_batches, ...)")
    params = list(inspect.signature(targets["Accelerator.backward"]).parameters.values())
    if [p.name for p in params[:2]] != ["self", "loss"] or params[-1].kind != inspect.Parameter.VAR_KEYWORD:
        return drifted(f"Accelerator.backward{tuple(p.name for p in params)} is not (self, loss, **kwargs)")
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    params = inspect.signature(DeepSpeedEngineWrapper.backward).parameters.values()
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return drifted("DeepSpeedEngineWrapper.backward takes no **kwargs: scale_wrt_gas cannot reach engine.backward")
    from accelerate.accelerator import Accelerator

    prop = inspect.getattr_static(Accelerator, "gradient_accumulation_steps", None)
    if not isinstance(prop, property) or prop.fset is None:
        return drifted("Accelerator.gradient_accumulation_steps is no longer a settable property")
    return found()


def runtime_details() -> list[dict]:
    """Per trainer run: the verdicts of its steps (divided, independent, unknown and why), whether what the loss is was
    stated, and how many of its backwards zerofix changed (0: every one went through as upstream's)."""
    from zerofix.fixes.trainer_scaling import runs

    return [dict(d) for d in runs.details]


def run_details(trainer_state) -> dict | None:
    """The runtime_details() entry of the run whose ``trainer.state`` this is (a copy), or None: what the Trainer log of
    that run reports (issue 51, item 5: not another Trainer's of the same class)."""
    from zerofix.fixes.trainer_scaling import runs

    return runs.run_details_of(trainer_state)


def reset_runtime() -> None:
    from zerofix.fixes.trainer_scaling import runs

    runs.details.clear()


def framework_flag_line(details: dict) -> str | None:
    """What the entry did for a framework's flag (issue 67) in one run, from its details (``run_details``): the
    framework entry's line in the Trainer log, or None where no framework flag was handed in that run."""
    if not details or not details.get("framework_flag") or not details.get("steps_handed"):
        return None
    return trainer_words.framework_flag_line(details["framework_setter"], details["steps_handed"],
                                             details.get("corrected", 0), details.get("count_handed", ""))


def loss_is_scaled_for_ga(trainer, value: bool = True) -> None:
    """The user's statement of what ``trainer``'s loss is: True, already per accumulation window (divided by
    gradient_accumulation_steps or normalised by the window's count: the Trainer's own path is followed as for a
    normalised loss); False, a micro-batch mean. It wins over the measurement; ``None`` withdraws it."""
    from zerofix.fixes.trainer_scaling import runs

    record = runs.record_of(trainer)
    record.statement = None if value is None else bool(value)
    if record.decision is not None:
        record.decision.restate(record.statement)


def state_of(trainer):
    """What the entry keeps beside ``trainer`` (``runs.TrainerRecord``: its run's path, compiled, last verdict and
    ``stated``), for a reader that reports or tests it."""
    from zerofix.fixes.trainer_scaling import runs

    return runs.record_of(trainer)


def count_never_handed(trainer, model) -> str | None:
    """The model class zerofix would have the Trainer hand the count to although the Trainer withholds it
    (``zerofix.decision.handed_head``), or None."""
    from zerofix import decision, paths
    from zerofix.fixes.trainer_scaling import reading, runs

    facts = reading.run_facts(trainer, model, paths.Path("read", True), reading.compiled(trainer, model))
    record = runs.record_of(trainer)
    statement = record.statement if record.statement is not None else \
        (record.decision.env_statement if record.decision is not None else None)
    return decision.handed_head(facts, statement)


_PUBLIC = {"training_step": "wiring", "compute_loss": "wiring", "get_batch_samples": "wiring", "backward": "wiring",
           "current_step": "wiring", "warn_main": "wiring", "CountToLoss": "handing", "unwrap_peft": "reading",
           "trainer_guess": "reading", "release": "reading", "last_scalings": "reading"}


def __getattr__(name):
    """The wrappers and the readers the sibling entries use, from their modules (imported when asked for: this package's
    face imports neither accelerate nor torch)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
