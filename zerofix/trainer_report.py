"""zerofix visible in a Trainer run: while zerofix is patched, every ``transformers.Trainer`` gets a
``ZerofixCallback`` (through ``transformers.trainer.DEFAULT_CALLBACKS``, the list the Trainer starts its
callbacks from, so it reaches Trainers built by TRL and by user code alike). On the main process only, and
through transformers' logger (so ``log_level`` / ``log_level_replica`` and the run's log handlers apply):

- at the start of training, once: which fixes act on this run's path (the Trainer's own, DeepSpeed's when it
  trains through DeepSpeed, TRL's when TRL is in use), on which releases, and the others applied in the process;
- after the first optimizer step, once per DeepSpeed engine: whether zerofix's accumulation fix took it over,
  and why; and per trainer what the Trainer entry decided: the count handed to a head the Trainer never hands it,
  a step it never sees ("not covered"), an unknown verdict and its route;
- at the end: every warning zerofix's wrappers issued (a window shorter than the config's GAS, a checkpoint
  in the middle of a window), each once (the wrappers themselves already warned when it happened).

The callback only reads zerofix's status: it changes no control flag, metric or log entry of the run. Users
who call ``zerofix.patch()`` after building their Trainer add it themselves:
``from zerofix.trainer_report import callback; trainer.add_callback(callback())``.

Importing this module imports nothing; transformers is imported when a Trainer module is.
"""
from __future__ import annotations

_TRAINER_MODULE = "transformers.trainer"
_class = None  # ZerofixCallback, built on first use (it subclasses transformers' TrainerCallback)
_registered = False
_status = None  # zerofix.patching.status, handed over by register() (this module imports no zerofix module)


def callback():
    """A new ZerofixCallback instance."""
    return callback_class()()


def callback_class():
    global _class
    if _class is None:
        _class = _build_class()
    return _class


def register(status) -> None:
    """Add the callback to every Trainer built from now on (now if transformers.trainer is imported, else when
    it is). ``status``: the function that returns zerofix's status records. Idempotent."""
    global _registered, _status
    _status = status
    if _registered:
        return
    _registered = True
    from zerofix import importhooks

    importhooks.when_imported(_TRAINER_MODULE, _add)


def ensure_on(trainer) -> None:
    """Give ``trainer`` a ZerofixCallback if it has none, at its first step: a framework that replaces
    ``transformers.trainer.DEFAULT_CALLBACKS`` at start-up (ms-swift) drops the one ``register`` added, and its runs
    would otherwise say nothing of zerofix. The start-of-training lines are said then, once (the callback only
    reads)."""
    handler = getattr(trainer, "callback_handler", None)
    if not _registered or handler is None:
        return
    if any(isinstance(cb, callback_class()) for cb in getattr(handler, "callbacks", ())):
        return
    added = callback()
    handler.add_callback(added)
    try:
        added.on_train_begin(trainer.args, trainer.state, trainer.control, model=getattr(trainer, "model", None))
    except Exception:  # noqa: BLE001 - a report must never stop a run
        pass


def unregister() -> None:
    """Trainers built from now on get no callback (DEFAULT_CALLBACKS as transformers defined it)."""
    global _registered
    _registered = False
    import sys

    module = sys.modules.get(_TRAINER_MODULE)
    defaults = getattr(module, "DEFAULT_CALLBACKS", None)
    if isinstance(defaults, list) and _class is not None and _class in defaults:
        defaults.remove(_class)


def _add(module) -> None:
    if not _registered:  # unregistered before transformers.trainer was imported
        return
    defaults = getattr(module, "DEFAULT_CALLBACKS", None)
    if isinstance(defaults, list) and callback_class() not in defaults:
        defaults.append(callback_class())


def acts_in(record, *, deepspeed: bool, trl: bool) -> bool:
    """Whether an applied fix concerns a Trainer run: the Trainer's own entries always; DeepSpeed's and accelerate's
    only when the run goes through DeepSpeed (accelerate's entries concern its DeepSpeed path or a plain loop);
    TRL's when TRL is in use."""
    if record.dist == "transformers":
        return True
    if record.dist in ("deepspeed", "accelerate"):
        return deepspeed
    if record.dist == "trl":
        return trl
    return True


