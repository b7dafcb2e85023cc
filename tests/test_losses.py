"""chunked_cross_entropy against F.cross_entropy on the full logits (float64 reference), no distributed run."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zerofix.losses import chunked_cross_entropy, chunked_cross_entropy_with_stats, default_chunk_size  # noqa: E402

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

N, H, V = 53, 12, 37  # N is prime: no chunk size below it divides it


def reference(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean", num_items_in_batch=None,
              label_smoothing=0.0, logit_softcap=None, z_loss=0.0, logit_scale=1.0):
    """The definition, on the full logits, in whatever dtype the inputs have."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits * logit_scale
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    flat, y = logits.reshape(-1, weight.shape[0]), labels.reshape(-1)
    counted = y != ignore_index
    per_token = F.cross_entropy(flat, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    per_token = per_token + z_loss * torch.logsumexp(flat, -1) ** 2 * counted
    if reduction == "none":
        return per_token.view(labels.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    denom = counted.sum() if num_items_in_batch is None else num_items_in_batch
    return total / denom if denom > 0 else total * 0


def make(seed=0, dtype=torch.float64, ignored=0.2, bias=False, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = -100
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return (*leaves, labels)


def grads_of(fn, hidden, weight, bias, labels, upstream_seed=1, **kw):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    out = fn(hidden, weight, labels, bias, **kw)
    # reduction="none": a random upstream gradient, so per-token weighting is checked too
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    up = up.to(out.dtype)
    (out * up).sum().backward()
    return out.detach(), [None if t is None else t.grad.detach().clone() for t in (hidden, weight, bias)]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


OPTIONS = [dict(zip(("reduction", "num_items_in_batch", "label_smoothing", "logit_softcap", "z_loss",
                     "logit_scale", "chunk_size", "bias"), combo, strict=True))
           for combo in itertools.product(("mean", "sum", "none"), (None, 61), (0.0, 0.1), (None, 3.0),
                                          (0.0, 1e-2), (1.0, 0.5), (None, 7, 1, 64), (False, True))
           if not (combo[1] is not None and combo[0] != "mean")]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parity_with_full_logits_float64_reference(opts):
    opts = dict(opts)
    bias = opts.pop("bias")
    chunk = opts.pop("chunk_size")
    h64, w64, b64, labels = make(bias=bias)
    ref, ref_grads = grads_of(reference, h64, w64, b64, labels, **opts)
    for dtype, bound in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        h, w, b, _ = make(bias=bias, dtype=dtype)
        out, got = grads_of(chunked_cross_entropy, h, w, b, labels, chunk_size=chunk, **opts)
        assert out.dtype == dtype
        assert rel(out, ref) < bound, (dtype, "loss", rel(out, ref))
        for name, g, r in zip(("hidden", "weight", "bias"), got, ref_grads, strict=True):
            if r is not None:
                assert rel(g, r) < bound, (dtype, name, rel(g, r))


def test_a_wrong_implementation_fails_the_parity_check():
    """The comparison can fail: a 1e-5 change in the loss scale is 10x over the fp32 bound."""
    h, w, b, labels = make()
    ref, _ = grads_of(reference, h, w, b, labels)
    out, _ = grads_of(chunked_cross_entropy, h, w, b, labels, logit_scale=1 + 1e-5)
    assert rel(out, ref) > 1e-6


def test_multi_dim_inputs_and_causal_shift_example():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (2, 9), generator=g)
    labels[0, :4] = -100
    loss = chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], chunk_size=4)
    loss.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = reference(hidden[:, :-1], weight, labels[:, 1:])
    ref.backward()
    assert rel(loss, ref) < 1e-12 and rel(gh, hidden.grad) < 1e-12 and rel(gw, weight.grad) < 1e-12
    assert torch.all(gh[:, -1] == 0)  # the last position predicts nothing after the shift


def test_tied_embedding_gets_both_gradients():
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N,), generator=g)
    labels = torch.roll(ids, -1)
    for fn in (reference, chunked_cross_entropy):
        emb.grad = None
        hidden = torch.tanh(emb[ids])
        fn(hidden, emb, labels).backward()
        if fn is reference:
            ref = emb.grad.clone()
    assert rel(emb.grad, ref) < 1e-12


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_position_ignored_gives_zero_loss_and_zero_gradients(reduction):
    h, w, b, labels = make(bias=True, ignored=1.0, dtype=torch.float32)
    assert (labels == -100).all()
    out = chunked_cross_entropy(h, w, labels, b, reduction=reduction)
    out.sum().backward()
    assert torch.all(out == 0) and not torch.isnan(out).any()
    for t in (h, w, b):
        assert t.grad is not None and torch.all(t.grad == 0)


