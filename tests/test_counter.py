"""The shared micro-step counter, without any distributed run: the step() decisions of every loop style."""
from __future__ import annotations

import pytest

from zerofix.counter import FLUSH, FOLLOW, LAZY, PASS, STEP, MicroStepCounter


def drive(calls, *, gas=1, explicit=None, upstream_accumulates=False, modes=None):
    """Replay a loop: 'b' = backward, 's' = step(), 'r' = a gradient read that reduces a lazy window.
    DeepSpeed's schedule is simulated like the engine: boundary when (micro_steps + 1) % gas == 0,
    micro_steps advancing once per step(). ``explicit``: function of the backward index giving the flag
    the loop sets (None: none). ``modes``: a list that receives each backward's (mode, carry)."""
    counter, micro_steps, plans, backwards = MicroStepCounter(upstream_accumulates), 0, [], 0
    flag = None
    for call in calls:
        if call == "r":
            if counter.needs_read_flush():
                counter.flushed_for_read()
        elif call == "b":
            if explicit is not None:
                flag = explicit(backwards)
            plan = counter.plan_backward(explicit_boundary=flag)
            if modes is not None:
                modes.append(tuple(plan))
            schedule = (micro_steps + 1) % gas == 0
            boundary = flag if flag is not None else plan.mode == FOLLOW and schedule
            counter.backward(explicit_boundary=flag, mode=plan.mode, boundary=boundary, divisor=gas)
            backwards += 1
        else:
            plan = counter.plan_step(explicit_boundary=flag,
                                     schedule_boundary=(micro_steps + 1) % gas == 0)
            plans.append(plan)
            counter.stepped(plan)
            micro_steps += 1
    return counter, plans


def test_manual_accumulation_flushes_once_per_window():
    counter, plans = drive("bbbbs" * 2)
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 4), (FLUSH, 4)]
    assert (counter.windows, counter.flushes, counter.pending, counter.steps) == (2, 2, 0, 2)


def test_manual_accumulation_with_config_gas_does_not_wait_for_deepspeeds_count():
    _, plans = drive("bbbs" * 2, gas=4)  # DeepSpeed alone would not step before 4 step() calls
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 3), (FLUSH, 3)]


def test_deepspeed_style_is_followed_never_taken_over():
    """Do no harm: one backward per step() is DeepSpeed's own style; every backward and step() run as
    DeepSpeed schedules them, so nothing a user reads between them can differ."""
    modes = []
    counter, plans = drive("bs" * 8, gas=4, modes=modes)
    assert set(modes) == {(FOLLOW, False)}
    assert [p.action for p in plans] == [PASS] * 8
    assert [p.micro_batches for p in plans] == [0, 0, 0, 4] * 2
    assert (counter.windows, counter.flushes, counter.manual) == (2, 0, False)


def test_deepspeed_style_gas1_closes_a_window_per_step_without_zerofix():
    counter, plans = drive("bs" * 3, gas=1)
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 1)] * 3
    assert (counter.windows, counter.flushes) == (3, 0)


def test_manual_accumulation_is_taken_over_from_the_second_backward():
    """The first backward cannot know what follows: it runs as DeepSpeed schedules it (a boundary at
    config GAS=1), and the next lazy backward carries what that boundary reduced into the flush."""
    modes = []
    counter, plans = drive("bbbbs" * 2, modes=modes)
    assert modes == [(FOLLOW, False), (LAZY, True), (LAZY, False), (LAZY, False)] + [(LAZY, False)] * 4
    assert counter.manual


def test_stages_that_accumulate_by_themselves_are_followed():
    """ZeRO-0/3 at config GAS=1 apply several backwards per step() correctly: no takeover."""
    modes = []
    counter, plans = drive("bbbbs" * 2, upstream_accumulates=True, modes=modes)
    assert set(modes) == {(FOLLOW, False)}
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 4), (PASS, 4)]
    assert (counter.windows, counter.flushes, counter.manual) == (2, 0, False)


def test_a_read_reduces_the_window_and_step_only_steps():
    counter, plans = drive("bbbbs" + "bbbbrs")
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 4), (STEP, 4)]
    assert (counter.read_flushes, counter.flushes, counter.pending) == (1, 2, 0)


def test_backwards_after_a_read_carry_what_it_reduced():
    modes = []
    counter, plans = drive("bbs" + "brbrbbrs", modes=modes)
    assert modes[2:] == [(LAZY, False), (LAZY, True), (LAZY, True), (LAZY, False)]
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 2), (STEP, 4)]


def test_a_read_with_nothing_lazy_pending_does_nothing():
    counter, plans = drive("bsrbs", gas=4)  # DeepSpeed's style: nothing of zerofix's to reduce
    assert counter.read_flushes == 0 and not counter.manual


def test_explicit_boundaries_are_left_to_deepspeed():
    counter, plans = drive("bbbbs" * 2, explicit=lambda i: i % 4 == 3)
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 4), (PASS, 4)]
    assert (counter.windows, counter.flushes) == (2, 0)


def test_explicit_non_boundary_step_keeps_the_window_open():
    counter = MicroStepCounter()
    counter.backward(explicit_boundary=False, boundary=False)
    plan = counter.plan_step(explicit_boundary=False, schedule_boundary=True)
    counter.stepped(plan)
    assert (plan.action, plan.micro_batches, counter.pending, counter.windows) == (PASS, 0, 1, 0)


def test_a_backward_after_an_explicit_boundary_is_reported():
    counter = MicroStepCounter()
    assert counter.backward(explicit_boundary=True, boundary=True) is False
    assert counter.backward(explicit_boundary=True, boundary=True) is True  # the first one's gradients are gone
    counter.stepped(counter.plan_step(explicit_boundary=True, schedule_boundary=True))
    assert counter.backward(explicit_boundary=True, boundary=True) is False  # a new window


def test_mixed_styles_close_the_window_with_everything_pending():
    # GAS=4 schedule: backward+step (non-boundary), then two backwards and a step: 3 micro-batches.
    counter, plans = drive(["b", "s", "b", "b", "s"], gas=4)
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 0), (FLUSH, 3)]
    assert counter.pending == 0


def test_step_without_backward_has_nothing_to_close():
    counter, plans = drive("s", gas=1)
    assert plans[0].action == PASS and plans[0].micro_batches == 0
    assert counter.windows == 0


@pytest.mark.parametrize("divisors, window, expected", [
    ({4}, 3, 4),  # DeepSpeed divided by 4, the window has 3
    ({4}, 4, None),
    ({1}, 3, None),  # nothing divided: the user's own scaling
    ({1, 4}, 4, None),  # mixed scale_wrt_gas: no single claim to make
])
def test_scale_mismatch(divisors, window, expected):
    counter = MicroStepCounter()
    for d in divisors:
        counter.backward(explicit_boundary=None, divisor=d)
    assert counter.scale_mismatch(window) == expected


def test_counter_is_plain_python():
    import subprocess
    import sys

    code = "import sys, zerofix.counter; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
