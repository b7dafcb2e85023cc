"""accelerate-deepspeed-no-sync: ``accumulate()`` no longer enters a ZeRO-2/3 engine's ``no_sync()``.

``Accelerator.accumulate`` enters ``Accelerator.no_sync(model)`` on every micro-batch that does not close a
window, and ``no_sync`` enters the model's own ``no_sync`` when the run is distributed. DeepSpeed 0.16.0
gave its engine a ``no_sync()`` that asserts it is not used with ZeRO-2/3 (their gradient partitioning
reduces in every backward), so a plain ``accumulate()`` loop over ZeRO-2/3 on 2+ ranks raises an
AssertionError on its first micro-batch (measured: accelerate 1.3.0 with DeepSpeed 0.16.3). accelerate 1.9.0
skips the model's ``no_sync`` for DeepSpeed ZeRO >= 2; zerofix does the same on earlier releases: for those
engines ``no_sync`` enters nothing, every other model (DDP, ZeRO-0/1, DeepSpeed < 0.16 without a
``no_sync``) is passed to accelerate's own code unchanged.

Ambiguity list (docs/fixes.md): it reacts to ``Accelerator.no_sync(model)`` on a DeepSpeed engine of ZeRO-2/3,
where DeepSpeed >= 0.16 raises on every rank; no right usage reaches that point. DDP, ZeRO-0/1 and DeepSpeed
releases without an engine ``no_sync`` are handed to accelerate's own code (tests/test_accelerate_loop.py).
"""
from __future__ import annotations

import contextlib
import inspect

from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "accelerate-deepspeed-no-sync"
FIX_IDS = (FIX_ID,)


def structural_check(fix_id: str, targets) -> Check:
    """Found when ``no_sync(self, model)`` enters ``model.no_sync`` for any distributed run (reads no
    DeepSpeed stage, unlike 1.9.0's)."""
    no_sync = inspect.unwrap(targets["Accelerator.no_sync"])
    if list(inspect.signature(no_sync).parameters) != ["self", "model"]:
        return drifted("Accelerator.no_sync is not (self, model)")
    names = set(no_sync.__code__.co_names)
    if "use_distributed" not in names or "zero_stage" in names:
        return drifted("Accelerator.no_sync already tells DeepSpeed ZeRO-2/3 apart")
    return found()


def no_sync(wrapped, accelerator, args, kwargs):
    if _zero_partitions_gradients(accelerator):
        return contextlib.nullcontext()  # accelerate 1.9.0's behaviour: nothing to enter
    return wrapped(*args, **kwargs)


def _zero_partitions_gradients(accelerator) -> bool:
    if "DEEPSPEED" not in str(getattr(accelerator, "distributed_type", "")):
        return False
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and (plugin.zero_stage or 0) >= 2
