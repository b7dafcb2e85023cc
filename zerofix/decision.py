"""What the Trainer entry does, decided in one place (issues 58 and 68). Plain code, no torch.

The entry (``zerofix.fixes.trainer_scaling``) reads the trainer, the model and each step, and asks one
``zerofix.trainer_decision.TrainerDecision`` per trainer run, once per event, what to do; that object holds the run's
state and applies the rules below, which are plain functions of what was read. The words are
``zerofix.trainer_words``.

The rules written here and nowhere else:

- **Who stated what the loss is** (``stated``): the user (``zerofix.loss_is_scaled_for_ga``, ``ZEROFIX_LOSS_IS_SCALED_FOR_GA``,
  the API winning), the Trainer (``loss_is_scaled_for_ga``, transformers >= 5.19), TRL (a non-callable
  ``compute_loss_func``), the model's class (``accepts_loss_kwargs``), or a trainer's ``model_accepts_loss_kwargs`` set
  against its model's signature; zerofix's own handing is nobody's word.
- **A value that equals the accumulation steps is a coincidence, not a statement.** Three readings are coincidences:
  ``ALREADY_DIVIDED`` (a loss independent of the count whose last operation divides it by exactly
  ``gradient_accumulation_steps`` or the window's length, read through the Trainer's own multiplication by the number of
  processes: ms-swift's RLHF form, and also the average of GAS mean terms), ``CARRIES_STEPS`` (a loss divided by the
  count and multiplied by exactly GAS: a hand fix of transformers 5.2 - 5.5.3's second division, or a loss weight; a
  Python number or a one-element tensor alike, ``zerofix.num_items_watch.constant_value``), ``DIVIDED_BY_STEPS`` (a loss
  divided by the count and by exactly GAS). Such a reading may hold back a change zerofix would otherwise make; it never
  moves an update away from upstream's. Only statements move an update on an ambiguous loss; on an unknown verdict
  nobody stated, the plan is upstream's (``scaling.acts_on``).
- **A framework's flag is not the user's word** where the framework's later release or an upstream issue or PR calls
  it a bug (``framework_word``, issue 67).
- **The count zerofix hands stays only where the loss is divided by it**: a handed step whose loss is not runs again as
  the Trainer runs it, and nothing more is handed in the run.

Tests: tests/test_decision.py (the rules, and the run's object through its public methods).
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from zerofix import scaling, trainer_words as words

ALREADY_DIVIDED = "already divided"
CARRIES_STEPS = "carries the steps"
DIVIDED_BY_STEPS = "divided by the steps"
DIVIDED, INDEPENDENT, UNKNOWN = "divided", "independent", "unknown"  # num_items_watch's states (no torch import)
STATEMENT = words.STATEMENT
_CLOSE = 1e-6  # a constant equal to 1/GAS up to the rounding of ``1 / gas`` written by hand


class Evidence(NamedTuple):
    """What was read of one step's loss."""

    verdict: str | None  # DIVIDED, INDEPENDENT, UNKNOWN; None: no count was handed
    stated: bool = False  # the Trainer, TRL or the model said, rather than the Trainer guessed, what the loss is
    statement: bool | None = None  # the user's statement: True per window, False a micro-batch mean
    factor: Fraction | None = None  # for DIVIDED: the constant factor of count ** -1 (num_items_watch.Verdict.factor)
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


# ------------------------------------------------------------------------------------------------ the plain rules
def own_statement(evidence: Evidence) -> bool | None:
    """The statement a step is scaled by: the user's; for a step zerofix handed the count whose loss is not divided by
    it, "a micro-batch mean" (what the Trainer would have taken it for, had zerofix not handed the count)."""
    if evidence.handed and evidence.verdict != DIVIDED:
        return False
    return evidence.statement


def coincidence(version, facts: scaling.TrainerFacts, evidence: Evidence, *, base_ran: bool) -> str | None:
    """Which coincidence the loss shows (module docstring), or None. Nothing is read where anyone stated what the loss
    is, on a single-step window, or on an unknown verdict."""
    if not reads_coincidences(evidence.stated, evidence.statement, evidence.handed) or facts.gas <= 1:
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


def reads_coincidences(stated: bool, statement: bool | None, handed: bool) -> bool:
    """Whether a loss's factors are read at all: only where nobody stated what it is and zerofix handed no count."""
    return not stated and statement is None and not handed


def _equal(value: float, wanted: float) -> bool:
    return abs(value - wanted) <= _CLOSE * abs(wanted)


def decide(version, facts: scaling.TrainerFacts, evidence: Evidence, engine: Engine) -> Decision:
    """The plan for one backward (module docstring)."""
    statement = own_statement(evidence)
    shown = coincidence(version, facts, evidence, base_ran=engine.base_ran)
    call = _call(version, facts, evidence, engine, statement, carried=1)
    measured = _plan(call, facts, evidence, statement)
    if shown not in (ALREADY_DIVIDED, CARRIES_STEPS):
        return Decision(call, measured, shown, measured)
    read_statement = True if shown == ALREADY_DIVIDED else statement
    read_call = _call(version, facts, evidence, engine, read_statement,
                      carried=facts.gas if shown == CARRIES_STEPS else 1)
    as_read = scaling.plan(read_call)
    return Decision(call, measured if as_read == measured else scaling.Plan(), shown, measured, as_read)


