"""deepspeed-bf16-boundary-reduction: bf16 with an fp32 gradient accumulator reduces the boundary micro-batch.

ZeRO-1 in bf16 with ``"data_types": {"grad_accum_dtype": "fp32"}`` (and no offload) runs DeepSpeed's
``BF16_Optimizer``: each backward's bf16 gradients are added into an fp32 accumulator by
``BF16_Optimizer.backward_epilogue()`` (unless ``immediate_grad_update``, off by default, adds them during the
backward). From 0.18.3, ``DeepSpeedEngine._backward_epilogue`` calls ``allreduce_gradients()`` first and the
optimizer's ``backward_epilogue()`` after it, so at a boundary the all-reduce averages the accumulator before
the boundary micro-batch is in it: that micro-batch reaches the update unaveraged, each rank's own in the
partition the rank owns. Measured on 0.18.9, 2 ranks, DeepSpeed's own loop: update error 0.56 at GAS=4 and
1.02 at GAS=1 (every micro-batch is a boundary, nothing is averaged). 0.18.0 - 0.18.2 add the gradients inside
``optimizer.backward()``, before the all-reduce; 0.19.0 (DeepSpeed PR #7985) calls the BF16 optimizer's
``backward_epilogue()`` before ``allreduce_gradients()``. On 0.18.3 and 0.18.4 the method is broken but that
configuration does not reach it: the engine builds FP16_UnfusedOptimizer instead (its constants BFLOAT16 and
DDP_BFLOAT16 are both "bf16" until 0.18.5), and the wrapper passes every other optimizer through.

zerofix does the same from outside: around ``_backward_epilogue`` of an engine whose optimizer is a
``BF16_Optimizer`` it runs the optimizer's ``backward_epilogue()`` first and makes the call inside DeepSpeed's
method do nothing for its duration (an instance attribute that shadows the method, removed afterwards).
Everything else (the reduction, ``exit_backward``, the timers) is DeepSpeed's own code in its own order; only
the optimizer's epilogue runs before the backward timers switch from "inner" to "reduce", a difference of the
timers' attribution when ``wall_clock_breakdown`` is on.

Ambiguity list (docs/fixes.md): none. The entry reads nothing about the user's loop: every backward through
an engine with a ``BF16_Optimizer`` runs in 0.19.0's order, whatever loop produced it. Usages where the order
cannot matter stay as they were: no all-reduce in the call (``no_sync()``, pipeline engines, which reduce
after the schedule, a non-boundary ZeRO-1 micro-step), ``immediate_grad_update`` (the optimizer's epilogue adds
nothing), and every engine with another optimizer (fp32, bf16 without the fp32 accumulator, ZeRO-2/3, optimizer
offload) is passed through untouched (tests/test_deepspeed_bf16.py).
"""
from __future__ import annotations

import ast

from zerofix.fixes import _inspect
from zerofix.fixes._changes import Changes
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-bf16-boundary-reduction"
FIX_IDS = (FIX_ID,)
QUALNAME = "DeepSpeedEngine._backward_epilogue"
_MISSING = object()


def structural_check(fix_id: str, targets) -> Check:
    drift = drift_from_broken(_inspect.undecorated(targets[QUALNAME], QUALNAME))
    if drift:
        return drifted(drift)
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not issubclass(BF16_Optimizer, ZeROOptimizer):
        return drifted("BF16_Optimizer is not a ZeROOptimizer: the engine's epilogue does not call it")
    if "update_hp_grads" not in _called_methods(BF16_Optimizer.backward_epilogue):
        return drifted("BF16_Optimizer.backward_epilogue no longer adds the gradients into the fp32 accumulator")
    return found()


def drift_from_broken(func) -> str | None:
    """None when ``func`` is the epilogue measured broken: it calls ``self.allreduce_gradients()`` before
    ``self.optimizer.backward_epilogue()`` and does not single out the BF16 optimizer (0.19.0 does). Else what
    differs. The source is parsed, never executed."""
    try:
        tree = _inspect.source_tree(func)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"{QUALNAME}: source unavailable, cannot verify it is the broken one ({exc})"
    if any(isinstance(n, ast.Name) and n.id == "BF16_Optimizer" for n in ast.walk(tree)):
        return f"{QUALNAME} already treats BF16_Optimizer apart: not the broken one"
    first = {}  # the line of each call's first occurrence (ast.walk goes breadth-first, not in line order)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            first[name] = min(first.get(name, node.lineno), node.lineno)
    if "self.optimizer.backward_epilogue" not in first:
        return f"{QUALNAME} does not call the optimizer's backward_epilogue (0.18.0 - 0.18.2 do it in backward)"
    if "self.allreduce_gradients" not in first:
        return f"{QUALNAME} does not call allreduce_gradients"
    if first["self.allreduce_gradients"] > first["self.optimizer.backward_epilogue"]:
        return f"{QUALNAME} reduces after the optimizer's epilogue: not the broken order"
    return None


def _call_name(node: ast.Call) -> str:
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _called_methods(func) -> set[str]:
    try:
        tree = _inspect.source_tree(func)
    except (OSError, TypeError, SyntaxError):
        return set()
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


# how many backward epilogues ran the optimizer's part before the reduction (none: no BF16_Optimizer met)
_changes = Changes("epilogues_moved")
runtime_details = _changes.runtime_details
reset_runtime = _changes.reset_runtime


def _nothing(*args, **kwargs):
    """Stands in for the BF16 optimizer's backward_epilogue inside the engine's epilogue: it already ran."""


def backward_epilogue(wrapped, engine, args, kwargs):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, BF16_Optimizer):
        return wrapped(*args, **kwargs)
    optimizer.backward_epilogue()  # the micro-batch into the fp32 accumulator, before the all-reduce reads it
    _changes.count("epilogues_moved")
    shadowed = optimizer.__dict__.get("backward_epilogue", _MISSING)
    optimizer.__dict__["backward_epilogue"] = _nothing
    try:
        return wrapped(*args, **kwargs)
    finally:
        if shadowed is _MISSING:
            optimizer.__dict__.pop("backward_epilogue", None)
        else:
            optimizer.__dict__["backward_epilogue"] = shadowed
