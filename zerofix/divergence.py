"""A chunked distillation divergence between a student's and a teacher's next-token distributions, computed from
their hidden states and heads without building either's ``N x V`` logits, and safe under ZeRO-3.

Per counted token (``mask != 0``), with ``s = log_softmax(x_s)``, ``t = log_softmax(x_t)`` and
``x = softcap(scale * (h @ W.T + b)) / temperature`` for each model:

- ``beta == 0``: forward KL, ``sum p_t (t - s)``;
- ``beta == 1``: reverse KL, ``sum p_s (s - t)``;
- otherwise the generalized JSD with ``m = log((1 - beta) p_s + beta p_t)``:
  ``beta * sum p_t (t - m) + (1 - beta) * sum p_s (s - m)``

(TRL's ``DistillationTrainer`` definitions). The loss is the sum over counted tokens divided by
``num_items_in_batch`` (or by the counted tokens, at least 1).

How (the why of each choice, as in ``zerofix.losses``):
- The loss is a scalar, so the forward computes, chunk by chunk, the loss *and* the student's input gradients;
  backward only scales them. Nothing is recomputed, one ``chunk x V`` block per model is alive at a time.
  With ``g = dL/ds``: ``-p_t`` (beta 0), ``p_s (s - t + 1)`` (beta 1), ``(1 - beta) p_s (s - m)`` (otherwise),
  and ``dL/dx = g - p_s * sum(g)`` through the log-softmax.
- The teacher is a fixed target: no gradient reaches its head or its hidden states.
- ZeRO-3: both heads are gathered once around the forward (only what DeepSpeed reports not available), and the
  student's at most once more in backward, kept whole until autograd has accumulated its gradient. The number of
  gathers (collectives) is the same on every rank, whatever its number of chunks or counted tokens.

Importing this module imports torch.
"""
from __future__ import annotations

import torch

from zerofix import zero3
from zerofix.losses import default_chunk_size, hand_out_fused, items

__all__ = ["chunked_divergence"]


def _logits(h, weight, bias, scale, softcap, temperature, acc):
    """Logits of one chunk in the accumulation dtype (float32, or float64 for float64 inputs) divided by the
    temperature, and d(x)/d(h @ W.T): per element with a softcap, else the constant ``scale / temperature``."""
    z = (h.to(weight.dtype) @ weight.t()).to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    if scale != 1.0:
        z = z * scale
    slope = scale / temperature
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = softcap * tanh
        slope = (1.0 - tanh * tanh) * slope
    if temperature != 1.0:
        z = z / temperature
    return z, slope


def _divergence_and_grad(s, t, beta):
    """Per-row divergence and ``g = dL/ds`` (s, t: log-probabilities)."""
    p_s = s.exp()
    p_t = t.exp()
    if beta == 0.0:
        return (p_t * (t - s)).sum(-1), -p_t, p_s
    if beta == 1.0:
        diff = s - t
        return (p_s * diff).sum(-1), p_s * (diff + 1.0), p_s
    beta_t = torch.tensor(beta, dtype=s.dtype, device=s.device)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-beta_t), t + torch.log(beta_t)]), dim=0)
    per = beta_t * (p_t * (t - m)).sum(-1) + (1 - beta_t) * (p_s * (s - m)).sum(-1)
    return per, (1 - beta_t) * p_s * (s - m), p_s


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, opt):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = b_s is not None and ctx.needs_input_grad[2]
        n = h_s.shape[0]
        grad_h = torch.empty_like(h_s) if want_h else None
        acc = opt["acc"]
        grad_w = torch.zeros(w_s.shape, dtype=acc, device=h_s.device) if want_w else None
        grad_b = torch.zeros(w_s.shape[0], dtype=acc, device=h_s.device) if want_b else None
        total = torch.zeros((), dtype=acc, device=h_s.device)
        entropy = torch.zeros((), dtype=acc, device=h_s.device)
        for start in range(0, n, opt["chunk_size"]):
            hs, ht = h_s[start:start + opt["chunk_size"]], h_t[start:start + opt["chunk_size"]]
            x_s, slope = _logits(hs, w_s, b_s, opt["s_scale"], opt["s_softcap"], opt["temperature"], acc)
            x_t, _ = _logits(ht, w_t, b_t, opt["t_scale"], opt["t_softcap"], opt["temperature"], acc)
            s = torch.log_softmax(x_s, dim=-1)
            t = torch.log_softmax(x_t, dim=-1)
            per, g, p_s = _divergence_and_grad(s, t, opt["beta"])
            total += per.sum()
            entropy -= (p_s * s).sum()
            if not (want_h or want_w or want_b):
                continue
            # dL/dx through the log-softmax, times 1/denominator, then through the temperature, scale and softcap
            d = (g - p_s * g.sum(-1, keepdim=True)) * (opt["weight"] * slope)
            if want_h:
                grad_h[start:start + hs.shape[0]] = (d.to(w_s.dtype) @ w_s).to(h_s.dtype)
            if want_w:
                grad_w.addmm_(d.t(), hs.to(acc))
            if want_b:
                grad_b += d.sum(0)
        ctx.weight, ctx.bias = w_s, b_s  # the parameters themselves, for the ZeRO-3 hold in backward
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(w_s.dtype),
                     None if grad_b is None else grad_b.to(b_s.dtype))
        ctx.mark_non_differentiable(entropy)
        return total / opt["denominator"], entropy

    @staticmethod
    def backward(ctx, grad_out, _):
        if torch.is_grad_enabled():
            raise RuntimeError("zerofix's chunked divergence supports no double backward (create_graph=True): its "
                               "gradients are computed chunk by chunk outside autograd")
        if ctx.grads is None:
            raise RuntimeError("zerofix's chunked divergence computes its gradients in the forward and hands them out "
                               "once: a second backward through the same graph (retain_graph=True) is not supported; "
                               "run the forward again")
        grads, ctx.grads = ctx.grads, None
        return (*hand_out_fused(ctx.weight, ctx.bias, grads, grad_out), None, None, None, None)


