"""The chunked loss as one autograd Function: its forward runs a path (``chunked``, ``blocked`` or ``fused``, chosen by
``choose_path``) and keeps the gradients it computed; its backward hands them out scaled by the incoming gradient, the ZeRO-3 head held whole until
autograd has accumulated its gradient (``zerofix.zero3.Hold``). Also the checks of what a caller passes."""
from __future__ import annotations

import math

import torch

from zerofix import zero3
from zerofix.losses import kernel
from zerofix.losses.blocked import blocked_pass
from zerofix.losses.chunked import ChunkedStats, Options, default_chunk_size, forward_pass
from zerofix.losses.fused import POLICIES, fused_pass
from zerofix.losses.gemm import LOW_PRECISION

_REDUCTIONS = ("mean", "sum", "none")


def choose_path(device_type: str, weight_dtype, reduction: str) -> str:
    """``fused`` (three GEMMs and the fused kernel: low-precision weights, a scalar reduction, where the kernel runs:
    CUDA, or a CPU under Triton's interpreter), ``blocked`` (the same inputs elsewhere: four GEMMs, the weight gradient
    rounded once without a float32 buffer) or ``chunked`` (float32 / float64 weights, or ``reduction="none"``)."""
    if reduction == "none" or weight_dtype not in LOW_PRECISION:
        return "chunked"
    return "fused" if kernel.runs_on(device_type) else "blocked"


def hand_out_fused(weight, bias, grads, grad_out):
    """Backward of a loss whose gradients (for hidden, weight, bias) were computed in its forward: scaled by the
    incoming gradient. The weight's gradient is accumulated into the parameter right after backward returns;
    under ZeRO-3 the parameter must be whole then, so it is held gathered until autograd has accumulated it."""
    grad_h, grad_w, grad_b = grads
    hold = zero3.Hold([p for p, g in ((weight, grad_w), (bias, grad_b)) if g is not None], [])
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
        if opt.valid is not None:  # the blocked and fused paths: every row passed, the ignored ones weighted 0
            row_weights = opt.valid.to(opt.acc) * opt.weight_scale
            if opt.path == "fused":
                losses, grads, stats = fused_pass(h, weight, bias, y, opt, row_weights, want_grads, opt.accuracy)
            else:
                losses, grads, stats = blocked_pass(h, weight, bias, y, opt, row_weights, want_grads)
            losses = torch.where(opt.valid, losses, 0.0)
        else:
            row_weights = torch.full((h.shape[0],), 1.0 if opt.weight_scale is None else opt.weight_scale,
                                     dtype=opt.acc, device=h.device)
            losses, grads, stats = forward_pass(h, weight, bias, y, opt, row_weights, want_grads)
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
        hold = zero3.Hold(needing, [p for p in (weight, bias) if p is not None])
        try:
            _, (grad_h, grad_w, grad_b), _ = forward_pass(
                h, weight, bias, y, ctx.opt, grad_out.to(ctx.opt.acc), (want[0], want[1], bias is not None and want[2]))
        finally:
            hold.release_if_no_grad()
        return (grad_h, None if grad_w is None else grad_w.to(ctx.weight_dtype),
                None if grad_b is None else grad_b.to(ctx.bias_dtype), None, None)


def _check(hidden, weight, labels, bias, reduction, chunk_size, label_smoothing, logit_softcap, z_loss,
           num_items_in_batch, accuracy=None):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {', '.join(map(repr, _REDUCTIONS))}")
    if accuracy is not None and accuracy not in POLICIES:
        raise ValueError(f"accuracy={accuracy!r}: use one of {', '.join(map(repr, POLICIES))}, or None for "
                         f"'compact'")
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


def items(num_items_in_batch, dtype) -> float:
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


def run(hidden, weight, labels, bias, *, ignore_index, reduction, num_items_in_batch, chunk_size,
         label_smoothing, logit_softcap, z_loss, logit_scale, stats, out_dtype=None, accuracy=None):
    # One gather for the whole forward, never per chunk (and by every rank, even with nothing to compute).
    with zero3.gathered(weight, bias):
        _check(hidden, weight, labels, bias, reduction, chunk_size, label_smoothing, logit_softcap, z_loss,
               num_items_in_batch, accuracy)
        vocab, size = weight.shape
        flat_labels = labels.reshape(-1)
        valid = flat_labels != ignore_index
        h = hidden.reshape(-1, size)
        # Low-precision weights and a scalar reduction take the fused or the blocked path: every row, ignored ones
        # weighted 0, so neither the hidden states nor their gradient is copied.
        path = choose_path(weight.device.type, weight.dtype, reduction)
        blocked = path != "chunked"
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
            denom = n_valid if num_items_in_batch is None else items(num_items_in_batch, weight.dtype)
            if isinstance(denom, torch.Tensor):  # a count on the meta device: no value to test
                weight_scale = 1.0 / denom.clamp(min=1)
            else:
                weight_scale = 1.0 / denom if denom > 0 else 0.0  # no counted token anywhere: loss 0, gradient 0
            if isinstance(num_items_in_batch, torch.Tensor) and denom > 0:
                weight_scale = 1.0  # the sum, divided by the count tensor below (where a watch sees the division)
        opt = Options(chunk_size or default_chunk_size(vocab, weight.device.type), float(label_smoothing),
                       logit_softcap, float(z_loss), float(logit_scale), weight_scale, stats,
                       torch.promote_types(weight.dtype, torch.float32), valid if blocked else None,
                       chunk_size is not None, path, accuracy or "compact")
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
        out_dtype = torch.float32 if reduction != "none" and hidden.dtype in LOW_PRECISION else hidden.dtype
    out = out.to(out_dtype)
    # The scatter of dh back to the ignored positions is autograd's (the indexing above), so ignored
    # positions get an exact zero gradient.
    count = n_valid if isinstance(n_valid, torch.Tensor) else torch.tensor(n_valid, device=hidden.device)
    return out, ChunkedStats(correct, entropy, count)


def _bad_labels(y, vocab, ignore_index):
    raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; got values in "
                     f"[{int(y.min())}, {int(y.max())}]")
