"""accelerate's FSDP code path on CPU, for the check and the tests (never imported by a fix).

accelerate chooses FSDP only for an accelerator (``AcceleratorState.__init__``: the ``MULTI_GPU`` / ``MULTI_XPU``
... branch); with ``use_cpu`` the same FSDP plugin is dropped and the run silently becomes DDP (FSDP2) or stops in
a device lookup (FSDP1). torch's own ``fully_shard`` / ``FullyShardedDataParallel`` run on CPU over gloo. So this
replaces exactly that one choice: an ``AcceleratorState`` built on CPU with an FSDP plugin gets
``DistributedType.FSDP`` and the plugin, as it would on a GPU. Everything after it is accelerate's and torch's own
FSDP code (``prepare`` -> ``fsdp2_prepare_model`` / ``FullyShardedDataParallel``, the DTensor parameters, the
reduce-scatter of gradients, the clipping), which is what decides the numerics.

``engine_facts(trainer)`` says, from inside the run, which engine really ran, so a run that fell back to DDP is
seen as one.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def fsdp_on_cpu():
    """While active, an AcceleratorState built on CPU with an FSDP plugin is an FSDP state (see the module)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__dict__["__init__"]

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.device.type == "cpu" and self.distributed_type in (
                DistributedType.MULTI_CPU, DistributedType.NO):
            # what the accelerator branch of AcceleratorState.__init__ does with the plugin
            self.distributed_type = DistributedType.FSDP
            if getattr(self, "_mixed_precision", "no") != "no" and hasattr(plugin, "set_mixed_precision"):
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            if PartialState._shared_state.get("distributed_type") is not None:
                # the release's last line: later AcceleratorState() calls copy PartialState's type back
                PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def engine_facts(trainer) -> dict:
    """Which engine trained: accelerate's distributed type, its FSDP version, the wrapper's class, and whether the
    trained parameters are DTensors (FSDP2) or FSDP1's flat parameters."""
    accelerator = trainer.accelerator
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    params = list(trainer.model.parameters())
    return {
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "fsdp_version": getattr(plugin, "fsdp_version", 1) if plugin is not None else None,
        "wrapper": type(trainer.model_wrapped).__name__,
        "dtensor_params": bool(params) and all(type(p).__name__ == "DTensor" for p in params),
        "flat_params": any(type(p).__name__ == "FlatParameter" for p in trainer.model_wrapped.parameters()),
    }


def full_state(model, wrapped) -> dict:
    """Every parameter whole, on every rank (a collective): FSDP2's DTensors through ``full_tensor()``, FSDP1's
    through ``summon_full_params`` on the wrapper."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    if any(isinstance(v, DTensor) for v in state.values()):
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped, writeback=False, rank0_only=False):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in state.items()}
