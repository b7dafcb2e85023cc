"""The Trainer entry's decision object (issue 68), without a Trainer: each rule it holds, through its public methods,
from the facts the entry reads. The same rules as real Trainer runs: tests/test_trainer_scaling*.py,
test_micro_means.py, test_trainer_mean_of_means.py, test_trainer_coincidences.py."""
from __future__ import annotations

from fractions import Fraction

import pytest

from zerofix import decision, scaling
from zerofix.decision import Engine, RunFacts, StatementFacts
from zerofix.framework_flags import FrameworkFlag
from zerofix.trainer_decision import Reading, TrainerDecision

pytestmark = pytest.mark.stack_independent
NEWEST, DOUBLE = (5, 24, 0), (5, 3, 0)
GAS = 4


def run(version=NEWEST, **kw) -> TrainerDecision:
    return TrainerDecision(version, "MyTrainer", **kw)


def facts(**kw) -> RunFacts:
    base = dict(covered=True, compiled=False, loss_func=False, smoother_takes_count=True, trainer_statement=False,
                flagged=None, withheld=None)
    return RunFacts(**{**base, **kw})


def trainer_facts(processes=1, accepts=True, window=GAS, num_items=True) -> scaling.TrainerFacts:
    return scaling.TrainerFacts(accepts_loss_kwargs=accepts, compute_loss_func=False, num_items=num_items,
                                average_tokens=True, loss_is_scaled_for_ga=None, processes=processes, gas=GAS,
                                window=window)


def statement_facts(**kw) -> StatementFacts:
    base = dict(trainer_statement=False, loss_func_marker=False, loss_func=False, model_declares=False, accepts=True,
                guess=True)
    return StatementFacts(**{**base, **kw})


def reading(verdict="independent", *, factor=None, scalings=(), to_head=False, injected=None, own_loss=True,
            processes=1, base_ran=True, accelerate_steps=1, stated=None, means=None, compare=None, withheld=None,
            window=GAS) -> Reading:
    return Reading(verdict=verdict, route="a Python number" if verdict == "unknown" else "", factor=factor,
                   to_head=to_head, injected=injected, own_loss=own_loss, facts=trainer_facts(processes, window=window),
                   engine=Engine(base_ran, False, True, accelerate_steps), key=("k", window), at=1,
                   statement_facts=lambda: stated or statement_facts(), scalings=lambda: scalings,
                   means=means or (lambda: None), compare=compare or (lambda records: ("none", [])),
                   withheld=withheld or (lambda: None))


def said(answer_or_lines, level=None) -> list[str]:
    lines = answer_or_lines.said if hasattr(answer_or_lines, "said") else answer_or_lines
    return [s.text for s in lines if level is None or s.level == level]


# --- 1. the statements' guard: who may be handed the count (one rule, decision.handed_head)
@pytest.mark.parametrize("blocked", ["loss_func", "trainer_statement", "user", "smoother", "compiled", "not covered"])
def test_nobodys_word_is_the_only_case_where_a_withheld_head_is_handed_the_count(blocked):
    d = run(statement=False if blocked == "user" else None)
    f = facts(flagged="QwenVL", **{"loss_func": blocked == "loss_func", "trainer_statement": blocked == "trainer_statement",
                                   "smoother_takes_count": blocked != "smoother", "compiled": blocked == "compiled",
                                   "covered": blocked != "not covered"})
    d.start(f)
    assert d.handed_head is None
    assert run().start(facts(flagged="QwenVL")) and run().handed_head is None  # a fresh run hands nothing before start
    again = run()
    again.start(facts(flagged="QwenVL"))
    assert again.handed_head == "QwenVL"


