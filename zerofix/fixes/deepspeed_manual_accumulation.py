"""deepspeed-manual-accumulation: N x ``engine.backward()`` then one ``engine.step()`` applies all N.

DeepSpeed decides whether a backward is an accumulation boundary when the backward *starts*, from its
schedule (``(micro_steps + 1) % gradient_accumulation_steps == 0``, where ``micro_steps`` only advances
in step()) or from ``set_gradient_accumulation_boundary``. With config GAS=1 every backward is a boundary,
and from 0.17.6 ZeRO-1/2 *assign* the reduced partition at a boundary: several backwards before one step()
keep only the last micro-batch (with optimizer offload every release replaces the fp32 partition's
gradient the same way).

The fix is a *lazy boundary*, taken only where no right usage looks the same (zerofix.counter decides):
ZeRO-1/2 at config GAS=1 where a boundary replaces, once a second unflagged backward arrives before a
step() outside ``no_sync()`` / ``coalesce_grad_reduction()``. Then every such backward runs as non-boundary,
and the window is reduced as a boundary backward would have reduced it: at step(), or earlier when the
user reads the gradient (``safe_get_full_grad``, ``safe_set_full_grad``, ``safe_update_full_grad_vectorized``),
so a read between the last backward and step() sees the window's mean gradient. The window's first
backward already ran as DeepSpeed's boundary (nothing could know more were coming): zerofix keeps a copy
of this rank's reduced partition and adds it back at the flush. Loss scaling stays DeepSpeed's.

The reduction (measured exact on 0.14.5 and 0.19.8: error ~1e-8, SGD and AdamW, clipping included):
rebuild the reduction buckets, hand every parameter holding a gradient to
``reduce_ready_partitions_and_remove_grads`` and run ``overlapping_partition_gradients_reduce_epilogue()``
(DeepSpeed 0.19.7's ``coalesce_grad_reduction`` flush runs the same sequence). With optimizer offload each
backward of a manual window runs as a lone boundary and zerofix sums the fp32 partition itself
(zerofix.fixes._zero12_offload). bf16 ZeRO-1/2 measured on CPU (0.15.4 - 0.19.8): exact to bf16 rounding.

Ambiguity list: the usages upstream documents or tests that produce the observations this fix reacts to
("several backward() calls before a step()"), each followed exactly as DeepSpeed runs it, each with its
test (tests/test_deepspeed_accumulation.py, the transparency matrix; docs/fixes.md has the table):

- DeepSpeed's own style, one backward per step() at any config GAS (``z*-gas*-b``/``-f``);
- several backwards per micro-batch in DeepSpeed's own style at config GAS > 1 (two losses,
  ``retain_graph=True``, a micro-batch fed in halves: ``-g``). It looks exactly like a manual loop at
  config GAS=K whose step() DeepSpeed skips until K step() calls, so *no* loop at config GAS > 1 is taken
  over: zerofix follows and warns once per engine ("ambiguous"), naming config GAS=1 as the way to say
  "manual". (ZeRO-1/2 get DeepSpeed's own multi-backward style wrong by themselves: followed, documented.)
- ``engine.no_sync()`` (ZeRO-0/1, DeepSpeed >= 0.16: ``-nosync``; DeepSpeed's ``test_multiple_ctxts``,
  two no_sync windows separated by ``zero_grad()``: ``-zg``) and ``engine.coalesce_grad_reduction()``
  (ZeRO-1/2/3, DeepSpeed >= 0.19.7: ``-coalesce``): a window with a backward inside either is the user's;
- ``set_gradient_accumulation_boundary`` (open-instruct's fix, accelerate >= 1.10's DeepSpeedEngineWrapper,
  the Trainer: ``-c``): flagged backwards are DeepSpeed's;
- ``engine.zero_grad()`` between backwards (``-z``): ends the window; the next backward starts a new one;
- ZeRO-0/3 (every release) and ZeRO-1/2 before 0.17.6 at config GAS=1: they accumulate by themselves;
- ``managed_gradient_accumulation: false``, pipeline engines, ZeRO-0's fp16 wrapper: passed through;
- ``scale_wrt_gas``: whatever it says, DeepSpeed's scaling is kept (config GAS=1 divides by 1).
"""
from __future__ import annotations

