"""The watch behind transformers-trainer-scaling (zerofix.num_items_watch), without a Trainer: the count is
followed through every operation, so a loss computed from it depends on it and a plain mean does not, whatever
else was done with the count on the way (a move, a cast, a Python number, a log entry); the values computed from
a watched count are bitwise those of the plain count, and the watched count copies like a plain tensor."""
from __future__ import annotations

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")

from zerofix import num_items_watch as watch  # noqa: E402

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


def normalised(logits, labels, num_items_in_batch=None):
    """transformers' fixed_cross_entropy: sum / num_items_in_batch, after moving the count to the loss's device."""
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def mean(logits, labels, num_items_in_batch=None):
    """A classifier's loss: it takes the count as a keyword and ignores it."""
    return torch.nn.functional.cross_entropy(logits, labels)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)


def test_a_normalised_loss_depends_on_the_count_and_gets_bitwise_its_value(batch):
    n = torch.tensor(37)
    loss = normalised(*batch, num_items_in_batch=watch.watched(n))
    assert watch.depends(loss)
    plain = watch.unwatched(loss)
    assert type(plain) is torch.Tensor and torch.equal(plain, normalised(*batch, num_items_in_batch=n))


def test_a_mean_that_ignores_the_count_does_not_depend_on_it(batch):
    assert not watch.depends(mean(*batch, num_items_in_batch=watch.watched(torch.tensor(37))))


def test_what_hooks_do_to_a_forward_argument_is_no_normalisation(batch):
    """Issue 40 (accelerate's device hooks) and issue 39 (FSDP2's mixed precision asks is_floating_point of every
    argument, FSDP moves them): attribute reads, moves and casts of the count that never reach the loss."""
    n = watch.watched(torch.tensor(37))
    assert n.requires_grad is False and n.shape == () and n.device.type == "cpu"
    moved = n.to("cpu")
    assert watch.depends(moved) and torch.is_floating_point(n) is False
    n.to(torch.float32)
    assert not watch.depends(mean(*batch, num_items_in_batch=moved))


def test_a_python_number_or_a_log_entry_is_no_normalisation(batch):
    """Issue 40's first row: compute_loss logs float(count) or keeps .item(), returns the model's mean."""
    logged = {}

    def mean_with_a_metric(logits, labels, num_items_in_batch=None):
        logged["tokens"], logged["item"] = float(num_items_in_batch), num_items_in_batch.item()
        return torch.nn.functional.cross_entropy(logits, labels)

    loss = mean_with_a_metric(*batch, num_items_in_batch=watch.watched(torch.tensor(37)))
    assert not watch.depends(loss) and logged == {"tokens": 37.0, "item": 37}
    assert watch.python_reads() == 2  # said in the warning: a loss divided by such a number cannot be followed


@pytest.mark.parametrize("how", ["div_", "out=", "itruediv", "reciprocal-mul", "clamp", "max-of-two", "split"])
def test_every_way_of_computing_from_the_count_is_followed(batch, how):
    logits, labels = batch
    n = watch.watched(torch.tensor(37))
    total = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    if how == "div_":
        loss = total.clone()
        loss.div_(n)
    elif how == "out=":
        loss = torch.empty(())
        torch.div(total, n, out=loss)
    elif how == "itruediv":
        loss = total.clone()
        loss /= n
    elif how == "reciprocal-mul":
        loss = total * (1.0 / n)
    elif how == "clamp":
        loss = total / n.clamp(min=1)
    elif how == "max-of-two":
        loss = total / max(n, torch.tensor(1))
    else:
        loss = total / torch.split(n.reshape(1).float(), 1)[0].squeeze()
    assert watch.depends(loss)
    assert torch.equal(watch.unwatched(loss), total / 37)


def test_the_loss_handed_on_keeps_its_graph(batch):
    logits, labels = batch
    logits = logits.clone().requires_grad_(True)
    loss = watch.unwatched(normalised(logits, labels, num_items_in_batch=watch.watched(torch.tensor(37))))
    loss.backward()
    expected = torch.autograd.grad(normalised(logits, labels, torch.tensor(37)), logits)[0]
    assert torch.equal(logits.grad, expected)


def test_the_watched_count_copies_pickles_and_saves_as_a_plain_tensor():
    """Issue 40: copy.deepcopy(num_items_in_batch) inside compute_loss crashed the watched subclass."""
    n = watch.watched(torch.tensor(37))
    buffer = io.BytesIO()
    torch.save({"n": n}, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(n), pickle.loads(pickle.dumps(n)), torch.load(buffer)["n"], copy.copy(n) * 1):
        assert int(copied) == 37
    assert type(copy.deepcopy(n)) is torch.Tensor and type(pickle.loads(pickle.dumps(n))) is torch.Tensor


def test_a_parameter_changed_in_place_by_the_count_keeps_its_class():
    p = torch.nn.Parameter(torch.ones(3))
    with torch.no_grad():
        p.mul_(watch.watched(torch.tensor(2)))
    assert type(p) is torch.nn.Parameter


def test_nothing_to_watch_is_handed_back_as_it_is():
    assert watch.watched(None) is None
    assert watch.watched(12) == 12
    assert watch.unwatched(12) == 12 and not watch.depends(12.0)


def test_an_int_count_becomes_a_tensor_with_bitwise_the_same_divisions():
    """transformers 4.46-4.48 pass an int; the watch hands on a 0-dim int64 tensor."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        sums = (torch.randn(500, generator=g) * 100).to(dtype)
        for k in (1, 3, 7, 37, 4093):
            as_tensor = watch.as_tensor_like_release(k)
            assert as_tensor.dtype == torch.int64 and int(as_tensor) == k
            assert torch.equal(sums / k, sums / as_tensor) and (sums / as_tensor).dtype == dtype
    assert watch.as_tensor_like_release(True) is True and watch.as_tensor_like_release(None) is None


def test_zerofixs_own_chunked_loss_shows_that_it_divides_by_the_count():
    """zerofix.chunked_cross_entropy divides by the count inside its kernel, as a float; its result still depends
    on the tensor, bitwise the same (found by zerofix check's trl-sft-chunked-nll row on 2026-04: 0.5 otherwise)."""
    from zerofix.losses import chunked_cross_entropy

    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(16, 8, generator=g)
    labels = torch.randint(0, 16, (10,), generator=g)
    plain = chunked_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(23))
    followed = chunked_cross_entropy(hidden, weight, labels, num_items_in_batch=watch.watched(torch.tensor(23)))
    assert watch.depends(followed) and torch.equal(watch.unwatched(followed), plain)
    assert not watch.depends(chunked_cross_entropy(hidden, weight, labels))