def test_a_trainers_own_flag_is_handed_only_on_the_users_word_or_a_frameworks_known_bug():
    own = run()
    assert own.start(facts(withheld="LlamaForCausalLM")) == () and own.handed_head is None  # followed
    env = run()
    assert "says that is not your word" in said(env.start(facts(withheld="Llama", hand_count=True)))[0]
    assert env.handed_head == "Llama"
    fix = type("Fix", (), {"dist": "axolotl", "affected": ">=0.17.0,<0.20.0", "fixed_in": "0.20.0", "upstream": ("u",)})
    bug = run()
    line = said(bug.start(facts(withheld="Llama", framework=FrameworkFlag("axolotl-withheld-count", "AxolotlTrainer"
                                                                          ".__init__", "axolotl 0.19.0"),
                                framework_fix=fix)))[0]
    assert bug.handed_head == "Llama" and "a known bug of axolotl >=0.17.0,<0.20.0 (axolotl-withheld-count" in line
    assert bug.details["framework_flag"] == "axolotl-withheld-count"
    unclear = run()
    unclear.start(facts(withheld="Llama", framework=FrameworkFlag("x", "T.__init__", "axolotl 0.19.0", "Mine.__init__"),
                        framework_fix=fix))
    assert unclear.handed_head is None  # a subclass of the user's runs around the framework's __init__: followed


def test_a_flagged_head_whose_smoother_takes_no_count_is_said_not_handed():
    d = run()
    lines = d.start(facts(flagged="QwenVL", smoother_takes_count=False))
    assert d.handed_head is None and "this run smooths its labels" in said(lines, "warning")[0]


# --- 2. who counts as having stated what the loss is; 3. which statement wins
def test_who_counts_as_having_stated():
    assert not decision.stated(statement_facts(), user=False, head_handed=False)  # the Trainer's guess
    assert decision.stated(statement_facts(), user=True, head_handed=False)
    assert decision.stated(statement_facts(trainer_statement=True), user=False, head_handed=False)
    assert decision.stated(statement_facts(loss_func_marker=True, loss_func=True), user=False, head_handed=False)
    assert decision.stated(statement_facts(model_declares=True), user=False, head_handed=False)  # the model's author
    assert not decision.stated(statement_facts(model_declares=True, loss_func=True), user=False, head_handed=False)
    assert decision.stated(statement_facts(accepts=False), user=False, head_handed=False)  # set against the signature
    # while zerofix hands the count the flag is zerofix's: a flag False with the guess False is nobody's word
    assert not decision.stated(statement_facts(accepts=True, guess=False), user=False, head_handed=True)


def test_the_apis_statement_wins_over_the_environments_and_is_read_again():
    d = run(statement=None, env_statement=True)
    assert d.user_statement() is True
    d.restate(False)
    assert d.user_statement() is False and d.stated_cache is None and d.plans == {}


# --- 4. the dropped count; 12. a compiled model
def test_a_window_counted_for_a_handing_that_stopped_hands_the_trainer_no_count():
    d = run()
    d.start(facts(flagged="QwenVL"))
    assert d.count_window() is True
    plan = d.step(True, compiled=False)
    assert plan.to_head and plan.watch and not plan.drop_count and not plan.to_loss
    d.backward(reading("independent", to_head=True))  # handing stops
    assert d.handed_head is None
    assert d.step(True, compiled=False).drop_count  # the window was counted only for it
    assert d.count_window() is False and not d.step(True, compiled=False).drop_count  # the next window is the Trainer's


def test_a_compiled_model_is_neither_watched_nor_handed_and_stands_until_a_forward_shows_its_count():
    d = run()
    d.start(facts(flagged="QwenVL", compiled=True))
    assert d.handed_head is None and not d.step(True, compiled=True).watch
    d = run()
    plan = d.step(True, compiled=False)
    assert plan.to_loss  # armed until a step shows the forward hands its loss function the count itself
    d.stepped(plan, dropped=False)
    assert d.to_loss is False and not d.step(True, compiled=False).to_loss


