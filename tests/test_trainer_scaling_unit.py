"""transformers-trainer-scaling's wrappers without a Trainer run: what training_step hands on, when it watches,
and what it leaves alone (a compiled model, a count that is None). The real runs are test_trainer_scaling.py."""
from __future__ import annotations

import logging
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from zerofix.fixes import trainer_scaling as fix  # noqa: E402


class FakeAccelerator:
    def __init__(self):
        self.num_processes, self.gradient_accumulation_steps = 1, 1
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.NO

    def unwrap_model(self, model):
        return model


class KwargsModel(torch.nn.Module):
    def forward(self, input_ids=None, labels=None, **kwargs):
        return input_ids


def trainer(torch_compile=False):
    t = type("Trainer", (), {})()  # a class instance, weak-referenceable as a real Trainer is
    t.accelerator, t.model = FakeAccelerator(), KwargsModel()
    t.model_accepts_loss_kwargs, t.compute_loss_func = True, None
    t.args = types.SimpleNamespace(gradient_accumulation_steps=4, average_tokens_across_devices=True,
                                   torch_compile=torch_compile)
    return t


def test_the_first_step_hands_on_a_watched_count_and_later_steps_the_count_itself():
    t, seen = trainer(), []

    def step(model, inputs, num_items_in_batch):
        seen.append(num_items_in_batch)
        fix.backward(lambda loss: None, t.accelerator, (torch.tensor(1.0),), {})

    count = torch.tensor(12)
    fix.training_step(step, t, (t.model, {}, count), {})
    fix.training_step(step, t, (t.model, {}, count), {})
    assert type(seen[0]) is not torch.Tensor and torch.equal(seen[0], count)  # watched, equal
    assert seen[1] is count
    assert fix.runtime_details()[-1]["loss"] == "ignores num_items_in_batch"


def test_an_int_count_is_watched_as_a_tensor_once():
    t, seen = trainer(), []

    def step(model, inputs, num_items_in_batch):
        seen.append(num_items_in_batch)
        fix.backward(lambda loss: None, t.accelerator, (torch.tensor(1.0),), {})

    fix.training_step(step, t, (t.model, {}, 12), {})
    fix.training_step(step, t, (t.model, {}, 12), {})
    assert isinstance(seen[0], torch.Tensor) and int(seen[0]) == 12 and seen[1] == 12 and type(seen[1]) is int


def test_no_count_no_watch():
    t, seen = trainer(), []
    fix.training_step(lambda m, i, n: seen.append(n), t, (t.model, {}, None), {})
    assert seen == [None] and not fix.known(t).measured


def test_a_compiled_model_is_not_watched_and_the_belief_is_followed(caplog):
    t, seen, losses = trainer(torch_compile=True), [], []

    def step(model, inputs, num_items_in_batch):
        seen.append(num_items_in_batch)
        fix.backward(lambda loss: losses.append(loss), t.accelerator, (torch.tensor(1.0),), {})

    count = torch.tensor(12)
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        fix.training_step(step, t, (t.model, {}, count), {})
    assert seen == [count] and seen[0] is count
    assert fix.known(t).measured and fix.known(t).reads is None and "torch.compile" in caplog.text
    assert losses[0].item() == 1.0  # the Trainer's belief (normalised): nothing divided
