"""deepspeed-manual-accumulation: N x ``engine.backward()`` then one ``engine.step()`` applies all N.

DeepSpeed decides whether a backward is an accumulation boundary when the backward *starts*, from its
schedule (``(micro_steps + 1) % gradient_accumulation_steps == 0``, where ``micro_steps`` only advances
in step()) or from ``set_gradient_accumulation_boundary``. A manual loop breaks both: with config GAS=1
every backward is a boundary and ZeRO-1/2 keep only the last micro-batch (>= 0.17.6); with config GAS=K
and N != K backwards per step(), step() silently does nothing until DeepSpeed's own count reaches K.

The fix is a *lazy boundary*, taken only where DeepSpeed's schedule cannot describe the loop
(zerofix.counter decides): while an engine sees one backward per step() (DeepSpeed's own style, at any
config GAS) every backward and step() run exactly as DeepSpeed runs them. Once a second backward arrives
before a step() on an engine where DeepSpeed gets that wrong (ZeRO-1/2 at config GAS=1, any stage at
config GAS > 1), every backward the user did not flag explicitly runs as non-boundary, and the window is
reduced as a boundary backward would have reduced it: at step(), or earlier when the user reads the
gradient (``safe_get_full_grad``, ``safe_set_full_grad``, ``safe_update_full_grad_vectorized``), so a
read between the last backward and step() sees the window's mean gradient, as DeepSpeed's own style
does. Where a reduction of the window already ran (the first window's first backward at config GAS=1,
or a read followed by more backwards), ZeRO-1/2 would *replace* it at the next reduction: zerofix keeps
a copy of this rank's reduced partition and adds it back. Backwards the user flagged with
``set_gradient_accumulation_boundary`` (open-instruct's fix, Accelerate's DeepSpeedEngineWrapper) are
left to DeepSpeed entirely, so nothing is reduced twice. Loss scaling stays DeepSpeed's.

The reduction per ZeRO stage (measured exact on 0.14.5 and 0.19.8: error ~1e-8, SGD and AdamW, clipping
included): stage 0 ``allreduce_gradients()``; stage 1/2 rebuild the
reduction buckets, hand every parameter holding a gradient to ``reduce_ready_partitions_and_remove_grads``
and run ``overlapping_partition_gradients_reduce_epilogue()``; stage 3 accumulates and reduces in every
backward through its own micro-step id, so the flag alone is enough. ZeRO-1/2 with optimizer offload
keep no device partition to reduce into: there each backward of a manual window runs as a lone boundary
and zerofix sums the fp32 partition itself (zerofix.fixes._zero12_offload). Configurations whose
reduction path was not measured (the fp16 wrapper at stage 0, pipeline engines,
``managed_gradient_accumulation: false``) are passed through untouched, and status() says so. bf16 (ZeRO-0's
BF16_Optimizer, ZeRO-1/2/3 in bf16) was measured on CPU (0.15.4 - 0.19.8): the same reductions are exact to
bf16 rounding.
"""
from __future__ import annotations

import weakref

from zerofix import applied
from zerofix._log import log
from zerofix.counter import FLUSH, FOLLOW, PASS, MicroStepCounter, StepPlan
from zerofix.fixes import _deepspeed_backward, _zero12_offload
from zerofix.fixes.contract import Check, drifted

FIX_ID = "deepspeed-manual-accumulation"
FIX_IDS = (FIX_ID,)
_ZERO12_API = ("reduce_ready_partitions_and_remove_grads", "overlapping_partition_gradients_reduce_epilogue",
               "bit16_groups")
_STATE_KEY = "_zerofix_accumulation"  # lives in engine.__dict__: no nn.Module.__setattr__ per call
# The engine's boundary flag (None: DeepSpeed's schedule decides). Written through engine.__dict__:
# nn.Module.__setattr__ costs ~1.3 us, a quarter of the wrappers' whole budget. Every release copies it
# to the optimizer when a backward starts, so the engine's copy is the one to set for a backward.
_FLAG = "_is_gradient_accumulation_boundary"
_engines: weakref.WeakSet = weakref.WeakSet()
_unreduced: weakref.WeakSet = weakref.WeakSet()  # engines holding lazily accumulated, un-reduced gradients


def structural_check(fix_id: str, targets) -> Check:
    check = _deepspeed_backward.check(targets[_deepspeed_backward.QUALNAME])
    if check.drift:
        return check
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ("set_gradient_accumulation_boundary", "is_gradient_accumulation_boundary",
                 "gradient_accumulation_steps", "zero_optimization_stage", "allreduce_gradients"):
        if not callable(getattr(DeepSpeedEngine, name, None)):
            return drifted(f"DeepSpeedEngine.{name} is gone")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    missing = [a for a in _ZERO12_API[:2] if not callable(getattr(DeepSpeedZeroOptimizer, a, None))]
    if missing:
        return drifted(f"DeepSpeedZeroOptimizer.{missing[0]} is gone")
    return check


