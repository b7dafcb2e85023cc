"""The shared micro-step counter, without any distributed run: the step() decisions of every loop style."""
from __future__ import annotations

import pytest

from zerofix.counter import FLUSH, FOLLOW, LAZY, PASS, STEP, MicroStepCounter

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


def drive(calls, *, gas=1, explicit=None, may_take_over=None, modes=None, api=None):
    """Replay a loop: 'b' = backward, 's' = step(), 'r' = a gradient read that reduces a lazy window,
    'z' = zero_grad(). DeepSpeed's schedule is simulated like the engine: boundary when (micro_steps + 1) %
    gas == 0, micro_steps advancing once per step(). ``may_take_over`` defaults to what the fix decides for
    ZeRO-1/2 >= 0.17.6 (config GAS=1 only). ``explicit``: function of the backward index giving the flag the
    loop sets (None: none). ``api``: function of the backward index telling whether it runs inside no_sync()
    / coalesce_grad_reduction(). ``modes``: a list that receives each backward's (mode, carry). Returns the
    counter, the step plans and, per step(), whether it was ambiguous."""
    counter = MicroStepCounter(gas == 1 if may_take_over is None else may_take_over)
    micro_steps, plans, backwards, flag, ambiguous = 0, [], 0, None, []
    for call in calls:
        if call == "r":
            if counter.needs_read_flush():
                counter.flushed_for_read()
        elif call == "z":
            counter.zero_grad()
        elif call == "b":
            if explicit is not None:
                flag = explicit(backwards)
            plan = counter.plan_backward(explicit_boundary=flag, upstream_api=bool(api and api(backwards)))
            if modes is not None:
                modes.append(tuple(plan))
            schedule = (micro_steps + 1) % gas == 0
            boundary = flag if flag is not None else plan.mode == FOLLOW and schedule
            counter.backward(explicit_boundary=flag, mode=plan.mode, boundary=boundary)
            backwards += 1
        else:
            schedule = flag is None and (micro_steps + 1) % gas == 0
            ambiguous.append(counter.ambiguous_step(explicit_boundary=flag, schedule_boundary=schedule))
            plan = counter.plan_step(explicit_boundary=flag, schedule_boundary=schedule)
            plans.append(plan)
            counter.stepped(plan)
            micro_steps += 1
    drive.ambiguous = ambiguous
    return counter, plans


def test_manual_accumulation_flushes_once_per_window():
    counter, plans = drive("bbbbs" * 2)
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 4), (FLUSH, 4)]
    assert (counter.windows, counter.flushes, counter.pending, counter.steps) == (2, 2, 0, 2)


def test_several_backwards_per_step_at_config_gas_above_one_are_followed_and_flagged_ambiguous():
    """Do no harm: at config GAS=4, "3 backwards then step()" is a manual loop whose step() DeepSpeed skips,
    or DeepSpeed's own style with 3 backwards per micro-batch. Counts cannot tell: follow, and say so."""
    modes = []
    counter, plans = drive("bbbs" * 4, gas=4, modes=modes)
    assert set(modes) == {(FOLLOW, False)}
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 0)] * 3 + [(PASS, 12)]
    assert drive.ambiguous == [True, True, True, False]  # the 4th step() is DeepSpeed's boundary
    assert (counter.windows, counter.flushes, counter.manual) == (1, 0, False)


def test_two_backwards_per_micro_batch_in_deepspeeds_own_style_keep_its_optimizer_steps():
    counter, plans = drive("bbs" * 8, gas=4)
    assert [p.micro_batches for p in plans] == [0, 0, 0, 8] * 2  # one update per 4 step() calls
    assert (counter.windows, counter.flushes) == (2, 0)


def test_deepspeed_style_is_followed_never_taken_over():
    """Do no harm: one backward per step() is DeepSpeed's own style; every backward and step() run as
    DeepSpeed schedules them, so nothing a user reads between them can differ."""
    modes = []
    counter, plans = drive("bs" * 8, gas=4, modes=modes)
    assert set(modes) == {(FOLLOW, False)}
    assert [p.action for p in plans] == [PASS] * 8
    assert [p.micro_batches for p in plans] == [0, 0, 0, 4] * 2
    assert not any(drive.ambiguous)
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
    counter, plans = drive("bbbbs" * 2, may_take_over=False, modes=modes)
    assert set(modes) == {(FOLLOW, False)}
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 4), (PASS, 4)]
    assert (counter.windows, counter.flushes, counter.manual) == (2, 0, False)
    assert not any(drive.ambiguous)


@pytest.mark.parametrize("loop, inside", [
    ("bbbbs", lambda i: True),  # coalesce_grad_reduction(): every backward of the window inside the block
    ("bbbbs", lambda i: i < 3),  # no_sync() for all but the last backward (DeepSpeed's no_sync recipe)
    ("bbbbs", lambda i: i > 0),  # the window's first backward before the block: still the user's window
])
def test_a_window_through_no_sync_or_coalesce_is_the_users(loop, inside):
    modes = []
    counter, plans = drive(loop * 2, modes=modes, api=lambda i: inside(i % 4))
    assert set(modes) == {(FOLLOW, False)}
    assert [(p.action, p.micro_batches) for p in plans] == [(PASS, 4), (PASS, 4)]
    assert (counter.flushes, counter.manual) == (0, False)


def test_no_sync_windows_separated_by_zero_grad_are_followed():
    """DeepSpeed's test_multiple_ctxts: two no_sync windows, zero_grad between, no step()."""
    modes = []
    counter, _ = drive("bbbb" + "z" + "bbbb", modes=modes, api=lambda i: True)
    assert set(modes) == {(FOLLOW, False)}
    assert (counter.pending, counter.zero_grads, counter.manual) == (4, 1, False)


def test_zero_grad_starts_a_new_window_that_must_show_two_backwards_again():
    modes = []
    counter, plans = drive("bbbbs" + "bbz" + "bs" + "bbs", modes=modes)
    assert modes[4:6] == [(LAZY, False), (LAZY, False)]  # a manual engine: lazy from the window's start
    assert modes[6] == (FOLLOW, False)  # after zero_grad(): DeepSpeed's boundary, as without zerofix
    assert modes[7:] == [(FOLLOW, False), (LAZY, True)]
    assert [(p.action, p.micro_batches) for p in plans] == [(FLUSH, 4), (PASS, 1), (FLUSH, 2)]
    assert counter.zero_grads == 1


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
    assert not any(drive.ambiguous)


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


def test_step_without_backward_has_nothing_to_close():
    counter, plans = drive("s", gas=1)
    assert plans[0].action == PASS and plans[0].micro_batches == 0
    assert counter.windows == 0


def test_counter_is_plain_python():
    import subprocess
    import sys

    code = "import sys, zerofix.counter; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