def summary_lines(records, *, deepspeed: bool = True, trl: bool = True, path=None) -> list[str]:
    """What zerofix does in this Trainer run, from ``_records()`` records (pure: unit-tested): the applied fixes
    that act on this run's path, then the others applied in the process, only as installed. ``path``: the run's
    ``zerofix.paths.Path``; on one no fix models, the Trainer's entry stands aside and the first line says so."""
    if not records:
        return ["zerofix is not patched in this process (ZEROFIX=1 or zerofix.patch()): it changes nothing here"]
    applied = [r for r in records if r.state == "applied"]
    failed = [r for r in records if r.state in ("failed", "target-changed")]
    broken = (f"; {len(failed)} fix(es) in range could not be applied: " + "; ".join(
        f"{r.id} {'failed' if r.state == 'failed' else 'found its target changed'} ({r.reason})" for r in failed)
        if failed else "")
    if not applied:
        # issue 69: a fix that failed (wrapt missing from a --no-deps install) is said as failed, never as out of range
        return [f"zerofix is active, but no fix is applied, so it changes nothing in this run{broken}" if failed else
                "zerofix is active; no fix applies to the installed releases, so it changes nothing in this run"]
    # a switch (the chunked loss) decides per model at the first step, and an entry that acts only where the run uses
    # what it fixes (an MoE router loss, TRL's own GRPO loss) is named once a step did: said then (switch_lines,
    # used_lines), never here
    later = _switch_ids() | set(_used())
    acting = [r for r in applied if acts_in(r, deepspeed=deepspeed, trl=trl) and r.id not in later]
    aside = [r for r in acting if path is not None and _stands_aside(r, path)]
    acting = [r for r in acting if r not in aside]
    rest = [r for r in applied if r not in acting and r not in aside and r.id not in later]
    names = ", ".join(f"{r.id} ({r.dist} {r.installed})" for r in acting) or "none"
    where = "this run (through DeepSpeed)" if deepspeed else "this run (no DeepSpeed)"
    if path is not None and path.covered and path.name.startswith("FSDP"):
        where = f"this run (through {path.name})"
    own = {"transformers": "the Trainer's own scaling", "deepspeed": "DeepSpeed's own accumulation",
           "accelerate": "accelerate's own code"}
    lines = [f"zerofix: {r.id} stands aside on this run, {path}: {own.get(r.dist, 'upstream')} runs unchanged"
             for r in aside]
    lines.append(f"zerofix: {len(acting)} fix{'' if len(acting) == 1 else 'es'} act{'s' if len(acting) == 1 else ''} "
                 f"on {where}: {names}")
    if rest:
        lines.append(f"zerofix: also applied in this process, for paths this run does not take: "
                     f"{', '.join(r.id for r in rest)}")
    if failed:
        lines.append(f"zerofix: not applied in this process{broken}")
    return lines


def _stands_aside(record, path) -> bool:
    from zerofix import paths  # a plain module (no ML library)

    return paths.stands_aside(record.id, record.dist, path)


def engine_lines(records, seen: set) -> list[str]:
    """One line per DeepSpeed engine not reported yet (``seen`` holds the reported ones and is updated)."""
    lines = []
    for record in records:
        for engine in record.runtime or ():
            key = (record.id, engine.get("engine"))
            if "engine" not in engine or key in seen:
                continue
            seen.add(key)
            taken = "takes over its accumulation boundaries" if engine.get("active") else "leaves it to DeepSpeed"
            lines.append(f"zerofix: {record.id} {taken} on the DeepSpeed engine {engine['engine']} "
                         f"(ZeRO-{engine.get('zero_stage')}): {engine.get('why')}")
    return lines


