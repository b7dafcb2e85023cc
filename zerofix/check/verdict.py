"""What a scenario's two runs mean: ``ok``, ``fixed by <fix>``, ``WRONG`` or ``failed``. Pure Python.

A run's *outcome* is its comparison with the single-process reference (``ratio``, ``cosine``, ``rel_err``),
or ``{"error": text}`` when it crashed. A run is right when its worst relative error is within the
scenario's tolerance. The verdict:

- ``ok``: the patched run is right, and so is the unpatched one (or there is no unpatched run);
- ``fixed by <ids>``: the unpatched run is wrong, the patched run is right, and catalogue fixes that
  concern this scenario were applied in the patched run;
- ``WRONG``: the patched run is wrong, or the runs differ while no fix was applied: a deviation that no
  catalogue entry explains. A known upstream problem zerofix does not fix yet is still ``WRONG``, with
  a note saying what it is;
- ``failed``: the scenario could not be run (a timeout, a crash of the whole job).
"""
from __future__ import annotations

from typing import NamedTuple

from zerofix.versions import installed_version, version_in_range

TOLERANCE = 1e-4  # fp32 runs against a float64 reference are within ~3e-7; every bug measured is >= 0.3


class Known(NamedTuple):
    """A deviation measured and understood, that no catalogue entry fixes (yet): it annotates a WRONG row."""

    scenarios: tuple[str, ...]  # row names (a trailing "*" matches a prefix)
    requires: tuple[tuple[str, str], ...]  # (dist, PEP 440 specifier) that must all hold
    note: str


# A deviation measured without a catalogue entry yet is listed here until it has one (the last three notes went
# with deepspeed-output-hook-division, accelerate-deepspeed-no-sync and deepspeed-bf16-loss-scale).
KNOWN: tuple[Known, ...] = ()


def is_right(outcome: dict | None, tolerance: float = TOLERANCE) -> bool:
    return outcome is not None and "error" not in outcome and outcome["rel_err"] <= tolerance


def verdict(unpatched: dict | None, patched: dict | None, applied: list[str],
            tolerance: float = TOLERANCE) -> tuple[str, str]:
    """(status, text): status is ``ok``, ``fixed``, ``WRONG`` or ``failed``; ``text`` is what the table prints.
    ``unpatched`` is None for a scenario with nothing to patch (an API); ``applied``: the fixes of the
    catalogue concerning this scenario that the patched run applied."""
    if patched is None:
        return "failed", "failed"
    if not is_right(patched, tolerance):
        return "WRONG", "WRONG"
    if unpatched is None or is_right(unpatched, tolerance):
        return "ok", "ok"
    if applied:
        return "fixed", "fixed by " + " + ".join(applied)
    return "WRONG", "WRONG"  # wrong unpatched, right patched, nothing applied: not reproducible


def known_note(scenario: str, versions: dict | None = None) -> str | None:
    """The note of a known deviation for this row on the installed (or given) versions, if any."""
    def version(dist):
        return (versions or {}).get(dist) or installed_version(dist)

    for known in KNOWN:
        names = any(scenario == s or (s.endswith("*") and scenario.startswith(s[:-1])) for s in known.scenarios)
        if names and all(version(d) is not None and version_in_range(version(d), spec) for d, spec in known.requires):
            return known.note
    return None


def exit_code(statuses) -> int:
    """0 when every scenario that ran is ``ok`` or ``fixed`` (skipped ones do not count), else 1."""
    return 0 if all(s in ("ok", "fixed", "skipped") for s in statuses) else 1
