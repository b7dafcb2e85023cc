"""Applies and reverts catalogue entries.

One fix goes through: selection (``patch(fixes, exclude)``) -> post-import hook on each defining
submodule -> version guard (PEP 440, prereleases allowed, ``zerofix.versions``) -> structural guard (the
implementation's ``structural_check``, whose contract is ``zerofix.fixes.contract``) -> wrapt
``FunctionWrapper`` installed at class level on every target, all or nothing -> ``zerofix.applied`` records
the fix as applied, with what its check found for the wrappers. An identity registry keyed on ``(owner, name)`` keeps the raw ``vars(owner)[name]`` so that
``unpatch()`` puts back exactly what was there (or removes the attribute if it was inherited).

Several fixes may wrap the same attribute (the DeepSpeed fixes all need ``DeepSpeedEngine.backward``).
Their wrappers are layers around the one raw value, innermost first in catalogue order, and the chain is
rebuilt from the raw value whenever a fix comes or goes: fixes layer, in any patch/unpatch order.
"""
from __future__ import annotations

import importlib
import sys
import threading
from typing import NamedTuple

from zerofix import applied, catalogue, importhooks, paths, trainer_report
from zerofix._log import log
from zerofix.errors import StrictError
from zerofix.fixes import contract
from zerofix.versions import installed_version, version_in_range

# States of a fix, as reported by status().
APPLIED = "applied"
PENDING = "pending-import"
NOT_INSTALLED = "not-installed"
NOT_AFFECTED = "not-affected"
TARGET_CHANGED = "target-changed"
DISABLED = "disabled"
FAILED = "failed"
INACTIVE = "inactive"  # in range, but patch() was not asked for it


__all__ = ["StrictError", "Record", "patch", "unpatch", "status", "apply", "select", "is_applied",
           "installed_version", "version_in_range"]


class Record(NamedTuple):
    id: str
    state: str
    dist: str
    installed: str | None
    affected: str
    reason: str
    runtime: tuple = ()  # what an applied fix saw while running (e.g. one dict per DeepSpeed engine)

    def to_dict(self) -> dict:
        return dict(self._asdict())


class _Slot:
    """One attribute zerofix wraps: the raw value it found and the fixes layered on it."""

    __slots__ = ("owner", "name", "raw", "had_own", "layers", "current")

    def __init__(self, owner, name):
        self.owner, self.name = owner, name
        self.had_own = name in vars(owner)
        # what vars(owner)[name] held, or the inherited value the layers wrap
        self.raw = vars(owner)[name] if self.had_own else getattr(owner, name)
        self.layers: dict[str, object] = {}  # fix id -> wrapper function
        self.current = None  # the outermost FunctionWrapper zerofix set, None when nothing is set

    def rebuild(self) -> None:
        """Set owner.name to raw wrapped by every layer (catalogue order, innermost first), or put raw
        back when no layer is left."""
        if not self.layers:
            if self.had_own:
                setattr(self.owner, self.name, self.raw)
            elif vars(self.owner).get(self.name) is self.current:
                delattr(self.owner, self.name)
            self.current = None
            return
        import wrapt

        value = self.raw
        for fix_id in catalogue.ids():
            if fix_id in self.layers:
                value = wrapt.FunctionWrapper(value, self.layers[fix_id])
        setattr(self.owner, self.name, value)
        self.current = value


_lock = threading.RLock()
_enabled: dict[str, bool] = {}  # fix id -> strict
_records: dict[str, Record] = {}
_installed: dict[str, list[_Slot]] = {}  # fix id -> the attributes it wraps
_registry: dict[tuple[int, str], _Slot] = {}  # (id(owner), name) -> the raw value and its layers
_reload_watched: set[tuple[str, str]] = set()  # (fix id, module) with a reload hook


# ----------------------------------------------------------------------------- guards
def _version_record(fix: catalogue.Fix, version: str | None) -> Record | None:
    """The record for a fix whose version guard says no, else None."""
    if version is None:
        return Record(fix.id, NOT_INSTALLED, fix.dist, None, fix.affected, f"{fix.dist} is not installed")
    if not version_in_range(version, fix.affected):
        fixed = f"; fixed upstream in {fix.fixed_in}" if fix.fixed_in else ""
        return Record(
            fix.id, NOT_AFFECTED, fix.dist, version, fix.affected,
            f"{fix.dist} {version} is outside the affected range {fix.affected}{fixed}",
        )
    return None


def _resolve(target: catalogue.Target):
    """(owner, name, current value) of a dotted attribute inside its module."""
    owner = sys.modules[target.module]
    *path, name = target.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


