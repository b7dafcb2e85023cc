"""The lazy boundary for ZeRO-1/2 with optimizer offload (deepspeed-manual-accumulation's offload path).

With ``offload_optimizer``, ZeRO-1/2 do not keep a reduced partition on the device: each boundary backward
copies this rank's reduced gradient into the fp32 partition on the CPU (``single_partition_of_fp32_groups
[i].grad``, replacing it) and records each parameter's gradient norm for clipping. Between boundaries a
CPU accumulator keyed by the optimizer's ``micro_step_id`` carries the window, and how it does changed
with every release (0.15.2 - 0.18.9 accumulate only when the config GAS > 1 and drop the middle
micro-batches at ZeRO-2; 0.19 accumulates from the second micro-step on; 0.19.8 adds a finalizer). A
flush at step() that replays DeepSpeed's boundary work would need one variant per release.

So the window is built from the one path every release gets right, DeepSpeed's own config-GAS=1 step:
each backward of a manual window runs as the *lone boundary backward of a step* (boundary flag set,
``micro_step_id`` back to its initial value, so no CPU accumulator is read), which leaves exactly this
backward's reduced gradient in the fp32 partition; zerofix adds it to a window sum of the same partition
(one add per backward, on the CPU where the partition lives). Before step(), or before a gradient read,
the sum is written into the fp32 partition and each parameter's recorded norm is recomputed from it, so
clipping, ``get_global_grad_norm()`` and ``safe_get_full_grad`` see the window. Measured exact (SGD
2.5e-7, AdamW 2.4e-6, clipping 5.5e-7) on 0.15.4, 0.16.3, 0.18.0, 0.18.3, 0.18.9 and 0.19.8.
"""
from __future__ import annotations

# what the offload path reads and writes on DeepSpeedZeroOptimizer (eligibility checks them per engine)
API = ("single_partition_of_fp32_groups", "norm_for_param_grads", "params_in_partition", "grad_position",
       "micro_step_id", "get_param_id")


def missing_api(optimizer) -> str | None:
    """The first attribute the offload path needs that ``optimizer`` lacks, or None."""
    return next((name for name in API if not hasattr(optimizer, name)), None)


def partition_grads(optimizer) -> list:
    return [p.grad for p in optimizer.single_partition_of_fp32_groups]


def backward(wrapped, optimizer, flags: dict, flag: str, window_sum, *, carry: bool, args, kwargs):
    """Run one backward of a manual window; returns (result, the window's sum so far).

    ``window_sum``: the sum kept so far (None at the window's first lazy backward); ``carry``: a
    boundary backward of this window already ran (its gradient is in the fp32 partition);
    ``flags[flag]``: the engine's boundary flag (None: DeepSpeed's schedule), set for the call."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    if window_sum is None:
        window_sum = [g.detach().clone() if carry else torch.zeros_like(g) for g in partition_grads(optimizer)]
    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID  # the lone backward of a step: no CPU accumulator
    flags[flag] = True
    try:
        result = wrapped(*args, **kwargs)
    finally:
        flags[flag] = None
    for total, grad in zip(window_sum, partition_grads(optimizer)):
        total.add_(grad)
    return result, window_sum


def write_window(optimizer, window_sum) -> None:
    """Put the window's sum into the fp32 partition, and recompute each parameter's gradient norm from
    it (in the dtype DeepSpeed recorded it in) for clipping and the global norm."""
    for total, grad in zip(window_sum, partition_grads(optimizer)):
        grad.copy_(total)
    norms = optimizer.norm_for_param_grads
    for i, params in enumerate(optimizer.params_in_partition):
        for param in params:
            param_id = optimizer.get_param_id(param)
            recorded = norms.get(param_id)
            if recorded is None:  # no gradient reached this parameter in the window
                continue
            _, _, offset, numel = optimizer.grad_position[param_id]
            norms[param_id] = window_sum[i].view(-1).narrow(0, offset, numel).to(recorded.dtype).norm(2)
