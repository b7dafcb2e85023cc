"""transformers-deepspeed-sp-loss without a distributed run: which loss reaching Accelerator.backward is upstream's (the
Trainer's step divides it by the accumulation steps and nothing else), and the call that asks Trainer.compute_loss for
its outputs. The real runs: tests/test_trainer_sequence_parallel.py."""
from __future__ import annotations

import pytest

from zerofix.fixes import trainer_sequence_parallel as sp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.stack_independent


def returned_loss():
    weights = torch.ones(3, requires_grad=True)
    return (weights * 2).sum()


def test_the_trainers_own_scalings_of_the_returned_loss_are_upstreams():
    loss = returned_loss()
    assert sp._upstreams(loss, loss)
    assert sp._upstreams(loss / 4, loss)  # training_step's division by the accumulation steps
    assert sp._upstreams(loss / torch.tensor(4.0), loss)
    assert sp._upstreams(loss * 0.5, loss)


def test_a_loss_with_a_term_added_or_another_loss_is_not():
    loss = returned_loss()
    extra = torch.ones(2, requires_grad=True).pow(2).sum()
    assert not sp._upstreams(loss + extra, loss)  # a subclass's penalty
    assert not sp._upstreams((loss + extra) / 4, loss)
    assert not sp._upstreams(loss / extra, loss)  # divided by something with a graph of its own
    assert not sp._upstreams(returned_loss(), loss)
    assert not sp._upstreams(None, loss) and not sp._upstreams(loss, None)


@pytest.mark.parametrize("args, kwargs, wants", [
    (("model", "inputs"), {}, False),
    (("model", "inputs"), {"return_outputs": True, "num_items_in_batch": None}, True),
    (("model", "inputs", False, None), {}, False),
    (("model", "inputs", True), {}, True),
])
def test_compute_loss_is_asked_for_its_outputs_and_the_caller_gets_what_it_asked(args, kwargs, wants):
    call_args, call_kwargs, asked = sp._with_outputs(args, kwargs)
    assert asked is wants
    assert (call_args[2] if len(call_args) > 2 else call_kwargs["return_outputs"]) is True
    assert call_args[:2] == ("model", "inputs")
