"""The shared micro-step counter: one per training engine (or accelerator), pure Python.

It answers the one question DeepSpeed answers wrongly for manual accumulation: *is this step() the end
of an accumulation window, and which micro-batches does it close?* DeepSpeed decides the boundary when
each backward starts, from its own schedule (``(micro_steps + 1) % gradient_accumulation_steps``) or
from an explicit ``set_gradient_accumulation_boundary``; a loop that calls backward N times and then
step() once cannot be described that way. That decision is made here, from counts alone, so it is
unit-tested without a distributed run.

Do no harm: the counter takes over (LAZY: every backward runs as non-boundary, the window is reduced at
step() or at the first gradient read) only where no right usage produces what it observes. That is a
second backward before a step(), with no boundary flag, outside ``no_sync()`` / ``coalesce_grad_reduction()``,
on an engine where DeepSpeed discards the earlier backwards by itself: ZeRO-1/2 at config GAS=1 (from
deepspeed 0.17.6, or with optimizer offload); the caller says which engines (``may_take_over``). Everything
else is followed (FOLLOW: run as DeepSpeed schedules it, step() passes through):

- one backward per step(): DeepSpeed's own style, at any config GAS;
- several backwards per step() at config GAS > 1: DeepSpeed's own style with several backwards per
  micro-batch (two losses, ``retain_graph=True``, a micro-batch fed in halves) looks exactly like a manual
  loop whose step() DeepSpeed skips; the counter cannot tell them apart, so it follows and the caller warns
  (``ambiguous_step``);
- a window with a backward inside ``no_sync()`` or ``coalesce_grad_reduction()`` (the user reduces through
  DeepSpeed's own API), or flagged with ``set_gradient_accumulation_boundary`` (the user decides);
- ZeRO-0/3, and ZeRO-1/2 before 0.17.6, at config GAS=1: they accumulate several backwards by themselves.

``zero_grad()`` ends the window without an update (the user discarded its gradients): the next backward
starts afresh, and must show a second backward before a step() again before the counter takes over.

The first window of a manual loop has run its first backward as DeepSpeed's boundary (config GAS=1)
before the counter could know. That backward's reduction is kept: the counter reports ``reduced`` and
the next lazy backward asks the caller to carry what was reduced into the window's final reduction.
The same holds after a gradient read reduced the window early and the loop then went on accumulating.

Vocabulary: a *window* is the set of micro-batches whose gradients one optimizer update applies;
``since_step`` counts backwards since the last step() call (DeepSpeed's own style calls step() after
every backward, so a window may span several step() calls); ``pending`` counts micro-batches not yet
applied by an update; ``unreduced`` counts lazy backwards whose gradients no reduction has seen yet.
"""
from __future__ import annotations

from typing import NamedTuple

# step() actions
PASS = "pass"  # let step() run as DeepSpeed would: nothing to add
FLUSH = "flush"  # close the window: reduce what a boundary backward would have, then step
STEP = "step"  # close the window whose reduction already ran (a gradient read): set the boundary, step

# backward() modes
FOLLOW = "follow"  # run as DeepSpeed's schedule or the user's flag says (DeepSpeed's own behaviour)
LAZY = "lazy"  # run as non-boundary: zerofix reduces the window at step() or at the first read


class StepPlan(NamedTuple):
    action: str  # PASS, FLUSH or STEP
    micro_batches: int  # micro-batches the window closes (0 when the step applies nothing new)
    reason: str


class BackwardPlan(NamedTuple):
    mode: str  # FOLLOW or LAZY
    carry: bool  # LAZY after a reduction of the same window: keep what was reduced for the next flush


