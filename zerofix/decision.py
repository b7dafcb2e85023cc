"""What the Trainer entry does to one backward, decided in one place (issue 58, item 5). Plain code, no torch.

The entry (``zerofix.fixes.trainer_scaling``) reads a step and hands this module what it read:

- the *verdict*: what the loss does with ``num_items_in_batch`` (``zerofix.num_items_watch``: divided by it,
  independent of it, unknown), and the Python factor a divided loss carries;
- *statements*: the user's (``zerofix.loss_is_scaled_for_ga``, ``ZEROFIX_LOSS_IS_SCALED_FOR_GA``) and the ones the
  Trainer, TRL or the model make with their own attributes (``stated``);
- the loss's *last scalings*: the constants its last operations multiply it by (``loss / 4`` is ``0.25``).

``decide`` turns them into a ``scaling.Plan``. One rule is written here and nowhere else:

**A value that equals the accumulation steps is a coincidence, not a statement.** Three readings are coincidences:

- ``ALREADY_DIVIDED``: a loss independent of the count whose last operation divides it by exactly
  ``gradient_accumulation_steps`` (or the window's length), read through the Trainer's own multiplication by the
  number of processes. It is what a user who divides a micro-batch mean by GAS writes (ms-swift's RLHF trainers); it
  is also the average of GAS micro-batch-mean terms, ``(a + b + c + d) / 4``, which is a mean.
- ``CARRIES_STEPS``: a loss divided by the count and multiplied by exactly GAS: a hand fix of transformers 5.2 -
  5.5.3's second division, or a loss weight that happens to equal GAS.
- ``DIVIDED_BY_STEPS``: a loss divided by the count and by exactly GAS: the count already covers the window, so a
  second division makes the update 1/GAS of the window's mean (or it is a loss weight of 1/GAS).

Such a reading may hold back a change zerofix would otherwise make; it never moves an update away from upstream's.
Where reading it as the user's word would give another plan than the measurement alone, the plan is upstream's (no
change) and one WARNING (``coincidence_message``) says what was read, what each reading would make of the update
and the statement that decides. ``DIVIDED_BY_STEPS`` changes nothing and is said. Only statements move an update on
an ambiguous loss; on an unknown verdict nobody stated, the plan is upstream's (``scaling.acts_on``).

Tests: tests/test_decision.py.
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from zerofix import scaling

ALREADY_DIVIDED = "already divided"
CARRIES_STEPS = "carries the steps"
DIVIDED_BY_STEPS = "divided by the steps"
DIVIDED, INDEPENDENT, UNKNOWN = "divided", "independent", "unknown"  # num_items_watch's states (no torch import)
STATEMENT = "ZEROFIX_LOSS_IS_SCALED_FOR_GA"
_CLOSE = 1e-6  # a constant equal to 1/GAS up to the rounding of ``1 / gas`` written by hand


class Evidence(NamedTuple):
    """What was read of one step's loss."""

    verdict: str | None  # DIVIDED, INDEPENDENT, UNKNOWN; None: no count was handed
    stated: bool = False  # the Trainer, TRL or the model said, rather than the Trainer guessed, what the loss is
    statement: bool | None = None  # the user's statement: True per window, False a micro-batch mean
    factor: Fraction | None = None  # for DIVIDED: the Python factor of count ** -1 (num_items_watch.Verdict.factor)
    scalings: tuple = ()  # the constants the loss's last operations multiply it by, the last one first
    handed: bool = False  # zerofix handed the count to a head the Trainer never hands it (issue 47)


class Engine(NamedTuple):
    """What divides after the Trainer: accelerate's ``backward`` or DeepSpeed's ``scale_wrt_gas``."""

    base_ran: bool  # the base Trainer.compute_loss ran (so its multiplication by the processes did)
    deepspeed: bool
    scale_wrt_gas: bool
    accelerate_steps: int


class Decision(NamedTuple):
    call: scaling.Call  # what the loss is (measured or stated) and what the path does to it
    plan: scaling.Plan  # what the entry changes
    coincidence: str | None = None  # ALREADY_DIVIDED, CARRIES_STEPS, DIVIDED_BY_STEPS, or None
    measured: scaling.Plan = scaling.Plan()  # the plan from the verdict and the statements alone
    as_read: scaling.Plan | None = None  # the plan if the coincidence were the user's word

    @property
    def held(self) -> bool:
        """The coincidence and the measurement disagree: the plan is upstream's, and a WARNING says so."""
        return self.as_read is not None and self.as_read != self.measured


