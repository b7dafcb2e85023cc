"""zerofix.divergence.chunked_divergence against the definition on the full logits (float64, autograd), no
distributed run. The reference is written the way TRL's DistillationTrainer writes it (F.kl_div with
log-probability targets); the chunked code computes its gradients by hand, so they are checked too."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zerofix.divergence import chunked_divergence  # noqa: E402

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

B, K, H_S, H_T, V = 3, 11, 12, 9, 29  # the teacher may be wider or narrower; only the vocabulary is shared


def logits(h, w, b, scale, softcap, temperature):
    z = h @ w.t()
    if b is not None:
        z = z + b
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference(h_s, w_s, h_t, w_t, mask, *, beta, temperature=1.0, student_bias=None, teacher_bias=None,
              student_logit_scale=1.0, teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None,
              num_items_in_batch=None):
    s = F.log_softmax(logits(h_s, w_s, student_bias, student_logit_scale, student_softcap, temperature), -1)
    t = F.log_softmax(logits(h_t, w_t, teacher_bias, teacher_logit_scale, teacher_softcap, temperature), -1)
    if beta == 0.0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1.0:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log1p(-beta_t), t + torch.log(beta_t)]), dim=0)
        jsd = beta_t * F.kl_div(m, t, reduction="none", log_target=True) + (1 - beta_t) * F.kl_div(
            m, s, reduction="none", log_target=True)
    valid = (mask != 0).to(s.dtype)
    total = (jsd.sum(-1) * valid).sum()
    entropy = (-(s.exp() * s).sum(-1) * valid).sum()
    denom = valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return total / denom, entropy, int(valid.sum())


def make(seed=0, dtype=torch.float64, masked=0.3, bias=False):
    g = torch.Generator().manual_seed(seed)
    t = {"h_s": torch.randn(B, K, H_S, generator=g), "w_s": torch.randn(V, H_S, generator=g) * 0.5,
         "h_t": torch.randn(B, K, H_T, generator=g), "w_t": torch.randn(V, H_T, generator=g) * 0.5,
         "b_s": torch.randn(V, generator=g) if bias else None, "b_t": torch.randn(V, generator=g) if bias else None}
    mask = (torch.rand(B, K, generator=g) >= masked).long()
    return {k: None if v is None else v.to(dtype).requires_grad_(k in ("h_s", "w_s", "b_s")) for k, v in t.items()}, mask


def both(t, mask, chunk_size, **options):
    got = chunked_divergence(t["h_s"], t["w_s"], t["h_t"], t["w_t"], mask, student_bias=t["b_s"],
                             teacher_bias=t["b_t"], chunk_size=chunk_size, **options)
    r = {k: None if v is None else v.detach().double().requires_grad_(v.requires_grad) for k, v in t.items()}
    want = reference(r["h_s"], r["w_s"], r["h_t"], r["w_t"], mask, student_bias=r["b_s"], teacher_bias=r["b_t"],
                     **options)
    return got, want, r


def grads_match(t, r, tol):
    for k in ("h_s", "w_s", "b_s"):
        if t[k] is None:
            continue
        err = float((t[k].grad.double() - r[k].grad).abs().max() / r[k].grad.abs().max().clamp(min=1e-300))
        assert err < tol, (k, err)


@pytest.mark.parametrize("beta,chunk_size", list(itertools.product((0.0, 0.5, 0.9, 1.0), (1, 4, 1000))))
def test_loss_entropy_count_and_gradients_equal_the_definition(beta, chunk_size):
    t, mask = make(seed=int(beta * 10) + chunk_size)
    (loss, entropy, n), (ref, ref_entropy, ref_n), r = both(t, mask, chunk_size, beta=beta)
    assert int(n) == ref_n and n.dtype == torch.int64
    assert float(abs(loss - ref) / ref) < 1e-12
    assert float(abs(entropy - ref_entropy) / ref_entropy) < 1e-12
    assert not entropy.requires_grad  # for logging only
    (loss * 3).backward()  # an incoming gradient other than 1
    (ref * 3).backward()
    grads_match(t, r, 1e-10)
    assert t["h_t"].grad is None and t["w_t"].grad is None  # the teacher is a fixed target


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_temperature_scale_softcap_bias_and_num_items(beta):
    options = dict(beta=beta, temperature=2.0, student_logit_scale=0.7, teacher_logit_scale=1.3, student_softcap=3.0,
                   teacher_softcap=2.5, num_items_in_batch=torch.tensor(17.5, dtype=torch.float64))
    t, mask = make(seed=3, bias=True)
    (loss, entropy, _), (ref, ref_entropy, _), r = both(t, mask, 5, **options)
    assert float(abs(loss - ref) / ref) < 1e-12 and float(abs(entropy - ref_entropy) / ref_entropy) < 1e-12
    loss.backward()
    ref.backward()
    grads_match(t, r, 1e-10)


def test_float32_within_float32_rounding():
    t, mask = make(seed=5, dtype=torch.float32)
    (loss, _, _), (ref, _, _), r = both(t, mask, 4, beta=0.5)
    assert loss.dtype == torch.float32 and float(abs(loss.double() - ref) / ref) < 1e-5
    loss.backward()
    ref.backward()
    grads_match(t, r, 1e-4)


def test_nothing_counted_gives_zero_loss_and_zero_gradients():
    t, mask = make(seed=1)
    loss, entropy, n = chunked_divergence(t["h_s"], t["w_s"], t["h_t"], t["w_t"], torch.zeros_like(mask), beta=0.5,
                                          chunk_size=4)
    assert float(loss) == 0.0 and float(entropy) == 0.0 and int(n) == 0
    loss.backward()
    assert torch.count_nonzero(t["w_s"].grad) == 0 and torch.count_nonzero(t["h_s"].grad) == 0


def test_masked_positions_get_exact_zero_gradient():
    t, mask = make(seed=2)
    loss, _, _ = chunked_divergence(t["h_s"], t["w_s"], t["h_t"], t["w_t"], mask, beta=0.5, chunk_size=3)
    loss.backward()
    assert torch.count_nonzero(t["h_s"].grad[mask == 0]) == 0


@pytest.mark.parametrize("change,message", [
    (dict(beta=1.5), "beta=1.5: must be in"),
    (dict(temperature=0.0), "temperature=0.0: must be > 0"),
    (dict(chunk_size=0), "chunk_size=0: must be a positive int"),
    (dict(w_t=torch.randn(V + 1, H_T)), "student vocabulary"),
    (dict(h_t=torch.randn(B, K, H_S)), "teacher hidden states"),
    (dict(w_s=torch.empty(0)), "could not be gathered"),
])
def test_bad_input_names_the_fix(change, message):
    t, mask = make()
    args = {"h_s": t["h_s"], "w_s": t["w_s"], "h_t": t["h_t"], "w_t": t["w_t"], "beta": 0.5, "temperature": 1.0,
            "chunk_size": 4}
    args.update({k: (v.double() if torch.is_tensor(v) else v) for k, v in change.items()})
    with pytest.raises(ValueError, match=message):
        chunked_divergence(args["h_s"], args["w_s"], args["h_t"], args["w_t"], mask, beta=args["beta"],
                           temperature=args["temperature"], chunk_size=args["chunk_size"])


def test_a_second_backward_through_the_same_graph_is_refused():
    t, mask = make()
    loss, _, _ = chunked_divergence(t["h_s"], t["w_s"], t["h_t"], t["w_t"], mask, beta=0.5, chunk_size=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="hands them out once"):
        loss.backward()