import weakref

from zerofix import applied, paths
from zerofix._log import log
from zerofix.counter import FLUSH, FOLLOW, PASS, MicroStepCounter
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
                 "gradient_accumulation_steps", "zero_optimization_stage", "zero_grad"):
        if not callable(getattr(DeepSpeedEngine, name, None)):
            return drifted(f"DeepSpeedEngine.{name} is gone")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    missing = [a for a in _ZERO12_API[:2] if not callable(getattr(DeepSpeedZeroOptimizer, a, None))]
    if missing:
        return drifted(f"DeepSpeedZeroOptimizer.{missing[0]} is gone")
    return check


# ----------------------------------------------------------------------------- per-engine state
class _EngineState:
    __slots__ = ("counter", "stage", "gas", "offload", "takes_over", "observes", "reason", "warned", "carried",
                 "window_sum", "param_ids", "__weakref__")

    def __init__(self, engine):
        self.stage = int(engine.zero_optimization_stage())
        self.gas = int(engine.gradient_accumulation_steps())
        # ZeRO-1/2 from deepspeed 0.17.6 (the all_grad_tensors accumulator) *assign* the reduced partition at
        # a boundary; before, the epilogue added every reduction to it.
        self.offload = self.stage in (1, 2) and bool(getattr(engine.optimizer, "cpu_offload", False))
        replaces = self.stage in (1, 2) and hasattr(engine.optimizer, "all_grad_tensors")
        eligible, self.reason = _eligibility(engine, self.stage)
        # pipeline engines, managed_gradient_accumulation off, an engine without the flag: not even counted
        self.observes = _outside_schedule(engine) is None
        # Only where several unflagged backwards before a step() cannot be a right usage: config GAS=1, and a
        # boundary that replaces (at config GAS > 1 DeepSpeed's own style with several backwards per
        # micro-batch looks the same; ZeRO-0/3 and ZeRO-1/2 before 0.17.6 accumulate by themselves).
        self.takes_over = eligible and self.gas == 1 and (replaces or self.offload)
        if eligible and not self.takes_over:
            self.reason = ("config gradient_accumulation_steps > 1: DeepSpeed's schedule decides the boundaries "
                           "(a loop with several backwards per step() is warned about, not changed)"
                           if self.gas > 1 else f"ZeRO-{self.stage} on this release accumulates several "
                           "backwards per step() by itself at config gradient_accumulation_steps=1")
        self.counter = MicroStepCounter(may_take_over=self.takes_over)
        self.warned: list[str] = []
        self.carried = None  # ZeRO-1/2: this rank's reduced partition of the window, kept for the flush
        self.window_sum = None  # ZeRO-1/2 with offload: the window's sum of the fp32 partition's gradient
        # for the read wrappers, which reduce only windows this fix accumulated
        self.param_ids = frozenset(id(p) for p in engine.module.parameters()) if self.takes_over else ()

    def warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.append(key)
            log("warning", msg, *args)


def _outside_schedule(engine) -> str | None:
    """Why the engine's boundaries are not DeepSpeed's micro-step schedule this fix reasons about (then both
    wrappers pass straight through), or None."""
    if _FLAG not in engine.__dict__:
        return f"the engine has no {_FLAG} attribute: not measured"
    if getattr(engine, "pipeline_parallelism", False):
        return "pipeline engine: boundaries come from its schedule"
    path = paths.engine_path(engine)
    if not path.covered:  # ranks share micro-batches: the lazy boundary's reduction is not modelled there
        paths.stood_aside(FIX_ID, path)
        return str(path)
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is not None and not managed():
        return "managed_gradient_accumulation is off: step() is already the boundary"
    return None