# --- 5. the handed count, checked at every step
def test_a_handed_step_stays_only_where_its_loss_is_divided_by_the_count():
    d = run()
    d.start(facts(flagged="QwenVL"))
    kept = d.backward(reading("divided", factor=Fraction(1), to_head=True))
    assert not kept.redo and d.details["corrected"] == 1 and d.handed_head == "QwenVL"
    own = d.backward(reading("independent", to_head=True))
    assert own.redo and d.handed_head is None and "stopped at optimizer step 1" in d.details["count_handed"]
    assert said(own, "info") and not said(own, "warning")  # a head's own mean: upstream's, said at INFO
    d = run()
    d.start(facts(flagged="QwenVL"))
    unknown = d.backward(reading("unknown", to_head=True))
    assert unknown.redo and "cannot be told (a Python number)" in said(unknown, "warning")[0]


def test_a_loss_function_called_without_the_count_is_handed_it_while_its_loss_is_divided():
    d = run()
    first = d.backward(reading("divided", factor=Fraction(1), injected="VipLlava"))
    assert not first.redo and d.to_loss is True and "calls its loss function without it" in said(first, "info-main")[0]
    assert said(d.backward(reading("divided", factor=Fraction(1), injected="VipLlava"))) == []  # said once
    stop = d.backward(reading("independent", injected="VipLlava"))
    assert stop.redo and d.to_loss is False and "stopped at optimizer step 1" in d.details["count_to_loss"]
    # a trainer's compute_loss that changed the model's loss (a classifier's mean divided by GAS by hand): the count
    # handed would change what it relied on, so the step runs as the Trainer runs it (do no harm)
    d = run()
    changed = d.backward(reading("divided", factor=Fraction(1), injected="LlamaForSequenceClassification",
                                 own_loss=False))
    assert changed.redo and d.to_loss is False and "is not the model's own" in said(changed)[0]


# --- 6. the labels and whether to warn; 7. and 11. what a coincidence and an unknown verdict say
def test_an_unknown_verdict_follows_upstream_and_is_said_once_unless_stated():
    d = run()
    first = d.backward(reading("unknown"))
    assert not first.decided.plan.changes and "cannot be told: a Python number" in said(first, "warning")[0]
    assert said(d.backward(reading("unknown"))) == [] and d.details["loss"].startswith("unknown")
    assert d.details["steps_unknown"] == 2
    stated = run(statement=True)
    assert said(stated.backward(reading("unknown"))) == [] and stated.details["loss"] == "unknown"


def test_a_coincidence_that_would_move_the_update_is_held_and_said_at_the_first_windows_end():
    d = run(DOUBLE)  # 5.3: reading the division by GAS as the user's word would undo accelerate's second division
    answer = d.backward(reading("independent", scalings=(1.0, 1 / GAS), accelerate_steps=GAS, base_ran=False))
    assert answer.decided.coincidence == decision.ALREADY_DIVIDED and answer.decided.held
    assert not answer.decided.plan.changes and said(answer) == []  # held for the window's means
    assert d.held_coincidence and "coincidence: upstream followed" in d.details["warnings"]
    assert "a coincidence zerofix does not act on" in said(d.stop_means(), "warning")[0]


def test_a_coincidence_is_said_once_and_the_scalings_are_never_read_for_a_stated_loss():
    d = run()
    d.means = None  # not reading means
    carried = d.backward(reading("divided", factor=Fraction(GAS)))  # 5.24: a loss weight of GAS, or a hand fix
    assert carried.decided.coincidence == decision.CARRIES_STEPS and carried.decided.held
    assert "a coincidence zerofix does not act on" in said(carried, "warning")[0]
    assert "a coincidence, not a statement" in d.details["scaled_for_ga"]
    assert said(d.backward(reading("divided", factor=Fraction(GAS)))) == []  # once a run
    steps = run()
    steps.means = None
    answer = steps.backward(reading("divided", factor=Fraction(1, GAS)))
    assert "the count already covers the accumulation window" in said(answer, "warning")[0]
    # 10. the coincidence guard: the last scalings are read only for an independent loss nobody stated
    asked = []
    stated = run(statement=False)
    stated.backward(reading("independent")._replace(scalings=lambda: asked.append(1) or ()))
    assert asked == []


