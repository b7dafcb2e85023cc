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

from zerofix.losses.blocked import block_sizes
from zerofix.losses.chunked import ChunkedStats, default_chunk_size
from zerofix.losses.function import hand_out_fused, items, run

__all__ = ["chunked_cross_entropy", "chunked_cross_entropy_with_stats", "default_chunk_size", "ChunkedStats", "block_sizes",
           "hand_out_fused", "items"]


def chunked_cross_entropy(hidden, weight, labels, bias=None, *, ignore_index: int = -100,
                          reduction: str = "mean", num_items_in_batch=None, chunk_size: int | None = None,
                          label_smoothing: float = 0.0, logit_softcap: float | None = None,
                          z_loss: float = 0.0, logit_scale: float = 1.0, accuracy: str | None = None):
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
    - ``accuracy`` (bf16/fp16 weights, ``"mean"`` / ``"sum"``, on a GPU): ``"compact"`` (the default) accumulates
      the weight gradient in the weight's dtype chunk by chunk, at Liger-Kernel's memory and accuracy; ``"accurate"``
      in a float32 buffer rounded once, plain autograd's accuracy, for that buffer's bytes. Both take three GEMMs and
      one fused Triton kernel per chunk. Where that kernel does not run (a CPU, a GPU without Triton) the weight
      gradient is rounded once without the buffer (one GEMM more), whichever is asked.
    """
    loss, _ = run(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
                   num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
                   label_smoothing=label_smoothing, logit_softcap=logit_softcap, z_loss=z_loss,
                   logit_scale=logit_scale, stats=False, accuracy=accuracy)
    return loss


def chunked_cross_entropy_with_stats(hidden, weight, labels, bias=None, **options):
    """``chunked_cross_entropy`` plus ``ChunkedStats`` (argmax-correct count, entropy sum, counted tokens)."""
    kwargs = dict(ignore_index=-100, reduction="mean", num_items_in_batch=None, chunk_size=None,
                  label_smoothing=0.0, logit_softcap=None, z_loss=0.0, logit_scale=1.0, out_dtype=None, accuracy=None)
    unknown = set(options) - set(kwargs)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(kwargs)}")
    kwargs.update(options)
    return run(hidden, weight, labels, bias, stats=True, **kwargs)
