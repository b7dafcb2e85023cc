"""trl-distillation-chunked-gather-zero3: ``DistillationTrainer``'s chunked divergence under ZeRO-3.

TRL 1.10.0 - 1.14.2 compute the distillation loss in ``trl.trainer.distillation_trainer._chunked_divergence_loss``:
the counted completion positions, in chunks of ``chunk_size`` rows, each through a checkpointed ``_chunk`` that
gathers the student's and the teacher's head itself (``maybe_gather_lm_head_ctx``), and again when backward
recomputes it. Under ZeRO-3 the teacher's head is partitioned after the teacher's forward, so every chunk gathers
it twice: a rank's number of collectives follows its number of completion tokens, and completions end at EOS, so
ranks differ. Measured on CPU (gloo): the first step where the ranks' chunk counts differ aborts with "Received
data size doesn't match expected size ... collective mismatch" (NCCL waits instead: a hang).

The wrapper computes the same loss, entropy sum and counted-token count with ``zerofix.divergence`` (each head
gathered once per forward, the student's at most once more in backward, whatever the number of chunks). Where
neither head is a ZeRO-3 parameter (DDP, ZeRO-1/2, FSDP2's DTensors) it calls TRL's function, untouched. TRL 1.15.0 replaced the chunk loop with a fused kernel and
no per-chunk gathers (and dropped ``chunk_size`` from the signature).

Ambiguity list (docs/fixes.md): it reacts to TRL's chunked divergence called with a ZeRO-3-partitioned head.
Every other setting gets TRL's own function, untouched (bitwise, tests/test_trl_distillation.py).
"""
from __future__ import annotations

import inspect

from zerofix import applied, zero3
from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "trl-distillation-chunked-gather-zero3"
FIX_IDS = (FIX_ID,)
TARGET = "_chunked_divergence_loss"
# The measured signature (identical in 1.10.0 - 1.14.2)
PARAMETERS = ["student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight",
              "completion_mask", "beta", "chunk_size", "num_items_in_batch", "student_lm_head_bias",
              "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale", "student_final_logit_softcapping",
              "teacher_final_logit_softcapping", "temperature"]
GATHER_HELPER = "maybe_gather_lm_head_ctx"


def structural_check(fix_id: str, targets) -> Check:
    function = inspect.unwrap(targets[TARGET])
    params = list(inspect.signature(function).parameters)
    if params != PARAMETERS:
        return drifted(f"trl.trainer.distillation_trainer.{TARGET}{tuple(params)} is not the measured "
                       f"{tuple(PARAMETERS)}")
    chunk = getattr(inspect.getmodule(function), "_chunk", None)
    try:
        source = _inspect.source(chunk) if callable(chunk) else ""
    except (OSError, TypeError):
        source = ""
    if GATHER_HELPER not in source:
        return drifted(f"trl.trainer.distillation_trainer._chunk no longer gathers the heads per chunk "
                       f"({GATHER_HELPER} is not in its source)")
    return found(signature=inspect.signature(function))


def chunked_divergence_loss(wrapped, instance, args, kwargs):
    bound = applied.facts(FIX_ID)["signature"].bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    heads = [a[k] for k in ("student_lm_head_weight", "student_lm_head_bias", "teacher_lm_head_weight",
                            "teacher_lm_head_bias") if a[k] is not None]
    if not any(zero3.is_zero3_param(p) for p in heads):
        return wrapped(*args, **kwargs)  # no ZeRO-3 head (DDP, ZeRO-1/2, FSDP2's DTensors): TRL's own, untouched
    from zerofix.divergence import chunked_divergence

    return chunked_divergence(
        a["student_hidden_states"], a["student_lm_head_weight"], a["teacher_hidden_states"],
        a["teacher_lm_head_weight"], a["completion_mask"], beta=a["beta"], temperature=a["temperature"],
        student_bias=a["student_lm_head_bias"], teacher_bias=a["teacher_lm_head_bias"],
        student_logit_scale=a["student_logit_scale"], teacher_logit_scale=a["teacher_logit_scale"],
        student_softcap=a["student_final_logit_softcapping"], teacher_softcap=a["teacher_final_logit_softcapping"],
        num_items_in_batch=a["num_items_in_batch"], chunk_size=a["chunk_size"])
