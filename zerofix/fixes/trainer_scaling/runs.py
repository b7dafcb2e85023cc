"""What the Trainer entry keeps beside each trainer, never on it (a weak identity map): the user's statement, which
outlives a run, and the run under way, whose facts are read again at every ``train()`` (a new ``trainer.state``:
``model_init`` builds a new model) and whose decisions are one ``zerofix.trainer_decision.TrainerDecision``."""
from __future__ import annotations

from zerofix import envvalues, paths, trainer_decision
from zerofix.fixes.trainer_scaling import reading
from zerofix.identity import WeakIdentityMap


class TrainerRecord:
    """One trainer: ``statement`` (``zerofix.loss_is_scaled_for_ga(trainer, value)``), and of its current run the
    ``trainer.state`` it belongs to, its path, whether its model is compiled, the window the Trainer fetched last, and
    the run's decision object."""

    __slots__ = ("statement", "run", "path", "compiled", "window", "even", "decision", "verdict")

    def __init__(self):
        self.statement = None
        self.run = None  # trainer.state of the run below (a new one at every train())
        self.path = None  # paths.Path of this run
        self.compiled = False  # the model runs under torch.compile: not watched (the belief stands)
        self.window = None  # micro-batches of the current window, as get_batch_samples fetched them
        self.even = False  # every micro-batch of the current window counts the same labels (reading.even_window)
        self.decision: trainer_decision.TrainerDecision | None = None
        self.verdict = None  # the last step's num_items_watch.Verdict (None: none yet)

    @property
    def stated(self) -> bool | None:
        """Whether someone stated what the loss is, as the run's decision read it (None: not read yet)."""
        return self.decision.stated_cache if self.decision is not None else None

    @property
    def handed_head(self) -> str | None:
        """The model class zerofix has the Trainer hand the count to in this run, while it does (None: none)."""
        return self.decision.handed_head if self.decision is not None else None


_records = WeakIdentityMap()  # trainer -> TrainerRecord (by identity: a trainer need not hash)
details: list[dict] = []  # runtime_details(), one per run of a trainer, in order (plain dicts: no reference to it)


def record_of(trainer) -> TrainerRecord:
    record = _records.get(trainer)
    if record is None:
        record = _records[trainer] = TrainerRecord()
    return record


def new_run(trainer, record: TrainerRecord, model) -> bool:
    """At the first step of a ``train()`` (a new ``trainer.state``): a new decision object and the facts read again,
    so no fact outlives the run it was read in. True where the run is new."""
    run = getattr(trainer, "state", None)
    if record.run is run and run is not None:
        return False
    record.run = run
    record.path = paths.trainer_path(trainer)
    record.compiled = reading.compiled(trainer, model)
    record.decision = trainer_decision.TrainerDecision(
        reading.release(), type(trainer).__name__, statement=record.statement, env_statement=envvalues.loss_statement(),
        register=details.append)
    return True


def run_details_of(trainer_state) -> dict | None:
    """The runtime details of the run whose ``trainer.state`` this is (a copy), or None."""
    for record in list(_records.values()):
        if record.run is trainer_state and record.decision is not None and record.decision.details is not None:
            return dict(record.decision.details)
    return None
