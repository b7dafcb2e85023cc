"""What the DeepSpeed fixes cost, measured side by side in one run (2 gloo ranks, CPU).

Launch: ``python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_deepspeed_accumulation.py``
(``make bench-ds``).

1. Per call: the real ``backward`` / ``step`` wrappers, bound through wrapt exactly as ``patch()`` installs
   them, around a no-op method on a real ZeRO-2 engine, against the bare no-op (the reduction a flush runs
   is the work a boundary backward would have done, so it is stubbed out here and counted in 3). The same
   for the backports' wrappers (deepspeed-zero12-accumulator, deepspeed-scale-wrt-gas).
2. End to end, DeepSpeed's own style (backward + step per micro-batch, config GAS=4: zerofix only
   observes it) unpatched vs patched, windows interleaved, median.
3. Communication: every torch.distributed collective counted (calls and elements) over one window, for
   DeepSpeed's own boundary (config GAS=4, backward + step per micro-batch, unpatched) and zerofix's lazy
   boundary (config GAS=1, 4 backwards then one step, patched), ZeRO-1 and ZeRO-2 (the stages zerofix takes
   over, from deepspeed 0.17.6). The first window warms up.

4. deepspeed-output-hook-division's three wrappers, per call (output_hook_per_call_us).

``BENCH_PARTS`` (default ``calls,window,collectives,hooks``) names the parts to run: the test of part 3 runs only
``collectives``, since the timings are this benchmark's business, not the test's.
Targets (issue 3): < 10 us per wrapped call; the flush communicates no more than a boundary backward.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import timeit

import torch
import torch.distributed as dist

from zerofix.check.host import collectives  # noqa: E402 - imports no DeepSpeed

# Count collectives at the torch level, installed before DeepSpeed caches any of these functions.
calls: collections.Counter = collections.Counter()
elements: collections.Counter = collections.Counter()


def _count(name: str, numel: int) -> None:
    calls[name] += 1
    elements[name] += numel


collectives.install(_count)

import deepspeed  # noqa: E402

import zerofix  # noqa: E402
from zerofix import catalogue  # noqa: E402
from zerofix.check import accumulation, models  # noqa: E402
from zerofix.check.scenarios.ds_accumulation import ds_config  # noqa: E402

FIX = "deepspeed-manual-accumulation"
# Patched runs enable every DeepSpeed fix: on 0.17.6-0.18.2 the lazy boundary needs the accumulator fix.
DS_FIXES = [f.id for f in catalogue.FIXES if f.dist == "deepspeed"]
N_CALLS = int(os.environ.get("BENCH_CALLS", "20000"))
N_WINDOWS = int(os.environ.get("BENCH_WINDOWS", "15"))
PARTS = {"calls", "window", "collectives", "hooks"}
ASKED = set(filter(None, os.environ.get("BENCH_PARTS", ",".join(sorted(PARTS))).split(",")))
if not ASKED or ASKED - PARTS:
    sys.exit(f"BENCH_PARTS={os.environ.get('BENCH_PARTS')!r}: name some of {', '.join(sorted(PARTS))}, comma-separated")


def engine_for(stage: int, gas: int):
    model = models.build_model("custom", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cell = accumulation.Cell(stage, gas, "a")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cell))
    return engine


def batch_for(micro_step: int):
    return models.collate(accumulation.sample_indices(micro_step, dist.get_rank(), dist.get_world_size()))


def micro(engine, micro_step):
    loss = engine(**batch_for(micro_step))["loss"]
    engine.backward(loss)


def step(engine):
    with torch.no_grad():
        engine.step()


# ----------------------------------------------------------------------------- 1. per call
def as_applied(fix_id: str) -> None:
    """The wrappers are bound here by hand, not by patch(): record what the fix's structural check finds on
    this DeepSpeed (the wrappers read it from zerofix.applied), as patch() would."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from zerofix import applied
    from zerofix.fixes import _deepspeed_backward

    applied.mark_applied(fix_id, _deepspeed_backward.check(DeepSpeedEngine.backward).facts)