# ----------------------------------------------------------------------------- per-engine state
class _EngineState:
    __slots__ = ("counter", "stage", "offload", "replaces", "eligible", "reason", "warned", "carried",
                 "window_sum", "param_ids", "scale_wrt_gas_at", "__weakref__")

    def __init__(self, engine):
        self.stage = int(engine.zero_optimization_stage())
        # ZeRO-1/2 from deepspeed 0.17.6 (the all_grad_tensors accumulator) *assign* the reduced partition at
        # a boundary; before, the epilogue added every reduction to it.
        self.offload = self.stage in (1, 2) and bool(getattr(engine.optimizer, "cpu_offload", False))
        self.replaces = self.stage in (1, 2) and hasattr(engine.optimizer, "all_grad_tensors")
        # At config GAS=1 every backward is a boundary: ZeRO-0/3, and ZeRO-1/2 while the epilogue adds,
        # reduce each one and accumulate the results, which is right by itself.
        # With optimizer offload every boundary replaces the fp32 partition's gradient.
        upstream_accumulates = (engine.gradient_accumulation_steps() == 1 and not self.replaces
                                and not self.offload)
        self.counter = MicroStepCounter(upstream_accumulates=upstream_accumulates)
        self.eligible, self.reason = _eligibility(engine, self.stage)
        self.warned: list[str] = []
        self.carried = None  # ZeRO-1/2: this rank's reduced partition of the window, kept for the flush
        self.window_sum = None  # ZeRO-1/2 with offload: the window's sum of the fp32 partition's gradient
        # for the read wrappers, which reduce only ZeRO-1/2 windows
        self.param_ids = frozenset(id(p) for p in engine.module.parameters()) if self.stage in (1, 2) else ()
        # where backward() takes scale_wrt_gas positionally, as the structural check found it
        self.scale_wrt_gas_at = applied.facts(FIX_ID)[_deepspeed_backward.POSITION]

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
        if engine.fp16_enabled():  # bf16 measured (CPU, 0.15.4 - 0.19.8); fp16 does not run on CPU
            return False, "ZeRO-0 with an fp16 optimizer wrapper: not measured"
        return True, "ZeRO-0: allreduce at step()"
    if stage in (1, 2):
        if not all(hasattr(opt, a) for a in _ZERO12_API):
            return False, f"ZeRO-{stage} optimizer {type(opt).__name__}: not measured"
        if getattr(opt, "cpu_offload", False):
            missing = _zero12_offload.missing_api(opt)
            if missing:
                return False, f"ZeRO-{stage} with optimizer offload: the optimizer has no {missing}: not measured"
            return True, (f"ZeRO-{stage} with optimizer offload: each backward of a manual window runs as a "
                          "lone boundary, zerofix sums the fp32 partition for step()")
        if stage == 2 and _accumulator_broken(opt):
            # deepspeed 0.17.6 - 0.18.2: each backward's epilogue restarts the partition's accumulator,
            # so a flush at step() starts it from the flush's own (empty) gradients: a zero update.
            return False, ("ZeRO-2 on deepspeed 0.17.6-0.18.2 without deepspeed-zero12-accumulator: every "
                           "backward restarts the accumulator, a flush at step() would apply nothing")
        return True, f"ZeRO-{stage}: bucket reduction at step()"
    return True, "ZeRO-3: boundary flag at step()"


