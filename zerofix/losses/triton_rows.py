"""The elementwise work of one block of logits, in one Triton kernel (issue 70): per row, the log-sum-exp, the loss
(label smoothing, z-loss), optionally the argmax hit and the entropy, and ``d(sum_i w_i loss_i)/d(raw logits)``
written in place of the block, in the block's dtype, ready for the two GEMMs that take it.

The block holds raw GEMM output (``h @ W.T``, no bias); the kernel adds the bias, the scale and the softcap on the
fly, in float32, and never keeps a float32 copy of the block: pass 1 streams it for an online max and sum (and the
label's logit, the logits' sum for smoothing, the statistics), pass 2 streams it again and overwrites it with the
gradient. That is what Liger-Kernel's cross-entropy kernel does for its chunk; here a program takes ``BLOCK_R`` rows
at a time (1 on a GPU, as Liger's; more under Triton's interpreter, where each operation is a NumPy call and a
16-row tile makes the CPU tests 16x faster, the same code).

Importing this module imports Triton and compiles nothing; ``TRITON_INTERPRET=1`` must be set before the import for
the kernel to run on a CPU (``zerofix.losses.kernel`` decides where it runs).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Masked logits: finite, so a row of padding (beyond the block's rows) stays free of inf - inf
_NEG = -3.0e38


@triton.jit
def _logits(z, bias, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw float32 GEMM output plus bias (0 without one), scaled and softcapped: the logits the loss sees, and the
    tanh of the softcap (for its derivative; 0 without one)."""
    x = (z + bias) * scale
    t = x * 0.0
    if HAS_SOFTCAP:
        # tanh(a) = (e - 1) / (e + 1), e = exp(2a), a clamped where tanh is +-1 in float32 (no tanh in every
        # Triton release's language, and the interpreter's)
        a = tl.minimum(tl.maximum(x / softcap, -15.0), 15.0)
        e = tl.exp(2.0 * a)
        t = (e - 1.0) / (e + 1.0)
        x = t * softcap
    return x, t


@triton.jit
def _round_nearest_even_bf16(x):
    """float32 -> the nearest bf16 (ties to even), as a float32 that converts exactly. A GPU's conversion rounds so
    by itself; Triton's interpreter truncates (measured: twice the error), so the kernel rounds in integer
    arithmetic on both: the numbers the CPU tests check are the GPU's."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def ce_rows_kernel(z_ptr, stride_z, y_ptr, w_ptr, bias_ptr, loss_ptr, lse_ptr, hit_ptr, ent_ptr, n_rows, vocab,
                   scale, softcap, eps, z_loss,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr,
                   STATS: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = z_ptr + rows.to(tl.int64)[:, None] * stride_z
    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    m = tl.full([BLOCK_R], _NEG, tl.float32)  # running max
    s = tl.zeros([BLOCK_R], tl.float32)  # running sum of exp(x - m)
    z_y = tl.zeros([BLOCK_R], tl.float32)
    z_sum = tl.zeros([BLOCK_R], tl.float32)
    px = tl.zeros([BLOCK_R], tl.float32)  # running sum of exp(x - m) * x (the entropy's)
    best = tl.zeros([BLOCK_R], tl.int32)  # the first column of the running max (torch.argmax's tie rule)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        ok = row_ok[:, None] & col_ok[None, :]
        raw = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        b = 0.0
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        x, _ = _logits(raw, b, scale, softcap, HAS_SOFTCAP)
        x = tl.where(ok, x, _NEG)
        top = tl.max(x, 1)
        grown = tl.maximum(m, top)
        keep = tl.exp(m - grown)
        e = tl.exp(x - grown[:, None])
        s = s * keep + tl.sum(e, 1)
        if STATS:
            px = px * keep + tl.sum(tl.where(ok, e * x, 0.0), 1)
            first = tl.min(tl.where(x == top[:, None], cols[None, :], vocab), 1)
            best = tl.where(top > m, first, best)
        m = grown
        z_y += tl.sum(tl.where(cols[None, :] == y[:, None], x, 0.0), 1)
        if SMOOTH:
            z_sum += tl.sum(tl.where(ok, x, 0.0), 1)
    lse = tl.where(row_ok, m + tl.log(s), 0.0)  # padding rows: 0, so the z-loss's square stays finite
    loss = (1.0 - eps) * (lse - z_y)
    if SMOOTH:
        loss += eps * (lse - z_sum / vocab)
    if ZLOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if STATS:
        tl.store(hit_ptr + rows, (best == y).to(tl.int32), mask=row_ok)
        tl.store(ent_ptr + rows, lse - px / s, mask=row_ok)
    if WANT_GRAD:
        # d loss_i / d raw_ij = scale [p_ij (1 + 2 zl lse_i) - (1 - eps) [j == y_i] - eps / V] (1 - tanh^2), times w_i
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0) * scale
        factor = w
        if ZLOSS:
            factor = w * (1.0 + 2.0 * z_loss * lse)
        for v0 in range(0, vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < vocab
            ok = row_ok[:, None] & col_ok[None, :]
            raw = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            b = 0.0
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            x, t = _logits(raw, b, scale, softcap, HAS_SOFTCAP)
            x = tl.where(ok, x, _NEG)  # past the vocabulary: exp 0
            d = factor[:, None] * tl.exp(x - lse[:, None])
            d -= tl.where(cols[None, :] == y[:, None], (1.0 - eps) * w[:, None], 0.0)
            if SMOOTH:
                d -= (eps / vocab) * w[:, None]
            if HAS_SOFTCAP:
                d *= 1.0 - t * t
            if z_ptr.dtype.element_ty == tl.bfloat16:
                d = _round_nearest_even_bf16(d)
            tl.store(base + cols[None, :], d.to(z_ptr.dtype.element_ty), mask=ok)
