"""A chunked cross-entropy of ``hidden @ weight.T (+ bias)`` that never builds the ``N x V`` logits and is safe
under ZeRO-3, inside or outside the engine's forward.

How (the why of each choice):
- Fused gradients. For the scalar reductions the forward computes, chunk by chunk, the loss *and* both input
  gradients (``dlogits @ W`` and ``dlogits.T @ h``); backward only scales them by the incoming gradient. That
  is three matmuls in all, like plain autograd, with one ``chunk x V`` block alive at a time and nothing to
  recompute. ``reduction="none"`` must weight each token by its own incoming gradient, so it recomputes the
  chunks in backward instead.
- Ignored positions are dropped before the matmul, so they cost nothing.
- Low precision (bf16/fp16) inputs: the matmuls run in the input dtype; softmax, the loss and the weight
  gradient accumulate in float32, and the scalar loss comes back in float32 (as plain cross-entropy's under
  autocast). On CUDA every GEMM runs on tensor cores in the input dtype with float32 accumulation
  (``torch.mm(..., out_dtype=torch.float32)``): the logits come out in float32, and each chunk's weight-gradient
  product is added into the float32 buffer, so no float32 GEMM runs (the H200 profile: 83% of the time was a
  float32 SIMT GEMM there). CPU has no such kernel and keeps the float32 accumulation it had.
- ZeRO-3. A partitioned head is gathered once around the forward (a no-op where DeepSpeed already made it
  whole, e.g. read by attribute inside ``engine.forward``), so the autograd node records its full shape.
  In backward it is gathered at most once more and kept whole until autograd has accumulated the weight's
  gradient (and DeepSpeed's reduction hook on that accumulation has run): the gradient cannot be accumulated
  into a 0-element parameter. Every rank gathers the same number of times whatever its number of chunks or
  valid tokens, because a gather is a collective (per-chunk gathers hang when ranks differ).

Nothing here knows about patching; importing this module imports torch (the public ``zerofix`` API imports
it lazily).
"""
from __future__ import annotations

import math

import torch

from zerofix import zero3

__all__ = ["chunked_cross_entropy", "default_chunk_size", "ChunkedStats"]

_REDUCTIONS = ("mean", "sum", "none")
# One chunk's float32 logits block is kept near this size: large enough that the per-chunk accumulation
# into the weight gradient stays cheap, small enough to stay a fraction of the full logits.
# CPU: 64 MiB (512 rows at V=32000): against 128 MiB, 54 MiB less peak at the same time (8.19 s against 8.08 s for
# N=8192, H=1024, fp32, 2 threads); 32 MiB took 10.3 s (benchmarks/bench_chunked_ce.py, issue 48)
_CHUNK_BYTES = 64 * 2**20
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
    budget = _CUDA_CHUNK_BYTES if device_type == "cuda" else _CHUNK_BYTES
    rows = max(1, budget // (4 * max(1, vocab_size)))
    return int(min(8192, max(64, 2 ** int(math.log2(rows)))))


class ChunkedStats:
    """Token statistics computed in the same chunk loop, without gradients (for logging)."""

    __slots__ = ("num_correct", "entropy_sum", "num_valid")

    def __init__(self, num_correct, entropy_sum, num_valid):
        self.num_correct, self.entropy_sum, self.num_valid = num_correct, entropy_sum, num_valid


class _Options:
    __slots__ = ("chunk_size", "label_smoothing", "logit_softcap", "z_loss", "logit_scale", "weight_scale",
                 "stats", "acc", "valid", "explicit_chunk")

    def __init__(self, chunk_size, label_smoothing, logit_softcap, z_loss, logit_scale, weight_scale, stats, acc,
                 valid=None, explicit_chunk=False):
        self.chunk_size = chunk_size
        self.label_smoothing = label_smoothing
        self.logit_softcap = logit_softcap
        self.z_loss = z_loss
        self.logit_scale = logit_scale
        self.weight_scale = weight_scale  # 1/denominator for the scalar reductions
        self.stats = stats
        self.acc = acc  # accumulation dtype: float32, or float64 for float64 inputs
        self.valid = valid  # the blocked path (``_blocked_pass``): every row is passed, this mask says which count
        self.explicit_chunk = explicit_chunk  # the caller chose chunk_size (else the blocked path sizes its blocks)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def lowp_gemm(tensor, acc) -> bool:
    """Whether GEMMs on ``tensor`` run in its low-precision dtype with float32 accumulation and output (CUDA, where
    ``torch.mm`` takes ``out_dtype``); else the CPU path: float32 accumulation of the weight gradient."""
    return tensor.device.type == "cuda" and tensor.dtype in _LOW_PRECISION and acc == torch.float32


def mm_f32(a, b):
    """``a @ b`` of two low-precision matrices on tensor cores, accumulated and returned in float32."""
    return torch.mm(a, b, out_dtype=torch.float32)


# (device type, input dtype) -> whether torch.addmm(acc, a, b, out_dtype=float32, out=acc) adds in place, measured once
_ADDMM_IN_PLACE: dict = {}


def add_mm_f32_(acc, a, b) -> None:
    """``acc`` (float32) += ``a @ b`` of two low-precision matrices: in place where the release's cuBLAS overload
    takes ``out=acc`` (no ``V x H`` float32 temporary per chunk: on an H100 that temporary and its add were most
    of the chunked loss's time), else through ``mm_f32``. Whether the in-place form is right is measured once per
    device type and input dtype on small matrices, not assumed from the signature."""
    kind = (acc.device.type, a.dtype)
    if kind not in _ADDMM_IN_PLACE:
        _ADDMM_IN_PLACE[kind] = _addmm_adds_in_place(acc.device, a.dtype)
    if _ADDMM_IN_PLACE[kind]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += mm_f32(a, b)


def _addmm_adds_in_place(device, dtype) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.randn(64, 32, generator=g, device=device)
    a = torch.randn(64, 48, generator=g, device=device).to(dtype)
    b = torch.randn(48, 32, generator=g, device=device).to(dtype)
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))


