"""The blocked path of the chunked loss (issue 52): low-precision weights, scalar reductions, nothing ``V x H`` kept
but the gradient itself, in the weight's dtype, written once."""
from __future__ import annotations

import torch

from zerofix.losses.chunked import CHUNK_BYTES, chunk_loss_and_dlogits, chunk_stats, chunks, finish_logits

# Memory. The fused path above keeps a float32 V x H weight-gradient buffer and its low-precision copy (2.4 GiB + 1.2
# GiB at V=151936, H=4096): 4x Liger-Kernel's peak on an H100. Here nothing V x H is kept but the gradient itself, in
# the weight's dtype, written once:
# - pass 1, over row chunks: the logits in the weight's dtype (as the model's own head gives them), the loss, the
#   log-sum-exp of every row, and dL/dh = dlogits @ W, one GEMM per chunk (float32 accumulation inside it);
# - pass 2, over vocabulary blocks: the same block's logits for every row again, dlogits from the saved log-sum-exp,
#   and that slice of dL/dW = dlogits.T @ h, one GEMM over all rows, written straight into the gradient.
# Each element of each gradient is one GEMM's float32 sum rounded once, as plain autograd's are (nothing is summed
# across chunks in low precision). The price is one more GEMM (the logits twice). Rows are not dropped by
# ignore_index before the GEMMs (that would copy the hidden states and their gradient): ignored rows carry weight 0.
# The float32 work on a block runs on a quarter of it at a time, written back into the block in the weight's dtype,
# so a block costs its low-precision bytes plus a quarter of them twice over.

_BLOCK_SHARE = 0.9  # of the hidden states' own bytes: what a block may keep alive (see block_sizes)


_BLOCK_FLOOR = 16 * 2**20  # a small micro-batch still takes blocks this large (fewer passes over the weight)


# Elsewhere CHUNK_BYTES. ``meta``: benchmarks/bench_ce_bytes.py accounts a GPU's step on meta tensors, sized as CUDA's.
_BLOCK_CAP = {"cuda": 1024 * 2**20, "meta": 1024 * 2**20}


_SUB_SPLIT = 4


# Rows per chunk and vocabulary entries per block are rounded down to a multiple of this (where larger): a block's
# logits have the block's width as their leading dimension, and cuBLAS runs a GEMM whose leading dimension is not a
# multiple of 8 on a slow fallback kernel (measured on an H200: 2457-entry blocks took 241 ms at 8192 x 4096 x 128256,
# 4.5x Liger-Kernel's time, sm75 CUTLASS kernels 70% of it; docs/measured/gpu-h200-2026-11-28-issue58)
_ALIGN = 64


def _aligned(size: int) -> int:
    """``size`` rounded down to a multiple of _ALIGN, or of 8 below it (a GEMM's leading dimension)."""
    step = _ALIGN if size >= _ALIGN else 8
    return size // step * step if size >= step else size


