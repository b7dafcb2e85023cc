"""zerofix.own_mean without a Trainer (issue 59, item 1): a head's inline token mean is proven from the logits it returns
and weighed as its share of the window's token mean, and nothing else is proven. The same route in real Trainer runs
(Gemma 3 on transformers 4.57 and 5.3, the inline-mean Llama on every stack): tests/test_trainer_own_mean_heads.py and
tests/test_trainer_mean_of_means.py; the trainer entry's forward hook (``CountToLoss``) below on a tiny Llama."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from zerofix import own_mean  # noqa: E402

V = 11


def batch(seed=0, b=2, t=9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, t), generator=g)
    labels[0, :4] = -100  # a prompt, not counted
    labels[1, 7:] = -100
    return logits, labels


def shifted_mean(logits, labels, **kw):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), **kw)


def gemma3_loss(logits, labels, mask):
    """Gemma3ForConditionalGeneration's inline loss (transformers 4.57 - 5.6): masked positions dropped, then a mean."""
    shift_logits, shift_labels = logits.float()[..., :-1, :], labels[..., 1:]
    kept = mask[:, -shift_logits.shape[1]:] != 0
    return torch.nn.CrossEntropyLoss()(shift_logits[kept].view(-1, V), shift_labels[kept].view(-1))


def test_a_token_mean_of_the_returned_logits_is_proven_with_its_count():
    logits, labels = batch()
    proof = own_mean.prove(shifted_mean(logits, labels), logits, labels)
    assert proof is not None and proof.tokens == "labels"
    assert int(proof.count) == int((labels[:, 1:] != -100).sum()) == 5 + 6


def test_gemma3s_attention_mask_is_the_second_reading():
    logits, labels = batch()
    mask = torch.ones_like(labels)
    mask[1, 5:] = 0  # padding on the right whose labels were left counted (a collator that does not mask them)
    labels[1, 5:] = 3
    proof = own_mean.prove(gemma3_loss(logits, labels, mask), logits, labels, mask)
    assert proof is not None and proof.tokens == "labels and attention mask"
    assert int(proof.count) == int(((labels[:, 1:] != -100) & (mask[:, 1:] != 0)).sum())
    assert own_mean.prove(gemma3_loss(logits, labels, torch.ones_like(labels)), logits, labels, mask).tokens == "labels"


@pytest.mark.parametrize("what", ["an extra term", "label smoothing", "unshifted", "a sum", "a z-loss of 1e-4"])
def test_anything_else_proves_nothing(what):
    logits, labels = batch()
    loss = {"an extra term": lambda: shifted_mean(logits, labels) + 1e-3,
            "label smoothing": lambda: shifted_mean(logits, labels, label_smoothing=0.1),
            "unshifted": lambda: F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)),
            "a sum": lambda: shifted_mean(logits, labels, reduction="sum"),
            "a z-loss of 1e-4": lambda: shifted_mean(logits, labels) + 1e-4 * logits.logsumexp(-1).pow(2).mean(),
            }[what]()
    assert own_mean.prove(loss, logits, labels) is None


def test_shapes_and_counts_that_do_not_line_up_prove_nothing():
    logits, labels = batch()
    loss = shifted_mean(logits, labels)
    assert own_mean.prove(loss, logits[:, 1:], labels) is None  # logits_to_keep
    assert own_mean.prove(loss.reshape(1), logits, labels) is None  # not a scalar
    assert own_mean.prove(loss, logits, labels.float()) is None
    assert own_mean.prove(loss, logits, None) is None
    empty = torch.full_like(labels, -100)
    assert own_mean.prove(shifted_mean(logits, empty), logits, empty) is None  # no counted token: upstream's NaN


def test_chunks_read_the_same(monkeypatch):
    logits, labels = batch(t=40)
    loss = shifted_mean(logits, labels)
    whole = own_mean.prove(loss, logits, labels)
    monkeypatch.setattr(own_mean, "CHUNK_BYTES", 4 * V * 3)  # three rows a chunk
    chunked = own_mean.token_losses(logits, labels)[0]
    assert chunked.numel() == int((labels[:, 1:] != -100).sum()) and own_mean.prove(loss, logits, labels) == whole


