"""The verdict behind transformers-trainer-scaling (zerofix.num_items_watch), without a Trainer: what a loss does
with the count, in three states. Divided: it scales as one over the count, after moves, casts, clamps, copies.
Independent: the count never reached it and never left the watch. Unknown: a Python number, NumPy, a pickle, a read
torch does not show to Python (torch.tensor(n), TorchScript), a count kept from an earlier step, or a loss computed
from the count that does not scale as one over it (issue 46's rows). Values are bitwise the plain count's, and after
the step nothing the user keeps is of the watch's class."""
from __future__ import annotations

import copy
import io
import pickle
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")

from zerofix import num_items_watch as watch  # noqa: E402
from zerofix.check.scenarios.trainer_gas import IDIOM_ROWS, idiom_loss  # noqa: E402
from zerofix.num_items_watch import DIVIDED, INDEPENDENT, UNKNOWN  # noqa: E402

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
    return torch.randn(6, 5, generator=g).requires_grad_(True), torch.randint(0, 5, (6,), generator=g)


def verdict(loss_of, count=37):
    """One step: the verdict on ``loss_of(watched count)`` and the loss's value, plain."""
    n = watch.watch(torch.tensor(count))
    try:
        loss = loss_of(n)
        return watch.decide(loss), watch.unwatched(loss)
    finally:
        watch.close()


def test_a_normalised_loss_is_divided_and_gets_bitwise_its_value(batch):
    v, loss = verdict(lambda n: normalised(*batch, num_items_in_batch=n))
    assert v.state == DIVIDED
    assert type(loss) is torch.Tensor and torch.equal(loss, normalised(*batch, num_items_in_batch=torch.tensor(37)))


def test_a_mean_that_ignores_the_count_is_independent(batch):
    assert verdict(lambda n: mean(*batch, num_items_in_batch=n))[0].state == INDEPENDENT


def test_what_hooks_do_to_a_forward_argument_is_no_use(batch):
    """Issue 40 (accelerate's device hooks) and issue 39 (FSDP2's mixed precision asks is_floating_point of every
    argument, FSDP moves them): attribute reads, moves and casts of the count that never reach the loss."""
    def hooked(n):
        assert n.requires_grad is False and n.shape == () and n.device.type == "cpu"
        moved = n.to("cpu")
        assert torch.is_floating_point(n) is False
        n.to(torch.float32)
        return mean(*batch, num_items_in_batch=moved)
    assert verdict(hooked)[0].state == INDEPENDENT


@pytest.mark.parametrize("how", ["div_", "out=", "itruediv", "reciprocal-mul", "clamp", "split", "deepcopy",
                                 "times-processes", "float-cast", "sum-of-divided"])
def test_every_way_of_dividing_by_the_count_is_divided(batch, how):
    logits, labels = batch

    def loss_of(n):
        total = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        if how == "div_":
            loss = total.clone()
            return loss.div_(n)
        if how == "out=":
            loss = torch.empty(())
            torch.div(total.detach(), n, out=loss)
            return loss
        if how == "itruediv":
            loss = total.clone()
            loss /= n
            return loss
        if how == "reciprocal-mul":
            return total * (1.0 / n)
        if how == "clamp":
            return total / n.clamp(min=1)
        if how == "split":
            return total / torch.split(n.reshape(1).float(), 1)[0].squeeze()
        if how == "deepcopy":  # issue 46: a compute_loss that hands the model a deep copy of the count
            return total / copy.deepcopy(n)
        if how == "times-processes":  # the Trainer's loss *= num_processes
            loss = total / n
            loss *= 2
            return loss
        if how == "float-cast":
            return total / n.float().to(torch.float64)
        return total / n + total.detach() * 0.5 / n
    v, loss = verdict(loss_of)
    assert v.state == DIVIDED, v
    assert loss.isfinite()


def _divide(a, b):
    return a / b


_scripted_divide = torch.jit.script(_divide)


