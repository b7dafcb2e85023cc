"""The blocked path of chunked_cross_entropy (low-precision weights, scalar reductions; issue 52): row chunks for the
loss and dL/dh, vocabulary blocks for dL/dW, each gradient element one GEMM's sum rounded once. No distributed run."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zerofix import losses  # noqa: E402
from zerofix.losses import block_sizes, chunked_cross_entropy, chunked_cross_entropy_with_stats  # noqa: E402

pytestmark = pytest.mark.stack_independent

N, H, V = 53, 12, 37  # prime N and V: no chunk or block size divides them
BOUND = {torch.bfloat16: 2e-2, torch.float16: 3e-3}  # a few ulps of the dtype (the gradients are in it)


def make(seed=0, ignored=0.2, bias=False, n=N, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = -100
    return hidden, weight, b, labels


def rounded_reference(hidden, weight, labels, bias, dtype, *, reduction="mean", num_items_in_batch=None,
                      label_smoothing=0.0, logit_softcap=None, z_loss=0.0, logit_scale=1.0):
    """The fair reference for low precision: the inputs rounded to ``dtype``, the head's product rounded to it once
    (as the model's own head gives it), every other operation in float64. Returns the loss and the gradients."""
    leaves = [None if t is None else t.to(dtype).double().requires_grad_() for t in (hidden, weight, bias)]
    h, w, b = leaves
    z = h @ w.t()
    z = z + (z.to(dtype).double() - z).detach()
    if b is not None:
        z = z + b
    z = z * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    counted = labels != -100
    per = F.cross_entropy(z, labels, ignore_index=-100, reduction="none", label_smoothing=label_smoothing)
    per = per + z_loss * torch.logsumexp(z, -1) ** 2 * counted
    total = per.sum()
    if reduction == "mean":
        denom = counted.sum() if num_items_in_batch is None else num_items_in_batch
        total = total / denom if denom > 0 else total * 0
    total.backward()
    return total.detach(), [None if t is None else t.grad for t in leaves]


def ours(hidden, weight, labels, bias, dtype, **kw):
    leaves = [None if t is None else t.to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    out = chunked_cross_entropy(leaves[0], leaves[1], labels, leaves[2], **kw)
    out.backward()
    return out.detach(), [None if t is None else t.grad for t in leaves]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


OPTIONS = [dict(zip(("reduction", "num_items_in_batch", "label_smoothing", "logit_softcap", "z_loss", "logit_scale",
                     "chunk_size", "bias"), combo, strict=True))
           for combo in itertools.product(("mean", "sum"), (None, 61), (0.0, 0.1), (None, 3.0), (0.0, 1e-2),
                                          (1.0, 0.5), (None, 7, 1), (False, True))
           if not (combo[1] is not None and combo[0] != "mean")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parity_with_the_rounded_reference(opts, dtype):
    opts = dict(opts)
    bias = opts.pop("bias")
    chunk = opts.pop("chunk_size")
    h, w, b, labels = make(bias=bias)
    ref, ref_grads = rounded_reference(h, w, labels, b, dtype, **opts)
    out, got = ours(h, w, labels, b, dtype, chunk_size=chunk, **opts)
    assert out.dtype == torch.float32 and all(g is None or g.dtype == dtype for g in got)
    assert rel(out, ref) < 1e-5, ("loss", rel(out, ref))  # float32 after the rounded product
    for name, g, r in zip(("hidden", "weight", "bias"), got, ref_grads, strict=True):
        if r is not None:
            assert rel(g, r) < BOUND[dtype], (name, rel(g, r))


def test_the_weight_gradient_is_rounded_once_whatever_the_number_of_chunks():
    """512 row chunks: the weight gradient is exactly as far from the float64 answer as plain autograd's (one rounding
    to bf16 per element), where adding each chunk's product into a bf16 gradient on 8-row chunks is 13x
    farther. The bound tells the two apart. (8-row chunks are not Liger-Kernel's setting: with its own chunk rule the
    accumulation is 1.7-2.6x farther, benchmarks/bench_ce_rounding.py and docs/chunked-loss.md.)"""
    n, h, v = 4096, 64, 1000
    hidden, weight, _, labels = make(seed=5, ignored=0.15, n=n, h=h, v=v)
    weight = weight / h**0.5
    ref, (ref_h, ref_w, _) = rounded_reference(hidden, weight, labels, None, torch.bfloat16)
    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    F.cross_entropy((hb @ wb.t()).float(), labels, ignore_index=-100).backward()
    plain = rel(hb.grad, ref_h), rel(wb.grad, ref_w)
    out, (gh, gw, _) = ours(hidden, weight, labels, None, torch.bfloat16, chunk_size=8)
    assert rel(gh, ref_h) <= 1.01 * plain[0] and rel(gw, ref_w) <= 1.01 * plain[1], (plain, rel(gh, ref_h),
                                                                                      rel(gw, ref_w))
    # the accumulation the blocked path avoids, on the same chunks
    acc = torch.zeros_like(wb)
    count = int((labels != -100).sum())
    for s in range(0, n, 8):
        z = (hb[s:s + 8].detach() @ wb.detach().t()).float()
        y = labels[s:s + 8]
        d = torch.where((y != -100)[:, None], z.softmax(-1) - F.one_hot(y.clamp(min=0), v), 0.0) / count
        acc.addmm_(d.bfloat16().t(), hb[s:s + 8].detach())
    assert rel(acc, ref_w) > 5 * plain[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_position_ignored_gives_zero(dtype):
    h, w, b, labels = make(bias=True, ignored=1.0)
    for reduction in ("mean", "sum"):
        out, got = ours(h, w, labels, b, dtype, reduction=reduction)
        assert float(out) == 0 and all(torch.all(g == 0) for g in got)


def test_ignored_rows_get_an_exact_zero_gradient_and_their_hidden_states_do_not_matter():
    h, w, _, labels = make()
    h2 = h.clone()
    h2[labels == -100] *= 50  # different hidden states at the ignored positions only
    out, (gh, gw, _) = ours(h, w, labels, None, torch.bfloat16)
    out2, (gh2, gw2, _) = ours(h2, w, labels, None, torch.bfloat16)
    assert torch.all(gh[labels == -100] == 0) and torch.equal(out, out2) and torch.equal(gw, gw2)


def test_frozen_head_or_frozen_hidden_states():
    h, w, _, labels = make()
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16()  # a frozen head (LoRA on the body): no dW pass
    chunked_cross_entropy(hb, wb, labels).backward()
    _, (ref_h, _, _) = rounded_reference(h, w, labels, None, torch.bfloat16)
    assert rel(hb.grad, ref_h) < BOUND[torch.bfloat16]
    hb, wb = h.bfloat16(), w.bfloat16().requires_grad_()
    chunked_cross_entropy(hb, wb, labels, chunk_size=4).backward()
    _, (_, ref_w, _) = rounded_reference(h, w, labels, None, torch.bfloat16)
    assert rel(wb.grad, ref_w) < BOUND[torch.bfloat16]


def test_a_scaled_backward_and_a_second_call_accumulate():
    """loss / GAS sends 0.25 to the backward, scaled in place into the loss's own buffers; two calls add into .grad."""
    h, w, _, labels = make()
    _, (ref_h, ref_w, _) = rounded_reference(h, w, labels, None, torch.bfloat16)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    for _ in range(2):
        (chunked_cross_entropy(hb, wb, labels, chunk_size=5) * 0.25).backward()
    assert rel(hb.grad, 0.5 * ref_h) < BOUND[torch.bfloat16] and rel(wb.grad, 0.5 * ref_w) < BOUND[torch.bfloat16]


def test_hidden_in_float32_with_a_bf16_head_and_multi_dim_inputs():
    h, w, _, labels = make(n=2 * 26)
    hidden = h.float().view(2, 26, H).requires_grad_()
    loss = chunked_cross_entropy(hidden, w.bfloat16(), labels.view(2, 26), chunk_size=6)
    loss.backward()
    ref, _ = rounded_reference(h, w, labels, None, torch.bfloat16)
    assert hidden.grad.dtype == torch.float32 and hidden.grad.shape == (2, 26, H)
    assert rel(loss, ref) < 1e-5


def test_labels_out_of_range_are_a_clear_error():
    h, w, _, labels = make()
    labels[3] = V
    with pytest.raises(ValueError, match=r"labels must be in \[0, 37\)"):
        chunked_cross_entropy(h.bfloat16(), w.bfloat16(), labels)


def test_stats_on_the_blocked_path():
    h, w, b, labels = make(bias=True)
    loss, stats = chunked_cross_entropy_with_stats(h.bfloat16(), w.bfloat16(), labels, b.bfloat16(), chunk_size=6)
    logits = ((h.bfloat16() @ w.bfloat16().t()).double() + b.bfloat16().double())
    counted = labels != -100
    assert int(stats.num_valid) == int(counted.sum())
    assert int(stats.num_correct) == int(((logits.argmax(-1) == labels) & counted).sum())
    p = logits.softmax(-1)
    entropy = (-(p * p.log()).sum(-1) * counted).sum()
    assert abs(float(stats.entropy_sum) - float(entropy)) < 1e-4 * float(entropy)


def test_block_sizes():
    """Blocks stay under 0.9x the hidden states' bytes (at least 16 MiB), on CUDA (and meta, which models it), the
    largest multiple of 64 rows and vocabulary entries that does (a GEMM's leading dimension: issue 58, item 6); the
    caller's chunk_size sets the rows and the same bytes per vocabulary block."""
    mib = 2**20
    for n, v in ((8192, 128256), (32768, 151936), (8192, 32000)):
        for device in ("cuda", "meta"):
            rows, piece, cols, col_piece = block_sizes(n, 4096, v, 2, device)
            budget = 0.9 * n * 4096 * 2
            assert rows % 64 == 0 and cols % 64 == 0, (rows, cols)
            assert rows * v * 3 <= budget and (rows + 64) * v * 3 > budget
            assert cols * n * 3 <= budget and (cols + 64) * n * 3 > budget
            assert piece == -(-rows // 4) and col_piece == n // 4
    assert block_sizes(8192, 4096, 128256, 2, "cuda")[2] == 2432  # not 2457: that leading dimension ran 4.5x slower
    assert block_sizes(512, 4096, 151936, 2, "cuda")[0] == 16 * mib // (151936 * 3) // 8 * 8  # the floor (36 -> 32)
    assert block_sizes(32768, 4096, 128256, 2, "cpu")[0] == 128  # CPU's cap: 174 rows, rounded down
    assert block_sizes(53, 12, 37, 2, chunk_size=7)[:3] == (7, 2, 7 * 37 // 53)  # below 8: as they are
    assert block_sizes(1, 12, 37, 2)[:3] == (1, 1, 37)


def test_only_low_precision_scalar_reductions_take_the_blocked_path(monkeypatch):
    taken = []
    real = losses.function.blocked_pass
    monkeypatch.setattr(losses.function, "blocked_pass", lambda *a, **k: taken.append(1) or real(*a, **k))
    h, w, _, labels = make()
    chunked_cross_entropy(h.bfloat16(), w.bfloat16(), labels)
    chunked_cross_entropy(h.float(), w.float(), labels)
    chunked_cross_entropy(h.bfloat16(), w.bfloat16(), labels, reduction="none")
    assert taken == [1]
