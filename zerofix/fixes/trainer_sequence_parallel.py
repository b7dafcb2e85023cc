"""The Trainer under DeepSpeed's Ulysses sequence parallelism trains on the window's token mean:
``transformers-deepspeed-sp-loss`` (issue 61).

With ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=S)`` (transformers >= 5.0, accelerate
>= 1.12, DeepSpeed >= 0.18.2) every micro-batch is one data-loader batch split along the sequence over an SP group of
S ranks (``UlyssesSPDataLoaderAdapter``: it pops ``labels`` and hands each rank its shard's ``shift_labels``), and
``Trainer.compute_loss`` goes to ``deepspeed_sp_compute_loss``: each rank's token mean over its shard, combined into
the micro-batch's token mean through a differentiable ``all_gather``. Three things then move the update, measured on
transformers 5.24 / accelerate 1.15 / DeepSpeed 0.19.8 (tests/test_trainer_sequence_parallel.py):

- the ``all_gather``'s backward sums every SP rank's gradient of the same loss into each rank, and DeepSpeed's
  reduction sums the ranks and divides by ``world / S`` (ZeRO-0/1/2, and ZeRO-3's contiguous path), so the gradient
  is S x the micro-batch mean's; ZeRO-3's default reduce-scatter divides by the world size and is right there;
- the Trainer hands no ``num_items_in_batch`` (``model_accepts_loss_kwargs = False`` under SP) and divides each
  micro-batch's mean by the accumulation steps: a mean of micro-batch means;
- a ``compute_loss_func`` is never called (and, believed normalised per window, the loss is not divided at all).

What zerofix does on that path, when it models it (``zerofix.paths.sequence_parallel_path``: DeepSpeed ZeRO-0/1/2,
ZeRO-3 with its default reduce-scatter, no gradient pre-division):

- ``get_batch_samples`` counts the window's counted tokens: every shard's ``shift_labels`` of every micro-batch,
  summed over every rank (one all-reduce a window, outside autograd);
- ``compute_loss`` runs upstream's own SP loss unchanged (its value is what the Trainer returns and logs) and keeps
  beside it each rank's shard term as upstream weighs it: the model's shard loss times the shard's count;
- ``Accelerator.backward`` hands the engine that shard term times ``D / N`` instead, where ``N`` is the window's count
  and ``D`` what the engine's reduction divides by (``world / S``, or the world size on ZeRO-3), with
  ``scale_wrt_gas=False``: after DeepSpeed's reduction the gradient is the sum of every counted token's loss in the
  window over ``N``, on every micro-batch of every data-parallel group, however the shards split the counts (a
  shard with no counted token adds nothing, as upstream's mask has it). No gradient flows through the loss's
  ``all_gather``, so upstream's crash in its backward on gloo with 4 ranks is not reached.

Stands aside ("not covered", said once; upstream's path runs) on: ZeRO-3 without reduce-scatter (its buckets take
either division), a gradient pre-division or ``prescale_gradients``, a window whose batches carry no ``shift_labels``,
and a ``compute_loss`` of the user's that never reaches ``Trainer.compute_loss``. A ``compute_loss_func`` is said at
WARNING: upstream never calls it on this path, and zerofix trains the model's own loss, as upstream does.

Ambiguity list (docs/fixes.md): no right usage produces upstream's gradient here: it is S x the mean of micro-batch
means on ZeRO-0/1/2 whatever the loss, which no user asks for; on ZeRO-3 at one micro-batch per window with one
data-parallel group upstream is right, and zerofix's update equals it to float rounding (the same sum, divided once).
"""
from __future__ import annotations

import logging

import torch

from zerofix import paths
from zerofix.fixes.contract import Check, drifted, found
from zerofix.fixes import trainer_scaling
from zerofix.identity import WeakIdentityMap

FIX_ID = "transformers-deepspeed-sp-loss"
FIX_IDS = (FIX_ID,)
_log = logging.getLogger("zerofix")


class _Run:
    """One ``train()`` of one trainer (keyed by its ``trainer.state``)."""

    __slots__ = ("path", "divisor", "world", "sp", "count", "left", "pending", "returned", "backwards", "replaced",
                 "in_window", "said")

    def __init__(self, path, divisor, world, sp):
        self.path = path  # paths.Path
        self.divisor = divisor  # what the engine's reduction divides the summed gradient by
        self.world = world  # ranks the engine reduces over (SP x data-parallel)
        self.sp = sp
        self.count = None  # the window's counted tokens over every rank (a tensor), None: not counted
        self.left = 0  # micro-batches of the window not yet backwarded
        self.pending = None  # this micro-batch's shard term, waiting for Accelerator.backward
        self.returned = None  # the loss Trainer.compute_loss returned beside it (upstream's)
        self.backwards = 0
        self.replaced = 0
        self.in_window = 0  # micro-batches of the current window trained at its token mean
        self.said = set()


_runs = WeakIdentityMap()  # trainer.state -> _Run
_training = WeakIdentityMap()  # accelerator -> (trainer.state, _Run) of the run it trains now
_details: list[dict] = []


