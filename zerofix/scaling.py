"""Divide exactly once: the gradient-accumulation scaling rule of a Trainer step, as plain code.

Along Trainer.training_step -> Accelerator.backward -> (DeepSpeedEngineWrapper.backward ->
engine.backward) the loss of one micro-batch must end up divided by the number of micro-batches in its
accumulation window exactly once, or not at all when it is already a mean over the window's counted
tokens (the model received ``num_items_in_batch``). Depending on the transformers release, zero or two
of those places divide. This module decides, for one backward, what zerofix does about it; it knows
nothing about patching and needs no distributed run to test (tests/test_scaling.py).

The facts of a call (``Call``) come from the release (read off the catalogue's version ranges) and from
the Trainer (does the model take loss kwargs, did it get ``num_items_in_batch``, how long is the
window); the corrections (``Corrections``) are the catalogue entries that are applied. ``plan`` returns
what to do: divide the loss by the window, tell DeepSpeed not to divide, make accelerate divide by 1.
``divisions`` counts what the whole path then divides by, which is what the tests hold against 1.
"""
from __future__ import annotations

from typing import NamedTuple


class Call(NamedTuple):
    """One backward of a Trainer step, as the release and the Trainer shape it."""

    deepspeed: bool  # the accelerator runs DeepSpeed (engine.backward scales unless scale_wrt_gas=False)
    token_normalised: bool  # the model took num_items_in_batch: the loss is a mean over the window's tokens
    trainer_divides: bool  # the release's training_step divides this loss by the window length itself
    nokw_undivided: bool  # the release leaves this loss (a model without loss kwargs) undivided: 4.46-4.47
    window: int  # micro-batches in this accumulation window (the last of an epoch may be shorter)
    gas: int  # the configured gradient_accumulation_steps: what DeepSpeed and accelerate divide by
    accelerate_divides: bool  # the Trainer built its Accelerator with num_steps=GAS (5.2.0-5.5.3)
    scale_wrt_gas: bool  # what the Trainer passes to engine.backward (False from 4.49)


class Corrections(NamedTuple):
    """The applied catalogue entries of the Trainer's scaling (their ids in zerofix.catalogue)."""

    nokw_undivided: bool = False  # transformers-nokw-undivided
    deepspeed_double_division: bool = False  # transformers-deepspeed-double-division
    accelerate_double_division: bool = False  # transformers-accelerate-double-division


class Plan(NamedTuple):
    divide_by: int  # zerofix divides the loss by this before accelerate sees it (1: nothing)
    scale_wrt_gas: bool | None  # None: leave the call's; False: DeepSpeed must not divide
    accelerate_divisor_one: bool  # accelerate divides by 1 for this call


def plan(call: Call, fixes: Corrections) -> Plan:
    divide_by = 1
    normalised = call.token_normalised or call.trainer_divides
    engine_divides_alone = call.deepspeed and call.scale_wrt_gas and not fixes.deepspeed_double_division
    if fixes.nokw_undivided and call.nokw_undivided and not normalised and not engine_divides_alone:
        # transformers #35207 (4.48) divides by GAS; the window's real length is what the mean needs.
        # Not when DeepSpeed will divide and nothing tells it not to: its division is then the only one.
        divide_by, normalised = call.window, True
    scale_wrt_gas = None
    if fixes.deepspeed_double_division and call.deepspeed and normalised and call.scale_wrt_gas:
        # transformers #35808 (4.49): the loss is already per window, the engine must not divide again.
        # Left alone for a loss nobody divided (a model without loss kwargs on 4.46-4.47 with the nokw
        # entry excluded): there DeepSpeed's division is the only one, and correct.
        scale_wrt_gas = False
    accelerate_one = fixes.accelerate_double_division and not call.deepspeed and call.accelerate_divides
    return Plan(divide_by, scale_wrt_gas, accelerate_one)


def divisions(call: Call, step: Plan) -> float:
    """What the whole path divides the model's loss by, with ``step`` applied, relative to what it should
    divide by: 1.0 means exactly right (for a token-normalised loss the right divisor is 1)."""
    total = step.divide_by
    if call.trainer_divides:
        total *= call.window  # current_gradient_accumulation_steps (4.48 divides by GAS: no short windows)
    if call.deepspeed:
        scale = call.scale_wrt_gas if step.scale_wrt_gas is None else step.scale_wrt_gas
        if scale:
            total *= call.gas
    elif call.accelerate_divides and not step.accelerate_divisor_one:
        total *= call.gas
    wanted = 1 if call.token_normalised else call.window
    return total / wanted
