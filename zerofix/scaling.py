"""Divide exactly once, by what the loss is: the Trainer's gradient-accumulation scaling as plain code.

Along Trainer.compute_loss -> Trainer.training_step -> Accelerator.backward (-> engine.backward) the value
``compute_loss`` returns must reach the gradient divided by the right amount:

- a loss normalised by ``num_items_in_batch`` (a sum over the window's counted items divided by their
  number, multiplied by the number of processes when the count is across devices) is already per window:
  nothing may divide it again;
- any other loss is a mean over its micro-batch: it must be divided by the number of micro-batches in
  the window, and not multiplied by the number of processes.

Which of the two a loss is, the Trainer guesses from the forward's signature (``**kwargs``); zerofix
measures it (``zerofix.fixes.trainer_scaling``: did computing the loss read ``num_items_in_batch``?) or
takes it from an explicit statement. What each release does along the path is read off its source, one
function per place that multiplies or divides (``trainer_division``, ``world_multiplier``, and what accelerate
or the engine divides by afterwards); ``plan`` compares the product with what the loss needs and says what to
change, and nothing where they agree. This module knows nothing
about patching and needs no distributed run to test (tests/test_scaling.py).
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple


class TrainerFacts(NamedTuple):
    """What a release's Trainer reads when it scales one micro-batch's loss."""

    accepts_loss_kwargs: bool  # trainer.model_accepts_loss_kwargs (the Trainer's guess, or a statement)
    compute_loss_func: bool  # trainer.compute_loss_func is not None
    num_items: bool  # num_items_in_batch is not None
    average_tokens: bool  # args.average_tokens_across_devices
    loss_is_scaled_for_ga: bool | None  # the statement of transformers >= 5.19 (None: not stated)
    processes: int  # accelerator.num_processes
    gas: int  # args.gradient_accumulation_steps
    window: int  # micro-batches in this window (current_gradient_accumulation_steps)


def _at_least(version: tuple[int, ...], *floor: int) -> bool:
    return tuple(version[:len(floor)]) >= floor


def trainer_believes_scaled(version: tuple[int, ...], f: TrainerFacts) -> bool:
    """Whether training_step treats the loss as already per window (and skips its own division)."""
    if not _at_least(version, 4, 48):  # 4.46-4.47 never divide; the loss kwargs decide what it is meant to be
        return f.accepts_loss_kwargs and f.num_items
    if _at_least(version, 5, 19) and f.loss_is_scaled_for_ga is not None:
        return f.loss_is_scaled_for_ga
    if not _at_least(version, 4, 54):  # 4.48-4.53: no num_items condition
        return f.accepts_loss_kwargs or f.compute_loss_func
    return (f.accepts_loss_kwargs and f.num_items) or f.compute_loss_func


def trainer_division(version: tuple[int, ...], f: TrainerFacts) -> int:
    """What training_step divides the loss by before Accelerator.backward."""
    if not _at_least(version, 4, 48) or trainer_believes_scaled(version, f):
        return 1
    return f.window if _at_least(version, 4, 55) else f.gas  # current_gradient_accumulation_steps from 4.55


def world_multiplier(version: tuple[int, ...], f: TrainerFacts) -> int:
    """What Trainer.compute_loss multiplies the loss by (average_tokens_across_devices)."""
    if not f.average_tokens:
        return 1
    if not _at_least(version, 4, 49):  # 4.46-4.48
        return f.processes if f.accepts_loss_kwargs else 1
    return f.processes if (f.accepts_loss_kwargs or f.compute_loss_func) and f.num_items else 1


class Call(NamedTuple):
    """One backward of a Trainer step: what the loss is, and what the path does to it."""

    loss_is_mean: bool  # a micro-batch mean (measured or stated), not normalised by num_items_in_batch
    world_multiplied: int  # what compute_loss multiplied it by (1 when the base compute_loss did not run)
    trainer_divided: int  # what training_step divided it by
    window: int  # micro-batches in this window
    downstream: int  # what accelerate (no DeepSpeed) or the engine (scale_wrt_gas) divides by afterwards
    carried: int = 1  # a factor the loss carries beyond what it is (a hand fix's ``* gas``): the path divides it out


def call_of(version: tuple[int, ...], facts: TrainerFacts, *, verdict: str | None, stated: bool,
            base_ran: bool, deepspeed: bool, scale_wrt_gas: bool, accelerate_steps: int,
            statement: bool | None = None, carried: int = 1) -> Call:
    """The Call of one backward. ``verdict``: what the loss does with the count (``zerofix.num_items_watch``:
    "divided", "independent" or "unknown"; None: none yet); ``stated``: someone said, rather than the Trainer
    guessed, what the loss is; ``base_ran``: the base Trainer.compute_loss ran; ``accelerate_steps``: what
    accelerate divides by without DeepSpeed (one process, DDP, FSDP1, FSDP2: the same ``Accelerator.backward``);
    ``statement``: the user's own (``zerofix.loss_is_scaled_for_ga``): True, the loss is per window already; it wins
    over everything; ``carried``: a factor the loss carries beyond what it is, which the path must divide out (a loss
    divided by the count and multiplied by the accumulation steps by hand). An unknown verdict is never acted on: the
    caller follows upstream (``acts_on``)."""
    believed = trainer_believes_scaled(version, facts)
    # The measurement only demotes: a loss the Trainer believes per window that is independent of the count is a
    # mean, and so is one that got no count (a batch without ``labels``: what the Trainer itself concludes from
    # 4.54 on; 4.46-4.53 skip the division anyway). A loss the Trainer divides is left to the Trainer.
    mean = not believed or (not stated and (not facts.num_items or verdict == "independent"))
    if statement is not None:
        mean = not statement
    downstream = (facts.gas if scale_wrt_gas else 1) if deepspeed else accelerate_steps
    return Call(loss_is_mean=mean,
                world_multiplied=world_multiplier(version, facts) if base_ran else 1,
                trainer_divided=trainer_division(version, facts),
                window=facts.window, downstream=downstream, carried=carried)


def acts_on(verdict: str | None, *, stated: bool, statement: bool | None, num_items: bool) -> bool:
    """Whether a plan may change this backward: always where someone stated what the loss is, or where no count was
    handed (nothing can have normalised the loss); otherwise only on a decided verdict (divided or independent),
    never on an unknown one."""
    return stated or statement is not None or not num_items or verdict in ("divided", "independent")


class Plan(NamedTuple):
    multiply_by: int = 1  # applied to the loss before Accelerator.backward
    divide_by: int = 1
    no_downstream_division: bool = False  # accelerate divides by 1 / engine.backward(scale_wrt_gas=False)

    @property
    def changes(self) -> bool:
        return self != Plan()


def needed(call: Call) -> Fraction:
    """The factor the loss reaching Accelerator.backward must still be multiplied by (1: right as it is)."""
    wanted = Fraction(call.world_multiplied * call.window) if call.loss_is_mean else Fraction(1)
    wanted *= call.carried
    done = Fraction(call.trainer_divided * call.downstream)
    return done / wanted


def plan(call: Call) -> Plan:
    """What to change so the path divides exactly once: nothing where it already does. A division after
    backward that must not happen is switched off (what upstream's own fixes do: accelerate's num_steps=1,
    scale_wrt_gas=False) rather than compensated; the rest is an integer factor on the loss."""
    factor = needed(call)
    if factor == 1:
        return Plan()
    off = call.downstream > 1 and factor.numerator % call.downstream == 0
    if off:
        factor /= call.downstream
    return Plan(factor.numerator, factor.denominator, off)


NEEDED, UPSTREAM = "needed", "upstream"  # what applied_factor compares with


def applied_factor(call: Call, step: Plan, against: str = NEEDED) -> Fraction:
    """The total the path multiplies compute_loss's value by, with ``step`` carried out, relative to what the loss
    needs (``NEEDED``: 1 means exactly right; the tests hold every case against it) or to upstream's own path
    (``UPSTREAM``: the path with no change, 1 for no change: what the decision's words say an update becomes)."""
    downstream = 1 if step.no_downstream_division else call.downstream
    total = Fraction(step.multiply_by, step.divide_by) / (call.trainer_divided * downstream)
    if against == UPSTREAM:
        return total * (call.trainer_divided * call.downstream)
    wanted = Fraction(1, call.world_multiplied * call.window) if call.loss_is_mean else Fraction(1)
    return total / wanted * call.carried
