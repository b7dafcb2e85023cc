"""The MoE router auxiliary loss, weighted as in one big batch: ``transformers-moe-aux-loss``.

A Mixture-of-Experts causal LM of transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ... 30 families in 5.23)
returns ``loss = cross_entropy(..., num_items_in_batch) + router_aux_loss_coef * aux_loss``: the cross-entropy is
normalised over the window's tokens, the auxiliary term is each micro-batch's own mean. The Trainer scales the sum
as one thing: it believes the loss normalised, so it divides neither term, and with
``average_tokens_across_devices`` multiplies both by the number of processes. The cross-entropy comes out right,
the auxiliary term GAS x (and x processes) too heavy (transformers #48690, open; NeMo Automodel #3359 and TRL #6083
fixed it in their own trainers). Where the Trainer divides the whole loss again (5.2.0 - 5.5.3: accelerate's second
division) the auxiliary term happens to be right and the cross-entropy is the one off: there
``transformers-trainer-scaling`` restores the cross-entropy, and this entry keeps the auxiliary term where it was.

The reference: the cross-entropy over every counted token of the window, plus the coefficient times the auxiliary
loss averaged over the window's micro-batches of every rank (tests/test_moe_aux_loss.py).

Mechanism (it rides on ``transformers-trainer-scaling``'s step, plan and path; without that entry, or on a path it
does not cover, it does nothing):

- ``compute_loss`` (the base Trainer's): asks the model's outputs of it (``return_outputs=True``, handed back as
  the caller asked) and keeps the step's auxiliary loss (``aux_loss`` of a ModelOutput, or the one 0-dim graph
  tensor after the loss of a tuple) and the model's ``router_aux_loss_coef``;
- ``backward`` (Accelerator.backward, inside the Trainer entry's wrapper, so after its plan): if the loss reaching
  it was computed from that auxiliary loss (its autograd graph reaches it: decided from behaviour, not from the
  model's class), the auxiliary term is re-weighted to ``1 / window`` of what reaches the gradient, given what the
  Trainer multiplied and divided, what the plan changed and what accelerate or the engine divides afterwards.
  Where that is already so, nothing changes (bitwise).

Ambiguity list: a ``compute_loss`` override that does not call the base one (its loss is the user's: untouched); a
batch without ``labels`` (the model adds no auxiliary term: not reached, untouched); a model whose auxiliary loss
does not reach the loss (``output_router_logits`` off: untouched); a user who already divides the auxiliary term
(not distinguishable from the Trainer's path: the statement ``zerofix.loss_is_scaled_for_ga`` turns the Trainer
entry's plan off, and this entry then weights the term as the plan leaves it).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from fractions import Fraction

import torch
from accelerate.utils import DistributedType  # imported by the fixes only, once accelerate is

from zerofix.fixes import trainer_scaling
from zerofix.fixes.contract import Check, drifted, found
from zerofix.identity import WeakIdentityMap

FIX_ID = "transformers-moe-aux-loss"
FIX_IDS = (FIX_ID,)
_GRAPH_NODES = 256  # how far back from the loss the auxiliary loss is looked for (it sits a few nodes down)
_details: dict = {}  # trainer class name -> {"backwards", "reweighted", "factor"}
_runs = WeakIdentityMap()  # trainer.state of a run -> [backwards whose loss carries a router term, re-weighted]


def structural_check(fix_id: str, targets) -> Check:
    if fix_id != FIX_ID:
        raise KeyError(fix_id)
    params = list(inspect.signature(targets["Trainer.compute_loss"]).parameters)
    if params[:3] != ["self", "model", "inputs"] or "return_outputs" not in params:
        return drifted(f"Trainer.compute_loss{tuple(params)} has no return_outputs")
    return found()


def _return_outputs(args, kwargs):
    """The caller's return_outputs, and the call asking for the outputs."""
    if "return_outputs" in kwargs:
        return bool(kwargs["return_outputs"]), args, {**kwargs, "return_outputs": True}
    if len(args) > 2:
        return bool(args[2]), (*args[:2], True, *args[3:]), kwargs
    return False, args, {**kwargs, "return_outputs": True}


def _aux_of(outputs):
    if isinstance(outputs, Mapping):
        aux = outputs.get("aux_loss")
        return aux if isinstance(aux, torch.Tensor) and aux.grad_fn is not None else None
    if isinstance(outputs, (tuple, list)):
        graph = [t for t in outputs if isinstance(t, torch.Tensor) and t.dim() == 0 and t.grad_fn is not None]
        return graph[1] if len(graph) == 2 else None  # (loss, aux_loss, logits, ...): to_tuple() drops Nones
    return None


def _coefficient(trainer):
    try:
        model = trainer.accelerator.unwrap_model(trainer.model)
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        model = trainer.model
    model = trainer_scaling.unwrap_peft(model)
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    return None if coef is None else float(coef)