def per_call_us() -> dict:
    import wrapt

    from zerofix.fixes import deepspeed_manual_accumulation as fix

    engine = engine_for(2, 1)
    cls = type(engine)
    loss = torch.zeros(())

    def noop_backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        return loss

    def noop_step(self, lr_kwargs=None):
        return None

    as_applied(fix.FIX_ID)
    wrapped_backward = wrapt.FunctionWrapper(noop_backward, fix.backward)
    wrapped_step = wrapt.FunctionWrapper(noop_step, fix.step)
    real_reduce = fix._reduce_as_boundary
    fix._reduce_as_boundary = lambda engine, stage: None  # the reduction itself is counted in part 3
    try:
        def window(backward_fn, step_fn):
            for _ in range(4):
                backward_fn.__get__(engine, cls)(loss)
            step_fn.__get__(engine, cls)()

        out = {}
        for label, b, s in (("bare", noop_backward, noop_step), ("zerofix", wrapped_backward, wrapped_step)):
            # median of 5 runs of N_CALLS/5 windows (4 backwards + 1 flushing step each)
            n = N_CALLS // 5
            times = [timeit.timeit(lambda b=b, s=s: window(b, s), number=n) / n for _ in range(5)]
            out[label] = statistics.median(times) * 1e6
        # per call: a window is 5 calls
        out["added_per_call_us"] = (out["zerofix"] - out["bare"]) / 5
        back = [timeit.timeit(lambda: wrapped_backward.__get__(engine, cls)(loss), number=N_CALLS)
                - timeit.timeit(lambda: noop_backward.__get__(engine, cls)(loss), number=N_CALLS)
                for _ in range(3)]
        out["added_per_backward_us"] = statistics.median(back) / N_CALLS * 1e6
        out["added_per_flushing_step_us"] = (out["zerofix"] - out["bare"]) - 4 * out["added_per_backward_us"]
        # DeepSpeed's own style (backward + step per micro-batch): zerofix follows, every call passes through
        own = engine_for(2, 4)

        def own_window(backward_fn, step_fn):
            for _ in range(4):
                backward_fn.__get__(own, cls)(loss)
                step_fn.__get__(own, cls)()

        n = N_CALLS // 8
        own_times = {label: statistics.median(timeit.timeit(lambda b=b, s=s: own_window(b, s), number=n) / n
                                              for _ in range(5)) * 1e6
                     for label, b, s in (("bare", noop_backward, noop_step),
                                         ("zerofix", wrapped_backward, wrapped_step))}
        out["own_style_added_per_call_us"] = (own_times["zerofix"] - own_times["bare"]) / 8
        # a gradient read with nothing pending (the read wrapper's common case)
        read = wrapt.FunctionWrapper(lambda param: param, fix.read_grad)
        out["read_added_per_call_us"] = (min(timeit.repeat(lambda: read(loss), number=N_CALLS, repeat=3))
                                         - min(timeit.repeat(lambda: (lambda param: param)(loss), number=N_CALLS,
                                                             repeat=3))) / N_CALLS * 1e6
        return out
    finally:
        fix._reduce_as_boundary = real_reduce