def test_num_items_in_batch_zero_gives_zero_not_nan():
    h, w, _, labels = make(ignored=1.0)
    out = chunked_cross_entropy(h, w, labels, num_items_in_batch=torch.tensor(0))
    out.backward()
    assert out.item() == 0 and torch.all(w.grad == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    h64, w64, b64, labels = make(bias=True)
    ref, ref_grads = grads_of(reference, h64, w64, b64, labels, label_smoothing=0.1, z_loss=1e-3)
    # The fair reference for low precision: the same rounded inputs, float64 maths.
    hq, wq, bq = (t.detach().to(dtype).double().requires_grad_() for t in (h64, w64, b64))
    refq, refq_grads = grads_of(reference, hq, wq, bq, labels, label_smoothing=0.1, z_loss=1e-3)
    h, w, b = (t.detach().to(dtype).requires_grad_() for t in (h64, w64, b64))
    out, got = grads_of(chunked_cross_entropy, h, w, b, labels, chunk_size=5, label_smoothing=0.1, z_loss=1e-3)
    # the scalar loss in float32 (issue 41: plain's accuracy, not rounded to bf16), the gradients in the input dtype
    assert out.dtype == torch.float32 and all(g.dtype == dtype for g in got)
    # logits rounded to the input dtype once per chunk: a few ulps of bf16/fp16, nothing that grows with N
    bound = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert rel(out, refq) < bound
    for g, r in zip(got, refq_grads, strict=True):
        assert rel(g, r) < bound
    assert rel(out, ref) < 5 * bound  # and close to the unrounded problem


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gpu_gemm_path_on_cpu(monkeypatch, dtype):
    """Issue 41: on CUDA every GEMM of a low-precision input on the chunked path (reduction="none"; the scalar
    reductions take the blocked path) runs in its dtype with float32 accumulation (torch.mm(..., out_dtype=float32),
    which CPU lacks). Here that path runs on CPU with the kernel emulated exactly (products of the rounded inputs,
    accumulated in float32): every chunk's logits and weight-gradient product go through it with low-precision
    operands, no float32 GEMM runs, and the result is as accurate as the CPU path."""
    from zerofix import losses

    calls = []

    def emulated(a, b):
        calls.append((a.dtype, b.dtype))
        return a.float() @ b.float()

    monkeypatch.setattr(losses.gemm, "lowp_gemm", lambda tensor, acc: tensor.dtype == dtype and acc == torch.float32)
    monkeypatch.setattr(losses.gemm, "mm_f32", emulated)
    h64, w64, b64, labels = make(bias=True)
    hq, wq, bq = (t.detach().to(dtype).double().requires_grad_() for t in (h64, w64, b64))
    kw = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    refq, refq_grads = grads_of(reference, hq, wq, bq, labels, **kw)
    h, w, b = (t.detach().to(dtype).requires_grad_() for t in (h64, w64, b64))
    out, got = grads_of(chunked_cross_entropy, h, w, b, labels, chunk_size=5, **kw)
    chunks = -(-int((labels != -100).sum()) // 5)
    # forward: the logits per chunk; backward (recomputed): the logits, then the weight-gradient product
    assert calls == [(dtype, dtype)] * (3 * chunks)
    assert all(g.dtype == dtype for g in got)
    bound = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert rel(out, refq) < bound  # per-token losses in the input dtype
    for g, r in zip(got, refq_grads, strict=True):
        assert rel(g, r) < bound


def test_the_cpu_path_keeps_float32_gemms():
    from zerofix import losses

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert not losses.gemm.lowp_gemm(torch.zeros(1, dtype=dtype), torch.float32)


def test_stats_match_the_full_logits():
    h, w, b, labels = make(bias=True)
    loss, stats = chunked_cross_entropy_with_stats(h, w, labels, b, chunk_size=6)
    logits = h @ w.t() + b
    counted = labels != -100
    assert int(stats.num_valid) == int(counted.sum())
    assert int(stats.num_correct) == int(((logits.argmax(-1) == labels) & counted).sum())
    p = logits.softmax(-1)
    entropy = (-(p * p.log()).sum(-1) * counted).sum()
    assert abs(float(stats.entropy_sum) - float(entropy)) < 1e-5 * float(entropy)


def test_no_grad_forward_matches():
    h, w, b, labels = make(bias=True)
    with torch.no_grad():
        out = chunked_cross_entropy(h, w, labels, b, chunk_size=5)
    assert rel(out, reference(h, w, labels, b).detach()) < 1e-12


def test_an_in_place_accumulation_is_used_only_where_it_measures_right(monkeypatch):
    """zerofix.losses.add_mm_f32_: the in-place cuBLAS form is taken only where a small measured case adds right; an
    overload that overwrote the accumulator (out aliasing input) or is missing falls back to acc += mm_f32(a, b)."""
    from zerofix import losses

    cpu = torch.device("cpu")
    assert losses.gemm.addmm_adds_in_place(cpu, torch.bfloat16) is False  # CPU has no out_dtype kernel
    real = torch.addmm

    def overwrites(acc, a, b, *, out_dtype, out):
        out.copy_(a.float() @ b.float())  # the accumulator lost: a wrong in-place form

    def adds(acc, a, b, *, out_dtype, out):
        out.add_(a.float() @ b.float())

    monkeypatch.setattr(torch, "addmm", overwrites)
    assert losses.gemm.addmm_adds_in_place(cpu, torch.bfloat16) is False
    monkeypatch.setattr(torch, "addmm", adds)
    assert losses.gemm.addmm_adds_in_place(cpu, torch.bfloat16) is True
    monkeypatch.setattr(torch, "addmm", real)
    monkeypatch.setattr(losses.gemm, "ADDMM_IN_PLACE", {("cpu", torch.bfloat16): False})
    monkeypatch.setattr(losses.gemm, "mm_f32", lambda a, b: a.float() @ b.float())
    acc, a, b = torch.ones(4, 3), torch.randn(4, 5).bfloat16(), torch.randn(5, 3).bfloat16()
    want = acc + a.float() @ b.float()
    losses.gemm.add_mm_f32_(acc, a, b)
    assert torch.equal(acc, want)


def test_default_chunk_size():
    # a GPU takes larger blocks: its weight-gradient accumulation per chunk is what a small chunk costs there
    assert default_chunk_size(151936, "cuda") == 1024 and default_chunk_size(32000, "cuda") == 8192
    assert default_chunk_size(32000) == 512  # 64 MiB of float32 logits on CPU (issue 48)
    assert default_chunk_size(10) == 8192 and default_chunk_size(10**7) == 64


@pytest.mark.parametrize("kwargs, message", [
    (dict(reduction="avg"), "reduction='avg'"),
    (dict(reduction="sum", num_items_in_batch=3), "num_items_in_batch replaces"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(z_loss=-1.0), "z_loss"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_options_name_the_fix(kwargs, message):
    h, w, _, labels = make()
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(h, w, labels, **kwargs)


def test_bad_shapes_and_labels_name_the_fix():
    h, w, _, labels = make()
    with pytest.raises(ValueError, match="causal LM shift first"):
        chunked_cross_entropy(h[:-1], w, labels)
    with pytest.raises(ValueError, match="does not match hidden size"):
        chunked_cross_entropy(h, w[:, :-1], labels)
    with pytest.raises(ValueError, match="ZeRO-3 partition"):
        chunked_cross_entropy(h, torch.empty(0), labels)
    bad = labels.clone()
    bad[0] = V
    with pytest.raises(ValueError, match=r"labels must be in \[0, 37\)"):
        chunked_cross_entropy(h, w, bad)
    with pytest.raises(TypeError, match="integer class indices"):
        chunked_cross_entropy(h, w, labels.double())


def test_gathered_is_a_no_op_for_ordinary_tensors_and_rejects_modules():
    import zerofix

    w = torch.ones(3, 2)
    with zerofix.gathered(w, None, [w]):
        assert w.shape == (3, 2)
    with pytest.raises(TypeError, match="not the module itself"):
        with zerofix.gathered(torch.nn.Linear(2, 3)):
            pass


@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-2, logit_scale=0.5),
                                     dict(reduction="none"), dict(logit_softcap=3.0)])
def test_the_path_without_in_place_softmax_matches_too(monkeypatch, options):
    """Off CPU the chunk uses max, exp and sum instead of the in-place softmax: same numbers."""
    from zerofix import losses

    h64, w64, b64, labels = make(bias=True)
    ref, ref_grads = grads_of(reference, h64, w64, b64, labels, **options)
    monkeypatch.setattr(losses.chunked, "_INPLACE_SOFTMAX_DEVICES", ())
    out, got = grads_of(chunked_cross_entropy, *make(bias=True), chunk_size=7, **options)
    assert rel(out, ref) < 1e-12 and all(rel(g, r) < 1e-12 for g, r in zip(got, ref_grads, strict=True))


# ----------------------------------------------------------------------------- zerofix's own edges
def test_num_items_in_batch_zero_with_counted_tokens_gives_a_zero_gradient():
    """Documented: 0 counted items means loss 0 and a zero gradient (it used to give reduction='sum''s)."""
    h, w, _, labels = make(ignored=0.2)
    out = chunked_cross_entropy(h, w, labels, num_items_in_batch=0)
    out.backward()
    assert out.item() == 0
    assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), -float("inf"), 1e-300])
def test_invalid_num_items_in_batch_is_a_value_error(value):
    h, w, _, labels = make(dtype=torch.float32)  # 1e-300: 1/1e-300 overflows float32
    with pytest.raises(ValueError, match="num_items_in_batch"):
        chunked_cross_entropy(h, w, labels, num_items_in_batch=value)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_double_backward_raises_instead_of_a_gradient_without_graph(reduction):
    h, w, _, labels = make()
    out = chunked_cross_entropy(h, w, labels, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(out, h, create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_second_backward_through_a_fused_loss_names_the_fix(reduction):
    h, w, _, labels = make()
    out = chunked_cross_entropy(h, w, labels, reduction=reduction)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="reduction='none'"):
        out.backward()


def test_reduction_none_supports_retain_graph_and_gradcheck():
    h, w, _, labels = make(n=7)
    out = chunked_cross_entropy(h, w, labels, reduction="none").sum()
    out.backward(retain_graph=True)
    first = h.grad.clone()
    out.backward()
    assert torch.allclose(h.grad, 2 * first)
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, labels, reduction="none"),
                                    (h.detach().requires_grad_(), w.detach().requires_grad_()))
