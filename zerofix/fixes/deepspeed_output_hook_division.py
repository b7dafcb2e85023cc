"""deepspeed-output-hook-division: each gradient is divided by GAS once, not once per forward output.

From 0.18.3 (#7665, the PyTorch-style ``backward``) ``engine.forward`` registers a backward hook on every
tensor of the model's output (``OutputBackwardHookManager``), and each hook divides the gradient flowing
into its tensor by gradient_accumulation_steps (``DeepSpeedEngine._backward_prologue_per_tensor``). A
Hugging Face model returns its logits next to the loss, and the loss is computed from those logits: the
gradient is divided at the loss and again at the logits, so the update is 1/GAS of the intended one (one
more 1/GAS per further output on the loss's path, e.g. ``output_hidden_states``). ``engine.backward(loss)``
shows it on 0.18.3 - 0.19.5 (0.19.6 divides the loss once at the root and lets the hooks pass); a direct
``loss.backward()`` shows it on every release since 0.18.3 (measured 0.18.9 and 0.19.8, ZeRO-1/2; ZeRO-3
hands the outputs through its own autograd functions, so they do not lie on each other's path).

zerofix divides each gradient once, as 0.19.6 does inside ``engine.backward``:

- ``engine.backward(loss)`` (scale_wrt_gas=True) on releases whose hook divides at every output: a hook
  on ``loss`` itself divides by GAS, and the output hooks pass their gradients through while the call
  runs. When ``loss`` is the model's own output (a Hugging Face loss, Accelerate) the division happens on
  the same tensor with the same operation as DeepSpeed's, bit for bit; a loss computed from the outputs is
  divided at the root instead of at the outputs, the value of 0.19.6 up to rounding. A loss that crossed
  no hooked output (``engine.module(...)`` called directly) was not divided at all by 0.18.3 - 0.19.5 and
  is divided now, as before 0.18.3 and from 0.19.6 on.
- A direct ``loss.backward()`` has no root zerofix can see: when an output's hook fires it walks the
  autograd graph below its node (only nodes created after the earliest hooked output of that forward: a
  node's inputs are always older than it) and records which of the forward's other outputs it reaches;
  their hooks then pass the gradient through. Outputs not on each other's path (a loss and an auxiliary
  loss the user sums) are divided each, as upstream does. An output reached partly through another output
  and partly around it (a penalty on the logits added to the loss) cannot be split at its hook: it is left
  undivided, so the penalty's share is GAS times too large there (upstream divides the loss's share twice).

Ambiguity list (docs/fixes.md): it reacts to a second hooked output on the loss's path. Outputs not on each
other's path (a loss and an auxiliary loss summed by the user) are divided each, as upstream; a model returning
only its loss is divided on the same tensor by the same operation, bitwise (the ``-logits`` cells of the
transparency matrix, tests/test_deepspeed_output_hook.py). A penalty on the logits added to the loss is the one
mixed case, stated above.
"""
from __future__ import annotations

import inspect
import threading

from zerofix import applied
from zerofix.fixes import _deepspeed_backward
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "deepspeed-output-hook-division"
FIX_IDS = (FIX_ID,)
MAKE_HOOK = "OutputBackwardHookManager._make_backward_hook"
PER_TENSOR = "DeepSpeedEngine._backward_prologue_per_tensor"
BACKWARD = _deepspeed_backward.QUALNAME
ROOT_SCALED = "root_scaled"  # fact: engine.backward() divides the root itself (0.19.6+), zerofix leaves it
# What the per-tensor hook reads, per release: 0.18.3 divides unconditionally; 0.18.4 - 0.19.5 unless
# backward() was called with scale_wrt_gas=False (0.19.x also not under functorch); 0.19.6 - 0.19.8 unless
# engine.backward() scaled the graph's root itself.
_PER_TENSOR_NAMES = frozenset({"gradient_accumulation_steps", "_scale_wrt_gas", "is_functorch_transforming",
                               "_ENGINE_BACKWARD_GRAPH_TRACKER", "is_current_graph_registered"})
_HOOKED = "_zerofix_hooked"  # manager.__dict__: sequence numbers of the hooked outputs' autograd nodes
_BELOW = "_zerofix_below"  # manager.__dict__: (graph task id, outputs below a division in that backward)
_ROOT = "_zerofix_root_divided"  # engine.__dict__: engine.backward divides at the root, outputs pass
_local = threading.local()  # .skip: set while a hook runs whose division is skipped