def backport_per_call_us() -> dict:
    """The backports' wrappers, per call, on the same kind of engine (their cost does not depend on
    the release: they read and write a few dict entries). The epilogue is timed in its costliest state:
    every parameter group's accumulator holds gradients, so each call substitutes and restores."""
    import wrapt

    from zerofix.fixes import deepspeed_scale_wrt_gas as scale
    from zerofix.fixes import deepspeed_zero12_accumulator as accumulator

    engine = engine_for(2, 4)
    opt = engine.optimizer
    groups = range(len(opt.bit16_groups))
    loss, grad = torch.zeros(()), torch.zeros(4)

    def noop_epilogue(self):
        return None

    def noop_backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        return loss

    def noop_hook(self, grad):
        return grad

    as_applied(scale.FIX_ID)
    pairs, saved = {}, {}
    if hasattr(opt, "all_grad_tensors"):  # the accumulator the fix guards (0.16.3 has none)
        saved = {i: (opt.all_grad_tensors.get(i), opt.averaged_gradients.get(i)) for i in groups}
        for i in groups:
            opt.all_grad_tensors[i], opt.averaged_gradients[i] = [], None
        pairs["epilogue (deepspeed-zero12-accumulator)"] = (
            noop_epilogue, wrapt.FunctionWrapper(noop_epilogue, accumulator.epilogue), opt, (), {})
    pairs.update({
        "backward (deepspeed-scale-wrt-gas)":
            (noop_backward, wrapt.FunctionWrapper(noop_backward, scale.backward), engine, (loss,),
             {"scale_wrt_gas": False}),
        "output hook, scale_wrt_gas=False (deepspeed-scale-wrt-gas)":
            (noop_hook, wrapt.FunctionWrapper(noop_hook, scale.per_tensor), engine, (grad,), {}),
    })
    pairs.update(_offload_accumulator_pairs())
    out = {}
    try:
        engine.__dict__[scale._KEY] = False  # as inside engine.backward(loss, scale_wrt_gas=False)
        for label, (bare, wrapped, owner, args, kwargs) in pairs.items():
            bare_bound, wrapped_bound = bare.__get__(owner, type(owner)), wrapped.__get__(owner, type(owner))
            added = [timeit.timeit(lambda f=wrapped_bound, a=args, k=kwargs: f(*a, **k), number=N_CALLS)
                     - timeit.timeit(lambda f=bare_bound, a=args, k=kwargs: f(*a, **k), number=N_CALLS)
                     for _ in range(5)]
            out[label] = statistics.median(added) / N_CALLS * 1e6
    finally:
        engine.__dict__.pop(scale._KEY, None)
        for i, (accumulated, averaged) in saved.items():
            opt.all_grad_tensors[i], opt.averaged_gradients[i] = accumulated, averaged
    return out


def _offload_accumulator_pairs() -> dict:
    """deepspeed-offload-accumulator's wrapper around the per-parameter CPU accumulation, on a stand-in
    optimizer holding one 4-element gradient: at the window's first micro-step (it passes) and after it
    (it stores the sum back: one 4-element copy, the statement DeepSpeed 0.19 runs there itself)."""
    from types import SimpleNamespace

    import wrapt

    from zerofix import applied
    from zerofix.fixes import deepspeed_offload_accumulator as offload

    applied.mark_applied(offload.FIX_ID, {"sliced": "low_precision_master_weights_and_grads"})
    param = torch.zeros(4)
    grads = {0: torch.ones(4)}
    out = {}
    for micro_step in (0, 1):
        opt = SimpleNamespace(micro_step_id=micro_step, partition_gradients=True, get_param_id=lambda p: 0,
                              get_param_gradient_attribute=lambda p: grads[0], grad_position={0: [0, 0, 0, 4]},
                              accumulated_grads_in_cpu={0: torch.zeros(4)},
                              low_precision_master_weights_and_grads=False)

        def noop_accumulate(self, param):
            return None

        where = "first micro-step" if micro_step == 0 else "later micro-step, stores the sum"
        out[f"CPU accumulation, {where} (deepspeed-offload-accumulator)"] = (
            noop_accumulate, wrapt.FunctionWrapper(noop_accumulate, offload.accumulate), opt, (param,), {})
    return out


