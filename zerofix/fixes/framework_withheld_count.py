"""A framework's trainer that withholds the count from every model: ``axolotl-withheld-count`` and
``llamafactory-processor-withheld-count`` (issue 67).

axolotl 0.17.0 - 0.19.x (``AxolotlTrainer.__init__``) set ``model_accepts_loss_kwargs = False`` wherever the backbone's
``forward`` does not name ``num_items_in_batch``: every transformers model, whose forward takes it in ``**kwargs``. Its
comment says only the logged loss changes; the update becomes a mean of micro-batch means (SFT cosine 0.75 to the big
batch). axolotl PR #3982 reported it, and 0.20.0 reads the loss function's signature instead. LLaMA-Factory (0.9.3 -
0.9.5 and its main branch: ``CustomSeq2SeqTrainer`` and ``CustomTrainer``, its SFT and PT trainers) sets it False
whenever a processor is present (#7448, for transformers 4.49's vision-language heads that ignored the count); its open
PR #10454 calls the result the mean of means bug.

The wrappers only record, after the framework's own ``__init__`` ran, that the framework's code left the flag False
(``zerofix.framework_flags``). What that means is ``zerofix.decision.framework_word``'s rule, and what is done is the
Trainer entry's (``transformers-trainer-scaling``): it has the Trainer count and hand the model the window's count, and
keeps it only for steps whose loss is divided by it, as it does for a head whose class withholds the count. So the
update is what the framework's fixed release gives: the window's token mean where the model's loss takes the count, and
upstream's own step, run again, where it does not (DPO-style and classifier losses).

Ambiguity list (docs/fixes.md), each usage with the test that shows it left alone:
- a flag the user's own script or plain Trainer subclass sets: no framework ``__init__`` ran, nothing is recorded, and
  the Trainer entry follows it and says so (tests/test_micro_means.py);
- a subclass of the framework's trainer from outside the framework whose own ``__init__`` runs around the framework's:
  it may set the flag too, which cannot be told from a flag the framework set, so it is followed and said, naming
  both (tests/test_framework_flags.py);
- the framework's RL trainers (axolotl's are TRL's; LLaMA-Factory's DPO, KTO and reward trainers set the flag for
  losses that are not token means): not wrapped, upstream's update bitwise (tests/test_frameworks_axolotl.py,
  tests/test_frameworks_llamafactory.py);
- a model whose loss is not divided by the handed count (a classifier, a forward computing its own mean): the Trainer
  entry's per-step check runs that micro-batch again as upstream does and hands nothing more (tests/test_micro_means.py);
- a model whose class already says ``accepts_loss_kwargs = False`` (Qwen2.5-VL under LLaMA-Factory): the Trainer entry
  hands it the count for its own class's reason; the framework's flag changes nothing there
  (tests/test_frameworks_llamafactory.py).
"""
from __future__ import annotations

from zerofix import framework_flags, versions
from zerofix.fixes.contract import Check, drifted, found

AXOLOTL = "axolotl-withheld-count"
LLAMAFACTORY = "llamafactory-processor-withheld-count"
FIX_IDS = (AXOLOTL, LLAMAFACTORY)
_DISTS = {AXOLOTL: "axolotl", LLAMAFACTORY: "llamafactory"}


def structural_check(fix_id: str, targets) -> Check:
    """The wrapped ``__init__`` methods exist as functions (the flag itself is read after they ran, not from them)."""
    if fix_id not in FIX_IDS:
        raise KeyError(fix_id)
    for name, value in targets.items():
        if not callable(value):
            return drifted(f"{name} is not callable")
    return found()


def axolotl_init(wrapped, trainer, args, kwargs):
    return _init(AXOLOTL, wrapped, trainer, args, kwargs)


def llamafactory_init(wrapped, trainer, args, kwargs):
    return _init(LLAMAFACTORY, wrapped, trainer, args, kwargs)


def _init(fix_id: str, wrapped, trainer, args, kwargs):
    result = wrapped(*args, **kwargs)
    # a nested call (a framework subclass whose own __init__ is wrapped too) records once, at the innermost
    if getattr(trainer, "model_accepts_loss_kwargs", None) is False and framework_flags.of(trainer) is None:
        owner = _owner(type(trainer), wrapped)
        setter = f"{getattr(owner, '__qualname__', type(trainer).__qualname__)}.__init__"
        release = f"{_DISTS[fix_id]} {versions.installed_version(_DISTS[fix_id])}"
        framework_flags.record(trainer, framework_flags.FrameworkFlag(fix_id, setter, release,
                                                                      _around(type(trainer), owner)))
    return result


def _owner(cls, wrapped):
    """The class whose ``__init__`` ``wrapped`` is (the framework's)."""
    qualname, module = getattr(wrapped, "__qualname__", ""), getattr(wrapped, "__module__", "")
    for klass in cls.__mro__:
        if f"{klass.__qualname__}.__init__" == qualname and klass.__module__ == module:
            return klass
    return None


def _around(cls, owner) -> str | None:
    """The first class below ``owner`` with an ``__init__`` of its own that is not the framework's code (a user's
    subclass, which runs after the framework's and may set the flag itself), or None."""
    if owner is None:
        return None
    package = owner.__module__.split(".")[0]
    for klass in cls.__mro__:
        if klass is owner:
            return None
        if "__init__" in vars(klass) and klass.__module__.split(".")[0] != package:
            return f"{klass.__qualname__}.__init__"
    return None


def acted_in(fix_id: str, trainer_state) -> str | None:
    """What was done in the run whose ``trainer.state`` this is, where a trainer of it carried this entry's flag: the
    count handed to the model's loss, and for how many backwards it was kept (the Trainer entry's details)."""
    from zerofix.fixes import trainer_scaling

    details = trainer_scaling.run_details(trainer_state)
    if not details or details.get("framework_flag") != fix_id:
        return None
    return trainer_scaling.framework_flag_line(details)


def reset_runtime() -> None:
    framework_flags.clear()
