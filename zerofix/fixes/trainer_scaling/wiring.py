"""The Trainer entry's wrappers: they read a step (``reading``), ask the run's
``zerofix.trainer_decision.TrainerDecision`` once per event, and carry out its answer (the count handed or dropped, the
loss scaled, a micro-batch run again, a line logged). What is decided is the decision's; what is said is
``zerofix.trainer_words``.

- ``training_step`` opens a step on the trainer's accelerator and hands the Trainer a *watched*
  ``num_items_in_batch`` (``zerofix.num_items_watch``) at every step; where the decision says so, the count goes to a
  head the Trainer withholds it from (``handing.Handing``) or to the loss function a forward calls without it
  (``handing.CountToLoss``), and a step the decision runs again starts from the random state and buffers it started
  from (``zerofix.replay``);
- ``compute_loss`` (the base Trainer's) records that it ran, so its multiplication by the number of processes is known
  to have happened;
- ``get_batch_samples`` records the window's real length (and counts a window for a handed head);
- ``backward`` (Accelerator.backward) takes this step's verdict, hands the engine the plain loss and the decision's
  plan: a second division switched off (accelerate's divisor 1, ``scale_wrt_gas=False``: what upstream's own fixes do)
  and the rest put on the loss; a backward outside any step of a training trainer is said "not covered".
"""
from __future__ import annotations

import logging
import weakref

from accelerate.utils import DistributedType  # imported by the fixes only, once accelerate is

from zerofix import (decision, micro_means, num_items_watch, paths, replay, trainer_decision, trainer_report,
                     trainer_words as words)
from zerofix.fixes.trainer_scaling import means, reading, runs
from zerofix.fixes.trainer_scaling.handing import CountToLoss, Handing
from zerofix.identity import WeakIdentityMap

FIX_ID = words.FIX_ID
STEP = "_zerofix_trainer_step"  # in accelerator.__dict__ while a Trainer step runs
_log = logging.getLogger("zerofix")


class TrainerStep:
    """One ``training_step`` under way, on ``accelerator.__dict__[STEP]``: what the wrappers read of it, and what the
    sibling entry of the MoE router term reads (``aux``, ``accounted``, ``call``, ``plan``, ``trainer``)."""

    __slots__ = ("trainer", "record", "num_items", "watching", "base_ran", "base_loss", "handled", "aux", "accounted",
                 "call", "plan", "to_head", "redo", "to_loss", "counter")

    def __init__(self, trainer, num_items, watching, record):
        self.trainer, self.num_items, self.watching, self.record = trainer, num_items, watching, record
        self.base_ran = False  # the base Trainer.compute_loss ran (and multiplied by the processes if it does)
        self.base_loss = None  # the loss it returned (the model's own, as the Trainer passes it on)
        self.handled = False
        self.aux = None  # (auxiliary loss, coefficient) of an MoE model: transformers-moe-aux-loss
        self.accounted = None  # tensor -> bool: an undivided term of the loss that entry weights (its router term)
        self.call = self.plan = None  # this step's scaling.Call and Plan, once backward has them
        self.to_head = False  # zerofix had the Trainer hand the model the count (a withheld head)
        self.redo = False  # a handed step whose loss is not divided by the count: run again as the Trainer runs it
        self.to_loss = False  # CountToLoss armed for a count the Trainer itself hands the model (issue 69)
        self.counter = None  # this step's CountToLoss


def current_step(accelerator) -> TrainerStep | None:
    """The Trainer step under way on ``accelerator``, or None."""
    return accelerator.__dict__.get(STEP) if accelerator is not None else None


def warn_main(trainer, msg: str, *args) -> None:
    """A warning on the main process only (every rank takes the same decision)."""
    accelerator = getattr(trainer, "accelerator", None)
    if getattr(accelerator, "is_main_process", True):
        _log.warning(msg, *args)


def _say(trainer, said) -> None:
    """Log the decision's lines: INFO on every rank, or on the main process only; WARNING on the main process."""
    main = getattr(getattr(trainer, "accelerator", None), "is_main_process", True)
    for line in said:
        if line.level == "info":
            _log.info("%s", line.text)
        elif main:
            (_log.info if line.level == "info-main" else _log.warning)("%s", line.text)


