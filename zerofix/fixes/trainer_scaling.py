"""The Trainer's gradient-accumulation scaling, decided by what the loss does: ``transformers-trainer-scaling``.

Along Trainer.compute_loss -> training_step -> Accelerator.backward (-> engine.backward) a loss must be
divided exactly once by its accumulation window, or not at all when it is normalised by
``num_items_in_batch``. The Trainer decides which from the forward's signature (``**kwargs``), and each
release divides in its own places: 4.46-4.47 never divide a loss without loss kwargs (#35207), 4.46-4.48 with
DeepSpeed divide a per-window loss again (#35808), 5.2.0-5.5.3 let accelerate divide again (#45349), and
every release from 4.46 skips the division for a head that takes ``**kwargs`` but returns a plain mean
(sequence classification, ...; #47688 open) and multiplies it by the number of processes.

One mechanism (the rule is ``zerofix.scaling``, plain code), on the paths it models (``zerofix.paths``: one process,
DDP, DeepSpeed ZeRO-0..3, FSDP1, FSDP2; elsewhere it stands aside and says "not covered: <path>"):

- ``training_step`` opens a step on the trainer's accelerator and hands the Trainer a *watched*
  ``num_items_in_batch`` (``zerofix.num_items_watch``), at every step: the count is followed through every
  operation, the loss's value is bitwise the same, no extra forward;
- ``compute_loss`` (the base Trainer's) records that it ran, so its multiplication by the number of
  processes is known to have happened;
- ``get_batch_samples`` records the window's real length;
- ``backward`` (Accelerator.backward) takes this step's verdict (``num_items_watch.decide``: the loss is *divided* by
  the count, *independent* of it, or *unknown*), hands the engine the plain loss, asks ``scaling.plan`` what the path
  does to this loss against what it needs, and changes nothing where they agree. Otherwise it switches a second
  division off (accelerate's divisor 1, ``scale_wrt_gas=False``: what upstream's own fixes do) and puts the rest on
  the loss. On an *unknown* verdict nobody stated the answer to, nothing changes (upstream's path) and a WARNING
  names the route once a run;
- ``count_never_handed``: a model whose class says ``accepts_loss_kwargs = False`` (27 generation heads of 5.24) is
  handed the count (the Trainer's ``model_accepts_loss_kwargs`` is True inside its ``get_batch_samples`` and
  ``training_step``), and every step checks that its loss is divided by it; otherwise upstream's mean of means
  comes back for the run, warned (issue 47). Where the head's forward takes the count and calls its loss function
  without it (Qwen3-VL, GLM-4V on 4.57 - 5.6), the loss function gets it for the step (``CountToLoss``, issue 59).

The verdict: a loss the Trainer believes per window, with no explicit statement, that is *independent* of
``num_items_in_batch`` is a micro-batch mean (said at WARNING once a run where zerofix rescales it: a user's own
division by GAS cannot be told apart). Explicit statements win over the verdict: ``zerofix.loss_is_scaled_for_ga``,
the Trainer's ``loss_is_scaled_for_ga`` (transformers >= 5.19, TRL's trainers on any release), a non-callable
``compute_loss_func`` (TRL's marker for it before 5.19), ``accepts_loss_kwargs`` on the model, and a
``model_accepts_loss_kwargs`` set on the trainer against its forward's signature. The verdict only ever turns "per
window" into "mean", never the reverse: a loss the Trainer divides is left to the Trainer. What the trainer's model
and arguments say is read again at every ``train()``.

Ambiguity list (docs/fixes.md), each usage with the test that shows it left alone:
- a loss divided by ``num_items_in_batch`` (every causal LM, TRL 1.16's GKD, zerofix's own chunked loss, a deep copy
  of the count handed to the model): the Trainer's own path runs; bitwise the unpatched weights wherever that path
  is right (tests/test_trainer_scaling.py, tests/test_trainer_fsdp.py, tests/test_trl_trainer_scaling.py,
  tests/test_trainer_count_routes.py);
- a count that only leaves as a moved or cast copy that is dropped (device hooks, FSDP's casts): independent
  (tests/test_num_items_watch.py, tests/test_trainer_scaling_rows.py);
- a count that leaves the watch (a Python number, NumPy, a pickle, ``torch.tensor(n)``, TorchScript,
  ``torch.compile``, a count kept from an earlier step) or touches the loss without dividing it (``mean + 0 * n``):
  unknown, so upstream's path, bitwise, and the WARNING (tests/test_trainer_count_routes.py, tests/test_num_items_watch.py);
- an explicit statement: followed, never measured (RewardTrainer in tests/test_trl_trainer_scaling.py,
  tests/test_scaling.py, tests/test_trainer_scaling_unit.py);
- a loss the Trainer divides itself (it believes a mean): left to the Trainer even if computed from the count
  (tests/test_scaling.py); a head the release scales right (BERT without ``**kwargs`` on 4.48/4.57, a classifier
  on one process of 5.3 where accelerate's second division is the one a mean needs): bitwise
  (tests/test_trainer_scaling.py, tests/test_trainer_fsdp.py);
- a batch without ``labels`` (question answering): no count, so nothing normalised the loss; 4.48-4.53 skip the
  division for a loss-kwargs model anyway, zerofix divides as 4.54 does (tests/test_scaling.py);
- a ``compute_loss`` that divides by GAS itself, or normalises per window by its own count, without a statement:
  indistinguishable from a micro-batch mean, treated as one and said at WARNING with the statement that stops it
  (tests/test_trainer_scaling_rows.py);
- a head whose class says ``accepts_loss_kwargs = False`` but whose forward computes its own mean: handed the count
  once, found independent, upstream's mean of means for the run, warned (tests/test_trainer_mean_of_means.py);
- a trainer's own ``model_accepts_loss_kwargs = False`` on a model whose forward takes ``**kwargs`` (axolotl 0.19's):
  followed (a run may want micro-batch means), and the micro-batch-mean WARNING names the setting; handed the count as a
  flagged head only on the user's word, ``ZEROFIX_HAND_COUNT_TO_MODEL=1`` (tests/test_micro_means.py,
  tests/test_frameworks_axolotl.py);
- transformers 4.46-4.48 pass the count as an int, which cannot be followed: it is handed on as a 0-dim int64 tensor
  (same value, bitwise the same division; tests/test_num_items_watch.py, and the 2024-11/2025-01 cells);
- a compiled model (``torch_compile=True``, or a compiled module) or ``compute_loss_func``: handed the plain count (a
  watched tensor cannot enter Dynamo's graph); the verdict is unknown and upstream's path runs, warned
  (tests/test_trainer_scaling_unit.py);
- a ``training_step`` override that never reaches ``Trainer.training_step``: not covered, said in the log and the
  runtime details (tests/test_trainer_count_routes.py);
- a plain ``accelerator.accumulate`` loop is never touched: no Trainer step is open (tests/test_accelerate_loop.py).

Trainers created before ``patch()`` are covered (the wrappers are on the classes), and ``unpatch()`` leaves
no state behind: the verdicts live in a weak mapping, not on the user's objects.
"""
from __future__ import annotations

import inspect
import logging
import weakref

import torch

from accelerate.utils import DistributedType  # imported by the fixes only, once accelerate is

from zerofix import (decision, envvalues, framework_flags, micro_means, num_items_watch, own_mean, paths, replay,
                     scaling, trainer_report, versions)
from zerofix.fixes.contract import Check, drifted, found
from zerofix.identity import WeakIdentityMap

FIX_ID = "transformers-trainer-scaling"
FIX_IDS = (FIX_ID,)
_STEP = "_zerofix_trainer_step"  # in accelerator.__dict__ while a Trainer step runs
_log = logging.getLogger("zerofix")
_details: list[dict] = []  # runtime_details(), one per run of a trainer, in order (plain dicts: no reference to it)