# ----------------------------------------------------------------------------- 2. end to end
def own_style_window_ms() -> dict:
    engines = {"unpatched": engine_for(2, 4), "patched": engine_for(2, 4)}
    times = collections.defaultdict(list)
    for w in range(N_WINDOWS + 1):
        for label in ("unpatched", "patched"):
            if label == "patched":
                zerofix.patch(fixes=DS_FIXES)
            dist.barrier()
            t0 = timeit.default_timer()
            for i in range(4):
                micro(engines[label], 4 * w + i)
                step(engines[label])
            dist.barrier()
            if w:  # window 0 warms up
                times[label].append((timeit.default_timer() - t0) * 1e3)
            zerofix.unpatch()
    return {k: statistics.median(v) for k, v in times.items()}


# ----------------------------------------------------------------------------- 4. output hooks
HOOK_FIX = "deepspeed-output-hook-division"


def output_hook_per_call_us(n: int = 5000) -> dict:
    """deepspeed-output-hook-division's wrappers, per call, around DeepSpeed's real hook manager on a small
    (loss, logits) graph (a whole engine micro-step is ~4 ms on 2 busy cores: noise of +-0.3 ms hides them).
    ``hooks``: a backward through the manager's two output hooks (the direct-backward path: the loss's hook
    walks to the logits, the logits' hook passes), minus the same backward through the bare manager, per
    hook. ``backward``: the engine.backward wrapper (a hook on the loss, registered and removed) around a
    no-op backward. ``per_tensor``: the per-tensor wrapper with nothing to skip."""
    import wrapt
    from deepspeed.runtime.engine import DeepSpeedEngine

    try:
        from deepspeed.runtime.utils import OutputBackwardHookManager
    except ImportError:  # DeepSpeed < 0.18.3: no output hooks, nothing for the entry to do
        return {}
    from zerofix import applied
    from zerofix.fixes import deepspeed_output_hook_division as hook

    targets = {hook.MAKE_HOOK: OutputBackwardHookManager._make_backward_hook,
               hook.PER_TENSOR: DeepSpeedEngine._backward_prologue_per_tensor, hook.BACKWARD: DeepSpeedEngine.backward}
    applied.mark_applied(HOOK_FIX, hook.structural_check(HOOK_FIX, targets).facts)
    facts = dict(applied.facts(HOOK_FIX))
    applied.mark_applied(HOOK_FIX, {**facts, hook.ROOT_SCALED: False})  # time the wrapper where it acts

    class Engine:  # stands for the engine: its per-tensor function divides by GAS
        def _backward_prologue_per_tensor(self, grad):
            return grad / 4

        def gradient_accumulation_steps(self):
            return 4

    class Patched(Engine):
        _backward_prologue_per_tensor = wrapt.FunctionWrapper(Engine._backward_prologue_per_tensor, hook.per_tensor)

    class PatchedManager(OutputBackwardHookManager):
        _make_backward_hook = wrapt.FunctionWrapper(OutputBackwardHookManager._make_backward_hook,
                                                    hook.make_backward_hook)

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 11)

    def train(engine, manager_cls):
        logits = x @ w
        loss = logits.log_softmax(-1).mean()
        manager_cls(lambda: None, engine._backward_prologue_per_tensor).register_hooks_on_outputs(
            {"loss": loss, "logits": logits})
        loss.backward()

    bare, patched = (Engine(), OutputBackwardHookManager), (Patched(), PatchedManager)
    added = [timeit.timeit(lambda: train(*patched), number=n) - timeit.timeit(lambda: train(*bare), number=n)
             for _ in range(5)]
    out = {"hooks": statistics.median(added) / n / 2 * 1e6}

    def noop_backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        return loss

    engine, loss = Engine(), torch.zeros((), requires_grad=True) * 1
    wrapped = wrapt.FunctionWrapper(noop_backward, hook.backward).__get__(engine, Engine)
    plain = noop_backward.__get__(engine, Engine)
    out["backward"] = statistics.median(timeit.timeit(lambda: wrapped(loss), number=n)
                                        - timeit.timeit(lambda: plain(loss), number=n) for _ in range(5)) / n * 1e6
    grad = torch.zeros(4)
    out["per_tensor"] = statistics.median(
        timeit.timeit(lambda: Patched()._backward_prologue_per_tensor(grad), number=n)
        - timeit.timeit(lambda: Engine()._backward_prologue_per_tensor(grad), number=n) for _ in range(5)) / n * 1e6
    applied.mark_removed(HOOK_FIX)
    return out


