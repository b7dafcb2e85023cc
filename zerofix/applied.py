"""Which fixes are applied in this process, and what each one's structural check found.

A leaf. ``patching`` writes it (when a fix's wrappers are installed, and when they are removed); the fixes
read it: a wrapper that must know whether a sibling entry is applied (the Trainer's three scaling entries,
the DeepSpeed accumulator) asks ``is_applied``, and a wrapper that needs what its structural check read from
the target (a parameter's position, a signature) asks ``facts``. Nothing here imports another zerofix module.
"""
from __future__ import annotations

from types import MappingProxyType

_facts: dict = {}  # fix id -> read-only mapping of what its structural check found


def is_applied(fix_id: str) -> bool:
    return fix_id in _facts


def facts(fix_id: str):
    """What the applied fix's structural check found (read-only). KeyError when the fix is not applied."""
    return _facts[fix_id]


def mark_applied(fix_id: str, found=None) -> None:
    _facts[fix_id] = MappingProxyType(dict(found or {}))


def mark_removed(fix_id: str) -> None:
    _facts.pop(fix_id, None)