class Known:
    """What zerofix knows of one trainer, kept beside it (a weak mapping), never on the user's object. What
    depends on the model, the loss function or the arguments is read again at every ``train()`` (``run``)."""

    __slots__ = ("run", "path", "compiled", "verdict", "window", "stated", "statement", "details", "plans", "warned",
                 "handing", "counted", "env_statement", "means", "means_windows", "rescale_said", "coincidence_said",
                 "unreached", "own_mean", "to_loss")

    def __init__(self):
        self.run = None  # trainer.state of the run the facts below were read in (a new one at every train())
        self.path = None  # paths.Path of this run
        self.compiled = False  # the model runs under torch.compile: not watched (the belief stands)
        self.verdict = None  # this step's num_items_watch.Verdict (None: none yet)
        self.handing = None  # the model class whose count the Trainer never hands, while zerofix hands it
        self.window = None  # micro-batches of the current window, as get_batch_samples fetched them
        self.stated = None  # stated(trainer), read once a run: inspect.signature costs microseconds
        self.statement = None  # zerofix.loss_is_scaled_for_ga(trainer, value): the user's own statement
        self.details = None  # this run's runtime_details() entry, from its first backward (a new one every train())
        self.plans = {}  # facts -> scaling.Plan
        self.warned = set()  # warnings given in this run
        self.counted = False  # the current window was counted only because zerofix hands the count (count_never_handed)
        self.env_statement = None  # ZEROFIX_LOSS_IS_SCALED_FOR_GA, read at every train()
        self.means = None  # this window's micro_means records, while they are read (None: done or not reading)
        self.means_windows = 0  # windows the micro-batch-mean reading has read
        self.rescale_said = None  # (the rescale warning, upstream's factor), held while the first window's means are
        # read: where they find a micro-batch mean term, one WARNING says both
        self.coincidence_said = None  # the coincidence warning (zerofix.decision), held the same way
        self.unreached = None  # the head zerofix handed the count to whose loss did not take it (its own mean)
        self.own_mean = None  # (head, proven): whether its inline mean was proven at its last micro-batch (own_mean)
        # issue 69: a model the Trainer hands the count whose forward calls its loss function without it (VipLlava on
        # 4.57 - 5.x): None until a step shows it (or not), True while zerofix hands it there, False otherwise
        self.to_loss = None


_known = WeakIdentityMap()  # trainer -> Known (by identity: a trainer need not hash)


def known(trainer) -> Known:
    state = _known.get(trainer)
    if state is None:
        state = _known[trainer] = Known()
    return state


class TrainerStep:
    __slots__ = ("trainer", "state", "num_items", "watching", "base_ran", "handled", "aux", "accounted", "call",
                 "plan", "handed", "redo", "to_loss", "counter", "changed")

    def __init__(self, trainer, num_items, watching, state=None):
        self.trainer, self.num_items, self.watching = trainer, num_items, watching
        self.state = state if state is not None else known(trainer)  # looked up once a step
        self.base_ran = False  # the base Trainer.compute_loss ran (and multiplied by the processes if it does)
        self.handled = False
        self.aux = None  # (auxiliary loss, coefficient) of an MoE model: transformers-moe-aux-loss
        self.accounted = None  # tensor -> bool: an undivided term of the loss that entry weights (its router term)
        self.call = self.plan = None  # this step's scaling.Call and Plan, once backward has them
        self.handed = False  # zerofix had the Trainer hand the model the count (count_never_handed)
        self.redo = False  # a handed step whose loss is not divided by the count: run again as the Trainer runs it
        self.to_loss = False  # CountToLoss armed for a count the Trainer itself hands the model (issue 69)
        self.counter = None  # this step's CountToLoss
        self.changed = False  # the count zerofix handed changed this backward (counted once with the plan's change)


_release = None


def release() -> tuple[int, ...]:
    global _release  # a cache of an installed-version fact, not patch state
    if _release is None:
        _release = versions.release_tuple(versions.installed_version("transformers") or "0")
    return _release


def structural_check(fix_id: str, targets) -> Check:
    """The signatures the wrappers read."""
    if fix_id != FIX_ID:
        raise KeyError(fix_id)
    params = list(inspect.signature(targets["Trainer.training_step"]).parameters)
    if params[:4] != ["self", "model", "inputs", "num_items_in_batch"]:
        return drifted(f"Trainer.training_step{tuple(params)} is not (self, model, inputs, num_items_in_batch, ...)")
    params = list(inspect.signature(targets["Trainer.compute_loss"]).parameters)
    if params[:2] != ["self", "model"] or "num_items_in_batch" not in params:
        return drifted(f"Trainer.compute_loss{tuple(params)} takes no num_items_in_batch")
    params = list(inspect.signature(targets["Trainer.get_batch_samples"]).parameters)
    if params[:3] != ["self", "epoch_iterator", "num_batches"]:
        return drifted(f"Trainer.get_batch_samples{tuple(params)} is not (self, epoch_iterator, num_batches, ...)")
    params = list(inspect.signature(targets["Accelerator.backward"]).parameters.values())
    if [p.name for p in params[:2]] != ["self", "loss"] or params[-1].kind != inspect.Parameter.VAR_KEYWORD:
        return drifted(f"Accelerator.backward{tuple(p.name for p in params)} is not (self, loss, **kwargs)")
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    params = inspect.signature(DeepSpeedEngineWrapper.backward).parameters.values()
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return drifted("DeepSpeedEngineWrapper.backward takes no **kwargs: scale_wrt_gas cannot reach engine.backward")
    from accelerate.accelerator import Accelerator

    prop = inspect.getattr_static(Accelerator, "gradient_accumulation_steps", None)
    if not isinstance(prop, property) or prop.fset is None:
        return drifted("Accelerator.gradient_accumulation_steps is no longer a settable property")
    return found()


def _num_items_arg(args, kwargs):
    if "num_items_in_batch" in kwargs:
        return kwargs["num_items_in_batch"]
    return args[2] if len(args) > 2 else None


def _with_num_items(args, kwargs, value):
    if "num_items_in_batch" in kwargs or len(args) <= 2:
        return args, {**kwargs, "num_items_in_batch": value}
    return (*args[:2], value, *args[3:]), kwargs


def _new_run(trainer, state: Known, model) -> None:
    """At the first step of a ``train()`` (a new ``trainer.state``): read again what the model, the loss function
    and the arguments decide, so no fact outlives the run it was read in (``model_init`` builds a new model)."""
    run = getattr(trainer, "state", None)
    if state.run is run and run is not None:
        return
    state.run, state.stated, state.plans, state.warned = run, None, {}, set()
    state.details, state.counted, state.env_statement = None, False, envvalues.loss_statement()
    state.means, state.means_windows, state.rescale_said, state.coincidence_said = [], 0, None, None
    state.unreached = state.own_mean = state.to_loss = None
    state.path = paths.trainer_path(trainer)
    state.compiled = _compiled(trainer, model)
    _say_local_batch_loss(trainer)
    trainer_report.ensure_on(trainer)  # a framework that replaced DEFAULT_CALLBACKS (ms-swift) still hears of zerofix
    if not state.path.covered and paths.stood_aside(FIX_ID, state.path):  # the Trainer's log line: trainer_report
        _log.info("zerofix: %s stands aside on this run, %s: the Trainer's own scaling runs unchanged "
                  "(zerofix models one process, DDP, DeepSpeed ZeRO-0..3, FSDP1 and FSDP2)", FIX_ID, state.path)
    state.handing = count_never_handed(trainer, model) if state.path.covered and not state.compiled else None
    if state.handing:
        _details_of(trainer)["count_handed"] = state.handing
        # said at INFO: whether anything changes is known only once the first loss is measured (_check_handed)
        whose = _whose_flag(trainer, model, state.handing)
        _log.info("zerofix: %s, so the Trainer neither counts nor passes num_items_in_batch; zerofix has the Trainer "
                  "count and pass it, and keeps it only for steps whose loss is divided by it (a step whose loss is not "
                  "runs again as the Trainer runs it)", whose)
    elif state.path.covered and (name := _smoothed_never_handed(trainer, model)):
        _note(_details_of(trainer), "label smoothing: mean of micro-batch means")
        _warn_main(trainer, "zerofix: %s says accepts_loss_kwargs = False and this run smooths its labels: the Trainer "
                   "never counts num_items_in_batch for it and this release's LabelSmoother takes no count "
                   "(transformers >= 5.24's does), so each micro-batch's loss is its own token mean and the update is "
                   "a mean of micro-batch means (uneven label counts weigh micro-batches unequally); zerofix leaves it "
                   "as the Trainer computes it", name)