def block_sizes(n: int, hidden_size: int, vocab_size: int, itemsize: int, device_type: str = "cpu",
                float32_blocks: int = 1, chunk_size: int | None = None) -> tuple[int, int, int, int]:
    """(rows per chunk of pass 1, rows per float32 piece of it, vocabulary entries per block of pass 2, rows per
    float32 piece of that block) for the blocked path.

    A block keeps alive its logits in the weight's dtype (``itemsize``) and ``float32_blocks`` float32 pieces of a
    quarter of it (1; 2 with a softcap, 3 more with statistics). Its bytes stay under 0.9x the hidden states' own
    (N x H x itemsize) and at least 16 MiB, so a step's peak grows by the two gradients and less than one
    hidden-sized block: Liger-Kernel's Triton kernel keeps one low-precision logits chunk of about the hidden's size
    (``next_pow2(N / ceil(V / H))`` rows). ``chunk_size``: the caller's rows per chunk, and the same bytes per block.
    Both are rounded down to a multiple of 64 (8 below it: ``_aligned``), which GEMMs on a GPU need to run fast.
    """
    per_element = itemsize + 4.0 * float32_blocks / _SUB_SPLIT
    if chunk_size is not None:
        budget = chunk_size * vocab_size * per_element
    else:
        cap = _BLOCK_CAP.get(device_type, CHUNK_BYTES)
        budget = min(cap, max(_BLOCK_FLOOR, _BLOCK_SHARE * n * hidden_size * itemsize))
    n = max(1, n)
    rows = max(1, min(n, _aligned(int(budget // (vocab_size * per_element)))))
    cols = max(1, min(vocab_size, _aligned(int(budget // (n * per_element)))))
    return rows, -(-rows // _SUB_SPLIT), cols, -(-n // _SUB_SPLIT)


def _dlogits_from_lse(z, t, y_local, inside, lse, row_weight, opt, vocab):
    """d(sum_i w_i loss_i)/d(raw logits) of one vocabulary block, in place of its float32 logits ``z``, from the rows'
    log-sum-exp (pass 1's): the formula of ``chunk_loss_and_dlogits``, with the one-hot term only where the row's
    label falls inside the block (``inside``; ``y_local`` its column there)."""
    eps = opt.label_smoothing
    w = row_weight * opt.logit_scale
    factor = w * (1.0 + 2.0 * opt.z_loss * lse) if opt.z_loss else w
    d = z.sub_(lse[:, None]).exp_().mul_(factor[:, None])
    if eps:
        d += (w * (-eps / vocab))[:, None]
    c = (-(1.0 - eps) * w) * inside
    d.scatter_add_(1, y_local[:, None], c[:, None])
    if t is not None:
        d.mul_(t.mul_(t).neg_().add_(1.0))
    return d


def blocked_pass(h, weight, bias, y, opt, row_weights, want_grads):
    """The blocked path's forward (see above): per-row losses, the gradients asked for (dh, dW in the weight's dtype,
    db in float32) and the statistics over the rows ``opt.valid`` marks."""
    n, vocab = h.shape[0], weight.shape[0]
    acc, valid = opt.acc, opt.valid
    want_h, want_w, want_b = want_grads
    float32_blocks = 1 + (opt.logit_softcap is not None) + 3 * bool(opt.stats)
    rows, piece, cols, col_piece = block_sizes(n, h.shape[1], vocab, weight.element_size(), h.device.type,
                                               float32_blocks, opt.chunk_size if opt.explicit_chunk else None)
    losses = torch.empty(n, dtype=acc, device=h.device)
    lse_all = torch.empty(n, dtype=acc, device=h.device) if want_w or want_b else None
    grad_h = torch.empty_like(h) if want_h else None
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    entropy = torch.zeros((), dtype=acc, device=h.device)
    for s, e in chunks(n, rows):
        block = h[s:e] @ weight.t()
        for a, b in chunks(e - s, piece):
            i, j = s + a, s + b
            z, t = finish_logits(block[a:b].to(acc), bias, opt)
            if opt.stats:
                c, ent = chunk_stats(z, y[i:j], torch.logsumexp(z, dim=-1), valid[i:j])
                correct += c
                entropy += ent
            loss, d, lse = chunk_loss_and_dlogits(z, t, y[i:j], opt, row_weights[i:j], want_h, False)
            losses[i:j] = loss
            if lse_all is not None:
                lse_all[i:j] = lse
            if want_h:
                block[a:b] = d
            del z, t, d
        if want_h:
            torch.matmul(block, weight, out=grad_h[s:e])
        del block
    grad_w = torch.empty_like(weight) if want_w else None
    grad_b = torch.zeros(vocab, dtype=acc, device=h.device) if want_b else None
    if want_w or want_b:
        for v0, v1 in chunks(vocab, cols):
            block = h @ weight[v0:v1].t()
            for a, b in chunks(n, col_piece):
                z, t = finish_logits(block[a:b].to(acc), None if bias is None else bias[v0:v1], opt)
                local = y[a:b] - v0
                inside = (local >= 0) & (local < v1 - v0)
                d = _dlogits_from_lse(z, t, local.clamp(0, v1 - v0 - 1), inside, lse_all[a:b], row_weights[a:b], opt,
                                      vocab)
                if want_b:
                    grad_b[v0:v1] += d.sum(dim=0)
                block[a:b] = d
                del z, t, d
            if want_w:
                torch.matmul(block.t(), h, out=grad_w[v0:v1])
            del block
    return losses, (grad_h, grad_w, grad_b), (correct, entropy)
