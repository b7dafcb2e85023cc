"""deepspeed-zero12-accumulator: ZeRO-1/2 keep every micro-batch of a window, not only the last.

After each backward, ``DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue`` moves the
reduced gradients of the rank's partition into an accumulator (``all_grad_tensors[i]``): it starts the
accumulator when it is empty and adds to it otherwise. On 0.17.6 - 0.18.2 the emptiness test reads the
wrong buffer, ``averaged_gradients[i]``, which is only filled at a boundary and emptied by step(). So
within a window every micro-step restarts the accumulator and only the last micro-batch reaches the
update (measured: ratio 0.163, cosine 0.41 with the Trainer at GAS=8 on 0.18.0); and a backward after a
boundary but before step() finds an accumulator it thinks is there and raises a TypeError (zip over
None). DeepSpeed 0.18.3 tests ``all_grad_tensors[i]``.

zerofix does not rewrite that method. It wraps it, and for the duration of the call makes the buffer
the test reads say what the accumulator really holds: a placeholder when the accumulator holds
gradients but ``averaged_gradients[i]`` is empty, empty when ``averaged_gradients[i]`` holds a finished
window but the accumulator is empty. Then it puts back what was there, unless the method replaced it
at a boundary. Everything else (the reduction, the boundary copy, releasing the buffers) is DeepSpeed's
own code, unchanged: the observable behaviour is 0.18.3's.

Ambiguity list (docs/fixes.md): none. The wrapper acts only where the structural check finds the broken
test of 0.17.6 - 0.18.2 and does what 0.18.3 does; every loop through the epilogue (DeepSpeed's own style, flagged
boundaries, the Trainer) then runs as on 0.18.3 (tests/test_deepspeed_zero12_accumulator.py).
"""
from __future__ import annotations

import ast

from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-zero12-accumulator"
FIX_IDS = (FIX_ID,)
TARGET = "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue"
_MISSING = object()


class _Accumulating:
    """Stands in ``averaged_gradients[i]`` while the epilogue runs: "the accumulator holds gradients".
    Only its being non-None is ever read; anything else it is asked for is a bug worth a clear error."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<zerofix: accumulator in use>"


_ACCUMULATING = _Accumulating()


def structural_check(fix_id: str, targets) -> Check:
    drift = drift_from_broken(targets[TARGET])
    if drift:
        return drifted(drift)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assigned = _inspect.self_attributes(DeepSpeedZeroOptimizer.__init__)
    for name in ("bit16_groups", "all_grad_tensors", "averaged_gradients", "cpu_offload"):
        if name not in assigned:
            return drifted(f"DeepSpeedZeroOptimizer no longer sets self.{name}")
    return found()


def drift_from_broken(func) -> str | None:
    """None when ``func`` is the epilogue measured broken: the branch that starts the accumulator
    (assigns ``self.all_grad_tensors[i]``) is guarded by a test on ``averaged_gradients`` alone. Else
    what differs. The source is parsed, never executed."""
    try:
        tree = _inspect.source_tree(func)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"{TARGET}: source unavailable, cannot verify it is the broken one ({exc})"
    guards = [_attributes(node.test) for node in ast.walk(tree)
              if isinstance(node, ast.If) and "all_grad_tensors" in _assigned(node.body)]
    if not guards:
        return f"{TARGET} no longer starts the accumulator the way 0.17.6-0.18.2 do"
    if not any("averaged_gradients" in g and "all_grad_tensors" not in g for g in guards):
        return f"{TARGET} already tests the accumulator itself: not the broken one"
    return None


def _attributes(node) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _assigned(body) -> set[str]:
    """Attribute names assigned through a subscript (``self.x[i] = ...``) in a block."""
    out = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
                        out.add(target.value.attr)
    return out


def epilogue(wrapped, optimizer, args, kwargs):
    if optimizer.cpu_offload is not False:  # the accumulator branch only runs without offload
        return wrapped(*args, **kwargs)
    accumulated = optimizer.all_grad_tensors
    averaged = optimizer.averaged_gradients
    swapped = {}  # group -> (what averaged_gradients held, or _MISSING; what stands in for it)
    for i in range(len(optimizer.bit16_groups)):
        holds = accumulated.get(i) is not None
        if holds != (averaged.get(i) is not None):
            swapped[i] = (averaged.get(i, _MISSING), _ACCUMULATING if holds else None)
            averaged[i] = swapped[i][1]
    if not swapped:
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for i, (before, stand_in) in swapped.items():
            if averaged.get(i, _MISSING) is stand_in:  # not replaced by a boundary copy
                if before is _MISSING:
                    del averaged[i]
                else:
                    averaged[i] = before