def _whose_flag(trainer, model, name: str) -> str:
    """Why the Trainer withholds the count from the head zerofix hands it to, in words (the run's INFO line); a
    framework's flag (issue 67) is also kept in the run's details for its entry's line in the Trainer log."""
    if _flagged_class(trainer, model):
        return f"{name} says accepts_loss_kwargs = False"
    flag = framework_flags.of(trainer)
    if not envvalues.hand_count_statement() and flag is not None:
        from zerofix import catalogue

        fix = catalogue.by_id(flag.fix_id)
        details = _details_of(trainer)
        details["framework_flag"], details["framework_setter"] = flag.fix_id, flag.setter
        fixed = f", fixed in {fix.fixed_in}" if fix.fixed_in else ""
        return (f"{flag.setter} ({flag.release}) set model_accepts_loss_kwargs = False for {name}, a known bug of "
                f"{fix.dist} {fix.affected} ({flag.fix_id}{fixed}: {', '.join(fix.upstream)}), not your word")
    return (f"{type(trainer).__name__} set model_accepts_loss_kwargs = False for {name} and "
            f"{envvalues.HAND_COUNT}=1 says that is not your word")


def framework_flag_line(details: dict) -> str | None:
    """What the Trainer entry did for a framework's flag (issue 67) in one run, from its details (``run_details``):
    the entry's line in the Trainer log, or None where no framework flag was handed in that run."""
    if not details or not details.get("framework_flag"):
        return None
    handed, kept = details.get("steps_handed", 0), details.get("corrected", 0)
    said = f"{details['framework_setter']} set model_accepts_loss_kwargs = False"
    if not handed:
        return None
    stopped = details.get("count_handed", "")
    if " stopped at " in stopped:
        return (f"{said}; zerofix had the Trainer hand the model num_items_in_batch, and {stopped} (the framework's "
                "setting is then followed, as upstream runs it)")
    return (f"{said}; zerofix has the Trainer hand the model num_items_in_batch, and its loss was divided by it in "
            f"{kept} of {handed} backwards so far (the window's token mean, as the framework's fixed release trains)")


def _say_local_batch_loss(trainer) -> None:
    """Once a run: a loss its library defines as normalised over the local batch (TRL's GRPO ``bnpo``), which averages
    micro-batch means under accumulation; said, never changed (``decision.local_batch_message``)."""
    args = getattr(trainer, "args", None)
    accelerator = getattr(trainer, "accelerator", None)
    said = decision.local_batch_message(getattr(args, "loss_type", None),
                                        int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                                        int(getattr(accelerator, "num_processes", 1) or 1))
    if said is None:
        return
    details = _details_of(trainer)
    details["local_batch_loss"] = said
    _note(details, f"loss_type {args.loss_type}: mean of micro-batch token means (documented)")
    _warn_main(trainer, "zerofix: %s %s", type(trainer).__name__, said)


def count_never_handed(trainer, model) -> str | None:
    """The model class whose count the Trainer never hands although its forward takes it (issue 47), or None.

    The Trainer counts and passes ``num_items_in_batch`` only when ``model_accepts_loss_kwargs``, which it reads from
    the model's ``accepts_loss_kwargs``. 27 generation heads of transformers 5.24 set that to False (Qwen2.5/3-VL,
    Qwen3.5, Gemma 4, GLM-4V, ...) while their forwards hand ``**kwargs`` to a ``loss_function`` that divides by the
    count: their update is a mean of micro-batch means. Whether the loss is divided by the count when handed one is
    decided at every step from behaviour (the verdict); this only names the candidates: the flag False on the model's
    class, a forward taking ``**kwargs``, and nobody's word otherwise (a compute_loss_func, a label smoother, a
    statement, transformers' or zerofix's ``loss_is_scaled_for_ga``; a label smoother counts only where it takes the
    count). transformers >= 4.54 (the count's rules read here)."""
    if getattr(trainer, "compute_loss_func", None) is not None or not _smoother_takes_the_count(trainer):
        return None
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None or _user_statement(known(trainer)) is not None:
        return None
    flagged = _flagged_class(trainer, model)
    if flagged is None and _count_withheld_by_trainer(trainer, model) and (
            envvalues.hand_count_statement()
            or decision.framework_word(framework_flags.of(trainer)) == decision.FRAMEWORK_BUG):
        # the user's word (ZEROFIX_HAND_COUNT_TO_MODEL=1, issue 60), or a framework entry's record that the framework's
        # own code set the trainer's flag on a release with that bug (issue 67): handed and checked at every step exactly
        # as a flagged head's count
        return type(_unwrap_peft(_unwrapped(trainer, model))).__name__
    return flagged


def _smoother_takes_the_count(trainer) -> bool:
    """No label smoother, or one the Trainer hands ``num_items_in_batch`` (transformers >= 5.24's LabelSmoother): its
    loss is then divided by the count like the model's (decided at every step by the verdict)."""
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is None:
        return True
    try:
        return "num_items_in_batch" in inspect.signature(smoother).parameters
    except (TypeError, ValueError):
        return False


def _smoothed_never_handed(trainer, model) -> str | None:
    """The class of a flagged head (see count_never_handed) whose label smoother takes no count: the mean of means stays
    and is said (issue 51, item 4)."""
    if getattr(trainer, "compute_loss_func", None) is not None or _smoother_takes_the_count(trainer):
        return None
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None or _user_statement(known(trainer)) is not None:
        return None
    return _flagged_class(trainer, model)


def _flagged_class(trainer, model) -> str | None:
    """The model class that says ``accepts_loss_kwargs = False`` while its forward takes ``**kwargs``, where the Trainer
    took the flag (``model_accepts_loss_kwargs`` False), on transformers >= 4.54 (the count's rules read here)."""
    if release() < (4, 54) or getattr(trainer, "model_accepts_loss_kwargs", True) is not False:
        return None
    try:
        inner = _unwrap_peft(trainer.accelerator.unwrap_model(model))
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        inner = _unwrap_peft(model)
    if inspect.getattr_static(type(inner), "accepts_loss_kwargs", None) is not False:
        return None
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return type(inner).__name__ if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params) else None


def _unwrapped(trainer, model):
    """The model inside DDP, DeepSpeed and FSDP (a PeftModel stays: its call is the one the count comes with)."""
    try:
        return trainer.accelerator.unwrap_model(model)
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        return model


