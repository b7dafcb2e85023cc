"""The three-GEMM path of the chunked loss (issue 70): low-precision weights and a scalar reduction where the fused
kernel runs (CUDA; a CPU under Triton's interpreter, for the tests). Per chunk of rows:

1. the logits GEMM, once, in the weight's dtype (``h @ W.T``, as the model's own head gives them);
2. the fused kernel (``zerofix.losses.triton_rows``): loss, log-sum-exp and ``dlogits`` in place of the logits;
3. ``dh = dlogits @ W`` into the chunk's rows of the hidden gradient, and ``dW += dlogits.T @ h``.

Three GEMMs, as Liger-Kernel's and plain autograd's, against the blocked path's four (it computes the logits twice to
round the weight gradient once without a float32 buffer). The weight gradient's accumulation is the accuracy policy:

- ``compact``: accumulated in the weight's dtype, chunk by chunk (Liger-Kernel's choice): nothing ``V x H`` but the
  gradient itself, each element rounded once per chunk;
- ``accurate``: accumulated in a float32 buffer and rounded once (plain autograd's accuracy), at the cost of that
  buffer (2x the weight's bytes, plus the rounded copy).

Chunks follow Liger-Kernel's rule: ``next_pow2(N / ceil(V / H))`` rows, so a chunk's logits are about the hidden
states' own size; a caller's ``chunk_size`` wins. Rows are not dropped by ``ignore_index`` (as on the blocked path):
ignored rows carry weight 0.
"""
from __future__ import annotations

import torch

from zerofix.losses import gemm, kernel
from zerofix.losses.chunked import chunks

POLICIES = ("compact", "accurate")


def chunk_rows(n: int, hidden_size: int, vocab_size: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: the caller's, else Liger-Kernel's rule (logits about the hidden states' size), a power of two
    (a GEMM's leading dimension a multiple of 8 wherever it is one)."""
    if chunk_size is not None:
        return max(1, min(n, chunk_size))
    factor = -(-vocab_size // max(1, hidden_size))
    rows = -(-max(1, n) // factor)
    return min(max(1, n), 1 << (rows - 1).bit_length())


def fused_pass(h, weight, bias, y, opt, row_weights, want_grads, policy: str = "compact", shape=None):
    """Per-row losses, the gradients asked for (dh in h's dtype; dW in the weight's dtype for ``compact``, float32
    for ``accurate``; db in float32) and the statistics over the rows ``opt.valid`` marks. ``shape``: the kernel's
    launch shape (the tests' choice), else its own."""
    if policy not in POLICIES:
        raise ValueError(f"accuracy={policy!r}: use one of {', '.join(map(repr, POLICIES))}")
    n, vocab = h.shape[0], weight.shape[0]
    want_h, want_w, want_b = want_grads
    want_grad = want_h or want_w or want_b
    rows = chunk_rows(n, h.shape[1], vocab, opt.chunk_size if opt.explicit_chunk else None)
    losses = torch.empty(n, dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    accurate = policy == "accurate"
    grad_w = None
    if want_w:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if accurate else weight.dtype, device=h.device)
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=h.device) if want_b else None
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    entropy = torch.zeros((), dtype=torch.float32, device=h.device)
    weights = row_weights.to(torch.float32).contiguous()
    labels = y.contiguous()
    for s, e in chunks(n, rows):
        hc = h[s:e]
        block = hc @ weight.t()  # GEMM 1, in the weight's dtype
        loss, _, stats = kernel.rows_loss_and_dlogits(block, labels[s:e], weights[s:e], bias, opt, want_grad,
                                                      opt.stats, shape)
        losses[s:e] = loss
        if stats is not None:
            hit, ent = stats
            correct += (hit.bool() & opt.valid[s:e]).sum()
            entropy += (ent * opt.valid[s:e]).sum()
        if want_h:
            torch.matmul(block, weight, out=grad_h[s:e])  # GEMM 2
        if want_w:  # GEMM 3
            if accurate and gemm.lowp_gemm(hc, torch.float32):
                gemm.add_mm_f32_(grad_w, block.t(), hc)
            elif accurate:
                grad_w.addmm_(block.t().to(torch.float32), hc.to(torch.float32))
            else:
                grad_w.addmm_(block.t(), hc)
        if want_b:
            grad_b += block.sum(dim=0, dtype=torch.float32)
        del block
    return losses, (grad_h, grad_w, grad_b), (correct, entropy)
