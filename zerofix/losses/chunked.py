"""The chunk-by-chunk path of the chunked loss: each chunk's logits in the accumulation dtype, its loss and both input
gradients computed in the forward (three GEMMs in all), one ``chunk x V`` block alive at a time; ``reduction="none"``
recomputes its chunks in backward. Also what every path shares: the options, the statistics, a block's loss and
``dlogits``."""
from __future__ import annotations

import math

import torch

from zerofix.losses import gemm  # by module: the tests emulate CUDA's GEMMs by replacing them there

# One chunk's float32 logits block is kept near this size: large enough that the per-chunk accumulation
# into the weight gradient stays cheap, small enough to stay a fraction of the full logits.
# CPU: 64 MiB (512 rows at V=32000): against 128 MiB, 54 MiB less peak at the same time (8.19 s against 8.08 s for
# N=8192, H=1024, fp32, 2 threads); 32 MiB took 10.3 s (benchmarks/bench_chunked_ce.py, issue 48)
CHUNK_BYTES = 64 * 2**20


_CUDA_CHUNK_BYTES = 1024 * 2**20


# Devices whose softmax kernel may write in place (measured on CPU only; elsewhere max, exp and sum).
_INPLACE_SOFTMAX_DEVICES = ("cpu",)


def default_chunk_size(vocab_size: int, device_type: str = "cpu") -> int:
    """Rows per chunk: a power of two with ``rows x vocab_size`` float32 logits near 64 MiB on CPU, near
    ``_CUDA_CHUNK_BYTES`` on a GPU (64..8192).

    Smaller chunks re-read and re-write the ``V x H`` weight gradient more often (one accumulation per
    chunk), which costs more time than the chunk's own block saves memory below this size (measured in
    ``benchmarks/bench_chunked_ce.py``). On a GPU that accumulation is the whole cost of a small chunk: at 128 rows
    of a 151936 vocabulary it was 5.7x Liger-Kernel's time (H100), so a GPU takes larger blocks.
    """
    budget = _CUDA_CHUNK_BYTES if device_type == "cuda" else CHUNK_BYTES
    rows = max(1, budget // (4 * max(1, vocab_size)))
    return int(min(8192, max(64, 2 ** int(math.log2(rows)))))


class ChunkedStats:
    """Token statistics computed in the same chunk loop, without gradients (for logging)."""

    __slots__ = ("num_correct", "entropy_sum", "num_valid")

    def __init__(self, num_correct, entropy_sum, num_valid):
        self.num_correct, self.entropy_sum, self.num_valid = num_correct, entropy_sum, num_valid


class Options:
    __slots__ = ("chunk_size", "label_smoothing", "logit_softcap", "z_loss", "logit_scale", "weight_scale",
                 "stats", "acc", "valid", "explicit_chunk", "path", "accuracy")

    def __init__(self, chunk_size, label_smoothing, logit_softcap, z_loss, logit_scale, weight_scale, stats, acc,
                 valid=None, explicit_chunk=False, path="chunked", accuracy="compact"):
        self.chunk_size = chunk_size
        self.label_smoothing = label_smoothing
        self.logit_softcap = logit_softcap
        self.z_loss = z_loss
        self.logit_scale = logit_scale
        self.weight_scale = weight_scale  # 1/denominator for the scalar reductions
        self.stats = stats
        self.acc = acc  # accumulation dtype: float32, or float64 for float64 inputs
        self.valid = valid  # the blocked path (``blocked_pass``): every row is passed, this mask says which count
        self.explicit_chunk = explicit_chunk  # the caller chose chunk_size (else the blocked path sizes its blocks)
        self.path = path  # chunked, blocked or fused (zerofix.losses.function.choose_path)
        self.accuracy = accuracy  # the fused path's weight-gradient accumulation: compact or accurate


def _chunk_logits(h, weight, bias, opt, buf):
    """Logits of one chunk in the accumulation dtype and, with a softcap, the tanh needed for its derivative.
    ``buf`` (rows x V, reused by every chunk) saves a fresh allocation, and its page faults, per chunk."""
    if buf is not None:
        z = torch.matmul(h, weight.t(), out=buf[: h.shape[0]])
    elif gemm.lowp_gemm(weight, opt.acc):
        z = gemm.mm_f32(h, weight.t())  # float32 logits straight from the tensor cores: no rounding to bf16 between
    else:
        z = (h @ weight.t()).to(opt.acc)
    return finish_logits(z, bias, opt)


def finish_logits(z, bias, opt):
    """Bias, scale and softcap of float32 logits ``z``, in place; returns (z, tanh term or None)."""
    if bias is not None:
        z += bias.to(opt.acc)
    if opt.logit_scale != 1.0:
        z *= opt.logit_scale
    t = None
    if opt.logit_softcap is not None:
        t = torch.div(z, opt.logit_softcap).tanh_()
        z = torch.mul(t, opt.logit_softcap, out=z)
    return z, t


def chunk_loss_and_dlogits(z, t, y, opt, row_weight, want_grad, fold):
    """Per-token loss of one chunk, d(sum_i w_i loss_i)/d(raw logits) in place of z (None without ``want_grad``),
    and the rows' log-sum-exp.

    Written for few passes over the ``rows x V`` block (memory bandwidth, not the matmuls, is what a chunk
    adds): max, exp in place, sum; the row scaling is left to the matmuls where possible (``_Folded``).
    """
    vocab = z.shape[-1]
    eps = opt.label_smoothing
    z_y = z.gather(1, y[:, None]).squeeze(1)
    z_mean = z.mean(dim=-1) if eps else None
    if z.device.type in _INPLACE_SOFTMAX_DEVICES:
        # ATen's CPU softmax works row by row (each row stays in cache), so it can write in place: two
        # passes over the block where max, exp and sum take four (measured 0.07 s against 0.23 s for the
        # 8 chunks of 1024 x 32000). lse from the row maximum, whose probability is >= 1/V: no underflow.
        m, top = z.max(dim=-1, keepdim=True)
        e = torch.ops.aten._softmax.out(z, -1, False, out=z)
        lse = m.squeeze(1) - e.gather(1, top).squeeze(1).log()
        total = None
    else:
        m = z.amax(dim=-1, keepdim=True)
        e = z.sub_(m).exp_()  # exp(z - max), in place of the logits
        total = e.sum(dim=-1)
        lse = total.log() + m.squeeze(1)
    loss = (1.0 - eps) * (lse - z_y)
    if eps:
        loss += eps * (lse - z_mean)
    if opt.z_loss:
        loss += opt.z_loss * lse * lse
    if not want_grad:
        return loss, None, lse
    # d loss_i / d z_ij = p_ij (1 + 2 zl lse_i) - (1 - eps) [j == y_i] - eps / V, times the row weight and
    # d z / d raw = logit_scale (1 - tanh^2):  factor_i e_ij + c_i [j == y_i] + u_i, times (1 - tanh^2).
    w = row_weight * opt.logit_scale
    factor = w if total is None else w / total
    if opt.z_loss:
        factor = factor * (1.0 + 2.0 * opt.z_loss * lse)
    c = -(1.0 - eps) * w
    u = w * (-eps / vocab) if eps else None
    if t is None and fold:
        return loss, _Folded(e, factor, c, u), lse  # the matmuls apply the row terms: no pass over the block
    d = e.mul_(factor[:, None])
    if u is not None:
        d += u[:, None]
    d.scatter_add_(1, y[:, None], c[:, None])
    if t is not None:
        d.mul_(t.mul_(t).neg_().add_(1.0))  # in place: t is not read again
    return loss, d, lse


class _Folded:
    """d = factor[:, None] * e + c * onehot(y) + u[:, None], kept factored: ``e @ W`` and ``e.T @ h`` are
    scaled by row, and the one-hot and uniform terms are added as gathers and rank-1 terms, so the
    ``rows x V`` block is never scaled in place (one pass of memory traffic fewer per chunk)."""

    __slots__ = ("e", "factor", "c", "u")

    def __init__(self, e, factor, c, u):
        self.e, self.factor, self.c, self.u = e, factor, c, u


def chunk_stats(z, y, lse, valid=None):
    """Correct argmax count and the sum of entropies of one chunk (z: float32 logits, before in-place use), over the
    rows ``valid`` marks (every row without it)."""
    hit = z.argmax(dim=-1) == y
    p = torch.softmax(z, dim=-1)
    entropy = lse - (p * z).sum(dim=-1)
    if valid is not None:
        hit, entropy = hit & valid, entropy * valid
    return hit.sum(), entropy.sum()


def chunks(n, size):
    return ((s, min(n, s + size)) for s in range(0, n, size))


def forward_pass(h, weight, bias, y, opt, row_weights, want_grads):
    """One pass over the chunks: per-token losses and, if ``want_grads`` = (dh, dW, db) flags, the gradients."""
    n = h.shape[0]
    acc = opt.acc
    losses = torch.empty(n, dtype=acc, device=h.device)
    want_h, want_w, want_b = want_grads
    want_any = want_h or want_w or want_b
    grad_h = torch.empty_like(h) if want_h else None
    rows = min(n, opt.chunk_size)
    buf = torch.empty((rows, weight.shape[0]), dtype=acc, device=h.device) if weight.dtype == acc and rows else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=h.device) if want_b else None
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    entropy = torch.zeros((), dtype=acc, device=h.device)
    u_h = None  # sum over rows of u_i h_i (the uniform label-smoothing term), added to every row of dW once
    w_sum = None  # sum of the weight's rows, for that term's share of dh
    for s, e in chunks(n, opt.chunk_size):
        hc, yc = h[s:e], y[s:e]
        z, t = _chunk_logits(hc, weight, bias, opt, buf)
        if opt.stats:
            c, ent = chunk_stats(z, yc, torch.logsumexp(z, dim=-1))
            correct += c
            entropy += ent
        loss, d, _ = chunk_loss_and_dlogits(z, t, yc, opt, row_weights[s:e] if want_any else None, want_any,
                                          buf is not None)
        losses[s:e] = loss
        if isinstance(d, _Folded):
            if d.u is not None and want_h and w_sum is None:
                w_sum = weight.sum(dim=0)  # once per pass, not per chunk
            u_h = _apply_folded(d, hc, yc, weight, w_sum, grad_h[s:e] if want_h else None, grad_w, grad_b, u_h)
            continue
        # d in the input dtype, once for both products that take it: dh's, and dW's on the low-precision GEMM path
        need_low = want_h or (want_w and gemm.lowp_gemm(hc, grad_w.dtype))
        d_low = d.to(weight.dtype) if need_low and d.dtype != weight.dtype else None
        if want_h:
            if d_low is None:
                torch.matmul(d, weight, out=grad_h[s:e])
            else:
                grad_h[s:e] = d_low @ weight
        if want_w:
            _accumulate_weight_grad(grad_w, d, hc, d_low)
        if want_b:
            grad_b += d.sum(dim=0)
    if u_h is not None:
        if grad_w is not None:
            grad_w += u_h[0][None, :]
        if grad_b is not None:
            grad_b += u_h[1]
    return losses, (grad_h, grad_w, grad_b), (correct, entropy)


