"""deepspeed-manual-accumulation: N x ``engine.backward()`` then one ``engine.step()`` applies all N.

DeepSpeed decides whether a backward is an accumulation boundary when the backward *starts*, from its
schedule (``(micro_steps + 1) % gradient_accumulation_steps == 0``, where ``micro_steps`` only advances
in step()) or from ``set_gradient_accumulation_boundary``. A manual loop breaks both: with config GAS=1
every backward is a boundary and ZeRO-1/2 keep only the last micro-batch (>= 0.17.6); with config GAS=K
and N != K backwards per step(), step() silently does nothing until DeepSpeed's own count reaches K.

The fix is a *lazy boundary*: every backward the user did not flag explicitly runs as non-boundary;
step() asks the shared counter (zerofix.counter) whether it closes a window and, if so, performs the
reduction a boundary backward would have performed, with the flag set, and lets DeepSpeed step. A
step() after exactly one backward follows DeepSpeed's own schedule. Backwards the user flagged with
``set_gradient_accumulation_boundary`` (open-instruct's fix, Accelerate's DeepSpeedEngineWrapper) are
left to DeepSpeed entirely, so nothing is reduced twice. Loss scaling stays DeepSpeed's.

The reduction per ZeRO stage (DESIGN.md §2): stage 0 ``allreduce_gradients()``; stage 1/2 rebuild the
reduction buckets, hand every parameter holding a gradient to ``reduce_ready_partitions_and_remove_grads``
and run ``overlapping_partition_gradients_reduce_epilogue()``; stage 3 accumulates and reduces in every
backward through its own micro-step id, so the flag alone is enough. Configurations whose reduction path
was not measured (fp16/bf16 wrappers at stage 0, optimizer offload at stage 1/2, pipeline engines,
``managed_gradient_accumulation: false``) are passed through untouched, and status() says so.
"""
from __future__ import annotations

import weakref

from zerofix._log import log
from zerofix.counter import FLUSH, MicroStepCounter, StepPlan
from zerofix.fixes import _deepspeed_backward

FIX_ID = "deepspeed-manual-accumulation"
_ZERO12_API = ("reduce_ready_partitions_and_remove_grads", "overlapping_partition_gradients_reduce_epilogue",
               "bit16_groups")
_STATE_KEY = "_zerofix_accumulation"  # lives in engine.__dict__: no nn.Module.__setattr__ per call
# The engine's boundary flag (None: DeepSpeed's schedule decides). Written through engine.__dict__:
# nn.Module.__setattr__ costs ~1.3 us, a quarter of the wrappers' whole budget. Every release copies it
# to the optimizer when a backward starts, so the engine's copy is the one to set for a backward.
_FLAG = "_is_gradient_accumulation_boundary"
_engines: weakref.WeakSet = weakref.WeakSet()


def structural_check(targets) -> str | None:
    drift = _deepspeed_backward.check(targets[_deepspeed_backward.QUALNAME])
    if drift:
        return drift
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ("set_gradient_accumulation_boundary", "is_gradient_accumulation_boundary",
                 "gradient_accumulation_steps", "zero_optimization_stage", "allreduce_gradients"):
        if not callable(getattr(DeepSpeedEngine, name, None)):
            return f"DeepSpeedEngine.{name} is gone"
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    missing = [a for a in _ZERO12_API[:2] if not callable(getattr(DeepSpeedZeroOptimizer, a, None))]
    if missing:
        return f"DeepSpeedZeroOptimizer.{missing[0]} is gone"
    return None


# ----------------------------------------------------------------------------- per-engine state
class _EngineState:
    __slots__ = ("counter", "stage", "eligible", "reason", "warned", "__weakref__")

    def __init__(self, engine):
        self.counter = MicroStepCounter()
        self.stage = int(engine.zero_optimization_stage())
        self.eligible, self.reason = _eligibility(engine, self.stage)
        self.warned: list[str] = []

    def warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.append(key)
            log("warning", msg, *args)


def _eligibility(engine, stage: int) -> tuple[bool, str]:
    """Whether the lazy boundary is known to be exact for this engine's reduction path."""
    if _FLAG not in engine.__dict__:
        return False, f"the engine has no {_FLAG} attribute: not measured"
    if getattr(engine, "pipeline_parallelism", False):
        return False, "pipeline engine: boundaries come from its schedule"
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is not None and not managed():
        return False, "managed_gradient_accumulation is off: step() is already the boundary"
    opt = engine.optimizer
    if stage == 0:
        if engine.fp16_enabled() or engine.bfloat16_enabled():
            return False, "ZeRO-0 with an fp16/bf16 optimizer wrapper: not measured"
        return True, "ZeRO-0: allreduce at step()"
    if stage in (1, 2):
        if not all(hasattr(opt, a) for a in _ZERO12_API):
            return False, f"ZeRO-{stage} optimizer {type(opt).__name__}: not measured"
        if getattr(opt, "cpu_offload", False):
            return False, f"ZeRO-{stage} with optimizer offload: not measured"
        if stage == 2 and _accumulator_broken(opt):
            # deepspeed 0.17.6 - 0.18.2: each backward's epilogue restarts the partition's accumulator,
            # so a flush at step() starts it from the flush's own (empty) gradients: a zero update.
            return False, ("ZeRO-2 on deepspeed 0.17.6-0.18.2 without deepspeed-zero12-accumulator: every "
                           "backward restarts the accumulator, a flush at step() would apply nothing")
        return True, f"ZeRO-{stage}: bucket reduction at step()"
    return True, "ZeRO-3: boundary flag at step()"