def verdict_lines(records, seen: set) -> list[str]:
    """What transformers-trainer-scaling decided, once each (``seen`` is updated): the count handed to a head whose
    Trainer never hands it (issue 47; said only where it changed something or could not be proven), steps it never
    sees ("not covered"), an unknown verdict and why, a loss read as already scaled for accumulation (issue 51), and
    once per run after its first step what it did to its backwards. The callback hands it its own run's records only
    (``own_run``)."""
    lines = []
    for record in records:
        for trainer in record.runtime or ():
            if "trainer" not in trainer or "steps_unknown" not in trainer:
                continue
            name = trainer["trainer"]
            statement = trainer.get("statement")  # the user's, which decides over the verdict
            said = {
                "count_handed": lambda v: (f"zerofix: {record.id} on {name}: the count handed to {v}" if "stopped" in v
                                           else f"zerofix: {record.id} acts on {name} because the Trainer never "
                                           f"hands num_items_in_batch to {v}"),
                "count_to_loss": lambda v: (f"zerofix: {record.id} on {name}: the count handed to {v}" if "stopped" in v
                                            else f"zerofix: {record.id} acts on {name} because {v}'s forward calls its "
                                            "loss function without num_items_in_batch: zerofix hands it the count"),
                "covered": lambda v: f"zerofix: {record.id} on {name}: {v}",
                "route": lambda v: f"zerofix: {record.id} on {name}: the verdict is unknown ({v}); "
                                   + (f"the statement {statement} decides how it is scaled" if statement else
                                      "the Trainer's own scaling runs unchanged"),
                "scaled_for_ga": lambda v: f"zerofix: {record.id} on {name}: the loss {v}",
            }
            summary = (record.id, name, "summary")
            if summary not in seen and trainer.get("backwards"):
                seen.add(summary)  # once per run, after its first step: the trainer and what zerofix did to its steps
                changed = trainer.get("corrected", 0)
                lines.append(f"zerofix: {record.id} on {name}: the loss is {trainer.get('loss', 'not measured')}; "
                             + (f"as the statement {statement} says, " if statement else "")
                             + (f"zerofix changed {changed} of its first {trainer['backwards']} backwards" if changed
                                else f"its first {trainer['backwards']} backwards ran as the Trainer runs them"))
            for key, line in said.items():
                value = trainer.get(key)
                if key == "count_handed" and trainer.get("count_handed_verdict") == "independent":
                    continue  # a classifier, a masked LM: handed once, upstream's run, nothing to say
                if value and (record.id, name, key, value) not in seen:
                    seen.add((record.id, name, key, value))
                    lines.append(line(value))
    return lines


def _switch_ids() -> set:
    from zerofix import catalogue  # imports no ML library

    return {f.id for f in catalogue.FIXES if f.switch}


def _used() -> dict:
    """The catalogue's entries that act only where a run uses what they fix (``Fix.acts_when``), by id."""
    from zerofix import catalogue  # imports no ML library

    return {f.id: f for f in catalogue.FIXES if f.acts_when}


def used_lines(records, state, seen: set) -> list[str]:
    """An applied entry that acts only where a run uses what it fixes (``Fix.acts_when``), once it did in the run
    whose TrainerState ``state`` is: what it did there, from its implementation's ``acted_in`` (issue 58, item 3)."""
    import sys

    used, lines = _used(), []
    for record in records:
        fix = used.get(record.id)
        if record.state != "applied" or fix is None or record.id in seen:
            continue
        acted_in = getattr(sys.modules.get(fix.implementation), "acted_in", None)
        try:
            did = acted_in(record.id, state) if acted_in is not None else None
        except Exception:  # noqa: BLE001 - a report must never stop a run
            did = None
        if did:
            seen.add(record.id)
            lines.append(f"zerofix: {record.id} acts on this run ({record.dist} {record.installed}): {did}")
    return lines


def switch_lines(records, seen: set) -> list[str]:
    """What a switch decided (the chunked loss: per model and batch form, issue 52), once each, once it knows: routed,
    or keeping the model's own loss and why, or standing aside for a trainer and why."""
    switches, lines = _switch_ids(), []
    for record in records:
        if record.id not in switches:
            continue
        for entry in record.runtime or ():
            key = (record.id, entry.get("model"), entry.get("trainer"), entry.get("why"), entry.get("routed"))
            if key in seen:
                continue
            seen.add(key)
            if entry.get("model") and entry.get("routed"):
                lines.append(f"zerofix: {record.id} routes {entry['model']}'s training loss without the full logits "
                             f"({entry.get('why')})")
            elif entry.get("model"):
                lines.append(f"zerofix: {record.id}: {entry['model']} keeps its own loss (full logits): "
                             f"{entry.get('why')}")
            else:
                lines.append(f"zerofix: {record.id} stands aside"
                             + (f" for {entry['trainer']}" if entry.get("trainer") else "") + f": {entry.get('why')}")
    return lines