def _accumulate_weight_grad(grad_w, d, hc, d_low=None) -> None:
    """grad_w (float32) += d.T @ hc: on CUDA with low-precision inputs the product runs in the input dtype on tensor
    cores and is added into the float32 buffer (no float32 GEMM); elsewhere the float32 addmm. ``d_low``: ``d``
    already in the input dtype."""
    if gemm.lowp_gemm(hc, grad_w.dtype):
        gemm.add_mm_f32_(grad_w, (d_low if d_low is not None else d.to(hc.dtype)).t(), hc)
    else:
        grad_w.addmm_(d.t(), hc.to(grad_w.dtype))


def _apply_folded(f, hc, yc, weight, w_sum, grad_h, grad_w, grad_b, u_h):
    """Gradients of one chunk from a factored ``d`` (see ``_Folded``); returns the running uniform term."""
    if grad_h is not None:
        torch.matmul(f.e, weight, out=grad_h)
        grad_h.mul_(f.factor[:, None]).add_(weight[yc] * f.c[:, None])
        if f.u is not None:
            grad_h.add_(f.u[:, None] * w_sum[None, :])
    if grad_w is not None:
        grad_w.addmm_(f.e.t(), hc * f.factor[:, None])
        grad_w.index_add_(0, yc, hc * f.c[:, None])
    if grad_b is not None:
        grad_b.addmv_(f.e.t(), f.factor)
        grad_b.index_add_(0, yc, f.c)
    if f.u is not None:
        term = (f.u @ hc, f.u.sum())
        u_h = term if u_h is None else (u_h[0] + term[0], u_h[1] + term[1])
    return u_h