def _chunk_logits(h, weight, bias, opt, buf):
    """Logits of one chunk in the accumulation dtype and, with a softcap, the tanh needed for its derivative.
    ``buf`` (rows x V, reused by every chunk) saves a fresh allocation, and its page faults, per chunk."""
    if buf is not None:
        z = torch.matmul(h, weight.t(), out=buf[: h.shape[0]])
    elif lowp_gemm(weight, opt.acc):
        z = mm_f32(h, weight.t())  # float32 logits straight from the tensor cores: no rounding to bf16 between
    else:
        z = (h @ weight.t()).to(opt.acc)
    return _finish_logits(z, bias, opt)


def _chunk_loss_and_dlogits(z, t, y, opt, row_weight, want_grad, fold):
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


def _chunk_stats(z, y, lse, valid=None):
    """Correct argmax count and the sum of entropies of one chunk (z: float32 logits, before in-place use), over the
    rows ``valid`` marks (every row without it)."""
    hit = z.argmax(dim=-1) == y
    p = torch.softmax(z, dim=-1)
    entropy = lse - (p * z).sum(dim=-1)
    if valid is not None:
        hit, entropy = hit & valid, entropy * valid
    return hit.sum(), entropy.sum()


def _chunks(n, size):
    return ((s, min(n, s + size)) for s in range(0, n, size))


def _forward_pass(h, weight, bias, y, opt, row_weights, want_grads):
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
    for s, e in _chunks(n, opt.chunk_size):
        hc, yc = h[s:e], y[s:e]
        z, t = _chunk_logits(hc, weight, bias, opt, buf)
        if opt.stats:
            c, ent = _chunk_stats(z, yc, torch.logsumexp(z, dim=-1))
            correct += c
            entropy += ent
        loss, d, _ = _chunk_loss_and_dlogits(z, t, yc, opt, row_weights[s:e] if want_any else None, want_any,
                                          buf is not None)
        losses[s:e] = loss
        if isinstance(d, _Folded):
            if d.u is not None and want_h and w_sum is None:
                w_sum = weight.sum(dim=0)  # once per pass, not per chunk
            u_h = _apply_folded(d, hc, yc, weight, w_sum, grad_h[s:e] if want_h else None, grad_w, grad_b, u_h)
            continue
        # d in the input dtype, once for both products that take it: dh's, and dW's on the low-precision GEMM path
        need_low = want_h or (want_w and lowp_gemm(hc, grad_w.dtype))
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
    if lowp_gemm(hc, grad_w.dtype):
        add_mm_f32_(grad_w, (d_low if d_low is not None else d.to(hc.dtype)).t(), hc)
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


