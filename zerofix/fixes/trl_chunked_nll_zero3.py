"""trl-chunked-nll-zero3: ``SFTTrainer(loss_type="chunked_nll")`` under ZeRO-3, outside a gathering forward.

TRL 1.4.0 - 1.5.1 compute the chunked loss in ``trl.trainer.sft_trainer._chunked_cross_entropy_loss``,
which multiplies each chunk by ``lm_head.weight`` as it finds it. Under ZeRO-3 that parameter is a
0-element shard unless DeepSpeed gathered it: it does inside ``engine.forward`` (DeepSpeed >= 0.16 gathers
a parameter read by attribute there), but not in an evaluation step on DeepSpeed < 0.16, nor in a
``compute_loss`` override that runs the decoder and then this loss. There it crashes with ``size
mismatch, got input (..), mat (..), vec (0)``, the ``n_valid == 0`` fallback included. TRL 1.6.0 (#5873)
gathers per chunk instead, which fails in backward outside the engine (TRL #6372) and hangs when ranks
have different chunk counts (TRL #6696).

The wrapper computes the same quantities with ``zerofix.losses`` (one gather of the head per forward and
per backward, whatever the number of chunks): the loss, the argmax-correct count, the entropy sum and the
number of counted tokens, with TRL's shift, ``-100`` masking, ``num_items_in_batch`` normalisation,
``logit_scale`` and ``final_logit_softcapping``. The statistics are for logging and carry no gradient (TRL's
entropy sum has one, but the Trainer only logs it).

trl-chunked-nll-gather-zero3 (TRL 1.6.0 - 1.14.2) wraps the same function, whose signature did not change:
there each chunk gathers the head itself (``_maybe_gather_lm_head_ctx`` / ``maybe_gather_lm_head_ctx``
around the chunk's matmul, again when the checkpointed chunk is recomputed in backward), so a rank's number
of gathers, a collective, follows its number of counted tokens. The wrapper's gathers do not.
TRL 1.15.0 made ``chunked_nll`` an alias of ``nll`` and removed the function.

Both hand a head that is not a ZeRO-3 parameter (no DeepSpeed, ZeRO-1/2, DDP) to TRL's own function, untouched:
only ZeRO-3 is broken.

Ambiguity list (docs/fixes.md): it reacts to TRL's chunked loss called with a ZeRO-3-partitioned head. DDP,
ZeRO-1/2, FSDP2 and a head that is already whole get TRL's own function, untouched.
"""
from __future__ import annotations

import inspect

from zerofix import applied, zero3
from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "trl-chunked-nll-zero3"
GATHER_FIX_ID = "trl-chunked-nll-gather-zero3"
FIX_IDS = (FIX_ID, GATHER_FIX_ID)
TARGET = "_chunked_cross_entropy_loss"
# The measured signature (identical in 1.4.0 - 1.14.2).
PARAMETERS = ["hidden_states", "lm_head_weight", "chunk_size", "labels", "shift_labels", "num_items_in_batch",
              "logit_scale", "final_logit_softcapping", "lm_head_bias"]
# The per-chunk helper that gathers the head (1.6.0 - 1.8.0 private, public from 1.9.0)
GATHER_HELPERS = ("_maybe_gather_lm_head_ctx", "maybe_gather_lm_head_ctx")


def structural_check(fix_id: str, targets) -> Check:
    function = inspect.unwrap(targets[TARGET])
    params = list(inspect.signature(function).parameters)
    if params != PARAMETERS:
        return drifted(f"trl.trainer.sft_trainer.{TARGET}{tuple(params)} is not the measured {tuple(PARAMETERS)}")
    if fix_id == GATHER_FIX_ID:
        chunk = getattr(inspect.getmodule(function), "_chunk", None)
        try:
            source = _inspect.source(chunk) if callable(chunk) else ""
        except (OSError, TypeError):
            source = ""
        if not any(helper in source for helper in GATHER_HELPERS):
            return drifted(f"trl.trainer.sft_trainer._chunk no longer gathers the head per chunk "
                           f"(none of {GATHER_HELPERS} in its source)")
    return found(signature=inspect.signature(function))


def chunked_cross_entropy_loss(wrapped, instance, args, kwargs):
    """trl-chunked-nll-zero3 (TRL 1.4.0 - 1.5.1)."""
    return _zero3_safe(FIX_ID, wrapped, args, kwargs)


def per_chunk_gather_loss(wrapped, instance, args, kwargs):
    """trl-chunked-nll-gather-zero3 (TRL 1.6.0 - 1.14.2): the same computation, gathered once per pass."""
    return _zero3_safe(GATHER_FIX_ID, wrapped, args, kwargs)


def _zero3_safe(fix_id, wrapped, args, kwargs):
    bound = applied.facts(fix_id)["signature"].bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a["labels"] is None and a["shift_labels"] is None:
        return wrapped(*args, **kwargs)  # TRL's own error message
    if not any(zero3.is_zero3_param(p) for p in (a["lm_head_weight"], a["lm_head_bias"]) if p is not None):
        return wrapped(*args, **kwargs)  # no ZeRO-3 head: TRL's own computation is right, and left untouched
    import torch

    from zerofix.losses import chunked_cross_entropy_with_stats

    hidden = a["hidden_states"]
    if a["shift_labels"] is not None:  # pre-shifted (context / sequence parallelism) wins, as in TRL
        hidden, labels = hidden.reshape(-1, hidden.size(-1)), a["shift_labels"].reshape(-1)
    else:
        hidden, labels = hidden[..., :-1, :].reshape(-1, hidden.size(-1)), a["labels"][..., 1:].reshape(-1)
    loss, stats = chunked_cross_entropy_with_stats(
        hidden, a["lm_head_weight"], labels, a["lm_head_bias"], ignore_index=-100, reduction="mean",
        num_items_in_batch=a["num_items_in_batch"], chunk_size=a["chunk_size"], logit_scale=a["logit_scale"],
        logit_softcap=a["final_logit_softcapping"], out_dtype=torch.float32)
    return loss, stats.num_correct.float(), stats.entropy_sum.float(), stats.num_valid
