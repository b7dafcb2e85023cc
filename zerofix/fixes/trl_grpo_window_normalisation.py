"""trl-grpo-window-normalisation: GRPO's token-level losses divided by the generation batch's token count.

For ``loss_type`` ``dapo`` (the default), ``cispo`` and ``vespo``, TRL 0.22.0 - 1.9.1 divide each micro-step's
summed per-token loss by ``num_items_in_batch / num_processes``, where ``num_items_in_batch`` counts the
completion tokens of the whole *generation* batch (``steps_per_generation`` micro-steps, every rank), while
the gradients of ``gradient_accumulation_steps`` micro-steps make one update. With ``steps_per_generation``
(or ``generation_batch_size``) different from GAS, every update is GAS/steps_per_generation times the
token-mean over its window (measured: 0.5 at steps_per_generation=4, GAS=2; 2.0 at 1 and 2). TRL #5619, fixed
in 1.9.2 (#6024) by rescaling the normaliser with ``current_gradient_accumulation_steps /
steps_per_generation`` in training.

The wrapper applies that rescaling to the returned loss, in training only and only where the two differ, so a
run with steps_per_generation == GAS (and evaluation) gets upstream's own tensor back. Like 1.9.2 it assumes
the generation batch's tokens are spread evenly over its micro-steps: with completions of different lengths
the update is the window's token-mean up to that spread (as upstream's fix). The Liger path
(``use_liger_kernel=True``, ``compute_liger_loss``, fixed in 1.12.0) is not covered. The experimental
``trl.experimental.gspo_token`` GRPOTrainer has its own copy of ``_compute_loss`` with the same divisor (fixed
in the same release): trl-gspo-token-window-normalisation wraps it with the same function.

Ambiguity list (docs/fixes.md): it reacts to dapo/cispo/vespo in training with ``steps_per_generation`` !=
GAS, as 1.9.2 does; ``steps_per_generation`` == GAS and evaluation return upstream's tensor, bitwise
(tests/test_trl_grpo.py).
"""
from __future__ import annotations

import inspect

from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found
from zerofix.identity import WeakIdentityMap

FIX_ID = "trl-grpo-window-normalisation"
GSPO_TOKEN_FIX_ID = "trl-gspo-token-window-normalisation"
FIX_IDS = (FIX_ID, GSPO_TOKEN_FIX_ID)
TARGET = "GRPOTrainer._compute_loss"
WINDOW_LOSSES = ("dapo", "cispo", "vespo")
# What the measured releases' source says: the divisor, and no rescaling by steps_per_generation yet
DIVISOR = 'inputs["num_items_in_batch"]'
RESCALE = "/ self.args.steps_per_generation"


def structural_check(fix_id: str, targets) -> Check:
    for name, target in targets.items():
        function = inspect.unwrap(target)
        params = list(inspect.signature(function).parameters)
        if params != ["self", "model", "inputs"]:
            return drifted(f"{name}{tuple(params)} is not the measured (self, model, inputs)")
        try:
            source = _inspect.source(function)
        except (OSError, TypeError):
            return drifted(f"the source of {name} cannot be read, so its divisor cannot be checked")
        if DIVISOR not in source:
            return drifted(f"{name} no longer divides by {DIVISOR}")
        if RESCALE in source:
            return drifted(f"{name} already rescales by {RESCALE} (upstream's fix)")
    return found()


_runs = WeakIdentityMap()  # trainer.state of a run -> {fix id: [training calls, rescaled]}


def compute_loss(wrapped, instance, args, kwargs):
    loss = wrapped(*args, **kwargs)
    if getattr(instance, "loss_type", None) not in WINDOW_LOSSES or not instance.model.training:
        return loss
    generation = instance.args.steps_per_generation
    window = instance.current_gradient_accumulation_steps
    counts = _counts(instance, wrapped)
    if counts is not None:
        counts[0] += 1
    if generation == window:
        return loss  # upstream is right here: its own tensor, untouched
    if counts is not None:
        counts[1] += 1
    return loss * (generation / window)


def _counts(trainer, wrapped):
    """This run's counts for the entry whose _compute_loss ran (TRL's own or the GSPO-token copy), or None."""
    fix_id = GSPO_TOKEN_FIX_ID if ".gspo_token." in f"{getattr(wrapped, '__module__', '')}." else FIX_ID
    try:
        runs = _runs.get(trainer.state)
        if runs is None:
            runs = _runs[trainer.state] = {}
    except TypeError:  # a state that cannot be kept beside: not reported per run
        return None
    return runs.setdefault(fix_id, [0, 0])


def acted_in(fix_id: str, trainer_state) -> str | None:
    """What this entry did in the run whose ``trainer.state`` this is (the Trainer's log), or None where TRL's own
    ``_compute_loss`` never ran with a window-normalised loss type there (a framework's override, another loss)."""
    try:
        counts = (_runs.get(trainer_state) or {}).get(fix_id)
    except TypeError:
        return None
    if not counts:
        return None
    calls, rescaled = counts
    return (f"TRL's own _compute_loss ran; zerofix rescaled {rescaled} of its first {calls} training losses "
            "(steps_per_generation differs from the window)" if rescaled else
            f"TRL's own _compute_loss ran {calls} times with steps_per_generation equal to the window: upstream's "
            "tensors, untouched")