@pytest.mark.parametrize("how, route", [
    ("item", "Python number"), ("int", "Python number"), ("float", "Python number"), ("tolist", "Python number"),
    ("tensor-of-item", "Python number"), ("tensor", "torch does not show"), ("from-numpy", "NumPy"),
    ("float-of-numpy", "NumPy"), ("jit-script", "torch does not show"), ("jit-trace", "torch does not show"),
    ("pickle", "pickle"), ("logged-only", "Python number"), ("max-of-two", "Python number"),
])
def test_a_count_that_leaves_the_watch_makes_the_verdict_unknown(batch, how, route):
    """Issue 46: the loss divided by the count through a route the watch cannot follow, or a mean that only logs it:
    the same observation, so both are unknown (never acted on)."""
    logits, labels = batch
    traced = torch.jit.trace(_divide, (torch.tensor(1.0), torch.tensor(3)))

    def loss_of(n):
        total = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        divisor = {"item": lambda: n.item(), "int": lambda: int(n), "float": lambda: float(n),
                   "tolist": lambda: n.tolist(), "tensor-of-item": lambda: torch.tensor(n.item()),
                   "tensor": lambda: torch.tensor(n), "from-numpy": lambda: torch.from_numpy(n.numpy()),
                   "float-of-numpy": lambda: float(n.numpy()), "pickle": lambda: pickle.loads(pickle.dumps(n)),
                   "max-of-two": lambda: max(n, torch.tensor(1))}
        if how == "jit-script":
            return _scripted_divide(total, n)
        if how == "jit-trace":
            return traced(total, n)
        if how == "logged-only":
            float(n)
            return mean(logits, labels)
        return total / divisor[how]()
    v, loss = verdict(loss_of)
    assert v.state == UNKNOWN and route in v.route, v
    assert loss.isfinite()


@pytest.mark.parametrize("how", ["plus-zero-times", "times-comparison", "plus-regulariser-over-count",
                                 "squared", "floor-division", "log"])
