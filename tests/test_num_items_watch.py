"""The watch behind transformers-trainer-scaling (zerofix.num_items_watch), without a Trainer: a loss that
divides by num_items_in_batch is seen reading it, a plain mean is not, attribute reads (what DeepSpeed's hooks
do to every tensor argument) are not counted, and the values computed from a watched count are bitwise those
of the plain count."""
from __future__ import annotations

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


def test_a_normalised_loss_reads_the_count_and_gets_bitwise_its_value(batch):
    n = torch.tensor(37)
    watched = watch.watched(n)
    loss = normalised(*batch, num_items_in_batch=watched)
    assert watch.reads() > 0
    assert type(loss) is torch.Tensor and torch.equal(loss, normalised(*batch, num_items_in_batch=n))


def test_a_mean_that_ignores_the_count_reads_nothing(batch):
    watched = watch.watched(torch.tensor(37))
    mean(*batch, num_items_in_batch=watched)
    assert watch.reads() == 0


def test_attribute_reads_are_not_counted():
    watched = watch.watched(torch.tensor(37))
    assert watched.requires_grad is False and watched.shape == () and watched.device.type == "cpu"
    assert watch.reads() == 0
    int(watched)  # a conversion is a read: it can feed a division
    assert watch.reads() == 1


def test_nothing_to_watch_is_handed_back_as_it_is():
    assert watch.watched(None) is None
    assert watch.watched(12) == 12


def test_an_int_count_becomes_a_tensor_with_bitwise_the_same_divisions():
    """transformers 4.46-4.48 pass an int; the watch hands on a 0-dim int64 tensor for the first step."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        sums = (torch.randn(500, generator=g) * 100).to(dtype)
        for k in (1, 3, 7, 37, 4093):
            as_tensor = watch.as_tensor_like_release(k)
            assert as_tensor.dtype == torch.int64 and int(as_tensor) == k
            assert torch.equal(sums / k, sums / as_tensor) and (sums / as_tensor).dtype == dtype
    assert watch.as_tensor_like_release(True) is True and watch.as_tensor_like_release(None) is None


def test_a_loss_that_reads_the_count_for_a_metric_counts_as_normalised(batch):
    """The ambiguity list's direction: reading the count for anything (a logged number) is evidence the loss
    may use it, so the Trainer's own belief is followed; only a loss that never reads it is demoted to a mean."""
    logged = {}

    def mean_with_a_metric(logits, labels, num_items_in_batch=None):
        logged["tokens"] = int(num_items_in_batch)
        return torch.nn.functional.cross_entropy(logits, labels)

    watched = watch.watched(torch.tensor(37))
    mean_with_a_metric(*batch, num_items_in_batch=watched)
    assert watch.reads() > 0 and logged["tokens"] == 37