class MicroStepCounter:
    """Counts one engine's micro-steps and plans its backward() and step() calls.

    ``may_take_over``: several unflagged backwards per step() on this engine can only be manual
    accumulation that DeepSpeed gets wrong (ZeRO-1/2 at config GAS=1 where each boundary replaces the
    reduced gradient); False for every engine where a right usage looks the same, or where DeepSpeed
    accumulates by itself."""

    __slots__ = ("may_take_over", "manual", "since_step", "pending", "unreduced", "reduced", "owned",
                 "boundary_in_window", "windows", "flushes", "read_flushes", "steps", "backwards",
                 "zero_grads")

    def __init__(self, may_take_over: bool = True) -> None:
        self.may_take_over = may_take_over
        self.manual = False  # a second backward before a step() was seen: zerofix finds the boundaries
        self.since_step = 0  # backward() calls since the last step() (or zero_grad())
        self.pending = 0  # micro-batches whose gradients no update has applied yet
        self.unreduced = 0  # lazy backwards since the window's last reduction
        self.reduced = False  # the engine holds this window's reduced gradients (a boundary ran)
        self.owned = False  # the window went through no_sync() / coalesce_grad_reduction(): the user's
        self.boundary_in_window = False  # a backward of this window already ran as an explicit boundary
        self.windows = 0  # windows closed by an update
        self.flushes = 0  # of which zerofix reduced (at step() or at a read)
        self.read_flushes = 0  # reductions a gradient read asked for before step()
        self.steps = 0
        self.backwards = 0
        self.zero_grads = 0  # windows ended by zero_grad() without an update

    # ------------------------------------------------------------------ events
    def plan_backward(self, *, explicit_boundary: bool | None, upstream_api: bool = False) -> BackwardPlan:
        """Before a backward runs: FOLLOW DeepSpeed, or run it LAZY (non-boundary). ``upstream_api``: the
        backward runs inside ``no_sync()`` or ``coalesce_grad_reduction()``."""
        if upstream_api:
            self.owned = True  # the user reduces this window through DeepSpeed's own API
        if explicit_boundary is not None or self.owned or not self.may_take_over:
            return BackwardPlan(FOLLOW, False)
        if not self.manual and self.since_step >= 1:
            self.manual = True  # several backwards per step(): DeepSpeed's schedule cannot describe it
        if not self.manual:
            return BackwardPlan(FOLLOW, False)
        return BackwardPlan(LAZY, self.reduced)

    def backward(self, *, explicit_boundary: bool | None, mode: str = FOLLOW, boundary: bool = False) -> bool:
        """Record a finished backward. ``explicit_boundary``: what the user set with
        ``set_gradient_accumulation_boundary`` for it (None: nothing); ``mode``: how it ran;
        ``boundary``: whether DeepSpeed ran it as a boundary (reduced the window). Returns True when an
        explicit boundary backward of the same window came before it: DeepSpeed ZeRO-1/2 has then already
        consumed the earlier gradients and will discard them (the user's flags contradict the loop)."""
        discarding = self.boundary_in_window
        self.backwards += 1
        self.since_step += 1
        self.pending += 1
        if explicit_boundary:
            self.boundary_in_window = True
        if mode == LAZY:
            self.unreduced += 1
            self.reduced = False  # what was reduced is carried by the caller, the engine's copy goes
        elif boundary:
            self.reduced = True
        return discarding

    def plan_step(self, *, explicit_boundary: bool | None, schedule_boundary: bool) -> StepPlan:
        """Decide what a step() call does. ``explicit_boundary``: the user's flag now;
        ``schedule_boundary``: whether DeepSpeed's own micro-step schedule puts a boundary here."""
        if explicit_boundary is not None:
            return StepPlan(PASS, self.pending if explicit_boundary else 0,
                            "the user set the boundary explicitly")
        if self.pending == 0:
            return StepPlan(PASS, 0, "no backward since the last update")
        if not self.manual or self.owned:
            return StepPlan(PASS, self.pending if schedule_boundary else 0, "DeepSpeed's own schedule")
        if self.unreduced == 0:
            return StepPlan(STEP, self.pending, "a gradient read reduced the window already")
        return StepPlan(FLUSH, self.pending, f"{self.since_step} backwards before this step()")

    def ambiguous_step(self, *, explicit_boundary: bool | None, schedule_boundary: bool) -> bool:
        """Whether this step() follows several unflagged backwards that DeepSpeed's schedule does not close
        (config GAS > 1): a manual loop whose update DeepSpeed skips, or DeepSpeed's own style with several
        backwards per micro-batch. Nothing here can tell which; the caller warns and follows."""
        return (explicit_boundary is None and not schedule_boundary and not self.owned and not self.manual
                and self.since_step >= 2)

    def flushed_for_read(self) -> None:
        """A gradient read made zerofix reduce the window before step()."""
        self.unreduced = 0
        self.reduced = True
        self.read_flushes += 1

    def stepped(self, plan: StepPlan) -> None:
        """Record that step() ran as planned."""
        self.steps += 1
        self.since_step = 0
        if plan.micro_batches:
            self.windows += 1
            self.flushes += plan.action in (FLUSH, STEP)
            self._new_window()

    def zero_grad(self) -> None:
        """The user discarded the window's gradients (``engine.zero_grad()``): a new window, followed until
        it shows a second backward before a step() again. The caller reduced any lazy backwards first, so
        the engine holds what DeepSpeed's own boundaries would have left."""
        if self.pending:
            self.zero_grads += 1
        self.since_step = 0
        self.manual = False
        self._new_window()

    def _new_window(self) -> None:
        self.pending = 0
        self.unreduced = 0
        self.reduced = False
        self.owned = False
        self.boundary_in_window = False

    # ------------------------------------------------------------------ questions
    def needs_read_flush(self) -> bool:
        """Whether a gradient read now would see un-reduced (per-rank, partial) gradients."""
        return self.unreduced > 0

    def as_dict(self) -> dict:
        return {"mode": "manual" if self.manual else "follow", "backwards": self.backwards,
                "steps": self.steps, "windows": self.windows, "flushed": self.flushes,
                "read_flushes": self.read_flushes, "pending": self.pending, "zero_grads": self.zero_grads}