def _eligibility(engine, stage: int) -> tuple[bool, str]:
    """Whether the lazy boundary's reduction is known to be exact for this engine (ZeRO-1/2 only: the
    stages whose boundary can discard a manual window)."""
    outside = _outside_schedule(engine)
    if outside is not None:
        return False, outside
    if stage not in (1, 2):
        return False, (f"ZeRO-{stage}: several backwards per step() accumulate by themselves at config "
                       "gradient_accumulation_steps=1; DeepSpeed's schedule decides the rest")
    opt = engine.optimizer
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
            FIX_ID, "active" if state.takes_over else "following DeepSpeed", state.stage, state.gas,
            state.reason)
    return state


def _in_upstream_api(engine) -> bool:
    """The backward runs inside ``engine.no_sync()`` or ``engine.coalesce_grad_reduction()`` (which sets the
    same flag): the user reduces through DeepSpeed's own API."""
    return bool(engine.__dict__.get("inside_no_sync_ctxt"))


# ----------------------------------------------------------------------------- wrappers
def backward(wrapped, engine, args, kwargs):
    flags = engine.__dict__
    state = flags.get(_STATE_KEY) or _state(engine)
    if not state.observes:
        return wrapped(*args, **kwargs)
    explicit = flags.get(_FLAG)
    counter = state.counter
    plan = counter.plan_backward(explicit_boundary=explicit, upstream_api=_in_upstream_api(engine))
    if plan.mode == FOLLOW:  # DeepSpeed's own schedule, the user's flag or API: exactly what DeepSpeed does
        boundary = (explicit if explicit is not None else engine.is_gradient_accumulation_boundary()) \
            if state.takes_over else False
        result = wrapped(*args, **kwargs)
    elif state.offload:
        result, state.window_sum = _zero12_offload.backward(
            wrapped, engine.optimizer, flags, _FLAG, state.window_sum, carry=plan.carry, args=args, kwargs=kwargs)
        boundary = True
        _unreduced.add(engine)  # a read before step() must see the window's sum
    else:
        if plan.carry:  # taken over without offload: the boundary replaces, so keep what it reduced
            state.carried = _partition_copy(engine.optimizer)
        boundary = False
        flags[_FLAG] = False  # lazy: step() (or a gradient read) reduces the window
        try:
            result = wrapped(*args, **kwargs)
        finally:
            flags[_FLAG] = None  # back to DeepSpeed's schedule
        _unreduced.add(engine)
    discarding = counter.backward(explicit_boundary=explicit, mode=plan.mode, boundary=boundary)
    if discarding and state.takes_over:
        state.warn_once("discard", "%s: backward() after a backward flagged with set_gradient_accumulation_"
                        "boundary(True) and before step(): DeepSpeed ZeRO-%d keeps only the gradients from "
                        "the flagged backward on. Flag only the last backward before step(), or none (zerofix "
                        "then finds the boundary itself).", FIX_ID, state.stage)
    return result


def step(wrapped, engine, args, kwargs):
    flags = engine.__dict__
    state = flags.get(_STATE_KEY)
    if state is None or not state.observes:
        return wrapped(*args, **kwargs)
    counter = state.counter
    explicit = flags.get(_FLAG)
    schedule = explicit is None and engine.is_gradient_accumulation_boundary()
    if counter.ambiguous_step(explicit_boundary=explicit, schedule_boundary=schedule):
        _warn_ambiguous(state, counter.since_step)
    plan = counter.plan_step(explicit_boundary=explicit, schedule_boundary=schedule)
    if plan.action == PASS:
        result = wrapped(*args, **kwargs)
    else:
        with _as_boundary(engine):
            if plan.action == FLUSH:
                _reduce_window(engine, state)
            result = wrapped(*args, **kwargs)
    counter.stepped(plan)
    if plan.micro_batches:
        _window_closed(engine, state)
    return result