def _accumulator_broken(opt) -> bool:
    """Whether the optimizer's epilogue is the broken one of 0.17.6-0.18.2 and zerofix has not fixed it."""
    from zerofix.fixes import deepspeed_zero12_accumulator as accumulator

    if applied.is_applied(accumulator.FIX_ID):
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
    counter = state.counter
    plan = counter.plan_backward(explicit_boundary=explicit)
    if plan.mode == FOLLOW:  # DeepSpeed's own schedule or the user's flag: exactly what DeepSpeed does
        boundary = explicit if explicit is not None else engine.is_gradient_accumulation_boundary()
        result = wrapped(*args, **kwargs)
    elif state.offload:
        result, state.window_sum = _zero12_offload.backward(
            wrapped, engine.optimizer, flags, _FLAG, state.window_sum, carry=plan.carry,
            joins=state.window_sum is None and not plan.carry and counter.pending > 0, args=args, kwargs=kwargs)
        boundary = True
        _unreduced.add(engine)  # a read before step() must see the window's sum
    else:
        if plan.carry and state.replaces:
            state.carried = _partition_copy(engine.optimizer)  # the next reduction replaces it
        boundary = False
        flags[_FLAG] = False  # lazy: step() (or a gradient read) reduces the window
        try:
            result = wrapped(*args, **kwargs)
        finally:
            flags[_FLAG] = None  # back to DeepSpeed's schedule
        if state.stage in (1, 2):  # ZeRO-0/3 reads are right (0: local, as DeepSpeed's) without a flush
            _unreduced.add(engine)
    scaled = _deepspeed_backward.scale_wrt_gas(args, kwargs, state.scale_wrt_gas_at)
    discarding = counter.backward(explicit_boundary=explicit, mode=plan.mode, boundary=boundary,
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
    if plan.action == PASS:
        result = wrapped(*args, **kwargs)
        counter.stepped(plan)
        return result
    _warn_scale(state, plan)
    with _as_boundary(engine):
        if plan.action == FLUSH:
            _reduce_window(engine, state)
        result = wrapped(*args, **kwargs)
    state.window_sum = None
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


def read_grad(wrapped, instance, args, kwargs):
    """``safe_get_full_grad`` / ``safe_set_full_grad`` / ``safe_update_full_grad_vectorized``: reduce a
    lazily accumulated window first, so the read sees what DeepSpeed's own boundary would have left.
    These reads are collectives under ZeRO-1/2 already (an all_reduce per parameter), so every rank
    reaches the reduction together; ZeRO-0 reads are local and never reduce here (DeepSpeed's own
    behaviour for them), ZeRO-3 reduces every backward. One truthiness test when nothing is pending."""
    if _unreduced:
        params = args[0] if args else kwargs.get("param", kwargs.get("param_list", ()))
        ids = {id(p) for p in params} if isinstance(params, (list, tuple)) else {id(params)}
        for engine in list(_unreduced):
            state = engine.__dict__.get(_STATE_KEY)
            if state is not None and not ids.isdisjoint(state.param_ids):
                _flush_for_read(engine, state)
    return wrapped(*args, **kwargs)


def save_checkpoint(wrapped, engine, args, kwargs):
    """A checkpoint holds parameters and optimizer state, not the gradients of a window in progress:
    say so on every rank when zerofix is accumulating one (DeepSpeed's own style loses them too)."""
    state = engine.__dict__.get(_STATE_KEY)
    if state is not None and state.eligible and state.counter.manual and state.counter.pending:
        log("warning", "%s: save_checkpoint() in the middle of an accumulation window: the %d micro-batch(es) "
            "accumulated since the last step() are not in the checkpoint, and a run resumed from it will not "
            "apply them. Save right after step() to resume exactly.", FIX_ID, state.counter.pending)
    return wrapped(*args, **kwargs)


def _flush_for_read(engine, state: _EngineState) -> None:
    with _as_boundary(engine):
        _reduce_window(engine, state)
    state.counter.flushed_for_read()


class _as_boundary:
    """The engine's boundary flag set for the block (the public call: the optimizer's copy matters to the
    reduction and to step()), DeepSpeed's schedule again after it."""

    __slots__ = ("engine",)

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        self.engine.set_gradient_accumulation_boundary(True)

    def __exit__(self, *exc):
        self.engine.__dict__[_FLAG] = None


def _reduce_window(engine, state: _EngineState) -> None:
    """The boundary reduction of the lazily accumulated backwards, plus what an earlier reduction of the
    same window left (ZeRO-1/2 from 0.17.6 assign the reduced partition; earlier ones add to it; ZeRO-0
    re-averages the already averaged part unchanged; ZeRO-3 accumulates by itself)."""
    _unreduced.discard(engine)
    if state.offload:  # every backward ran as a boundary: the window is the sum zerofix kept
        _zero12_offload.write_window(engine.optimizer, state.window_sum)
        return
    _reduce_as_boundary(engine, state.stage)
    if state.carried is not None:
        _add_partition(engine.optimizer, state.carried)
        state.carried = None


def _partition_copy(opt) -> dict:
    """This rank's reduced gradient partition of every parameter group (what the read API returns)."""
    return {i: [t.clone() for t in grads] for i, grads in opt.averaged_gradients.items() if grads is not None}


def _add_partition(opt, saved: dict) -> None:
    for i, grads in saved.items():
        for current, kept in zip(opt.averaged_gradients[i], grads):
            current.add_(kept)


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
