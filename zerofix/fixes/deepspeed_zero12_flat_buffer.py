"""deepspeed-zero12-flat-buffer: ZeRO-1/2's flat parameter buffer is built with an autograd graph.

From 0.18.7 (DeepSpeed PR #7828), ``DeepSpeedZeroOptimizer.__init__`` flattens each parameter group on the
accelerator when it has the memory (always, on the CPU accelerator): ``flatten_dense_tensors_aligned(params, ..., use_cpu_data=False)``
concatenates the parameters themselves, so the flat buffer every rank's partition and every parameter's data live
in is an autograd result that requires grad (0.18.6 flattened ``param.data.cpu()`` copies; 0.19.0 adds
``.detach()``, PR #7948). ``step()`` then all-gathers the updated partitions into that buffer; with gloo, torch writes the
gathered pieces into ``split()`` views of it, and in grad mode autograd refuses: ``RuntimeError: Output 0 of Split
is a view and is being modified inplace``, on every rank, at the first optimizer step of every ZeRO-1/2 run on 2+
ranks (fp32 and bf16 alike; measured 0.18.7, 0.18.8, 0.18.9; 0.18.6 and 0.19.0 run). ``engine.step()`` under
``torch.no_grad()`` avoids it, but the Trainer and accelerate call it in grad mode.

zerofix does what 0.19.0 does, from outside: a result of ``flatten_dense_tensors_aligned`` that requires grad is
returned detached (the same storage, no graph). Only the call above produces one: the method's other callers
flatten gradients and optimizer states, which never require grad, and get DeepSpeed's own tensor back.

Ambiguity list (docs/fixes.md): none. The entry reads nothing of the user's loop; no DeepSpeed usage differentiates
through the flat buffer (0.18.6 and 0.19.0 build it without a graph), and a step under ``no_grad()``, where 0.18.9
already runs, trains bitwise as before (tests/test_deepspeed_accumulation.py's probes on 2026-04).
"""
from __future__ import annotations

import ast

from zerofix.fixes import _inspect
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-zero12-flat-buffer"
FIX_IDS = (FIX_ID,)
QUALNAME = "DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned"


def structural_check(fix_id: str, targets) -> Check:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    drift = drift_from_broken(DeepSpeedZeroOptimizer.__init__)
    return drifted(drift) if drift else found()


def drift_from_broken(init) -> str | None:
    """None when ``init`` is the constructor measured broken: it calls ``self.flatten_dense_tensors_aligned`` with
    ``use_cpu_data=False`` and keeps the result as it is (0.19.0 detaches it; 0.18.6 never flattens the parameters
    themselves). Else what differs. The source is parsed, never executed."""
    try:
        tree = _inspect.source_tree(init)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"DeepSpeedZeroOptimizer.__init__: source unavailable, cannot verify it is the broken one ({exc})"
    detached = {id(node.func.value) for node in ast.walk(tree)  # the calls whose result .detach() is called on
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "detach"
                and isinstance(node.func.value, ast.Call)}
    on_parameters = [node for node in ast.walk(tree) if _flattens_parameters(node)]
    if not on_parameters:
        return "DeepSpeedZeroOptimizer.__init__ never flattens the parameters themselves (use_cpu_data=False)"
    if all(id(node) in detached for node in on_parameters):
        return "DeepSpeedZeroOptimizer.__init__ detaches the flat buffer: not the broken one"
    return None


def _flattens_parameters(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "flatten_dense_tensors_aligned"
            and any(k.arg == "use_cpu_data" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords))


def flatten_dense_tensors_aligned(wrapped, optimizer, args, kwargs):
    flat = wrapped(*args, **kwargs)
    return flat.detach() if flat.requires_grad else flat  # 0.19.0: the buffer holds data, not a graph
