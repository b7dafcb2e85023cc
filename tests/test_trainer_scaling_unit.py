"""transformers-trainer-scaling's wrappers without a Trainer run: what training_step hands on, when it watches,
and what it leaves alone (a compiled model, a count that is None). The real runs are test_trainer_scaling.py."""
from __future__ import annotations

import logging
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from zerofix import trainer_decision  # noqa: E402
from zerofix.fixes import trainer_scaling as fix  # noqa: E402


class FakeAccelerator:
    def __init__(self):
        self.num_processes, self.gradient_accumulation_steps = 1, 1
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.NO

    def unwrap_model(self, model):
        return model


class KwargsModel(torch.nn.Module):
    # **loss_kwargs: what 4.46-4.47 look for by name, and a **kwargs to 4.48 on (the Trainer then guesses "normalised")
    def forward(self, input_ids=None, labels=None, **loss_kwargs):
        return input_ids


def trainer(torch_compile=False):
    t = type("Trainer", (), {})()  # a class instance, weak-referenceable as a real Trainer is
    t.accelerator, t.model = FakeAccelerator(), KwargsModel()
    t.model_accepts_loss_kwargs, t.compute_loss_func = True, None
    t.args = types.SimpleNamespace(gradient_accumulation_steps=4, average_tokens_across_devices=True,
                                   torch_compile=torch_compile, n_gpu=1)
    t.state = types.SimpleNamespace()  # a new one at every train()
    return t


def run_step(t, count, loss_of=lambda n: torch.tensor(1.0)):
    """One Trainer step whose loss is ``loss_of(the count the Trainer hands on)``; what reached the engine."""
    seen, engine = [], []

    def step(model, inputs, num_items_in_batch):
        seen.append(num_items_in_batch)
        fix.backward(lambda loss: engine.append(loss), t.accelerator, (loss_of(num_items_in_batch),), {})
        return torch.tensor(0.0)

    fix.training_step(step, t, (t.model, {}, count), {})
    return seen[0], engine[0]


def test_every_step_hands_on_a_watched_count_and_the_engine_a_plain_loss():
    t, count = trainer(), torch.tensor(12)
    for _ in range(3):
        seen, loss = run_step(t, count, lambda n: torch.tensor(24.0) / n)
        assert type(seen) is not torch.Tensor and torch.equal(seen, count)  # watched, equal
        assert type(loss) is torch.Tensor and loss.item() == 2.0  # normalised: left to the Trainer
    assert fix.runtime_details()[-1]["loss"] == "divided by num_items_in_batch"


def test_the_verdict_is_each_steps_own():
    """Issue 40: a loss that reads the count only from step 2 on (step 1's verdict was kept before)."""
    t, count = trainer(), torch.tensor(12)
    _, first = run_step(t, count)  # a mean: divided by the window's 4 micro-batches
    _, second = run_step(t, count, lambda n: torch.tensor(24.0) / n)  # normalised: left as it is
    _, third = run_step(t, count)
    assert (first.item(), second.item(), third.item()) == (0.25, 2.0, 0.25)
    details = fix.runtime_details()[-1]
    assert (details["steps_divided"], details["steps_independent"]) == (1, 2)


def test_a_new_run_reads_the_trainers_facts_again():
    """Issue 40: train() again with another model (model_init): nothing read in the first run is kept."""
    t, count = trainer(), torch.tensor(12)
    run_step(t, count)
    assert fix.state_of(t).stated is False
    t.model_accepts_loss_kwargs = False  # the new model's guess differs from its signature: a statement
    t.state = types.SimpleNamespace()
    run_step(t, count)
    assert fix.state_of(t).stated is True


def test_an_int_count_is_watched_as_a_tensor_at_every_step():
    t = trainer()
    for _ in range(2):
        seen, _ = run_step(t, 12)
        assert isinstance(seen, torch.Tensor) and int(seen) == 12