def zero_grad(wrapped, engine, args, kwargs):
    """``engine.zero_grad()`` discards the window: lazy backwards are reduced first, as DeepSpeed's own
    boundaries would have reduced each of them, so the engine is left as DeepSpeed leaves it; the next
    backward starts a new window."""
    state = engine.__dict__.get(_STATE_KEY)
    if state is not None:
        if engine in _unreduced:
            with _as_boundary(engine):
                _reduce_window(engine, state)
        state.counter.zero_grad()
        _window_closed(engine, state)
    return wrapped(*args, **kwargs)


def _window_closed(engine, state: _EngineState) -> None:
    _unreduced.discard(engine)
    state.carried = None
    state.window_sum = None


def _warn_ambiguous(state: _EngineState, backwards: int) -> None:
    state.warn_once("ambiguous", "%s: %d backward() calls before a step() that DeepSpeed does not make an "
                    "update (config gradient_accumulation_steps=%d: DeepSpeed counts step() calls). That is "
                    "right when each micro-batch takes several backwards (DeepSpeed's own style); if every "
                    "step() should apply the backwards before it, set gradient_accumulation_steps to 1 in the "
                    "DeepSpeed config (zerofix then accumulates them) or use engine.coalesce_grad_reduction(). "
                    "zerofix cannot tell the two apart and follows DeepSpeed.", FIX_ID, backwards, state.gas)


def read_grad(wrapped, instance, args, kwargs):
    """``safe_get_full_grad`` / ``safe_set_full_grad`` / ``safe_update_full_grad_vectorized``: reduce a
    lazily accumulated window first, so the read sees what DeepSpeed's own boundary would have left.
    These reads are collectives under ZeRO-1/2 already (an all_reduce per parameter), so every rank
    reaches the reduction together. One truthiness test when nothing is pending."""
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
    if state is not None and state.takes_over and state.counter.manual and state.counter.pending:
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
    same window left (ZeRO-1/2 from 0.17.6 assign the reduced partition at a boundary)."""
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
    """What a boundary backward would have run after its gradients were computed (ZeRO-1/2, the only
    stages this fix takes over)."""
    _reduce_zero12(engine.optimizer)


def _reduce_zero12(opt) -> None:
    _prepare_buckets(opt)
    gradient_of = getattr(opt, "get_gradient_for_reduction", None) or (lambda p: p.grad)
    for i, group in enumerate(opt.bit16_groups):
        for param in group:
            if param.requires_grad and gradient_of(param) is not None:
                opt.reduce_ready_partitions_and_remove_grads(param, i)
    opt.overlapping_partition_gradients_reduce_epilogue()


def _prepare_buckets(opt) -> None:
    """The reduction buckets a backward sets up and the epilogue releases (the layouts of the releases
    taken over, >= 0.17.6; before, ZeRO-1/2 accumulate by themselves and only offload is taken over,
    through zerofix.fixes._zero12_offload)."""
    if hasattr(opt, "setup_buckets"):  # deepspeed >= 0.18.3
        opt.setup_buckets()
    else:  # 0.17.6 - 0.18.2: the same work, named backward_prologue
        opt.backward_prologue()


# ----------------------------------------------------------------------------- status
def reset_runtime() -> None:
    """Forget the engines listed (an engine DeepSpeed's hooks keep alive after its training would otherwise be listed
    by every later application in the process); what the wrappers keep on each engine is left as it is."""
    _engines.clear()


def runtime_details() -> list[dict]:
    """One entry per live engine this fix has seen (for zerofix.status())."""
    out = []
    for engine in list(_engines):
        state = engine.__dict__.get(_STATE_KEY)
        if state is not None:
            out.append({"engine": f"0x{id(engine):x}", "zero_stage": state.stage, "active": state.takes_over,
                        "why": state.reason, **state.counter.as_dict(), "warnings": list(state.warned)})
    return out
