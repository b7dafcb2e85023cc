"""deepspeed-bf16-loss-scale: bf16 through FP16_UnfusedOptimizer, a loss scale nobody applied and gradients never zeroed.

From 0.17.6, ZeRO-0 in bf16 (DeepSpeed's ``DDP_BFLOAT16`` wrapper) trains through ``FP16_UnfusedOptimizer``, the
fp16 optimizer, which knows nothing of bf16: it keeps fp16's dynamic loss scale (65536) and divides every gradient
by it in ``step()``. Up to 0.18.4 the engine also builds it for ZeRO-1 bf16 with an fp32 gradient accumulator (the
constants ``BFLOAT16`` and ``DDP_BFLOAT16`` are both "bf16" and the engine tests the second first). Two bugs follow
(DeepSpeed #7837, fixed in 0.18.6 by PR #7839: no loss scale for bf16, and ``zero_grad`` for bf16 without ZeRO):

- 0.18.3 - 0.18.5: ``engine.backward`` calls ``loss.backward()`` itself, never the optimizer's ``backward``, so the
  loss is never multiplied by the scale the step divides by: every update is 65536 times too small (no update).
  0.17.6 - 0.18.2 scale the loss in ``optimizer.backward``: the update is right, but the gradient norm the engine
  reports (``get_global_grad_norm()``, the Trainer's ``grad_norm``) is the scaled one, 65536 times too large.
- 0.17.6 - 0.18.5: ``_take_model_step`` zeroes the gradients of a bf16 engine only under ZeRO, so under ZeRO-0
  every window's gradient carries all earlier windows' (measured 0.18.2: update error 0.76 in the second window).

Measured, 2 ranks, ZeRO-0 bf16, DeepSpeed's own loop at GAS=4: 0.17.5 right (no such optimizer), 0.17.6 - 0.18.2
the second window carried and the norm x65536, 0.18.3 - 0.18.5 no update at all, 0.18.6 right.

zerofix does what 0.18.6 does, from outside, to an ``FP16_UnfusedOptimizer`` whose parameters are bf16 (so never in
fp16): when the engine builds it, and again when a checkpoint is loaded into it (one saved by an unpatched run holds
the scale), its loss scale is a static 1.0, as 0.18.6's ``LossScaleConfig`` makes it for bf16 (the optimizer's
``backward`` multiplies by 1.0, its ``step`` divides by 1.0, its norm is the gradient's); and after the engine's
``_take_model_step`` of such an engine without ZeRO, the optimizer's ``zero_grad()`` runs, as it does inside
0.18.6's (nothing between the two reads a gradient).

Ambiguity list (docs/fixes.md): none. The entry reads nothing of the user's loop, only the optimizer DeepSpeed
built: bf16 never wants a loss scale (DeepSpeed's bf16 configuration has none; its BF16_Optimizer and 0.18.6's
optimizers use none), and no DeepSpeed usage keeps gradients across ``step()``: its docs and 0.18.6's engine zero
them at every optimizer step, in bf16 as in fp32. Left as they were (tests/test_deepspeed_accumulation.py): fp16
(the optimizer's parameters are fp16), fp32, ``BF16_Optimizer``, ZeRO-1/2/3's optimizers, and DeepSpeed's
``FP16_Optimizer`` (FusedAdam), which already drops the scale for bf16 and frees its gradients in ``step()``.
"""
from __future__ import annotations

import ast

from zerofix.fixes import _inspect
from zerofix.fixes._changes import Changes
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-bf16-loss-scale"
FIX_IDS = (FIX_ID,)
CONFIGURE = "DeepSpeedEngine._configure_fp16_optimizer"
STEP = "DeepSpeedEngine._take_model_step"
LOAD = "FP16_UnfusedOptimizer.load_state_dict"
# loss scales dropped (an optimizer built or loaded), gradients zeroed after a step (none: no bf16
# FP16_UnfusedOptimizer met)
_changes = Changes("scales_dropped", "steps_zeroed")
runtime_details = _changes.runtime_details
reset_runtime = _changes.reset_runtime


def structural_check(fix_id: str, targets) -> Check:
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    # 0.18.6 tells the optimizer its dtype (low_precision_dtype / loss_scale_config); before, it cannot know bf16
    known = set(_inspect.parameter_names(FP16_UnfusedOptimizer.__init__, "FP16_UnfusedOptimizer.__init__"))
    if known & {"low_precision_dtype", "loss_scale_config"}:
        return drifted("FP16_UnfusedOptimizer is told its dtype: not the release measured broken")
    for attribute in ("cur_scale", "dynamic_loss_scale"):
        if attribute not in _inspect.self_attributes(FP16_UnfusedOptimizer.__init__):
            return drifted(f"FP16_UnfusedOptimizer no longer sets self.{attribute}")
    if "low_precision_dtype" not in _inspect.parameter_names(targets[CONFIGURE], CONFIGURE):
        return drifted(f"{CONFIGURE} takes no low_precision_dtype: not the release measured broken")
    drift = zero_grad_gate_drift(_inspect.undecorated(targets[STEP], STEP))
    return drifted(drift) if drift else found()


def zero_grad_gate_drift(func) -> str | None:
    """None when ``func`` is the step measured broken: under ``if self.bfloat16_enabled():`` it calls the
    optimizer's ``zero_grad`` only behind ``self.zero_optimization()`` (0.18.6 drops that test). Else what differs.
    The source is parsed, never executed."""
    try:
        tree = _inspect.source_tree(func)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"{STEP}: source unavailable, cannot verify it is the broken one ({exc})"
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _calls(node.test, "bfloat16_enabled"):
            inner = [n for n in node.body if isinstance(n, ast.If)]
            if inner and _calls(inner[0].test, "zero_optimization"):
                return None
            return f"{STEP} zeroes a bf16 engine's gradients without testing zero_optimization(): not the broken one"
    return f"{STEP} has no bf16 branch for zeroing gradients"


def _calls(node, method: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method
               for n in ast.walk(node))


def trains_bf16(optimizer) -> bool:
    """Whether ``optimizer`` is an FP16_UnfusedOptimizer over bf16 parameters (fp16 ones keep their loss scale)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    import torch

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return False
    return any(p.dtype == torch.bfloat16 for group in optimizer.fp16_groups for p in group)


def drop_loss_scale(optimizer) -> None:
    """0.18.6's loss scale for bf16: static 1.0 (LossScaleConfig: no grad scaling unless fp16)."""
    optimizer.dynamic_loss_scale = False
    optimizer.cur_scale = 1.0
    _changes.count("scales_dropped")


def configure_fp16_optimizer(wrapped, engine, args, kwargs):
    optimizer = wrapped(*args, **kwargs)
    if trains_bf16(optimizer):
        drop_loss_scale(optimizer)
    return optimizer


def load_state_dict(wrapped, optimizer, args, kwargs):
    result = wrapped(*args, **kwargs)
    if trains_bf16(optimizer):  # a checkpoint of an unpatched run brings the scale back
        drop_loss_scale(optimizer)
    return result


def take_model_step(wrapped, engine, args, kwargs):
    result = wrapped(*args, **kwargs)
    optimizer = getattr(engine, "optimizer", None)
    if trains_bf16(optimizer) and not engine.zero_optimization():
        optimizer.zero_grad()  # where 0.18.6's _take_model_step zeroes it: after step(), before the next backward
        _changes.count("steps_zeroed")
    return result