def test_no_count_no_watch():
    t, seen = trainer(), []
    fix.training_step(lambda m, i, n: seen.append(n), t, (t.model, {}, None), {})
    assert seen == [None] and fix.state_of(t).verdict is None


def test_a_compiled_model_is_not_watched_and_upstream_is_followed(caplog):
    """Issue 46: the count handed to torch.compile cannot be followed: the verdict is unknown, upstream's path runs
    (here the Trainer's belief, normalised: nothing divided) and a WARNING names the route and the statement."""
    t, count = trainer(torch_compile=True), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        seen, loss = run_step(t, count)
    assert seen is count and fix.state_of(t).compiled and fix.state_of(t).verdict.state == "unknown"
    assert "torch.compile" in caplog.text and "zerofix.loss_is_scaled_for_ga(trainer" in caplog.text
    assert loss.item() == 1.0


def test_a_compiled_loss_function_is_not_watched_either():
    t, count = trainer(), torch.tensor(12)
    t.compute_loss_func = torch.compile(lambda outputs, labels, num_items_in_batch=None: outputs)
    seen, _ = run_step(t, count)
    assert seen is count and fix.state_of(t).verdict.state == "unknown"


def test_an_unknown_verdict_follows_upstream_and_says_so_once(caplog):
    """Issue 46: a loss divided by ``n.item()`` looks like a mean that read the count as a number: upstream (here
    nothing divided), one WARNING naming the route; the same loss stated is the user's word."""
    t, count = trainer(), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for _ in range(2):
            seen, loss = run_step(t, count, lambda n: torch.tensor(24.0) / n.item())
            assert loss.item() == 2.0
    assert caplog.text.count("cannot be told") == 1 and "a Python number" in caplog.text
    details = fix.runtime_details()[-1]
    assert details["steps_unknown"] == 2 and "a Python number" in details["route"]


def test_a_step_the_entry_never_sees_is_reported_not_covered(caplog):
    """Issue 46: a training_step override that calls accelerator.backward itself, without super(): the trainer's
    loop fetched its windows (get_batch_samples) but no step was opened; the log and the details say not covered."""
    t = trainer()
    fix.get_batch_samples(lambda *a, **k: ([{}], None), t, (iter(()), 1), {})
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        out = fix.backward(lambda loss: loss, t.accelerator, (torch.tensor(3.0),), {})
        fix.backward(lambda loss: loss, t.accelerator, (torch.tensor(3.0),), {})
    assert out.item() == 3.0 and caplog.text.count("not covered") == 1
    assert fix.runtime_details()[-1]["covered"] == fix.NOT_SEEN


def test_a_rescaled_mean_is_warned_once_a_run_with_the_statement_that_stops_it(caplog):
    """Issue 40: a classifier whose compute_loss divides by GAS itself looks like any mean; zerofix says so at
    WARNING once a run, naming the statement, and the statement is then followed. The WARNING comes at the end of
    the run's first window, once its micro-batch means are read (issue 53: one WARNING where both are said)."""
    t, count = trainer(), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for _ in range(3):
            run_step(t, count)
        assert "is independent of num_items_in_batch" not in caplog.text  # held while the window is read
        for _ in range(5):
            run_step(t, count)
    assert caplog.text.count("is independent of num_items_in_batch") == 1
    assert "zerofix.loss_is_scaled_for_ga(trainer)" in caplog.text
    import zerofix

    zerofix.loss_is_scaled_for_ga(t)
    _, loss = run_step(t, count)
    assert loss.item() == 1.0  # stated per window: the Trainer's own path
    zerofix.loss_is_scaled_for_ga(t, None)
    _, loss = run_step(t, count)
    assert loss.item() == 0.25


