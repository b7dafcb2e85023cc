"""The shared micro-step counter: one per training engine (or accelerator), pure Python.

It answers the one question DeepSpeed answers wrongly for manual accumulation: *is this step() the end
of an accumulation window, and which micro-batches does it close?* DeepSpeed decides the boundary when
each backward starts, from its own schedule (``(micro_steps + 1) % gradient_accumulation_steps``) or
from an explicit ``set_gradient_accumulation_boundary``; a loop that calls backward N times and then
step() once cannot be described that way. That decision is made here, from counts alone, so it is
unit-tested without a distributed run.

Do no harm: where DeepSpeed's schedule describes the loop (one backward per step(), DeepSpeed's own
documented style, at any config GAS), every backward runs exactly as DeepSpeed schedules it (FOLLOW)
and step() passes through; the reduction happens where DeepSpeed puts it, so everything a user reads
between backward and step() is DeepSpeed's own. The counter takes over (LAZY: every backward runs as
non-boundary, the window is reduced at step() or at the first gradient read) only once it has *seen*
a second backward before a step(), on an engine where DeepSpeed gets that wrong: ZeRO-1/2 at config
GAS=1 (from deepspeed 0.17.6), every stage at config GAS > 1. ZeRO-0/3 at config GAS=1, and ZeRO-1/2
before 0.17.6, accumulate correctly by themselves.

The first window of a manual loop may have run its first backward as DeepSpeed's boundary (config GAS=1)
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

    ``upstream_accumulates``: the engine applies several backwards per step() correctly by itself
    (ZeRO-0/3 at config GAS=1; ZeRO-1/2 too before deepspeed 0.17.6), so a manual loop is followed."""

    __slots__ = ("upstream_accumulates", "manual", "since_step", "pending", "unreduced", "reduced",
                 "divisors", "boundary_in_window", "windows", "flushes", "read_flushes", "steps",
                 "backwards")

    def __init__(self, upstream_accumulates: bool = False) -> None:
        self.upstream_accumulates = upstream_accumulates
        self.manual = False  # a second backward before a step() was seen: zerofix finds the boundaries
        self.since_step = 0  # backward() calls since the last step()
        self.pending = 0  # micro-batches whose gradients no update has applied yet
        self.unreduced = 0  # lazy backwards since the window's last reduction
        self.reduced = False  # the engine holds this window's reduced gradients (a boundary ran)
        self.divisors: set[int] = set()  # what the library divided each pending loss by (1: nothing)
        self.boundary_in_window = False  # a backward of this window already ran as an explicit boundary
        self.windows = 0  # windows closed by an update
        self.flushes = 0  # of which zerofix reduced (at step() or at a read)
        self.read_flushes = 0  # reductions a gradient read asked for before step()
        self.steps = 0
        self.backwards = 0

    # ------------------------------------------------------------------ events
    def plan_backward(self, *, explicit_boundary: bool | None) -> BackwardPlan:
        """Before a backward runs: FOLLOW DeepSpeed, or run it LAZY (non-boundary)."""
        if explicit_boundary is not None:  # the user decides (open-instruct's fix, Accelerate's wrapper)
            return BackwardPlan(FOLLOW, False)
        if not self.manual and self.since_step >= 1 and not self.upstream_accumulates:
            self.manual = True  # several backwards per step(): DeepSpeed's schedule cannot describe it
        if not self.manual:
            return BackwardPlan(FOLLOW, False)
        return BackwardPlan(LAZY, self.reduced)

    def backward(self, *, explicit_boundary: bool | None, mode: str = FOLLOW, boundary: bool = False,
                 divisor: int = 1) -> bool:
        """Record a finished backward. ``explicit_boundary``: what the user set with
        ``set_gradient_accumulation_boundary`` for it (None: nothing); ``mode``: how it ran;
        ``boundary``: whether DeepSpeed ran it as a boundary (reduced the window); ``divisor``: what
        the library divided this loss by. Returns True when an explicit boundary backward of the same
        window came before it: DeepSpeed ZeRO-1/2 has then already consumed the earlier gradients and
        will discard them (the user's flags contradict the loop)."""
        discarding = self.boundary_in_window
        self.backwards += 1
        self.since_step += 1
        self.pending += 1
        self.divisors.add(divisor)
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
        if not self.manual:
            return StepPlan(PASS, self.pending if schedule_boundary else 0, "DeepSpeed's own schedule")
        if self.since_step < 2 and not schedule_boundary:
            return StepPlan(PASS, 0, "DeepSpeed's schedule: a non-boundary micro-step")
        if self.unreduced == 0:
            return StepPlan(STEP, self.pending, "a gradient read reduced the window already")
        return StepPlan(FLUSH, self.pending, f"{self.since_step} backwards before this step()")

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
            self.pending = 0
            self.unreduced = 0
            self.reduced = False
            self.divisors = set()
            self.boundary_in_window = False

    # ------------------------------------------------------------------ questions
    def needs_read_flush(self) -> bool:
        """Whether a gradient read now would see un-reduced (per-rank, partial) gradients."""
        return self.unreduced > 0

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
        return {"mode": "manual" if self.manual else "follow", "backwards": self.backwards,
                "steps": self.steps, "windows": self.windows, "flushed": self.flushes,
                "read_flushes": self.read_flushes, "pending": self.pending}