# ----------------------------------------------------------------------------- selection
def select(fixes=None, exclude=(), opt_in=()) -> tuple[list[str], set[str]]:
    """Validate ids before anything is touched: unknown ids raise ValueError listing the valid ones.
    ``fixes=None`` means every default entry plus the ``opt_in`` ones; a list means exactly those."""
    valid = catalogue.ids()
    exclude = () if exclude is None else exclude
    opt_in = () if opt_in is None else opt_in
    if isinstance(fixes, str) or isinstance(exclude, str) or isinstance(opt_in, str):
        raise TypeError("fixes, exclude and opt_in take a list of fix ids, e.g. patch(fixes=['%s'])" % valid[0])
    wanted = [f.id for f in catalogue.FIXES if not f.opt_in or f.id in opt_in] if fixes is None \
        else list(dict.fromkeys(fixes))
    excluded = set(exclude)
    unknown = (set(wanted) | excluded | set(opt_in)) - set(valid)
    if unknown:
        raise catalogue.unknown_ids_error(unknown)
    return [f for f in wanted if f not in excluded], excluded


def _opt_in_reason(fix: catalogue.Fix) -> str:
    """Why an opt-in entry is not applied, and how to name it (status() says it before and after patch())."""
    return (f"opt-in, not applied unless named: {fix.opt_in}. Enable it with zerofix.patch(opt_in=['{fix.id}']) "
            f"or ZEROFIX_OPT_IN={fix.id}")


def patch(fixes=None, exclude=(), *, opt_in=(), strict: bool = False) -> None:
    """Enable fixes (every default entry, plus the ``opt_in`` ones, when ``fixes`` is None). Fixes whose
    modules are imported are applied now, the others when their defining submodule is imported. Calling it
    again is a no-op for enabled fixes, except that an explicit ``exclude`` wins over an earlier patch() or
    the environment: those fixes are unpatched. Returns nothing: status() would read package metadata, which
    start-up must not pay for. ``strict`` comes resolved: the package face and ``activation`` read
    ``ZEROFIX_STRICT``."""
    selected, excluded = select(fixes, exclude, opt_in)
    with _lock:
        for fix_id in [f for f in catalogue.ids() if f in excluded and f in _enabled]:
            _disable(fix_id)
        for fix in catalogue.FIXES:
            if fix.id in _enabled:
                continue
            if fix.id not in selected:
                why = ("excluded" if fix.id in excluded else _opt_in_reason(fix) if fix.opt_in and fixes is None
                       else "not selected")
                _records[fix.id] = Record(fix.id, DISABLED, fix.dist, None, fix.affected, why)
                continue
            _enabled[fix.id] = strict
            _records[fix.id] = Record(
                fix.id, PENDING, fix.dist, None, fix.affected,
                "applies when " + " and ".join(fix.modules) + " is imported",
            )
            for module in fix.modules:
                importhooks.when_imported(module, lambda m, fix_id=fix.id: _on_import(fix_id, m.__name__))
                if (fix.id, module) not in _reload_watched:  # once: patch/unpatch cycles add no twin
                    _reload_watched.add((fix.id, module))
                    importhooks.when_reloaded(module, lambda m, fix_id=fix.id: _on_reload(fix_id))
        if _enabled:  # the run's own log says what zerofix does (zerofix.trainer_report)
            trainer_report.register(status)


def _on_import(fix_id: str, module: str | None = None) -> None:
    """A target module finished importing: apply the fix once all its modules are complete. A module
    still executing its body (``transformers.trainer`` importing ``accelerate``, whose hook fires first)
    is not: its own hook fires when it is done."""
    fix = catalogue.by_id(fix_id)
    if all(_complete(m) or m == module for m in fix.modules):
        apply(fix)


def _on_reload(fix_id: str) -> None:
    """``importlib.reload`` re-ran a target module: its classes are new objects, the wrapped ones are gone
    from its namespace. Drop the stale layers and apply the fix again to what the module defines now."""
    with _lock:
        if fix_id not in _enabled or fix_id not in _installed:
            return
        for slot in reversed(_installed.pop(fix_id)):
            _remove_layer(slot, fix_id)
        applied.mark_removed(fix_id)
    log("info", "%s: a target module was reloaded; applying again", fix_id)
    apply(catalogue.by_id(fix_id))


def _complete(name: str) -> bool:
    mod = sys.modules.get(name)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def apply(fix: catalogue.Fix) -> Record:
    """Apply one enabled fix whose modules are all imported. Never half-applied; never raises except
    StrictError in strict mode."""
    with _lock:
        if fix.id not in _enabled:  # hooks outlive unpatch(); the live flag decides
            return _records.get(fix.id)
        if fix.id in _installed:
            return _records[fix.id]
        strict = _enabled[fix.id]
        version = None
        try:
            version = installed_version(fix.dist)
            record = _version_record(fix, version) or _install(fix, version)
        except Exception as exc:  # noqa: BLE001 - contained and reported, see status()
            record = Record(fix.id, FAILED, fix.dist, version, fix.affected, f"{type(exc).__name__}: {exc}")
        _records[fix.id] = record
        level = {APPLIED: "info", TARGET_CHANGED: "warning", FAILED: "warning"}.get(record.state, "debug")
        log(level, "%s: %s (%s)", fix.id, record.state, record.reason)
        if strict and record.state in (TARGET_CHANGED, FAILED):
            raise StrictError(f"zerofix fix {fix.id} was not applied: {record.reason} "
                              "(unset ZEROFIX_STRICT to skip it with a warning instead)")
        return record