def structural_check(fix_id: str, targets) -> Check:
    """Found when the hook manager's per-tensor hook calls ``preprocess_per_tensor_fn`` and the engine's
    per-tensor function divides by gradient_accumulation_steps (reading nothing unknown), and torch can
    say which node a hook runs for and which backward it belongs to."""
    import torch

    for name in ("_current_autograd_node", "_current_graph_task_id"):
        if not callable(getattr(torch._C, name, None)):
            return drifted(f"torch._C.{name} is gone")
    make = inspect.unwrap(targets[MAKE_HOOK])
    if list(inspect.signature(make).parameters) != ["self", "tensor"]:
        return drifted(f"{MAKE_HOOK} is not (self, tensor)")
    inner = [c for c in make.__code__.co_consts if inspect.iscode(c)]
    if len(inner) != 1 or not {"preprocess_per_tensor_fn", "preprocess_once_fn"} <= set(inner[0].co_names):
        return drifted(f"{MAKE_HOOK}'s hook does not call preprocess_once_fn and preprocess_per_tensor_fn")
    per_tensor = inspect.unwrap(targets[PER_TENSOR])
    if list(inspect.signature(per_tensor).parameters) != ["self", "grad"]:
        return drifted(f"{PER_TENSOR} is not (self, grad)")
    names = set(per_tensor.__code__.co_names)
    if "gradient_accumulation_steps" not in names or not names <= _PER_TENSOR_NAMES:
        return drifted(f"{PER_TENSOR} reads {sorted(names - _PER_TENSOR_NAMES) or 'no GAS'}: not the division "
                       "measured")
    return _deepspeed_backward.check(targets[BACKWARD],
                                     **{ROOT_SCALED: "_ENGINE_BACKWARD_GRAPH_TRACKER" in names})


def backward(wrapped, engine, args, kwargs):
    """``engine.backward(loss)``: divide at ``loss`` once, the output hooks pass (see the module's doc)."""
    facts = applied.facts(FIX_ID)
    loss = args[0] if args else kwargs.get("loss")
    if (facts[ROOT_SCALED] or not getattr(loss, "requires_grad", False)
            or not _deepspeed_backward.scale_wrt_gas(args, kwargs, facts[_deepspeed_backward.POSITION])):
        return wrapped(*args, **kwargs)
    gas = engine.gradient_accumulation_steps()
    handle = loss.register_hook(lambda grad: grad / gas)  # after DeepSpeed's own hook on the same tensor
    flags = engine.__dict__
    flags[_ROOT] = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        flags.pop(_ROOT, None)
        handle.remove()


def make_backward_hook(wrapped, manager, args, kwargs):
    """The manager's hook for one output, wrapped: records the output and skips its division where the
    gradient was divided above it already."""
    hook = wrapped(*args, **kwargs)
    fn = getattr(manager, "preprocess_per_tensor_fn", None)
    if getattr(fn, "__name__", None) != "_backward_prologue_per_tensor":  # a manager that is not the engine's
        return hook
    tensor = args[0] if args else kwargs["tensor"]
    node = tensor.grad_fn
    if node is None:
        return hook
    engine_flags = fn.__self__.__dict__
    state = manager.__dict__
    if not manager.hook_handles:  # the first output of a registration (register_hooks_on_outputs resets)
        state[_HOOKED] = []
        state.pop(_BELOW, None)
    seq = node._sequence_nr()
    state[_HOOKED].append(seq)  # ints only: a node held here would tie the graph to its own hooks

    def divide_once(grad):
        if _ROOT in engine_flags:  # inside engine.backward, divided at the root: every output passes
            return hook(grad)
        import torch

        task = torch._C._current_graph_task_id()
        below = state.get(_BELOW)
        if below is None or below[0] != task:
            below = state[_BELOW] = (task, set())
        if seq in below[1]:  # DeepSpeed divided this gradient at an output above: pass it on as it is
            _local.skip = True
            try:
                return hook(grad)
            finally:
                _local.skip = False
        result = hook(grad)
        older = [s for s in state[_HOOKED] if s < seq]
        if older:
            below[1].update(_reached(torch._C._current_autograd_node(), older))
        return result

    return divide_once


def per_tensor(wrapped, engine, args, kwargs):
    if getattr(_local, "skip", False) or _ROOT in engine.__dict__:
        return args[0] if args else kwargs["grad"]
    return wrapped(*args, **kwargs)


def _reached(node, targets: list[int]) -> set[int]:
    """Which of ``targets`` (sequence numbers of nodes) lie below ``node``. Only nodes at least as new as
    the oldest target are visited: an input's node is always older than the node using it."""
    wanted, floor = set(targets), min(targets)
    found_, stack, seen = set(), [node], set()
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is None or child in seen:
                continue
            seen.add(child)
            nr = child._sequence_nr()
            if nr < floor:
                continue
            if nr in wanted:
                found_.add(nr)
                if found_ == wanted:
                    return found_
            stack.append(child)
    return found_