def test_a_held_rescale_warning_is_said_when_the_windows_reading_stops_early(caplog):
    """Issue 53: the rescale WARNING waits for the first window's means; where the reading stops before the window
    ends (the next micro-batch's loss divides by its count), the held WARNING is said then, once."""
    t, count = trainer(), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        run_step(t, count)  # independent of the count: scaled as a micro-batch mean, its WARNING held
        assert "is independent of num_items_in_batch" not in caplog.text
        run_step(t, count, lambda n: torch.tensor(24.0) / n)  # divided: the reading stops
        assert caplog.text.count("is independent of num_items_in_batch") == 1
        run_step(t, count)
    assert caplog.text.count("is independent of num_items_in_batch") == 1
    assert "averages a term" not in caplog.text


@pytest.mark.parametrize("layout, name", [
    ({"parallelism_config": types.SimpleNamespace(tp_size=2, cp_size=1, sp_size=1)}, "tensor parallel (tp_size=2)"),
    ({"parallelism_config": types.SimpleNamespace(tp_size=1, cp_size=2, sp_size=1, cp_backend="torch")},
     "context parallel (cp_size=2, torch)"),
    ({"parallelism_config": types.SimpleNamespace(tp_size=1, cp_size=1, sp_size=4, sp_backend="deepspeed")},
     "sequence parallel (sp_size=4, deepspeed)"),
    ({"distributed_type": "XLA"}, "accelerate DistributedType.XLA"),
    ({"distributed_type": "SOMETHING_NEW"}, "accelerate DistributedType.SOMETHING_NEW"),
    ({"model": "tp"}, "tensor parallel (model _tp_size=2)"),
    ({"n_gpu": 2}, "torch DataParallel (n_gpu=2)"),
])
def test_an_uncovered_path_is_left_to_the_trainer_and_said(caplog, layout, name):
    """Issue 39: on a path the plan does not model the entry stands aside: the count is not watched, the loss
    reaches the engine as the Trainer made it, and the log and zerofix status say "not covered: <path>"."""
    from zerofix import paths

    paths.reset()
    t, count = trainer(), torch.tensor(12)
    for key, value in layout.items():
        if key == "model":
            t.model._tp_size = 2
        elif key == "n_gpu":
            t.args.n_gpu = value
        else:
            setattr(t.accelerator, key, value)
    with caplog.at_level(logging.INFO, logger="zerofix"):
        seen, loss = run_step(t, count)
    assert seen is count and loss.item() == 1.0  # a mean the covered path would divide by 4
    assert f"not covered: {name}" in caplog.text
    assert paths.not_covered(fix.FIX_ID) == [name]


