"""zerofix: numerically correct distributed training on the library versions people pin.

``import zerofix`` is cheap: it imports no torch, deepspeed, transformers, accelerate or trl. The
public functions load their modules on first use.
"""
__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "status", "gathered", "chunked_cross_entropy", "loss_is_scaled_for_ga", "StrictError",
           "__version__"]


def patch(fixes=None, exclude=(), *, opt_in=(), strict=None):
    """Enable zerofix's fixes (``fixes``/``exclude``/``opt_in`` take lists of fix ids).

    By default every entry but the opt-in ones (entries that cannot tell their bug from a right usage:
    ``zerofix status`` says which and why); ``opt_in`` adds those named. Each fix is applied only where its
    library is installed and its version is in the affected range; fixes for libraries not imported yet are
    applied when their defining submodule is imported. Returns the status records. Calling it twice is a
    no-op. Unknown ids raise ``ValueError``.
    """
    from zerofix import patching

    if strict is None:
        from zerofix.activation import strict_from_environment

        strict = strict_from_environment()
    patching.patch(fixes, exclude, opt_in=opt_in, strict=strict)
    return patching.status()


def unpatch(fixes=None):
    """Disable fixes (all by default) and restore exactly the attributes that were there."""
    from zerofix import patching

    patching.unpatch(fixes)
    return patching.status()


def status():
    """One record per known fix: id, state, dist, installed version, affected range, reason."""
    from zerofix import patching

    return patching.status()


def loss_is_scaled_for_ga(trainer, value=True):
    """State what a Trainer's loss is, for ``transformers-trainer-scaling``: True (the default), already per
    accumulation window (your ``compute_loss`` divides it by ``gradient_accumulation_steps`` or normalises it by the
    window's count), so the Trainer's own path is followed; False, a micro-batch mean, scaled as one; None withdraws
    the statement. It wins over what zerofix measures, on every transformers release (``trainer.loss_is_scaled_for_ga``
    says the same from transformers 5.19 on)."""
    from zerofix.fixes.trainer_scaling import loss_is_scaled_for_ga as _state

    _state(trainer, value)


def gathered(*params):
    """Context manager: ZeRO-3-partitioned parameters among ``params`` are whole inside the block.

    Deduplicates by identity (tied weights), gathers only what DeepSpeed reports not available and releases
    only that; a no-op without DeepSpeed, below ZeRO-3 or for ordinary tensors. See ``zerofix.zero3``.
    """
    from zerofix.zero3 import gathered as _gathered

    return _gathered(*params)


def chunked_cross_entropy(hidden, weight, labels, bias=None, **options):
    """Cross-entropy of ``hidden @ weight.T + bias`` without the full logits, ZeRO-3 safe.

    Options: ``ignore_index``, ``reduction``, ``num_items_in_batch``, ``chunk_size``, ``label_smoothing``,
    ``logit_softcap``, ``z_loss``, ``logit_scale``, ``accuracy``; see ``zerofix.losses.chunked_cross_entropy``.
    """
    from zerofix.losses import chunked_cross_entropy as _loss

    return _loss(hidden, weight, labels, bias, **options)


def __dir__():
    return sorted(__all__)


def __getattr__(name):
    if name == "StrictError":
        from zerofix.errors import StrictError

        return StrictError
    raise AttributeError(f"module 'zerofix' has no attribute {name!r}")