def own_statement(evidence: Evidence) -> bool | None:
    """The statement a step is scaled by: the user's; for a step zerofix handed the count whose loss is not divided by
    it, "a micro-batch mean" (what the Trainer would have taken it for, had zerofix not handed the count)."""
    if evidence.handed and evidence.verdict != DIVIDED:
        return False
    return evidence.statement


def coincidence(version, facts: scaling.TrainerFacts, evidence: Evidence, *, base_ran: bool) -> str | None:
    """Which coincidence the loss shows (module docstring), or None. Nothing is read where anyone stated what the loss
    is, on a single-step window, or on an unknown verdict."""
    if evidence.stated or evidence.statement is not None or evidence.handed or facts.gas <= 1:
        return None
    world = scaling.world_multiplier(version, facts) if base_ran else 1
    if evidence.verdict == DIVIDED and evidence.factor is not None:
        own = Fraction(evidence.factor) / world  # the Trainer's own multiplication is not the user's factor
        if own == facts.gas:
            return CARRIES_STEPS
        if own == Fraction(1, facts.gas):
            return DIVIDED_BY_STEPS
        return None
    if evidence.verdict != INDEPENDENT or scaling.trainer_division(version, facts) != 1:
        return None  # (where the Trainer divides itself, its division is the last operation and reads the same)
    scalings = list(evidence.scalings)
    if world != 1 and scalings and _equal(scalings[0], world):
        scalings = scalings[1:]  # through the Trainer's ``loss *= num_processes``
    elif scalings and _equal(scalings[0], 1.0):
        scalings = scalings[1:]  # ``loss *= 1``: one process
    steps = {facts.gas, facts.window}
    return ALREADY_DIVIDED if scalings and any(_equal(scalings[0], 1.0 / s) for s in steps) else None


def _equal(value: float, wanted: float) -> bool:
    return abs(value - wanted) <= _CLOSE * abs(wanted)


def decide(version, facts: scaling.TrainerFacts, evidence: Evidence, engine: Engine) -> Decision:
    """The plan for one backward (module docstring)."""
    statement = own_statement(evidence)
    found = coincidence(version, facts, evidence, base_ran=engine.base_ran)
    call = _call(version, facts, evidence, engine, statement, carried=1)
    measured = _plan(call, facts, evidence, statement)
    if found not in (ALREADY_DIVIDED, CARRIES_STEPS):
        return Decision(call, measured, found, measured)
    read_statement = True if found == ALREADY_DIVIDED else statement
    read_call = _call(version, facts, evidence, engine, read_statement,
                      carried=facts.gas if found == CARRIES_STEPS else 1)
    as_read = scaling.plan(read_call)
    return Decision(call, measured if as_read == measured else scaling.Plan(), found, measured, as_read)


def _call(version, facts, evidence: Evidence, engine: Engine, statement, *, carried: int) -> scaling.Call:
    return scaling.call_of(version, facts, verdict=evidence.verdict, stated=evidence.stated, statement=statement,
                           base_ran=engine.base_ran, deepspeed=engine.deepspeed, scale_wrt_gas=engine.scale_wrt_gas,
                           accelerate_steps=engine.accelerate_steps, carried=carried)


def _plan(call: scaling.Call, facts: scaling.TrainerFacts, evidence: Evidence, statement) -> scaling.Plan:
    acts = scaling.acts_on(evidence.verdict, stated=evidence.stated, statement=statement, num_items=facts.num_items)
    return scaling.plan(call) if acts else scaling.Plan()


def update_factor(call: scaling.Call, plan: scaling.Plan) -> Fraction:
    """What ``plan`` makes of the update, relative to upstream's (the path with no change): 1 for no change."""
    downstream = call.downstream if plan.no_downstream_division else 1
    return Fraction(plan.multiply_by, plan.divide_by) * downstream


_READ = {ALREADY_DIVIDED: "is independent of num_items_in_batch and its last operation divides it by "
                          "gradient_accumulation_steps ({gas})",
         CARRIES_STEPS: "is divided by num_items_in_batch and multiplied by gradient_accumulation_steps ({gas})",
         DIVIDED_BY_STEPS: "is divided by num_items_in_batch and by gradient_accumulation_steps ({gas})"}


def reading(found: str, gas: int) -> str:
    """What the loss showed, in words (the runtime details' ``scaled_for_ga`` and the WARNING)."""
    return _READ[found].format(gas=gas)


def _becomes(factor: Fraction) -> str:
    return "it stays this one" if factor == 1 else f"it becomes {float(factor):g}x this one"