def _identity_function(module: str):
    """An autograd identity (forward hands its input on, detached) whose class lives in ``module``."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad

    Identity.__module__ = module
    return Identity


def test_the_router_term_is_found_through_copies_and_nowhere_else():
    """transformers-moe-aux-loss decides from the loss's autograd graph whether the loss holds the router term
    (trainer_moe_aux._reaches). The output's aux_loss may be a copy of what the loss was computed from: a dtype
    cast (accelerate's convert_outputs_to_fp32, FSDP2 in bf16) or ZeRO-3's identity around a module output. A loss
    computed without the term stays untouched however the output's copy was made, and another library's function is
    not taken for a copy."""
    from zerofix.fixes import trainer_moe_aux as moe

    w = torch.ones(3, requires_grad=True)
    router = (w * 2).bfloat16()
    ce, aux = (w * 3).sum(), (router * router).sum()
    zero3_copy = _identity_function("deepspeed.runtime.zero.parameter_offload")
    other = _identity_function("some_library.hooks")
    copies = {"as is": aux, "cast": aux.float(), "zero3": zero3_copy.apply(aux),
              "zero3 of a cast": zero3_copy.apply(aux.float()), "other function": other.apply(aux)}
    with_term, without = ce + 0.5 * aux.float(), ce * 1.0
    found = {name: moe._reaches(with_term, copy) for name, copy in copies.items()}
    assert found == {"as is": True, "cast": True, "zero3": True, "zero3 of a cast": True, "other function": False}
    assert not any(moe._reaches(without, copy) for copy in copies.values())
    # the router's own input feeds the loss too (as routing weights feed the experts): still not the term
    assert not moe._reaches(ce + router.float().sum(), aux.float())


class NoCountModel(KwargsModel):
    accepts_loss_kwargs = False  # what 27 generation heads of transformers 5.24 say


# the count is handed from 4.54 on, where the Trainer's count and its loss_is_scaled_for_ga rule are the ones read
hands_the_count = pytest.mark.skipif(fix.release() < (4, 54), reason="count_never_handed models transformers >= 4.54")


def no_count_trainer():
    t = trainer()
    t.model, t.model_accepts_loss_kwargs, t.label_smoother = NoCountModel(), False, None
    return t


@hands_the_count
def test_a_head_that_says_it_takes_no_count_is_handed_one_unless_someone_said_otherwise():
    """Issue 47: the candidates, and the user's explicit word winning over them."""
    t = no_count_trainer()
    assert fix.count_never_handed(t, t.model) == "NoCountModel"
    t.model_accepts_loss_kwargs = True  # set after the Trainer was built: the Trainer counts by itself
    assert fix.count_never_handed(t, t.model) is None
    t = no_count_trainer()
    t.loss_is_scaled_for_ga = False  # transformers >= 5.19's statement
    assert fix.count_never_handed(t, t.model) is None
    t = no_count_trainer()
    import zerofix

    zerofix.loss_is_scaled_for_ga(t, False)  # zerofix's: a micro-batch mean, keep the mean of means
    assert fix.count_never_handed(t, t.model) is None
    t = no_count_trainer()
    t.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs
    assert fix.count_never_handed(t, t.model) is None
    t = no_count_trainer()
    t.model = KwargsModel()  # no flag: the Trainer reads the signature and hands the count itself
    assert fix.count_never_handed(t, t.model) is None


@hands_the_count
def test_the_trainer_counts_and_passes_only_inside_its_own_calls():
    """The flag is the Trainer's own outside get_batch_samples and training_step (callbacks read False)."""
    t = no_count_trainer()
    seen = []
    fix.get_batch_samples(lambda *a, **k: (seen.append(t.model_accepts_loss_kwargs), ([{}], torch.tensor(8)))[1],
                          t, (iter(()), 1), {})
    assert seen == [True] and t.model_accepts_loss_kwargs is False

    def step(model, inputs, num_items_in_batch):
        seen.append(t.model_accepts_loss_kwargs)
        fix.backward(lambda loss: loss, t.accelerator, (torch.tensor(24.0) / num_items_in_batch,), {})
        return torch.tensor(0.0)

    fix.training_step(step, t, (t.model, {}, torch.tensor(8)), {})
    assert seen == [True, True] and t.model_accepts_loss_kwargs is False
    details = fix.runtime_details()[-1]
    assert details["count_handed"] == "NoCountModel" and details["steps_handed"] == 1


@hands_the_count
def test_a_handed_head_whose_loss_ignores_the_count_runs_its_step_again_as_the_trainer_does(caplog):
    """Issue 51, item 2: its forward computes its own mean, so the handed count changed nothing it can prove right: that
    loss gets no backward, the micro-batch runs again as the Trainer runs it (no count, the flag the Trainer's own, the
    random state as the step began), no later step of the window or the run is handed the count, and nothing is said
    above INFO (a classifier, a masked LM: upstream's run)."""
    t = no_count_trainer()
    fix.get_batch_samples(lambda *a, **k: ([{}] * 4, torch.tensor(8)), t, (iter(()), 4), {})
    engine, calls = [], []

    def step(model, inputs, num_items_in_batch):
        calls.append((num_items_in_batch, t.model_accepts_loss_kwargs, torch.rand(())))
        fix.backward(lambda loss: engine.append(loss), t.accelerator, (torch.tensor(1.0),), {})
        return torch.tensor(0.0)

    with caplog.at_level(logging.INFO, logger="zerofix"):
        fix.training_step(step, t, (t.model, {}, torch.tensor(8)), {})
        fix.training_step(step, t, (t.model, {}, torch.tensor(8)), {})  # the window's next micro-batch
    assert [c[:2] for c in calls] == [(8, True), (None, False), (None, False)], calls
    assert calls[0][2] == calls[1][2]  # the step ran again from the same random state
    assert [e.item() for e in engine] == [1.0, 1.0]  # one backward per micro-batch, none of the handed loss
    assert fix.state_of(t).handed_head is None and "stopped" in fix.runtime_details()[-1]["count_handed"]
    assert "independent of num_items_in_batch" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text

def test_each_run_has_its_own_account():
    """Issue 51, item 5: every train() (a new trainer.state) gets its own runtime_details() entry; the Trainer log of a
    run reads only its own (run_details). No entry carries anything that depends on the runs before it."""
    first, second = trainer(), trainer()
    run_step(first, torch.tensor(12), lambda n: torch.tensor(24.0) / n.item())  # unknown
    run_step(second, torch.tensor(12), lambda n: torch.tensor(24.0) / n)  # divided
    a, b = fix.run_details(first.state), fix.run_details(second.state)
    assert a["steps_unknown"] == 1 and b["steps_unknown"] == 0 and "route" not in b
    second.state = types.SimpleNamespace()  # train() again: a new run, a new entry
    assert fix.run_details(second.state) is None
    run_step(second, torch.tensor(12), lambda n: torch.tensor(24.0) / n)
    assert fix.run_details(second.state)["backwards"] == 1 and fix.runtime_details()[-1]["backwards"] == 1


def test_the_last_scalings_of_a_loss_are_read_from_its_graph():
    """Issue 51, item 3 / issue 58, item 2: ``loss / gas`` and ``loss * (1 / gas)`` (a Python number, or a one-element
    tensor without a gradient), and through the Trainer's ``loss *= num_processes``; not a divisor that is itself
    trained, not past another operation."""
    x = torch.ones(3, requires_grad=True)
    loss = x.sum()
    for divided in (loss / 4, loss * 0.25, 0.25 * loss, loss / torch.tensor(4), loss.div(4.0), torch.tensor(0.25) * loss):
        assert fix.last_scalings(divided) == (0.25,), divided.grad_fn
    multiplied = loss / 4
    multiplied *= 2  # the Trainer's loss *= num_processes
    assert fix.last_scalings(multiplied) == (2.0, 0.25)
    assert fix.last_scalings(loss / 3 / 4) == (0.25, 1 / 3)
    w = torch.tensor(4.0, requires_grad=True)
    assert fix.last_scalings(loss / w) == () and fix.last_scalings(loss) == ()
    assert fix.last_scalings((loss / 4) + 1) == ()


def test_the_environment_states_what_the_loss_is(monkeypatch):
    """ZEROFIX_LOSS_IS_SCALED_FOR_GA (issue 51): read at every train(); 1 follows the loss as per window (a mean that
    is not is left unscaled: upstream's path), 0 scales it as a micro-batch mean; zerofix's own call wins."""
    def engine_loss(t):
        return run_step(t, torch.tensor(12), lambda n: torch.tensor(1.0))[1].item()  # a loss independent of the count

    assert engine_loss(trainer()) == 0.25  # measured: a mean, divided by the window
    monkeypatch.setenv("ZEROFIX_LOSS_IS_SCALED_FOR_GA", "1")
    stated = trainer()
    assert engine_loss(stated) == 1.0  # stated per window: the Trainer's own path
    import zerofix

    zerofix.loss_is_scaled_for_ga(stated, False)
    stated.state = types.SimpleNamespace()  # a new train()
    assert engine_loss(stated) == 0.25


def test_a_trainer_that_cannot_be_hashed_is_followed():
    """TRL 0.29's KTOTrainer defines __eq__ without __hash__: zerofix's state beside it is kept by identity (a
    WeakKeyDictionary raised `unhashable type` inside the Trainer's own get_batch_samples; issue 53)."""
    t = trainer()
    t.__class__ = type("KTOTrainer", (type(t),), {"__eq__": lambda self, other: self is other})
    with pytest.raises(TypeError):
        hash(t)
    fix.get_batch_samples(lambda *a, **k: ([{}] * 4, torch.tensor(12)), t, (iter(()), 4), {})
    assert run_step(t, torch.tensor(12), lambda n: torch.tensor(24.0) / n)[1].item() == 2.0  # divided: as upstream
    assert fix.run_details(t.state)["steps_divided"] == 1


def _token_mean(counted: int):
    """A micro-batch's token-mean cross-entropy over ``counted`` labels (of 12), independent of the count."""
    g = torch.Generator().manual_seed(counted)
    logits = torch.randn(12, 5, generator=g, requires_grad=True)
    labels = torch.randint(0, 5, (12,), generator=g)
    labels[counted:] = -100
    return torch.nn.functional.cross_entropy(logits, labels)


def test_the_micro_batch_mean_reading_goes_on_until_a_window_concludes(caplog):
    """Issue 59, item 3: a first window whose micro-batches count the same tokens concludes nothing; the reading goes on,
    and the window whose counts differ is said, once, as that window's."""
    t, count = trainer(), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for counted in (6, 6, 6, 6, 6, 6, 6, 6):  # two windows of equal counts: nothing said of a term
            run_step(t, count, lambda n, c=counted: _token_mean(c))
        assert "averages a term" not in caplog.text
        assert caplog.text.count("is independent of num_items_in_batch") == 1  # the held rescale: said alone
        for counted in (3, 9, 6, 6, 7, 7, 7, 7):  # the third window differs: said; the fourth is not read
            run_step(t, count, lambda n, c=counted: _token_mean(c))
    said = [r.getMessage() for r in caplog.records if "averages a term" in r.getMessage()]
    assert len(said) == 1 and "over 3, 9, 6, 6 elements in window 3's 4 micro-batches" in said[0], said
    assert "zerofix scales it as a micro-batch mean (said above)" in said[0], said


def test_the_reading_gives_up_after_its_windows(monkeypatch, caplog):
    monkeypatch.setattr(trainer_decision, "MEANS_WINDOWS", 2)
    t, count = trainer(), torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for counted in (6,) * 8 + (3, 9, 6, 6):  # two equal windows, then one that differs: no longer read
            run_step(t, count, lambda n, c=counted: _token_mean(c))
    assert "averages a term" not in caplog.text and fix.state_of(t).decision.means is None


def test_a_window_whose_micro_batches_count_alike_is_even():
    """Issue 69: handing a dropped count changes an update only where the micro-batches count different labels (a
    classifier's equal micro-batches: only the rounding), read either way the Trainer counts (shifted or not) and over
    the processes where it counts across them."""
    from zerofix.fixes.trainer_scaling.reading import even_window

    classes = [{"labels": torch.tensor([1, 0])}, {"labels": torch.tensor([2, 2])}]
    assert even_window(classes, torch.tensor(4), world=1, across=False)
    assert even_window(classes, torch.tensor(8), world=2, across=True)  # every rank's the same too
    assert not even_window(classes, torch.tensor(10), world=2, across=True)  # another rank counts more
    tokens = [{"labels": torch.tensor([[-100, 3, 4, -100]])}, {"labels": torch.tensor([[-100, -100, 5, 6]])}]
    assert even_window(tokens, torch.tensor(4), world=1, across=False)  # unshifted: 2 and 2
    uneven = [{"labels": torch.tensor([[-100, 3, 4, 5]])}, {"labels": torch.tensor([[-100, -100, 5, 6]])}]
    assert not even_window(uneven, torch.tensor(5), world=1, across=False)
    assert not even_window([{"input_ids": torch.ones(2)}], torch.tensor(2), world=1, across=False)  # no labels