class CountToLoss:
    """For one handed step (issue 59): the count the model's forward is called with reaches the ``loss_function`` that
    forward calls without it. Qwen3-VL and GLM-4V on transformers 4.57 - 5.6 and Qwen3.5 on 5.3 - 5.6 take the count in
    their ``**kwargs`` and call ``self.loss_function(logits=..., labels=..., vocab_size=...)`` without it, so the count
    the Trainer hands never reaches the loss and each micro-batch takes its own token mean. Whether the loss is then
    divided by the count is the step's verdict, as for any handed head (``_check_handed``): kept where it is, the step run
    again without the count where it is not. The count is the one the model's own call carries (a forward pre-hook
    reads it; a call without one, such as the chunked-loss switch's proof of its route, gets none), a call that passes
    the count itself (5.24's heads) is left as it is, and so is a loss function that takes no count (its signature has
    neither ``num_items_in_batch`` nor ``**kwargs``). The model's own ``_loss_function`` (a user's, set through the
    property transformers provides) is what gets the count, and it, the hooks and the rest are put back after the step.
    ``model`` None: nothing is done."""

    def __init__(self, model, proven=None, called=None):
        self.model, self.kept, self.hooks, self.proven = model, None, (), proven
        self.injected = False  # a loss function was called with the count it was called without
        # the module whose call carries the count: a PeftModel around the model (PEFT's tuner calls the model's
        # ``forward`` directly, so hooks on the model itself would never run), else the model
        self.called = called if called is not None else model

    def __enter__(self):
        model = self.model
        if model is None or not isinstance(model, torch.nn.Module) or not isinstance(self.called, torch.nn.Module):
            return self
        current = [None, False]  # the count of the model call under way; whether its loss function took a count
        original = self._loss_function(model)
        if original is not None:
            names = list(inspect.signature(original).parameters)
            position = names.index("num_items_in_batch") if "num_items_in_batch" in names else None

            def with_count(*args, **kwargs):
                count = current[0]
                if kwargs.get("num_items_in_batch") is not None:
                    current[1] = True
                    return original(*args, **kwargs)
                if count is None:
                    return original(*args, **kwargs)
                current[1] = True
                if position is not None and position < len(args):
                    if args[position] is not None:
                        return original(*args, **kwargs)
                    self.injected = True
                    return original(*args[:position], count, *args[position + 1:], **kwargs)
                self.injected = True
                return original(*args, **{**kwargs, "num_items_in_batch": count})

            self.kept = (vars(model).get("_loss_function"), "_loss_function" in vars(model))
            model.loss_function = with_count

        def called(module, args, kwargs):
            current[0], current[1] = kwargs.get("num_items_in_batch"), False

        def returned(module, args, kwargs, output):
            count, took = current
            current[0], current[1] = None, False
            if count is not None and not took and self.proven is not None:
                self._weigh_own_mean(type(model).__name__, kwargs, output, count)

        self.hooks = (self.called.register_forward_pre_hook(called, with_kwargs=True),
                      self.called.register_forward_hook(returned, with_kwargs=True))
        return self

    @staticmethod
    def _loss_function(model):
        """The model's loss function where a count can be handed to it (the property transformers provides, whose
        signature takes ``num_items_in_batch`` or ``**kwargs``), else None."""
        prop = inspect.getattr_static(type(model), "loss_function", None)
        if not isinstance(prop, property) or prop.fset is None:  # 4.46 - 4.47: read-only, and no count is handed there
            return None
        try:
            original = model.loss_function
            params = inspect.signature(original).parameters
        except Exception:  # noqa: BLE001 - a loss function this cannot read: left as it is
            return None
        if "num_items_in_batch" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return None
        return original

    def _weigh_own_mean(self, name: str, kwargs: dict, output, count) -> None:
        """A forward that returned a loss no count reached (an inline mean, Gemma 3's): where that loss is proven the
        mean cross-entropy of the logits it returns over its micro-batch's counted tokens, it becomes its share of the
        window's token mean (``zerofix.own_mean``); otherwise it is left as it is (the step's verdict: independent)."""
        loss = getattr(output, "loss", None)
        if loss is None:
            return
        proof = own_mean.prove(loss, getattr(output, "logits", None), kwargs.get("labels"), kwargs.get("attention_mask")) \
            if hasattr(output, "keys") else None
        if proof is None:
            self.proven(name, None)
            return
        output.loss = own_mean.as_window_share(loss, proof, count)
        self.proven(name, proof)

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        if self.kept is None:
            return
        value, had = self.kept
        if had:
            self.model.loss_function = value
        else:
            vars(self.model).pop("_loss_function", None)


class _Handing:
    """``trainer.model_accepts_loss_kwargs`` True for the length of one Trainer call (counting a window, a step):
    the Trainer then counts, passes and scales the count as for any model that takes it; outside, the attribute is the
    Trainer's own."""

    def __init__(self, trainer, on: bool):
        self.trainer, self.on, self.was = trainer, on, None

    def __enter__(self):
        if self.on:
            self.was = self.trainer.model_accepts_loss_kwargs
            self.trainer.model_accepts_loss_kwargs = True

    def __exit__(self, *exc):
        if self.on:
            self.trainer.model_accepts_loss_kwargs = self.was


