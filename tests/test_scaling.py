"""The scaling rule (zerofix.scaling) without a Trainer: every release x every kind of loss x with and
without DeepSpeed, checked by what the whole path multiplies compute_loss's value by, against what the loss
needs (``applied_factor`` 1.0 = exactly right).

The release rules are read off each release's source (trainer.py of 4.46.3, 4.48.3, 4.49.0, 4.52.4, 4.54.0,
4.55.0, 4.57.1, 5.0.0, 5.3.0, 5.18.0, 5.19.0, 5.23.0); the unpatched factors below are the measured ones
(tests/test_trainer_scaling.py shows each with a real Trainer). The plan must make every case exact and
must change nothing where the path is already right."""
from __future__ import annotations

import pytest

from zerofix.scaling import acts_on, Plan, TrainerFacts, applied_factor, call_of, plan, trainer_believes_scaled

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

GAS = 4
RELEASES = [(4, 46, 3), (4, 48, 3), (4, 52, 4), (4, 54, 0), (4, 57, 1), (5, 0, 0), (5, 3, 0), (5, 5, 4), (5, 23, 0)]
# What the loss is and who computes it: (takes loss kwargs, compute_loss_func, reads num_items, base
# compute_loss runs). "seq-cls": a head taking **kwargs whose loss is a plain mean (Llama/BERT classifiers).
LOSSES = {
    "causal-lm": (True, False, True, True),
    "nokw": (False, False, False, True),
    "seq-cls": (True, False, False, True),
    "subclass-mean": (True, False, False, False),  # compute_loss override returning its mean, no super()
    "func-mean": (True, True, False, True),  # compute_loss_func returning the micro-batch mean
}


def accelerate_steps(version) -> int:
    """transformers 5.2.0 - 5.5.3 build the Accelerator with num_steps=GAS (#45349): accelerate divides."""
    return GAS if (5, 2) <= version[:2] and version < (5, 5, 4) else 1


def call(version, loss, *, deepspeed=False, processes=1, window=GAS, average_tokens=None, stated=False):
    kw, func, reads, base = LOSSES[loss]
    if average_tokens is None:  # the default: False up to 4.48, True from 4.49 (measured releases: 4.57)
        average_tokens = version >= (4, 49)
    # the count: 4.46 computes it only for a model taking loss kwargs; later releases also for a loss function
    num_items = kw or (func and version >= (4, 48))
    facts = TrainerFacts(accepts_loss_kwargs=kw, compute_loss_func=func, num_items=num_items,
                         average_tokens=average_tokens, loss_is_scaled_for_ga=None, processes=processes, gas=GAS,
                         window=window)
    verdict = ("divided" if reads else "independent") if num_items else None
    return call_of(version, facts, verdict=verdict, stated=stated, base_ran=base,
                   deepspeed=deepspeed, scale_wrt_gas=version < (4, 49), accelerate_steps=accelerate_steps(version))


def unpatched(c) -> float:
    return float(applied_factor(c, Plan()))


CASES = [(v, loss, ds, n) for v in RELEASES for loss in LOSSES for ds in (False, True) for n in (1, 2)]
IDS = [f"{'.'.join(map(str, v))}-{loss}-{'ds' if ds else 'nods'}-{n}proc" for v, loss, ds, n in CASES]


@pytest.mark.parametrize("version, loss, deepspeed, processes", CASES, ids=IDS)
def test_the_plan_makes_every_path_exact(version, loss, deepspeed, processes):
    c = call(version, loss, deepspeed=deepspeed, processes=processes)
    assert applied_factor(c, plan(c)) == 1, (c, plan(c))


@pytest.mark.parametrize("version, loss, deepspeed, processes", CASES, ids=IDS)
def test_a_path_that_is_right_is_left_alone(version, loss, deepspeed, processes):
    c = call(version, loss, deepspeed=deepspeed, processes=processes)
    if unpatched(c) == 1:
        assert plan(c) == Plan(), (c, plan(c))


# Measured unpatched, update / reference (the tables and tests/test_trainer_scaling.py), GAS=4.
MEASURED = {
    ((4, 46, 3), "nokw", False, 1): GAS, ((4, 46, 3), "nokw", True, 1): 1,
    ((4, 46, 3), "causal-lm", True, 1): 1 / GAS, ((4, 46, 3), "seq-cls", False, 1): GAS,
    ((4, 48, 3), "causal-lm", True, 1): 1 / GAS, ((4, 48, 3), "nokw", True, 1): 1 / GAS,
    ((4, 48, 3), "subclass-mean", True, 2): 1, ((4, 48, 3), "func-mean", True, 2): 1,
    ((4, 57, 1), "seq-cls", False, 1): GAS,
    ((5, 0, 0), "seq-cls", False, 1): GAS,
    ((5, 3, 0), "seq-cls", False, 1): 1, ((5, 3, 0), "seq-cls", False, 2): 2,
    ((5, 3, 0), "subclass-mean", False, 1): 1, ((5, 3, 0), "func-mean", False, 2): 2,
    ((5, 3, 0), "causal-lm", False, 1): 1 / GAS, ((5, 3, 0), "causal-lm", True, 2): 1,
    ((5, 23, 0), "seq-cls", False, 1): GAS, ((5, 23, 0), "seq-cls", False, 2): 2 * GAS,
    ((5, 23, 0), "seq-cls", True, 2): 2 * GAS, ((5, 23, 0), "subclass-mean", False, 2): GAS,
    ((5, 23, 0), "func-mean", False, 2): 2 * GAS, ((5, 23, 0), "causal-lm", True, 2): 1,
}


