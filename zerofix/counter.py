"""The shared micro-step counter: one per training engine (or accelerator), pure Python.

It answers the one question DeepSpeed answers wrongly for manual accumulation: *is this step() the end
of an accumulation window, and which micro-batches does it close?* DeepSpeed decides the boundary when
each backward starts, from its own schedule (``(micro_steps + 1) % gradient_accumulation_steps``) or
from an explicit ``set_gradient_accumulation_boundary``; a loop that calls backward N times and then
step() once cannot be described that way. zerofix marks every backward non-boundary and decides at
step(), where the window's real length is known: that decision is made here, from counts alone, so it is
unit-tested without a distributed run.

Vocabulary: a *window* is the set of micro-batches whose gradients one optimizer update applies;
``since_step`` counts backwards since the last step() call (DeepSpeed's own style calls step() after
every backward, so a window may span several step() calls); ``pending`` counts micro-batches not yet
applied by an update.
"""
from __future__ import annotations

from typing import NamedTuple

PASS = "pass"  # let step() run as DeepSpeed would: nothing to add
FLUSH = "flush"  # close the window: reduce what a boundary backward would have, then step


class StepPlan(NamedTuple):
    action: str  # PASS or FLUSH
    micro_batches: int  # micro-batches the window closes (0 when the step applies nothing new)
    reason: str


class MicroStepCounter:
    """Counts one engine's micro-steps and plans its step() calls."""

    __slots__ = ("since_step", "pending", "divisors", "boundary_in_window", "windows", "flushes",
                 "steps", "backwards")

    def __init__(self) -> None:
        self.since_step = 0  # backward() calls since the last step()
        self.pending = 0  # micro-batches whose gradients no update has applied yet
        self.divisors: set[int] = set()  # what the library divided each pending loss by (1: nothing)
        self.boundary_in_window = False  # a backward of this window already ran as an explicit boundary
        self.windows = 0  # windows closed by an update
        self.flushes = 0  # of which zerofix closed (the reduction ran at step())
        self.steps = 0
        self.backwards = 0

    # ------------------------------------------------------------------ events
    def backward(self, *, explicit_boundary: bool | None, divisor: int = 1) -> bool:
        """Record a finished backward. ``explicit_boundary``: what the user set with
        ``set_gradient_accumulation_boundary`` for it (None: nothing, zerofix decides at step()).
        ``divisor``: what the library divided this loss by. Returns True when an explicit boundary
        backward of the same window came before it: DeepSpeed ZeRO-1/2 has then already consumed the
        earlier gradients and will discard them (the user's flags contradict the loop)."""
        discarding = self.boundary_in_window
        self.backwards += 1
        self.since_step += 1
        self.pending += 1
        self.divisors.add(divisor)
        if explicit_boundary:
            self.boundary_in_window = True
        return discarding

    def plan_step(self, *, explicit_boundary: bool | None, schedule_boundary: bool) -> StepPlan:
        """Decide what a step() call does. ``explicit_boundary``: the user's flag now;
        ``schedule_boundary``: whether DeepSpeed's own micro-step schedule puts a boundary here."""
        if explicit_boundary is not None:
            return StepPlan(PASS, self.pending if explicit_boundary else 0,
                            "the user set the boundary explicitly")
        if self.pending == 0:
            return StepPlan(PASS, 0, "no backward since the last update")
        if self.since_step >= 2:
            return StepPlan(FLUSH, self.pending, f"{self.since_step} backwards before this step()")
        if schedule_boundary:
            return StepPlan(FLUSH, self.pending, "DeepSpeed's schedule ends the window here")
        return StepPlan(PASS, 0, "DeepSpeed's schedule: a non-boundary micro-step")

    def stepped(self, plan: StepPlan) -> None:
        """Record that step() ran as planned."""
        self.steps += 1
        self.since_step = 0
        if plan.micro_batches:
            self.windows += 1
            self.flushes += plan.action == FLUSH
            self.pending = 0
            self.divisors = set()
            self.boundary_in_window = False

    # ------------------------------------------------------------------ questions
    def scale_mismatch(self, micro_batches: int) -> int | None:
        """The divisor the library applied to a window of ``micro_batches`` micro-batches, when it
        divided (by more than 1) and by something else than that count; else None."""
        divisors = self.divisors - {1}
        if len(divisors) == 1:
            (divisor,) = divisors
            if divisor != micro_batches:
                return divisor
        return None

    def as_dict(self) -> dict:
        return {"backwards": self.backwards, "steps": self.steps, "windows": self.windows,
                "flushed": self.flushes, "pending": self.pending}