def warning_lines(records, seen: set) -> list[str]:
    lines = []
    for record in records:
        for engine in record.runtime or ():
            for key in engine.get("warnings") or ():
                if (record.id, key) not in seen:
                    seen.add((record.id, key))
                    lines.append(f"zerofix: {record.id} warned during training: {key} (the warning above says more)")
    return lines


def _run_path(args, model):
    """The run's path (zerofix.paths), read from accelerate's shared state without constructing one."""
    import types

    from accelerate.state import AcceleratorState

    from zerofix import paths

    try:
        n_gpu = int(args.n_gpu)
    except Exception:  # noqa: BLE001 - arguments without a device set-up: one device
        n_gpu = 1
    return paths.accelerate_path(types.SimpleNamespace(**AcceleratorState._shared_state), model=model, n_gpu=n_gpu)


def own_run(records, state) -> list:
    """``records`` with transformers-trainer-scaling's runtime details narrowed to the run whose TrainerState
    ``state`` is (issue 51, item 5: a notebook's second Trainer of a class does not repeat the first one's account);
    ``state`` None: with none of them (what every other entry's records hold)."""
    import sys

    module = sys.modules.get("zerofix.fixes.trainer_scaling")
    found = getattr(module, "run_details", None)
    if found is None:
        return records
    mine = None if state is None else found(state)
    return [r._replace(runtime=() if mine is None else (mine,)) if r.id == module.FIX_ID else r for r in records]


def _records():
    return [] if _status is None else _status()  # None: zerofix.patch() never ran in this process


def _build_class():
    from transformers import TrainerCallback
    from transformers.utils import logging

    logger = logging.get_logger("transformers.zerofix")

    class ZerofixCallback(TrainerCallback):
        """Logs, once and on the main process, what zerofix does in this Trainer run (see
        ``zerofix.trainer_report``). Reads only; returns no control changes."""

        def __init__(self):
            self._run = None  # the TrainerState of the run being reported (a new one at every train())
            self._stepped = False
            self._engines: set = set()
            self._warnings: set = set()
            self._verdicts: set = set()
            self._switches: set = set()
            self._used: set = set()

        def _begin(self, state) -> bool:
            """A new run (issue 58, item 3: each run's log is its own): what earlier runs' engines, warnings and
            switch decisions said is theirs, so it is marked seen, never repeated here. False for the run already
            begun (ensure_on may call on_train_begin after the Trainer did)."""
            if self._run is state:
                return False
            self._run, self._stepped, self._verdicts, self._used = state, False, set(), set()
            self._engines, self._warnings, self._switches = set(), set(), set()
            records = own_run(_records(), None)
            engine_lines(records, self._engines)
            warning_lines(records, self._warnings)
            switch_lines(records, self._switches)
            return True

        def _lines(self, state, *, end: bool) -> list[str]:
            records = _records()
            mine = own_run(records, state)
            return (engine_lines(records, self._engines) + verdict_lines(mine, self._verdicts)
                    + used_lines(records, state, self._used) + switch_lines(records, self._switches)
                    + (warning_lines(mine, self._warnings) if end else []))

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero and self._begin(state):
                import sys

                deepspeed = bool(getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None))
                for line in summary_lines(_records(), deepspeed=deepspeed, trl="trl" in sys.modules,
                                          path=_run_path(args, kwargs.get("model"))):
                    logger.warning(line)

        def on_step_end(self, args, state, control, **kwargs):
            # after the first optimizer step only: the engines exist and the DeepSpeed fix has decided
            if state.is_world_process_zero and not self._stepped:
                self._stepped = True
                for line in self._lines(state, end=False):
                    logger.warning(line)

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                for line in self._lines(state, end=True):
                    logger.warning(line)

    ZerofixCallback.__module__ = __name__
    return ZerofixCallback