def _check(h_s, w_s, b_s, h_t, w_t, b_t, mask, beta, temperature, chunk_size):
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1] (0 forward KL, 1 reverse KL, else the generalized JSD)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int (or None for the default)")
    for name, h, w, b in (("student", h_s, w_s, b_s), ("teacher", h_t, w_t, b_t)):
        if w.dim() != 2 or w.numel() == 0:
            why = " (a ZeRO-3 partition that could not be gathered: pass the parameter itself)" if w.numel() == 0 else ""
            raise ValueError(f"the {name} head must be (vocab_size, hidden_size), got {tuple(w.shape)}{why}")
        if tuple(h.shape[:-1]) != tuple(mask.shape) or h.shape[-1] != w.shape[1]:
            raise ValueError(f"{name} hidden states {tuple(h.shape)} must be mask.shape {tuple(mask.shape)} + "
                             f"(hidden_size={w.shape[1]},)")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"the {name} bias {tuple(b.shape)} must be (vocab_size,) = ({w.shape[0]},)")
    if w_s.shape[0] != w_t.shape[0]:
        raise ValueError(f"student vocabulary {w_s.shape[0]} != teacher vocabulary {w_t.shape[0]}")


def chunked_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, mask, *, beta: float,
                       temperature: float = 1.0, student_bias=None, teacher_bias=None, student_logit_scale=1.0,
                       teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, num_items_in_batch=None,
                       chunk_size: int | None = None):
    """The distillation divergence (see the module docstring) over the positions where ``mask != 0``.

    Returns ``(loss, entropy_sum, num_valid)``: the loss (float32, float64 for float64 heads: the sum over counted
    tokens divided by ``num_items_in_batch``, or by the counted tokens, at least 1), the sum of the student's
    per-token entropies (no gradient, for logging) and the number of counted tokens (an int64 tensor). Gradients
    reach the student's hidden states, weight and bias only. Every rank must call it the same number of times (ZeRO-3 gathers
    are collectives), which a data-parallel loop does.
    """
    with zero3.gathered(student_weight, student_bias, teacher_weight, teacher_bias):
        _check(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, mask,
               float(beta), float(temperature), chunk_size)
        valid = mask.reshape(-1) != 0
        n_valid = valid.sum()
        h_s = student_hidden.reshape(-1, student_hidden.shape[-1])[valid]
        h_t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[valid].detach()
        if num_items_in_batch is None:
            denominator = n_valid.clamp(min=1).to(torch.promote_types(student_weight.dtype, torch.float32))
            weight = 1.0 / float(denominator)
        else:
            count = items(num_items_in_batch, torch.float32)
            denominator = num_items_in_batch.to(h_s.device) if torch.is_tensor(num_items_in_batch) else count
            weight = 1.0 / count if count > 0 else 0.0
        opt = {"beta": float(beta), "temperature": float(temperature), "s_scale": float(student_logit_scale),
               "t_scale": float(teacher_logit_scale), "s_softcap": student_softcap, "t_softcap": teacher_softcap,
               "chunk_size": chunk_size or default_chunk_size(student_weight.shape[0]), "weight": weight,
               "denominator": denominator, "acc": torch.promote_types(student_weight.dtype, torch.float32)}
        loss, entropy = _ChunkedDivergence.apply(h_s, student_weight, student_bias, h_t, teacher_weight,
                                                 teacher_bias, opt)
    return loss, entropy, n_valid