def _call(version, facts, evidence: Evidence, engine: Engine, statement, *, carried: int) -> scaling.Call:
    return scaling.call_of(version, facts, verdict=evidence.verdict, stated=evidence.stated, statement=statement,
                           base_ran=engine.base_ran, deepspeed=engine.deepspeed, scale_wrt_gas=engine.scale_wrt_gas,
                           accelerate_steps=engine.accelerate_steps, carried=carried)


def _plan(call: scaling.Call, facts: scaling.TrainerFacts, evidence: Evidence, statement) -> scaling.Plan:
    acts = scaling.acts_on(evidence.verdict, stated=evidence.stated, statement=statement, num_items=facts.num_items)
    return scaling.plan(call) if acts else scaling.Plan()


def coincidence_message(decided: Decision, gas: int) -> str:
    """The one WARNING of a run whose loss shows a coincidence (after "zerofix: <Trainer>'s loss ")."""
    as_read = decided.as_read if decided.as_read is not None else decided.plan
    return words.coincidence(decided.coincidence, gas, changes=decided.plan.changes,
                             measured=scaling.applied_factor(decided.call, decided.measured, against=scaling.UPSTREAM),
                             as_read=scaling.applied_factor(decided.call, as_read, against=scaling.UPSTREAM))


class StatementFacts(NamedTuple):
    """What a trainer and its model say of the loss by their own attributes (read once a run)."""

    trainer_statement: bool  # trainer.loss_is_scaled_for_ga is not None (transformers >= 5.19, TRL's trainers)
    loss_func_marker: bool  # a compute_loss_func that is not callable: TRL's marker for it before 5.19
    loss_func: bool  # a compute_loss_func at all
    model_declares: bool  # the model's class has ``accepts_loss_kwargs``: its author said
    accepts: bool  # trainer.model_accepts_loss_kwargs
    guess: bool  # what the release's Trainer.__init__ would guess for it from the model


def stated(facts: StatementFacts, *, user: bool, head_handed: bool) -> bool:
    """Whether someone said, rather than the Trainer guessed, whether the loss is per window: the user, the Trainer,
    TRL's marker, the model's class, or a trainer's flag set against its model's signature (while zerofix hands the
    count, the flag is zerofix's, nobody's word)."""
    if user or facts.trainer_statement or facts.loss_func_marker:
        return True
    if not facts.loss_func and facts.model_declares:
        return True
    return (facts.accepts and not head_handed) != facts.guess


FRAMEWORK_BUG = "a framework's known bug"
UNCLEAR = "the framework's, or a subclass's around it"


def framework_word(flag) -> str | None:
    """Whose word a trainer's ``model_accepts_loss_kwargs = False`` is (issue 67), from a
    ``zerofix.framework_flags.FrameworkFlag`` (or None): ``FRAMEWORK_BUG`` where the framework's own ``__init__`` set it
    on a release a catalogue entry names (the count is handed as the fixed release hands it); ``UNCLEAR`` where a
    subclass from outside the framework runs its own ``__init__`` around the framework's (it may set the flag too, and
    the two cannot be told apart: followed, and said); None where no framework entry recorded the flag (the trainer's
    own, or the user's: followed)."""
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
    return words.local_batch(loss_type, gas, processes, *known)


class RunFacts(NamedTuple):
    """What the entry read of a trainer and its model at a run's start (``trainer_scaling.reading.run_facts``)."""

    covered: bool  # the run's path is one the entry models (zerofix.paths)
    compiled: bool  # a compiled model or compute_loss_func: the count cannot be watched
    loss_func: bool  # a compute_loss_func
    smoother_takes_count: bool  # no label smoother, or one that takes num_items_in_batch (5.24's)
    trainer_statement: bool  # trainer.loss_is_scaled_for_ga is not None
    flagged: str | None  # the model class that says accepts_loss_kwargs = False while its forward takes **kwargs
    withheld: str | None  # the model class a trainer's own flag withholds the count from (its forward takes **kwargs)
    framework: object = None  # zerofix.framework_flags.FrameworkFlag of the trainer, or None
    framework_fix: object = None  # its catalogue entry (zerofix.catalogue.Fix), or None
    hand_count: bool = False  # ZEROFIX_HAND_COUNT_TO_MODEL=1
    local_batch: tuple | None = None  # (loss_type, what it is said as) for a loss normalised over the local batch


def handed_head(facts: RunFacts, user_statement) -> str | None:
    """The model class zerofix has the Trainer hand the count to although the Trainer withholds it (issue 47), or None:
    a head whose class says ``accepts_loss_kwargs = False``, or one a trainer's own flag withholds it from where the user
    says that flag is not theirs (``ZEROFIX_HAND_COUNT_TO_MODEL=1``, issue 60) or a framework's release has it as a
    known bug (issue 67); never where anybody's word decides the count (a ``compute_loss_func``, a statement, a label
    smoother that takes no count). Whether the loss is divided by the count is each step's verdict."""
    if facts.loss_func or not facts.smoother_takes_count or facts.trainer_statement or user_statement is not None:
        return None
    if facts.flagged:
        return facts.flagged
    if facts.withheld and (facts.hand_count or framework_word(facts.framework) == FRAMEWORK_BUG):
        return facts.withheld
    return None