@pytest.mark.parametrize("case", MEASURED, ids=[f"{'.'.join(map(str, k[0]))}-{k[1]}-{'ds' if k[2] else 'nods'}-{k[3]}"
                                               for k in MEASURED])
def test_the_rules_reproduce_the_measured_unpatched_factors(case):
    version, loss, deepspeed, processes = case
    assert unpatched(call(version, loss, deepspeed=deepspeed, processes=processes)) == MEASURED[case]


def test_a_short_window_is_divided_by_its_real_length():
    """GAS=4, a last window of 2 micro-batches: a mean loss on 5.23 is divided by 2, on 5.3 (accelerate
    divides by GAS) it is put right too."""
    for version in ((5, 23, 0), (5, 3, 0)):
        c = call(version, "seq-cls", window=2)
        assert applied_factor(c, plan(c)) == 1, version


def test_a_statement_is_followed_not_measured():
    """A trainer whose author stated the loss is per window (loss_is_scaled_for_ga=True, TRL's trainers) is not
    demoted to a mean even though its loss never read num_items_in_batch."""
    c = call((5, 23, 0), "subclass-mean", stated=True)
    assert not c.loss_is_mean and plan(c) == Plan()


def test_the_measurement_never_turns_a_mean_into_a_normalised_loss():
    """A loss the Trainer divides (it believes a mean) stays divided even if it read the count (a metric)."""
    facts = TrainerFacts(False, False, True, True, None, 2, GAS, GAS)
    c = call_of((5, 23, 0), facts, verdict="divided", stated=False, base_ran=True, deepspeed=False,
                scale_wrt_gas=False, accelerate_steps=1)
    assert c.loss_is_mean and plan(c) == Plan()


def test_loss_is_scaled_for_ga_is_read_from_5_19():
    facts = TrainerFacts(True, False, True, True, False, 1, GAS, GAS)
    assert trainer_believes_scaled((5, 18, 0), facts) and not trainer_believes_scaled((5, 19, 0), facts)


def test_a_loss_that_got_no_count_is_a_mean_on_every_release():
    """A batch without ``labels`` (question answering: start/end positions) gets no num_items_in_batch; 4.48 - 4.53
    still believe a loss-kwargs model's loss normalised and skip the division (tools/head_survey.py: Llama's QA
    head, 4.48.3, 4x); from 4.54 the Trainer divides such a loss itself, and zerofix does the same before."""
    facts = TrainerFacts(True, False, False, False, None, 1, GAS, GAS)
    for version in ((4, 48, 3), (4, 52, 4)):
        c = call_of(version, facts, verdict=None, stated=False, base_ran=True, deepspeed=False,
                    scale_wrt_gas=True, accelerate_steps=1)
        assert c.loss_is_mean and unpatched(c) == GAS and applied_factor(c, plan(c)) == 1
    c = call_of((5, 23, 0), facts, verdict=None, stated=False, base_ran=True, deepspeed=False,
                scale_wrt_gas=False, accelerate_steps=1)
    assert unpatched(c) == 1 and plan(c) == Plan()
    # stated per window: followed
    c = call_of((4, 48, 3), facts, verdict=None, stated=True, base_ran=True, deepspeed=False,
                scale_wrt_gas=True, accelerate_steps=1)
    assert not c.loss_is_mean and plan(c) == Plan()


def test_an_unknown_verdict_is_never_acted_on_unless_someone_said_what_the_loss_is():
    """Issue 46: the count left the watch (a Python number, TorchScript, ...) or touched the loss without dividing it:
    upstream's path, whatever the plan would be; a statement, or a step without a count, still decides."""
    assert not acts_on("unknown", stated=False, statement=None, num_items=True)
    assert acts_on("divided", stated=False, statement=None, num_items=True)
    assert acts_on("independent", stated=False, statement=None, num_items=True)
    assert acts_on("unknown", stated=True, statement=None, num_items=True)
    assert acts_on("unknown", stated=False, statement=False, num_items=True)
    assert acts_on(None, stated=False, statement=None, num_items=False)
    # an unknown loss is not demoted to a mean: the Trainer's belief stands in the Call
    facts = TrainerFacts(True, False, True, True, None, 1, GAS, GAS)
    c = call_of((5, 23, 0), facts, verdict="unknown", stated=False, base_ran=True, deepspeed=False,
                scale_wrt_gas=False, accelerate_steps=1)
    assert not c.loss_is_mean