# ----------------------------------------------------------------------------- 3. communication
def window_collectives(stage: int, gas: int, style: str, patched: bool) -> dict:
    if patched:
        zerofix.patch(fixes=DS_FIXES)
    try:
        engine = engine_for(stage, gas)
        result = {}
        for w in range(2):
            calls.clear()
            elements.clear()
            for i in range(4):
                micro(engine, 4 * w + i)
                if style == "b":
                    step(engine)
            if style == "a":
                step(engine)
            result = {"calls": dict(calls), "elements": dict(elements)}
        return result
    except TypeError as exc:  # unpatched manual accumulation on 0.17.6-0.18.2 (on every rank alike)
        return {"calls": {}, "elements": {}, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        zerofix.unpatch()


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    report = {"deepspeed": deepspeed.__version__, "world": dist.get_world_size()}
    if "calls" in ASKED:
        report["per_call_us"] = per_call_us()
        report["backport_per_call_us"] = backport_per_call_us()
    if "window" in ASKED:
        report["own_style_window_ms"] = own_style_window_ms()
    if "hooks" in ASKED:
        report["output_hook_per_call_us"] = output_hook_per_call_us()
    report["collectives"] = {}
    for stage in (1, 2) if "collectives" in ASKED else ():  # the stages zerofix takes over (config GAS=1, deepspeed >= 0.17.6)
        boundary = window_collectives(stage, 4, "b", patched=False)
        lazy = window_collectives(stage, 1, "a", patched=True)
        last_only = window_collectives(stage, 1, "a", patched=False)
        report["collectives"][f"ZeRO-{stage}"] = {"deepspeed boundary (GAS=4, own style)": boundary,
                                                  "zerofix lazy boundary (GAS=1, 4 backwards + step)": lazy,
                                                  "unpatched GAS=1, 4 backwards + step": last_only}
    if rank == 0:
        print(json.dumps(report, indent=1))
        if "calls" in ASKED:
            pc = report["per_call_us"]
            print(f"\nper backward call: +{pc['added_per_backward_us']:.2f} us; per flushing step(): "
                  f"+{pc['added_per_flushing_step_us']:.2f} us (target < 10 us)")
            print(f"DeepSpeed's own style (zerofix follows): +{pc['own_style_added_per_call_us']:.2f} us per call; "
                  f"a gradient read with nothing pending: +{pc['read_added_per_call_us']:.2f} us")
            for label, us in report["backport_per_call_us"].items():
                print(f"per {label} call: +{us:.2f} us")
        for label, us in report.get("output_hook_per_call_us", {}).items():
            print(f"per {label} call ({HOOK_FIX}): +{us:.2f} us")
        if "window" in ASKED:
            e2e = report["own_style_window_ms"]
            print(f"DeepSpeed's own style, ZeRO-2, one 4-micro-batch window: unpatched {e2e['unpatched']:.2f} ms, "
                  f"patched {e2e['patched']:.2f} ms (x{e2e['patched'] / e2e['unpatched']:.3f})")
        if report["collectives"]:
            print("\ncollective calls per window (elements):")
        for stage, rows in report["collectives"].items():
            for label, counts in rows.items():
                if "error" in counts:
                    print(f"  {stage:7s} {label:52s} raises {counts['error']}")
                    continue
                total = sum(counts["calls"].values())
                detail = ", ".join(f"{k} {v} ({counts['elements'][k]})" for k, v in sorted(counts["calls"].items()))
                print(f"  {stage:7s} {label:52s} {total:3d}: {detail}")
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    from zerofix.check.rank import finish

    finish()


if __name__ == "__main__":
    main()
