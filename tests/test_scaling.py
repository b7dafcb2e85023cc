"""The scaling rule (zerofix.scaling) without a Trainer: every release behaviour x every combination of
applied corrections, checked by counting what the whole path divides the loss by.

The release behaviours are the measured ones (tests/test_trainer_scaling.py shows each with a real
Trainer); the rule must make each of them divide exactly once, and must never break a path that was
right, whichever subset of the three entries is applied."""
from __future__ import annotations

import itertools

import pytest

from zerofix.scaling import Call, Corrections, plan, divisions

GAS = 8
# What each release hands Accelerator.backward, per model kind: (token_normalised, trainer_divides,
# nokw_undivided, accelerate_divides, scale_wrt_gas). "kw": a model taking loss kwargs; "nokw": without.
RELEASES = {
    "4.46-4.47": {"kw": (True, False, False, False, True), "nokw": (False, False, True, False, True)},
    "4.48": {"kw": (True, False, False, False, True), "nokw": (False, True, False, False, True)},
    "4.49-5.1": {"kw": (True, False, False, False, False), "nokw": (False, True, False, False, False)},
    "5.2-5.5.3": {"kw": (True, False, False, True, False), "nokw": (False, True, False, True, False)},
}
# The entries in range per release (what zerofix applies by default).
IN_RANGE = {"4.46-4.47": Corrections(True, True, False), "4.48": Corrections(False, True, False),
            "4.49-5.1": Corrections(), "5.2-5.5.3": Corrections(False, False, True)}
# Measured unpatched (relative to right): docs/fixes.md and the Trainer tests.
UNPATCHED = {
    ("4.46-4.47", "kw", False): 1.0, ("4.46-4.47", "nokw", False): 1 / GAS,
    ("4.46-4.47", "kw", True): GAS, ("4.46-4.47", "nokw", True): 1.0,
    ("4.48", "kw", False): 1.0, ("4.48", "nokw", False): 1.0, ("4.48", "kw", True): GAS, ("4.48", "nokw", True): GAS,
    ("5.2-5.5.3", "kw", False): GAS, ("5.2-5.5.3", "nokw", False): GAS,
}


def call(release, model, deepspeed, window=GAS):
    token, divides, undivided, accel, scale = RELEASES[release][model]
    # Accelerate divides only without DeepSpeed; with DeepSpeed the engine does (unless scale_wrt_gas=False).
    return Call(deepspeed=deepspeed, token_normalised=token, trainer_divides=divides, nokw_undivided=undivided,
                window=window, gas=GAS, accelerate_divides=accel and not deepspeed, scale_wrt_gas=scale)


CASES = [(r, m, ds) for r in RELEASES for m in ("kw", "nokw") for ds in (False, True)]


@pytest.mark.parametrize("release, model, deepspeed", CASES)
def test_unpatched_divisions_are_the_measured_ones(release, model, deepspeed):
    got = divisions(call(release, model, deepspeed), plan(call(release, model, deepspeed), Corrections()))
    assert got == UNPATCHED.get((release, model, deepspeed), 1.0)


@pytest.mark.parametrize("release, model, deepspeed", CASES)
def test_the_entries_in_range_divide_exactly_once(release, model, deepspeed):
    c = call(release, model, deepspeed)
    assert divisions(c, plan(c, IN_RANGE[release])) == 1.0


@pytest.mark.parametrize("release, model, deepspeed", CASES)
def test_no_subset_of_entries_breaks_a_path_that_was_right(release, model, deepspeed):
    """A user may exclude entries (ZEROFIX=ids, patch(exclude=...)): each subset of the ones in range
    must leave a right path right and must not make a wrong path worse."""
    c = call(release, model, deepspeed)
    before = divisions(c, plan(c, Corrections()))
    in_range = IN_RANGE[release]
    for mask in itertools.product((False, True), repeat=3):
        subset = Corrections(*(on and wanted for on, wanted in zip(mask, in_range, strict=True)))
        after = divisions(c, plan(c, subset))
        assert after in (1.0, before), (subset, before, after)


def test_a_short_window_is_divided_by_its_real_length():
    """GAS=3, last window of 2 micro-batches, a model without loss kwargs on 4.46-4.47: divide by 2."""
    c = call("4.46-4.47", "nokw", False, window=2)._replace(gas=3)
    step = plan(c, IN_RANGE["4.46-4.47"])
    assert step.divide_by == 2 and divisions(c, step) == 1.0


def test_outside_the_trainer_nothing_is_planned():
    """Corrections off: the plan changes nothing (what a plain accelerate loop gets, as the wrapper
    does not even plan outside a Trainer step)."""
    c = call("4.48", "nokw", True)
    assert plan(c, Corrections()) == (1, None, False)
