"""zerofix.decision, the Trainer entry's one place of decision (issue 58, items 2 and 5), without a Trainer: the rows
of the issue's table as the facts the entry reads, and the rule that a value equal to the accumulation steps may hold
a change back but never make one. The same rows as real Trainer runs: tests/test_trainer_coincidences.py."""
from __future__ import annotations

from fractions import Fraction

import pytest

from zerofix import decision, scaling
from zerofix.decision import ALREADY_DIVIDED, CARRIES_STEPS, DIVIDED_BY_STEPS, Engine, Evidence

NEWEST, DOUBLE = (5, 24, 0), (5, 3, 0)  # 5.3: accelerate divides a second time (5.2.0 - 5.5.3)
GAS = 4


def facts(*, func=False, processes=1, accepts=True):
    return scaling.TrainerFacts(accepts_loss_kwargs=accepts, compute_loss_func=func, num_items=True,
                                average_tokens=True, loss_is_scaled_for_ga=None, processes=processes, gas=GAS,
                                window=GAS)


def engine(version, base_ran=True):
    """No DeepSpeed: accelerate divides by GAS on 5.3, the Trainer sets it to 1 elsewhere (Trainer.__init__)."""
    return Engine(base_ran=base_ran, deepspeed=False, scale_wrt_gas=True,
                  accelerate_steps=GAS if version == DOUBLE else 1)


def update(version, f, evidence, base_ran=True) -> tuple[decision.Decision, Fraction]:
    decided = decision.decide(version, f, evidence, engine(version, base_ran))
    return decided, scaling.applied_factor(decided.call, decided.plan, against=scaling.UPSTREAM)


@pytest.mark.parametrize("version", [NEWEST, DOUBLE])
@pytest.mark.parametrize("processes", [1, 2])
def test_a_mean_divided_by_the_steps_in_compute_loss_func_is_upstreams(version, processes):
    """ms-swift's RLHF form through a compute_loss_func: the token mean / GAS, then the Trainer's ``*= processes``.
    5.24: upstream right (1.0); the measurement alone would divide again. 5.3: upstream's second division (0.25); the
    reading as the user's word would undo it. Both: upstream's update, held (one WARNING)."""
    evidence = Evidence("independent", scalings=(float(processes), 1 / GAS))
    decided, factor = update(version, facts(func=True, processes=processes), evidence)
    assert decided.coincidence == ALREADY_DIVIDED and decided.held
    assert factor == 1 and not decided.plan.changes
    # what a coincidence held back: 5.24's missing division; on 2 processes also the Trainer's multiplication, which a
    # micro-batch mean must not get
    assert decided.measured.changes == (version == NEWEST or processes > 1)
    assert decided.as_read.changes == (version == DOUBLE)  # what it would have moved


@pytest.mark.parametrize("processes", [1, 2])
def test_a_loss_weight_equal_to_the_steps_is_not_a_hand_fix(processes):
    """``compute_loss_func`` returning ``4.0 * (s / n)`` at GAS 4 on 5.24: upstream right; read as a hand fix it would
    be divided by 4. The Trainer's own ``*= processes`` is not part of the user's factor."""
    evidence = Evidence("divided", factor=Fraction(GAS * processes))
    decided, factor = update(NEWEST, facts(func=True, processes=processes), evidence)
    assert decided.coincidence == CARRIES_STEPS and decided.held and factor == 1
    assert scaling.applied_factor(decided.call, decided.as_read, against=scaling.UPSTREAM) == Fraction(1, GAS)


def test_the_trainers_own_multiplication_is_no_coincidence():
    """A plain token sum over the count on 2 processes at GAS 2 carries the factor 2 only from the Trainer's
    ``*= num_processes``: nothing is read, the plan is the measurement's."""
    f = facts(processes=2)._replace(gas=2, window=2)
    decided = decision.decide(NEWEST, f, Evidence("divided", factor=Fraction(2)), engine(NEWEST))
    assert decided.coincidence is None and not decided.plan.changes


@pytest.mark.parametrize("version, upstream_right", [(NEWEST, False), (DOUBLE, True)])
def test_an_average_of_as_many_terms_as_steps_is_upstreams(version, upstream_right):
    """A compute_loss override returning ``(a + b + c + d) / 4`` of micro-batch means at GAS 4 (no base
    compute_loss): 5.3 right upstream (accelerate's division is the one a mean needs), 5.24 GAS x. Upstream's update
    either way: on 5.24 the measurement's change is held back, on 5.3 the reading's is never made."""
    evidence = Evidence("independent", scalings=(1 / GAS,))
    decided, factor = update(version, facts(), evidence, base_ran=False)
    assert decided.coincidence == ALREADY_DIVIDED and decided.held and factor == 1
    assert decided.measured.changes is not upstream_right