def _start_run(trainer, record: runs.TrainerRecord, model) -> None:
    if not runs.new_run(trainer, record, model):
        return
    facts = reading.run_facts(trainer, model, record.path, record.compiled)
    _say(trainer, record.decision.local_batch(facts))
    trainer_report.ensure_on(trainer)  # a framework that replaced DEFAULT_CALLBACKS (ms-swift) still hears of zerofix
    if not record.path.covered and paths.stood_aside(FIX_ID, record.path):  # the Trainer's log line: trainer_report
        _log.info("%s", words.stood_aside(record.path))
    _say(trainer, record.decision.start(facts))


def training_step(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or STEP in accelerator.__dict__:  # a nested call
        return wrapped(*args, **kwargs)
    record = runs.record_of(trainer)
    _start_run(trainer, record, args[0] if args else getattr(trainer, "model", None))
    if not record.path.covered:
        return wrapped(*args, **kwargs)
    decided = record.decision
    num_items = reading.num_items_arg(args, kwargs)
    plan = decided.step(num_items is not None, record.compiled)
    if plan.drop_count:  # the window was counted only for a handing that stopped within it: the Trainer passes none
        num_items, (args, kwargs) = None, reading.with_num_items(args, kwargs, None)
    plain = args, kwargs
    # Every step is watched (the cost: the few operations on the count, tests/benchmarks): the verdict is this step's,
    # so a loss that starts reading the count later, or a new model, is seen as it is.
    if plan.watch:
        args, kwargs = reading.with_num_items(args, kwargs, num_items_watch.watch(
            num_items_watch.as_tensor_like_release(num_items)))
    step = accelerator.__dict__[STEP] = TrainerStep(trainer, num_items, plan.watch, record)
    step.to_head, step.to_loss = plan.to_head, plan.to_loss
    model = plain[0][0] if plain[0] else plain[1].get("model")
    armed = step.to_head or step.to_loss
    before = replay.Snapshot(model) if armed else None
    try:
        outer = reading.unwrapped(trainer, model) if armed else None
        # a forward that drops the count in a window whose micro-batches all count alike is left as it is: its mean,
        # scaled by the window, is its share of the window's mean already (bitwise upstream's where that is right)
        step.counter = CountToLoss(reading.unwrap_peft(outer) if armed else None,
                                   proven=_own_mean_said(trainer, decided) if step.to_head else None, called=outer,
                                   inject=step.to_head or not record.even)
        with Handing(trainer, step.to_head), step.counter:
            result = num_items_watch.unwatched(wrapped(*args, **kwargs))  # the Trainer's running loss stays plain
    finally:
        accelerator.__dict__.pop(STEP, None)
        if plan.watch:
            num_items_watch.close()  # whatever the step kept (a buffer, a running sum, a copy) is plain again
    decided.stepped(plan, step.counter.dropped)
    if not step.redo:
        return result
    before.restore()  # the step as the Trainer runs it, from where the handed one started
    if step.to_head:
        return training_step(wrapped, trainer, *reading.with_num_items(*plain, None))
    return training_step(wrapped, trainer, *plain)  # with the count, no longer handed to the loss function


def _own_mean_said(trainer, decided):
    """What ``CountToLoss`` proved of a head's inline mean at each micro-batch (``zerofix.own_mean``), for the run's
    decision to say."""
    def proven(name: str, proof) -> None:
        _say(trainer, decided.own_mean_proven(name, proof.tokens if proof is not None else None))

    return proven


def compute_loss(wrapped, trainer, args, kwargs):
    step = current_step(getattr(trainer, "accelerator", None))
    result = wrapped(*args, **kwargs)
    if step is not None and step.trainer is trainer:
        step.base_ran = True
        step.base_loss = result[0] if isinstance(result, tuple) else result
    return result


def get_batch_samples(wrapped, trainer, args, kwargs):
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        try:
            _training[accelerator] = weakref.ref(trainer)  # a strong one would keep both alive (trainer.accelerator)
        except TypeError:  # not weak-referenceable: no report of unseen steps
            pass
    record = runs.record_of(trainer)
    _start_run(trainer, record, getattr(trainer, "model", None))
    with Handing(trainer, record.decision.count_window()):  # the Trainer counts the window only for a head it hands
        result = wrapped(*args, **kwargs)
    try:
        record.window = len(result[0])
    except (TypeError, IndexError):
        pass
    # where a forward may call its loss function without the count (still asked: issue 69), whether handing it would
    # change anything in this window
    record.even = record.decision.to_loss is not False and reading.even_window(
        result[0], result[1], world=int(getattr(accelerator, "num_processes", 1) or 1),
        across=bool(getattr(getattr(trainer, "args", None), "average_tokens_across_devices", False))) \
        if isinstance(result, tuple) and len(result) == 2 and result[1] is not None else False
    return result


def _verdict(step: TrainerStep, loss):
    if step.watching:
        return num_items_watch.decide(loss, accounted=step.accounted or (lambda tensor: False))
    if step.num_items is None:
        return None  # no count handed: nothing can have normalised the loss (scaling.call_of)
    return num_items_watch.Verdict(num_items_watch.UNKNOWN, "the count was handed to torch.compile, which the "
                                   "watch cannot follow")


def backward(wrapped, accelerator, args, kwargs):
    step = current_step(accelerator)
    if step is None:
        _unseen(accelerator)
        return wrapped(*args, **kwargs)
    if step.handled:  # a second backward in the same step
        return wrapped(*args, **kwargs)
    step.handled = True
    trainer, record = step.trainer, step.record
    decided = record.decision
    loss = args[0] if args else kwargs["loss"]
    verdict = _verdict(step, loss)
    record.verdict = verdict
    loss = num_items_watch.unwatched(loss)  # the engine gets a plain tensor: bitwise the same value and graph
    state = verdict.state if verdict is not None else None
    injected = step.to_loss and step.counter is not None and step.counter.injected
    world = int(accelerator.num_processes)
    answer = decided.backward(trainer_decision.Reading(
        verdict=state, route=verdict.route if verdict is not None else "",
        factor=verdict.factor if verdict is not None else None,
        to_head=step.to_head, injected=type(step.counter.model).__name__ if injected else None,
        own_loss=injected and loss is step.base_loss,
        facts=reading.trainer_facts(accelerator, trainer, step.num_items, record.window),
        engine=decision.Engine(base_ran=step.base_ran,
                               deepspeed=accelerator.distributed_type == DistributedType.DEEPSPEED,
                               scale_wrt_gas=bool(kwargs.get("scale_wrt_gas", True)),
                               accelerate_steps=int(accelerator.gradient_accumulation_steps)),
        key=(getattr(trainer, "model_accepts_loss_kwargs", None), getattr(trainer, "compute_loss_func", None) is None,
             getattr(trainer, "loss_is_scaled_for_ga", None), step.num_items is None, step.base_ran, record.window,
             kwargs.get("scale_wrt_gas", True), accelerator.gradient_accumulation_steps,
             trainer.args.gradient_accumulation_steps),
        at=getattr(getattr(trainer, "state", None), "global_step", 0) + 1,
        statement_facts=lambda: reading.statement_facts(trainer), scalings=lambda: reading.last_scalings(loss),
        means=lambda: micro_means.micro_means(loss), compare=lambda records: means.compare(records, world),
        withheld=lambda: means.withheld(trainer)))
    _say(trainer, answer.said)
    if answer.redo:  # no backward of a loss the handed count changed: training_step runs the micro-batch again
        step.redo = True  # (and the run again, no longer handed, is what the micro-batch-mean reading reads)
        return None
    plan = answer.decided.plan
    step.call, step.plan = answer.decided.call, plan
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


# accelerator -> its trainer, while the trainer's loop fetches windows (get_batch_samples): a backward of that
# accelerator outside any training_step this entry saw is a step it does not cover
_training = WeakIdentityMap()


def _unseen(accelerator) -> None:
    """A backward of a training trainer's accelerator outside the steps this entry sees: said once per trainer, in the
    log and in the runtime details (``zerofix status``), so no log claims a fix this run does not get."""
    ref = _training.get(accelerator) if accelerator is not None else None
    trainer = ref() if ref is not None else None
    if trainer is None:
        return
    record = runs.record_of(trainer)
    if record.path is not None and not record.path.covered:
        return  # stood aside on this path, and said so already
    decided = record.decision
    if decided is None:
        return
    decided.run_details()["covered"] = words.NOT_SEEN
    if "unseen" not in decided.warned:
        decided.warned.add("unseen")
        warn_main(trainer, "%s", words.unseen())
