"""The contract between the catalogue, ``patching`` and an implementation module (``Fix.implementation``).

An implementation module implements one or more catalogue entries and provides:

``FIX_IDS: tuple[str, ...]``
    the catalogue ids it implements; each of them names this module as its ``implementation`` (a test
    holds both directions).
``structural_check(fix_id, targets) -> Check``
    called once per application, before anything is wrapped, with ``targets`` mapping each found target's
    dotted attribute (``"Trainer.training_step"``) to the value upstream defined (under any other fix's
    layer). It reads, never runs, upstream code. ``Check(drift=...)`` says how the target differs from the
    release that was measured (the fix is then skipped as ``target-changed``); ``Check(facts=...)`` is what
    the wrappers need from the target (a parameter's position, a signature), handed to them through
    ``zerofix.applied.facts(fix_id)`` instead of module globals.
``runtime_details() -> list[dict]`` (optional)
    what an applied fix saw while running, one dict per object it manages, for ``zerofix.status()``.
``acted_in(fix_id, trainer_state) -> str | None`` (required where the entry has ``acts_when``)
    what the entry did in the Trainer run whose ``TrainerState`` this is, in words, or None where that run never
    used what the entry fixes: the Trainer's log names it only then (``zerofix.trainer_report``).
``reset_runtime() -> None`` (optional)
    forget what ``runtime_details`` lists; called when the module's last applied entry is removed, so that an
    application starts with nothing seen (a process that trains many times, as ``zerofix check``'s sessions
    do, would otherwise list every earlier run's objects).

The wrappers themselves are named by the catalogue's ``Target.wrapper`` as ``"module:function"`` (wrapt's
signature ``(wrapped, instance, args, kwargs)``), so entries that share a mechanism share its functions
without a module that only forwards to them. This module imports nothing from zerofix: ``patching`` and the
fixes both depend on it, it depends on neither.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Protocol, runtime_checkable

_NO_FACTS = MappingProxyType({})


class Check(NamedTuple):
    """The outcome of a structural check: ``drift`` None means the target is the one measured broken."""

    drift: str | None = None
    facts: Mapping = _NO_FACTS


def drifted(why: str) -> Check:
    return Check(drift=why)


def found(**facts) -> Check:
    return Check(facts=MappingProxyType(facts))


@runtime_checkable
class Implementation(Protocol):
    FIX_IDS: tuple[str, ...]

    def structural_check(self, fix_id: str, targets: Mapping[str, Callable]) -> Check: ...


def violations(module, fix_id: str | None = None) -> list[str]:
    """How ``module`` breaks the contract (empty when it meets it), for ``patching`` and the contract test."""
    name = getattr(module, "__name__", repr(module))
    out = []
    ids = getattr(module, "FIX_IDS", None)
    if not (isinstance(ids, tuple) and ids and all(isinstance(i, str) for i in ids)):
        out.append(f"{name} has no FIX_IDS tuple naming the catalogue ids it implements")
    elif fix_id is not None and fix_id not in ids:
        out.append(f"{name} implements {', '.join(ids)}, not {fix_id}")
    if not callable(getattr(module, "structural_check", None)):
        out.append(f"{name} has no structural_check(fix_id, targets) -> Check")
    for optional in ("runtime_details", "reset_runtime", "acted_in"):
        value = getattr(module, optional, None)
        if value is not None and not callable(value):
            out.append(f"{name}.{optional} is not callable")
    return out


def split_wrapper(reference: str) -> tuple[str, str]:
    """``"zerofix.fixes.x:function"`` -> ("zerofix.fixes.x", "function"); ValueError for anything else."""
    module, sep, function = reference.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"Target.wrapper {reference!r} is not 'module:function'")
    return module, function