def _accumulator_broken(opt) -> bool:
    """Whether the optimizer's epilogue is the broken one of 0.17.6-0.18.2 and zerofix has not fixed it."""
    from zerofix import patching
    from zerofix.fixes import deepspeed_zero12_accumulator as accumulator

    if patching.is_applied(accumulator.FIX_ID):
        return False
    method = getattr(type(opt), "independent_gradient_partition_epilogue", None)
    return method is not None and accumulator.drift_from_broken(method) is None


def _state(engine) -> _EngineState:
    state = engine.__dict__.get(_STATE_KEY)
    if state is None:
        state = engine.__dict__[_STATE_KEY] = _EngineState(engine)
        _engines.add(engine)
        log("info", "%s: %s on a DeepSpeed engine (ZeRO-%d, gradient_accumulation_steps=%d): %s",
            FIX_ID, "active" if state.eligible else "passing through", state.stage,
            engine.gradient_accumulation_steps(), state.reason)
    return state


# ----------------------------------------------------------------------------- wrappers
def backward(wrapped, engine, args, kwargs):
    flags = engine.__dict__
    state = flags.get(_STATE_KEY) or _state(engine)
    if not state.eligible:
        return wrapped(*args, **kwargs)
    explicit = flags[_FLAG]
    if explicit is None:
        flags[_FLAG] = False  # lazy: the step() decides whether this window ends
        try:
            result = wrapped(*args, **kwargs)
        finally:
            flags[_FLAG] = None  # back to DeepSpeed's schedule
    else:
        result = wrapped(*args, **kwargs)
    scaled = _deepspeed_backward.scale_wrt_gas(args, kwargs)
    discarding = state.counter.backward(explicit_boundary=explicit,
                                        divisor=engine.gradient_accumulation_steps() if scaled else 1)
    if discarding and state.stage in (1, 2):
        state.warn_once("discard", "%s: backward() after a backward flagged with set_gradient_accumulation_"
                        "boundary(True) and before step(): DeepSpeed ZeRO-%d keeps only the gradients from "
                        "the flagged backward on. Flag only the last backward before step(), or none (zerofix "
                        "then finds the boundary itself).", FIX_ID, state.stage)
    return result


def step(wrapped, engine, args, kwargs):
    flags = engine.__dict__
    state = flags.get(_STATE_KEY)
    if state is None or not state.eligible:
        return wrapped(*args, **kwargs)
    counter = state.counter
    explicit = flags[_FLAG]
    schedule = explicit is None and engine.is_gradient_accumulation_boundary()
    plan = counter.plan_step(explicit_boundary=explicit, schedule_boundary=schedule)
    if plan.action != FLUSH:
        result = wrapped(*args, **kwargs)
        counter.stepped(plan)
        return result
    _warn_scale(state, plan)
    engine.set_gradient_accumulation_boundary(True)  # the public call: the optimizer's copy matters here
    try:
        _reduce_as_boundary(engine, state.stage)
        result = wrapped(*args, **kwargs)
    finally:
        flags[_FLAG] = None
    counter.stepped(plan)
    return result


def _warn_scale(state: _EngineState, plan: StepPlan) -> None:
    divisor = state.counter.scale_mismatch(plan.micro_batches)
    if divisor is not None:
        state.warn_once("scale", "%s: DeepSpeed divided each loss of this %d-micro-batch window by "
                        "gradient_accumulation_steps=%d (scale_wrt_gas=True), so the update is %d/%d of the "
                        "window's mean-loss gradient. Set gradient_accumulation_steps to the number of "
                        "backwards per step(), or pass scale_wrt_gas=False and divide the loss yourself.",
                        FIX_ID, plan.micro_batches, divisor, plan.micro_batches, divisor)


def _reduce_as_boundary(engine, stage: int) -> None:
    """What a boundary backward would have run after its gradients were computed."""
    if stage == 0:
        engine.allreduce_gradients()
    elif stage in (1, 2):
        _reduce_zero12(engine.optimizer)
    # stage 3 reduced every backward already; the boundary flag alone makes step() apply it.


def _reduce_zero12(opt) -> None:
    _prepare_buckets(opt)
    gradient_of = getattr(opt, "get_gradient_for_reduction", None) or (lambda p: p.grad)
    for i, group in enumerate(opt.bit16_groups):
        for param in group:
            if param.requires_grad and gradient_of(param) is not None:
                opt.reduce_ready_partitions_and_remove_grads(param, i)
    opt.overlapping_partition_gradients_reduce_epilogue()


def _prepare_buckets(opt) -> None:
    """The reduction buckets a backward sets up and the epilogue releases (three layouts so far)."""
    if hasattr(opt, "setup_buckets"):  # deepspeed >= 0.18.3
        opt.setup_buckets()
    elif hasattr(opt, "ipg_buckets"):  # 0.17.x - 0.18.2: the same work, named backward_prologue
        opt.backward_prologue()
    elif getattr(opt, "contiguous_gradients", False):  # before: what optimizer.backward() allocated
        import torch
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().current_device_name()
        opt.ipg_buffer = [torch.empty(int(opt.reduce_bucket_size), dtype=opt.dtype, device=device)
                          for _ in range(2 if opt.overlap_comm else 1)]
        opt.ipg_index = 0


# ----------------------------------------------------------------------------- status
def runtime_details() -> list[dict]:
    """One entry per live engine this fix has seen (for zerofix.status())."""
    out = []
    for engine in list(_engines):
        state = engine.__dict__.get(_STATE_KEY)
        if state is not None:
            out.append({"engine": f"0x{id(engine):x}", "zero_stage": state.stage, "active": state.eligible,
                        "why": state.reason, **state.counter.as_dict(), "warnings": list(state.warned)})
    return out
