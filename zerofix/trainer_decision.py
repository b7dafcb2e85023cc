"""The Trainer entry's decisions for one run of one trainer, as one object asked once per event (issue 68): at the run's
start (whether zerofix hands the count to a head the Trainer withholds it from, and why), at each window and step
(whether the count goes on, and to whom), at each backward (the ``scaling.Plan``, a run of the micro-batch again or not,
the window's micro-batch means while they are read, and what to say). Like ``zerofix.counter``: plain state and the rules
of ``zerofix.decision``, no torch; the entry (``zerofix.fixes.trainer_scaling``) reads and applies, the words are
``zerofix.trainer_words``.

Tests: tests/test_decision.py, through the public methods.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, NamedTuple

from zerofix import scaling, trainer_words as words
from zerofix.decision import (DIVIDED, DIVIDED_BY_STEPS, INDEPENDENT, UNKNOWN, Decision, Engine, Evidence, RunFacts,
                              StatementFacts, coincidence_message, decide, handed_head, reads_coincidences, stated)

MEANS_WINDOWS = 64  # windows of equal counts the micro-batch-mean reading reads before it gives up (one graph walk a
# micro-batch while it reads: tests/benchmarks)
__all__ = ["TrainerDecision", "Said", "StepPlan", "Reading", "Answer", "RunFacts", "MEANS_WINDOWS"]


class Said(NamedTuple):
    """A line to log: ``level`` "info" (every rank), "info-main" or "warning" (the main process only)."""

    level: str
    text: str


class StepPlan(NamedTuple):
    drop_count: bool  # the window was counted only for a handing that stopped within it: the Trainer's none goes on
    watch: bool  # the count is watched (every step where one is handed, but to a compiled model)
    to_head: bool  # zerofix has the Trainer hand the count to a head it withholds it from
    to_loss: bool  # the count the Trainer hands reaches a loss function the forward calls without it (issue 69)


def _nothing(*args):
    return ()


class Reading(NamedTuple):
    """What the entry read at one backward, and the readings the decision asks for only where it needs them (the
    statements of the trainer's attributes, the loss's last scalings, its micro-batch means, the ranks' records)."""

    verdict: str | None  # num_items_watch's state, None where no count was handed
    route: str = ""  # for UNKNOWN: what the watch saw that it cannot follow
    factor: Fraction | None = None
    to_head: bool = False  # zerofix had the Trainer hand the count to a head it withholds it from
    injected: str | None = None  # the model class whose loss function zerofix handed the count (issue 69), or None
    own_loss: bool = False  # the loss reaching the backward is the one the base Trainer.compute_loss returned
    facts: scaling.TrainerFacts | None = None
    engine: Engine | None = None
    key: tuple = ()  # the trainer's attributes the plan depends on (a plan is computed once per distinct key)
    at: int = 1  # the optimizer step under way
    statement_facts: Callable = lambda: None  # () -> StatementFacts, read once a run (``stated``)
    scalings: Callable = _nothing  # () -> the loss's last scalings, read only for an independent loss nobody stated
    means: Callable = lambda: None  # () -> micro_means of the loss (None: not readable)
    # a window's records -> (outcome, the means whose count changed): every rank's compared (a collective on 2+
    # ranks; micro_means.outcome: "differ", "equal" or "none")
    compare: Callable = lambda records: ("none", [])
    withheld: Callable = lambda: None  # () -> who withheld the count from the model's own loss, in words, or None


class Answer(NamedTuple):
    decided: Decision | None  # None where the step runs again (``redo``)
    redo: bool = False  # no backward of this loss: the micro-batch runs again as the Trainer runs it
    said: tuple = ()  # Said lines


class TrainerDecision:
    """One trainer's run (a ``train()``): the run's policy state, asked once per event (module docstring).

    ``trainer``: its class name; ``statement``: the user's word through ``zerofix.loss_is_scaled_for_ga`` (kept across
    runs by the entry, handed to each run's object); ``env_statement``: ``ZEROFIX_LOSS_IS_SCALED_FOR_GA`` read at the
    run's start; ``register(details)``: called once with the run's runtime-details dict when it is made."""

    def __init__(self, version, trainer: str = "Trainer", *, statement=None, env_statement=None,
                 register: Callable = lambda d: None):
        self.version, self.trainer = tuple(version), trainer
        self.statement, self.env_statement = statement, env_statement
        self._register = register
        self.details: dict | None = None
        self.handed_head: str | None = None  # the model class zerofix hands the count to, while it does
        self.window_for_head = False  # the current window was counted only because zerofix hands the count
        self.to_loss: bool | None = None  # issue 69: None undecided, True handing to the loss function, False not
        self.stated_cache: bool | None = None
        self.plans: dict = {}
        self.warned: set = set()
        self.unreached: str | None = None  # the head handed the count whose loss did not take it (its own mean)
        self.own_mean = None  # (head, proven): whether its inline mean was proven at its last micro-batch
        self.means: list | None = []  # this window's micro_means records while they are read (None: done)
        self.means_windows = 0
        self.held_rescale = None  # (the rescale words, upstream's factor), held for the first window's means
        self.held_coincidence: str | None = None  # the coincidence WARNING's words, held the same way
        self.last: Decision | None = None  # the last backward's decision (the means' words read it)

    # --- statements and the record
    def user_statement(self) -> bool | None:
        """The user's statement: the API's, else the environment's."""
        return self.statement if self.statement is not None else self.env_statement

    def stated(self, facts: Callable[[], StatementFacts]) -> bool:
        """``stated`` once a run (``facts`` read only then: ``inspect.signature`` costs microseconds a step)."""
        if self.stated_cache is None:
            self.stated_cache = stated(facts(), user=self.user_statement() is not None, head_handed=bool(self.handed_head))
        return self.stated_cache

    def restate(self, statement) -> None:
        """The user's statement changed (``zerofix.loss_is_scaled_for_ga``): plans and ``stated`` are read again."""
        self.statement, self.stated_cache, self.plans = statement, None, {}

    def run_details(self) -> dict:
        """The run's runtime-details entry, made when it first has something to say."""
        if self.details is None:
            self.details = {"trainer": self.trainer, "loss": "not measured", "stated": False, "backwards": 0,
                            "corrected": 0, "steps_divided": 0, "steps_independent": 0, "steps_unknown": 0}
            self._register(self.details)
        return self.details

    def note(self, warning: str) -> None:
        if warning not in self.run_details().setdefault("warnings", []):
            self.details["warnings"].append(warning)

    # --- a run's start
    def local_batch(self, facts: RunFacts) -> tuple:
        """A loss normalised over the local batch by definition (TRL's GRPO ``bnpo``): said once a run, whatever the
        path, never changed."""
        if not facts.local_batch:
            return ()
        loss_type, message = facts.local_batch
        self.run_details()["local_batch_loss"] = message
        self.note(f"loss_type {loss_type}: mean of micro-batch token means (documented)")
        return (Said("warning", f"zerofix: {self.trainer} {message}"),)

    def start(self, facts: RunFacts) -> tuple:
        """The run's start: whether zerofix hands the count to a head the Trainer withholds it from (``handed_head``), and
        what is said (Said lines)."""
        said = []
        user = self.user_statement()
        self.handed_head = handed_head(facts, user) if facts.covered and not facts.compiled else None
        if self.handed_head:
            details = self.run_details()
            details["count_handed"] = self.handed_head
            if facts.flagged:
                whose = words.whose_flag_class(self.handed_head)
            elif not facts.hand_count and facts.framework is not None:
                details["framework_flag"], details["framework_setter"] = facts.framework.fix_id, facts.framework.setter
                whose = words.whose_flag_framework(facts.framework, self.handed_head, facts.framework_fix)
            else:
                whose = words.whose_flag_user(self.trainer, self.handed_head)
            # said at INFO: whether anything changes is known only once the first loss is measured (``backward``)
            said.append(Said("info", words.handing(whose)))
        elif facts.covered and facts.flagged and not facts.smoother_takes_count and not facts.loss_func \
                and not facts.trainer_statement and user is None:  # a smoother that takes no count: said (issue 51)
            self.note("label smoothing: mean of micro-batch means")
            said.append(Said("warning", words.smoothed_never_handed(facts.flagged)))
        return tuple(said)

    # --- a window, a step
    def count_window(self) -> bool:
        """A window is counted: whether the Trainer must count it for a head zerofix hands the count to."""
        self.window_for_head = bool(self.handed_head)
        return self.window_for_head

    def step(self, count_given: bool, compiled: bool) -> StepPlan:
        """A step: the count the Trainer passes goes on (not where the window was counted only for a handing that
        stopped within it), watched (but under torch.compile), handed to a withheld head, or to a loss function its
        forward calls without it (until a step shows the forward passes it itself)."""
        drop = count_given and self.window_for_head and not self.handed_head
        given = count_given and not drop
        watch = given and not compiled
        to_head = bool(self.handed_head) and given
        return StepPlan(drop, watch, to_head, not to_head and watch and self.to_loss is not False)

    def stepped(self, plan: StepPlan, dropped: bool) -> None:
        """After a step: a forward that called no loss function without the count (it hands it on itself) needs nothing
        this run."""
        if plan.to_loss and not dropped and self.to_loss is None:
            self.to_loss = False

    # --- a backward
    def backward(self, reading: Reading) -> Answer:
        """One backward, asked once: the plan, a run of the micro-batch again or not, and what to say (the window's
        micro-batch means included, while they are read)."""
        stated_ = self.stated(reading.statement_facts)
        details = self.run_details()
        details["stated"] = stated_
        statement = self.user_statement()
        if statement is not None:
            details["statement"] = words.statement_source(self.statement, self.env_statement) + (
                " (per accumulation window)" if statement else " (a micro-batch mean)")
        if reading.verdict is not None:
            details["steps_" + reading.verdict] += 1
            details["loss"] = "unknown" if reading.verdict == UNKNOWN and statement is not None else \
                words.VERDICT_SAID[reading.verdict]
            if reading.route:
                details["route"] = reading.route
        details["backwards"] += 1
        said, changed = [], False
        if reading.to_head or reading.injected:
            kept, lines = self._kept_by_head(reading) if reading.to_head else self._kept_by_loss(reading)
            said += lines
            if not kept:
                return Answer(None, redo=True, said=tuple(said))
            changed = True  # this backward differs from upstream's: its loss was divided by the handed count
        decided = self._decide(reading, stated_, statement)
        self.last = decided
        if decided.coincidence is not None:
            said += self._coincidence(decided, reading.facts.gas)
        if reading.verdict == UNKNOWN and not stated_ and statement is None and "unknown" not in self.warned:
            self.warned.add("unknown")  # once a run: nobody stated what the loss is, and zerofix follows upstream
            self.note("unknown verdict: upstream's path followed")
            said.append(Said("warning", words.unknown(self.trainer, reading.route, not decided.call.loss_is_mean)))
        if decided.plan.changes and "rescaled" not in self.warned and decided.call.loss_is_mean and not stated_:
            # once a run: zerofix scales as a micro-batch mean a loss nobody stated to be one (a user's compute_loss
            # may have divided it already, which no measurement can tell)
            self.warned.add("rescaled")
            self.note("rescaled as a mean, unstated")
            rescale = words.rescale(decided.call.window)
            if self.means is not None:  # the first window's means are read: one WARNING at its end says both
                factor = scaling.applied_factor(decided.call, decided.plan, against=scaling.UPSTREAM)
                self.held_rescale = (rescale, float(1 / factor))  # upstream's update / zerofix's
            else:
                said.append(Said("warning", words.rescaled(self.trainer, rescale)))
        if self.means is not None:  # after the plan: what the reading says depends on what this run does
            said += self._read_means(reading)
        if decided.plan.changes or changed:  # once a backward, whatever changed it
            details["corrected"] += 1
        return Answer(decided, said=tuple(said))

    def _kept_by_head(self, reading: Reading) -> tuple[bool, list]:
        """A step zerofix handed the count to a head the Trainer withholds it from: kept where the loss is divided by
        it; otherwise (its own mean, or what it does cannot be told) the step runs again as the Trainer runs it and no
        later step is handed the count (issue 51, item 2). Said at WARNING only where the run keeps a mean of means it
        may not mean (unknown); a loss independent of the count is upstream's and said at INFO."""
        details = self.details
        details["steps_handed"] = details.get("steps_handed", 0) + 1
        if reading.verdict == DIVIDED:
            return True, []
        name, self.handed_head, self.plans, self.stated_cache = self.handed_head, None, {}, None
        details["count_handed"] = words.handed_stopped_details(name, reading.at)
        self.unreached = name
        details["count_handed_verdict"] = reading.verdict if reading.verdict is not None else UNKNOWN
        if reading.verdict == INDEPENDENT:  # a head computing its own mean (Gemma 3's), a classifier: the means reading
            # says at WARNING whether the update averages token means of uneven counts
            return False, [Said("info", words.handed_independent(name, reading.at))]
        return False, [Said("warning", words.handed_unknown(name, reading.at, reading.route or "not measured"))]

    def _kept_by_loss(self, reading: Reading) -> tuple[bool, list]:
        """A step whose forward got the Trainer's count and called its loss function without it, handed it by zerofix
        (issue 69): kept where the loss is divided by it and is the model's own as the Trainer passes it on, said once at
        INFO; otherwise the step runs again as the Trainer runs it and nothing more is handed this run. A trainer's
        ``compute_loss`` that changes the model's loss (divides a classifier's mean by the accumulation steps, the
        hand fix of #47688) may rely on what the model returned without the count: handing it there would change that
        right usage, so the handing stays only where nothing but the Trainer stands between the loss and the
        backward."""
        name = reading.injected
        if reading.verdict == DIVIDED and reading.own_loss:
            if self.to_loss is None:
                self.to_loss = True
                self.details["count_to_loss"] = name
                return True, [Said("info-main", words.to_loss_kept(name))]
            return True, []
        self.to_loss, self.plans = False, {}
        self.details["count_to_loss"] = words.to_loss_stopped_details(name, reading.at)
        why = reading.verdict or UNKNOWN if reading.verdict != DIVIDED else \
            "the loss that reaches the backward is not the model's own: the trainer's compute_loss changed it"
        return False, [Said("info", words.to_loss_stopped(name, reading.at, why))]

    def _decide(self, reading: Reading, stated_: bool, statement) -> Decision:
        """The plan, computed once per distinct set of facts of a run: the facts change at a short window and when the
        verdict changes, not from step to step (a step then costs a few attribute reads)."""
        # the last scalings matter only to an independent loss nobody stated (``coincidence``): read only there
        read = reading.verdict == INDEPENDENT and reads_coincidences(stated_, statement, False)
        evidence = Evidence(verdict=reading.verdict, stated=stated_, statement=statement,
                            factor=reading.factor if reading.verdict == DIVIDED else None,
                            scalings=reading.scalings() if read else (), handed=reading.to_head)
        key = (reading.key, evidence)
        if key not in self.plans:
            self.plans[key] = decide(self.version, reading.facts, evidence, reading.engine)
        return self.plans[key]

    def _coincidence(self, decided: Decision, gas: int) -> list:
        """Once a run: a loss that shows a value equal to the accumulation steps. Said at WARNING where reading it as
        the user's word would have changed the plan (the update is upstream's), and for a division by both the count
        and the steps; otherwise only recorded (the runtime details)."""
        if "coincidence" in self.warned:
            return []
        self.warned.add("coincidence")
        read = words.reading(decided.coincidence, gas)
        steps = decided.coincidence == DIVIDED_BY_STEPS
        self.details["scaled_for_ga"] = words.coincidence_details(read, held=decided.held, steps=steps)
        if not decided.held and not steps:
            return []  # nothing to decide
        self.note("coincidence: " + ("upstream followed" if decided.held else "said"))
        said = coincidence_message(decided, gas)
        if self.means is not None:  # the first window's means are read: one WARNING at its end says both
            self.held_coincidence = said
            return []
        return [Said("warning", words.loss(self.trainer, said))]

    # --- the window's micro-batch means (issues 53 and 59)
    def _read_means(self, reading: Reading) -> list:
        """The means the loss takes over its own micro-batch, read window by window (only where it does not take the
        count and zerofix hands the model none); at a window's end, every rank's records compared (``outcome``)."""
        facts, world = reading.facts, reading.facts.processes
        readable = facts.gas * world > 1 and not reading.to_head and not self.handed_head and \
            reading.verdict in (None, INDEPENDENT)
        if not readable and world == 1:
            return list(self.stop_means())
        # not readable on several processes: this micro-batch concludes nothing, but every rank reaches the comparison
        self.means.append(reading.means() if readable else None)
        if len(self.means) < facts.window:
            return []
        found, changed = reading.compare(self.means)
        withheld = reading.withheld() if self.names_withheld(reading.engine.base_ran) else None
        return list(self.means_outcome(found, changed, world=world, withheld=withheld))

    def means_outcome(self, found: str, changed: list, *, world: int, withheld: str | None) -> tuple:
        """A complete window's outcome (``micro_means.outcome`` over every rank: "differ", "equal" or "none") and what
        is said (Said lines). A window of equal counts concludes nothing (a later one may differ: issue 59), so the
        reading goes on up to MEANS_WINDOWS windows. ``withheld``: who withheld the count from the model's own loss
        (``trainer_words.withheld_who...``), or None."""
        self.means_windows += 1
        if found == "equal" and self.means_windows < MEANS_WINDOWS:
            self.means = []
            return self._say_held()  # the first window's held warnings are said alone; the reading goes on
        if found != "differ":
            return self.stop_means()
        rescaled, coincided = self.held_rescale, self.held_coincidence
        self.means = self.held_rescale = self.held_coincidence = None
        kind, counts = changed[0]
        where = "the first window's" if self.means_windows == 1 else f"window {self.means_windows}'s"
        said, tail = self._means_said(words.mean_term(kind, counts, where, world), rescaled, coincided,
                                      words.NO_COUNT_WITHHELD if withheld else words.NO_COUNT)
        if self.unreached:  # issue 59: the head whose own mean it is, which no count reaches, named
            said = words.means_unreached(self.unreached, self.own_mean == (self.unreached, False), said)
        if withheld:  # issue 60: the trainer's own flag (axolotl's, a user's), followed and said with the setting
            said = words.means_withheld(withheld, said)
        self.run_details()["micro_batch_mean"] = said
        self.note("micro-batch mean term: mean of micro-batch means")
        advice = words.MEANS_ADVICE_WITHHELD if withheld else words.MEANS_ADVICE
        return (Said("warning", words.means(self.trainer, said, advice, tail)),)

    def names_withheld(self, base_ran: bool) -> bool:
        """Whether the means' words may name a trainer's withheld count: the base compute_loss ran (the term is the
        model's own loss) and no head zerofix handed the count computes it."""
        return not self.unreached and base_ran

    def _means_said(self, term: str, rescaled, coincided, no_count: str) -> tuple[str, str]:
        """What the WARNING of a micro-batch mean term says of the update, by what this run does to it: upstream's
        scaling, zerofix's rescale of an unstated mean (held for the first window and said here, or said already), or a
        statement's."""
        decided = self.last
        plan = decided.plan if decided is not None else scaling.Plan()
        if rescaled is None and not plan.changes:  # upstream's own scaling: a mean of the micro-batch means
            said = words.means_upstream(term, no_count)
            return (f"{coincided}. It also {said}" if coincided is not None else said), ""  # one WARNING for both
        factor = float(1 / scaling.applied_factor(decided.call, plan, against=scaling.UPSTREAM)) if rescaled is None \
            else rescaled[1]
        gave, tail = words.gave(factor), " " + words.IF_ALREADY_DIVIDED
        if rescaled is not None:  # zerofix's scaling of a micro-batch mean: the mean of the micro-batch means
            return words.means_rescaled_now(term, rescaled[0], gave, no_count), tail
        if self.user_statement() is None and not self.stated_cache:  # rescaled unstated, said when the first window ended
            return words.means_rescaled_before(term, gave, no_count), tail
        return words.means_stated(term, words.statement_source(self.statement, self.env_statement),
                                  decided.call.loss_is_mean, gave, no_count), ""

    def stop_means(self) -> tuple:
        """The reading ends without a micro-batch mean to say: a warning held for it is said now."""
        said = self._say_held()
        self.means = None
        return said

    def _say_held(self) -> tuple:
        """The warnings held for the first window's end (a rescale, a coincidence), said alone now, once."""
        held, coincided = self.held_rescale, self.held_coincidence
        self.held_rescale = self.held_coincidence = None
        out = []
        if held is not None:
            out.append(Said("warning", words.rescaled(self.trainer, held[0])))
        if coincided is not None:
            out.append(Said("warning", words.loss(self.trainer, coincided)))
        return tuple(out)

    # --- what the handed count's proof of an inline mean says (issue 59)
    def own_mean_proven(self, name: str, tokens: str | None) -> tuple:
        """A head's inline mean proven (``tokens``: what its count counts) or not (None) at a micro-batch: the first
        proof of a run is said at INFO; a failed one is kept for the means' words."""
        self.own_mean = (name, tokens is not None)
        if tokens is None:
            return ()
        details = self.run_details()
        if "own_mean" in details:
            return ()
        details["own_mean"] = words.own_mean_details(name, tokens)
        return (Said("info-main", words.own_mean(name, tokens)),)