@pytest.mark.parametrize("version, zerofix", [(NEWEST, Fraction(1)), (DOUBLE, Fraction(GAS))])
def test_a_double_division_by_the_user_is_said_and_the_rest_unchanged(version, zerofix):
    """``s / n / GAS``: 5.24 upstream's 0.25 stays; 5.3's own second division (0.0625) is still undone (0.25)."""
    decided, factor = update(version, facts(func=True), Evidence("divided", factor=Fraction(1, GAS)))
    assert decided.coincidence == DIVIDED_BY_STEPS and not decided.held and factor == zerofix
    assert "count already covers" in decision.coincidence_message(decided, GAS)


def test_the_hand_fix_of_a_double_division_on_the_release_that_has_it_stays_right():
    """``s / n * GAS`` on 5.3 (what it was written for): upstream right, the measurement alone would undo the second
    division (GAS x): held, upstream's update."""
    decided, factor = update(DOUBLE, facts(), Evidence("divided", factor=Fraction(GAS)))
    assert decided.coincidence == CARRIES_STEPS and decided.held and factor == 1
    assert scaling.applied_factor(decided.call, decided.measured, against=scaling.UPSTREAM) == GAS


@pytest.mark.parametrize("statement", [True, False])
def test_a_statement_decides_and_nothing_is_read(statement):
    """A statement (the API, the environment) decides: no coincidence is read, the plan follows it."""
    evidence = Evidence("independent", statement=statement, scalings=(1.0, 1 / GAS))
    decided, factor = update(NEWEST, facts(func=True), evidence)
    assert decided.coincidence is None and factor == (1 if statement else Fraction(1, GAS))
    stated = Evidence("independent", stated=True, scalings=(1.0, 1 / GAS))
    assert decision.decide(NEWEST, facts(func=True), stated, engine(NEWEST)).coincidence is None


def test_what_is_not_a_coincidence():
    """Another divisor, a division the Trainer makes itself, an unknown verdict, one accumulation step."""
    no_kwargs = facts(accepts=False)  # the Trainer divides a loss without loss kwargs itself
    assert decision.coincidence(NEWEST, facts(), Evidence("independent", scalings=(1 / 3,)), base_ran=False) is None
    assert decision.coincidence(NEWEST, no_kwargs, Evidence("independent", scalings=(1 / GAS,)), base_ran=False) is None
    assert decision.coincidence(NEWEST, facts(), Evidence("unknown", scalings=(1 / GAS,)), base_ran=False) is None
    single = facts()._replace(gas=1, window=1)
    assert decision.coincidence(NEWEST, single, Evidence("independent", scalings=(1.0,)), base_ran=False) is None
    # a measured mean with no coincidence: the plan is the measurement's (5.24: divided by the window)
    decided, factor = update(NEWEST, facts(func=True), Evidence("independent", scalings=()))
    assert decided.coincidence is None and factor == Fraction(1, GAS)


@pytest.mark.parametrize("found, version", [(ALREADY_DIVIDED, NEWEST), (ALREADY_DIVIDED, DOUBLE),
                                            (CARRIES_STEPS, NEWEST), (CARRIES_STEPS, DOUBLE)])
def test_the_warning_names_both_readings_and_the_statement(found, version):
    evidence = (Evidence("independent", scalings=(1.0, 1 / GAS)) if found == ALREADY_DIVIDED
                else Evidence("divided", factor=Fraction(GAS)))
    decided, _ = update(version, facts(func=True), evidence)
    said = decision.coincidence_message(decided, GAS)
    assert "coincidence" in said and "the update is the Trainer's own" in said and decision.STATEMENT in said
    as_read = scaling.applied_factor(decided.call, decided.as_read, against=scaling.UPSTREAM)
    assert ("stays this one" if as_read == 1 else f"becomes {float(as_read):g}x this one") in said


def test_a_loss_defined_over_the_local_batch_is_said_never_changed():
    """Issue 60, item 3: TRL's GRPO ``bnpo`` normalises each micro-batch by its own tokens by definition: said where
    accumulation or processes make that a mean of micro-batch means, nowhere else; ``dapo`` is not such a loss."""
    said = decision.local_batch_message("bnpo", 4, 1)
    assert "averages 4 micro-batch token means" in said and "loss_type='dapo'" in said and "leaves it" in said
    assert "averages 4 micro-batch" in decision.local_batch_message("bnpo", 2, 2)
    assert decision.local_batch_message("bnpo", 1, 1) is None and decision.local_batch_message("dapo", 4, 2) is None
    assert decision.local_batch_message(None, 4, 1) is None