# --- The blocked path: low-precision weights, scalar reductions (issue 52) ------------------------------------------
#
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
# Elsewhere _CHUNK_BYTES. ``meta``: benchmarks/bench_ce_bytes.py accounts a GPU's step on meta tensors, sized as CUDA's.
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
        cap = _BLOCK_CAP.get(device_type, _CHUNK_BYTES)
        budget = min(cap, max(_BLOCK_FLOOR, _BLOCK_SHARE * n * hidden_size * itemsize))
    n = max(1, n)
    rows = max(1, min(n, _aligned(int(budget // (vocab_size * per_element)))))
    cols = max(1, min(vocab_size, _aligned(int(budget // (n * per_element)))))
    return rows, -(-rows // _SUB_SPLIT), cols, -(-n // _SUB_SPLIT)


def _finish_logits(z, bias, opt):
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


def _dlogits_from_lse(z, t, y_local, inside, lse, row_weight, opt, vocab):
    """d(sum_i w_i loss_i)/d(raw logits) of one vocabulary block, in place of its float32 logits ``z``, from the rows'
    log-sum-exp (pass 1's): the formula of ``_chunk_loss_and_dlogits``, with the one-hot term only where the row's
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


def _blocked_pass(h, weight, bias, y, opt, row_weights, want_grads):
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
    for s, e in _chunks(n, rows):
        block = h[s:e] @ weight.t()
        for a, b in _chunks(e - s, piece):
            i, j = s + a, s + b
            z, t = _finish_logits(block[a:b].to(acc), bias, opt)
            if opt.stats:
                c, ent = _chunk_stats(z, y[i:j], torch.logsumexp(z, dim=-1), valid[i:j])
                correct += c
                entropy += ent
            loss, d, lse = _chunk_loss_and_dlogits(z, t, y[i:j], opt, row_weights[i:j], want_h, False)
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
        for v0, v1 in _chunks(vocab, cols):
            block = h @ weight[v0:v1].t()
            for a, b in _chunks(n, col_piece):
                z, t = _finish_logits(block[a:b].to(acc), None if bias is None else bias[v0:v1], opt)
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


class _ZeRO3Hold:
    """Keeps ZeRO-3 parameters gathered in backward until autograd has accumulated their gradient.

    The release runs as a post-hook of each parameter's AccumulateGrad node: those hooks run after
    DeepSpeed's own reduction hook on the same node (registered earlier, at engine construction), so
    DeepSpeed reduces the gradient of a whole parameter and zerofix partitions it afterwards.
    """

    def __init__(self, params_needing_grad, params_read):
        self.todo = zero3.gather(*params_read, *params_needing_grad)
        self.pending = {id(p) for p in self.todo if p.requires_grad}
        self.handles = []
        with torch.enable_grad():  # backward runs with grad mode off; the node is reached through a view
            for p in self.todo:
                if id(p) in self.pending:
                    node = p.view_as(p).grad_fn.next_functions[0][0]
                    self.handles.append(node.register_hook(self._accumulated(p)))

    def _accumulated(self, p):
        def hook(*_):
            self.pending.discard(id(p))
            if not self.pending:
                self.release()
        return hook

    def release_if_no_grad(self):
        if not self.pending:
            self.release()

    def release(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        todo, self.todo = self.todo, []
        # Partition only what is still whole and not in use by a module DeepSpeed is running (a tied
        # embedding's own backward may hold it too; DeepSpeed releases it then).
        still = [p for p in todo if getattr(p.ds_status, "name", "") == "AVAILABLE"
                 and not getattr(p, "ds_active_sub_modules", None)]
        zero3.release(still)


def hand_out_fused(weight, bias, grads, grad_out):
    """Backward of a loss whose gradients (for hidden, weight, bias) were computed in its forward: scaled by the
    incoming gradient. The weight's gradient is accumulated into the parameter right after backward returns;
    under ZeRO-3 the parameter must be whole then, so it is held gathered until autograd has accumulated it."""
    grad_h, grad_w, grad_b = grads
    hold = _ZeRO3Hold([p for p, g in ((weight, grad_w), (bias, grad_b)) if g is not None], [])
    hold.release_if_no_grad()
    # Scaled in place: the buffers are this loss's own, and a copy of a V x H gradient would be one more V x H block
    # at the peak (a Trainer's loss / GAS sends no 1 here). Meta tensors (benchmarks/bench_ce_bytes.py) have no values
    # to compare.
    if grad_out.device.type == "meta" or not torch.equal(grad_out, torch.ones_like(grad_out)):
        for g in (grad_h, grad_w, grad_b):
            if g is not None:
                g.mul_(grad_out.to(g.dtype))
    return grad_h, grad_w, grad_b


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, y, opt):
        want = ctx.needs_input_grad
        fused = opt.weight_scale is not None
        want_grads = (want[0], want[1], bias is not None and want[2]) if fused else (False, False, False)
        if opt.valid is not None:  # the blocked path: every row passed, the ignored ones weighted 0
            row_weights = opt.valid.to(opt.acc) * opt.weight_scale
            losses, grads, stats = _blocked_pass(h, weight, bias, y, opt, row_weights, want_grads)
            losses = torch.where(opt.valid, losses, 0.0)
        else:
            row_weights = torch.full((h.shape[0],), 1.0 if opt.weight_scale is None else opt.weight_scale,
                                     dtype=opt.acc, device=h.device)
            losses, grads, stats = _forward_pass(h, weight, bias, y, opt, row_weights, want_grads)
        ctx.opt, ctx.fused = opt, fused
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves, for the ZeRO-3 hold in backward
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        if fused:
            grad_h, grad_w, grad_b = grads
            ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                         None if grad_b is None else grad_b.to(bias.dtype))
            out = losses.sum() * opt.weight_scale
        else:
            ctx.save_for_backward(h, weight, bias, y)
            out = losses
        ctx.mark_non_differentiable(*stats)
        return (out, *stats)

    @staticmethod
    def backward(ctx, grad_out, *_):
        if torch.is_grad_enabled():  # backward(create_graph=True): these gradients have no graph of their own
            raise RuntimeError(
                "zerofix.chunked_cross_entropy supports no double backward (create_graph=True, e.g. a gradient "
                "penalty): its gradients are computed chunk by chunk outside autograd. Use F.cross_entropy on "
                "the full logits for that term.")
        if ctx.fused:
            if ctx.grads is None:
                raise RuntimeError(
                    "zerofix.chunked_cross_entropy with reduction='mean' or 'sum' computes its gradients in the "
                    "forward and hands them out once: a second backward through the same graph "
                    "(retain_graph=True, torch.autograd.gradcheck) is not supported. Use reduction='none' and "
                    "reduce the result yourself (recomputed in backward, so it supports both), or run the forward "
                    "again.")
            grads, ctx.grads = ctx.grads, None
            return (*hand_out_fused(ctx.weight, ctx.bias, grads, grad_out), None, None)
        h, weight, bias, y = ctx.saved_tensors
        want = ctx.needs_input_grad
        needing = [p for p, w in ((weight, want[1]), (bias, want[2])) if p is not None and w]
        hold = _ZeRO3Hold(needing, [p for p in (weight, bias) if p is not None])
        try:
            _, (grad_h, grad_w, grad_b), _ = _forward_pass(
                h, weight, bias, y, ctx.opt, grad_out.to(ctx.opt.acc), (want[0], want[1], bias is not None and want[2]))
        finally:
            hold.release_if_no_grad()
        return (grad_h, None if grad_w is None else grad_w.to(ctx.weight_dtype),
                None if grad_b is None else grad_b.to(ctx.bias_dtype), None, None)


def _check(hidden, weight, labels, bias, reduction, chunk_size, label_smoothing, logit_softcap, z_loss,
           num_items_in_batch):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {', '.join(map(repr, _REDUCTIONS))}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"num_items_in_batch replaces the token count of reduction='mean'; with "
                         f"reduction={reduction!r} leave it out (divide the result yourself)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1]")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap={logit_softcap}: must be > 0 (or None for no softcap)")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss}: must be >= 0")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int (or None for the default)")
    if labels.dtype not in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"labels must hold integer class indices, got {labels.dtype}")
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match: hidden must "
                         f"be labels.shape + (hidden_size,); for a causal LM shift first "
                         f"(hidden[..., :-1, :], labels[..., 1:])")
    if weight.dim() != 2 or weight.numel() == 0:
        why = (" (a ZeRO-3 partition that zerofix could not gather: pass the parameter itself, not a copy "
               "or a view of it)") if weight.numel() == 0 else ""
        raise ValueError(f"weight must be (vocab_size, hidden_size), got {tuple(weight.shape)}{why}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be (vocab_size,) = ({weight.shape[0]},)")


def _items(num_items_in_batch, dtype) -> float:
    """num_items_in_batch as a float: a count of tokens, so finite and >= 0 (0: loss 0, gradient 0), and
    large enough that 1 / num_items_in_batch is representable in the accumulation dtype."""
    # A tensor count is read through the Trainer entry's watch when it is watched (zerofix.num_items_watch): a read
    # that only validates, which the watch must not take for a route of the count into the loss.
    peek = getattr(type(num_items_in_batch), "zerofix_value", None)
    value = float(peek(num_items_in_batch) if peek is not None else num_items_in_batch)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"num_items_in_batch={value!r}: must be a finite count >= 0 (the number of tokens the "
                         "loss is averaged over; 0 gives loss 0 and a zero gradient)")
    acc = torch.promote_types(dtype, torch.float32)
    if 0 < value and 1.0 / value > torch.finfo(acc).max:
        raise ValueError(f"num_items_in_batch={value!r}: 1/num_items_in_batch overflows {acc}; it is a token "
                         "count, pass the number of counted tokens (or 0)")
    return value


def _run(hidden, weight, labels, bias, *, ignore_index, reduction, num_items_in_batch, chunk_size,
         label_smoothing, logit_softcap, z_loss, logit_scale, stats, out_dtype=None):
    # One gather for the whole forward, never per chunk (and by every rank, even with nothing to compute).
    with zero3.gathered(weight, bias):
        _check(hidden, weight, labels, bias, reduction, chunk_size, label_smoothing, logit_softcap, z_loss,
               num_items_in_batch)
        vocab, size = weight.shape
        flat_labels = labels.reshape(-1)
        valid = flat_labels != ignore_index
        h = hidden.reshape(-1, size)
        # Low-precision weights and a scalar reduction take the blocked path (``_blocked_pass``): every row, ignored
        # ones weighted 0, so neither the hidden states nor their gradient is copied.
        blocked = reduction != "none" and weight.dtype in _LOW_PRECISION
        if blocked:
            meta = hidden.device.type == "meta"  # benchmarks/bench_ce_bytes.py: shapes, no values
            if not meta and bool((valid & ((flat_labels < 0) | (flat_labels >= vocab))).any()):
                _bad_labels(flat_labels[valid], vocab, ignore_index)
            y = flat_labels.masked_fill(~valid, 0).long()
            h_valid = h
            n_valid = valid.sum() if meta else int(valid.sum())
        else:
            y = flat_labels[valid].long()
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= vocab):
                _bad_labels(y, vocab, ignore_index)
            h_valid = h[valid]
            n_valid = y.numel()
        if h_valid.dtype != weight.dtype:
            h_valid = h_valid.to(weight.dtype)
        if reduction == "none":
            weight_scale = None
        elif reduction == "sum":
            weight_scale = 1.0
        else:
            denom = n_valid if num_items_in_batch is None else _items(num_items_in_batch, weight.dtype)
            if isinstance(denom, torch.Tensor):  # a count on the meta device: no value to test
                weight_scale = 1.0 / denom.clamp(min=1)
            else:
                weight_scale = 1.0 / denom if denom > 0 else 0.0  # no counted token anywhere: loss 0, gradient 0
            if isinstance(num_items_in_batch, torch.Tensor) and denom > 0:
                weight_scale = 1.0  # the sum, divided by the count tensor below (where a watch sees the division)
        opt = _Options(chunk_size or default_chunk_size(vocab, weight.device.type), float(label_smoothing),
                       logit_softcap, float(z_loss), float(logit_scale), weight_scale, stats,
                       torch.promote_types(weight.dtype, torch.float32), valid if blocked else None,
                       chunk_size is not None)
        out, correct, entropy = _ChunkedCE.apply(h_valid, weight, bias, y, opt)
    if reduction == "none":
        full = out.new_zeros(flat_labels.shape)
        full = full.masked_scatter(valid, out) if n_valid else full + out.sum() * 0
        out = full.view(labels.shape)
    if reduction == "mean" and isinstance(num_items_in_batch, torch.Tensor) and weight_scale == 1.0:
        # The sum divided by the count as a tensor, as transformers' own loss does: whoever follows the count through
        # torch operations (the Trainer entry's watch, zerofix.num_items_watch) sees the loss divided by it.
        out = out / num_items_in_batch.detach().to(out.device, out.dtype)
    if out_dtype is None:  # a scalar loss of low-precision inputs stays float32 (its accuracy: plain's under autocast)
        out_dtype = torch.float32 if reduction != "none" and hidden.dtype in _LOW_PRECISION else hidden.dtype
    out = out.to(out_dtype)
    # The scatter of dh back to the ignored positions is autograd's (the indexing above), so ignored
    # positions get an exact zero gradient.
    count = n_valid if isinstance(n_valid, torch.Tensor) else torch.tensor(n_valid, device=hidden.device)
    return out, ChunkedStats(correct, entropy, count)


def _bad_labels(y, vocab, ignore_index):
    raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; got values in "
                     f"[{int(y.min())}, {int(y.max())}]")


def chunked_cross_entropy(hidden, weight, labels, bias=None, *, ignore_index: int = -100,
                          reduction: str = "mean", num_items_in_batch=None, chunk_size: int | None = None,
                          label_smoothing: float = 0.0, logit_softcap: float | None = None,
                          z_loss: float = 0.0, logit_scale: float = 1.0):
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, without building the full logits.

    Equals ``F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=..., reduction=...,
    label_smoothing=...)`` with ``logits = softcap(logit_scale * (hidden @ weight.T + bias))`` and
    ``softcap(x) = c * tanh(x / c)``, plus ``z_loss * logsumexp(logits)**2`` per counted token.

    - ``hidden``: ``(..., H)``; ``labels``: the same leading shape, class indices or ``ignore_index``.
      For a causal LM, shifting is the caller's choice::

          loss = chunked_cross_entropy(h[:, :-1], model.lm_head.weight, labels[:, 1:])

    - ``reduction``: ``"mean"`` over counted tokens (0, not NaN, when there are none), ``"sum"``, or
      ``"none"`` (per position, 0 at ignored positions).
    - ``num_items_in_batch``: the Trainer's normalisation, sum of this micro-batch's token losses divided
      by this count (the counted tokens of the whole accumulation window, across ranks). ``"mean"`` only.
    - ``chunk_size``: rows per chunk (default: ``default_chunk_size(V, device)``, about 64 MiB of float32 logits
      on CPU, 1 GiB on a GPU).
    - Works with ZeRO-3 partitioned ``weight``/``bias``, inside or outside ``engine.forward``: each is
      gathered at most once in forward and once in backward, whatever the number of chunks. Every rank must
      call it the same number of times (a gather is a collective), which any data-parallel loop does.
    - bf16/fp16 inputs: matmuls in the input dtype, softmax and accumulation in float32; the result has
      the input dtype.
    """
    loss, _ = _run(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
                   num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
                   label_smoothing=label_smoothing, logit_softcap=logit_softcap, z_loss=z_loss,
                   logit_scale=logit_scale, stats=False)
    return loss


def chunked_cross_entropy_with_stats(hidden, weight, labels, bias=None, **options):
    """``chunked_cross_entropy`` plus ``ChunkedStats`` (argmax-correct count, entropy sum, counted tokens)."""
    kwargs = dict(ignore_index=-100, reduction="mean", num_items_in_batch=None, chunk_size=None,
                  label_smoothing=0.0, logit_softcap=None, z_loss=0.0, logit_scale=1.0, out_dtype=None)
    unknown = set(options) - set(kwargs)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(kwargs)}")
    kwargs.update(options)
    return _run(hidden, weight, labels, bias, stats=True, **kwargs)