def structural_check(fix_id: str, targets) -> Check:
    """Found where ``Trainer.compute_loss`` routes a sequence-parallel training loss to ``deepspeed_sp_compute_loss``
    (transformers >= 5.0); releases without that branch have no such path."""
    import inspect
    compute = inspect.unwrap(targets["Trainer.compute_loss"])
    # 5.0: the method Trainer._deepspeed_sp_compute_loss; 5.3 - 5.24 (read): transformers.integrations.deepspeed's
    if not {"deepspeed_sp_compute_loss", "_deepspeed_sp_compute_loss"} & set(compute.__code__.co_names):
        return drifted("Trainer.compute_loss has no DeepSpeed sequence-parallel branch")
    return found()


def sp_config(trainer):
    """accelerate's ParallelismConfig when it asks for DeepSpeed Ulysses (sp_size > 1), else None."""
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is None or getattr(pc, "sp_backend", None) != "deepspeed" or not getattr(pc, "sp_enabled", False):
        return None
    return pc


def _run_of(trainer):
    state = getattr(trainer, "state", None)
    try:
        run = _runs.get(state)
    except TypeError:
        return None
    if run is None:
        path, divisor = paths.sequence_parallel_path(trainer)
        engine = getattr(trainer, "model_wrapped", None)
        run = _Run(path, divisor, int(getattr(engine, "seq_dp_world_size", 0) or 0),
                   int(getattr(engine, "sequence_parallel_size", 0) or 0))
        try:
            _runs[state] = run
        except TypeError:
            return None
        if not path.covered:
            _stand_aside(trainer, run, path)
        else:  # what it did is said once it did it: the Trainer's log (acted_in) and zerofix status
            _details.append({"trainer": type(trainer).__name__, "path": path.name, "divisor": divisor,
                             "backwards": 0, "replaced": 0})
    return run


def _stand_aside(trainer, run, path) -> None:
    if paths.stood_aside(FIX_ID, path):
        trainer_scaling.warn_main(trainer, "zerofix: %s stands aside on this run, %s: the Trainer's own sequence-parallel "
                                  "loss trains unchanged (S x the mean of micro-batch means on ZeRO-0/1/2)", FIX_ID, path)


def get_batch_samples(wrapped, trainer, args, kwargs):
    result = wrapped(*args, **kwargs)
    if sp_config(trainer) is None:
        return result
    run = _run_of(trainer)
    if run is None or not run.path.covered:
        return result
    batches = result[0]
    accelerator = trainer.accelerator
    _training[accelerator] = (trainer.state, run)
    if not batches or any("shift_labels" not in b for b in batches):
        # every rank reads the same adapter, so every rank takes this branch: no collective is left waiting
        run.path = paths.Path(f"{run.path.name} without shift_labels in its batches", False)
        _stand_aside(trainer, run, run.path)
        return result
    if run.divisor == run.world == run.sp and len(batches) == 1:
        # ZeRO-3's reduce-scatter over one SP group, one micro-batch: upstream's loss is the window's token mean and its
        # reduction divides the SP sum once; left to upstream, bitwise (no count, no collective)
        run.count, run.left, run.pending = None, 0, None
        return result
    device = accelerator.device
    local = sum(int((b["shift_labels"] != -100).sum()) for b in batches)
    count = torch.tensor([float(local)], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)  # the whole world: every SP shard of every data-parallel group
    run.count, run.left, run.pending, run.in_window = count, len(batches), None, 0
    return result


