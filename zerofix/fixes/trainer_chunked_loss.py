"""The Trainer's causal-LM and vision-language losses without the full logits: ``transformers-trainer-chunked-loss``.

Not a bug fix: a switch (opt-in: ``zerofix.patch(opt_in=["transformers-trainer-chunked-loss"])`` or
``ZEROFIX_OPT_IN=transformers-trainer-chunked-loss``). A causal LM's forward builds ``batch x seq x vocab`` logits
for its loss (at 32k tokens and a 152k vocabulary: 19 GiB in float32, more than the rest of the step); with the
switch, the Trainer's training loss comes from ``zerofix.chunked_cross_entropy`` on the backbone's last hidden state
and the head's weight, chunk by chunk, ZeRO-3 safe.

Mechanism, inside ``Trainer.compute_loss`` only, in training (``model.training``), for a batch with ``labels``:
the model's ``forward`` (the transformers model inside DDP, DeepSpeed, FSDP2 or PEFT) is, for that call, a
function that runs the backbone (``model.<base_model_prefix>``: every input the model was given, images
included), then the chunked loss of the hidden states against ``labels[..., 1:]``, with the head's weight and bias,
its logit scale or softcap, and ``num_items_in_batch`` when the Trainer passed it (the loss is then divided by
that count tensor, which the Trainer entry's watch sees). It returns the model's output type with the loss and
no logits. Generation, evaluation (``model.eval()``), a batch without labels, a ``compute_loss_func`` and a
label smoother go through the model's own forward.

Which model it routes is decided from behaviour, per model and batch form, on the first batch with a counted label,
in the model's own mode (training, in the step): the model's own forward *with the labels* against the route, each
with a count and without one, from one random state (torch's, Python's and NumPy's) and the model's buffers as they
were, both restored afterwards (``_probe``). Their hidden states, losses and the gradients those give the hidden
states must agree; otherwise the model keeps its own loss and the log says why, once (runtime details:
``zerofix.status()``).

Ambiguity list (docs/fixes.md): what produces the observations the switch reacts to, and what it does with each.
- A training loss that is not the chunked loss of the backbone's hidden states (a z-loss or dropout only in training,
  a decoder fed from the labels, labels aligned otherwise, a router auxiliary loss, an inline mean that ignores the
  count): the proof finds it, the model keeps its own loss, said once (tests/test_trainer_chunked_loss_unit.py).
- A forward that draws randomness: from torch, Python's ``random`` or NumPy, replayed, so the route is proven and the
  step draws what it draws without the switch; from elsewhere, the two forwards differ from each other and the model
  keeps its own loss with that reason (tests/test_trainer_chunked_loss_unit.py, issue 69).
- Whatever reads the logits or the head's call: a ``compute_loss_func``, a label smoother, ``return_outputs=True``,
  ``output_hidden_states``, forward or backward hooks on the head or on the model, process-wide module hooks: the
  switch stands aside for that trainer, said once; a compiled model too. A user's hooks inside the backbone see the
  step's forwards only (the proof's run with them off).
- Evaluation, generation, a batch without labels or with ``shift_labels``: the model's own forward, untouched.
- A trainer whose ``compute_loss`` never reaches ``Trainer.compute_loss`` (TRL's DPO and reward trainers): nothing is
  routed, said once; a tensor, context or sequence parallel layout: not covered, said.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Mapping

import torch

from zerofix import hooks
from zerofix.fixes import trainer_scaling
from zerofix.fixes.contract import Check, drifted, found
from zerofix.identity import WeakIdentityMap

FIX_ID = "transformers-trainer-chunked-loss"
FIX_IDS = (FIX_ID,)
_log = logging.getLogger("zerofix")
_LOSS_KWARGS = ("num_items_in_batch", "labels", "shift_labels", "logits_to_keep", "return_dict")
_routes = WeakIdentityMap()  # transformers model -> {batch form: _Route}
_details: dict = {}  # model class name -> {"routed": bool, "why": str, "steps": int}


def structural_check(fix_id: str, targets) -> Check:
    if fix_id != FIX_ID:
        raise KeyError(fix_id)
    params = list(inspect.signature(targets["Trainer.compute_loss"]).parameters)
    if params[:3] != ["self", "model", "inputs"]:
        return drifted(f"Trainer.compute_loss{tuple(params)} is not (self, model, inputs, ...)")
    return found()


class _Route:
    """How one model's loss is computed without logits (or why not: ``why``)."""

    __slots__ = ("ok", "why", "logit_scale", "softcap")

    def __init__(self, ok: bool, why: str, logit_scale: float = 1.0, softcap: float | None = None):
        self.ok, self.why, self.logit_scale, self.softcap = ok, why, logit_scale, softcap