# --- the rescale of an unstated mean; 8. and 9. the window's micro-batch means
def test_an_unstated_mean_rescaled_is_held_for_the_means_and_said_alone_when_they_conclude_nothing():
    d = run()
    answer = d.backward(reading("independent", means=lambda: [("mean", 3)]))
    assert answer.decided.plan.changes and d.held_rescale is not None and said(answer) == []
    lines = []
    for _ in range(GAS - 1):  # the window's other micro-batches: every count the same
        lines += said(d.backward(reading("independent", means=lambda: [("mean", 3)],
                                         compare=lambda records: ("equal", []))))
    assert len(lines) == 1 and "zerofix scales it as a micro-batch mean" in lines[0] and d.means == []


@pytest.mark.parametrize("case", ["upstream", "rescaled-now", "rescaled-before", "stated"])
def test_what_a_micro_batch_mean_term_is_said_as(case):
    """The four words of a window whose means differ: upstream's scaling, zerofix's rescale held from the first window,
    a rescale said before (a later window), a statement's."""
    d = run(DOUBLE if case == "upstream" else NEWEST, statement=False if case == "stated" else None)
    differ = lambda records: ("differ", [("cross-entropy token mean", [3, 9, 3, 9])])  # noqa: E731
    windows = 1
    if case == "rescaled-before":  # the first window concludes nothing (its held rescale said alone), the second differs
        for _ in range(GAS):
            d.backward(reading("independent", compare=lambda records: ("equal", [])))
        windows = 2
    lines = []
    for _ in range(GAS):
        lines += said(d.backward(reading("independent", accelerate_steps=GAS if case == "upstream" else 1,
                                         compare=differ)), "warning")
    text = lines[-1]
    assert "(a cross-entropy token mean over 3, 9, 3, 9 elements in" in text
    assert ("the first window's" in text) == (windows == 1)
    if case == "upstream":
        assert "that mean of means stays as upstream computes it" in text
    elif case == "rescaled-now":
        assert "is independent of num_items_in_batch and averages a term" in text and "gave 4x that" in text
    elif case == "rescaled-before":
        assert "zerofix scales it as a micro-batch mean (said above)" in text
    else:
        assert "as stated by zerofix.loss_is_scaled_for_ga(trainer, False)" in text
    assert d.means is None and "micro-batch mean term: mean of micro-batch means" in d.details["warnings"]


def test_the_means_reading_stops_where_the_loss_takes_the_count_and_gives_up_after_its_windows(monkeypatch):
    from zerofix import trainer_decision

    d = run()
    d.backward(reading("divided", factor=Fraction(1)))
    assert d.means is None  # one process: a loss divided by the count ends the reading
    monkeypatch.setattr(trainer_decision, "MEANS_WINDOWS", 2)
    d = run()
    for _ in range(2 * GAS):
        d.backward(reading("independent", compare=lambda records: ("equal", [])))
    assert d.means is None and d.means_windows == 2


def test_a_withheld_count_names_the_flag_and_a_handed_own_mean_names_its_head():
    d = run(DOUBLE)
    for _ in range(GAS):
        lines = said(d.backward(reading("independent", accelerate_steps=GAS, withheld=lambda: "MyTrainer set "
                                        "model_accepts_loss_kwargs = False",
                                        compare=lambda r: ("differ", [("mean", [1, 2, 1, 2])]))), "warning")
    assert "(the Trainer hands the model no num_items_in_batch: MyTrainer set model_accepts_loss_kwargs = False" in \
        lines[0] and "say so with ZEROFIX_HAND_COUNT_TO_MODEL=1" in lines[0]
    d = run()
    d.start(facts(flagged="Gemma3"))
    d.backward(reading("independent", to_head=True))  # its own mean: handed once, the run upstream's from there
    assert said(d.own_mean_proven("Gemma3", None)) == [] and d.own_mean == ("Gemma3", False)
    for _ in range(GAS):
        lines = said(d.backward(reading("independent", compare=lambda r: ("differ", [("mean", [1, 2, 1, 2])]))))
    assert "(computed by Gemma3, which takes no count" in lines[-1] and "could not prove that mean" in lines[-1]