def test_a_loss_computed_from_the_count_that_does_not_scale_as_one_over_it_is_unknown(batch, how):
    """Issue 46: ``mean + 0 * n``, ``mean * (n > 0)``, ``mean + 1e-3 * sum(p**2) / n`` touch the count without being
    divided by it (on transformers 5.3 treating them as divided made right runs 4x wrong)."""
    logits, labels = batch

    def loss_of(n):
        m = mean(logits, labels)
        total = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        return {"plus-zero-times": lambda: m + 0 * n, "times-comparison": lambda: m * (n > 0),
                "plus-regulariser-over-count": lambda: m + 1e-3 * (logits ** 2).sum() / n,
                "squared": lambda: total / n ** 2, "floor-division": lambda: total / (n // 1),
                "log": lambda: total / torch.log(n.float())}[how]()
    v, _ = verdict(loss_of)
    assert v.state == UNKNOWN and "does not scale as one over it" in v.route, v


@pytest.mark.parametrize("how", list(IDIOM_ROWS) + ["tensor-where-positive", "where-at-least-one", "if-positive"])
def test_the_identities_real_code_writes_are_divided(batch, how):
    """Issue 51, item 1: a term that adds nothing, a count bounded below by 1, a count plus a negligible constant, a
    guard that picks the divided branch wherever the count is positive: each is the division it guards (the scenario's
    idioms, zerofix.check.scenarios.trainer_gas.idiom_loss, and three more guards)."""
    logits, labels = batch
    token_losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    def loss_of(n):
        s = token_losses.sum()
        if how == "tensor-where-positive":
            return (s / n).where(n != 0, s.new_zeros(()))
        if how == "where-at-least-one":
            return torch.where(n >= 1, s / n.clamp(min=1), s.new_zeros(()))
        if how == "if-positive":
            return s / n if n > 0 else s * 0
        return idiom_loss(how, token_losses, n)
    v, loss = verdict(loss_of)
    assert v.state == DIVIDED and v.factor == 1, v
    plain = torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / 37
    assert torch.allclose(loss, plain, rtol=1e-6)


def test_a_zero_built_from_the_counts_shape_is_no_function_of_it(batch):
    """``mean + torch.zeros_like(n)``: the count's value never reaches the loss (issue 51's table)."""
    assert verdict(lambda n: mean(*batch) + torch.zeros_like(n))[0].state == INDEPENDENT
    assert verdict(lambda n: mean(*batch) + n.new_zeros(()))[0].state == INDEPENDENT


@pytest.mark.parametrize("how", ["plus-half", "where-above-five", "where-not-a-guard", "maximum-of-two-counts"])
def test_what_only_looks_like_an_identity_stays_unknown(batch, how):
    """A constant that moves the count (``n + 0.5``), a comparison that is no positivity guard, a bound that is itself
    a function of the count: not the count."""
    logits, labels = batch
    s = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")

    def loss_of(n):
        return {"plus-half": lambda: s / (n + 0.5), "where-above-five": lambda: torch.where(n > 5, s / n, s),
                "where-not-a-guard": lambda: torch.where(n < 0, s / n, s),
                "maximum-of-two-counts": lambda: s / torch.maximum(n, n * 2)}[how]()
    assert verdict(loss_of)[0].state == UNKNOWN


@pytest.mark.parametrize("how, factor", [("times-steps", 4), ("count-over-steps", 4), ("times-half-of-two", 1),
                                         ("times-quarter", Fraction(1, 4)), ("unequal-terms", None),
                                         ("tensor-factor", Fraction(1, 4)), ("times-tensor-steps", 4),
                                         ("times-a-trained-weight", 1), ("times-a-vector", 1)])
def test_a_divided_loss_carries_its_python_factor(batch, how, factor):
    """Issue 51, item 3: ``s / n * GAS`` and ``s / (n / GAS)`` (5.3 hand fixes) carry the factor GAS: the Python
    numbers applied once the count is part of the value. Issue 69, item 2: a one-element tensor without a gradient is
    read as the number it holds (``s / n * torch.tensor(4.0)`` carries 4, as ``* 4`` does); a trained weight or a
    tensor of several elements is part of what is independent of the count."""
    logits, labels = batch
    s = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")

    def loss_of(n):
        return {"times-steps": lambda: s / n * 4, "count-over-steps": lambda: s / (n / 4),
                "times-half-of-two": lambda: s / (2 * n) * 2, "times-quarter": lambda: s / n * 0.25,
                "unequal-terms": lambda: s / n * 4 + s / n,
                "tensor-factor": lambda: s / (n * torch.tensor(4.0)),
                "times-tensor-steps": lambda: (s / n) * torch.tensor(4.0),
                "times-a-trained-weight": lambda: s / n * torch.tensor(4.0, requires_grad=True),
                "times-a-vector": lambda: (s / n * torch.full((2,), 4.0)).sum()}[how]()
    v, _ = verdict(loss_of)
    assert v.state == DIVIDED and v.factor == factor, v


def test_an_undivided_term_another_fix_accounts_for_keeps_the_loss_divided(batch):
    """The MoE router term (transformers-moe-aux-loss weights it): divided cross-entropy + coefficient x aux."""
    logits, labels = batch
    aux = (logits ** 2).mean()
    n = watch.watch(torch.tensor(37))
    try:
        loss = normalised(logits, labels, n)
        loss += 0.01 * aux
        assert watch.decide(loss, accounted=lambda t: t.grad_fn is not None).state == DIVIDED
    finally:
        watch.close()
    n = watch.watch(torch.tensor(37))
    try:
        loss = normalised(logits, labels, n) + 0.01 * aux
        assert watch.decide(loss).state == UNKNOWN  # nobody accounts for it
    finally:
        watch.close()


def test_nothing_the_user_keeps_is_of_the_watchs_class_after_the_step(batch):
    """Issue 46: a buffer filled from the count, a running sum, an attribute holding a value computed from it, a
    deep copy: plain tensors once the step ends. The count itself, if kept, answers as a plain tensor and its reads in
    a later step are a route that step cannot follow."""
    logits, labels = batch
    norm, seen, kept = torch.zeros(()), torch.zeros((), dtype=torch.int64), {}

    def loss_of(n):
        norm.copy_(n)
        seen.add_(n)
        kept["count"], kept["float"], kept["copy"] = n, n.float(), copy.deepcopy(n)
        loss = normalised(logits, labels, n)
        kept["running"] = torch.zeros(()) + loss.detach()
        return loss
    v, _ = verdict(loss_of)
    assert v.state == DIVIDED
    for tensor in (norm, seen, kept["running"], kept["copy"]):
        assert type(tensor) is torch.Tensor, type(tensor)
    assert type(kept["float"]) is torch.Tensor and not isinstance(kept["count"], watch._Watched)
    assert int(kept["count"]) == 37 and float(kept["float"] + 1) == 38.0 and kept["count"].numpy() == 37
    assert type(copy.deepcopy(kept["count"])) is torch.Tensor
    v, _ = verdict(lambda n: torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / kept["count"])
    assert v.state == UNKNOWN and "earlier step" in v.route


def test_the_loss_handed_on_keeps_its_graph(batch):
    logits, labels = batch
    _, loss = verdict(lambda n: normalised(logits, labels, num_items_in_batch=n))
    loss.backward()
    expected = torch.autograd.grad(normalised(logits, labels, torch.tensor(37)), logits)[0]
    assert torch.equal(logits.grad, expected)


def test_the_watched_count_copies_pickles_and_saves_as_a_plain_tensor():
    """Issue 40: copy.deepcopy(num_items_in_batch) inside compute_loss crashed the watched subclass."""
    n = watch.watch(torch.tensor(37))
    try:
        buffer = io.BytesIO()
        torch.save({"n": n}, buffer)
        buffer.seek(0)
        for copied in (copy.deepcopy(n), pickle.loads(pickle.dumps(n)), torch.load(buffer)["n"], copy.copy(n) * 1):
            assert int(copied) == 37
        assert type(pickle.loads(pickle.dumps(n))) is torch.Tensor
    finally:
        watch.close()


def test_the_algebra_by_itself():
    from fractions import Fraction as F

    from zerofix.count_terms import Constant, Mixed, combine
    one, c = F(1), Constant(None)
    assert combine("__truediv__", [c, one]) == F(-1)
    assert combine("__rtruediv__", [one, c]) == F(-1)
    assert combine("mul", [F(-1), c]) == F(-1)
    assert combine("to", [one, "other"]) == one and isinstance(combine("to", [c, one]), Constant)
    assert combine("add", [F(-1), F(-1)]) == F(-1)
    assert combine("add", [F(-1), c]) == Mixed(frozenset({F(-1), F(0)}), (None,))
    assert combine("pow", [one, F(2)]) == F(2) and combine("sqrt", [F(2)]) == one
    assert combine("gt", [one, c]) is None and combine("add", [None, c]) is None


def test_a_parameter_changed_in_place_by_the_count_keeps_its_class():
    p = torch.nn.Parameter(torch.ones(3))
    n = watch.watch(torch.tensor(2))
    try:
        with torch.no_grad():
            p.mul_(n)
    finally:
        watch.close()
    assert type(p) is torch.nn.Parameter


def test_nothing_to_watch_is_handed_back_as_it_is():
    assert watch.watch(None) is None
    assert watch.watch(12) == 12
    assert watch.unwatched(12) == 12


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


def test_zerofixs_own_chunked_loss_is_divided_by_the_count():
    """zerofix.chunked_cross_entropy divides by the count inside its kernel, as a float; its result still depends
    on the tensor, bitwise the same (found by zerofix check's trl-sft-chunked-nll row on 2026-04: 0.5 otherwise)."""
    from zerofix.losses import chunked_cross_entropy

    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(16, 8, generator=g)
    labels = torch.randint(0, 16, (10,), generator=g)
    plain = chunked_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(23))
    v, followed = verdict(lambda n: chunked_cross_entropy(hidden, weight, labels, num_items_in_batch=n), 23)
    assert v.state == DIVIDED and torch.equal(followed, plain)
    assert verdict(lambda n: chunked_cross_entropy(hidden, weight, labels))[0].state == INDEPENDENT