def compute_loss(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    step = trainer_scaling.current_step(accelerator)
    if step is None or step.trainer is not trainer or step.aux is not None:
        return wrapped(*args, **kwargs)
    wanted, args, kwargs = _return_outputs(args, kwargs)
    loss, outputs = wrapped(*args, **kwargs)
    aux = _aux_of(outputs)
    # the coefficient only for a model with a router term: unwrapping the model at every micro-step cost 0.35 CPU s of
    # each rank of zerofix check's default run
    coef = _coefficient(trainer) if aux is not None else None
    if aux is not None and coef:
        step.aux = (aux, coef)
        # the router term is this entry's to weight: a loss of divided terms plus it is still divided (the Trainer
        # entry's verdict, zerofix.num_items_watch.decide)
        step.accounted = lambda term: _reaches(term, aux)
    return (loss, outputs) if wanted else loss


def _passes_value_through(node) -> bool:
    """Whether an autograd node only hands its one input's value on: a copy (``.to()``: another dtype or device), or
    one of the identity functions ZeRO-3 wraps every module output in (DeepSpeed's parameter_offload: forward
    returns ``outputs.detach()``, backward its gradient, to fetch the module's parameters before its backward)."""
    if node.name() == "ToCopyBackward0":
        return True
    forward = getattr(node, "_forward_cls", None)
    return forward is not None and getattr(forward, "__module__", "").startswith("deepspeed.runtime.zero.")


def _copied_from(node, output_nr: int = 0) -> set:
    """``node`` and, through nodes that only pass a value on, the node it came from. A model's loss is computed from
    the auxiliary loss inside its forward; what its output carries can be a copy of that: accelerate casts
    low-precision outputs to float32 (convert_outputs_to_fp32, so with FSDP2's bf16 parameters), ZeRO-3 wraps each
    module output. The loss's graph never reaches the copy (measured: the router term left unweighted on both, H100
    and CPU). DDP hands every output through one identity function (``_DDPSink``, one output per input): its
    ``output_nr``-th input is the one this output copies."""
    nodes = {node}
    for _ in range(8):
        if node is None:
            break
        forward = getattr(node, "_forward_cls", None)
        if getattr(forward, "__name__", "") == "_DDPSink" and output_nr < len(node.next_functions):
            node, output_nr = node.next_functions[output_nr][0], 0
            nodes.add(node)
            continue
        if not _passes_value_through(node):
            break
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            break
        node = inputs[0]
        nodes.add(node)
    return nodes


def _reaches(loss, aux) -> bool:
    """Whether ``loss`` was computed from ``aux`` (or from what ``aux`` is a copy of): that autograd node is among
    the loss's first nodes."""
    targets, seen, queue = _copied_from(aux.grad_fn, aux.output_nr), set(), [getattr(loss, "grad_fn", None)]
    while queue and len(seen) < _GRAPH_NODES:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        if node in targets:
            return True
        seen.add(node)
        queue.extend(n for n, _ in node.next_functions)
    return False


def reweighting(call, plan, *, downstream_now: int) -> Fraction:
    """What to add to the loss, times coefficient x auxiliary loss, so the auxiliary term reaches the gradient at
    1 / window: it reaches it now at world_multiplied x plan / (trainer_divided x downstream_now)."""
    now = Fraction(call.world_multiplied * plan.multiply_by, call.trainer_divided * plan.divide_by)
    return Fraction(downstream_now, call.window) - now


def backward(wrapped, accelerator, args, kwargs):
    step = trainer_scaling.current_step(accelerator)
    if step is None or step.aux is None or step.call is None:
        return wrapped(*args, **kwargs)
    aux, coef = step.aux
    step.aux = None
    loss = args[0] if args else kwargs["loss"]
    details = _details.setdefault(type(step.trainer).__name__, {"backwards": 0, "reweighted": 0, "factor": None})
    details["backwards"] += 1
    if not _reaches(loss, aux):
        return wrapped(*args, **kwargs)
    run = _run_of(step)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        downstream = int(step.trainer.args.gradient_accumulation_steps) if kwargs.get("scale_wrt_gas", True) else 1
    else:
        downstream = int(accelerator.gradient_accumulation_steps)
    extra = reweighting(step.call, step.plan, downstream_now=downstream)
    if extra == 0:
        return wrapped(*args, **kwargs)
    details["reweighted"] += 1
    if run is not None:
        run[1] += 1
    details["factor"] = str(extra)
    loss = loss + (coef * float(extra)) * aux.to(loss.device, loss.dtype)
    args, kwargs = ((loss, *args[1:]), kwargs) if args else ((), {**kwargs, "loss": loss})
    return wrapped(*args, **kwargs)


def _run_of(step):
    """This run's counts (a backward whose loss carries the router term is counted), or None where its state cannot
    be kept beside it."""
    state = getattr(step.trainer, "state", None)
    try:
        run = _runs.get(state)
        if run is None:
            run = _runs[state] = [0, 0]
    except TypeError:  # not weak-referenceable: the run is not reported per run
        return None
    run[0] += 1
    return run


def acted_in(fix_id: str, trainer_state) -> str | None:
    """What this entry did in the run whose ``trainer.state`` this is (the Trainer's log: trainer_report), or None
    where its loss never carried a router auxiliary loss (a dense model)."""
    try:
        run = _runs.get(trainer_state)
    except TypeError:
        return None
    if not run:
        return None
    backwards, reweighted = run
    return (f"its loss adds a router auxiliary loss; zerofix re-weighted that term in {reweighted} of the "
            f"{backwards} backwards so far" if reweighted else
            f"its loss adds a router auxiliary loss, weighted right by this run's path in all {backwards} backwards "
            "so far: left as it is")


def runtime_details() -> list[dict]:
    """Per trainer class: backwards seen with an auxiliary loss, how many zerofix re-weighted, and by what it
    added (``factor`` x coefficient x auxiliary loss, to the loss that reached Accelerator.backward)."""
    return [{"trainer": name, **d} for name, d in _details.items()]


def reset_runtime() -> None:
    _details.clear()
