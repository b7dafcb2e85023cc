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

Which model it routes is decided from behaviour, once per model object, on the first micro-batch (no gradient,
eval mode, the random state restored): the model's own forward with ``logits_to_keep`` gives the last positions'
logits, which must equal the head applied to the backbone's hidden states there (within 1e-3 relative, 1e-2 in
low precision), and must not add a router auxiliary loss; the model's ``loss_function`` on a small random case
must equal the chunked loss (shifted labels, ``-100`` ignored, divided by the count or by the counted tokens). A
model that fails any of these, or whose forward takes no ``logits_to_keep``, keeps its own loss, and the log says
which and why, once (runtime details: ``zerofix.status()``).
"""
from __future__ import annotations

import inspect
import logging
import weakref

import torch

from zerofix.fixes import trainer_scaling
from zerofix.fixes.contract import Check, drifted, found

FIX_ID = "transformers-trainer-chunked-loss"
FIX_IDS = (FIX_ID,)
_log = logging.getLogger("zerofix")
_PROBE_POSITIONS = 4
_LOSS_KWARGS = ("num_items_in_batch", "labels", "shift_labels", "logits_to_keep", "return_dict")
_routes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformers model -> _Route
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


def _probe(model, batch: dict, autocast=None) -> _Route:
    """Whether ``model``'s training loss is the chunked loss of its backbone's hidden states (module docstring)."""
    from zerofix import zero3

    backbone, head = _backbone(model), model.get_output_embeddings()
    if backbone is None or not isinstance(head, torch.nn.Linear):
        return _Route(False, "no backbone (base_model_prefix) and Linear head (get_output_embeddings) to route")
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return _Route(False, "its forward takes no logits_to_keep, so its head cannot be compared")
    scale, softcap = _head_transform(model)
    route = _Route(True, "", scale, softcap)
    seen = {}

    def probe_forward(*args, **kwargs):
        # inside the module's own call, as the Trainer's step runs it: FSDP2 has its root's parameters whole here
        if autocast is not None:  # accelerate's mixed precision, as in the step
            with autocast():
                return probed(*args, **kwargs)
        return probed(*args, **kwargs)

    def probed(*args, **kwargs):
        own = original(*args, **kwargs, logits_to_keep=_PROBE_POSITIONS, use_cache=False)
        hidden = _hidden_states(model, args, kwargs)[..., -_PROBE_POSITIONS:, :]
        with zero3.gathered(head.weight, head.bias):
            bias = None if head.bias is None else _whole(head.bias)
            seen["logits"] = torch.nn.functional.linear(hidden.to(head.weight.dtype), _whole(head.weight),
                                                        bias).float()
        seen["own"] = own
        return own

    inputs = {k: v for k, v in batch.items() if k not in _LOSS_KWARGS}
    original, kept = type(model).forward.__get__(model), vars(model).get("forward")
    was_training = model.training
    model.eval()
    model.forward = probe_forward
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(**inputs)
        own, logits = seen["own"], seen["logits"] * scale
        if getattr(own, "aux_loss", None) is not None:
            return _Route(False, "its loss adds a router auxiliary loss (an MoE model: output_router_logits)")
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        theirs = own.logits[..., -_PROBE_POSITIONS:, :].float()
        tolerance = 1e-2 if head.weight.dtype in (torch.bfloat16, torch.float16) else 1e-3
        if theirs.shape != logits.shape or not torch.allclose(logits, theirs, rtol=tolerance,
                                                              atol=tolerance * float(theirs.abs().max())):
            return _Route(False, "its logits are not its head applied to its backbone's last hidden state (a "
                          "transform between the two that zerofix does not know)")
        why = _loss_function_differs(model, route)
        if why:
            return _Route(False, why)
    except Exception as exc:  # noqa: BLE001 - a family this probe cannot drive keeps its own loss
        return _Route(False, f"the probe failed ({type(exc).__name__}: {str(exc)[:160]})")
    finally:
        _restore_forward(model, kept)
        model.train(was_training)
    return route


def _restore_forward(model, kept) -> None:
    """The module's forward as it was: the instance attribute another library set (accelerate's mixed-precision
    wrapper), or the class's."""
    if kept is None:
        vars(model).pop("forward", None)
    else:
        model.forward = kept


def _loss_function_differs(model, route: _Route) -> str:
    """The model's ``loss_function`` against the chunked loss on a small random case, with and without a count."""
    from zerofix.losses import chunked_cross_entropy

    loss_function = getattr(model, "loss_function", None)
    if not callable(loss_function):
        return "it has no loss_function to compare with"
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g,
                                                                                         dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :3] = -100
    logits = hidden @ weight.t() * route.logit_scale
    if route.softcap is not None:
        logits = route.softcap * torch.tanh(logits / route.softcap)
    for count in (None, torch.tensor(7)):
        kwargs = {} if count is None else {"num_items_in_batch": count}
        theirs = loss_function(logits=logits, labels=labels, vocab_size=11, **kwargs)
        ours = chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], num_items_in_batch=count,
                                     logit_softcap=route.softcap, logit_scale=route.logit_scale)
        if not torch.allclose(theirs.double(), ours.double(), rtol=1e-6):  # transformers' loss upcasts to float32
            return f"its loss_function ({getattr(loss_function, '__name__', type(loss_function).__name__)}) is not a " \
                   "shifted token cross-entropy divided by the count"
    return ""


def _class_name(model) -> str:
    """The model's class name, FSDP2's generated subclass (``FSDP<Name>``) seen through."""
    name = type(model).__name__
    if name.startswith("FSDP") and any(c.__name__ == name[4:] for c in type(model).__mro__[1:]):
        return name[4:]
    return name


def _route_of(model, batch, autocast=None) -> _Route:
    route = _routes.get(model)
    if route is None:
        route = _routes[model] = _probe(model, batch, autocast)
        name = _class_name(model)
        _details[name] = {"model": name, "routed": route.ok, "why": route.why or "its loss is the chunked loss of its "
                          "backbone's hidden states (compared on the first micro-batch)", "steps": 0}
        if route.ok:
            _log.info("zerofix: %s: %s's training loss is computed without the full logits", FIX_ID, name)
        else:
            _log.warning("zerofix: %s: %s keeps its own loss (full logits): %s", FIX_ID, name, route.why)
    return route


_paths: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # trainer -> its zerofix.paths.Path


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
    return trainer_scaling._unwrap_peft(inner)


def compute_loss(wrapped, trainer, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    if (model is None or not isinstance(inputs, dict) or "labels" not in inputs or not model.training
            or getattr(trainer, "compute_loss_func", None) is not None
            or getattr(trainer, "label_smoother", None) is not None or hasattr(model, "_orig_mod")):
        return wrapped(*args, **kwargs)
    if not _covered(trainer):
        return wrapped(*args, **kwargs)
    target = _target(trainer, model)
    if not isinstance(target, torch.nn.Module) or getattr(vars(target).get("forward"), "_zerofix_chunked", False):
        return wrapped(*args, **kwargs)  # not a module, or a nested call
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


def runtime_details() -> list[dict]:
    """Per model class: whether its training loss is routed through the chunked loss, why (not), and how many
    training losses were."""
    return [dict(d) for d in _details.values()]


def reset_runtime() -> None:
    _details.clear()