def test_a_value_computed_from_the_count_in_a_compiled_region_is_unknown_and_no_crash(batch):
    """Issue 46: Dynamo traces the watch's own branch for a tensor computed from the count (a side effect it replays
    at every call), with fullgraph=True. (The count itself carries a dispatch key Dynamo cannot take as a graph input:
    the Trainer entry hands a compiled model or compute_loss_func the plain count, tests/test_trainer_scaling_unit.py.)"""
    logits, labels = batch
    divide = torch.compile(lambda total, d: total / d, fullgraph=True, backend="eager")
    for _ in range(2):  # the first call traces, the second runs the compiled code
        v, loss = verdict(lambda n: divide(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"),
                                           n.float()))
        assert v.state == UNKNOWN and "torch.compile" in v.route, v
        assert loss.isfinite()


@pytest.mark.parametrize("how, state", [("logged-loss", DIVIDED), ("logged-then-scaled", DIVIDED),
                                        ("logged-another-division", UNKNOWN), ("count-as-number", UNKNOWN)])
def test_a_loss_logged_as_a_number_is_still_divided(batch, how, state):
    """Issue 69: a ``compute_loss`` that logs ``float(loss)`` takes the loss's own value out of torch, after the
    division: nothing read out of it can have entered the loss (also through the Trainer's later ``loss / gas``). A
    value divided by the count that is not the loss, read out (it could be multiplied back in), and the count itself read
    out stay unknown."""
    logits, labels = batch
    s = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    logged = []

    def loss_of(n):
        if how == "logged-loss":
            loss = s / n
            logged.append(float(loss))
            return loss
        if how == "logged-then-scaled":
            loss = s / n
            logged.append(loss.item())
            return loss / 4
        if how == "logged-another-division":
            logged.append(float(s.detach() / n))
            return s / n
        return s / float(n)

    v, _ = verdict(loss_of)
    assert v.state == state, v