def coincidence_message(decision: Decision, gas: int) -> str:
    """The one WARNING of a run whose loss shows a coincidence (after "zerofix: <Trainer>'s loss "): what was read,
    that the update is upstream's, what each reading would make of it, and the statement that decides."""
    found = decision.coincidence
    said = reading(found, gas)
    if found == DIVIDED_BY_STEPS:
        return (f"{said}: the count already covers the accumulation window, so the update is 1/{gas} of the window's "
                f"mean{' (as upstream makes it)' if not decision.plan.changes else ''}. For the window's mean, remove "
                f"the division by gradient_accumulation_steps; if 1/{gas} is a loss weight, say so with {STATEMENT}=1 "
                "and this warning goes")
    measured = update_factor(decision.call, decision.measured)
    as_read = update_factor(decision.call, decision.as_read)
    if found == ALREADY_DIVIDED:
        return (f"{said}. That division may be yours for gradient accumulation (the loss already per window) or part "
                f"of a mean (an average of {gas} terms, a loss weight); {gas} is a coincidence zerofix does not act on, "
                f"so the update is the Trainer's own. Say which: {STATEMENT}=1 (or zerofix.loss_is_scaled_for_ga("
                f"trainer)) if the division is for accumulation ({_becomes(as_read)}), "
                f"{STATEMENT}=0 (zerofix.loss_is_scaled_for_ga(trainer, False)) if the loss is a micro-batch mean "
                f"({_becomes(measured)})")
    return (f"{said}. The factor may be a hand fix of a second division by the accumulation steps (transformers 5.2.0 "
            f"- 5.5.3) or a loss weight; {gas} is a coincidence zerofix does not act on, so the update is the Trainer's "
            f"own. If it is a hand fix, remove it: zerofix divides exactly once where a release divides twice (the "
            f"update: {_becomes(as_read).removeprefix('it ')}); if it is a loss weight, say so with {STATEMENT}=1 (or "
            f"zerofix.loss_is_scaled_for_ga(trainer)) and this warning goes ({_becomes(measured)})")


# Whose word a trainer's ``model_accepts_loss_kwargs = False`` is (issue 67). A flag the framework's own code sets is a
# known bug of that framework's releases where its own later release or an upstream issue or PR says so: a catalogue
# entry for those releases records it (zerofix.framework_flags), and the count is handed as the fixed release hands it.
# A flag set by the user's own script or Trainer subclass stays the user's word and is followed; so does one the
# framework set where a subclass from outside it runs its own ``__init__`` around the framework's (it may set the flag
# too, and the two cannot be told apart): followed, and said.
FRAMEWORK_BUG = "a framework's known bug"
UNCLEAR = "the framework's, or a subclass's around it"


def framework_word(flag) -> str | None:
    """``FRAMEWORK_BUG``, ``UNCLEAR`` or None (no framework entry recorded the flag: the trainer's own, or the user's)
    for a ``zerofix.framework_flags.FrameworkFlag`` (or None)."""
    if flag is None:
        return None
    return UNCLEAR if flag.around else FRAMEWORK_BUG


# Losses whose normaliser is the local batch by their library's own definition: a right usage, so never changed; with
# gradient accumulation or several processes the update averages micro-batch means, which is said once a run.
# TRL's GRPO "bnpo" (its docs: normalised over the local batch, results vary with the local batch size; ms-swift's GRPO
# takes the same loss type) divides each micro-batch's token sum by that micro-batch's completion tokens, where "dapo"
# takes the window's (issue 60).
LOCAL_BATCH_LOSSES = {"bnpo": ("each micro-batch's completion tokens on each process", "dapo")}


def local_batch_message(loss_type, gas: int, processes: int) -> str | None:
    """What to say once a run of a loss type normalised over the local batch by definition (after "zerofix: <Trainer>
    "), where accumulation or processes make that differ from the window's normalisation; None elsewhere."""
    known = LOCAL_BATCH_LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    if known is None or (gas <= 1 and processes <= 1):
        return None
    over, window = known
    return (f"uses loss_type={loss_type!r}, which its library defines as normalised by {over}: with "
            f"gradient_accumulation_steps={gas} over {processes} process(es) the update averages {gas * processes} "
            f"micro-batch token means, which differs from one mean over the window's tokens wherever micro-batches "
            f"count different numbers of tokens. That is the documented loss, and zerofix leaves it as it is; "
            f"loss_type={window!r} normalises by the window's tokens")