def training_step(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or _STEP in accelerator.__dict__:  # a nested call
        return wrapped(*args, **kwargs)
    state = known(trainer)
    _new_run(trainer, state, args[0] if args else getattr(trainer, "model", None))
    if not state.path.covered:
        return wrapped(*args, **kwargs)
    num_items = _num_items_arg(args, kwargs)
    if num_items is not None and state.counted and not state.handing:
        # the window was counted only for a handing that stopped within it: the Trainer would pass no count
        num_items, (args, kwargs) = None, _with_num_items(args, kwargs, None)
    plain = args, kwargs
    # Every step is watched (the cost: the few operations on the count, tests/benchmarks): the verdict is
    # this step's, so a loss that starts reading the count later, or a new model, is seen as it is.
    watching = num_items is not None and not state.compiled
    if watching:
        args, kwargs = _with_num_items(args, kwargs, num_items_watch.watch(
            num_items_watch.as_tensor_like_release(num_items)))
    step = accelerator.__dict__[_STEP] = TrainerStep(trainer, num_items, watching, state)
    step.handed = bool(state.handing) and num_items is not None
    # issue 69: the count the Trainer hands the model reaches the loss function its forward calls without it, checked
    # the same way; armed until a step shows that the forward passes the count itself (then not again this run)
    step.to_loss = not step.handed and watching and state.to_loss is not False
    model = plain[0][0] if plain[0] else plain[1].get("model")
    armed = step.handed or step.to_loss
    before = replay.Point(model) if armed else None
    try:
        outer = _unwrapped(trainer, model) if armed else None
        step.counter = CountToLoss(_unwrap_peft(outer) if armed else None,
                                   proven=_own_mean_said(step) if step.handed else None, called=outer)
        with _Handing(trainer, step.handed), step.counter:
            result = num_items_watch.unwatched(wrapped(*args, **kwargs))  # the Trainer's running loss stays plain
    finally:
        accelerator.__dict__.pop(_STEP, None)
        if watching:
            num_items_watch.close()  # whatever the step kept (a buffer, a running sum, a copy) is plain again
    if step.to_loss and not step.counter.injected and state.to_loss is None:
        state.to_loss = False  # its forward hands its loss function the count itself: nothing to hand this run
    if not step.redo:
        return result
    before.restore()  # the step as the Trainer runs it, from where the handed one started
    if step.handed:
        return training_step(wrapped, trainer, *_with_num_items(*plain, None))
    return training_step(wrapped, trainer, *plain)  # with the count, no longer handed to the loss function


def _compiled(trainer, model) -> bool:
    """Under torch.compile a watched count cannot be followed: Dynamo cannot trace a tensor subclass that shows it
    every read (with ``fullgraph=True`` the step would stop), and a watched tensor would send the step through
    another graph (eager where the compiled graph would run: measured, the loss differs in the last bits). So a
    compiled model or ``compute_loss_func`` gets the plain count, the verdict is unknown, and upstream's path runs
    (``backward`` says so at WARNING with the statement that settles it)."""
    loss_func = getattr(trainer, "compute_loss_func", None)
    return (bool(getattr(getattr(trainer, "args", None), "torch_compile", False)) or hasattr(model, "_orig_mod")
            or hasattr(loss_func, "_torchdynamo_orig_callable") or hasattr(loss_func, "_orig_mod"))


def _warn_main(trainer, msg: str, *args) -> None:
    """A warning on the main process only (every rank takes the same decision)."""
    accelerator = getattr(trainer, "accelerator", None)
    if getattr(accelerator, "is_main_process", True):
        _log.warning(msg, *args)


def compute_loss(wrapped, trainer, args, kwargs):
    step = getattr(trainer, "accelerator", None) and trainer.accelerator.__dict__.get(_STEP)
    if step is not None and step.trainer is trainer:
        step.base_ran = True
    return wrapped(*args, **kwargs)


def get_batch_samples(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        try:
            _training[accelerator] = weakref.ref(trainer)  # a strong one would keep both alive (trainer.accelerator)
        except TypeError:  # not weak-referenceable: no report of unseen steps
            pass
    state = known(trainer)
    _new_run(trainer, state, getattr(trainer, "model", None))
    state.counted = bool(state.handing)
    with _Handing(trainer, state.counted):  # the Trainer counts the window only for a model it hands it to
        result = wrapped(*args, **kwargs)
    try:
        state.window = len(result[0])
    except (TypeError, IndexError):
        pass
    return result


def _unwrap_peft(model):
    """A PeftModel's base model (what the Trainer inspects), or the model itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _trainer_guess(model) -> bool:
    """What the release's Trainer.__init__ guesses for ``model_accepts_loss_kwargs`` (PEFT-unwrapped): the
    model's ``accepts_loss_kwargs`` from 4.48, else whether the forward takes ``**kwargs`` (4.46-4.47: a
    ``**loss_kwargs`` parameter by that name)."""
    model = _unwrap_peft(model)
    if release() >= (4, 48) and hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if release() < (4, 48):
        return "loss_kwargs" in params and params["loss_kwargs"].kind == inspect.Parameter.VAR_KEYWORD
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def stated(trainer) -> bool:
    """Whether someone said, rather than the Trainer guessed, whether the loss is per window."""
    if _user_statement(known(trainer)) is not None or getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return True
    loss_func = getattr(trainer, "compute_loss_func", None)
    if loss_func is not None and not callable(loss_func):  # TRL's marker for loss_is_scaled_for_ga before 5.19
        return True
    try:
        model = trainer.accelerator.unwrap_model(trainer.model)
    except Exception:  # noqa: BLE001 - an exotic wrapper: take the model as it is
        model = trainer.model
    if loss_func is None and hasattr(type(_unwrap_peft(model)), "accepts_loss_kwargs"):  # the model's author said
        return True
    # while zerofix hands the count (count_never_handed), the flag is zerofix's, not anybody's word
    accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and not known(trainer).handing
    return accepts != _trainer_guess(model)


def _stated_once(trainer) -> bool:
    state = known(trainer)
    if state.stated is None:
        state.stated = stated(trainer)
    return state.stated


def _facts(accelerator, step: TrainerStep) -> scaling.TrainerFacts:
    trainer, state = step.trainer, step.state
    gas = int(trainer.args.gradient_accumulation_steps)
    return scaling.TrainerFacts(
        accepts_loss_kwargs=bool(getattr(trainer, "model_accepts_loss_kwargs", False)),
        compute_loss_func=getattr(trainer, "compute_loss_func", None) is not None,
        num_items=step.num_items is not None,
        average_tokens=bool(getattr(trainer.args, "average_tokens_across_devices", False)),
        loss_is_scaled_for_ga=getattr(trainer, "loss_is_scaled_for_ga", None),
        processes=int(accelerator.num_processes), gas=gas, window=int(state.window or gas))


def _state_of(verdict) -> str | None:
    return None if verdict is None else verdict.state


def _user_statement(state: Known) -> bool | None:
    """zerofix.loss_is_scaled_for_ga(trainer, value), else ZEROFIX_LOSS_IS_SCALED_FOR_GA (read at every train())."""
    return state.statement if state.statement is not None else state.env_statement


_SAID = {num_items_watch.DIVIDED: "divided by num_items_in_batch",
         num_items_watch.INDEPENDENT: "independent of num_items_in_batch",
         num_items_watch.UNKNOWN: "unknown: follows the Trainer's own path"}


def _record_verdict(step: TrainerStep, verdict) -> dict:
    """This step's verdict (a num_items_watch.Verdict) into the trainer's state and its runtime details."""
    trainer, state = step.trainer, step.state
    details = _details_of(trainer)
    details["stated"] = _stated_once(trainer)
    statement = _user_statement(state)
    if statement is not None:
        details["statement"] = _statement_source(state) + (" (per accumulation window)" if statement
                                                           else " (a micro-batch mean)")
    state.verdict = verdict
    if verdict is not None:
        details["steps_" + verdict.state] += 1
        details["loss"] = "unknown" if verdict.state == num_items_watch.UNKNOWN and statement is not None \
            else _SAID[verdict.state]
        if verdict.route:
            details["route"] = verdict.route
    details["backwards"] += 1
    return details


def _own_mean_said(step: TrainerStep):
    """What ``CountToLoss`` proved of a head's inline mean at each micro-batch (``zerofix.own_mean``): the first proof of
    a run is said at INFO (the update is the window's token mean, upstream's a mean of micro-batch means); one that
    fails is kept for the WARNING of the mean of means that follows (the step's verdict is then independent)."""

    def proven(name: str, proof) -> None:
        state = step.state
        state.own_mean = (name, proof is not None)
        if proof is None:
            return
        details = _details_of(step.trainer)
        if "own_mean" in details:
            return
        details["own_mean"] = (f"{name}: its inline token mean, proven at each micro-batch equal to the mean "
                               f"cross-entropy of the logits it returns over the tokens its {proof.tokens} count, "
                               "weighed by those tokens over num_items_in_batch (the window's token mean)")
        if step.trainer.accelerator.is_main_process:
            _log.info("zerofix: %s computes its own token mean inline, where no count reaches it: at each micro-batch "
                      "zerofix proves that loss is the mean cross-entropy of the logits it returns over the tokens its %s "
                      "count, and weighs it by those tokens over num_items_in_batch, so the update is the window's "
                      "token mean (upstream's: a mean of micro-batch means)", name, proof.tokens)

    return proven


def _check_handed(step: TrainerStep, verdict, details) -> None:
    """A step of a model the Trainer never hands the count, handed it by zerofix: right when the loss is divided by it.
    Otherwise (its forward computes its own mean, or what it does cannot be told) the handing changed a step it cannot
    prove right: that step runs again as the Trainer runs it (``redo``: no backward of this loss, the random state and
    the buffers as they were, no count) and no later step is handed the count, so every step is upstream's (issue 51,
    item 2). Said at WARNING only where the run keeps a mean of means it may not mean (unknown); a loss independent of
    the count (a classifier, a masked LM, a forward computing its own mean) is upstream's and said at INFO."""
    state = step.state
    details["steps_handed"] = details.get("steps_handed", 0) + 1
    if verdict is not None and verdict.state == num_items_watch.DIVIDED:
        step.changed = True  # this backward differs from upstream's: its loss was divided by the handed count
        return
    name, state.handing, state.plans, state.stated = state.handing, None, {}, None
    step.redo = True
    independent = verdict is not None and verdict.state == num_items_watch.INDEPENDENT
    at = getattr(getattr(step.trainer, "state", None), "global_step", 0) + 1
    details["count_handed"] = (f"{name}: stopped at optimizer step {at}, the loss is not divided by the count; that "
                               "micro-batch ran again without it and every step from there is scaled as a micro-batch "
                               "mean (the Trainer's own path, or zerofix's plan where the release divides twice)")
    state.unreached = name
    details["count_handed_verdict"] = verdict.state if verdict is not None else num_items_watch.UNKNOWN
    if independent:  # a head computing its own mean (Gemma 3's inline cross-entropy), a classifier: the reading of its
        # micro-batch means (_read_micro_means) says at WARNING whether the update averages token means of uneven counts
        _log.info("zerofix: %s's loss is independent of num_items_in_batch (its forward computes its own mean, not through "
                  "a loss function zerofix can hand the count): zerofix stopped handing it the count at optimizer step %d "
                  "and ran that micro-batch again without it; from there each step is scaled as a micro-batch mean is "
                  "(the Trainer's own path, or zerofix's plan where the release divides twice)", name, at)
        return
    _warn_main(step.trainer, "zerofix: %s was handed num_items_in_batch at optimizer step %d, but whether its loss is "
               "divided by it cannot be told (%s): that micro-batch ran again without the count, as the Trainer runs "
               "it, and every step from there is the Trainer's own, a mean of micro-batch means (uneven label counts "
               "weigh micro-batches unequally)%s. If the loss is divided by num_items_in_batch, say so: "
               "zerofix.loss_is_scaled_for_ga(trainer) or ZEROFIX_LOSS_IS_SCALED_FOR_GA=1", name, at,
               verdict.route if verdict is not None else "not measured",
               "" if at == 1 else f"; steps 1-{at - 1} were divided by the count, the token mean")


def _check_to_loss(step: TrainerStep, verdict, details) -> None:
    """A step whose forward got the Trainer's count but called its loss function without it, handed it by zerofix
    (issue 69: VipLlava on transformers 4.57 - 5.x): kept where the loss is divided by it, said once at INFO; otherwise
    the step runs again as the Trainer runs it and nothing more is handed this run."""
    state = step.state
    name = type(step.counter.model).__name__
    if verdict is not None and verdict.state == num_items_watch.DIVIDED:
        step.changed = True
        if state.to_loss is None:
            state.to_loss = True
            details["count_to_loss"] = name
            if step.trainer.accelerator.is_main_process:
                _log.info("zerofix: %s's forward takes num_items_in_batch and calls its loss function without it, so each "
                          "micro-batch would take its own token mean: zerofix hands that loss function the count and "
                          "keeps it only for steps whose loss is divided by it (a step whose loss is not runs again as "
                          "the Trainer runs it)", name)
        return
    state.to_loss, state.plans, step.redo = False, {}, True
    at = getattr(getattr(step.trainer, "state", None), "global_step", 0) + 1
    details["count_to_loss"] = (f"{name}: stopped at optimizer step {at}, the loss is not divided by the count its "
                                "loss function was handed; that micro-batch ran again without it")
    _log.info("zerofix: %s's loss function was handed num_items_in_batch at optimizer step %d and the loss is not "
              "divided by it (%s): that micro-batch ran again as the Trainer runs it, and nothing more is handed",
              name, at, verdict.state if verdict is not None else num_items_watch.UNKNOWN)


def _details_of(trainer) -> dict:
    """The run's runtime_details() entry (one per train() of a trainer), made when it first has something to say."""
    state = known(trainer)
    if state.details is None:
        state.details = {"trainer": type(trainer).__name__, "loss": "not measured", "stated": False,
                         "backwards": 0, "corrected": 0, "steps_divided": 0, "steps_independent": 0,
                         "steps_unknown": 0}
        _details.append(state.details)
    return state.details


def _note(details, warning: str) -> None:
    if details is not None and warning not in details.setdefault("warnings", []):
        details["warnings"].append(warning)


def _warn_unknown(step: TrainerStep, verdict) -> None:
    """Once a run, where the verdict is unknown and nobody stated what the loss is: zerofix follows upstream."""
    trainer, state = step.trainer, step.state
    if state.stated or _user_statement(state) is not None or "unknown" in state.warned:
        return
    state.warned.add("unknown")
    _note(state.details, "unknown verdict: upstream's path followed")
    _warn_main(trainer, "zerofix: whether %s's loss is divided by num_items_in_batch cannot be told: %s. zerofix "
               "leaves this run to the Trainer's own scaling, which is right only if the Trainer's guess is (it "
               "believes the loss %s). Say what the loss is: zerofix.loss_is_scaled_for_ga(trainer) or "
               "ZEROFIX_LOSS_IS_SCALED_FOR_GA=1 if it is divided by the count or already divided by "
               "gradient_accumulation_steps, zerofix.loss_is_scaled_for_ga(trainer, False) or "
               "ZEROFIX_LOSS_IS_SCALED_FOR_GA=0 if it is a micro-batch mean (or trainer.loss_is_scaled_for_ga on "
               "transformers >= 5.19)",
               type(trainer).__name__, verdict.route,
               "per window" if step.call is not None and not step.call.loss_is_mean else "a micro-batch mean")


def _warn_rescaled(step: TrainerStep, call: scaling.Call, plan: scaling.Plan) -> None:
    """Once a run, where zerofix scales a loss as a micro-batch mean that nobody stated to be one: a user's
    compute_loss may have divided it already (the hand-fixed classifier), which no measurement can tell."""
    trainer, state = step.trainer, step.state
    if not call.loss_is_mean or state.stated:
        return
    state.warned.add("rescaled")
    _note(state.details, "rescaled as a mean, unstated")
    said = f"zerofix scales it as a micro-batch mean (averaged over the window's {call.window} micro-batches)"
    if state.means is not None:  # the first window's means are being read: one WARNING at its end says both
        state.rescale_said = (said, float(1 / decision.update_factor(call, plan)))  # upstream's update / zerofix's
        return
    _say_rescaled(trainer, said)


_IF_ALREADY_DIVIDED = ("If your compute_loss already divides it by gradient_accumulation_steps, state it: "
                       "zerofix.loss_is_scaled_for_ga(trainer) or, from the environment, "
                       "ZEROFIX_LOSS_IS_SCALED_FOR_GA=1 (or trainer.loss_is_scaled_for_ga = True on transformers >= "
                       "5.19)")


def _say_rescaled(trainer, said: str) -> None:
    _warn_main(trainer, "zerofix: %s's loss is independent of num_items_in_batch: %s. %s", type(trainer).__name__,
               said, _IF_ALREADY_DIVIDED)


def runtime_details() -> list[dict]:
    """Per trainer seen: the verdicts of its steps (divided, independent, unknown and why), whether what the loss is
    was stated, and how many of its backwards zerofix changed (0: every one went through as upstream's)."""
    return [dict(d) for d in _details]


def run_details(trainer_state) -> dict | None:
    """The runtime_details() entry of the run whose ``trainer.state`` this is (a copy), or None: what the Trainer log of
    that run reports (issue 51, item 5: not another Trainer's of the same class)."""
    for state in list(_known.values()):
        if state.run is trainer_state and state.details is not None:
            return dict(state.details)
    return None


def reset_runtime() -> None:
    _details.clear()


def _verdict(step: TrainerStep, loss):
    if step.watching:
        return num_items_watch.decide(loss, accounted=step.accounted or (lambda tensor: False))
    if step.num_items is None:
        return None  # no count handed: nothing can have normalised the loss (scaling.call_of)
    return num_items_watch.Verdict(num_items_watch.UNKNOWN, "the count was handed to torch.compile, which the "
                                   "watch cannot follow")


def backward(wrapped, accelerator, args, kwargs):
    step = accelerator.__dict__.get(_STEP) if accelerator is not None else None
    if step is None:
        _unseen(accelerator)
        return wrapped(*args, **kwargs)
    if step.handled:  # a second backward in the same step
        return wrapped(*args, **kwargs)
    step.handled = True
    loss = args[0] if args else kwargs["loss"]
    verdict = _verdict(step, loss)
    loss = num_items_watch.unwatched(loss)  # the engine gets a plain tensor: bitwise the same value and graph
    details = _record_verdict(step, verdict)
    if step.handed:
        _check_handed(step, verdict, details)
    elif step.to_loss and step.counter is not None and step.counter.injected:
        _check_to_loss(step, verdict, details)
    if step.redo:  # no backward of a loss the handed count changed: training_step runs the micro-batch again
        return None  # (and the run again, no longer handed, is what the micro-batch-mean reading reads)
    decided = _decide(accelerator, step, verdict, loss, kwargs)
    step.call, step.plan = decided.call, decided.plan
    plan = decided.plan
    if decided.coincidence is not None:
        _say_coincidence(step, decided)
    if verdict is not None and verdict.state == num_items_watch.UNKNOWN:
        _warn_unknown(step, verdict)
    if plan.changes and "rescaled" not in step.state.warned:
        _warn_rescaled(step, step.call, plan)
    if step.state.means is not None:  # after the plan: what the reading says depends on what this run does
        _read_micro_means(step, verdict, loss)
    if plan.changes or step.changed:  # once a backward, whatever changed it
        details["corrected"] += 1
    if plan.changes:
        if plan.multiply_by != 1:
            loss = loss * plan.multiply_by
        if plan.divide_by != 1:
            loss = loss / plan.divide_by
    args, kwargs = ((loss, *args[1:]), kwargs) if args else ((), {**kwargs, "loss": loss})
    if not plan.no_downstream_division:
        return wrapped(*args, **kwargs)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return wrapped(*args, **{**kwargs, "scale_wrt_gas": False})  # upstream #35808
    steps = accelerator.gradient_accumulation_steps
    accelerator.gradient_accumulation_steps = 1  # upstream #45349
    try:
        return wrapped(*args, **kwargs)
    finally:
        accelerator.gradient_accumulation_steps = steps


MEANS_WINDOWS = 64  # windows of equal counts the micro-batch-mean reading reads before it gives up (one graph walk a
# micro-batch while it reads: tests/benchmarks)


def _read_micro_means(step: TrainerStep, verdict, loss) -> None:
    """Issues 53 and 59: the means the loss takes over its own micro-batch (``micro_means``), window by window, on every
    rank, judged over the window's micro-batches of every rank. Where one divides by a count that changes between them,
    the update averages micro-batch means and zerofix, which cannot hand that term a count, says so once. A window whose
    counts are all equal concludes nothing (a later one may differ: issue 59 measured a first window of equal counts and
    a second 0.19 off, silent), so the reading goes on, up to MEANS_WINDOWS windows. Read only where the loss does not
    take the count (independent of it, or never handed it) and zerofix hands the model none: a loss divided by the count,
    and a head zerofix hands the count to, are the Trainer entry's other paths. On several processes each rank reads to
    the window's end before the ranks compare (one small all-gather a window while the reading lasts), so every rank
    reaches the same decision at the same step."""
    state, trainer = step.state, step.trainer
    gas = int(trainer.args.gradient_accumulation_steps)
    world = int(getattr(trainer.accelerator, "num_processes", 1) or 1)
    independent = verdict is None or verdict.state == num_items_watch.INDEPENDENT
    readable = gas * world > 1 and not step.handed and not state.handing and independent
    if not readable and world == 1:
        _stop_reading_means(step)
        return
    state.means.append(micro_means.micro_means(loss) if readable else None)  # None: this window concludes nothing
    if len(state.means) < int(state.window or gas):
        return
    found, changed = micro_means.outcome(_across_ranks(state.means, world))
    state.means_windows += 1
    if found == micro_means.EQUAL and state.means_windows < MEANS_WINDOWS:
        _release_held(step)  # the first window's held warnings are said alone; the reading goes on
        state.means = []
        return
    if found != micro_means.DIFFER:
        _stop_reading_means(step)
        return
    rescaled, coincided = state.rescale_said, state.coincidence_said
    state.means = state.rescale_said = state.coincidence_said = None
    kind, counts = changed[0]
    where = "the first window's" if state.means_windows == 1 else f"window {state.means_windows}'s"
    term = (f"a {kind} over {', '.join(map(str, counts))} elements in {where} {len(counts)} micro-batches"
            + (f" over {world} processes" if world > 1 else ""))
    # issue 60: axolotl 0.19's trainer sets the flag False for every model whose inner forward lacks the parameter by
    # name; the Trainer then hands the model's own loss (the base compute_loss ran: the term is the model's) no count.
    # Its own path: followed, and said with the setting (a trainer's own loss, TRL's ORPO, keeps the other words)
    withheld = not state.unreached and step.base_ran and _count_withheld_by_trainer(trainer, trainer.model)
    said, tail = _means_said(step, term, rescaled, coincided, "zerofix hands it no count against that setting"
                             if withheld else "zerofix cannot hand that term a count")
    if state.unreached:  # issue 59: the head whose own mean it is, which no count reaches, named
        said = (f"(computed by {state.unreached}, which takes no count: zerofix handed it num_items_in_batch and its "
                "forward computes its own mean, not through a loss function zerofix can hand it"
                + (", and zerofix could not prove that mean from the logits it returns (the only mean it weighs)"
                   if state.own_mean == (state.unreached, False) else "") + ") " + said)
    if withheld:
        flag = framework_flags.of(trainer)
        who = (f"{flag.setter} ({flag.release}) set model_accepts_loss_kwargs = False (a known bug of its releases: "
               f"{flag.fix_id}) and {flag.around} runs around it, so the setting may also be yours"
               if decision.framework_word(flag) == decision.UNCLEAR else
               f"{type(trainer).__name__} set model_accepts_loss_kwargs = False")
        said = (f"(the Trainer hands the model no num_items_in_batch: {who} where the model's forward takes **kwargs, "
                "so the Trainer divides each micro-batch's loss by gradient_accumulation_steps instead; zerofix follows "
                "that setting) " + said)
    details = _details_of(trainer)
    details["micro_batch_mean"] = said
    _note(details, "micro-batch mean term: mean of micro-batch means")
    advice = ("if the model's own loss takes num_items_in_batch (a causal LM's does), say so with "
              f"{envvalues.HAND_COUNT}=1 (zerofix then hands it the window's count and keeps it only for steps whose "
              "loss is divided by it) or set model_accepts_loss_kwargs = True on the trainer once it is built; or make "
              "that term a sum divided by the window's count (the Trainer's num_items_in_batch)") if withheld else \
        "make that term a sum divided by the window's count (the Trainer's num_items_in_batch)"
    _warn_main(trainer, "zerofix: %s's loss %s. For the window's mean: %s, or train with gradient_accumulation_steps=1 "
               "and the same total batch.%s", type(trainer).__name__, said, advice, tail)


def _count_withheld_by_trainer(trainer, model) -> bool:
    """Whether the trainer's ``model_accepts_loss_kwargs`` is False against the Trainer's own reading of the model
    (the model declares loss kwargs), with no ``compute_loss_func``: the Trainer then never hands the model's loss the
    count. zerofix follows the setting (a run may want micro-batch means) and its micro-batch-mean WARNING names it
    (where the base compute_loss ran: the loss is the model's own); only ``ZEROFIX_HAND_COUNT_TO_MODEL=1`` has the count
    handed (count_never_handed)."""
    if getattr(trainer, "model_accepts_loss_kwargs", True) is not False:
        return False
    if getattr(trainer, "compute_loss_func", None) is not None:
        return False
    try:
        return _trainer_guess(_unwrapped(trainer, model))
    except Exception:  # noqa: BLE001 - an exotic model: no claim
        return False


def _across_ranks(records: list, world: int) -> list:
    """This window's records of every rank, in rank order (this rank's alone on one process)."""
    import torch.distributed as dist

    if world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return records
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return [record for rank in gathered for record in rank]


def _means_said(step: TrainerStep, term: str, rescaled, coincided, no_count: str) -> tuple[str, str]:
    """What the WARNING of a micro-batch mean term says of the update (after "zerofix: <Trainer>'s loss "), by what this
    run does to it: upstream's scaling, zerofix's rescale of an unstated mean (held for the first window and said here,
    or said already), or a statement's. ``no_count``: why the term gets no count."""
    state = step.state
    plan = step.plan if step.plan is not None else scaling.Plan()
    means = (f"so with gradient accumulation the update averages micro-batch means where one batch of the window's size "
             f"takes one mean; {no_count}")
    if rescaled is None and not plan.changes:  # upstream's own scaling: a mean of the micro-batch means
        said = f"averages a term over its own micro-batch ({term}), {means}, and that mean of means stays as upstream " \
               "computes it"
        return (f"{coincided}. It also {said}" if coincided is not None else said), ""  # one WARNING for both
    factor = f"{float(1 / decision.update_factor(step.call, plan)):g}" if rescaled is None else f"{rescaled[1]:g}"
    gave = f"(the Trainer's own path gave {factor}x that)"
    if rescaled is not None:  # zerofix's scaling of a micro-batch mean: the mean of the micro-batch means
        return (f"is independent of num_items_in_batch and averages a term over its own micro-batch ({term}): "
                f"{rescaled[0]}, so the update averages micro-batch means {gave} where one batch of the window's size "
                f"takes one mean; {no_count}"), " " + _IF_ALREADY_DIVIDED
    if _user_statement(state) is None and not state.stated:  # rescaled unstated, said when the first window ended
        return (f"averages a term over its own micro-batch ({term}): zerofix scales it as a micro-batch mean (said "
                f"above), {means} {gave}"), " " + _IF_ALREADY_DIVIDED
    return (f"averages a term over its own micro-batch ({term}); as stated by {_statement_source(state)}, zerofix "
            f"scales it as {'a micro-batch mean' if step.call.loss_is_mean else 'per accumulation window'} and the "
            f"update averages micro-batch means {gave} where one batch of the window's size takes one mean; "
            f"{no_count}"), ""


def _statement_source(state: Known) -> str:
    """Who said what the loss is, in words: the user's statement (the API or the environment), else the trainer's or
    the model's own attributes."""
    if state.statement is not None:
        return f"zerofix.loss_is_scaled_for_ga(trainer, {state.statement})"
    if state.env_statement is not None:
        return f"{decision.STATEMENT}={int(state.env_statement)}"
    return "the trainer's or the model's own attributes (loss_is_scaled_for_ga, accepts_loss_kwargs)"


def _stop_reading_means(step: TrainerStep) -> None:
    """The reading ends without a micro-batch mean to say: a warning held for it is said now."""
    _release_held(step)
    step.state.means = None


def _release_held(step: TrainerStep) -> None:
    """The warnings held for the first window's end (a rescale, a coincidence), said alone now, once."""
    state = step.state
    held, coincided = state.rescale_said, state.coincidence_said
    state.rescale_said = state.coincidence_said = None
    if held is not None:
        _say_rescaled(step.trainer, held[0])
    if coincided is not None:
        _warn_main(step.trainer, "zerofix: %s's loss %s", type(step.trainer).__name__, coincided)


def _last_scalings(loss, depth: int = 2) -> tuple:
    """The constants the last ``depth`` operations of ``loss`` multiply it by, the last one first (``loss / 4`` is
    ``0.25``, ``loss * 2`` is ``2.0``): a Python number or a one-element tensor with no gradient, which is what
    ``loss / gas`` and the Trainer's ``loss *= num_processes`` save. The reading stops at any other operation.
    ``zerofix.decision`` reads a division by exactly the accumulation steps from them (a coincidence, issue 58)."""
    found, node = [], getattr(loss, "grad_fn", None)
    while node is not None and len(found) < depth:
        kind = type(node).__name__
        if kind.startswith("DivBackward"):
            value, invert = num_items_watch.constant_value(getattr(node, "_saved_other", None)), True
        elif kind.startswith("MulBackward"):
            value = num_items_watch.constant_value(getattr(node, "_saved_other", None))
            if value is None:
                value = num_items_watch.constant_value(getattr(node, "_saved_self", None))
            invert = False
        else:
            break
        if value is None or (invert and value == 0):
            break
        found.append(1.0 / value if invert else value)
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None  # a constant operand has no node: one input left
    return tuple(found)


def _decide(accelerator, step: TrainerStep, verdict, loss, kwargs) -> decision.Decision:
    """This backward's ``zerofix.decision.Decision``, computed once per distinct set of facts of a trainer: the facts
    change at a short window and when the verdict changes, not from step to step (a step then costs a few attribute
    reads and the loss's last two graph nodes)."""
    trainer, state = step.trainer, step.state
    stated = _stated_once(trainer)
    statement = _user_statement(state)
    state_now = _state_of(verdict)
    # the last scalings matter only to an independent loss nobody stated (decision.coincidence): read only there
    read = state_now == num_items_watch.INDEPENDENT and not stated and statement is None
    evidence = decision.Evidence(
        verdict=state_now, stated=stated, statement=statement,
        factor=verdict.factor if state_now == num_items_watch.DIVIDED else None,
        scalings=_last_scalings(loss) if read else (), handed=step.handed)
    key = (getattr(trainer, "model_accepts_loss_kwargs", None), getattr(trainer, "compute_loss_func", None) is None,
           getattr(trainer, "loss_is_scaled_for_ga", None), step.num_items is None, step.base_ran, state.window,
           evidence, kwargs.get("scale_wrt_gas", True), accelerator.gradient_accumulation_steps,
           trainer.args.gradient_accumulation_steps)
    if key not in state.plans:
        engine = decision.Engine(base_ran=step.base_ran,
                                 deepspeed=accelerator.distributed_type == DistributedType.DEEPSPEED,
                                 scale_wrt_gas=bool(kwargs.get("scale_wrt_gas", True)),
                                 accelerate_steps=int(accelerator.gradient_accumulation_steps))
        state.plans[key] = decision.decide(release(), _facts(accelerator, step), evidence, engine)
    return state.plans[key]


def _say_coincidence(step: TrainerStep, decided: decision.Decision) -> None:
    """Once a run: a loss that shows a value equal to the accumulation steps (``zerofix.decision``). Said at WARNING
    where reading it as the user's word would have changed the plan (zerofix follows upstream), and for a division by
    both the count and the steps; otherwise only recorded (the runtime details)."""
    state = step.state
    if "coincidence" in state.warned:
        return
    state.warned.add("coincidence")
    gas = int(step.trainer.args.gradient_accumulation_steps)
    details = _details_of(step.trainer)
    read = decision.reading(decided.coincidence, gas)
    if not decided.held and decided.coincidence != decision.DIVIDED_BY_STEPS:
        details["scaled_for_ga"] = f"{read}; read as the user's word or not, zerofix's plan is the same"
        return  # nothing to decide
    details["scaled_for_ga"] = (f"{read}; the count already covers the window (the warning above says more)"
                                if decided.coincidence == decision.DIVIDED_BY_STEPS else
                                f"{read}: a coincidence, not a statement, so the update is the Trainer's own (the "
                                "warning above names the statement that decides)")
    _note(details, "coincidence: " + ("upstream followed" if decided.held else "said"))
    said = decision.coincidence_message(decided, gas)
    if state.means is not None:  # the first window's means are being read: one WARNING at its end says both
        state.coincidence_said = said
        return
    _warn_main(step.trainer, "zerofix: %s's loss %s", type(step.trainer).__name__, said)


# accelerator -> its trainer, while the trainer's loop fetches windows (get_batch_samples): a backward of that
# accelerator outside any training_step this entry saw is a step it does not cover
_training = WeakIdentityMap()
NOT_SEEN = ("not covered: this trainer's training_step does not reach Trainer.training_step (an override without "
            "super()), so zerofix never sees its steps; the Trainer's own scaling runs unchanged")


def _unseen(accelerator) -> None:
    """A backward of a training trainer's accelerator outside the steps this entry sees: said once per trainer, in the
    log and in the runtime details (``zerofix status``), so no log claims a fix this run does not get."""
    ref = _training.get(accelerator) if accelerator is not None else None
    trainer = ref() if ref is not None else None
    if trainer is None:
        return
    state = known(trainer)
    if state.path is not None and not state.path.covered:
        return  # stood aside on this path, and said so already
    _details_of(trainer)["covered"] = NOT_SEEN
    if "unseen" not in state.warned:
        state.warned.add("unseen")
        _warn_main(trainer, "zerofix: %s %s", FIX_ID, NOT_SEEN)


def loss_is_scaled_for_ga(trainer, value: bool = True) -> None:
    """The user's statement of what ``trainer``'s loss is: True, already per accumulation window (divided by
    gradient_accumulation_steps or normalised by the window's count: the Trainer's own path is followed as for a
    normalised loss); False, a micro-batch mean. It wins over the measurement; ``None`` withdraws it."""
    state = known(trainer)
    state.statement = None if value is None else bool(value)
    state.stated, state.plans = None, {}
