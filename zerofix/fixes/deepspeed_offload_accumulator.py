"""deepspeed-offload-accumulator: ZeRO-2 with optimizer offload keeps every micro-batch of a window.

With ``offload_optimizer`` and config GAS > 1, ZeRO-2 reduces every backward and carries the window in a
CPU buffer per parameter: ``DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu`` adds the buffer
to this micro-step's gradient and should store the sum back. From 0.15.2 (DeepSpeed #6550) to 0.18.9 it
stores only at the window's first micro-step (``micro_step_id == 0``) and merely adds at the others, so the
buffer keeps the first micro-batch and the boundary applies first + last: the middle micro-batches of
every window are lost, and the gradient norm with them. That is DeepSpeed's own loop (backward + step per
micro-batch), hence every Trainer / Accelerate run with ZeRO-2 + CPU offload and GAS > 2. Measured
(2 ranks, GAS=4, SGD): update error 0.889, exactly the first + last micro-batch (3.7e-7) on 0.15.4,
0.16.3, 0.18.0, 0.18.3 and 0.18.9. DeepSpeed 0.19.0 (#7967) stores the sum at every micro-step.

zerofix wraps the method and, after DeepSpeed's own accumulation ran, stores the accumulated gradient in
the CPU buffer when ``micro_step_id > 0``: the statement 0.19.0 runs there, with the same slice
(``low_precision_master_weights_and_grads`` / ``fp16_master_weights_and_gradients`` keep a slice). Only
at ZeRO-2: ZeRO-1 reduces once per window, at the boundary, so it calls this method once per window with
``micro_step_id > 0`` and never at 0 to restart the buffer; a store there would carry each window into the
next (measured on 0.15.4: update error 0.76 where DeepSpeed is right). ZeRO-1 never reads the missing store.

Ambiguity list (docs/fixes.md): none. It stores the CPU accumulator at every micro-step as 0.19.0 does; where
the broken release was right (ZeRO-1, GAS <= 2) the result is bitwise DeepSpeed's (the offload probes of
tests/test_deepspeed_accumulation.py).
"""
from __future__ import annotations

import ast
import inspect

from zerofix import applied
from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-offload-accumulator"
FIX_IDS = (FIX_ID,)
TARGET = "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu"
# the flag that makes the CPU buffer hold only this partition's slice (renamed in 0.17)
_SLICED = ("low_precision_master_weights_and_grads", "fp16_master_weights_and_gradients")


def structural_check(fix_id: str, targets) -> Check:
    drift = drift_from_broken(targets[TARGET])
    if drift:
        return drifted(drift)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for name in ("get_param_id", "get_param_gradient_attribute"):
        if not callable(getattr(DeepSpeedZeroOptimizer, name, None)):
            return drifted(f"DeepSpeedZeroOptimizer.{name} is gone")
    init = _inspect.source(DeepSpeedZeroOptimizer.__init__)
    for name in ("partition_gradients", "accumulated_grads_in_cpu", "grad_position"):
        if f"self.{name} =" not in init:
            return drifted(f"DeepSpeedZeroOptimizer no longer sets self.{name}")
    # the flag the method itself tests (both names are in some sources' __init__)
    source = _inspect.source(targets[TARGET])
    sliced = next((name for name in _SLICED if f"self.{name}" in source), None)
    if sliced is None:
        return drifted(f"{TARGET} no longer tests a low-precision master-weights flag")
    return found(sliced=sliced)


def drift_from_broken(func) -> str | None:
    """None when ``func`` is the method measured broken: ``copy_gradients_to_cpu()`` runs only in the
    ``else`` of ``if self.micro_step_id > 0: accumulate_gradients()``. Else what differs (parsed, never run)."""
    try:
        tree = _inspect.source_tree(func)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"{TARGET}: source unavailable, cannot verify it is the broken one ({exc})"
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "micro_step_id" in _attributes(node.test):
            if "accumulate_gradients" in _calls(node.body) and "copy_gradients_to_cpu" in _calls(node.orelse):
                return None
            return f"{TARGET} already stores the accumulated gradient at every micro-step: not the broken one"
    return f"{TARGET} no longer branches on micro_step_id the way 0.15.2-0.18.9 do"


def _attributes(node) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _calls(body) -> set[str]:
    return {n.func.id for stmt in body for n in ast.walk(stmt)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def accumulate(wrapped, optimizer, args, kwargs):
    result = wrapped(*args, **kwargs)
    # DeepSpeed added the buffer to this micro-step's gradient: store the sum back (ZeRO-2 only, see above)
    if optimizer.micro_step_id > 0 and optimizer.partition_gradients:
        param = args[0] if args else kwargs["param"]
        param_id = optimizer.get_param_id(param)
        grad = optimizer.get_param_gradient_attribute(param).data.view(-1)
        if getattr(optimizer, applied.facts(FIX_ID)["sliced"]):
            _, source_offset, _, num_elements = optimizer.grad_position[param_id]
            grad = grad.narrow(0, source_offset, num_elements)
        optimizer.accumulated_grads_in_cpu[param_id].data.copy_(grad, non_blocking=True)
    return result