def _install(fix: catalogue.Fix, version: str) -> Record:
    impl = importlib.import_module(fix.implementation)
    broken = contract.violations(impl, fix.id)
    if broken:
        raise TypeError("; ".join(broken))  # zerofix's own defect: reported as failed
    wrappers = {}
    for target in fix.targets:
        module, function = contract.split_wrapper(target.wrapper)
        wrappers[target] = getattr(importlib.import_module(module), function)
    resolved = {}
    for target in fix.targets:
        try:
            resolved[target] = _resolve(target)
        except AttributeError as exc:
            if target.optional:  # not in this release: nothing there to wrap
                continue
            return Record(fix.id, TARGET_CHANGED, fix.dist, version, fix.affected,
                          f"{target.module}.{target.attribute} not found ({exc})")
    # The check sees what upstream defined, also under another fix's layer.
    originals = {}
    for target, (owner, name, value) in resolved.items():
        slot = _registry.get((id(owner), name))
        originals[target.attribute] = value if slot is None else slot.raw
    check = impl.structural_check(fix.id, originals)
    if not isinstance(check, contract.Check):
        raise TypeError(f"{fix.implementation}.structural_check returned {type(check).__name__}, not a Check")
    if check.drift:
        return Record(fix.id, TARGET_CHANGED, fix.dist, version, fix.affected, check.drift)

    done: list[_Slot] = []
    applied.mark_applied(fix.id, check.facts)  # before the first wrapper can run
    try:
        for target, (owner, name, _) in resolved.items():
            slot = _registry.get((id(owner), name))
            if slot is None:
                slot = _registry[(id(owner), name)] = _Slot(owner, name)
            slot.layers[fix.id] = wrappers[target]
            done.append(slot)
            slot.rebuild()
    except BaseException:
        for slot in reversed(done):  # all or nothing
            _remove_layer(slot, fix.id)
        applied.mark_removed(fix.id)
        raise
    _installed[fix.id] = done
    where = ", ".join(f"{t.module}.{t.attribute}" for t in resolved)
    return Record(fix.id, APPLIED, fix.dist, version, fix.affected,
                  f"{fix.dist} {version} is in the affected range {fix.affected}; wrapped {where}")


def _remove_layer(slot: _Slot, fix_id: str) -> None:
    slot.layers.pop(fix_id, None)
    slot.rebuild()
    if not slot.layers:
        _registry.pop((id(slot.owner), slot.name), None)


def unpatch(fixes=None) -> None:
    """Disable fixes (all by default, opt-in ones included) and restore exactly what was there before."""
    selected, _ = select(catalogue.ids() if fixes is None else fixes)
    with _lock:
        for fix_id in selected:
            _disable(fix_id)
            _records.pop(fix_id, None)
        if not _enabled:
            trainer_report.unregister()


def _disable(fix_id: str) -> None:
    _enabled.pop(fix_id, None)
    for slot in reversed(_installed.pop(fix_id, [])):
        _remove_layer(slot, fix_id)
    applied.mark_removed(fix_id)
    module = sys.modules.get(catalogue.by_id(fix_id).implementation)
    reset = getattr(module, "reset_runtime", None)
    if reset is not None and not any(applied.is_applied(other) for other in module.FIX_IDS):
        reset()


# ----------------------------------------------------------------------------- status
class Status(list):
    """status()'s records: a list, shown one fix a line (its repr was one 4 KB line; issue 42)."""

    def __repr__(self) -> str:
        return "\n".join(f"{r.id}: {r.state} ({r.dist} {r.installed or '-'})" for r in self)


def status() -> list[Record]:
    """One record per catalogue entry. Version facts are computed here, lazily, so that patch() at
    interpreter start-up costs no metadata lookup."""
    out = []
    with _lock:
        for fix in catalogue.FIXES:
            record = _records.get(fix.id)
            if record is None or record.state in (PENDING, DISABLED):
                version = installed_version(fix.dist)
                guard = _version_record(fix, version)
                if guard is not None and (record is None or record.state == PENDING):
                    record = guard
                elif record is None:
                    enable = _opt_in_reason(fix) if fix.opt_in else "enable with zerofix.patch() or ZEROFIX=1"
                    record = Record(fix.id, INACTIVE, fix.dist, None, fix.affected,
                                    f"{fix.dist} {version} is in the affected range {fix.affected}; {enable}")
                record = record._replace(installed=version)
            elif record.state == APPLIED:
                details = getattr(sys.modules.get(fix.implementation), "runtime_details", None)
                if details is not None:
                    record = record._replace(runtime=tuple(details()))
                declined = paths.not_covered(fix.id)
                if declined:  # the paths it stood aside on in this process (zerofix.paths)
                    record = record._replace(reason=f"{record.reason}; not covered: {', '.join(declined)} (stood "
                                             "aside there, upstream's behaviour unchanged)")
            out.append(record)
    return Status(out)


is_applied = applied.is_applied