def test_the_weighed_mean_has_the_token_sums_gradient():
    """Two micro-batches of uneven counts: sum of loss_i * n_i / N has the gradient of the window's token mean."""
    (a, la), (b, lb) = batch(0), batch(1, t=5)
    n = int((la[:, 1:] != -100).sum()) + int((lb[:, 1:] != -100).sum())
    count = torch.tensor(n)
    weighed = sum(own_mean.as_window_share(shifted_mean(x, y), own_mean.prove(shifted_mean(x, y), x, y), count)
                  for x, y in ((a, la), (b, lb)))
    got = torch.autograd.grad(weighed, (a, b))
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    reference = (shifted_mean(a64, la, reduction="sum") + shifted_mean(b64, lb, reduction="sum")) / n
    want = torch.autograd.grad(reference, (a64, b64))
    err = max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
    assert err < 1e-6
    means = (shifted_mean(a, la) + shifted_mean(b, lb)) / 2  # upstream's: a mean of micro-batch means
    off = torch.autograd.grad(means, (a, b))
    assert max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(off, want)) > 0.1


def test_the_proof_leaves_the_graph_and_the_random_state_alone():
    logits, labels = batch()
    loss = shifted_mean(logits, labels)
    state = torch.random.get_rng_state()
    own_mean.prove(loss, logits, labels)
    assert torch.equal(state, torch.random.get_rng_state())
    assert loss.grad_fn is not None and logits.grad is None


@pytest.mark.parametrize("kind", ["inline-mean-llama", "fused-mean-llama", "own-mean-llama"])
def test_the_trainer_entrys_forward_hook_weighs_only_a_proven_inline_mean(kind):
    """``trainer_scaling.CountToLoss`` on a handed call: the inline mean is weighed (its proof said), a head that returns
    no logits keeps its loss (the failed proof said), a head whose loss function takes the count is not read."""
    pytest.importorskip("transformers")
    from zerofix.check import models
    from zerofix.fixes.trainer_scaling import CountToLoss

    model = models.build_model(kind)
    ids = torch.arange(1, 17).reshape(2, 8)
    labels = ids.clone()
    labels[0, :5] = -100
    count = torch.tensor(40)  # the window's
    plain = model(input_ids=ids, labels=labels).loss
    said = []
    with CountToLoss(model, proven=lambda name, proof: said.append((name, proof))):
        out = model(input_ids=ids, labels=labels, num_items_in_batch=count)
    assert not model._forward_hooks and not model._forward_pre_hooks and "_loss_function" not in vars(model)
    n = int((labels[:, 1:] != -100).sum())
    if kind == "inline-mean-llama":
        assert said == [(type(model).__name__, said[0][1])] and int(said[0][1].count) == n
        assert float(out.loss) == pytest.approx(float(plain) * n / 40, rel=1e-6)
    elif kind == "fused-mean-llama":
        assert said == [(type(model).__name__, None)] and torch.equal(out.loss, plain)
    else:  # the count reached its loss function: divided by 40 (4.46 - 4.47: a read-only loss_function, the same mean
        # proven from its logits instead; zerofix hands no count there, count_never_handed needs 4.54)
        import inspect

        settable = inspect.getattr_static(type(model), "loss_function").fset is not None
        assert (said == []) == settable and float(out.loss) == pytest.approx(float(plain) * n / 40, rel=1e-6)


def test_a_loss_handed_back_in_bf16_is_proven_to_bf16s_rounding():
    """FSDP2's mixed precision casts the forward's outputs to bf16, the loss among them (measured on an H200 and on the
    CPU harness: the inline mean's 4.1422 came back as 4.15625): the proof holds to that rounding, and no further (a
    term within half a bf16 unit cannot be seen in a bf16 loss, and is weighed with it)."""
    logits, labels = batch()
    loss = shifted_mean(logits, labels)
    assert own_mean.prove(loss.bfloat16(), logits, labels) is not None
    assert own_mean.prove(shifted_mean(logits.bfloat16(), labels), logits, labels) is not None  # the same, in bf16
    assert own_mean.prove((loss * 1.02).bfloat16(), logits, labels) is None  # 2% off: beyond a bf16 rounding


def test_a_window_of_one_micro_batch_is_the_heads_loss_bitwise():
    """One process, GAS 1: the window is this micro-batch (n equal to the count), and the weighed loss is the head's."""
    logits, labels = batch()
    loss = shifted_mean(logits, labels)
    proof = own_mean.prove(loss, logits, labels)
    assert torch.equal(own_mean.as_window_share(loss, proof, torch.tensor(int(proof.count))), loss)