def _text_config(model):
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _head_transform(model) -> tuple[float, float | None]:
    """The logit scale and softcap the config names (Cohere's logit_scale, Gemma's final_logit_softcapping, Granite's
    logits_scaling, ...); whether the model really applies them is the probe's question."""
    text = _text_config(model)
    scale = getattr(text, "logit_scale", None)
    if scale is None and getattr(text, "logits_scaling", None):
        scale = 1.0 / float(text.logits_scaling)
    softcap = getattr(text, "final_logit_softcapping", None)
    return (1.0 if scale is None else float(scale)), (None if not softcap else float(softcap))


def _backbone(model):
    prefix = getattr(model, "base_model_prefix", "") or "model"
    backbone = getattr(model, prefix, None)
    return backbone if isinstance(backbone, torch.nn.Module) and backbone is not model else None


def _hidden_states(model, args, kwargs):
    backbone = _backbone(model)
    inputs = {k: v for k, v in kwargs.items() if k not in _LOSS_KWARGS}
    inputs["use_cache"] = False
    out = backbone(*args, **inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _whole(tensor):
    """A parameter FSDP2 keeps sharded while it is read here (a DTensor: the head when it is a unit of its own, whose
    own forward never runs on this route) as one differentiable all-gather whose gradient is reduce-scattered back
    *averaged* over the ranks, as FSDP2 averages every gradient (a plain ``full_tensor()`` would take each rank's
    own gradient as the replicated one: measured on 2 ranks, the head's update off by 0.62). Anything else as it
    is."""
    placements = getattr(tensor, "placements", None)
    if placements is None or not callable(getattr(tensor, "full_tensor", None)):
        return tensor
    from torch.distributed.tensor import Partial

    return tensor.full_tensor(grad_placements=[Partial("avg")] * len(placements))


def _loss(model, route: _Route, hidden, labels, num_items_in_batch):
    from zerofix.losses import chunked_cross_entropy

    head = model.get_output_embeddings()
    count = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
    if num_items_in_batch is not None and count is None:  # an int (4.46-4.48): the same division, as a tensor
        count = torch.tensor(num_items_in_batch, device=hidden.device)
    labels = labels.to(hidden.device)
    bias = None if head.bias is None else _whole(head.bias)
    return chunked_cross_entropy(hidden[..., :-1, :], _whole(head.weight), labels[..., 1:], bias=bias,
                                 num_items_in_batch=count, logit_softcap=route.softcap,
                                 logit_scale=route.logit_scale)


def _probe(model, batch, autocast=None) -> _Route:
    """Whether ``model``'s training loss on this batch is the chunked loss of its backbone's hidden states, decided
    from behaviour (issue 52) on what training runs (issue 58): on the batch's first sample (the whole batch where an
    input is not batch-major, an image's patches), in the model's own mode (training, in a step), the model's own
    forward *with the labels* against the route, each with a count that is not the batch's token count and without
    one. Every forward starts from one random state (dropout draws the same masks in both) and the model's buffers as
    they were; both are restored afterwards, so the step itself draws what it would have drawn. A term or layer that
    exists only in training (a z-loss under ``if self.training``, dropout before the head) is then part of the
    comparison. Their hidden states, their losses and the gradients the losses give the hidden states must agree
    (1e-4 relative in float32, 1e-2 in low precision); otherwise the model keeps its own loss, and ``why`` says what
    differed."""
    from zerofix import replay, zero3

    backbone, head = _backbone(model), model.get_output_embeddings()
    if backbone is None or not isinstance(head, torch.nn.Linear):
        return _Route(False, "no backbone (base_model_prefix) and Linear head (get_output_embeddings) to route")
    if batch.get("shift_labels") is not None:
        return _Route(False, "its batches carry shift_labels (the route shifts the labels itself)")
    scale, softcap = _head_transform(model)
    route = _Route(True, "", scale, softcap)
    sample = _first_sample(batch)
    labels = sample["labels"]
    if not bool((labels != -100).any()):
        return None  # nothing counted to prove it on: this call keeps the model's own loss, a later batch decides
    inputs = {k: v for k, v in sample.items() if k not in _LOSS_KWARGS}
    # a count no shifted or unshifted token count of the sample equals: a loss that ignores it is seen
    count = torch.tensor(int((labels != -100).sum()) + 7, device=labels.device)
    low = head.weight.dtype in (torch.bfloat16, torch.float16) or autocast is not None
    tolerance = 1e-2 if low else 1e-4
    seen = {}

    def probe_forward(*args, **kwargs):
        # inside the module's own call, as the Trainer's step runs it: FSDP2 has its root's parameters whole here
        if autocast is not None:  # accelerate's mixed precision, as in the step
            with autocast():
                return probed(*args, **kwargs)
        return probed(*args, **kwargs)

    def probed(*args, **kwargs):
        own = None
        # without a count first, values only (no gradient); then with one, gradients too: the last thing the call
        # does is a backward (FSDP2 reshards its root's parameters after one, so no forward may follow it)
        for with_count in (False, True):
            extra = {"num_items_in_batch": count} if with_count else {}
            own, captured = own_forward(args, kwargs, extra, with_count)
            if getattr(own, "aux_loss", None) is not None:
                seen["why"] = "its loss adds a router auxiliary loss (an MoE model: output_router_logits)"
                return own
            start.restore()
            with torch.set_grad_enabled(with_count):
                hidden = _hidden_states(model, args, kwargs).detach().requires_grad_(with_count)
                with zero3.gathered(head.weight, head.bias):
                    ours = _loss(model, route, hidden, labels, count if with_count else None)
                why = _differs(own, ours, captured, hidden, tolerance, with_count)
            if why and not with_count and not _reproduces(own, own_forward(args, kwargs, extra, False)[0]):
                # its own forward twice from one random state gave two losses: a draw this proof cannot replay
                why = ("its training forward does not repeat itself from one random state (torch's, Python's and "
                       "NumPy's, which zerofix replays): it draws from elsewhere, so no route can be proven equal")
            if why:
                seen["why"] = why
                return own
        return own

    def own_forward(args, kwargs, extra, with_grad):
        """The model's own training forward with the labels, from the proof's start, and the hidden states its head
        reads as a leaf: the backbone's output, or the head's input where the backbone's own forward never runs (OPT
        calls its decoder directly)."""
        captured = []
        start.restore()  # the same random state and buffers for every forward of the proof
        handles = [backbone.register_forward_hook(lambda m, a, out: _leaf_hidden(out, captured)),
                   head.register_forward_pre_hook(lambda m, a: None if captured else _leaf_input(a, captured))]
        try:
            with torch.set_grad_enabled(with_grad):
                return original(*args, **kwargs, labels=labels, use_cache=False, **extra), captured
        finally:
            for handle in handles:
                handle.remove()

    original, kept = type(model).forward.__get__(model), vars(model).get("forward")
    start = replay.Snapshot(model)
    model.forward = probe_forward
    try:
        with hooks.unseen_by_user_hooks(backbone):  # the user's hooks in the backbone see the step's forwards only
            model(**inputs)
    except Exception as exc:  # noqa: BLE001 - a family this proof cannot drive keeps its own loss
        return _Route(False, f"the route cannot reproduce its loss on this batch ({type(exc).__name__}: "
                      f"{str(exc)[:160]})")
    finally:
        _restore_forward(model, kept)
        start.restore()  # the step draws what it would have drawn without the proof
    return _Route(False, seen["why"]) if "why" in seen else route


PROOF_TOKENS = 256  # the proof's window on a text-only batch: its logits, not the step's, are what it holds


def _first_sample(batch) -> dict:
    """What the proof runs on, small enough that the switch's memory saving survives it: the sample with the most
    counted labels where every tensor input is batch-major (else the whole batch: an image's patches are not), and of
    a text-only sample (every input ``[1, T]``) the PROOF_TOKENS positions ending at its last counted label. Both
    computations see the same inputs, so a window proves as well as the whole sequence (a long single sequence would
    otherwise hold its full logits once, the peak the switch exists to avoid)."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    labels = batch["labels"]
    rows = {v.shape[0] for v in tensors.values() if v.dim() > 0}
    if len(rows) != 1 or any(v.dim() == 0 for v in tensors.values()):
        return dict(batch)
    row = int((labels != -100).reshape(labels.shape[0], -1).sum(-1).argmax()) if labels.dim() > 1 else 0
    sample = {k: (v[row:row + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    length = sample["labels"].shape[-1] if sample["labels"].dim() == 2 else None
    text = length is not None and all(v.dim() == 2 and v.shape[-1] == length
                                      for v in sample.values() if isinstance(v, torch.Tensor))
    if not text or length <= PROOF_TOKENS:
        return sample
    counted = (sample["labels"][0] != -100).nonzero()
    end = int(counted[-1]) + 1 if len(counted) else length
    start = max(0, end - PROOF_TOKENS)
    return {k: (v[:, start:end] if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}


def _leaf_hidden(output, captured: list):
    """The backbone's last hidden state in the model's own forward, as a leaf whose gradient the proof reads."""
    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
    leaf = hidden.detach().requires_grad_(True)
    captured.append(leaf)
    if hasattr(output, "last_hidden_state"):
        output.last_hidden_state = leaf
        return output
    return (leaf, *output[1:])


def _leaf_input(args, captured: list):
    """The head's input in the model's own forward, as a leaf whose gradient the proof reads (a model whose forward
    runs its backbone's parts itself, so the backbone's own hook never fires)."""
    leaf = args[0].detach().requires_grad_(True)
    captured.append(leaf)
    return (leaf, *args[1:])


def _reproduces(first, second) -> bool:
    """Whether two runs of the model's own forward from one random state gave the same loss (bitwise)."""
    a, b = (getattr(o, "loss", None) if hasattr(o, "loss") else o[0] for o in (first, second))
    return a is not None and b is not None and torch.equal(a.detach(), b.detach())


def _close(a, b, tolerance: float) -> bool:
    a, b = a.detach().float(), b.detach().float()
    return a.shape == b.shape and torch.allclose(a, b, rtol=tolerance, atol=tolerance * max(float(b.abs().max()), 1e-12))


def _differs(own, ours, captured, hidden, tolerance: float, with_count: bool) -> str:
    """What differs between the model's own loss and the route's on the proof's sample ("" when nothing does)."""
    counted = "with a count" if with_count else "without a count"
    mine = own.loss if hasattr(own, "loss") else own[0]
    if mine is None:
        return "its forward returns no loss for these labels"
    if len(captured) != 1 or not _close(captured[0], hidden, tolerance):
        return ("its forward with labels runs its backbone on other inputs than the route does (a decoder fed from "
                "the labels, labels aligned otherwise)")
    if not _close(mine.detach(), ours.detach(), tolerance):
        return (f"its own loss on this batch {counted} is {float(mine):.6g}, the route's {float(ours):.6g} (labels "
                "aligned otherwise, an extra term such as a z-loss, or a mean that ignores the count)")
    if not with_count:  # values only (see _probe)
        return ""
    theirs_grad, = torch.autograd.grad(mine, captured[0])
    our_grad, = torch.autograd.grad(ours, hidden)
    if not _close(our_grad, theirs_grad, tolerance):
        return f"the gradient its own loss gives the hidden states {counted} differs from the route's"
    return ""


def _restore_forward(model, kept) -> None:
    """The module's forward as it was: the instance attribute another library set (accelerate's mixed-precision
    wrapper), or the class's."""
    if kept is None:
        vars(model).pop("forward", None)
    else:
        model.forward = kept


def _class_name(model) -> str:
    """The model's class name, FSDP2's generated subclass (``FSDP<Name>``) seen through."""
    name = type(model).__name__
    if name.startswith("FSDP") and any(c.__name__ == name[4:] for c in type(model).__mro__[1:]):
        return name[4:]
    return name


def _form(batch) -> frozenset:
    """What a batch holds (its keys with a value): a new form (decoder_input_ids, shift_labels, images present or not)
    is proven again."""
    return frozenset(k for k, v in batch.items() if v is not None)


def _route_of(model, batch, autocast=None) -> _Route:
    """This model's route for batches of this form, proven on the first such batch (``_probe``); said once each."""
    routes = _routes.get(model)
    if routes is None:
        routes = _routes[model] = {}
    form = _form(batch)
    route = routes.get(form)
    if route is None:
        route = _probe(model, batch, autocast)
        if route is None:  # no counted label in this batch: its own loss, and the next batch of the form decides
            return _Route(False, "no counted label to prove the route on yet")
        routes[form] = route
        name = _class_name(model)
        entry = _details.setdefault(name, {"model": name, "routed": route.ok, "steps": 0, "forms": 0})
        entry["forms"] = entry.get("forms", 0) + 1
        entry["routed"] = route.ok if entry["forms"] == 1 else entry["routed"] and route.ok
        entry["why"] = route.why or entry.get("why") or ("its loss is the chunked loss of its backbone's hidden "
                                                         "states (proven on its first batch with labels)")
        keys = ", ".join(sorted(form))
        if route.ok:
            _log.info("zerofix: %s: %s's training loss on batches of (%s) is computed without the full logits (its own "
                      "loss and gradient reproduced on the first such batch)", FIX_ID, name, keys)
        else:
            _log.warning("zerofix: %s: %s keeps its own loss (full logits) on batches of (%s): %s", FIX_ID, name, keys,
                         route.why)
    return route


def _stand_aside(trainer, reason: str) -> None:
    """Once per trainer and reason: the switch is on but this trainer's loss does not go through it (issue 52)."""
    said = _aside.setdefault(trainer, set()) if _weak(trainer) else set()
    if reason in said:
        return
    said.add(reason)
    name = type(trainer).__name__
    _details[f"aside:{name}:{reason}"] = {"model": None, "trainer": name, "routed": False, "why": reason, "steps": 0}
    _log.warning("zerofix: %s stands aside for %s: %s; its loss is computed as without the switch (full logits)",
                 FIX_ID, name, reason)


def _weak(obj) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


_aside = WeakIdentityMap()  # trainer -> reasons said


_paths = WeakIdentityMap()  # trainer -> its zerofix.paths.Path


def _covered(trainer) -> bool:
    """One process, DDP, DeepSpeed ZeRO-0..3, FSDP1/2 (zerofix.paths): a tensor, context or sequence parallel layout
    computes its loss over sharded logits or sequences, which this route does not model; said once."""
    from zerofix import paths

    path = _paths.get(trainer)
    if path is None:
        path = _paths[trainer] = paths.trainer_path(trainer)
        if not path.covered:
            _details[f"path:{path}"] = {"model": None, "routed": False, "why": f"not covered: {path}", "steps": 0}
            _log.warning("zerofix: %s stands aside on this run, not covered: %s (the model's own loss runs)", FIX_ID,
                         path)
    return path.covered


def _target(trainer, model):
    """The transformers model whose forward the Trainer's call reaches (inside DDP, DeepSpeed, FSDP2, PEFT)."""
    try:
        inner = trainer.accelerator.unwrap_model(model)
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        inner = model
    return trainer_scaling.unwrap_peft(inner)


def _aside_reason(trainer, model, target, inputs, args, kwargs) -> str:
    """Why this training call keeps the model's own loss although the switch is on ("": it may be routed)."""
    if getattr(trainer, "label_smoother", None) is not None:
        return "label smoothing (the Trainer's label smoother reads the full logits)"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func (it reads the model's outputs)"
    if hasattr(model, "_orig_mod") or hasattr(target, "_orig_mod"):
        return "a compiled model (torch.compile)"
    returning = kwargs.get("return_outputs", args[2] if len(args) > 2 else False)
    if returning:
        return "a compute_loss call that asks for the outputs (return_outputs=True: the caller reads the logits)"
    config = getattr(target, "config", None)
    if inputs.get("output_hidden_states") or getattr(config, "output_hidden_states", False):
        return "output_hidden_states (the caller reads the model's hidden states)"
    head = target.get_output_embeddings() if callable(getattr(target, "get_output_embeddings", None)) else None
    if isinstance(head, torch.nn.Module) and (hooks.user_hooks(head) or hooks.user_backward_hooks(head)):
        return "hooks on the output head (the route never calls it, so they would not fire)"
    for wrapper in _wrappers(model, target):
        kind = ("forward" if hooks.user_hooks(wrapper, pre=False) else
                "backward" if hooks.user_backward_hooks(wrapper) else None)
        if kind:
            return (f"{kind} hooks on {type(wrapper).__name__} (the model's output, whose logits the route does not "
                    "build, reaches them)")
    if hooks.process_wide_hooks():
        return ("process-wide module hooks (torch.nn.modules.module.register_module_forward_hook and its kin: they see "
                "every module's call and output, the head's logits too, which the route does not build)")
    return ""


def _wrappers(model, target) -> list:
    """The modules the Trainer's call passes through down to ``target`` (DDP's or DeepSpeed's ``module``, PEFT's
    ``base_model`` and ``model``), ``target`` included: a hook on any of them sees the model's output."""
    chain, module = [], model
    for _ in range(8):
        if not isinstance(module, torch.nn.Module) or any(m is module for m in chain):
            break
        chain.append(module)
        if module is target:
            return chain
        module = next((getattr(module, name) for name in ("module", "base_model", "model")
                       if isinstance(getattr(module, name, None), torch.nn.Module)), None)
    return [*chain, target] if all(m is not target for m in chain) else chain


def compute_loss(wrapped, trainer, args, kwargs):
    if trainer in _reached:  # by identity: any trainer can be asked, weak-referenceable or not
        _reached[trainer] = True
    model = args[0] if args else kwargs.get("model")
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    # any Mapping: transformers' collators return a BatchEncoding
    if model is None or not isinstance(inputs, Mapping) or "labels" not in inputs or not model.training:
        return wrapped(*args, **kwargs)
    if not _covered(trainer):
        return wrapped(*args, **kwargs)
    target = _target(trainer, model)
    if not isinstance(target, torch.nn.Module) or getattr(vars(target).get("forward"), "_zerofix_chunked", False):
        return wrapped(*args, **kwargs)  # not a module, or a nested call
    reason = _aside_reason(trainer, model, target, inputs, args[2:], kwargs)
    if reason:
        _stand_aside(trainer, reason)
        return wrapped(*args, **kwargs)
    kept = vars(target).get("forward")  # accelerate's mixed-precision wrapper: its autocast is applied below
    autocast = getattr(trainer.accelerator, "autocast", None) if kept is not None else None
    route = _route_of(target, inputs, autocast)
    if not route.ok:
        return wrapped(*args, **kwargs)
    original = type(target).forward.__get__(target)

    def chunked_forward(*f_args, labels=None, num_items_in_batch=None, **f_kwargs):
        if labels is None or f_kwargs.get("shift_labels") is not None:
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            return original(*f_args, labels=labels, **f_kwargs, **extra)
        hidden = _hidden_states(target, f_args, f_kwargs)
        if hidden.shape[:-1] != labels.shape:  # never seen in a proven form; the model's own loss, never a crash
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            return original(*f_args, labels=labels, **f_kwargs, **extra)
        loss = _loss(target, route, hidden, labels, num_items_in_batch)
        _details[_class_name(target)]["steps"] += 1
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    def forward(*f_args, **f_kwargs):
        if autocast is None:
            return chunked_forward(*f_args, **f_kwargs)
        with autocast():
            return chunked_forward(*f_args, **f_kwargs)

    forward._zerofix_chunked = True
    target.forward = forward
    try:
        return wrapped(*args, **kwargs)
    finally:
        _restore_forward(target, kept)


_reached = WeakIdentityMap()  # trainer -> compute_loss reached in its step


def training_step(wrapped, trainer, args, kwargs):
    """A training step whose loss never reached ``Trainer.compute_loss`` (a subclass's own ``compute_loss``: TRL's
    DPO and reward trainers) is computed as without the switch: said once per trainer (issue 52)."""
    if trainer in _reached or not _weak(trainer):  # the common case, a step after one that reached it, asks once
        return wrapped(*args, **kwargs)
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    _reached[trainer] = False
    try:
        return wrapped(*args, **kwargs)
    finally:
        if _reached.get(trainer) is False:
            del _reached[trainer]  # asked again at the next step, until one reaches it
            if isinstance(inputs, Mapping) and _covered(trainer):
                _stand_aside(trainer, f"its compute_loss ({type(trainer).__qualname__}.compute_loss) never calls "
                             "Trainer.compute_loss, where the switch routes the loss")


def runtime_details() -> list[dict]:
    """Per model class: whether its training loss is routed through the chunked loss, why (not), and how many
    training losses were."""
    return [dict(d) for d in _details.values()]


def reset_runtime() -> None:
    _details.clear()