def compute_loss(wrapped, trainer, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    training = getattr(model, "training", False)
    if training and getattr(trainer, "compute_loss_func", None) is not None and sp_config(trainer) is not None:
        _say_loss_func_dropped(trainer)
    if training and getattr(trainer, "label_smoother", None) is not None and sp_config(trainer) is not None:
        _say_smoothing_dropped(trainer)
    run = _open_run(trainer)
    if run is None or not training:
        return wrapped(*args, **kwargs)
    call_args, call_kwargs, wants_outputs = _with_outputs(args, kwargs)
    loss, outputs = wrapped(*call_args, **call_kwargs)
    inputs = call_args[1] if len(call_args) > 1 else call_kwargs["inputs"]
    count = (inputs["shift_labels"] != -100).sum()
    shard = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    # upstream's weighting: the shard's mean times its count; a shard with no counted token adds nothing
    term = torch.where(count > 0, shard * count, torch.zeros_like(shard))
    run.pending, run.returned = term, loss
    return (loss, outputs) if wants_outputs else loss


def _say_loss_func_dropped(trainer) -> None:
    """Once a run, on every SP path (covered or not): upstream's SP branch returns before a compute_loss_func."""
    run = _run_of(trainer)
    if run is None or "compute_loss_func" in run.said:
        return
    run.said.add("compute_loss_func")
    trainer_scaling.warn_main(
        trainer, "zerofix: compute_loss_func is not called under DeepSpeed sequence parallelism: transformers' "
        "deepspeed_sp_compute_loss trains the model's own loss instead (upstream drops the function silently); %s, and "
        "your function still is not called", "zerofix trains that model loss at the window's token mean"
        if run.path.covered else f"zerofix stands aside on this run ({run.path})")


def _say_smoothing_dropped(trainer) -> None:
    """Once a run, on every SP path (issue 69, item 4): upstream's SP branch computes the model's own loss on each shard
    and never calls the Trainer's label smoother, so ``label_smoothing_factor`` has no effect there; zerofix trains the
    same unsmoothed loss (at the window's token mean where it models the path) and says so."""
    run = _run_of(trainer)
    if run is None or "label_smoother" in run.said:
        return
    run.said.add("label_smoother")
    factor = getattr(getattr(trainer, "args", None), "label_smoothing_factor", None)
    trainer_scaling.warn_main(
        trainer, "zerofix: label_smoothing_factor=%s is not applied under DeepSpeed sequence parallelism: transformers' "
        "deepspeed_sp_compute_loss trains the model's own unsmoothed loss on each shard (upstream drops the smoothing "
        "silently); %s. For smoothed labels, train without sequence parallelism", factor,
        "zerofix trains that unsmoothed loss at the window's token mean" if run.path.covered else
        f"zerofix stands aside on this run ({run.path})")


def _open_run(trainer):
    """The run whose window is open on this trainer, on a covered SP path, or None."""
    if sp_config(trainer) is None:
        return None
    try:
        run = _runs.get(getattr(trainer, "state", None))
    except TypeError:
        return None
    if run is None or not run.path.covered or run.count is None or run.left <= 0:
        return None
    return run


def _with_outputs(args, kwargs):
    """The call with ``return_outputs=True`` (Trainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)),
    and whether the caller asked for the outputs."""
    args, kwargs = list(args), dict(kwargs)
    if len(args) > 2:
        wants, args[2] = bool(args[2]), True
    else:
        wants, kwargs["return_outputs"] = bool(kwargs.get("return_outputs", False)), True
    return tuple(args), kwargs, wants


def backward(wrapped, accelerator, args, kwargs):
    held = _training.get(accelerator)
    if held is None:
        return wrapped(*args, **kwargs)
    state, run = held
    if run.count is None or run.left <= 0:
        return wrapped(*args, **kwargs)
    run.left -= 1
    run.backwards += 1
    term, returned, run.pending, run.returned = run.pending, run.returned, None, None
    given = args[0] if args else kwargs.get("loss")
    if term is None:  # the user's compute_loss never reached Trainer.compute_loss: its loss is not one zerofix read
        return _not_ours(accelerator, run, "with a compute_loss that does not reach Trainer.compute_loss", wrapped, args,
                         kwargs)
    if not _upstreams(given, returned):  # a compute_loss that changed what the base one returned (an added term)
        return _not_ours(accelerator, run, "with a compute_loss that changes Trainer.compute_loss's loss", wrapped, args,
                         kwargs)
    loss = term * (run.divisor / run.count.to(term.device, torch.float64).clamp(min=1)).to(term.dtype)
    run.replaced += 1
    run.in_window += 1
    for d in _details:
        if d["path"] == run.path.name:
            d["backwards"], d["replaced"] = run.backwards, run.replaced
    rest = args[1:] if args else ()
    kwargs = {k: v for k, v in kwargs.items() if k != "loss"}
    kwargs["scale_wrt_gas"] = False  # the window's count already covers the accumulation steps
    return wrapped(loss, *rest, **kwargs)


def _upstreams(given, returned) -> bool:
    """Whether the loss handed to Accelerator.backward is the one Trainer.compute_loss returned, as the Trainer's
    step leaves it: itself, or itself divided (or multiplied) by a number (the accumulation steps). Anything else
    (a term a subclass added, a different loss) is not one zerofix read."""
    if given is None or returned is None:
        return False
    if given is returned:
        return True
    fn = getattr(given, "grad_fn", None)
    if fn is None or type(fn).__name__ not in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        return False
    inputs = [f for f, _ in fn.next_functions if f is not None]
    return len(inputs) == 1 and inputs[0] is returned.grad_fn


def _not_ours(accelerator, run, why, wrapped, args, kwargs):
    """From this micro-batch on the run is upstream's (said once, by the main process): the loss is not one zerofix
    read."""
    run.path = paths.Path(f"{run.path.name} {why}", False)
    run.count, run.left = None, 0
    if paths.stood_aside(FIX_ID, run.path) and getattr(accelerator, "is_main_process", True):
        _log.warning("zerofix: %s stands aside from here on, %s: the Trainer's own sequence-parallel loss trains "
                     "unchanged%s", FIX_ID, run.path,
                     f" ({run.in_window} earlier micro-batch(es) of this window were trained at its token mean)"
                     if run.in_window else "")
    return wrapped(*args, **kwargs)


def acted_in(fix_id: str, trainer_state) -> str | None:
    try:
        run = _runs.get(trainer_state)
    except TypeError:
        return None
    if run is None or not run.replaced:
        return None
    return (f"{run.path}: {run.replaced} of {run.backwards} micro-batches trained at the window's token mean "
            "(upstream: each micro-batch's mean, summed over the SP ranks on ZeRO-0/1/2)")


def runtime_details() -> list[dict]:
    return [dict(d) for d in _details]


def reset_runtime() -> None:
    _details.clear()
